"""Step-gate variants for A/B runs of ``evals/bench_e2e.py`` (never in the product):
``+pin16`` / ``+pin32`` / ``+pin64`` on a ``ddtree-auto`` run applies :func:`apply_pinned_gate`,
``+maxprior`` :func:`apply_max_prior_gate`, ``+nocut`` :func:`apply_no_device_cut`, in
the run's process before its engine starts.

**No device cut.** In the V2-Lite-shaped sweep (H100, 1k, after the start-up timing
fix) auto at batch 1 settled on arm 32 and verified 22 nodes a round on average: the
device's per-round choice (``BudgetPolicy.choose_in_graph``, expected tokens from the
drafter's own probabilities) cut below the arm, and its trees committed 4.24 tokens
against 4.51 for a fixed B = 16. ``ddtree-auto+nocut`` keeps the policy's side effects
but every round's choice is B, so the verify shape is the gate's arm (its measured
rates) and nothing below it.
In the next sweep (same setup, one command beside AR, the chain and B = 64) auto was
0.74 / 0.99 / 0.73 / 0.63 / 0.70 / 0.70x the best other run at batch 1-64 and
``+nocut`` 0.89 / 0.82 / 0.82 / 0.71 / 0.75 / 0.65x: mixed, one repeat, and both
measured before the start-up attention table became a request's share of a batch's
launch (it had counted a lone launch's latency once a request). The cut's loss at
batch 1 came from the rank oracle's drafter probabilities, which promised 2.72 tokens at
B = 64 where its trees committed 4.88 (the embedded drafter: 4.51 / 4.09); the oracle is
now fitted to the embedded drafter's calibration (``evals/e2e_oracle.py``). Rerun with
it (one command, H100): auto 704 / 1,548 / 2,592 / 4,095 / 4,423 / 4,552 tokens/s at
batch 1 / 4 / 8 / 16 / 32 / 64, ``+nocut`` 675 / 1,550 / 2,079 / 3,991 / 4,452 / 6,275:
still mixed (the batch-64 gap is where each gate settled, arm 0 against 4), and both
lose most at the steps that prefill a refill (their host time: the tree kernel's launch
a layer; taking short extends through it as well did not shorten those steps).

**Largest-arm prior.** In the H100 batch sweep (cells of about 100-140 steps) auto
settled on smaller trees from batch 4 up (2-4 drafts at batch 64) while a fixed B = 64
was the fastest method at every batch: a new bucket starts on the nearest bucket's
settled arm, and the few probes of a short cell left the larger arms untimed (8 timed
steps at batch 64, none of arms 16-64). ``ddtree-auto+maxprior`` starts every new bucket
on the largest arm within the cap instead: from there the smaller arms' committed
tokens come from the same trees (the walk's arm counters), so only their step times
need probes.

**Pinned gate.** In the batch sweep at batch 1 the gate's arms 4-32 measured residuals
1.1-1.7 ms above arms 64 and 0 within one cell of a few seconds, and fixed budgets' steps
cost about the same: either the host's speed drifted between the arms' turns, or a step
of ``auto`` at a verify shape below its maximum (drafts cut per step,
``vllm_ddtree.verify.shape.truncate_drafts``) costs more than the same shape run as a
fixed budget. ``ddtree-auto+pin32`` against ``ddtree-32`` (and ``+pin16`` against
``ddtree-16``), in lockstep, tells which: the gate still times and counts steps and
holds its decisions as the product gate does, but every decision is the pinned arm
(the largest arm at most the pin and the batch schedule's cap).
"""

from __future__ import annotations

_PINNED: dict[str, object] = {}


def apply_pinned_gate(pin: int) -> None:
    """Patch ``SpeculationGate`` in this process (idempotent): every decision is the
    largest arm at most ``pin`` and the step's cap (0 where none is); the bucket's
    statistics, timing and counters are kept as the product gate keeps them."""
    import bisect

    from vllm_ddtree.budget import gate as gate_module

    gate_cls = gate_module.SpeculationGate
    if _PINNED:
        return
    _PINNED.update(_choose=gate_cls._choose)

    def pinned_choose(self, num_reqs, contexts, cap, columns) -> int:
        if cap <= 0:
            return 0
        stats = self.bucket(num_reqs, cap)
        stats.decisions += 1
        # no speculative arm within the cap: plain decoding, as the product gate does
        arm = self.arms[bisect.bisect_right(self.arms, min(pin, cap)) - 1]
        stats.settled = self._index[arm]
        # rated as the product gate rates, so that the decision holds as long
        self.rates(stats, num_reqs, columns, bisect.bisect_right(self.arms, cap))
        return arm

    gate_cls._choose = pinned_choose


_MAX_PRIOR: dict[str, object] = {}


def apply_max_prior_gate() -> None:
    """Patch ``SpeculationGate._opening_arm`` in this process (idempotent): a new
    bucket settles on the largest arm at most its cap (every arm: no cap), whatever the
    other buckets settled on; the rest of the gate is the product's."""
    from vllm_ddtree.budget import gate as gate_module

    gate_cls = gate_module.SpeculationGate
    if _MAX_PRIOR:
        return
    _MAX_PRIOR.update(_opening_arm=gate_cls._opening_arm)
    gate_cls._opening_arm = lambda self, home, cap: self._largest_arm(cap)


def remove_max_prior_gate() -> None:
    """Undo :func:`apply_max_prior_gate`."""
    from vllm_ddtree.budget import gate as gate_module

    for name, fn in _MAX_PRIOR.items():
        setattr(gate_module.SpeculationGate, name, fn)
    _MAX_PRIOR.clear()


def remove_pinned_gate() -> None:
    """Undo :func:`apply_pinned_gate`."""
    from vllm_ddtree.budget import gate as gate_module

    for name, fn in _PINNED.items():
        setattr(gate_module.SpeculationGate, name, fn)
    _PINNED.clear()


_NO_CUT: dict[str, object] = {}


def apply_no_device_cut() -> None:
    """Patch ``BudgetPolicy.choose`` / ``choose_in_graph`` in this process (idempotent):
    the policy runs as in the product (its base-time EMA, its recorded attention), then
    the round's choice is overwritten with B (device ops only, so a captured graph
    replays it)."""
    from vllm_ddtree.budget.policy import BudgetPolicy

    if _NO_CUT:
        return
    _NO_CUT.update(choose=BudgetPolicy.choose, choose_in_graph=BudgetPolicy.choose_in_graph)
    choose, choose_in_graph = BudgetPolicy.choose, BudgetPolicy.choose_in_graph

    def full_choose(self, scores, context_lens):
        return choose(self, scores, context_lens).clone().fill_(self.max_budget)

    def full_choose_in_graph(self, scores, context_lens, row_of_sample, idx_stride):
        return choose_in_graph(self, scores, context_lens, row_of_sample,
                               idx_stride).fill_(self.max_budget)

    BudgetPolicy.choose = full_choose
    BudgetPolicy.choose_in_graph = full_choose_in_graph


def remove_no_device_cut() -> None:
    """Undo :func:`apply_no_device_cut`."""
    from vllm_ddtree.budget.policy import BudgetPolicy

    for name, fn in _NO_CUT.items():
        setattr(BudgetPolicy, name, fn)
    _NO_CUT.clear()
