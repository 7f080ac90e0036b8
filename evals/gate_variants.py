"""Step-gate variants for A/B runs of ``evals/bench_e2e.py`` (never in the product):
``+pin16`` / ``+pin32`` on a ``ddtree-auto`` run applies :func:`apply_pinned_gate` in the
run's process before its engine starts.

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


def remove_pinned_gate() -> None:
    """Undo :func:`apply_pinned_gate`."""
    from vllm_ddtree.budget import gate as gate_module

    for name, fn in _PINNED.items():
        setattr(gate_module.SpeculationGate, name, fn)
    _PINNED.clear()
