# SPDX-License-Identifier: Apache-2.0
"""Launcher of MLA tree-verify attention: validation, config choice, kernel launches."""

from __future__ import annotations

import functools
import logging
import math

import torch

from vllm_ddtree import settings

from . import cascade, dispatch, fp8_transposed, gluon_kernel, kernels
from .configs import (
    MAX_KV_SPLITS,
    MIN_TILES_PER_SPLIT,
    SM120_SHARED_MEMORY_BYTES,
    MLATileConfig,
    fit_config,
    mma_dtype_of,
    next_pow2,
    padded_dims,
    resolve_num_kv_splits,
    select_config,
    split_slots,
)
from .tree_mask import check_tree_batch

_SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# vLLM's MLA cache under --kv-cache-dtype fp8 / fp8_e4m3 (allocated uint8, viewed as
# this dtype by MLAAttention.forward_impl before forward_mqa).
FP8_KV_DTYPE = torch.float8_e4m3fn
E4M3_MAX = 448.0
MAX_ROPE_DIM = 64


logger = logging.getLogger(__name__)
_LOGGED_LAUNCHES: set[tuple] = set()

KERNEL_CHOICES = ("auto", "triton")
KERNEL_ENV = "VLLM_DDTREE_MLA_KERNEL"  # read through vllm_ddtree.settings


def _log_launch_once(kernel: str, q: torch.Tensor, kv_cache: torch.Tensor, **params) -> None:
    """Debug log of a launch's shapes, strides and chosen splits, once per distinct
    launch (what vLLM hands the kernel, to time it alone in the benchmark). Costs one
    level check when DEBUG is off."""
    if not logger.isEnabledFor(logging.DEBUG):
        return
    key = (kernel, tuple(q.shape), q.stride(), tuple(kv_cache.shape), kv_cache.stride(),
           tuple(sorted(params.items())))
    if key not in _LOGGED_LAUNCHES:
        _LOGGED_LAUNCHES.add(key)
        logger.debug("mla_tree launch %s: q %s %s, kv_cache %s %s, %s", kernel,
                     tuple(q.shape), q.stride(), tuple(kv_cache.shape), kv_cache.stride(),
                     ", ".join(f"{k}={v}" for k, v in sorted(params.items())))


@functools.lru_cache(maxsize=16)
def _max_shared_memory(device: torch.device) -> int:
    """Shared memory per block the tile choice plans for: the device's opt-in on sm_90,
    where the large tiles were compiled and measured; elsewhere sm_120's budget, whose
    tiles are compiled for sm_120 and tested (forced) on sm_90. The estimate behind the
    choice models mma.sync only (``configs.estimate_shared_memory_bytes``), so a 64-row tile
    that it fits in an sm_80 / sm_100 opt-in was never checked there. Cached: asked per
    launch, and the driver's properties query costs tens of microseconds."""
    if device.type == "cuda" and dispatch.device_arch(device) == "sm_90":
        props = torch.cuda.get_device_properties(device)
        return getattr(props, "shared_memory_per_block_optin", SM120_SHARED_MEMORY_BYTES)
    return SM120_SHARED_MEMORY_BYTES


def _fp8_transposed_fits(kv_scale: torch.Tensor | None, kv_lora_rank: int) -> bool:
    """Whether the transposed fp8 kernel can take this launch unasked (an fp8 cache,
    its latent at most ``fp8_transposed.MAX_KV_LORA_RANK`` wide)."""
    return kv_scale is not None and kv_lora_rank <= fp8_transposed.MAX_KV_LORA_RANK


def _check_mla_inputs(
    q: torch.Tensor, kv_cache: torch.Tensor, scale: float, kv_lora_rank: int,
    kv_scale: torch.Tensor | None = None, q_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.dtype:
    """Checks a launch's tensors and scales; returns the output's dtype (q's, or with
    an fp8 cache ``out_dtype``, default bf16)."""
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ValueError(f"q must be a 3-D tensor [T, H, D], got {getattr(q, 'shape', q)}")
    if not isinstance(kv_cache, torch.Tensor) or kv_cache.dim() != 3:
        raise ValueError(
            "kv_cache must be a 3-D latent cache [num_blocks, page_size, D], "
            f"got {getattr(kv_cache, 'shape', kv_cache)}"
        )
    fp8 = kv_cache.dtype == FP8_KV_DTYPE
    if fp8 and q.dtype != FP8_KV_DTYPE:
        raise ValueError(
            f"q must be {FP8_KV_DTYPE} with an {FP8_KV_DTYPE} kv_cache (vLLM's quantized "
            f"query, e4m3(q / q_scale): quantize_query), got {q.dtype}")
    if not fp8 and q.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"q must be bf16, fp16 or fp32 (or {FP8_KV_DTYPE} with an fp8 "
                         f"kv_cache), got {q.dtype}")
    if not fp8 and kv_cache.dtype != q.dtype:
        raise ValueError(f"kv_cache dtype {kv_cache.dtype} must equal q dtype {q.dtype} "
                         f"or be {FP8_KV_DTYPE} (an fp8 cache, with kv_scale and q_scale)")
    if kv_cache.device != q.device:
        raise ValueError(f"kv_cache is on {kv_cache.device}, q on {q.device}")
    head_dim = q.shape[2]
    if kv_cache.shape[2] != head_dim:
        raise ValueError(
            f"kv_cache last dim {kv_cache.shape[2]} must equal q's head dim {head_dim}"
        )
    if not isinstance(kv_lora_rank, int) or kv_lora_rank < 16 or kv_lora_rank % 16:
        raise ValueError(f"kv_lora_rank must be a positive multiple of 16, got {kv_lora_rank}")
    rope = head_dim - kv_lora_rank
    if not 0 <= rope <= MAX_ROPE_DIM:
        raise ValueError(
            f"q's head dim {head_dim} = kv_lora_rank ({kv_lora_rank}) + rope dim must have "
            f"a rope dim in [0, {MAX_ROPE_DIM}], got {rope}"
        )
    if q.stride(2) != 1 or kv_cache.stride(2) != 1:
        raise ValueError("q and kv_cache must be contiguous along the head dim")
    if not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite float, got {scale!r}")
    if not fp8:
        for name, value in (("kv_scale", kv_scale), ("q_scale", q_scale)):
            if value is not None:
                raise ValueError(f"{name} applies to an {FP8_KV_DTYPE} kv_cache only; "
                                 f"kv_cache is {kv_cache.dtype}")
        if out_dtype is not None and out_dtype != q.dtype:
            raise ValueError(f"out_dtype applies to an {FP8_KV_DTYPE} kv_cache only (the "
                             f"output takes q's dtype {q.dtype}), got {out_dtype}")
        return q.dtype
    for name, value, source in (("kv_scale", kv_scale, "layer._k_scale"),
                                ("q_scale", q_scale, "layer._q_scale")):
        if (not isinstance(value, torch.Tensor) or value.numel() != 1
                or value.dtype != torch.float32 or value.device != q.device):
            raise ValueError(
                f"{name} must be a one-element float32 tensor on q's device (vLLM's "
                f"{source}), got {_describe(value)}")
    out_dtype = torch.bfloat16 if out_dtype is None else out_dtype
    if out_dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"out_dtype must be bf16, fp16 or fp32, got {out_dtype}")
    return out_dtype


def quantize_query(q: torch.Tensor, q_scale: torch.Tensor) -> torch.Tensor:
    """e4m3 ``clamp(q * (1 / q_scale), +-448)``, q's shape: the query an fp8 cache's
    launch takes, as vLLM's ``MLAAttention`` quantizes it (``QuantFP8``'s static
    per-tensor path with ``layer._q_scale``) for backends with
    ``supports_quant_query_input`` (benchmarks and tests; vLLM fuses it into its query
    concatenation)."""
    inverse = q_scale.float().reciprocal()
    return (q.float() * inverse).clamp(-E4M3_MAX, E4M3_MAX).to(FP8_KV_DTYPE)


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"{value.dtype} {tuple(value.shape)} on {value.device}"
    return repr(value)


def prepare_outputs(
    q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, ancestor_bits: torch.Tensor,
    kv_lora_rank: int, max_query_len: int | None, max_seq_len: int | None,
    validate_values: bool, out: torch.Tensor | None,
    active_query_lens: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
):
    """The tree-batch checks of a launch (``check_tree_batch``: its stats, with the
    maxima) and its results' buffers: ``out [T, H, kv_lora_rank]`` in ``out_dtype``
    (default q's; the caller's, checked, or new) and ``lse [T, H]`` fp32. Shared by the
    Triton and Gluon launchers (:func:`mla_tree_verify`, :func:`mla_tree_fwd_gluon`)."""
    num_tokens, num_heads, _ = q.shape
    num_blocks, page_size, _ = kv_cache.shape
    stats = check_tree_batch(
        num_tokens=num_tokens,
        device=q.device,
        block_table=block_table,
        seq_lens=seq_lens,
        query_start_loc=query_start_loc,
        ancestor_bits=ancestor_bits,
        page_size=page_size,
        num_blocks=num_blocks,
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        validate_values=validate_values,
        active_query_lens=active_query_lens,
    )
    out_dtype = q.dtype if out_dtype is None else out_dtype
    if out is None:
        out = torch.empty(num_tokens, num_heads, kv_lora_rank, dtype=out_dtype, device=q.device)
    elif out.shape != (num_tokens, num_heads, kv_lora_rank) or out.dtype != out_dtype:
        raise ValueError(
            f"out must be [{num_tokens}, {num_heads}, {kv_lora_rank}] {out_dtype}, "
            f"got {tuple(out.shape)} {out.dtype}"
        )
    elif out.stride(2) != 1:
        raise ValueError("out must be contiguous along its last dimension")
    lse = torch.empty(num_tokens, num_heads, dtype=torch.float32, device=q.device)
    return stats, out, lse


def compact_partials(
    num_rows: int, width: int, num_tokens: int, num_heads: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Buffers of an active-row launch (``kernels._resplit_active_rows``): fp32 partial
    outputs ``[num_rows, width]`` and LSEs ``[num_rows]`` (one ``BLOCK_M``-row slab per
    CTA), and the per-row split index, int32 ``[T, H]`` base row and count (zeroed:
    rows no CTA writes, e.g. CUDA-graph padding, merge to ``0 / -inf``)."""
    f32, i32 = dict(dtype=torch.float32, device=device), dict(dtype=torch.int32, device=device)
    return (torch.empty(num_rows, width, **f32), torch.empty(num_rows, **f32),
            torch.empty(num_tokens, num_heads, **i32), torch.zeros(num_tokens, num_heads, **i32))


def merge_splits(
    out_buf: torch.Tensor, lse_buf: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    num_kv_splits: int, row_blocks: int, merge_base: torch.Tensor, merge_count: torch.Tensor,
    block_m: int, block_l: int, has_active: bool,
) -> None:
    """Launch ``kernels._mla_tree_merge_kernel`` over ``out [T, H, L]`` / ``lse [T, H]``:
    partials ``[T, H, S, L]`` / ``[T, H, S]`` (``S = num_kv_splits``), or with
    ``has_active`` the compact ones of :func:`compact_partials`, where a row has up to
    every CTA of its request (``row_blocks * S``) as splits."""
    max_splits = row_blocks * num_kv_splits if has_active else num_kv_splits
    num_tokens, num_heads, width = out.shape
    if has_active:
        out_strides, lse_strides = (out_buf.stride(0), 0, 0), (lse_buf.stride(0), 0, 0)
    else:
        out_strides, lse_strides = out_buf.stride()[:3], lse_buf.stride()[:3]
    kernels._mla_tree_merge_kernel[(num_tokens, num_heads)](
        out_buf, lse_buf, out, lse,
        max_splits,
        *out_strides,
        *lse_strides,
        out.stride(0), out.stride(1),
        lse.stride(0), lse.stride(1),
        merge_base, merge_count, num_heads, block_m,
        KV_LORA=width,
        BLOCK_L=block_l,
        BLOCK_S=1 if has_active else next_pow2(max_splits),
        HAS_ACTIVE=has_active,
        num_warps=4,
    )  # fmt: skip


def tree_launch_options(
    q: torch.Tensor, config, seq_lens: torch.Tensor,
    active_query_lens: torch.Tensor | None, merge_base: torch.Tensor,
    merge_count: torch.Tensor, num_q_heads: int,
) -> dict:
    """Keyword arguments the MLA and GQA tree kernels take alike: the dot precision for
    q's dtype, the active-row inputs (``seq_lens`` stands in, unread, without
    ``active_query_lens``), the re-split bounds and ``config``'s warps and stages."""
    has_active = active_query_lens is not None
    return dict(
        **kernels.dot_options(q.dtype),
        ActiveQueryLens=active_query_lens if has_active else seq_lens,
        MergeBase=merge_base,
        MergeCount=merge_count,
        stride_mt=num_q_heads,
        HAS_ACTIVE=has_active,
        MIN_TILES=MIN_TILES_PER_SPLIT,
        MAX_SPLITS=MAX_KV_SPLITS,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


def mla_tree_verify(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    ancestor_bits: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
    *,
    num_kv_splits: int | None = None,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    validate_values: bool = True,
    config: MLATileConfig | None = None,
    out: torch.Tensor | None = None,
    active_query_lens: torch.Tensor | None = None,
    mostly_active: bool = False,
    kernel: str = "auto",
    runtime_kv_splits: bool = False,
    kv_scale: torch.Tensor | None = None,
    q_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    cascade_plan: cascade.CascadePlan | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA attention of tree-verify query tokens against a latent paged cache.

    Absorbed MLA: a cached row is the latent ``[kv_lora_rank + rope_dim]`` vector; K is
    the whole row, V its first ``kv_lora_rank`` entries. The new tokens of request ``r``
    are q rows ``query_start_loc[r]:query_start_loc[r+1]`` and the last ``qlen_r`` keys
    of its sequence (positions ``seq_len - qlen .. seq_len - 1``). Every context key is
    visible; new key ``j`` is visible to new token ``t`` iff bit ``j`` of
    ``ancestor_bits[t]`` is set (and ``j <= t``, topological order).

    Args:
        q: ``[T, H, kv_lora_rank + rope_dim]`` bf16/fp16/fp32, rope_dim in 0..64; with
            an fp8 cache ``torch.float8_e4m3fn``: vLLM's quantized query, ``q / q_scale``
            (:func:`quantize_query`), the one every fp8 kernel reads, as FlashMLA's
            fp8 path does (its rounding does not depend on the batch or on the kernel
            the launch takes, so a tree verify scores its keys as plain decoding does).
        kv_cache: ``[num_blocks, page_size, kv_lora_rank + rope_dim]``, q's dtype, or
            ``torch.float8_e4m3fn`` (vLLM's ``--kv-cache-dtype fp8`` MLA cache: a
            row holds ``x / kv_scale``; a Triton kernel, or on sm_90 the cascade).
        block_table: int32 ``[R, max_blocks]``.
        seq_lens: int32 ``[R]``: context + new tokens of each request.
        query_start_loc: int32 ``[R + 1]``.
        ancestor_bits: int64 ``[>= T, W]`` (row t: query token t; extra rows are
            ignored), ``W >= ceil(max_query_len / 64)``, last dim contiguous.
        scale: softmax scale of ``q . k``.
        kv_lora_rank: multiple of 16.
        num_kv_splits: CTAs per request along the keys; None picks it from the context
            length and the SM count.
        max_query_len, max_seq_len: host-side maxima; required with
            ``validate_values=False`` (no device sync, CUDA-graph friendly).
        validate_values: check the metadata values on the host (one sync).
        config: force a tile config (benchmarks); it is shrunk only if it does not fit
            the device's shared memory per block (the estimate models mma.sync GPUs).
            One with ``fp8_transposed`` (``configs.FP8_TRANSPOSED_TILE_CONFIGS``, fp8
            caches only) runs the fp8 kernel with transposed products.
        out: optional ``[T, H, kv_lora_rank]`` output buffer in the output's dtype.
        active_query_lens: optional int32 ``[R]``, ``1 <= active_query_lens[r] <= qlen_r``
            (adaptive tree budget): only the first ``active_query_lens[r]`` new tokens of
            request ``r`` are real; the Triton kernel gives the others (inactive rows) no KV
            loads and ``out = 0, lse = -inf``, the Gluon kernel computes them as ordinary
            rows; callers read only active rows. The active tokens must not see an
            inactive one
            (they form a prefix-closed tree in topological order); their results are
            those without ``active_query_lens`` up to rounding (their keys are split
            over the idle CTAs too, so the splits differ). None: every row is active.
        kernel: ``"auto"``: the kernel and tile config measured fastest for the launch's
            architecture, cache dtype, heads, rows and context (``dispatch``: a table
            generated from the sm_90 grid; consulted when ``max_query_len`` and
            ``max_seq_len`` are given, as the backend does; its ``"cascade"``, FlashMLA
            over the context and our kernel over the tree (``cascade``), runs only with
            a ``cascade_plan`` where ``cascade.cascade_supported``, else the rule does);
            without an entry the Gluon
            kernel (``gluon_kernel``) where it applies (sm_90, 16-bit, 512 + 64 dims, no
            ``config``: :func:`gluon_kernel.gluon_supported`), else the Triton one (on
            sm_90 with an fp8 cache the transposed-products tile,
            ``dispatch.fp8_transposed_method``, where ``kv_lora_rank`` allows it);
            ``"triton"`` forces Triton. ``VLLM_DDTREE_MLA_KERNEL=triton``
            (``vllm_ddtree.settings``) does the same globally; ``=cascade`` takes the
            cascade wherever it can run. A launch with
            ``active_query_lens`` takes the Gluon kernel only when ``mostly_active``.
        mostly_active: more than half of each request's rows are active (adaptive verify
            shapes). The Gluon kernel then computes the inactive rows too (never read: the
            walk stops at each request's active count): on the H200 that is about 2x
            faster than the Triton kernel skipping them from 33 of 65 active rows up,
            while at 9 of 65 with a long context or 64 heads skipping wins 1.5-3.3x
            (``evals/results/inactive_rows.md``).
        runtime_kv_splits: the split count resolved from ``num_kv_splits`` /
            ``max_seq_len`` only sizes the grid; each request splits its keys as the
            host would choose for its own ``seq_len`` (at most that many ways; the other
            CTAs exit at once). For CUDA graphs, whose grid is frozen at capture for the
            longest context. Ignored with ``active_query_lens`` (its re-split is its own).
        kv_scale: fp32 one-element tensor on q's device, required with an fp8 cache and
            refused otherwise: keys and values are ``kv_scale * row`` (read on the device
            at each launch, so a CUDA graph follows later updates of the scale).
        q_scale: the same for the quantized query (vLLM's ``layer._q_scale``): queries
            are ``q_scale * q``.
        out_dtype: the output's dtype with an fp8 cache (default bf16); a 16-bit or
            fp32 q's output takes q's dtype.
        cascade_plan: a :class:`cascade.CascadePlan` shared by the launches of one step
            (the caller vouches that every request has ``max_query_len`` new tokens);
            None: never the cascade.

    Returns:
        ``out [T, H, kv_lora_rank]`` (q's dtype, or ``out_dtype``) and ``lse [T, H]``
        fp32, the natural log of the softmax denominator ``sum_k exp(scale * q.k)`` over
        visible keys. A row that sees no key, or is inactive on the Triton kernel, gets
        ``out = 0, lse = -inf``. Rows not covered by ``query_start_loc`` (padding) hold
        unspecified values.
    """
    out_dtype = _check_mla_inputs(q, kv_cache, scale, kv_lora_rank, kv_scale, q_scale,
                                  out_dtype)
    if kernel not in KERNEL_CHOICES:
        raise ValueError(f"kernel must be one of {KERNEL_CHOICES}, got {kernel!r}")
    if config is not None and config.fp8_transposed:
        if kv_scale is None:
            raise ValueError(f"config.fp8_transposed applies to an {FP8_KV_DTYPE} kv_cache "
                             f"only; kv_cache is {kv_cache.dtype}")
        if kv_lora_rank > fp8_transposed.MAX_KV_LORA_RANK:
            raise ValueError(f"config.fp8_transposed takes kv_lora_rank up to "
                             f"{fp8_transposed.MAX_KV_LORA_RANK}, got {kv_lora_rank}")
    choice = None
    mode = settings.get(KERNEL_ENV) if kernel == "auto" and config is None else "off"
    if mode == "cascade":
        choice = "cascade"
    elif mode == "auto" and max_query_len is not None and max_seq_len is not None:
        choice = dispatch.lookup(dispatch.device_arch(q.device),
                                 dispatch.cache_class(kv_cache.dtype), q.shape[1],
                                 max_query_len, max_seq_len)
    if choice in dispatch.TRITON_CONFIGS:
        config = dispatch.TRITON_CONFIGS[choice]
        if config.fp8_transposed and not _fp8_transposed_fits(kv_scale, kv_lora_rank):
            config = None  # an entry measured at other dims: the rule below
    elif (choice == "cascade" and cascade_plan is not None
          and (active_query_lens is None or mostly_active)
          and (out is None or out.is_contiguous())
          and (kv_scale is None or out_dtype == torch.bfloat16)  # FlashMLA's fp8 output
          and cascade.cascade_supported(q, kv_cache, kv_lora_rank, seq_lens.shape[0],
                                        max_query_len)):
        _, out, lse = prepare_outputs(
            q, kv_cache, block_table, seq_lens, query_start_loc, ancestor_bits,
            kv_lora_rank, max_query_len, max_seq_len, validate_values, out,
            out_dtype=out_dtype)
        _log_launch_once("cascade", q, kv_cache, requests=seq_lens.shape[0],
                         max_query_len=max_query_len, max_seq_len=max_seq_len)
        return cascade.mla_tree_verify_cascade(
            q, kv_cache, block_table, seq_lens, query_start_loc, ancestor_bits, scale,
            out, lse, max_query_len, cascade_plan, kv_scale, q_scale,
            _max_shared_memory(q.device))
    if (mode in ("auto", "cascade") and config is None and kv_scale is None
            and (active_query_lens is None or mostly_active)
            and gluon_kernel.gluon_supported(q, kv_cache, kv_lora_rank)):
        return _launch_gluon(
            q, kv_cache, block_table, seq_lens, query_start_loc, ancestor_bits, scale,
            kv_lora_rank, num_kv_splits=num_kv_splits, max_query_len=max_query_len,
            max_seq_len=max_seq_len, validate_values=validate_values, out=out,
            runtime_kv_splits=runtime_kv_splits)
    num_tokens, num_heads, head_dim = q.shape
    page_size = kv_cache.shape[1]
    stats, out, lse = prepare_outputs(
        q, kv_cache, block_table, seq_lens, query_start_loc, ancestor_bits, kv_lora_rank,
        max_query_len, max_seq_len, validate_values, out, active_query_lens, out_dtype)
    num_reqs = seq_lens.shape[0]
    if num_reqs == 0 or stats.max_query_len == 0 or num_tokens == 0:
        return out, lse

    rows = stats.max_query_len * num_heads
    if (config is None and _fp8_transposed_fits(kv_scale, kv_lora_rank)
            and dispatch.device_arch(q.device) == "sm_90"):
        config = dispatch.TRITON_CONFIGS[dispatch.fp8_transposed_method(rows)]
    mma_dtype = mma_dtype_of(q.dtype)
    if config is None:
        config = select_config(rows, head_dim, kv_lora_rank, mma_dtype,
                               _max_shared_memory(q.device))
    else:
        budget = _max_shared_memory(q.device)
        config = fit_config(config, head_dim, kv_lora_rank, mma_dtype, budget=budget)
    row_blocks = -(-rows // config.block_m)
    num_kv_splits = resolve_num_kv_splits(
        num_kv_splits, num_requests=num_reqs, row_blocks=row_blocks,
        max_keys=stats.max_seq_len, block_n=config.block_n, device=q.device,
        ctas_per_sm=config.ctas_per_sm,
        runtime=runtime_kv_splits and active_query_lens is None,
    )

    block_l, block_r = padded_dims(head_dim, kv_lora_rank)
    has_active = active_query_lens is not None
    merge_base = merge_count = seq_lens  # dummies, never read without active rows
    if has_active:
        # Active rows re-split their keys over the CTAs of inactive ones (kernels.py):
        # compact partials, one BLOCK_M-row slab per CTA, and a per-row split index.
        out_buf, lse_buf, merge_base, merge_count = compact_partials(
            num_reqs * row_blocks * num_kv_splits * config.block_m, kv_lora_rank,
            num_tokens, num_heads, q.device)
        out_strides = (out_buf.stride(0), 0, 0)
        lse_strides = (lse_buf.stride(0), 0, 0)
    elif num_kv_splits == 1:
        out_buf, lse_buf = out, lse
        out_strides = (out.stride(0), out.stride(1), 0)
        lse_strides = (lse.stride(0), lse.stride(1), 0)
    else:
        out_buf = torch.empty(
            num_tokens, num_heads, num_kv_splits, kv_lora_rank,
            dtype=torch.float32, device=q.device,
        )  # fmt: skip
        lse_buf = torch.empty(
            num_tokens, num_heads, num_kv_splits, dtype=torch.float32, device=q.device
        )
        out_strides = (out_buf.stride(0), out_buf.stride(1), out_buf.stride(2))
        lse_strides = (lse_buf.stride(0), lse_buf.stride(1), lse_buf.stride(2))

    grid = (row_blocks, num_kv_splits, num_reqs)
    _log_launch_once("triton", q, kv_cache, kv_lora_rank=kv_lora_rank, requests=num_reqs,
                    row_blocks=row_blocks, splits=num_kv_splits,
                    max_query_len=stats.max_query_len,
                    max_seq_len=stats.max_seq_len, active=has_active,
                    runtime_splits=runtime_kv_splits,
                    config=(config.block_m, config.block_n, config.num_warps))
    kernels._mla_tree_fwd_kernel[grid](
        q, kv_cache, block_table, seq_lens, query_start_loc, ancestor_bits,
        out_buf, lse_buf,
        scale * kernels.LOG2E,
        q.stride(0), q.stride(1),
        kv_cache.stride(0), kv_cache.stride(1),
        block_table.stride(0),
        ancestor_bits.stride(0), ancestor_bits.shape[1],
        *out_strides,
        *lse_strides,
        NUM_HEADS=num_heads,
        KV_LORA=kv_lora_rank,
        ROPE=head_dim - kv_lora_rank,
        BLOCK_L=block_l,
        BLOCK_R=block_r,
        PAGE_SIZE=page_size,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        **tree_launch_options(q, config, seq_lens, active_query_lens, merge_base,
                              merge_count, num_heads),
        split_slots=split_slots(q.device, config.ctas_per_sm),
        RUNTIME_SPLITS=runtime_kv_splits and not has_active and num_kv_splits > 1,
        KVScale=kv_scale if kv_scale is not None else seq_lens,  # dummy: unread in 16 bits
        QScale=q_scale if q_scale is not None else seq_lens,
        KV_FP8=kv_scale is not None,
        KV_FP8_TRANSPOSED=config.fp8_transposed,
    )  # fmt: skip
    if has_active or num_kv_splits > 1:
        merge_splits(out_buf, lse_buf, out, lse, num_kv_splits, row_blocks, merge_base,
                     merge_count, config.block_m, block_l, has_active)
    return out, lse


def mla_tree_fwd_gluon(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    ancestor_bits: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
    *,
    num_kv_splits: int | None = None,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    validate_values: bool = True,
    out: torch.Tensor | None = None,
    runtime_kv_splits: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA tree-verify attention with the Gluon sm_90 kernel (``gluon_kernel``) and
    :func:`merge_splits`; what :func:`mla_tree_verify` runs where
    :func:`gluon_kernel.gluon_supported` accepts the launch.

    Same contract as :func:`mla_tree_verify` (absorbed MLA against a latent paged
    cache; every context key visible, new key ``j`` visible to new token ``t`` iff bit
    ``j`` of ``ancestor_bits[t]`` is set and ``j <= t``), without active rows.

    Args:
        q: ``[T, H, 576]`` bf16/fp16.
        kv_cache: ``[num_blocks, page_size, 576]``, q's dtype; any page size.
        block_table: int32 ``[R, max_blocks]``.
        seq_lens: int32 ``[R]``: context + new tokens of each request.
        query_start_loc: int32 ``[R + 1]``.
        ancestor_bits: int64 ``[>= T, W]``, ``W >= ceil(max_query_len / 64)``.
        scale: softmax scale of ``q . k``.
        kv_lora_rank: 512.
        num_kv_splits: CTAs per request along the keys; None picks it from the
            context length and the SM count (one 216 KiB CTA per SM).
        max_query_len, max_seq_len: host-side maxima; required with
            ``validate_values=False`` (CUDA-graph friendly).
        validate_values: check the metadata values on the host (one sync).
        out: optional ``[T, H, 512]`` output buffer in q's dtype.
        runtime_kv_splits: ``num_kv_splits`` (or ``max_seq_len``'s choice) is only the
            grid's split count; each request takes the count chosen for its own length
            (as in :func:`mla_tree_verify`).

    Returns:
        ``out [T, H, 512]`` in q's dtype and ``lse [T, H]`` fp32 (natural log of the
        softmax denominator); a row that sees no key gets ``out = 0, lse = -inf``.

    Raises:
        ValueError: the launch is invalid or not supported (``gluon_supported``).
    """
    if getattr(kv_cache, "dtype", None) == FP8_KV_DTYPE:
        raise ValueError("mla_tree_fwd_gluon: the Gluon kernel reads 16-bit caches only; "
                         "mla_tree_verify runs an fp8 kv_cache on the Triton kernel")
    _check_mla_inputs(q, kv_cache, scale, kv_lora_rank)
    if not gluon_kernel.gluon_supported(q, kv_cache, kv_lora_rank):
        raise ValueError("mla_tree_fwd_gluon: unsupported launch (see gluon_supported)")
    return _launch_gluon(
        q, kv_cache, block_table, seq_lens, query_start_loc, ancestor_bits, scale,
        kv_lora_rank, num_kv_splits=num_kv_splits, max_query_len=max_query_len,
        max_seq_len=max_seq_len, validate_values=validate_values, out=out,
        runtime_kv_splits=runtime_kv_splits)


def _launch_gluon(
    q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, ancestor_bits: torch.Tensor,
    scale: float, kv_lora_rank: int, *, num_kv_splits: int | None,
    max_query_len: int | None, max_seq_len: int | None, validate_values: bool,
    out: torch.Tensor | None, runtime_kv_splits: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`mla_tree_fwd_gluon` once its inputs passed ``_check_mla_inputs`` and
    ``gluon_supported`` (:func:`mla_tree_verify` checked them: an eager step launches
    once per MLA layer, and each check is host time)."""
    num_tokens, num_heads, _ = q.shape
    block_m, block_n = gluon_kernel.BLOCK_M, gluon_kernel.BLOCK_N
    stats, out, lse = prepare_outputs(
        q, kv_cache, block_table, seq_lens, query_start_loc, ancestor_bits, kv_lora_rank,
        max_query_len, max_seq_len, validate_values, out)
    num_reqs = seq_lens.shape[0]
    if num_reqs == 0 or stats.max_query_len == 0 or num_tokens == 0:
        return out, lse

    row_blocks = -(-(stats.max_query_len * num_heads) // block_m)
    num_kv_splits = resolve_num_kv_splits(
        num_kv_splits, num_requests=num_reqs, row_blocks=row_blocks,
        max_keys=stats.max_seq_len, block_n=block_n, device=q.device, ctas_per_sm=1,
        runtime=runtime_kv_splits,
    )
    if num_kv_splits == 1:
        out_buf, lse_buf = out, lse
        out_strides = (out.stride(0), out.stride(1), 0)
        lse_strides = (lse.stride(0), lse.stride(1), 0)
    else:
        out_buf = torch.empty(num_tokens, num_heads, num_kv_splits, kv_lora_rank,
                              dtype=torch.float32, device=q.device)
        lse_buf = torch.empty(num_tokens, num_heads, num_kv_splits, dtype=torch.float32,
                              device=q.device)
        out_strides = out_buf.stride()[:3]
        lse_strides = lse_buf.stride()

    _log_launch_once("gluon", q, kv_cache, kv_lora_rank=kv_lora_rank, requests=num_reqs,
                     row_blocks=row_blocks, splits=num_kv_splits,
                     max_query_len=stats.max_query_len, max_seq_len=stats.max_seq_len,
                     runtime_splits=runtime_kv_splits)
    gluon_kernel._mla_tree_fwd_gluon_kernel[(row_blocks, num_kv_splits, num_reqs)](
        q, kv_cache, block_table, seq_lens, query_start_loc, ancestor_bits, out_buf, lse_buf,
        scale * kernels.LOG2E,
        q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1),
        block_table.stride(0), ancestor_bits.stride(0), ancestor_bits.shape[1],
        *out_strides, *lse_strides, split_slots(q.device, ctas_per_sm=1),
        NUM_HEADS=num_heads, KV_LORA=kv_lora_rank, ROPE=gluon_kernel.ROPE_DIM,
        PAGE_SIZE=kv_cache.shape[1], BLOCK_M=block_m, BLOCK_N=block_n,
        RUNTIME_SPLITS=runtime_kv_splits and num_kv_splits > 1,
        num_warps=gluon_kernel.NUM_WARPS,  # + the kernel's 4-warp worker partition
    )  # fmt: skip
    if num_kv_splits > 1:
        merge_splits(out_buf, lse_buf, out, lse, num_kv_splits, row_blocks, seq_lens,
                     seq_lens, block_m, kv_lora_rank, False)
    return out, lse
