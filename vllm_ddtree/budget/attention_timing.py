"""Timing the target's verify attention for ``ddtree_budget: "auto"``'s start-up table.

:func:`target_attention_timer` builds, from the run's vLLM config, a
``measure_fn(context, 1 + b) -> seconds``: one request's share of a batch's verify
attention in one target layer (``1 + B`` query rows a request, the first ``1 + b``
active; with adaptive verify shapes the ``1 + b`` rows a round of budget ``b``
verifies), over a batch of up to :data:`TIMING_REQUESTS` requests (summed over a
step's requests, lone requests' times would count the kernel's latency once a
request), timed with the target's own
tree kernel (MLA or GQA, the run's cache dtype and page size) on dummy tensors;
:func:`measure_attention_table` runs it over the (context x budget) grid
``vllm_ddtree.budget.policy.BudgetPolicy`` chooses from, and
:func:`measure_attention_costs` adds the one-row column of plain decoding steps. Only
start-up syncs.

How a call is timed follows the run's ``compilation_config.cudagraph_mode``
(:func:`attention_time_fn`): where decode steps replay FULL CUDA graphs (FULL,
FULL_AND_PIECEWISE, FULL_DECODE_ONLY, not ``enforce_eager``), :class:`GraphTimer`
captures the call in a ``torch.cuda.CUDAGraph`` and times replays, as the verify step
runs it; otherwise (NONE, PIECEWISE, ``enforce_eager``, a CPU device)
:func:`cuda_time_fn` times eager launches. Eager timing of small shapes measures the
host's launch overhead, which a graph replay does not pay, and would overstate short
contexts and few rows. If the capture fails, the :class:`GraphTimer` times eagerly from
then on and :func:`measure_attention_costs` times the whole grid again, so that a table
never mixes the two kinds.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch

from vllm_ddtree.budget.choice import BudgetCostTable

__all__ = [
    "CONTEXT_GRID",
    "GraphTimer",
    "MeasureFn",
    "TIMING_REQUESTS",
    "TimeFn",
    "attention_time_fn",
    "cuda_time_fn",
    "full_decode_graphs",
    "gqa_attention_timer",
    "measure_attention_costs",
    "measure_attention_table",
    "measurement_contexts",
    "mla_attention_timer",
    "target_attention_timer",
]

# Under "vllm." so that a capture failure reaches vLLM's log handler.
logger = logging.getLogger("vllm.ddtree.attention_timing")

# measure_fn(context tokens, active query rows 1 + b) -> seconds of one request's share
# of a batch's verify attention (1 + B rows, the first 1 + b active) in one layer.
MeasureFn = Callable[[int, int], float]

CONTEXT_GRID = (1024, 4096, 16384, 65536, 131072)


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
        measure_fn: seconds of one request's share of a batch's verify attention in
            one layer.
        contexts: increasing context lengths.
        budgets: increasing candidate budgets.
        device: where the table lives (the device the choice runs on).

    Returns:
        A :class:`BudgetCostTable` (``seconds [C, K]`` float32, extrapolating past the
        last context). Each row is made non-decreasing in ``b`` (a longer query never
        costs less) by lowering each time to the least at any larger ``b``: another
        process's kernels on the GPU only ever add time.
    """
    seconds = torch.tensor(
        [[float(measure_fn(int(c), 1 + int(b))) for b in budgets] for c in contexts],
        dtype=torch.float32,
    )
    if not bool(torch.isfinite(seconds).all()) or bool((seconds <= 0).any()):
        raise ValueError(f"measure_fn returned non-positive or non-finite times: {seconds}")
    # non-decreasing in b from above: a reading above a larger budget's is interference
    seconds = seconds.flip(1).cummin(dim=1).values.flip(1)
    return BudgetCostTable(
        torch.tensor(list(contexts)), torch.tensor(list(budgets)), seconds, extrapolate=True
    ).to(device)


def measure_attention_costs(
    measure_fn: MeasureFn, contexts: Sequence[int], budgets: Sequence[int],
    device: torch.device | str = "cpu", time_fn: TimeFn | None = None,
) -> tuple[BudgetCostTable, list[float]]:
    """The table of :func:`measure_attention_table` and the one-row column (a plain
    decoding step, ``measure_fn(context, 1)`` per context: host floats, seconds).

    ``time_fn``: the one ``measure_fn`` times with. When it is a :class:`GraphTimer`
    whose capture fails after it timed some cells in graphs, the table and the column
    are timed again (eagerly: the timer's fallback is sticky), so that every cell is
    of one kind.
    """
    graph_timings = time_fn.graph_timings if isinstance(time_fn, GraphTimer) else 0
    table = measure_attention_table(measure_fn, contexts, budgets, device)
    plain = [float(measure_fn(int(c), 1)) for c in contexts]
    if isinstance(time_fn, GraphTimer) and time_fn.failure is not None \
            and time_fn.graph_timings > graph_timings:
        table = measure_attention_table(measure_fn, contexts, budgets, device)
        plain = [float(measure_fn(int(c), 1)) for c in contexts]
    return table, plain


# time_fn(run) -> seconds of one call of run (CUDA events by default; tests use a clock).
TimeFn = Callable[[Callable[[], Any]], float]


def full_decode_graphs(vllm_config: Any) -> bool:
    """Whether the run's decode steps (the verify steps among them) replay FULL CUDA
    graphs: ``compilation_config.cudagraph_mode`` FULL, FULL_AND_PIECEWISE or
    FULL_DECODE_ONLY (its ``decode_mode()`` is FULL) and not ``enforce_eager``.
    NONE and PIECEWISE run attention eagerly (PIECEWISE graphs leave attention out)."""
    if vllm_config.model_config.enforce_eager:
        return False
    mode = getattr(vllm_config.compilation_config, "cudagraph_mode", None)
    return bool(mode) and mode.decode_mode().has_full_cudagraphs()


def attention_time_fn(vllm_config: Any, device: torch.device | str) -> TimeFn:
    """The ``time_fn`` of the run's verify attention: a :class:`GraphTimer` where
    decode steps replay FULL CUDA graphs on a CUDA device (:func:`full_decode_graphs`),
    else :func:`cuda_time_fn` (eager launches)."""
    if torch.device(device).type == "cuda" and full_decode_graphs(vllm_config):
        return GraphTimer()
    return cuda_time_fn()


def cuda_time_fn(warmup: int = 2, iters: int = 5, groups: int = 1) -> TimeFn:
    """A ``time_fn``: mean seconds per call over ``iters`` back-to-back launches on the
    current CUDA stream (CUDA events), after ``warmup`` calls; with ``groups`` > 1 the
    least such mean of ``groups`` timed groups (a burst of another process's kernels
    only adds time, and seldom covers every group)."""
    return lambda run: min(_time_cuda(run, warmup if g == 0 else 0, iters)
                           for g in range(groups))


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


def _capture_cuda_graph(run: Callable[[], Any], calls: int) -> torch.cuda.CUDAGraph:
    """A ``torch.cuda.CUDAGraph`` of ``calls`` back-to-back calls of ``run``, captured
    on a side stream (``capture_error_mode="thread_local"``: other threads' CUDA calls
    are not disturbed) into a memory pool of its own. The caller's current stream is
    current again afterwards, also when the capture raises: ``torch.cuda.graph``'s exit
    ends the capture before it restores the stream, and a failed capture makes the end
    raise first. A failed capture also gives its pool back
    (:func:`_release_failed_capture`)."""
    caller = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    side.wait_stream(caller)
    graph = torch.cuda.CUDAGraph()
    pool = torch.cuda.graph_pool_handle()
    device = torch.cuda.current_device()
    try:
        with torch.cuda.graph(graph, pool=pool, stream=side,
                              capture_error_mode="thread_local"):
            for _ in range(calls):
                run()
    except BaseException:
        _release_failed_capture(graph, pool, device)
        raise
    finally:
        torch.cuda.set_stream(caller)
    caller.wait_stream(side)
    return graph


def _release_failed_capture(graph: torch.cuda.CUDAGraph, pool: Any, device: int) -> None:
    """Undo what a capture that did not end left in the caching allocator. torch 2.11's
    ``CUDAGraph::capture_end`` raises on a failed ``cudaStreamEndCapture`` before it
    stops routing allocations to the graph's pool (``endAllocateToPool``), and a graph
    whose capture did not end never releases its pool. Left so, the allocator believes
    a capture is under way for the rest of the process: it no longer recycles blocks used
    on several streams (``record_stream``: vLLM's MoE shared experts, draft-token copies)
    and keeps the pool's memory reserved where vLLM's memory profile, which sizes the KV
    cache, does not count it. A graph whose capture
    ended (``graph.pool()`` answers) releases its pool when it is destroyed. Errors here
    are those of steps the failed capture never reached, and are ignored: the capture's
    own error is what the caller reports."""
    try:
        graph.pool()
        return
    except RuntimeError:
        pass
    for undo in (torch.cuda.memory._cuda_endAllocateToPool, torch.cuda.memory._cuda_releasePool):
        try:
            undo(device, pool)
        except RuntimeError:
            pass


def _median_replay_seconds(graph: torch.cuda.CUDAGraph, warmup: int, samples: int) -> float:
    """Median seconds of one replay of ``graph`` on the current stream over ``samples``
    replays, each between two CUDA events, after ``warmup`` replays (the warm-up keeps
    the GPU busy while the host enqueues the timed replays)."""
    for _ in range(warmup):
        graph.replay()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(samples)]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    events[-1][1].synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events) / 1000.0


class GraphTimer:
    """A ``time_fn`` (:data:`TimeFn`): seconds of one call of ``run`` inside a CUDA
    graph, as a FULL-graph verify step runs attention (no per-launch host overhead).

    Each call runs ``run`` once eagerly (its first call compiles kernels, which a
    capture cannot), captures ``calls_per_graph`` back-to-back calls in one graph
    (:func:`_capture_cuda_graph`: a one-kernel graph's replay would still pay a
    launch), and returns the median replay time over ``samples`` replays after
    ``warmup`` (:func:`_median_replay_seconds`) divided by ``calls_per_graph``. The
    graph is dropped afterwards (its memory pool with it).

    If a capture raises (a kernel that cannot be captured), the timer logs one warning
    naming the error, keeps it in :attr:`failure` and times every later call eagerly
    with ``eager_time_fn`` (default :func:`cuda_time_fn`): it does not try to capture
    again, cell by cell. :attr:`graph_timings` counts the calls timed in graphs
    (:func:`measure_attention_costs` times a grid again when it fell back midway).
    """

    def __init__(self, calls_per_graph: int = 4, warmup: int = 3, samples: int = 7,
                 eager_time_fn: TimeFn | None = None) -> None:
        if calls_per_graph < 1 or samples < 1 or warmup < 0:
            raise ValueError(
                f"GraphTimer(calls_per_graph={calls_per_graph}, warmup={warmup}, "
                f"samples={samples}) is not allowed: calls_per_graph >= 1, warmup >= 0, "
                "samples >= 1")
        self.calls_per_graph = calls_per_graph
        self.warmup = warmup
        self.samples = samples
        self.eager_time_fn = eager_time_fn or cuda_time_fn()
        # "ExceptionType: message" of the capture that failed; None while graphs work.
        self.failure: str | None = None
        self.graph_timings = 0

    @property
    def in_graphs(self) -> bool:
        """Whether calls are timed in CUDA graphs (no capture has failed)."""
        return self.failure is None

    def __call__(self, run: Callable[[], Any]) -> float:
        if self.failure is not None:
            return self.eager_time_fn(run)
        run()
        try:
            graph = _capture_cuda_graph(run, self.calls_per_graph)
        except Exception as e:  # noqa: BLE001 - start-up timing falls back, never stops
            self.failure = f"{type(e).__name__}: {e}"
            logger.warning("DDTree auto budget: capturing the verify attention in a CUDA "
                           "graph failed (%s); timing it eagerly instead", self.failure)
            return self.eager_time_fn(run)
        seconds = _median_replay_seconds(graph, self.warmup, self.samples)
        del graph
        self.graph_timings += 1
        return seconds / self.calls_per_graph


def _chain_bits(rows: int, device: torch.device) -> torch.Tensor:
    from vllm_ddtree.tree.draft_tree import pack_ancestor_mask

    mask = torch.ones(rows, rows, dtype=torch.bool).tril()
    return pack_ancestor_mask(mask).to(device)


# Requests in the dummy verify batch: one request's attention is the launch's time over
# this many (capped by the run's max_num_seqs). Alone, a request at a short context
# costs the kernel's latency (about 26 us a layer on an H100 at 1k for a
# V2-Lite-shaped target), which a batch pays once: summed over 64 requests and 27
# layers it modeled 45 ms of attention the step never spent.
TIMING_REQUESTS = 64
# ... and at most this many query rows in all (its dummy queries, outputs and split
# partials: at 128 heads about 3 GB for 8192 rows).
_TIMING_ROWS = 8192
# Cached tokens the dummy batch holds at most in distinct pages (as the single request
# of the longest context did): past it requests share pages, copy by copy.
_TIMING_CACHE_TOKENS = 131072


class _VerifyBatch:
    """The dummy verify batch both timers share: ``num_reqs`` requests of up to
    ``max_query_len`` rows each (chain bits) over a paged cache of ``max_context +
    max_query_len`` tokens a request, in distinct pages while the batch holds at most
    :data:`_TIMING_CACHE_TOKENS` tokens (else requests share page copies in turn).
    ``randn`` draws the dummy tensors (fixed seed).

    ``adaptive_shapes``: the run verifies adaptive shapes (``ddtree_verify_shape``
    "adaptive"), so a round of budget ``b`` launches ``1 + b`` rows, all active; else
    every round launches ``max_query_len`` rows, the first ``1 + b`` active."""

    def __init__(self, max_query_len: int, max_context: int, page_size: int,
                 dtype: torch.dtype, device: torch.device,
                 adaptive_shapes: bool = False, num_reqs: int = 1) -> None:
        if num_reqs < 1:
            raise ValueError(f"num_reqs must be >= 1, got {num_reqs}")
        self.dtype, self.device = dtype, device
        self.max_query_len = max_query_len
        self.adaptive_shapes = adaptive_shapes
        self.num_reqs = num_reqs
        tokens = max_context + max_query_len
        blocks = -(-tokens // page_size)
        copies = max(1, min(num_reqs, _TIMING_CACHE_TOKENS // tokens))
        self.num_blocks = copies * blocks
        self.gen = torch.Generator(device=device).manual_seed(0)
        copy = torch.arange(num_reqs, dtype=torch.int32, device=device) % copies
        self.block_table = (copy[:, None] * blocks
                            + torch.arange(blocks, dtype=torch.int32, device=device)[None])
        self.bits = _chain_bits(max_query_len, device)
        self.num_rows = num_reqs * max_query_len

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=self.gen, device=self.device,
                           dtype=torch.float32).to(self.dtype)

    def measure_fn(self, time_fn: TimeFn, attend: Callable[..., Any]) -> MeasureFn:
        """``measure(context, query_len)``: ``time_fn`` of ``attend(rows,
        query_start_loc, seq_lens, active_query_lens, bits, seq_len)`` (the launched
        query rows of the batch, int32 ``[R + 1]`` / ``[R]`` / ``[R]`` tensors, int64
        ancestor bits ``[rows, W]`` and the host seq_len) for ``R = num_reqs`` requests
        of ``context`` cached tokens and ``query_len`` active rows each (``query_len``
        rows a request with adaptive shapes, else ``max_query_len``), divided by ``R``:
        one request's share of a batch's launch."""
        def measure(context: int, query_len: int) -> float:
            per_req = query_len if self.adaptive_shapes else self.max_query_len
            seq_len = context + per_req
            n = self.num_reqs
            i32 = dict(dtype=torch.int32, device=self.device)
            query_start_loc = torch.arange(n + 1, **i32) * per_req
            seq_lens = torch.full((n,), seq_len, **i32)
            active = torch.full((n,), query_len, **i32)
            bits = self.bits[:per_req].repeat(n, 1)
            rows = n * per_req
            return time_fn(lambda: attend(rows, query_start_loc, seq_lens, active, bits,
                                          seq_len)) / n

        return measure


# vLLM's --kv-cache-dtype names the tree MLA backend takes as an e4m3 cache (as
# attention_backends/mla_tree/backend.py's FP8_KV_CACHE_DTYPES).
_FP8_CACHE_DTYPES = ("fp8", "fp8_e4m3")
_CACHE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def _mla_timer_cache(batch: _VerifyBatch, page_size: int, head_dim: int,
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
    kv_cache_dtype: str = "auto", adaptive_shapes: bool = False, num_reqs: int = 1,
) -> MeasureFn:
    """``measure_fn`` timing ``vllm_ddtree.attention_backends.mla_tree.mla_tree_verify`` for one
    request's share of a batch of ``num_reqs`` (:class:`_VerifyBatch`) as the adaptive
    verify step runs it: ``max_query_len = 1 + B`` query rows
    (``dtype``) of which the first ``query_len`` are active (``active_query_lens``), or
    with ``adaptive_shapes`` ``query_len`` rows, on a dummy latent cache of
    ``max_context + max_query_len`` tokens (allocated once) in the run's
    ``kv_cache_dtype`` (:func:`_mla_timer_cache`: an fp8 cache takes the fp8
    Triton kernel, as the run's verify does, not the bf16 cache's Gluon kernel).
    ``graph_max_seq_len``: the split count a CUDA graph freezes (the backend sizes it
    for ``max_model_len`` when capturing; it then also resolves the split count per
    request on the device, ``runtime_kv_splits``). ``adaptive_shapes``: the run
    verifies adaptive shapes (a round of budget ``b`` launches ``1 + b`` rows) with the
    backend's ``TREE_MASK_STATE.mostly_active`` set, which on sm_90 lets the Gluon
    kernel compute every row (it ignores the active count): timing it on ``1 + B`` rows
    would give every budget the cost of B. ``time_fn``: default :func:`cuda_time_fn`."""
    from vllm_ddtree.attention_backends.mla_tree import mla_tree_verify
    from vllm_ddtree.attention_backends.mla_tree.ops import quantize_query

    batch = _VerifyBatch(max_query_len, max_context, page_size, dtype, device,
                         adaptive_shapes, num_reqs)
    head_dim = kv_lora_rank + rope_dim
    kv_cache, kv_scale = _mla_timer_cache(batch, page_size, head_dim, kv_cache_dtype)
    q = batch.randn(batch.num_rows, num_heads, head_dim)
    q_scale = None
    if kv_scale is not None:  # the e4m3 query MLAAttention hands an fp8 cache's backend
        q_scale = torch.ones((), dtype=torch.float32, device=batch.device)
        q = quantize_query(q, q_scale)
    scale = head_dim ** -0.5

    def attend(rows, query_start_loc, seq_lens, active, bits, seq_len):
        return mla_tree_verify(
            q[:rows], kv_cache, batch.block_table, seq_lens, query_start_loc, bits,
            scale, kv_lora_rank, max_query_len=rows // batch.num_reqs,
            max_seq_len=max(seq_len, graph_max_seq_len or 0), validate_values=False,
            active_query_lens=active, kv_scale=kv_scale, q_scale=q_scale,
            out_dtype=None if kv_scale is None else dtype, mostly_active=adaptive_shapes,
            runtime_kv_splits=graph_max_seq_len is not None,
        )

    return batch.measure_fn(time_fn or cuda_time_fn(), attend)


def gqa_attention_timer(
    num_q_heads: int, num_kv_heads: int, head_dim: int, max_query_len: int, max_context: int,
    dtype: torch.dtype, device: torch.device, page_size: int = 64,
    time_fn: TimeFn | None = None, adaptive_shapes: bool = False, num_reqs: int = 1,
) -> MeasureFn:
    """``measure_fn`` timing ``vllm_ddtree.attention_backends.gqa_tree.gqa_tree_verify`` for one
    request's share of a batch of ``num_reqs`` (full attention; sliding-window layers
    cost less and are modeled as full), ``query_len`` active rows of ``max_query_len``
    (``adaptive_shapes``: of ``query_len``), as :func:`mla_attention_timer`."""
    from vllm_ddtree.attention_backends.gqa_tree import gqa_tree_verify

    batch = _VerifyBatch(max_query_len, max_context, page_size, dtype, device,
                         adaptive_shapes, num_reqs)
    k_cache = batch.randn(batch.num_blocks, page_size, num_kv_heads, head_dim)
    v_cache = batch.randn(batch.num_blocks, page_size, num_kv_heads, head_dim)
    q = batch.randn(batch.num_rows, num_q_heads, head_dim)
    scale = head_dim ** -0.5

    def attend(rows, query_start_loc, seq_lens, active, bits, seq_len):
        return gqa_tree_verify(
            q[:rows], k_cache, v_cache, batch.block_table, seq_lens, query_start_loc,
            bits, scale, max_query_len=rows // batch.num_reqs, max_seq_len=seq_len,
            validate_values=False, active_query_lens=active,
        )

    return batch.measure_fn(time_fn or cuda_time_fn(), attend)


def _run_cache_dtype(vllm_config: Any) -> str:
    """vLLM's ``cache_config.cache_dtype`` (``--kv-cache-dtype``), "auto" without one."""
    cache_config = getattr(vllm_config, "cache_config", None)
    return str(getattr(cache_config, "cache_dtype", None) or "auto")


def _run_page_size(vllm_config: Any) -> int:
    """The KV page the run's attention reads: vLLM's ``cache_config.block_size``
    (``--block-size``, or what the backend chose); 64, the tree backends' preference,
    where it is not set yet."""
    cache_config = getattr(vllm_config, "cache_config", None)
    block_size = getattr(cache_config, "block_size", None)
    return int(block_size) if isinstance(block_size, int) and block_size > 0 else 64


def target_attention_timer(vllm_config: Any, max_query_len: int, device: torch.device,
                           time_fn: TimeFn | None = None,
                           adaptive_shapes: bool = False) -> MeasureFn:
    """The timer for the target's tree backend, with its per-GPU shapes from the HF
    config (heads / tensor-parallel size; MLA: ``kv_lora_rank``, ``qk_rope_head_dim``),
    over a batch of ``min(TIMING_REQUESTS, max_num_seqs)`` requests (fewer where their
    ``max_query_len`` rows would pass 8192 in all).
    ``time_fn``: default :func:`attention_time_fn` (graph replays where the run's
    decode steps replay FULL CUDA graphs, else eager launches). ``adaptive_shapes``:
    the run verifies adaptive shapes, ``1 + b`` rows for budget ``b`` (see
    :func:`mla_attention_timer`).

    Start-up cost: 5 contexts x ``log2(B) + 1`` query lengths (and the one-row column),
    eagerly 7 launches each, plus the kernel's first Triton compile, which vLLM's
    warm-up would do anyway. In graphs each also takes one eager launch, a capture of 4
    calls and 10 replays (:class:`GraphTimer`). One request a launch took about 0.1-0.5
    s on an H200 for a 64-head MLA target up to 128k with B = 64, and 2.8 s in graphs on
    an H100 for a V2-Lite-shaped one at 1.5k; a batch's launch reads up to 64 requests'
    keys (at 128k: about 10 GB, some 3 ms, a launch), which adds a few seconds at long
    contexts (estimated, not yet measured).
    """
    model_config = vllm_config.model_config
    parallel = vllm_config.parallel_config
    hf = model_config.hf_text_config
    dtype = model_config.dtype
    max_context = measurement_contexts(model_config.max_model_len)[-1]
    heads = model_config.get_num_attention_heads(parallel)
    time_fn = time_fn or attention_time_fn(vllm_config, device)
    max_num_seqs = getattr(getattr(vllm_config, "scheduler_config", None), "max_num_seqs",
                           None)
    num_reqs = max(1, min(TIMING_REQUESTS, int(max_num_seqs or 1),
                          _TIMING_ROWS // max_query_len))
    if model_config.use_mla:
        graphs = full_decode_graphs(vllm_config)
        return mla_attention_timer(
            heads, hf.kv_lora_rank, hf.qk_rope_head_dim, max_query_len, max_context, dtype,
            device, graph_max_seq_len=model_config.max_model_len if graphs else None,
            page_size=_run_page_size(vllm_config), time_fn=time_fn,
            kv_cache_dtype=_run_cache_dtype(vllm_config), adaptive_shapes=adaptive_shapes,
            num_reqs=num_reqs,
        )
    return gqa_attention_timer(
        heads, model_config.get_num_kv_heads(parallel), model_config.get_head_size(),
        max_query_len, max_context, dtype, device, page_size=_run_page_size(vllm_config),
        time_fn=time_fn, adaptive_shapes=adaptive_shapes, num_reqs=num_reqs,
    )
