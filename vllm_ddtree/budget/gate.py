"""``ddtree_budget: "auto"``'s b = 0: speculate in the next step, or decode plainly?

The host decides at each ``propose``, before the drafter's block pass, whether the next
step verifies trees (b >= 1, chosen on the device after the pass) or runs as plain
decoding (b = 0: one verify row a request, no block pass). The design and its reasons
are in ``vllm_ddtree.budget.policy``'s docstring; this module holds the pieces:

* :class:`StepCostModel`: a step's GPU time by batch size, measured at start-up on the
  target's own kernels and graphs: the verify forward by total rows (the target's FULL
  graphs of every verify shape at several request counts), the drafter's block pass by
  requests (its FULL graphs), and the tree / plain verify attention per request, layer
  and context (the tree kernel at 1 and ``1 + b`` active rows).
* :class:`SpeculationGate`: the decision. It compares the modeled tokens per second of
  the two kinds of step at this batch size and context, each corrected by what steps of
  that kind actually took (GPU-timeline intervals between steps, read from CUDA events
  only once they completed: no host sync), with the acceptance measured on recent trees
  (DDTree's device counters, copied to pinned memory without a sync). Hysteresis keeps
  it from flapping; short probes of the other kind measure what it has not seen.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from vllm_ddtree.budget.step_cost import StepCostModel

__all__ = ["GateStats", "SpeculationGate", "batch_bucket"]

# Rate margin before the gate switches between speculative and plain steps.
HYSTERESIS = 0.05
# Steps of the other kind a probe runs: the middle ones are intervals of that kind alone.
PROBE_STEPS = 3
# A probe runs only where the other kind is predicted within this fraction of the
# current one (or where it was never measured at all); the scheduled probes of
# speculation from plain decoding run regardless (its acceptance goes stale).
PROBE_RATIO = 0.8
# Steps between probes of one batch-size bucket: doubles after each probe up to the max.
PROBE_INTERVAL = 32
MAX_PROBE_INTERVAL = 1024
# Samples of the current kind in a bucket before the other kind is first probed there.
CALIBRATION_SAMPLES = 2
EMA_WEIGHT = 0.2
# Residual samples a kind's estimate is the (lower) median of: one interval stretched by
# a host stall (a GC pause, a log flush) must not move it.
RESIDUAL_WINDOW = 5
# Intervals longer than this are an idle engine, not a step.
MAX_STEP_SECONDS = 2.0
# Committed tokens per tree before any tree was measured (neutral: the gate then keeps
# speculating until it has seen trees).
PRIOR_COMMITTED = 2.0
# Timing marks kept at most (the host runs a step or two ahead of the GPU).
_MARKS = 64
_ACCEPT_SLOTS = 8


def batch_bucket(num_reqs: int) -> int:
    """``ceil(log2(num_reqs))``: batches of 1, 2, 3-4, 5-8, ... share statistics."""
    return max(0, math.ceil(math.log2(max(1, num_reqs))))


@dataclass
class _Ema:
    value: float = 0.0
    count: int = 0

    def add(self, sample: float, weight: float = EMA_WEIGHT) -> None:
        self.value = sample if self.count == 0 else (1 - weight) * self.value + weight * sample
        self.count += 1


@dataclass
class _Median:
    """The lower median of the last ``RESIDUAL_WINDOW`` samples (of two: the smaller).
    An EMA carried one stalled interval for tens of steps, long enough to make the
    stalled kind look slower than the probe threshold (``PROBE_RATIO``), after which
    it was never run, so never measured, again."""

    samples: deque = field(default_factory=lambda: deque(maxlen=RESIDUAL_WINDOW))
    value: float = 0.0
    count: int = 0

    def add(self, sample: float) -> None:
        self.samples.append(sample)
        self.count += 1
        ordered = sorted(self.samples)
        self.value = ordered[(len(ordered) - 1) // 2]


@dataclass
class GateStats:
    """What the gate measured in one batch-size bucket."""

    plain: _Median = field(default_factory=_Median)  # residual seconds of plain steps
    spec: _Median = field(default_factory=_Median)  # residual seconds of speculative steps
    committed: _Ema = field(default_factory=_Ema)  # tokens committed per tree
    shape: int = 0  # drafts per request of the last speculative step (0: none yet)
    steps: int = 0  # decisions since the last probe
    interval: int = PROBE_INTERVAL

    def residual(self, spec: bool) -> _Median:
        return self.spec if spec else self.plain


@dataclass
class _Mark:
    """One step's start on the GPU timeline and what the step was."""

    event: Any
    num_reqs: int
    shape: int
    uniform: bool
    drafted: bool | None = None
    model: float | None = None


class _HostEvent:
    """A host-clock stand-in for a CUDA event (CPU runs): complete at once."""

    def __init__(self) -> None:
        self.t = time.perf_counter()

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: _HostEvent) -> float:
        return 1e3 * (end.t - self.t)


class SpeculationGate:
    """The host's per-step choice between a speculative and a plain step.

    Args:
        model: the start-up cost model.
        device: the runner's device (CUDA: timing events and pinned copies).
        make_event: ``() -> event`` with ``record()`` (optional), ``query()`` and
            ``elapsed_time(end) -> ms``; default CUDA timing events on CUDA, the host
            clock elsewhere. Tests pass a fake clock.
    """

    def __init__(self, model: StepCostModel, device: torch.device | str,
                 make_event: Callable[[], Any] | None = None) -> None:
        self.model = model
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        if make_event is None:
            make_event = ((lambda: torch.cuda.Event(enable_timing=True)) if cuda
                          else _HostEvent)
        self.make_event = make_event
        self.stats: dict[int, GateStats] = {}
        self.speculating = True
        self.probe_left = 0
        self.marks: deque[_Mark] = deque()
        # accepted-depth counters, copied each propose: (accepted_sum, trees) per slot
        self._accept_host = torch.zeros(_ACCEPT_SLOTS, 2, dtype=torch.int64, pin_memory=cuda)
        self._accept_events: list[Any] = [None] * _ACCEPT_SLOTS
        self._accept_reqs = [0] * _ACCEPT_SLOTS
        self._accept_pending: deque[int] = deque()
        self._accept_slot = 0
        self._accept_last: tuple[int, int] | None = None

    # -- feeds --------------------------------------------------------------------------

    def set_graph_costs(self, verify_by_rows: dict[int, float],
                        draft_by_reqs: dict[int, float]) -> None:
        """The start-up graph timings (``StepCostModel.set_graph_costs``), logged."""
        import logging

        self.model.set_graph_costs(verify_by_rows, draft_by_reqs)
        logging.getLogger("vllm.ddtree.budget_gate").info(
            "DDTree auto budget, b = 0 gate: verify forward by rows (us) %s; drafter block "
            "pass by requests (us) %s",
            {n: round(1e6 * t, 1) for n, t in sorted(verify_by_rows.items())},
            {r: round(1e6 * t, 1) for r, t in sorted(draft_by_reqs.items())})

    def bucket(self, num_reqs: int) -> GateStats:
        return self.stats.setdefault(batch_bucket(num_reqs), GateStats())

    def step_started(self, num_reqs: int, shape: int, uniform: bool) -> None:
        """At ``execute_model``: mark the step's start on the stream (a timing event)."""
        event = self.make_event()
        record = getattr(event, "record", None)
        if record is not None:
            record()
        self.marks.append(_Mark(event, num_reqs, shape, uniform))
        if shape > 0:
            self.bucket(num_reqs).shape = shape
        while len(self.marks) > _MARKS:
            self.marks.popleft()

    def record_acceptance_(self, accepted_sum: torch.Tensor, num_trees: torch.Tensor,
                           num_reqs: int) -> None:
        """At ``propose``, after the step's walk: start the copy of DDTree's cumulative
        counters (int64 ``[1]`` each, on the device) to pinned memory. No host sync."""
        slot = self._accept_slot
        self._accept_slot = (slot + 1) % _ACCEPT_SLOTS
        if slot in self._accept_pending:  # the host ran _ACCEPT_SLOTS steps ahead
            self._accept_pending.remove(slot)
        row = self._accept_host[slot]
        row[0:1].copy_(accepted_sum.reshape(1), non_blocking=True)
        row[1:2].copy_(num_trees.reshape(1), non_blocking=True)
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        self._accept_events[slot] = event
        self._accept_reqs[slot] = num_reqs
        self._accept_pending.append(slot)

    def _drain_acceptance(self) -> None:
        """Fold every completed counter copy into its bucket's committed-tokens EMA."""
        while self._accept_pending:
            slot = self._accept_pending[0]
            event = self._accept_events[slot]
            if event is not None and not event.query():
                break
            self._accept_pending.popleft()
            accepted, trees = (int(x) for x in self._accept_host[slot].tolist())
            last, self._accept_last = self._accept_last, (accepted, trees)
            if last is None or trees <= last[1]:
                continue
            new_trees = trees - last[1]
            self.bucket(self._accept_reqs[slot]).committed.add(
                1.0 + (accepted - last[0]) / new_trees)

    def _drain_marks(self) -> None:
        """Fold every step whose end (the next step's start) completed into its bucket's
        residual: measured interval minus the modeled GPU time of what it ran. Steps
        that mix kinds (a tree verified without a new draft, or the reverse), hold a
        prefill, or span an idle engine are left out."""
        while len(self.marks) >= 2:
            first, second = self.marks[0], self.marks[1]
            if first.drafted is None or not second.event.query():
                break
            self.marks.popleft()
            seconds = first.event.elapsed_time(second.event) / 1e3
            spec = first.shape > 0
            if (first.model is None or not first.uniform or spec != first.drafted
                    or not 0 < seconds <= MAX_STEP_SECONDS):
                continue
            self.bucket(first.num_reqs).residual(spec).add(seconds - first.model)

    # -- the decision -------------------------------------------------------------------

    def _nearest(self, num_reqs: int, pick: Callable[[GateStats], _Ema | _Median | int]):
        """``pick`` of this bucket's stats if measured there, else of the nearest bucket
        that has it (None: nowhere)."""
        home = batch_bucket(num_reqs)
        for b in sorted(self.stats, key=lambda b: (abs(b - home), b)):
            value = pick(self.stats[b])
            if (value if isinstance(value, int) else value.count) > 0:
                return value
        return None

    def rates(self, num_reqs: int, contexts: np.ndarray, cap: int, max_budget: int,
              columns: np.ndarray) -> tuple[float, float]:
        """Predicted tokens per second a request of ``(plain, speculative)`` steps at
        this batch size and these contexts, the speculative one at the verify shape last
        used near this batch size (at most ``cap``); ``columns``: the contexts'
        ``StepCostModel.attention_columns``."""
        shape = self._nearest(num_reqs, lambda s: s.shape) or max_budget
        shape = min(shape, cap)
        plain_res = self._nearest(num_reqs, lambda s: s.plain)
        spec_res = self._nearest(num_reqs, lambda s: s.spec)
        committed = self._nearest(num_reqs, lambda s: s.committed)
        t_plain = self.model.step_seconds(num_reqs, contexts, 0, False, columns)
        t_plain += plain_res.value if plain_res else 0.0
        t_spec = self.model.step_seconds(num_reqs, contexts, shape, True, columns)
        t_spec += spec_res.value if spec_res else 0.0
        e = committed.value if committed else PRIOR_COMMITTED
        return 1.0 / max(t_plain, 1e-6), e / max(t_spec, 1e-6)

    def decide(self, num_reqs: int, contexts: np.ndarray, cap: int, max_budget: int,
               this_shape: int) -> bool:
        """At ``propose``: whether the next step speculates (the drafter's block pass
        runs now). ``this_shape``: the drafts this step verified (its mark's shape).
        Records the step's modeled time for its interval. No host sync."""
        self._drain_acceptance()
        mark = None
        for m in self.marks:  # steps that reached no propose (no forward): left out
            if m.drafted is None:
                m.drafted, mark = False, m
        if mark is not None:
            mark.drafted = None
        columns = self.model.attention_columns(contexts)
        draft = self._choose(num_reqs, contexts, cap, max_budget, columns)
        if mark is not None:
            mark.drafted = draft
            mark.model = self.model.step_seconds(mark.num_reqs, contexts, mark.shape, draft,
                                                 columns)
        self._drain_marks()
        return draft

    def _choose(self, num_reqs: int, contexts: np.ndarray, cap: int, max_budget: int,
                columns: np.ndarray) -> bool:
        if cap <= 0:
            return False
        if self.probe_left > 0:
            self.probe_left -= 1
            return not self.speculating
        stats = self.bucket(num_reqs)
        plain, spec = self.rates(num_reqs, contexts, cap, max_budget, columns)
        if self.speculating:
            self.speculating = spec * (1 + HYSTERESIS) >= plain
        else:
            self.speculating = spec > plain * (1 + HYSTERESIS)
        current, other = (spec, plain) if self.speculating else (plain, spec)
        ratio = other / current
        stats.steps += 1
        measured_here = stats.residual(self.speculating).count >= CALIBRATION_SAMPLES
        other_here = stats.residual(not self.speculating).count > 0
        other_anywhere = self._nearest(num_reqs, lambda s: s.residual(not self.speculating))
        probe = False
        if measured_here and not other_here and (
                other_anywhere is None or ratio >= PROBE_RATIO):
            probe = True
        elif measured_here and stats.steps >= stats.interval and (
                ratio >= PROBE_RATIO or not self.speculating):
            # (also where this bucket never measured the other kind, only others did)
            # Plain steps measure no acceptance: a low figure from trees of other
            # requests would keep speculation predicted far slower, never probed.
            probe = True
            stats.interval = min(2 * stats.interval, MAX_PROBE_INTERVAL)
        if probe:
            stats.steps = 0
            self.probe_left = PROBE_STEPS - 1
            return not self.speculating
        return self.speculating
