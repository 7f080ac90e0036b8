"""``ddtree_budget: "auto"``: the start-up cost model and the per-round budget choice.

The scheduler keeps scheduling ``B = num_speculative_tokens`` draft tokens. Each
round only the first ``b`` nodes of every tree are *active*: the tree-verify attention
skips the other rows and the verifier ignores them (the first ``b`` nodes are the
budget-``b`` tree, see ``vllm_ddtree.tree.draft_tree``). With adaptive verify shapes
(``vllm_ddtree.verify.shape``) the runner also verifies only ``1 + s`` rows, ``s`` the
candidate >= a recent round's ``b``; with fixed ones it verifies ``1 + B``. One ``b``
per batch:

    tokens(b)  = sum_r E[committed tokens of request r | b]   (drafter's own estimate)
    seconds(b) = base + num_layers * sum_r attn(ctx_r, 1 + b) + rows(R * (1 + b))
    b*         = the smallest candidate within 1 % of the best tokens(b) / seconds(b)

* ``attn(ctx, q)``: one request's tree-verify attention in one target layer, measured
  at start-up with the target's own kernel on dummy tensors over a (context x query
  length) grid (:func:`measure_attention_table`), interpolated on the device.
  Summing it over requests overcounts the fixed launch cost of short contexts at
  larger batches (a batch runs one kernel); that cost does not depend on ``b``.
* ``rows(n)``: with adaptive verify shapes, what verifying ``n`` rows costs beside
  attention (the target's GEMMs or MoE experts, lm_head, sampling): one request's
  captured verify graph of each shape ``1 + s`` is replayed at start-up
  (``vllm_ddtree.patches.verify_shapes``; :meth:`BudgetPolicy.set_row_costs`), minus the smallest
  shape's time, interpolated in the total row count (``budget.rows_seconds_for_batch``).
  Zero with fixed shapes (every round runs ``1 + B`` rows) or before the measurement.
* ``base``: everything else in a round (drafter, the smallest shape's forward,
  sampling, host work). It is not measured per part; :class:`BudgetPolicy` keeps an EMA
  of ``wall time between consecutive rounds - modeled attention and rows of the round``.
  The host reads the wall time with ``time.perf_counter`` at each ``propose``: in
  steady state the host loop runs at the GPU's pace (it waits on each step's sampled
  tokens), so the interval is one round's time. Intervals after an idle engine or a
  step without trees are dropped, and one sample may at most double the estimate.
  Until the first sample, ``base`` is the modeled attention at ``B`` (a neutral start:
  neither tiny nor huge trees are favoured a priori).

Every per-round operation stays on the device (no ``.item()``, no host sync); only
the start-up measurement synchronizes.

**b = 0: plain decoding steps** (``vllm_ddtree.budget.gate``; TP = 1 with adaptive
verify shapes). At a large batch, or with a drafter that is rarely right, a step that
drafts and verifies even a one-node tree is slower per token than plain decoding: the
drafter's block pass and the wider verify cost more than the trees commit. The choice
above cannot express "no tree": it is made on the device *after* the block pass, from
the drafter's confidence, which exists only once the pass ran. So b = 0 is decided
separately, on the host, at each ``propose`` *before* the pass, for the next step:

* **what it compares**: tokens per second of a plain step, ``R / T_plain``, against a
  speculative one, ``R * E / T_spec``, for this batch of ``R`` requests and their
  contexts. ``T`` = the start-up model (``StepCostModel``: the target's verify forward
  by total rows, timed on its own FULL CUDA graphs of every verify shape at 1, 2, 4, ...
  requests; the drafter's block pass by requests, timed on its graphs; the verify
  attention per request, layer and context at 1 and ``1 + b`` rows, the table above
  plus a one-row column) plus a measured residual per kind of step and batch-size
  bucket (powers of two): what steps of that kind actually took beyond the model
  (host work, sampling, the context K/V precompute), from CUDA timing events at each
  step's start, read only once completed (``Event.query``). ``E`` = tokens committed
  per tree over recent trees at this batch size (DDTree's device counters, copied to
  pinned memory each step and read once their copy completed). ``T_spec`` uses the
  verify shape the device chose last near this batch size. So the model carries the
  batch-size dependence of the GPU work, and the measured residuals what no start-up
  measurement sees; neither needs a host sync.
* **hysteresis**: the gate switches only when the other kind is predicted 5 % faster.
* **coming back**: in plain mode no trees are verified, so ``E`` and the speculative
  residual at this batch size go stale. The gate probes: three steps of the other kind
  (the middle ones are clean intervals of that kind) the first time a bucket has
  measured only the current kind, then every 32 steps in that bucket, the interval
  doubling up to 1,024 after each probe; a probe of plain steps runs only where they are
  predicted within 20 % of speculation (or were never measured), so clear cases cost
  nothing; speculation is probed on that schedule however slow it is predicted (its
  ``E`` is measured only on trees, and changes with the requests). When the batch
  shrinks, the model (smaller ``R``) and the bucket's own figures bring speculation back
  without a probe. A speculative step after plain ones loses nothing: a plain step's
  ``propose`` still writes the drafter's context K/V of the tokens it committed
  (``DDTreeSpeculator._store_context_kv``), only the block pass is skipped, so the
  drafter's cache is the one it would have had.
* **the batch schedule** (``num_speculative_tokens_per_batch_size``,
  ``vllm_ddtree.budget.schedule``) caps the choice per batch size; a cap of 0 is a
  plain step without the gate, and then no probe runs.
* Not at TP > 1: each rank would time its own steps and could decide differently,
  while the ranks must cut the same drafts; auto's smallest budget stays 1 there.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from vllm_ddtree.budget.choice import (
    BudgetCostTable,
    choose_batch_budget,
    expected_committed_by_budget,
    rows_seconds_for_batch,
)
from vllm_ddtree.budget.choice_kernel import choose_budget_triton
from vllm_ddtree.triton_path import use_triton

if TYPE_CHECKING:
    from vllm_ddtree.budget.gate import StepCostModel

__all__ = [
    "BudgetPolicy",
    "MeasureFn",
    "candidate_budgets",
    "cuda_time_fn",
    "gqa_attention_timer",
    "measure_attention_table",
    "measurement_contexts",
    "mla_attention_timer",
]

# Under "vllm." so that the start-up table reaches vLLM's log handler (its "vllm"
# logger does not propagate to the root logger).
logger = logging.getLogger("vllm.ddtree.budget_policy")

# measure_fn(context tokens, active query rows 1 + b) -> seconds of one request's verify
# attention (1 + B rows, the first 1 + b active) in one layer.
MeasureFn = Callable[[int, int], float]

CONTEXT_GRID = (1024, 4096, 16384, 65536, 131072)
# Wall intervals longer than this are an idle engine, not a round.
MAX_ROUND_SECONDS = 2.0
EMA_WEIGHT = 0.1
# Pinned host slots for the wall time: the host may run a few steps ahead of the GPU,
# so a slot must not be rewritten before its copy ran.
_WALL_SLOTS = 8


def candidate_budgets(max_budget: int) -> list[int]:
    """Budgets ``b`` a round may pick: powers of two below ``max_budget``, then
    ``max_budget`` itself (sorted, unique; ``[1]`` for ``max_budget = 1``)."""
    if max_budget < 1:
        raise ValueError(f"max_budget must be >= 1, got {max_budget}")
    out, b = [], 1
    while b < max_budget:
        out.append(b)
        b *= 2
    return out + [max_budget]


def measurement_contexts(max_model_len: int) -> list[int]:
    """Context lengths to time: :data:`CONTEXT_GRID` capped at ``max_model_len``
    (which is timed when shorter than the grid's end). Past the last point attention
    grows linearly with the context, so the table extrapolates its last segment
    instead of allocating dummy caches of ``max_model_len`` tokens."""
    if max_model_len < 1:
        raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
    last = min(max_model_len, CONTEXT_GRID[-1])
    return [c for c in CONTEXT_GRID if c < last] + [last]


def measure_attention_table(
    measure_fn: MeasureFn, contexts: Sequence[int], budgets: Sequence[int],
    device: torch.device | str = "cpu",
) -> BudgetCostTable:
    """Time ``measure_fn(context, 1 + b)`` on the grid ``contexts x budgets``.

    Args:
        measure_fn: seconds of one request's verify attention in one layer.
        contexts: increasing context lengths.
        budgets: increasing candidate budgets.
        device: where the table lives (the device the choice runs on).

    Returns:
        A :class:`BudgetCostTable` (``seconds [C, K]`` float32, extrapolating past the
        last context). Each row is made non-decreasing in ``b`` (a longer query never
        costs less; timing noise could say otherwise).
    """
    seconds = torch.tensor(
        [[float(measure_fn(int(c), 1 + int(b))) for b in budgets] for c in contexts],
        dtype=torch.float32,
    )
    if not bool(torch.isfinite(seconds).all()) or bool((seconds <= 0).any()):
        raise ValueError(f"measure_fn returned non-positive or non-finite times: {seconds}")
    seconds = seconds.cummax(dim=1).values
    return BudgetCostTable(
        torch.tensor(list(contexts)), torch.tensor(list(budgets)), seconds, extrapolate=True
    ).to(device)


def format_table(table: BudgetCostTable) -> str:
    """The table as text, microseconds per request and layer (for the start-up log)."""
    budgets = table.budgets.tolist()
    lines = ["context  " + " ".join(f"b={b:>5}" for b in budgets)]
    for ctx, row in zip(table.contexts.tolist(), table.seconds.tolist(), strict=True):
        lines.append(f"{int(ctx):>7}  " + " ".join(f"{1e6 * s:7.1f}" for s in row))
    return "\n".join(lines)


class BudgetPolicy:
    """Per-round choice of the active budget, on the device.

    Args:
        table: one request's attention seconds per layer (``budgets`` = candidates,
            the last one = B), e.g. from :func:`measure_attention_table`.
        num_layers: target attention layers on this GPU.
        ema_weight: weight of a new base-time sample.
        tp_group: vLLM's tensor-parallel ``GroupCoordinator`` when it has more than one
            rank: every rank then takes the first rank's choice (each rank times its
            own table and wall clock, and the ranks' walks must agree).
        plain_attention: one request's attention seconds per layer at one row (a plain
            decoding step), per context of ``table`` (host floats), for the b = 0 gate's
            cost model (:meth:`cost_model`); None: the ``b = 1`` column stands in.
    """

    def __init__(self, table: BudgetCostTable, num_layers: int,
                 ema_weight: float = EMA_WEIGHT, tp_group: Any = None,
                 plain_attention: Sequence[float] | None = None) -> None:
        budgets = table.budgets.tolist()
        if budgets != sorted(set(budgets)) or budgets[0] < 1:
            raise ValueError(f"candidate budgets must be increasing and >= 1, got {budgets}")
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        self.table = table
        self.plain_attention = None if plain_attention is None else list(plain_attention)
        self.budgets = table.budgets
        self.max_budget = budgets[-1]
        self.num_layers = num_layers
        self.ema_weight = ema_weight
        self.tp_group = tp_group
        device = table.seconds.device
        f32 = dict(dtype=torch.float32, device=device)
        # < 0: no sample yet (the choice then uses the modeled attention at B).
        self.base_seconds = torch.full((1,), -1.0, **f32)
        # Modeled attention (+ rows) of the last chosen round: what the next wall
        # sample covers besides the base time.
        self.last_attention = torch.zeros(1, **f32)
        # rows(1 + b_k) of one request, float32 [K] (set_row_costs); None: not measured.
        self.row_seconds: torch.Tensor | None = None
        # The same in a buffer a CUDA graph reads (zeros: no row cost), written in place.
        self._row_seconds_buffer = torch.zeros(len(budgets), **f32)
        self._wall_device = torch.zeros(1, **f32)
        self._wall_host = torch.zeros(
            _WALL_SLOTS, dtype=torch.float32, pin_memory=device.type == "cuda"
        )
        # choose_in_graph: the chosen budget, and (wall seconds, pending) the graph reads.
        self.in_graph = False
        self.chosen = torch.full((1,), self.max_budget, dtype=torch.int64, device=device)
        self._wall_flagged = torch.zeros(2, **f32)
        self._wall_host_flagged = torch.zeros(
            _WALL_SLOTS, 2, dtype=torch.float32, pin_memory=device.type == "cuda"
        )
        self._slot = 0
        self._last_round_start: float | None = None
        # A wall sample copied to _wall_device that the next choose folds into base.
        self._sample_pending = False

    # -- the choice ----------------------------------------------------------------

    def attention_seconds(self, context_lens: torch.Tensor) -> torch.Tensor:
        """float32 ``[K]``: modeled target attention of a round per candidate,
        ``num_layers * sum_r attn(ctx_r, 1 + b)`` for int ``context_lens [R]``."""
        return self.num_layers * self.table.at(context_lens.reshape(-1)).sum(dim=0)

    def set_row_costs(self, seconds_by_shape: dict[int, float]) -> None:
        """Take one request's measured verify forward time per shape (``{s: seconds}``
        for every candidate ``s``, 1 + s rows): the row cost is each minus the smallest
        shape's, made non-decreasing. Raises ``ValueError`` when a candidate is missing
        or a time is not positive."""
        budgets = self.budgets.tolist()
        missing = [b for b in budgets if b not in seconds_by_shape]
        if missing:
            raise ValueError(f"verify times missing for budgets {missing}")
        times = torch.tensor([float(seconds_by_shape[b]) for b in budgets])
        if not bool((times > 0).all()):
            raise ValueError(f"verify times must be positive, got {times.tolist()}")
        rows = (times - times[0]).clamp_min(0).cummax(dim=0).values
        self._row_seconds_buffer.copy_(rows)
        self.row_seconds = self._row_seconds_buffer
        logger.info(
            "DDTree auto budget: one request's verify forward per shape (us): %s; row "
            "cost over the smallest shape (us): %s",
            {b: round(1e6 * t, 1) for b, t in zip(budgets, times.tolist(), strict=True)},
            [round(1e6 * r, 1) for r in rows.tolist()],
        )

    def modeled_seconds(self, context_lens: torch.Tensor) -> torch.Tensor:
        """float32 ``[K]``: the round's modeled attention plus, once measured, the row
        cost of ``R * (1 + b)`` verified rows (``R = context_lens.numel()``)."""
        modeled = self.attention_seconds(context_lens)
        if self.row_seconds is not None:
            modeled = modeled + rows_seconds_for_batch(self.row_seconds, self.budgets,
                                                       context_lens.numel())
        return modeled

    def round_seconds(self, attention: torch.Tensor) -> torch.Tensor:
        """float32 ``[K]``: ``base + attention`` (base = ``attention[-1]``, the cost
        at B, until the first wall sample)."""
        base = torch.where(self.base_seconds >= 0, self.base_seconds, attention[-1:])
        return base + attention

    def choose(self, scores: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor:
        """The batch's active budget.

        Args:
            scores: float32 ``[R, B]``, the trees' node scores (``DraftTree.scores``).
            context_lens: int ``[R]``, the requests' context lengths.

        Returns:
            int64 0-dim tensor ``b`` (one of the candidates). First folds the wall
            sample :meth:`observe_round` recorded, if any, into the base time; records
            the chosen round's modeled attention for the next sample. No host sync.
            On CUDA one Triton launch for both (``budget_choice_kernel``); CPU
            tensors: the ops below.
        """
        pending, self._sample_pending = self._sample_pending, False
        if use_triton(scores):
            table = self.table
            b = choose_budget_triton(
                scores, context_lens, table.contexts, table.seconds, self.budgets,
                self.base_seconds, self.last_attention, self.num_layers, table.extrapolate,
                wall_seconds=self._wall_device if pending else None,
                ema_weight=self.ema_weight, row_seconds=self.row_seconds,
            )
        else:
            if pending:
                self.update_base_(self._wall_device)
            modeled = self.modeled_seconds(context_lens)
            expected = expected_committed_by_budget(scores)
            b = choose_batch_budget(expected, self.round_seconds(modeled), self.budgets)
            index = torch.searchsorted(self.budgets, b.reshape(1))
            self.last_attention.copy_(modeled[index])
        if self.tp_group is not None:
            # An NCCL broadcast on the stream: no host sync.
            torch.distributed.broadcast(b, src=self.tp_group.ranks[0],
                                        group=self.tp_group.device_group)
        return b

    def choose_in_graph(self, scores: torch.Tensor, context_lens: torch.Tensor,
                        row_of_sample: torch.Tensor, idx_stride: int) -> torch.Tensor:
        """:meth:`choose` for a step captured in a CUDA graph (the drafter's), TP = 1 on
        CUDA: only rows whose ``row_of_sample[r * idx_stride] >= 0`` count (padding
        requests are -1), the wall sample is folded when the flag :meth:`observe_round`
        copied with it says so, the row costs are read from a buffer that
        :meth:`set_row_costs` fills later, and the choice lands in ``self.chosen``
        (int64 ``[1]``, returned). One launch, no host sync. Call
        :meth:`enable_in_graph_` first."""
        if not self.in_graph:
            raise RuntimeError("choose_in_graph needs enable_in_graph_() first")
        table = self.table
        return choose_budget_triton(
            scores, context_lens, table.contexts, table.seconds, self.budgets,
            self.base_seconds, self.last_attention, self.num_layers, table.extrapolate,
            wall_seconds=self._wall_flagged, ema_weight=self.ema_weight,
            row_seconds=self._row_seconds_buffer, row_of_sample=row_of_sample,
            idx_stride=idx_stride, sample_flag=True, out=self.chosen)

    def enable_in_graph_(self) -> None:
        """Choose inside a CUDA graph from now on (:meth:`choose_in_graph`): wall
        samples go to the device with a pending flag. Raises ``NotImplementedError``
        at TP > 1 (the ranks' choice is broadcast eagerly) or off CUDA."""
        if self.tp_group is not None:
            raise NotImplementedError("the in-graph budget choice is for TP = 1")
        if self.base_seconds.device.type != "cuda":
            raise NotImplementedError("the in-graph budget choice needs CUDA")
        self.in_graph = True

    def cost_model(self) -> StepCostModel:
        """The b = 0 gate's start-up cost model (``vllm_ddtree.budget.gate``): this
        policy's attention tables on the host, plus the plain step's column. Reads the
        device table once (start-up)."""
        from vllm_ddtree.budget.gate import StepCostModel

        tree = self.table.seconds.cpu().double().numpy()
        plain = self.plain_attention if self.plain_attention is not None else tree[:, 0]
        return StepCostModel(self.num_layers, self.table.contexts.cpu().tolist(), plain,
                             tree, self.budgets.cpu().tolist())

    # -- the base time ---------------------------------------------------------------

    def update_base_(self, wall_seconds: torch.Tensor) -> None:
        """Fold one round's wall time (float32 ``[1]`` on the device) into the base
        EMA: sample = ``max(wall - last_attention, 0)``, at most ``2 x base + 0.1 ms``."""
        sample = (wall_seconds - self.last_attention).clamp_min(0)
        known = self.base_seconds >= 0
        sample = torch.where(known, torch.minimum(sample, 2 * self.base_seconds + 1e-4), sample)
        w = self.ema_weight
        self.base_seconds.copy_(
            torch.where(known, (1 - w) * self.base_seconds + w * sample, sample)
        )

    def observe_round(self, now: float | None = None, verified: bool = True) -> None:
        """Host hook at the start of every ``propose``: the time since the previous
        call is one round when ``verified`` (this step verified trees) and the engine
        was not idle in between. Copies it to the device without a sync; the next
        :meth:`choose` folds it into the base time (:meth:`update_base_`)."""
        now = time.perf_counter() if now is None else now
        last, self._last_round_start = self._last_round_start, now
        if last is None or not verified or not 0 < now - last <= MAX_ROUND_SECONDS:
            return
        if self.in_graph:  # (seconds, pending) for the graph's choice
            pair = self._wall_host_flagged[self._slot]
            self._slot = (self._slot + 1) % _WALL_SLOTS
            pair[0], pair[1] = now - last, 1.0
            self._wall_flagged.copy_(pair, non_blocking=True)
            return
        slot = self._wall_host[self._slot : self._slot + 1]
        self._slot = (self._slot + 1) % _WALL_SLOTS
        slot.fill_(now - last)
        self._wall_device.copy_(slot, non_blocking=True)
        self._sample_pending = True

    def reset_round_clock(self) -> None:
        """Forget the previous round's start and any sample not yet folded (after a
        dummy or profile run)."""
        self._last_round_start = None
        self._sample_pending = False
        if self.in_graph:
            self._wall_flagged[1:].zero_()

    # -- construction in vLLM ------------------------------------------------------------

    @classmethod
    def from_vllm_config(cls, vllm_config: Any, max_budget: int,
                         device: torch.device | str,
                         measure_fn: MeasureFn | None = None) -> BudgetPolicy:
        """Measure the target's verify attention (``measure_fn`` default: the MLA or
        GQA tree kernel with the target's shapes) and build the policy. Syncs."""
        model_config = vllm_config.model_config
        parallel = vllm_config.parallel_config
        budgets = candidate_budgets(max_budget)
        contexts = measurement_contexts(model_config.max_model_len)
        device = torch.device(device)
        start = time.perf_counter()
        if measure_fn is None and device.type == "cuda":
            # Launch on the runner's GPU; give the dummy caches back before vLLM
            # profiles memory.
            with torch.cuda.device(device):
                timer = target_attention_timer(vllm_config, 1 + max_budget, device)
                table = measure_attention_table(timer, contexts, budgets, device)
                plain = [float(timer(int(c), 1)) for c in contexts]
                del timer
                torch.cuda.empty_cache()
        else:
            measure_fn = measure_fn or target_attention_timer(vllm_config, 1 + max_budget,
                                                              device)
            table = measure_attention_table(measure_fn, contexts, budgets, device)
            plain = [float(measure_fn(int(c), 1)) for c in contexts]
        num_layers = model_config.get_num_layers(parallel)
        tp_group = None
        if parallel.tensor_parallel_size > 1:
            from vllm.distributed.parallel_state import get_tp_group

            tp_group = get_tp_group()
        logger.info(
            "DDTree auto budget: candidates %s, %d target layers; verify attention per "
            "request and layer (us), measured in %.2f s:\n%s",
            budgets, num_layers, time.perf_counter() - start, format_table(table),
        )
        return cls(table, num_layers, tp_group=tp_group, plain_attention=plain)


# ---------------------------------------------------------------------------------------
# Timing the target's own kernel (GPU)


# time_fn(run) -> seconds of one call of run (CUDA events by default; tests use a clock).
TimeFn = Callable[[Callable[[], Any]], float]


def cuda_time_fn(warmup: int = 2, iters: int = 5) -> TimeFn:
    """A ``time_fn``: mean seconds per call over ``iters`` back-to-back launches on the
    current CUDA stream (CUDA events), after ``warmup`` calls."""
    return lambda run: _time_cuda(run, warmup, iters)


def _time_cuda(run: Callable[[], Any], warmup: int, iters: int) -> float:
    """Mean seconds of ``run`` on the current CUDA stream (CUDA events)."""
    for _ in range(warmup):
        run()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000.0 / iters


def _chain_bits(rows: int, device: torch.device) -> torch.Tensor:
    from vllm_ddtree.tree.draft_tree import pack_ancestor_mask

    mask = torch.ones(rows, rows, dtype=torch.bool).tril()
    return pack_ancestor_mask(mask).to(device)


class _OneRequestBatch:
    """The dummy verify batch both timers share: one request of ``max_query_len`` rows
    (chain bits) over a paged cache of ``max_context + max_query_len`` tokens whose
    pages are mapped in order. ``randn`` draws the dummy tensors (fixed seed)."""

    def __init__(self, max_query_len: int, max_context: int, page_size: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.dtype, self.device = dtype, device
        self.max_query_len = max_query_len
        self.num_blocks = -(-(max_context + max_query_len) // page_size)
        self.gen = torch.Generator(device=device).manual_seed(0)
        self.block_table = torch.arange(self.num_blocks, dtype=torch.int32,
                                        device=device)[None]
        self.bits = _chain_bits(max_query_len, device)
        self.query_start_loc = torch.tensor([0, max_query_len], dtype=torch.int32,
                                            device=device)

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=self.gen, device=self.device,
                           dtype=torch.float32).to(self.dtype)

    def measure_fn(self, time_fn: TimeFn, attend: Callable[..., Any]) -> MeasureFn:
        """``measure(context, query_len)``: ``time_fn`` of ``attend(seq_lens,
        active_query_lens, seq_len)`` (int32 ``[1]`` tensors and the host seq_len) for a
        request with ``context`` cached tokens and ``query_len`` active rows."""
        def measure(context: int, query_len: int) -> float:
            seq_len = context + self.max_query_len
            seq_lens = torch.tensor([seq_len], dtype=torch.int32, device=self.device)
            active = torch.tensor([query_len], dtype=torch.int32, device=self.device)
            return time_fn(lambda: attend(seq_lens, active, seq_len))

        return measure


# vLLM's --kv-cache-dtype names the tree MLA backend takes as an e4m3 cache (as
# attention_backends/mla_tree/backend.py's FP8_KV_CACHE_DTYPES).
_FP8_CACHE_DTYPES = ("fp8", "fp8_e4m3")
_CACHE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def _mla_timer_cache(batch: _OneRequestBatch, page_size: int, head_dim: int,
                     kv_cache_dtype: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The dummy latent cache ``[num_blocks, page_size, head_dim]`` in the run's
    ``kv_cache_dtype`` (vLLM's ``cache_config.cache_dtype``) and its ``kv_scale``:
    "auto" -> the model dtype (``batch.dtype``), no scale; "float16" / "bfloat16" -> that
    dtype; "fp8" / "fp8_e4m3" -> uint8 storage viewed as ``float8_e4m3fn`` (as vLLM
    allocates it and hands it to the backend) with a scale of 1.0 (fp32, 0-d: a layer's
    ``_k_scale``)."""
    if kv_cache_dtype in _FP8_CACHE_DTYPES:
        rows = torch.randn((batch.num_blocks, page_size, head_dim), generator=batch.gen,
                           device=batch.device, dtype=torch.float32)
        cache = torch.empty(rows.shape, dtype=torch.uint8, device=batch.device).view(
            torch.float8_e4m3fn)
        cache.copy_(rows)  # |randn| < 448: inside e4m3's range
        return cache, torch.ones((), dtype=torch.float32, device=batch.device)
    if kv_cache_dtype != "auto" and kv_cache_dtype not in _CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r} is not allowed for the MLA verify timer: "
            f"one of {['auto', *_CACHE_DTYPES, *_FP8_CACHE_DTYPES]}")
    dtype = _CACHE_DTYPES.get(kv_cache_dtype, batch.dtype)
    rows = batch.randn(batch.num_blocks, page_size, head_dim)
    return rows.to(dtype), None


def mla_attention_timer(
    num_heads: int, kv_lora_rank: int, rope_dim: int, max_query_len: int, max_context: int,
    dtype: torch.dtype, device: torch.device, page_size: int = 64,
    graph_max_seq_len: int | None = None, time_fn: TimeFn | None = None,
    kv_cache_dtype: str = "auto",
) -> MeasureFn:
    """``measure_fn`` timing ``vllm_ddtree.attention_backends.mla_tree.mla_tree_verify`` for one
    request as the adaptive verify step runs it: ``max_query_len = 1 + B`` query rows
    (``dtype``) of which the first ``query_len`` are active (``active_query_lens``), on a
    dummy latent cache of ``max_context + max_query_len`` tokens (allocated once) in the
    run's ``kv_cache_dtype`` (:func:`_mla_timer_cache`: an fp8 cache takes the fp8
    Triton kernel, as the run's verify does, not the bf16 cache's Gluon kernel).
    ``graph_max_seq_len``: the split count a CUDA graph freezes (the backend sizes it
    for ``max_model_len`` when capturing). ``time_fn``: default :func:`cuda_time_fn`."""
    from vllm_ddtree.attention_backends.mla_tree import mla_tree_verify

    batch = _OneRequestBatch(max_query_len, max_context, page_size, dtype, device)
    head_dim = kv_lora_rank + rope_dim
    kv_cache, kv_scale = _mla_timer_cache(batch, page_size, head_dim, kv_cache_dtype)
    q = batch.randn(max_query_len, num_heads, head_dim)
    scale = head_dim ** -0.5
    return batch.measure_fn(time_fn or cuda_time_fn(), lambda seq_lens, active, seq_len: (
        mla_tree_verify(
            q, kv_cache, batch.block_table, seq_lens, batch.query_start_loc, batch.bits,
            scale, kv_lora_rank, max_query_len=max_query_len,
            max_seq_len=max(seq_len, graph_max_seq_len or 0), validate_values=False,
            active_query_lens=active, kv_scale=kv_scale,
        )))


def gqa_attention_timer(
    num_q_heads: int, num_kv_heads: int, head_dim: int, max_query_len: int, max_context: int,
    dtype: torch.dtype, device: torch.device, page_size: int = 64,
    time_fn: TimeFn | None = None,
) -> MeasureFn:
    """``measure_fn`` timing ``vllm_ddtree.attention_backends.gqa_tree.gqa_tree_verify`` for one
    request (full attention; sliding-window layers cost less and are modeled as full),
    ``query_len`` active rows of ``max_query_len``, as :func:`mla_attention_timer`."""
    from vllm_ddtree.attention_backends.gqa_tree import gqa_tree_verify

    batch = _OneRequestBatch(max_query_len, max_context, page_size, dtype, device)
    k_cache = batch.randn(batch.num_blocks, page_size, num_kv_heads, head_dim)
    v_cache = batch.randn(batch.num_blocks, page_size, num_kv_heads, head_dim)
    q = batch.randn(max_query_len, num_q_heads, head_dim)
    scale = head_dim ** -0.5
    return batch.measure_fn(time_fn or cuda_time_fn(), lambda seq_lens, active, seq_len: (
        gqa_tree_verify(
            q, k_cache, v_cache, batch.block_table, seq_lens, batch.query_start_loc,
            batch.bits, scale, max_query_len=max_query_len, max_seq_len=seq_len,
            validate_values=False, active_query_lens=active,
        )))


def _run_cache_dtype(vllm_config: Any) -> str:
    """vLLM's ``cache_config.cache_dtype`` (``--kv-cache-dtype``), "auto" without one."""
    cache_config = getattr(vllm_config, "cache_config", None)
    return str(getattr(cache_config, "cache_dtype", None) or "auto")


def target_attention_timer(vllm_config: Any, max_query_len: int, device: torch.device,
                           time_fn: TimeFn | None = None) -> MeasureFn:
    """The timer for the target's tree backend, with its per-GPU shapes from the HF
    config (heads / tensor-parallel size; MLA: ``kv_lora_rank``, ``qk_rope_head_dim``).

    Start-up cost: 5 contexts x ``log2(B) + 1`` query lengths x 7 launches; about
    0.1-0.5 s on an H200 for a 64-head MLA target up to 128k with B = 64 (well under
    3 s), plus the kernel's first Triton compile, which vLLM's warm-up would do anyway.
    """
    model_config = vllm_config.model_config
    parallel = vllm_config.parallel_config
    hf = model_config.hf_text_config
    dtype = model_config.dtype
    max_context = measurement_contexts(model_config.max_model_len)[-1]
    heads = model_config.get_num_attention_heads(parallel)
    if model_config.use_mla:
        mode = vllm_config.compilation_config.cudagraph_mode
        graphs = not model_config.enforce_eager and bool(mode) and mode.has_full_cudagraphs()
        return mla_attention_timer(
            heads, hf.kv_lora_rank, hf.qk_rope_head_dim, max_query_len, max_context, dtype,
            device, graph_max_seq_len=model_config.max_model_len if graphs else None,
            time_fn=time_fn, kv_cache_dtype=_run_cache_dtype(vllm_config),
        )
    return gqa_attention_timer(
        heads, model_config.get_num_kv_heads(parallel), model_config.get_head_size(),
        max_query_len, max_context, dtype, device, time_fn=time_fn,
    )
