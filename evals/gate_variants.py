"""Step-gate variants for A/B runs of ``evals/bench_e2e.py`` (never in the product):
``+pairedgate`` on a ``ddtree-auto`` run applies :func:`apply_paired_gate`, ``+pin16`` /
``+pin32`` :func:`apply_pinned_gate`, in the run's process before its engine starts.

**Pinned gate.** In the batch sweep at batch 1 the gate's arms 4-32 measured residuals
1.1-1.7 ms above arms 64 and 0 within one cell of a few seconds, and fixed budgets' steps
cost about the same: either the host's speed drifted between the arms' turns, or a step
of ``auto`` at a verify shape below its maximum (drafts cut per step,
``vllm_ddtree.verify.shape.truncate_drafts``) costs more than the same shape run as a
fixed budget. ``ddtree-auto+pin32`` against ``ddtree-32`` (and ``+pin16`` against
``ddtree-16``), in lockstep, tells which: the gate still times and counts every step,
but every decision is the pinned arm (the largest arm at most the pin and the batch
schedule's cap).

**Paired residuals.** The product gate predicts each arm with the lower median of its own
last 15 step residuals (``vllm_ddtree.budget.gate.GateStats``). On a small target whose
steps wait on the host, the host's speed drifts over seconds, and the arms are timed at
different moments: in the batch sweep on an H100 the probed arms' residuals sat 1-5 ms
above the settled arm's where fixed budgets' steps cost about the same. The variant pairs
each interval of an arm other than the settled one with the median of the settled arm's
last ``PAIR_WINDOW`` intervals just before it, and predicts such an arm with the mean of
its own residual and the settled arm's plus the median of its pairings (drift common to
both cancels); when the bucket settles elsewhere the pairings move to the new settled
arm (differences of differences). In CPU simulations (``tests/test_budget_gate.py``'s
engine with acceptance noise) it was even with the product gate without drift, 1.3 %
ahead under a smooth (AR(1), sd 0.5) host drift, and 1-4 % behind at batch 64 under a
square-wave host speed: the shape of the real drift decides, hence the GPU A/B.
"""

from __future__ import annotations

from collections import deque
from statistics import median

import numpy as np

PAIR_WINDOW = 5
_ORIGINALS: dict[str, object] = {}
_PINNED: dict[str, object] = {}


class _Pairing:
    """One bucket's pairings: per arm the last ``RESIDUAL_WINDOW`` offsets against the
    settled arm, and the settled arm's latest residuals."""

    def __init__(self, num_arms: int, window: int, settled: int) -> None:
        self.window = window
        self.offsets = [deque(maxlen=window) for _ in range(num_arms)]
        self.recent: deque[float] = deque(maxlen=PAIR_WINDOW)
        self.reference = settled

    def rebase(self, new: int) -> None:
        """The settled arm became ``new``: offsets relative to it (or none, where it was
        never paired)."""
        old, base = self.reference, self.offsets[new]
        self.reference = new
        self.recent.clear()
        if not base:
            self.offsets = [deque(maxlen=self.window) for _ in self.offsets]
            return
        shift = median(base)
        for i, offsets in enumerate(self.offsets):
            if i not in (new, old):
                self.offsets[i] = deque((x - shift for x in offsets), maxlen=self.window)
        self.offsets[old] = deque((-x for x in base), maxlen=self.window)
        self.offsets[new] = deque(maxlen=self.window)


def apply_paired_gate() -> None:
    """Patch ``GateStats`` in this process (idempotent): residuals are also paired with
    the settled arm and the rates take the mean of both estimates."""
    from vllm_ddtree.budget import gate as gate_module

    stats_cls = gate_module.GateStats
    if _ORIGINALS:
        return
    _ORIGINALS.update(add_residual=stats_cls.add_residual,
                      predicted_residuals=stats_cls.predicted_residuals)
    add_residual = stats_cls.add_residual

    def pairing(stats) -> _Pairing:
        state = getattr(stats, "_pairing", None)
        if state is None:
            state = stats._pairing = _Pairing(len(stats.residuals),
                                              gate_module.RESIDUAL_WINDOW, stats.settled)
        if state.reference != stats.settled:
            state.rebase(stats.settled)
        return state

    def paired_add_residual(self, arm: int, seconds: float) -> None:
        add_residual(self, arm, seconds)
        state = pairing(self)
        if arm == state.reference:
            state.recent.append(seconds)
        elif state.recent:
            state.offsets[arm].append(seconds - median(state.recent))

    def paired_predicted_residuals(self, num_arms: int) -> np.ndarray:
        out = self.residual_seconds[:num_arms].copy()
        state = pairing(self)
        ref = state.reference
        if ref >= num_arms or self.residual_count[ref] == 0:
            return out
        for arm in range(num_arms):
            if arm != ref and state.offsets[arm]:
                paired = self.residual_seconds[ref] + median(state.offsets[arm])
                out[arm] = 0.5 * (out[arm] + paired)
        return out

    stats_cls.add_residual = paired_add_residual
    stats_cls.predicted_residuals = paired_predicted_residuals


def remove_paired_gate() -> None:
    """Undo :func:`apply_paired_gate`."""
    from vllm_ddtree.budget import gate as gate_module

    for name, fn in _ORIGINALS.items():
        setattr(gate_module.GateStats, name, fn)
    _ORIGINALS.clear()


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
        return arm

    gate_cls._choose = pinned_choose


def remove_pinned_gate() -> None:
    """Undo :func:`apply_pinned_gate`."""
    from vllm_ddtree.budget import gate as gate_module

    for name, fn in _PINNED.items():
        setattr(gate_module.SpeculationGate, name, fn)
    _PINNED.clear()
