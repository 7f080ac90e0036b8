# SPDX-License-Identifier: Apache-2.0
"""Cascade MLA tree verify (sm_90): the context through FlashMLA, the tree through ours.

Every query row of a verify step sees every context key: that part of the attention is
dense decode attention, the work FlashMLA's Hopper kernel (shipped in vLLM 0.26) is built
for, with a bf16 or an fp8 latent cache. Only the request's own new tokens need the
ancestor mask. So the cascade runs FlashMLA's dense decode over the first
``ctx_len = seq_len - qlen`` keys of each request (``causal=False``: all of them for
every row), then ``cascade_kernel._mla_tree_suffix_kernel`` over the new tokens, which
folds FlashMLA's ``(out, lse)`` into its own online softmax and writes the result (no
merge launch). At long context the step costs FlashMLA's time plus a kernel over at
most ``qlen`` keys.

With an fp8 cache both parts take vLLM's e4m3 query (``q / layer._q_scale``, quantized by
``MLAAttention``, as for vLLM's FLASHMLA backend) and its scale: FlashMLA's dense fp8
path over the context, the tree part over the new tokens, so every key is scored with
the query plain decoding uses.

FlashMLA needs 64-token pages, ``kv_lora_rank`` 512 + rope 64, a bf16 (e4m3 with an fp8
cache) q and the same
number of new tokens in every request (q viewed ``[R, qlen, H, 576]``): the launcher
(``ops.mla_tree_verify``) takes the cascade only where :func:`cascade_supported` holds
and the dispatch table measured it fastest.

A :class:`CascadePlan` holds what the layers of one KV-cache group share in a step: the
context lengths and FlashMLA's tile schedule (computed by the group's first launch, on
the device, so CUDA graphs capture it and replay it for each step's lengths). DDTree's
default keeps a target in one group; under vLLM's hybrid KV-cache manager each MLA layer
beside a DFlash drafter is its own group and plans for itself.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from . import cascade_kernel, kernels
from .configs import MLATileConfig, mma_dtype_of, padded_dims, select_config

FP8_KV_DTYPE = torch.float8_e4m3fn
PAGE_SIZE = 64
KV_LORA_RANK = 512
ROPE_DIM = 64


@dataclass
class CascadePlan:
    """Per-step state of the cascade, shared by the layers of a KV-cache group (the
    backend's metadata carries one per group and step; a launch without one plans for
    itself).

    Attributes:
        ctx_lens: int32 ``[R]`` context lengths (FlashMLA's ``cache_seqlens``), set by
            the first launch.
        sched_meta: FlashMLA's tile schedule of a bf16 cache (``FlashMLASchedMeta``,
            planned inside the first launch).
        fp8_meta: ``(tile_scheduler_metadata, num_splits)`` of FlashMLA's dense fp8
            path, set by the first launch on an fp8 cache.
    """

    ctx_lens: torch.Tensor | None = None
    sched_meta: object | None = None
    fp8_meta: tuple[torch.Tensor, torch.Tensor] | None = None


@functools.lru_cache(maxsize=16)
def flashmla_dense_available(device: torch.device) -> bool:
    """FlashMLA's dense decode is importable and runs on ``device`` (sm_90). Cached: asked
    at every launch."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] != 9:
        return False
    try:
        from vllm.v1.attention.ops import flashmla
    except ImportError:
        return False
    return flashmla.is_flashmla_dense_supported()[0]


def cascade_supported(q: torch.Tensor, kv_cache: torch.Tensor, kv_lora_rank: int,
                      num_reqs: int, max_query_len: int | None) -> bool:
    """Whether the cascade can run this launch: ``q [T, H, 576]``, bf16 with a bf16
    cache or e4m3 with an fp8 one, with
    ``T == num_reqs * max_query_len`` (every request ``max_query_len`` new tokens: the
    caller knows), a ``[num_blocks, 64, 576]`` cache, ``kv_lora_rank`` 512,
    FlashMLA's dense decode on this (sm_90) GPU."""
    if kv_lora_rank != KV_LORA_RANK or q.dim() != 3 or kv_cache.dim() != 3:
        return False
    if (q.dtype, kv_cache.dtype) not in ((torch.bfloat16,) * 2, (FP8_KV_DTYPE,) * 2):
        return False
    if q.shape[2] != KV_LORA_RANK + ROPE_DIM or kv_cache.shape[1:] != (PAGE_SIZE, q.shape[2]):
        return False
    if not max_query_len or q.shape[0] != num_reqs * max_query_len or not q.is_contiguous():
        return False
    if kv_cache.stride(2) != 1 or kv_cache.stride(1) != q.shape[2]:
        return False
    return flashmla_dense_available(q.device)


def context_lens(seq_lens: torch.Tensor, query_start_loc: torch.Tensor) -> torch.Tensor:
    """int32 ``[R]``: FlashMLA's lengths, the keys before each request's new tokens, at
    least 1: FlashMLA's fp8 path faulted on a length of 0 (CUDA-graph padding, vLLM's
    dummy runs). A request without context keys gets its first key's partial, which
    the tree part never reads (it checks the length itself)."""
    return (seq_lens - query_start_loc.diff()).clamp_(min=1).to(torch.int32)


def flashmla_context(
    q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
    scale: float, query_len: int, plan: CascadePlan,
    kv_scale: torch.Tensor | None, q_scale: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashMLA's dense decode over each request's ``plan.ctx_lens`` context keys, every
    row seeing all of them. Returns ``out [T, H, 512]`` bf16 (FlashMLA's own buffer:
    its ``out`` argument takes its internal layout) and ``lse`` fp32 ``[R, H,
    query_len]`` (natural log)."""
    from vllm.v1.attention.ops import flashmla as fm

    num_tokens, num_heads, head_dim = q.shape
    num_reqs = num_tokens // query_len
    q4 = q.view(num_reqs, query_len, num_heads, head_dim)
    k_cache = kv_cache.unsqueeze(2)
    if kv_scale is None:
        if plan.sched_meta is None:
            plan.sched_meta = fm.get_mla_metadata()[0]
        ctx_out, lse = fm.flash_mla_with_kvcache(
            q4, k_cache, block_table, plan.ctx_lens, KV_LORA_RANK, plan.sched_meta,
            softmax_scale=scale, causal=False, is_fp8_kvcache=False)
        return ctx_out.view(num_tokens, num_heads, KV_LORA_RANK), lse
    if plan.fp8_meta is None:
        plan.fp8_meta = fm.get_mla_metadata_dense_fp8(plan.ctx_lens, query_len * num_heads, 1)
    ctx_out, lse = fm.flash_mla_with_kvcache_fp8(
        q4, k_cache, block_table, plan.ctx_lens, KV_LORA_RANK, *plan.fp8_meta,
        softmax_scale=scale, causal=False, descale_q=q_scale.reshape(1),
        descale_k=kv_scale.reshape(1))
    return ctx_out.view(num_tokens, num_heads, KV_LORA_RANK), lse


# Row tiles of the tree part up to this many rows per request (``qlen * H``) are 16 rows
# tall: between the largest measured cell where 16 won (2,056 rows) and the smallest
# where the 64-row tile was within 3 % of the best (8,224 rows).
SMALL_ROW_TILE_ROWS = 4096


def suffix_config(rows_per_request: int, kv_fp8: bool, head_dim: int = 576,
                  kv_lora_rank: int = KV_LORA_RANK) -> MLATileConfig:
    """The tree part's tile for ``rows_per_request`` query rows (``qlen * H``) on sm_90.
    It runs one to five key tiles per CTA, so it is latency-bound: 8 warps, and 16-row
    tiles (more CTAs) up to ``SMALL_ROW_TILE_ROWS``; above it 64 x 64 with a bf16 cache
    and 32 x 32 single-stage with an fp8 one (the tiles shipped before). Timed alone on
    the H100 (``bench_verify_attention.py --grid --suffix-sweep``, 8k context, every
    candidate tile; ``evals/results/verify_attention_grid_suffix.md``): 16 x 64 with 2
    stages took 0.56-0.66x the time of the 32 x 32 single-stage fp8 tile shipped before
    at 520-2,056 rows (0.73-0.74x at 576-640 rows, where 16 x 32 led by 1 us) and 0.58x
    the 64-row bf16 tile at 1,032 rows; at 8,224-8,320 rows the 64 x 64 bf16 tile was
    within 3-5 % of the best. None of these spills compiled for sm_90a at DeepSeek's dims
    (tests/test_mla_cascade.py), where ``select_config``'s tiles spilled 140-1,036 bytes
    a thread with an fp8 cache. Other dims: ``select_config``."""
    if (head_dim, kv_lora_rank) != (KV_LORA_RANK + ROPE_DIM, KV_LORA_RANK):
        return select_config(rows_per_request, head_dim, kv_lora_rank, torch.bfloat16)
    if rows_per_request <= 16:  # as before the sweep, which measured no such cell
        return MLATileConfig(block_m=16, block_n=32, num_warps=8,
                             num_stages=1 if kv_fp8 else 2)
    if rows_per_request <= SMALL_ROW_TILE_ROWS:
        return MLATileConfig(block_m=16, block_n=64, num_warps=8, num_stages=2)
    if kv_fp8:  # the 64-row tile with fp8 was not among the measured ones
        return MLATileConfig(block_m=32, block_n=32, num_warps=8, num_stages=1)
    return MLATileConfig(block_m=64, block_n=64, num_warps=8, num_stages=2)


def tree_suffix(
    q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, ancestor_bits: torch.Tensor,
    scale: float, kv_lora_rank: int, ctx_out: torch.Tensor, ctx_lse: torch.Tensor,
    out: torch.Tensor, lse: torch.Tensor, max_query_len: int,
    kv_scale: torch.Tensor | None = None, q_scale: torch.Tensor | None = None,
    max_shared_memory: int | None = None,
) -> None:
    """The tree part: each request's new tokens under the ancestor mask, folded into the
    context partial ``ctx_out [T, H, kv_lora_rank]`` / ``ctx_lse [R, H, max_query_len]``
    (natural log; the layout FlashMLA returns), written to ``out [T, H, kv_lora_rank]``
    (bf16; may be ``ctx_out``) and ``lse [T, H]`` fp32. Any GPU Triton runs on, and
    the interpreter (the CPU tests give it a reference context partial)."""
    num_tokens, num_heads, head_dim = q.shape
    num_reqs = seq_lens.shape[0]
    if num_tokens == 0 or num_reqs == 0 or max_query_len == 0:
        return
    rows = max_query_len * num_heads
    if q.is_cuda and max_shared_memory is not None and max_shared_memory >= 227 * 1024:
        config = suffix_config(rows, kv_scale is not None, head_dim, kv_lora_rank)
    else:  # the interpreter (CPU tests), or a GPU without sm_90's shared memory
        kwargs = {} if max_shared_memory is None else {"max_shared_memory": max_shared_memory}
        config = select_config(rows, head_dim, kv_lora_rank, mma_dtype_of(q.dtype), **kwargs)
    block_l, block_r = padded_dims(head_dim, kv_lora_rank)
    grid = (-(-rows // config.block_m), num_reqs)
    cascade_kernel._mla_tree_suffix_kernel[grid](
        q, kv_cache, block_table, seq_lens, query_start_loc, ancestor_bits, out, lse,
        ctx_out, ctx_lse, scale * kernels.LOG2E,
        q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1),
        block_table.stride(0), ancestor_bits.stride(0), ancestor_bits.shape[1],
        out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        ctx_out.stride(0), ctx_out.stride(1), *ctx_lse.stride(),
        kv_scale if kv_scale is not None else seq_lens,  # dummies: unread in 16 bits
        q_scale if q_scale is not None else seq_lens,
        NUM_HEADS=num_heads, KV_LORA=kv_lora_rank, ROPE=head_dim - kv_lora_rank,
        BLOCK_L=block_l, BLOCK_R=block_r, PAGE_SIZE=kv_cache.shape[1],
        BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        **kernels.dot_options(q.dtype),
        KV_FP8=kv_scale is not None,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip


def mla_tree_verify_cascade(
    q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, ancestor_bits: torch.Tensor,
    scale: float, out: torch.Tensor, lse: torch.Tensor, query_len: int,
    plan: CascadePlan | None = None, kv_scale: torch.Tensor | None = None,
    q_scale: torch.Tensor | None = None, max_shared_memory: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tree-verify attention as the cascade (module docstring) into ``out [T, H, 512]``
    bf16 (contiguous) and ``lse [T, H]`` fp32; same contract as ``ops.mla_tree_verify``
    for launches :func:`cascade_supported` accepts (every request ``query_len`` new
    tokens). ``plan``: the step's shared :class:`CascadePlan` (filled on first use);
    ``max_shared_memory``: the device's, for the tree part's tile."""
    plan = plan if plan is not None else CascadePlan()
    if plan.ctx_lens is None:
        plan.ctx_lens = context_lens(seq_lens, query_start_loc)
    ctx_out, ctx_lse = flashmla_context(q, kv_cache, block_table, scale, query_len, plan,
                                        kv_scale, q_scale)
    tree_suffix(q, kv_cache, block_table, seq_lens, query_start_loc, ancestor_bits, scale,
                out.shape[2], ctx_out, ctx_lse, out, lse, query_len, kv_scale, q_scale,
                max_shared_memory)
    return out, lse
