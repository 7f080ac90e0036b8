"""``ddtree_budget: "auto"``'s step gate: which *arm* the next step runs.

Arm 0 is a plain decoding step (one verify row a request, no drafter block pass); arm
``s > 0``, one of the run's verify shapes, caps the next step's verify shape at ``s``
(the device still picks ``b <= s`` after the block pass, ``vllm_ddtree.verify.shape``).
The host picks the arm at each ``propose``, before the block pass, for the next step.
The design and its reasons are in ``vllm_ddtree.budget.policy``'s docstring; this
module holds the decision, :class:`SpeculationGate`:

* per batch-size bucket (:func:`batch_bucket`) and arm it keeps a *residual* (the
  bucket's level plus the arm's offset from paired samples, ``gate_stats``), what the
  arm's steps took on the GPU timeline (CUDA events at the start of a timed step and of
  the next, read once completed: no host sync) beyond the start-up model's time of that step
  (``vllm_ddtree.budget.step_cost.StepCostModel`` at the shape the step verified, which
  the device's budget or the schedule may have cut below the arm: an arm above the
  device's choice is then predicted no faster than the step it runs; a prefill's tokens
  beside the decodes as more rows of the forward; a step holding a prefill counts only
  where at least a quarter of the bucket's steps hold one and its prefill's attention
  is typical of theirs), and the tokens committed per tree (DDTree's device counters, copied
  to pinned memory and read once the copy completed; a step's trees cut to each smaller
  arm's size give that arm's figure too: the walk's arm counters);
* the predicted rate of arm ``a`` is ``committed(a) / (model(a) + residual(a))`` at this
  batch size and these contexts; each bucket keeps a settled arm and moves to its best
  measured arm when that is predicted ``HYSTERESIS`` faster (once measured on
  ``SWITCH_SAMPLES`` intervals; before, it is probed again);
* short probes (``PROBE_STEPS`` steps of another arm; which one: ``gate_probes``)
  measure the arms next to the settled one, the arm beyond a neighbour that measured
  faster, plain decoding (every
  speculative arm pays the drafter's whole pass, so the small arms can all be slower
  than both plain decoding and a larger arm: a search through neighbours stops short of
  it), the way back from plain decoding, and, on a doubling schedule, every neighbour
  again (acceptance changes with the requests) and plain decoding where the settled arm
  is predicted at most ``PLAIN_PROBE_MARGIN`` faster; a probe of a larger arm whose
  trees, cut to the settled arm, accepted no draft runs again (``blank_probe_retry``).

A decision holds for several steps where the gate's own host time would otherwise
show in the step's (:meth:`SpeculationGate.decide`): at batch 1 the step's time is the
host's, and a decision (draining the counters and the timing events, rating every arm)
costs about a twentieth of it. Between decisions the gate only counts the steps; the
trees of the held steps are counted together at the next decision (DDTree's counters
are cumulative), and the step whose propose decides is timed: the one after the hold,
or one whose batch left the hold's bucket or cap (its start ends the hold,
:meth:`SpeculationGate.step_started`).

Where the host's step outlasts the GPU's (a small target at batch 1 or 32-64), the
model's difference between speculative arms is hidden up to the GPU's idle time after
the settled arm's steps (an event at the end of ``propose``, :meth:`step_finished`):
offsets shrink toward that prediction (``GateStats.residuals``), and the device's cut
of each round's trees counts it hidden too (``device_hidden``, ``BudgetPolicy.hide_``).

Known limitation: the arm is chosen with the batch of the ``propose`` that chooses it:
a batch that jumps every few steps between far-apart buckets (say 3 and 200 requests)
runs each step with the previous step's bucket's decision."""

from __future__ import annotations

import bisect
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vllm_ddtree.budget.gate_probes import (
    BLANK_PROBE_RETRIES,
    PROBE_INTERVAL,
    PROBE_STEPS,
    blank_probe_retry,
    probe_target,
    restart_interval,
)
from vllm_ddtree.budget.gate_stats import (
    Ema,
    GateStats,
    batch_bucket,
    bucket_batches,
    bucket_bounds,
    follow_settled_arm,
    hidden_seconds,
    idle_engine,
)
from vllm_ddtree.budget.step_cost import StepCostModel

__all__ = ["GateStats", "SpeculationGate", "batch_bucket"]

# Under "vllm." so that the lines reach vLLM's log handler.
logger = logging.getLogger("vllm.ddtree.budget_gate")

# Predicted rate margin before a bucket moves to another arm: it mostly guards the
# committed figures (at 5 % a host-bound batch 64 stayed on 32 drafts where 64 committed
# 6 % more at about the same step).
HYSTERESIS = 0.02
# Residual samples an arm needs before a bucket moves to it; one predicted faster with
# fewer is probed again first (a probe of plain decoding from a speculative arm, or the
# reverse, gives two clean intervals, and the lower median of two is their minimum:
# under noise that made such arms look faster than they are).
SWITCH_SAMPLES = 3
# Intervals longer than this are an idle engine, not a step.
MAX_STEP_SECONDS = 2.0
# Committed tokens per tree of an arm before any of its trees (and of no arm near it)
# was counted in the bucket.
PRIOR_COMMITTED = 2.0
# The settled arms are logged when one changes, at most this often.
LOG_SECONDS = 60.0
# A decision holds for as many steps as keep the gate's host time per decision at most
# this share of those steps' time (measured decision time over the settled arm's
# predicted step), up to MAX_HOLD_STEPS; probes and calibration decide every step.
DECISION_HOST_SHARE = 0.01
MAX_HOLD_STEPS = 16
# Timing marks kept at most (the host runs a step or two ahead of the GPU).
_MARKS = 64
_ACCEPT_SLOTS = 8


@dataclass
class _Mark:
    """One step's start on the GPU timeline and what the step was."""

    event: Any
    num_reqs: int
    shape: int  # drafts each request verified
    prefill_reqs: int  # requests of the step that are not decodes (verify_shape.prefill_load)
    prefill_tokens: int  # their scheduled tokens
    prefill_pairs: int  # query-key pairs of their attention
    arm: int  # the arm chosen for it (its shape's cap)
    drafted: bool | None = None  # its propose ran the block pass (None: not decided yet)
    model: float | None = None  # modeled seconds of the step at its shape
    timed: bool = True  # False: it only closes the timed step before it
    end: Any = None  # event after its propose's last launch (step_finished)


@dataclass
class _Probe:
    bucket: int
    arm: int  # index
    left: int  # decisions it still takes


class _HostEvent:
    """A host-clock stand-in for a CUDA event (CPU runs): complete at once."""

    def __init__(self) -> None:
        self.t = time.perf_counter()

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: _HostEvent) -> float:
        return 1e3 * (end.t - self.t)


class SpeculationGate:
    """The host's per-step choice of arm: plain decoding (0) or a cap on the verify shape.

    Args:
        model: the start-up cost model.
        device: the runner's device (CUDA: timing events and pinned copies).
        arms: the verify shapes a step may take (``StepPlan.shapes``); those above 0 are
            the speculative arms, 0 (plain decoding) is always one.
        make_event: ``() -> event`` with ``record()`` (optional), ``query()`` and
            ``elapsed_time(end) -> ms``; default CUDA timing events on CUDA, the host
            clock elsewhere. Tests pass a fake clock.
        host_clock: ``() -> seconds`` timing the gate's own decisions (how many steps
            one holds); tests pass a fixed one (0 s: every step decides).
    """

    def __init__(self, model: StepCostModel, device: torch.device | str, arms: Sequence[int],
                 make_event: Callable[[], Any] | None = None,
                 host_clock: Callable[[], float] = time.perf_counter) -> None:
        bad = [a for a in arms if not isinstance(a, (int, np.integer)) or a < 0]
        if bad or not any(a > 0 for a in arms):
            raise ValueError(f"arms must be verify shapes (integers >= 0), at least one "
                             f"above 0, got {list(arms)}")
        self.model = model
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        if make_event is None:
            make_event = ((lambda: torch.cuda.Event(enable_timing=True)) if cuda
                          else _HostEvent)
        self.make_event = make_event
        self.arms = sorted({0, *(int(a) for a in arms)})
        self._arm_values = np.asarray(self.arms, dtype=np.int64)
        self._index = {a: i for i, a in enumerate(self.arms)}
        self.stats: dict[int, GateStats] = {}
        self.arm = self.arms[-1]  # the last decision: the cap of the next step's shape
        self.probe: _Probe | None = None
        # fp64 [arms <= cap]: each arm's predicted step at the last rated decision
        self._arm_seconds: np.ndarray | None = None
        self.marks: deque[_Mark] = deque()
        self.clock: Callable[[], float] = time.monotonic  # for the log's pace
        self._logged_at: float | None = None
        self._log_pending = False
        # accepted-depth counters, copied at each decision: (accepted_sum, trees, then what
        # the trees would have accepted cut to each speculative arm) per slot
        self._accept_host = torch.zeros(_ACCEPT_SLOTS, 2 + len(self.arms) - 1,
                                        dtype=torch.int64, pin_memory=cuda)
        self._accept_events: list[Any] = [None] * _ACCEPT_SLOTS
        self._accept_reqs = [0] * _ACCEPT_SLOTS
        self._accept_arms = [0] * _ACCEPT_SLOTS
        self._accept_pending: deque[int] = deque()
        self._accept_slot = 0
        self._accept_last: list[int] | None = None
        # the last propose's counters, copied at the next decision
        self._accept_source: tuple[Any, ...] | None = None
        # the decision in force: proposes it still holds, and what ends it early
        self.host_clock = host_clock
        self._hold = 0
        self._held = 0  # proposes held since the last decision
        self._hold_key: tuple[int, int] = (-1, -1)  # (bucket, cap)
        self._hold_batches = (0, -1)  # the bucket's batch sizes (gate_stats.bucket_bounds)
        self._decision_seconds = Ema()
        self._close_next = False  # the next step's start closes a timed step
        self.device_hidden = (0, 0.0)  # (settled arm, hidden s): BudgetPolicy.hide_'s
        self._finishing: _Mark | None = None  # the timed step step_finished ends

    @property
    def speculative_arms(self) -> list[int]:
        """The arms above 0 (verify shapes), in order: the sizes the walk's arm
        counters cut each tree to (``DDTreeRuntimeState.enable_arm_counters_``)."""
        return self.arms[1:]

    @property
    def holding(self) -> bool:
        """Whether the next :meth:`decide` keeps the held decision (after this step's
        :meth:`step_started`, which ends a hold that the batch left); the speculator then
        skips the round's copy of the device's choice and its wall time sample (one a
        decision serves ``VerifyShapeChooser`` and ``BudgetPolicy.observe_round``)."""
        return self._hold > 0

    # -- feeds --------------------------------------------------------------------------

    def set_graph_costs(self, verify_by_rows: dict[int, float],
                        draft_by_reqs: dict[int, float]) -> None:
        """The start-up graph timings (``StepCostModel.set_graph_costs``), logged."""
        self.model.set_graph_costs(verify_by_rows, draft_by_reqs)
        logger.info(
            "DDTree auto budget, step gate: verify forward by rows (us) %s; drafter block "
            "pass by requests (us) %s",
            {n: round(1e6 * t, 1) for n, t in sorted(verify_by_rows.items())},
            {r: round(1e6 * t, 1) for r, t in sorted(draft_by_reqs.items())})

    def bucket(self, num_reqs: int, cap: int | None = None) -> GateStats:
        """The statistics of ``num_reqs``'s bucket; a new bucket settles where the
        nearest bucket did, else on the largest arm <= ``cap`` (all arms: None)."""
        home = batch_bucket(num_reqs)
        stats = self.stats.get(home)
        if stats is None:
            stats = self.stats[home] = GateStats(len(self.arms),
                                                 self._opening_arm(home, cap), PROBE_INTERVAL)
        return stats

    def _opening_arm(self, home: int, cap: int | None) -> int:
        """The arm (index) a new bucket ``home`` settles on: the nearest bucket's, else
        :meth:`_largest_arm`."""
        if self.stats:
            near = min(self.stats, key=lambda b: (abs(b - home), b))
            return self.stats[near].settled
        return self._largest_arm(cap)

    def _largest_arm(self, cap: int | None) -> int:
        """The index of the largest arm <= ``cap`` (all arms: None)."""
        return bisect.bisect_right(self.arms, self.arms[-1] if cap is None else cap) - 1

    def settled_arms(self) -> dict[int, int]:
        """``{bucket: arm}``: the arm each batch-size bucket has settled on, for the
        buckets the gate decided in (where the schedule's budget is 0 it never does: the
        timings of those plain steps alone open a bucket)."""
        return {b: self.arms[s.settled] for b, s in sorted(self.stats.items()) if s.decisions}

    def forget(self) -> None:
        """Drops every bucket's measurements and the probe in force, as at start-up
        (between workloads, e.g. after a benchmark's warm-up on random prompts)."""
        self.stats.clear()
        self.probe, self._hold, self._arm_seconds = None, 0, None

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """What each batch-size bucket measured and chose, as plain data for reports
        (``evals/e2e_sweep.py``): ``{batches: {"settled": arm, "arms": [{"arm",
        "chosen" (steps it ran, held ones included), "residual_ms", "residual_samples",
        "committed" (tokens per tree as counted, before ``follow_settled_arm``; 1 for
        plain decoding), "committed_samples"}, ...]}}``, for the buckets the gate decided in
        and their arms timed or chosen (not those known only from the arm counters)."""
        out = {}
        for b, stats in sorted(self.stats.items()):
            if not stats.decisions:  # only the schedule's plain steps: not decided here
                continue
            arms = []
            for i, arm in enumerate(self.arms):
                if not (stats.chosen[i] or stats.residual_count[i]):
                    continue
                arms.append({
                    "arm": arm, "chosen": int(stats.chosen[i]),
                    "residual_ms": round(1e3 * float(stats.residual_seconds[i]), 4),
                    "residual_samples": int(stats.residual_count[i]),
                    "committed": 1.0 if i == 0 else round(float(stats.committed_tokens[i]), 4),
                    "committed_samples": int(stats.committed_count[i])})
            out[bucket_batches(b)] = {"settled": self.arms[stats.settled], "arms": arms}
        return out

    def step_started(self, num_reqs: int, shape: int, prefill_reqs: int = 0,
                     prefill_tokens: int = 0, prefill_pairs: int = 0,
                     cap: int | None = None) -> None:
        """At ``execute_model``: mark the step's start on the stream (a timing event)
        where the gate times it (its propose decides) or it ends a timed step.
        ``shape``: the drafts each request verifies; ``prefill_reqs`` of the
        ``num_reqs`` requests are not decodes and take ``prefill_tokens`` tokens, whose
        attention spans ``prefill_pairs`` query-key pairs
        (``vllm_ddtree.verify.shape.prefill_load``); ``cap``: the batch schedule's
        budget for this batch (None: the held decision's). A batch that left the held
        decision's bucket or cap ends the hold here, so the step whose propose then
        decides is timed: under continuous batching around a bucket's edge the batch
        crosses it every few steps, and each crossing cost the decision its sample."""
        if self._hold > 0:
            lo, hi = self._hold_batches
            if not lo <= num_reqs <= hi or (cap is not None and cap != self._hold_key[1]):
                self._hold = 0
        timed = self._hold == 0  # this step's propose decides: time the step
        if not (timed or self._close_next):
            return
        self._close_next = timed
        event = self.make_event()
        record = getattr(event, "record", None)
        if record is not None:
            record()
        mark = _Mark(event, num_reqs, shape, prefill_reqs, prefill_tokens, prefill_pairs,
                     self.arm)
        if not timed:
            mark.drafted, mark.timed = False, False
        self.marks.append(mark)
        while len(self.marks) > _MARKS:
            self.marks.popleft()

    def step_finished(self) -> None:
        """At the end of ``propose`` (after its last launch): mark where the timed step's
        GPU work ends, for the GPU's idle time until the next start. No host sync."""
        mark, self._finishing = self._finishing, None
        if mark is not None:
            mark.end = self.make_event()
            record = getattr(mark.end, "record", None)
            if record is not None:
                record()

    def record_acceptance_(self, accepted_sum: torch.Tensor, num_trees: torch.Tensor,
                           num_reqs: int, arm_accepted: torch.Tensor | None = None) -> None:
        """At ``propose``, after the step's walk: DDTree's cumulative counters (int64
        ``[1]`` each, on the device) and ``arm_accepted`` (int64 ``[A - 1]``,
        :attr:`speculative_arms`' order: the accepted nodes of every tree cut to each
        arm's size) when given, for :meth:`decide` to copy to pinned memory if it
        decides at this propose (the counters are cumulative: a copy at each decision
        counts the held steps' trees too). No host sync."""
        self._accept_source = (accepted_sum, num_trees, num_reqs, arm_accepted)

    def _copy_acceptance(self, mixed: bool = False) -> None:
        """Start the copy of the counters :meth:`record_acceptance_` took at this
        propose, if it took any; ``mixed``: the trees since the last copy came from
        another bucket or cap than this step's (a hold that the batch left), so they
        count nowhere. No host sync."""
        if self._accept_source is None:
            return
        accepted_sum, num_trees, num_reqs, arm_accepted = self._accept_source
        self._accept_source = None
        slot = self._accept_slot
        self._accept_slot = (slot + 1) % _ACCEPT_SLOTS
        if slot in self._accept_pending:  # the host ran _ACCEPT_SLOTS steps ahead
            self._accept_pending.remove(slot)
        row = self._accept_host[slot]
        row[0:1].copy_(accepted_sum.reshape(1), non_blocking=True)
        row[1:2].copy_(num_trees.reshape(1), non_blocking=True)
        if arm_accepted is not None:
            row[2:].copy_(arm_accepted, non_blocking=True)
        else:
            row[2:].fill_(-1)
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        self._accept_events[slot] = event
        self._accept_reqs[slot] = num_reqs
        # the arm these trees were cut to (0: counted nowhere)
        self._accept_arms[slot] = 0 if mixed else self.arm
        self._accept_pending.append(slot)

    def _drain_acceptance(self) -> None:
        """Fold every completed counter copy into its bucket's and arm's committed
        tokens per tree, and, with the arm counters, every smaller speculative arm's:
        what the same trees would have committed cut to that arm (paired with the
        settled arm's figure, where a probe's few trees met other requests)."""
        while self._accept_pending:
            slot = self._accept_pending[0]
            event = self._accept_events[slot]
            if event is not None and not event.query():
                break
            self._accept_pending.popleft()
            counts = self._accept_host[slot].tolist()
            last, self._accept_last = self._accept_last, counts
            arm = self._index.get(self._accept_arms[slot], 0)
            if last is None or counts[1] <= last[1] or arm == 0:
                continue
            new_trees = counts[1] - last[1]
            stats = self.bucket(self._accept_reqs[slot])
            stats.add_committed(arm, 1.0 + (counts[0] - last[0]) / new_trees, new_trees)
            if counts[2] < 0 or last[2] < 0:
                continue  # no arm counters in one of the two copies
            for smaller in range(1, arm):
                tokens = 1.0 + (counts[1 + smaller] - last[1 + smaller]) / new_trees
                stats.add_committed(smaller, tokens, new_trees)
                stats.add_reference_cut(arm, smaller, tokens, new_trees)

    def _drain_marks(self) -> None:
        """Fold every step whose end (the next step's start) completed into its bucket's
        residual of its arm: measured interval minus the modeled time of the step at the
        shape it verified, its prefill tokens as more forward rows. A step with a prefill
        counts where its prefill is typical of the bucket (:meth:`GateStats.
        typical_prefill`): under continuous batching at large batch nearly every step
        holds one, and their unmodeled part (the prefill's attention) is what each arm's
        steps pay there. Other prefills are left out, and where fewer than a quarter of
        the steps hold one, all are: a long prompt's chunks (their attention growing with
        the prompt) fill consecutive steps, more than a lower median of 15 samples holds,
        and (with each arm's own window, as the gate then kept) the bucket moved to a
        slower arm for thousands of steps. Steps that mix kinds
        (a tree verified without a new draft, or the reverse), have no decode, or span an
        idle engine (``gate_stats.idle_engine``) are left out."""
        while len(self.marks) >= 2:
            first, second = self.marks[0], self.marks[1]
            if first.drafted is None or not second.event.query():
                break
            self.marks.popleft()
            seconds = first.event.elapsed_time(second.event) / 1e3
            idle = None if first.end is None else first.end.elapsed_time(second.event) / 1e3
            if (first.model is None or not 0 < seconds <= MAX_STEP_SECONDS
                    or idle_engine(seconds, idle)):
                continue
            stats = self.bucket(first.num_reqs)
            typical = stats.typical_prefill(first.prefill_pairs if first.prefill_reqs else 0)
            spec = first.arm > 0
            if not typical or spec != first.drafted or spec != (first.shape > 0):
                continue
            stats.add_residual(self._index[first.arm], seconds - first.model)
            if spec and idle is not None:
                stats.add_slack(self._index[first.arm], idle)

    def _modeled_seconds(self, mark: _Mark, contexts: np.ndarray,
                         columns: np.ndarray) -> float | None:
        """The model's time of ``mark``'s step: its decodes at the shape they verified
        and, beside them, its prefill tokens as more rows of the forward
        (``StepCostModel.extra_rows_seconds``). None for a step without decodes."""
        decodes = mark.num_reqs - mark.prefill_reqs
        if decodes <= 0:
            return None
        seconds = self.model.step_seconds(decodes, contexts, mark.shape, mark.shape > 0,
                                          columns)
        return seconds + self.model.extra_rows_seconds(decodes * (1 + mark.shape),
                                                       mark.prefill_tokens)

    # -- the decision -------------------------------------------------------------------

    def rates(self, stats: GateStats, num_reqs: int, columns: np.ndarray,
              num_arms: int) -> np.ndarray:
        """fp64 ``[num_arms]``: predicted tokens per second a request of the first arms
        at this batch size, ``committed / (model + residual)`` (at least half the model;
        residuals: ``GateStats.hidden_residuals``; above the settled arm: scaled by
        ``gate_stats.follow_settled_arm``; without counted trees: the committed tokens of the
        nearest arm with some, else ``PRIOR_COMMITTED``); ``columns``: the contexts'
        ``StepCostModel.attention_columns``."""
        arms = self._arm_values[:num_arms]
        seconds = self.model.step_seconds_by_drafts(num_reqs, arms, columns)
        residuals = stats.hidden_residuals(seconds)
        # a residual far below zero (a stall in a few samples' level) must not make a
        # step free: no arm is predicted below half its model time
        seconds = np.maximum(seconds + residuals[:num_arms], 0.5 * seconds)
        self._arm_seconds = seconds
        committed = stats.committed_tokens[:num_arms].copy()
        committed[0] = 1.0  # a plain step commits one token a request
        follow_settled_arm(stats, committed, num_arms, SWITCH_SAMPLES)
        counted = stats.committed_count[:num_arms] > 0
        counted[0] = True
        if not counted.all():
            have = np.flatnonzero(counted[1:]) + 1
            missing = np.flatnonzero(~counted)
            if have.size == 0:
                committed[missing] = PRIOR_COMMITTED
            else:
                near = np.abs(missing[:, None] - have[None, :]).argmin(axis=1)
                committed[missing] = committed[have[near]]
        return committed / np.maximum(seconds, 1e-6)

    def decide(self, num_reqs: int, contexts: np.ndarray, cap: int) -> int:
        """At ``propose``: the next step's arm (0: plain decoding, the drafter's block
        pass does not run now; else a cap on its verify shape). ``contexts``: the
        requests' context lengths (host array); ``cap``: the batch schedule's budget for
        this batch (B without one). Records the step's modeled time for its interval.
        No host sync.

        While a decision holds (:meth:`_hold_steps`) and the batch stays in its bucket
        under the same cap, the arm is returned at once: nothing is drained, timed or
        rated."""
        key = (batch_bucket(num_reqs), cap)
        if self._hold > 0:
            if key == self._hold_key:
                self._hold -= 1
                self._held += 1
                # _accept_source stays: the counters are cumulative, and the next decision
                # copies them even where its own step verified no trees
                self.stats[key[0]].chosen[self._index[self.arm]] += 1
                return self.arm
            self._hold = 0
        start = self.host_clock()
        self._copy_acceptance(self._held > 0 and key != self._hold_key)
        self._held = 0
        self._drain_acceptance()
        mark = None
        for m in self.marks:  # steps that reached no propose (no forward): left out
            if m.drafted is None:
                m.drafted, mark = False, m
        if mark is not None:
            mark.drafted = None
        columns = self.model.attention_columns(contexts)
        self._arm_seconds = None
        arm = self._choose(num_reqs, contexts, cap, columns)
        stats = self.stats.get(key[0])
        self.device_hidden = (self.arms[stats.settled] if stats else 0, hidden_seconds(stats))
        if cap > 0 and stats is not None:  # the gate's steps by arm, for the report
            stats.chosen[self._index[arm]] += 1
            self._hold = self._hold_steps(stats, arm, self.host_clock() - start)
            self._hold_key, self._hold_batches = key, bucket_bounds(key[0])
        if mark is not None:
            mark.drafted = arm > 0
            if mark.arm in self._index:
                mark.model = self._modeled_seconds(mark, contexts, columns)
        self._finishing = mark
        self._drain_marks()
        self.arm = arm
        if self._log_pending:
            self._log_settled()
        return arm

    def _choose(self, num_reqs: int, contexts: np.ndarray, cap: int,
                columns: np.ndarray) -> int:
        if cap <= 0:
            self.probe = None
            return 0
        num_arms = bisect.bisect_right(self.arms, cap)  # arms <= cap, plain included
        home = batch_bucket(num_reqs)
        stats = self.bucket(num_reqs, cap)
        stats.decisions += 1
        stats.steps += 1
        probe = self.probe
        if probe is not None:
            self.probe = None
            if probe.bucket == home and probe.arm < num_arms:
                if probe.left > 1:
                    self.probe = _Probe(home, probe.arm, probe.left - 1)
                return self.arms[probe.arm]
        current = min(stats.settled, num_arms - 1)
        measured = stats.measured(num_arms)
        if not measured[current]:
            return self.arms[current]  # calibrating
        rates = self.rates(stats, num_reqs, columns, num_arms)
        restart_interval(stats, current)
        best = int(np.argmax(np.where(measured, rates, -np.inf)))
        target = None
        if (best != current and rates[best] >= rates[current] * (1 + HYSTERESIS)
                and stats.may_switch(best, self._arm_seconds)):
            if stats.residual_count[best] >= SWITCH_SAMPLES:
                current = stats.settled = best
                stats.refresh_residuals()
                if best == 0:
                    stats.stale_since = stats.decisions
                self._log_pending = True
            elif stats.decisions - stats.last_probe[best] > 2 * PROBE_STEPS:
                target = best  # confirm it first (its last probe's samples are in)
        retries = BLANK_PROBE_RETRIES
        if target is None:
            retry = blank_probe_retry(stats, current, num_arms)
            if retry is not None:
                target, retries = retry
        if target is None:
            target = probe_target(stats, current, rates, measured, num_arms)
        if target is None:
            return self.arms[current]
        self.probe = _Probe(home, target, PROBE_STEPS - 1)
        stats.blank_probe = (target, retries) if 0 < current < target else None
        stats.probed.add(target)
        stats.last_probe[target] = stats.decisions
        stats.probed_figure = None
        if stats.committed_count[target] > 0:
            stats.probed_figure = (target, float(stats.committed_tokens[target]))
        stats.reset_committed(target)  # its trees now replace the old figure
        return self.arms[target]

    def _hold_steps(self, stats: GateStats, arm: int, seconds: float) -> int:
        """The proposes after this one that keep ``arm`` (an arm's value) without
        deciding: enough that the decisions' host time (``seconds`` this one, averaged)
        is at most ``DECISION_HOST_SHARE`` of the steps' (``arm``'s predicted step at
        this decision), at most ``MAX_HOLD_STEPS - 1``; 0 for a probe and where the
        decision rated no arm (calibrating, a probe's last step)."""
        self._decision_seconds.add(seconds)
        if self.probe is not None or self._arm_seconds is None:
            return 0
        step = float(self._arm_seconds[self._index[arm]])
        steps = self._decision_seconds.value / (DECISION_HOST_SHARE * max(step, 1e-6))
        return int(min(max(math.ceil(steps), 1), MAX_HOLD_STEPS)) - 1

    def _log_settled(self) -> None:
        """The settled arms by batch size, at most once every ``LOG_SECONDS``."""
        now = self.clock()
        if self._logged_at is not None and now - self._logged_at < LOG_SECONDS:
            return
        self._logged_at, self._log_pending = now, False
        logger.info("DDTree auto budget: drafts per request by batch size (0: plain "
                    "decoding): %s", ", ".join(f"{bucket_batches(b)}: {a}"
                                               for b, a in self.settled_arms().items()))
