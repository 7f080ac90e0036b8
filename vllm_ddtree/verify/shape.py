"""Adaptive verify shapes for ``ddtree_budget: "auto"``: how many rows the target runs.

Without them every round verifies ``1 + B`` rows per tree request and ``auto`` only
skips the inactive rows inside the tree attention; the target's GEMMs, lm_head and
sampling still pay for ``1 + B``. With ``ddtree_verify_shape: "adaptive"`` (the
default of ``auto`` at TP = 1) the runner verifies ``1 + s`` rows, ``s`` the smallest
candidate budget (``budget_policy.candidate_budgets``) that holds the budget the
device chose in the newest round whose choice has reached the host:

* the scheduler keeps scheduling (and allocating KV for) ``B`` drafts per request;
  the worker cuts each request's drafts to its first ``s`` before the runner builds
  the batch (:func:`truncate_drafts`, applied by ``vllm_ddtree.patches.verify_shapes``). The
  first ``s`` nodes are the budget-``s`` tree (nodes are ordered best-first and
  topologically, ``vllm_ddtree.tree.draft_tree``), and the verifier, the walk and the KV
  compaction already take trees cut to a prefix (the scheduler cuts drafts near
  ``max_model_len``);
* token accounting stays consistent on both sides: the scheduler advanced
  ``num_computed_tokens`` by ``1 + B`` and takes back ``B - a`` rejected drafts, the
  worker advanced ``1 + s`` and takes back ``s - a``; both end ``1 + a`` further;
* ``vllm_ddtree.patches.verify_shapes`` captures FULL CUDA graphs for every ``1 + s``, as vLLM
  does for its dynamic speculative decoding (``cudagraph_utils.py:196-220``).

The choice reaches the host without a sync: each ``propose`` copies ``b`` into a
pinned slot (non-blocking) and records the slot's event; at TP = 1 the host takes the
newest slot whose event has completed (``Event.query``, never a wait): usually the
round before the last one, since the host runs about one step ahead of the GPU. The
device still picks ``b`` every round and masks the rows past it, so a lagging shape
costs rows, never correctness. Where auto's step gate holds its decision
(``StepPlan.holding``) the speculator skips the copy: the held steps keep the shape of
the choice copied at the decision (and the held arm caps it).

Ranks of a tensor-parallel group must cut the same drafts (their collectives need
equal shapes), but could see different slots complete. With ``lag`` set (TP > 1)
every rank reads the choice of exactly ``lag`` rounds before (the ranks' choices are
equal: ``BudgetPolicy`` broadcasts the first rank's), waiting on that round's event if
it has not completed; with ``lag = 2`` it has, unless the host ran two rounds ahead of
the GPU.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import Any

import torch

from vllm_ddtree.budget.policy import candidate_budgets

__all__ = [
    "StepPlan",
    "VerifyShapeChooser",
    "auto_plain_steps",
    "step_shapes",
    "truncate_drafts",
    "prefill_load",
    "warm_up_batch",
]

# Ids of the requests vLLM V2's kernel warm-up creates (``warmup.py:224``).
WARMUP_PREFIX = "_warmup_"
# Pinned slots in flight; the host runs at most a step or two ahead of the GPU.
_SLOTS = 8


def auto_plain_steps(ddtree: Any, tensor_parallel_size: int,
                     data_parallel_size: int = 1) -> bool:
    """Whether ``ddtree_budget: "auto"`` may choose b = 0 (plain decoding steps): with
    adaptive verify shapes on one GPU (no data parallelism). Ranks of a parallel group
    would each time their own steps and could decide differently; there auto's smallest
    budget stays 1."""
    return (ddtree is not None and ddtree.adaptive and tensor_parallel_size == 1
            and data_parallel_size == 1
            and ddtree.resolved_verify_shape(tensor_parallel_size) == "adaptive")


def step_shapes(ddtree: Any, tensor_parallel_size: int, max_num_reqs: int,
                data_parallel_size: int = 1) -> list[int] | None:
    """Every drafts-per-request count a step of this run may verify (a FULL CUDA graph
    of ``1 + s`` rows each), or None when every step verifies B (no cut): auto's
    candidates with adaptive verify shapes (and 0 where auto may decode plainly), the
    batch schedule's budgets, and B."""
    from vllm_ddtree.budget.schedule import schedule_budgets

    if ddtree is None:
        return None
    shapes: set[int] = set()
    if ddtree.resolved_verify_shape(tensor_parallel_size) == "adaptive":
        shapes.update(candidate_budgets(ddtree.budget))
        if auto_plain_steps(ddtree, tensor_parallel_size, data_parallel_size):
            shapes.add(0)
    if ddtree.batch_schedule is not None:
        shapes.update(schedule_budgets(ddtree.batch_schedule, max_num_reqs, ddtree.budget))
        shapes.add(ddtree.budget)
    return sorted(shapes) or None


def truncate_drafts(scheduler_output: Any, num_drafts: int) -> Any:
    """``scheduler_output`` with every request's scheduled drafts cut to ``num_drafts``.

    Args:
        scheduler_output: vLLM's ``SchedulerOutput`` (not modified: with the
            in-process executor the scheduler reads the same object afterwards and
            must see what it scheduled).
        num_drafts: drafts to keep per request (>= 0; 0: a plain decoding step, the
            requests leave ``scheduled_spec_decode_tokens``, so the runner samples
            without the verifier).

    Returns:
        The same object when no request holds more drafts, else a shallow copy whose
        ``scheduled_spec_decode_tokens`` lists, ``num_scheduled_tokens`` and
        ``total_num_scheduled_tokens`` drop the cut drafts (prefill chunks and
        requests without drafts are unchanged).
    """
    if num_drafts < 0:
        raise ValueError(f"num_drafts must be >= 0, got {num_drafts}")
    drafts = scheduler_output.scheduled_spec_decode_tokens
    if not drafts or all(len(tokens) <= num_drafts for tokens in drafts.values()):
        return scheduler_output
    kept_drafts = {}
    num_scheduled = dict(scheduler_output.num_scheduled_tokens)
    total = scheduler_output.total_num_scheduled_tokens
    for req_id, tokens in drafts.items():
        cut = len(tokens) - num_drafts
        if cut > 0:
            num_scheduled[req_id] -= cut
            total -= cut
        if num_drafts > 0:
            kept_drafts[req_id] = tokens[:num_drafts] if cut > 0 else tokens
    return dataclasses.replace(
        scheduler_output,
        scheduled_spec_decode_tokens=kept_drafts,
        num_scheduled_tokens=num_scheduled,
        total_num_scheduled_tokens=total,
    )


class _CurrentStream:
    """``torch.cuda.current_stream(device)`` for a call every round:
    ``torch.cuda.current_stream`` builds a new ``Stream`` object at each call, this one
    only when the device's current stream changed (a raw handle compared)."""

    def __init__(self, device: torch.device) -> None:
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        self._handle: int | None = None
        self._stream: torch.cuda.Stream | None = None

    def __call__(self) -> torch.cuda.Stream:
        handle = torch._C._cuda_getCurrentRawStream(self.index)
        if handle != self._handle:
            self._handle, self._stream = handle, torch.cuda.current_stream(self.index)
        return self._stream


class VerifyShapeChooser:
    """The verify shape of the next step, from the device's recent budget choices.

    Args:
        max_budget: B (``num_speculative_tokens``); the shape before any choice has
            reached the host.
        device: where the choices live (CUDA: pinned slots and events; CPU: the
            copy is synchronous and a choice is visible at once).
        lag: None: the newest completed choice (TP = 1); an int in
            ``1.._SLOTS - 1``: the choice of exactly that many rounds before, the same
            on every rank (TP > 1).
        make_event: ``() -> event`` with ``record(stream)``, ``query()`` and
            ``synchronize()``, one made per slot and recorded again at each use of the
            slot; default CUDA events on CUDA, none elsewhere. Tests pass fakes.
    """

    def __init__(self, max_budget: int, device: torch.device | str,
                 lag: int | None = None, make_event: Any = None) -> None:
        if lag is not None and not 1 <= lag < _SLOTS:
            raise ValueError(f"lag must be in 1..{_SLOTS - 1} or None, got {lag}")
        self.lag = lag
        self._num_recorded = 0
        self.shapes = candidate_budgets(max_budget)
        self.max_budget = max_budget
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        self._host = torch.full((_SLOTS,), max_budget, dtype=torch.int64, pin_memory=cuda)
        # The same pinned memory as int64 [1] views the copies land in and as a NumPy
        # array read back without a torch op (two a read, microseconds each).
        self._host_slots = [self._host[i : i + 1] for i in range(_SLOTS)]
        self._host_values = self._host.numpy()
        if make_event is None and cuda:
            make_event = torch.cuda.Event
        self._events = [None if make_event is None else make_event() for _ in range(_SLOTS)]
        self._stream = _CurrentStream(self.device) if cuda else lambda: None
        self._pending: deque[int] = deque()
        self._next_slot = 0
        self._latest = max_budget

    def record_(self, budget: torch.Tensor) -> None:
        """Start the copy of this round's chosen budget (int 0-dim or ``[1]`` tensor on
        ``device``) to the host. No host sync."""
        slot = self._next_slot
        self._next_slot = (slot + 1) % _SLOTS
        if slot in self._pending:  # the host ran _SLOTS rounds ahead: drop the oldest
            self._pending.remove(slot)
        if budget.dim() != 1:
            budget = budget.reshape(1)
        self._host_slots[slot].copy_(budget, non_blocking=True)
        event = self._events[slot]
        if event is not None:
            event.record(self._stream())
        self._pending.append(slot)
        self._num_recorded += 1

    def latest_budget(self) -> int:
        """The newest chosen budget whose copy has completed (B before the first).
        Never waits: events complete in stream order, so this stops at the first
        pending one. With ``lag``: the choice of ``lag`` rounds before (B before it
        exists), waiting for its copy if it has not completed."""
        if self.lag is not None:
            return self._lagged_budget()
        while self._pending:
            slot = self._pending[0]
            event = self._events[slot]
            if event is not None and not event.query():
                break
            self._pending.popleft()
            self._latest = int(self._host_values[slot])
        return self._latest

    def _lagged_budget(self) -> int:
        record = self._num_recorded - self.lag  # 0-based index of the round to read
        if record < 0:
            return self.max_budget
        slot = record % _SLOTS
        event = self._events[slot]
        if event is not None:
            event.synchronize()  # recorded `lag` rounds ago: normally long complete
        return int(self._host_values[slot])

    def next_shape(self) -> int:
        """Drafts to verify per request next step: the smallest candidate budget
        >= :meth:`latest_budget`."""
        budget = self.latest_budget()
        return next((s for s in self.shapes if s >= budget), self.max_budget)


def warm_up_batch(req_ids: Any) -> bool:
    """Whether a batch of these request ids is vLLM V2's kernel warm-up
    (``warmup.py:224``: ids ``_warmup_{i}_``)."""
    first = next(iter(req_ids), None)
    return first is not None and str(first).startswith(WARMUP_PREFIX)


def prefill_load(scheduler_output: Any) -> tuple[int, int, int]:
    """``(requests, tokens, pairs)`` the step schedules that are not decodes (a new
    request, a chunk of a prompt, a recomputed preempted request: anything but a
    request's root and its drafts) and the query-key pairs of their attention (``n``
    tokens after ``c`` computed ones: ``n * c + n * (n + 1) / 2``); ``(0, 0, 0)`` for a
    step of decodes only. The auto gate models the tokens as extra rows of the step's
    forward and counts the step's time only where its pairs are typical of the batch
    size. A new (or, with vLLM's V2 runner, resumed) request with one token left to
    compute that the scheduler padded with placeholder drafts to the decodes' query
    length (``scheduler.py``: "Pad new decode requests") is a decode: the worker cuts
    its drafts with the others' (:func:`truncate_drafts`, after this count), and counted
    as load it was priced as ``1 + B`` rows where the step verified ``1 + s``. Host
    data only."""
    drafts = scheduler_output.scheduled_spec_decode_tokens
    new = {req.req_id: req.num_computed_tokens for req in scheduler_output.scheduled_new_reqs}
    load = [(req_id, n) for req_id, n in scheduler_output.num_scheduled_tokens.items()
            if n != 1 + len(drafts.get(req_id, ())) or (n == 1 and req_id in new)]
    if not load:  # every step of steady decoding: one pass over the batch, no more
        return 0, 0, 0
    computed = dict(new)
    cached = scheduler_output.scheduled_cached_reqs
    computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
    pairs = sum(n * computed.get(req_id, 0) + n * (n + 1) // 2 for req_id, n in load)
    return len(load), sum(n for _, n in load), pairs


class StepPlan:
    """How many drafts each request verifies in the next step, and whether ``propose``
    runs the drafter's block pass: the host side of the batch schedule
    (``num_speculative_tokens_per_batch_size``, ``vllm_ddtree.budget.schedule``) and
    of ``ddtree_budget: "auto"`` (device choice through ``chooser``, the arm of each
    step through ``gate``).

    ``patches/verify_shapes.py`` cuts every request's drafts to :meth:`step_shape` in
    ``execute_model``; ``DDTreeSpeculator.propose`` asks :meth:`draft_next`. A step
    after a propose without the block pass verifies no drafts (its trees were not
    drafted): a plain decoding step, one row a request.

    Args:
        max_budget: B.
        shapes: every drafts-per-request count a step may take (CUDA graphs of ``1 + s``
            rows each are captured); :meth:`step_shape` returns one of them.
        schedule: the batch schedule (``BatchSchedule``) or None.
        chooser: auto's ``VerifyShapeChooser`` (adaptive verify shapes) or None: then
            a drafted step verifies the schedule's budget (B without one).
        gate: auto's ``SpeculationGate`` (the arm of each step: plain decoding or a cap
            on the verify shape) or None: then a propose drafts whenever the schedule's
            budget for its batch is above 0.
    """

    def __init__(self, max_budget: int, shapes: list[int], schedule: Any = None,
                 chooser: VerifyShapeChooser | None = None, gate: Any = None) -> None:
        self.max_budget = max_budget
        self.shapes = sorted(set(shapes))
        self.schedule = schedule
        self.chooser = chooser
        self.gate = gate
        self.drafted = True  # the last propose ran the block pass
        self.arm = max_budget  # the gate's last arm (the cap of a drafted step's shape)
        self.last_shape = max_budget

    @property
    def holding(self) -> bool:
        """Whether the next ``propose`` keeps the gate's held decision (does not
        decide): see :attr:`vllm_ddtree.budget.gate.SpeculationGate.holding`."""
        return self.gate is not None and self.gate.holding

    def cap(self, num_reqs: int) -> int:
        """The schedule's budget for a batch of ``num_reqs`` (B without a schedule)."""
        return self.max_budget if self.schedule is None else self.schedule.budget_for(num_reqs)

    def step_shape(self, num_reqs: int, prefill: tuple[int, int, int] = (0, 0, 0),
                   warm_up: bool = False) -> int:
        """Drafts per request this step verifies: 0 after a propose without the block
        pass, else ``min(cap, chooser's shape, the gate's arm)`` (a member of
        ``shapes``). ``prefill``: the step's :func:`prefill_load` (for the gate's
        timing). ``warm_up``: vLLM's kernel warm-up batch (:func:`warm_up_batch`), which
        verifies B whatever the schedule's budget for its size: a schedule at 0 there
        (its many requests) left the walk and compaction kernels to compile at the
        first request (H100 sweep, ``ddtree-64+perbatch``). Host only, no sync."""
        cap = self.max_budget if warm_up else self.cap(num_reqs)
        if not self.drafted:
            shape = 0
        else:
            shape = cap
            if self.chooser is not None:
                shape = min(shape, self.chooser.next_shape())
            if self.gate is not None and self.arm > 0:  # arm 0: a warm-up's forced draft
                shape = min(shape, self.arm)
        self.last_shape = shape
        if self.gate is not None:
            self.gate.step_started(num_reqs, shape, *prefill, cap=cap)
        return shape

    def step_finished(self) -> None:
        """At the end of ``propose``, after its last launch: the gate's timed step ends
        on the stream here (``SpeculationGate.step_finished``)."""
        if self.gate is not None:
            self.gate.step_finished()

    def draft_next(self, num_reqs: int, contexts: Any = None) -> bool:
        """At ``propose`` (after this step's verify): whether to run the drafter's block
        pass, i.e. whether the next step verifies trees. No when the schedule's budget
        for this batch is 0; else whether the gate's arm is above 0 (yes without a
        gate). ``contexts``: the requests' context lengths (host array; for the gate)."""
        cap = self.cap(num_reqs)
        if self.gate is None:
            arm = cap
        else:
            import numpy as np

            ctx = np.zeros(0) if contexts is None else np.asarray(contexts)
            arm = self.gate.decide(num_reqs, ctx, cap)
        self.arm = arm
        self.drafted = arm > 0
        return self.drafted
