# SPDX-License-Identifier: Apache-2.0
"""Gluon (sm_90) MLA tree-verify forward kernel: async wgmma, software-pipelined.

Same work split, inputs and partial outputs as ``kernels._mla_tree_fwd_kernel``
(grid ``(row_blocks, num_kv_splits, num_reqs)``, rows ``token * H + head``, a CTA
loops over the 64-key tiles of its split; per-split ``out``/``lse`` partials finished
by ``ops.merge_splits``), restricted to Hopper, 16-bit dtypes, ``kv_lora_rank`` 512 +
rope 64 and no active rows (:func:`gluon_supported`).

One CTA = 2 warpgroups (8 warps) on a 64-row tile. Shared memory: Q (64 x 576, 72 KiB),
two KV tile buffers (2 x 72 KiB; K = the whole 576-wide latent row, V its first 512
entries, read in place), P (64 x 64, 8 KiB): 224 KiB of Hopper's 227. ``S = Q K^T`` is
split by key columns over the warpgroups (``[4, 2]`` warps, 64 x 32 each), the output
accumulator by V columns (64 x 256 fp32 each, 128 registers a thread); P goes through
shared memory since each warpgroup needs all 64 of its columns.

Pipeline of KV tile ``j`` (tile 0's ``S`` and softmax precede the loop)::

    issue  O += P(j) V(j)                      (async wgmma group 1)
    wait   cp.async of K(j+1); fence; barrier
    issue  S(j+1) = Q K(j+1)^T                 (async groups 2, 3: nope, rope)
    wait   wgmma(num_outstanding=2): PV(j) retired, S(j+1) still in flight
    barrier; cp.async K(j+2) into PV(j)'s buffer (a whole tile of lead time)
    wait   wgmma(0): S(j+1); softmax(j+1) (tree mask only on tiles that need it)
    O *= alpha(j+1); P(j+1) -> shared; fence; barrier

so the tensor cores run ``PV(j)`` and ``S(j+1)`` back to back while KV loads stay a
tile ahead. With two 72 KiB KV buffers, the only ones that fit next to Q, ``S(j+2)``
cannot be issued before the softmax of ``j+1`` (its tile lands during that
iteration), so the softmax itself is not overlapped with MMA.

Keys are gathered row by row through the block table (any page size) with cp.async
(16-byte vectors) into 128-byte-swizzled NVMMA shared layouts; key indices past the
split end are clamped to its last key (valid addresses, masked in ``S``).

``VLLM_DDTREE_MLA_GLUON=v2`` (or ``mla_tree_fwd_gluon(..., version="v2")``) launches
``gluon_kernels_v2`` instead: the FlashMLA-style warp-specialized "seesaw" (each
warpgroup a full 64 x 64 ``S`` of alternate tiles, softmax of one overlapping the
other's wgmmas); opt-in until measured on a GPU.
"""

from __future__ import annotations

import os

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy,
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from . import configs
from .configs import resolve_num_kv_splits, split_slots
from .ops import _check_mla_inputs, log_launch_once, merge_splits, prepare_outputs

LOG2E = 1.4426950408889634
LN2 = gl.constexpr(0.6931471805599453)

KV_LORA_RANK = 512
ROPE_DIM = 64
BLOCK_M = 64
BLOCK_N = 64
NUM_WARPS = 8
HOPPER_SHARED_MEMORY_BYTES = 227 * 1024
# The split-count cost model of configs.select_num_kv_splits, for _runtime_num_splits.
MIN_TILES_PER_SPLIT = gl.constexpr(configs.MIN_TILES_PER_SPLIT)
MAX_KV_SPLITS = gl.constexpr(configs.MAX_KV_SPLITS)
SPLIT_OVERHEAD_TILES = gl.constexpr(configs.SPLIT_OVERHEAD_TILES)
# Kernel version of mla_tree_fwd_gluon: "v2" (gluon_kernels_v2: the warp-specialized
# seesaw schedule; the default since its H200 run, 2026-11-30 s16: 1.02-1.30x v1's
# speed, 0.79-1.15x FlashMLA's time) or "v1" (this module).
GLUON_VERSION_ENV = "VLLM_DDTREE_MLA_GLUON"
GLUON_VERSIONS = ("v1", "v2")


def gluon_version(version: str | None = None) -> str:
    """``version`` if given, else ``$VLLM_DDTREE_MLA_GLUON`` (default ``"v2"``).

    Raises:
        ValueError: not one of :data:`GLUON_VERSIONS`.
    """
    if version is None:
        version = os.environ.get(GLUON_VERSION_ENV, "").strip().lower() or "v2"
    if version not in GLUON_VERSIONS:
        raise ValueError(f"{GLUON_VERSION_ENV} / version must be one of {GLUON_VERSIONS}, "
                         f"got {version!r}")
    return version


@gluon.jit
def _runtime_num_splits(key_tiles, base_ctas, split_slots, grid_splits,
                        MIN_TILES: gl.constexpr, MAX_SPLITS: gl.constexpr,
                        LAYOUT: gl.constexpr):
    """``kernels._runtime_num_splits`` in Gluon (``LAYOUT``: any 1-D layout): the split
    count the host would choose for ``key_tiles`` tiles, at most ``grid_splits``."""
    tiles = gl.maximum(key_tiles, 1)
    limit = gl.maximum(gl.minimum(gl.minimum(grid_splits, MAX_SPLITS), tiles // MIN_TILES), 1)
    splits = gl.arange(0, MAX_SPLITS, LAYOUT) + 1
    waves = gl.cdiv(base_ctas * splits, split_slots)
    cost = gl.where(splits <= limit, waves * (gl.cdiv(tiles, splits) + SPLIT_OVERHEAD_TILES),
                    2**30)
    best_cost = gl.min(cost, axis=0)
    return gl.min(gl.where(cost == best_cost, splits, MAX_SPLITS), axis=0)


@gluon.jit
def _split_bounds(seq_len, ctx_len, num_rows, pid_m, pid_s, split_slots,
                  NUM_HEADS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  RUNTIME_SPLITS: gl.constexpr):
    """``(split_start, split_end)``: the keys of split ``pid_s`` (an even split of the
    request's keys in whole tiles, as the Triton kernel), cut after the last new token
    row block ``pid_m`` may see (topological order: its last token sees no later one).
    The request is split ``num_programs(1)`` ways, or with ``RUNTIME_SPLITS`` as
    :func:`_runtime_num_splits` picks for its length (CUDA graphs)."""
    num_splits = gl.num_programs(1)
    if RUNTIME_SPLITS:
        # The candidates, one per thread.
        layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
        num_splits = _runtime_num_splits(
            gl.cdiv(seq_len, BLOCK_N), gl.num_programs(0) * gl.num_programs(2), split_slots,
            num_splits, MIN_TILES_PER_SPLIT, MAX_KV_SPLITS, layout)
    keys_per_split = gl.cdiv(gl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    split_start = pid_s * keys_per_split
    split_end = gl.minimum(split_start + keys_per_split, seq_len)
    last_tok = gl.minimum(pid_m * BLOCK_M + BLOCK_M - 1, num_rows - 1) // NUM_HEADS
    return split_start, gl.minimum(split_end, ctx_len + last_tok + 1)


@gluon.jit
def _tile_pages(BlockTable, bt_row, start_n, last_key, PAGE_SIZE: gl.constexpr,
                BLOCK_N: gl.constexpr, LD: gl.constexpr):
    """Page ids of the keys ``start_n .. start_n + BLOCK_N`` (clamped to ``last_key``):
    an int32 scalar when a tile lies in one page, else int32 ``[BLOCK_N]``. Loaded a
    tile ahead of their use, so their latency does not stall the cp.async issue."""
    if PAGE_SIZE % BLOCK_N == 0:
        # The whole tile lies in one page (tiles start at multiples of BLOCK_N).
        return gl.load(BlockTable + bt_row + gl.minimum(start_n, last_key) // PAGE_SIZE)
    else:
        keys = gl.minimum(start_n + gl.arange(0, BLOCK_N, gl.SliceLayout(1, LD)), last_key)
        return gl.load(BlockTable + bt_row + keys // PAGE_SIZE)


@gluon.jit
def _issue_kv_tile_load(
    KV, pages, start_n, last_key, kn_dst, kr_dst, stride_kvb, stride_kvp,
    PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, KV_LORA: gl.constexpr,
    ROPE: gl.constexpr, LD: gl.constexpr,
):  # fmt: skip
    """cp.async of keys ``start_n .. start_n + BLOCK_N`` (clamped to ``last_key``, on
    ``pages`` of :func:`_tile_pages`): ``[BLOCK_N, KV_LORA]`` into ``kn_dst``,
    ``[BLOCK_N, ROPE]`` into ``kr_dst``."""
    keys = gl.minimum(start_n + gl.arange(0, BLOCK_N, gl.SliceLayout(1, LD)), last_key)
    row = pages.to(gl.int64) * stride_kvb + (keys % PAGE_SIZE) * stride_kvp
    ptrs = KV + row[:, None]
    offs_l = gl.arange(0, KV_LORA, gl.SliceLayout(0, LD))
    offs_r = gl.arange(0, ROPE, gl.SliceLayout(0, LD))
    async_copy.async_copy_global_to_shared(kn_dst, ptrs + offs_l[None, :])
    async_copy.async_copy_global_to_shared(kr_dst, ptrs + KV_LORA + offs_r[None, :])


@gluon.jit
def _mask_scores(
    s, start_n, split_end, ctx_len, q_start, row_tok, AncestorBits, stride_bits, num_words,
    S_LAYOUT: gl.constexpr, BLOCK_N: gl.constexpr, CLIP_SPLIT: gl.constexpr,
):  # fmt: skip
    """``s`` fp32 ``[BLOCK_M, BLOCK_N]`` (keys ``start_n ..``) with the keys a row may not
    see set to -inf: past ``split_end``, new tokens outside the row's ancestor bits, and
    new tokens after the row's own (topological order). Only a tile that reaches past
    the context is masked, or with ``CLIP_SPLIT`` (v2, whose odd splits run a dummy
    tile) also one past the split end; v1's tiles never cross a split end inside the
    context (split ends there are tile-aligned), and v1 keeps the code it was measured
    and GPU-tested with."""
    if CLIP_SPLIT:
        masked_from = gl.minimum(ctx_len, split_end)
    else:
        masked_from = ctx_len
    if start_n + BLOCK_N > masked_from:
        offs_n = start_n + gl.arange(0, BLOCK_N, gl.SliceLayout(0, S_LAYOUT))
        new_idx = offs_n - ctx_len  # index among the request's new tokens; < 0: context
        bit_idx = gl.maximum(new_idx, 0)
        # BLOCK_N <= 64: the tile's new tokens span at most two mask words per row.
        word_lo = gl.maximum(start_n - ctx_len, 0) // 64
        bits_row = AncestorBits + (q_start + row_tok).to(gl.int64) * stride_bits
        if CLIP_SPLIT:
            lo = gl.load(bits_row + word_lo, mask=(row_tok * 0 + word_lo) < num_words,
                         other=0)
        else:
            lo = gl.load(bits_row + word_lo)
        hi = gl.load(bits_row + word_lo + 1, mask=(row_tok * 0 + word_lo + 1) < num_words,
                     other=0)
        words = gl.where(((bit_idx // 64) == word_lo)[None, :], lo[:, None], hi[:, None])
        bit_set = ((words >> (bit_idx % 64).to(gl.int64)[None, :]) & 1) != 0
        visible = (offs_n < split_end)[None, :] & ((new_idx < 0)[None, :] | bit_set)
        visible = visible & (new_idx[None, :] <= row_tok[:, None])
        s = gl.where(visible, s, float("-inf"))
    return s


@gluon.jit
def _online_softmax(
    s, m_i, l_i, start_n, split_end, ctx_len, q_start, row_tok, AncestorBits, stride_bits,
    num_words, qk_scale, S_LAYOUT: gl.constexpr, BLOCK_N: gl.constexpr,
):  # fmt: skip
    """One KV tile of the online softmax on ``s = q.k`` fp32 ``[BLOCK_M, BLOCK_N]``:
    scales, masks (:func:`_mask_scores`), returns ``(p, alpha, m_new, l_new)``."""
    s = _mask_scores(s * qk_scale, start_n, split_end, ctx_len, q_start, row_tok,
                     AncestorBits, stride_bits, num_words, S_LAYOUT, BLOCK_N, False)
    m_new = gl.maximum(m_i, gl.max(s, axis=1))
    # A row may have seen nothing yet: keep exp2 arguments finite.
    m_base = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_base)
    p = gl.exp2(s - m_base[:, None])
    l_new = l_i * alpha + gl.sum(p, axis=1)
    return p, alpha, m_new, l_new


@gluon.jit(do_not_specialize=("stride_lt", "stride_lh", "stride_ls"))
def _mla_tree_fwd_gluon_kernel(
    Q, KV, BlockTable, SeqLens, QueryStartLoc, AncestorBits, Out, Lse,
    qk_scale,  # softmax scale * log2(e)
    stride_qt, stride_qh, stride_kvb, stride_kvp, stride_bt, stride_bits, num_words,
    stride_ot, stride_oh, stride_os, stride_lt, stride_lh, stride_ls,
    split_slots,  # resident CTA slots; read only with RUNTIME_SPLITS
    NUM_HEADS: gl.constexpr, KV_LORA: gl.constexpr, ROPE: gl.constexpr,
    PAGE_SIZE: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    RUNTIME_SPLITS: gl.constexpr,
):  # fmt: skip
    """One CTA: ``BLOCK_M`` rows of request ``program_id(2)`` against split
    ``program_id(1)`` of its keys (module docstring)."""
    gl.static_assert(BLOCK_M == 64)
    gl.static_assert(BLOCK_N == 64)
    gl.static_assert(gl.num_warps() == 8)
    dtype: gl.constexpr = Q.dtype.element_ty
    # S = Q K^T [64, 64]: warpgroup w computes key columns 32w .. 32w + 31.
    S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 32, 16])
    # O [64, 512] fp32: warpgroup w accumulates V columns 256w .. 256w + 255.
    O_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 256, 16])
    # Global -> shared copies: 16-byte vectors, 8 threads a 128-byte row segment.
    LD: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
    SMEM: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16,
                                              rank=2)
    ROW_S: gl.constexpr = gl.SliceLayout(1, S_LAYOUT)
    ROW_O: gl.constexpr = gl.SliceLayout(1, O_LAYOUT)

    pid_m = gl.program_id(0)
    pid_s = gl.program_id(1)
    pid_r = gl.program_id(2)

    q_start = gl.load(QueryStartLoc + pid_r)
    q_len = gl.load(QueryStartLoc + pid_r + 1) - q_start
    num_rows = q_len * NUM_HEADS
    if pid_m * BLOCK_M >= num_rows:
        return
    seq_len = gl.load(SeqLens + pid_r)
    ctx_len = seq_len - q_len

    split_start, split_end = _split_bounds(seq_len, ctx_len, num_rows, pid_m, pid_s,
                                           split_slots, NUM_HEADS, BLOCK_M, BLOCK_N,
                                           RUNTIME_SPLITS)

    rows_s = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, ROW_S)
    tok_s = gl.minimum(rows_s, num_rows - 1) // NUM_HEADS
    lse_ptrs = (Lse + (q_start + rows_s // NUM_HEADS).to(gl.int64) * stride_lt
                + (rows_s % NUM_HEADS) * stride_lh + pid_s * stride_ls)
    if split_start >= split_end:
        # Nothing to attend in this split; the merge kernel skips it.
        gl.store(lse_ptrs, gl.full([BLOCK_M], float("-inf"), gl.float32, ROW_S),
                 mask=rows_s < num_rows)
        return

    q_smem_n = gl.allocate_shared_memory(dtype, [BLOCK_M, KV_LORA], SMEM)
    q_smem_r = gl.allocate_shared_memory(dtype, [BLOCK_M, ROPE], SMEM)
    k_smem_n = gl.allocate_shared_memory(dtype, [2, BLOCK_N, KV_LORA], SMEM)
    k_smem_r = gl.allocate_shared_memory(dtype, [2, BLOCK_N, ROPE], SMEM)
    p_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, BLOCK_N], SMEM)

    # Q rows (past the last row: the last row again, never stored).
    rows_ld = gl.minimum(pid_m * BLOCK_M + gl.arange(0, BLOCK_M, gl.SliceLayout(1, LD)),
                         num_rows - 1)
    q_off = ((q_start + rows_ld // NUM_HEADS).to(gl.int64) * stride_qt
             + (rows_ld % NUM_HEADS) * stride_qh)
    q_ptrs = Q + q_off[:, None]
    offs_l = gl.arange(0, KV_LORA, gl.SliceLayout(0, LD))
    offs_r = gl.arange(0, ROPE, gl.SliceLayout(0, LD))
    async_copy.async_copy_global_to_shared(q_smem_n, q_ptrs + offs_l[None, :])
    async_copy.async_copy_global_to_shared(q_smem_r, q_ptrs + KV_LORA + offs_r[None, :])

    bt_row = pid_r.to(gl.int64) * stride_bt
    last_key = split_end - 1
    num_tiles = gl.cdiv(split_end - split_start, BLOCK_N)
    pages = _tile_pages(BlockTable, bt_row, split_start, last_key, PAGE_SIZE, BLOCK_N, LD)
    _issue_kv_tile_load(KV, pages, split_start, last_key, k_smem_n.index(0),
                        k_smem_r.index(0), stride_kvb, stride_kvp, PAGE_SIZE, BLOCK_N,
                        KV_LORA, ROPE, LD)
    async_copy.commit_group()
    async_copy.wait_group(0)
    fence_async_shared()
    gl.thread_barrier()
    pages = _tile_pages(BlockTable, bt_row, split_start + BLOCK_N, last_key, PAGE_SIZE,
                        BLOCK_N, LD)
    if num_tiles > 1:
        _issue_kv_tile_load(KV, pages, split_start + BLOCK_N, last_key,
                            k_smem_n.index(1), k_smem_r.index(1), stride_kvb, stride_kvp,
                            PAGE_SIZE, BLOCK_N, KV_LORA, ROPE, LD)
    async_copy.commit_group()
    # Page ids of tile 2, used in the loop's first iteration (then one tile ahead).
    pages = _tile_pages(BlockTable, bt_row, split_start + 2 * BLOCK_N, last_key, PAGE_SIZE,
                        BLOCK_N, LD)

    # Tile 0: S, softmax, P -> shared.
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, S_LAYOUT)
    s = warpgroup_mma(q_smem_n, k_smem_n.index(0).permute((1, 0)), s_zero, use_acc=False,
                      is_async=True)
    s = warpgroup_mma(q_smem_r, k_smem_r.index(0).permute((1, 0)), s, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=0, deps=[s])
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, ROW_S)
    l_i = gl.zeros([BLOCK_M], gl.float32, ROW_S)
    p, alpha, m_i, l_i = _online_softmax(
        s, m_i, l_i, split_start, split_end, ctx_len, q_start, tok_s, AncestorBits,
        stride_bits, num_words, qk_scale, S_LAYOUT, BLOCK_N)
    p_smem.store(p.to(dtype))
    fence_async_shared()
    gl.thread_barrier()
    acc = gl.zeros([BLOCK_M, KV_LORA], gl.float32, O_LAYOUT)

    for j in range(0, num_tiles - 1):
        buf = j % 2
        nxt = 1 - buf
        start_next = split_start + (j + 1) * BLOCK_N
        # O += P(j) V(j): V is the first KV_LORA columns of the K tile.
        acc = warpgroup_mma(p_smem, k_smem_n.index(buf), acc, is_async=True)
        # K(j+1) has landed (its cp.async was issued one tile ago).
        async_copy.wait_group(0)
        fence_async_shared()
        gl.thread_barrier()
        s = warpgroup_mma(q_smem_n, k_smem_n.index(nxt).permute((1, 0)), s_zero,
                          use_acc=False, is_async=True)
        s = warpgroup_mma(q_smem_r, k_smem_r.index(nxt).permute((1, 0)), s, is_async=True)
        # PV(j) retired in this warpgroup (S(j+1) still in flight); after the barrier
        # in both, so buffer `buf` and P are free.
        acc = warpgroup_mma_wait(num_outstanding=2, deps=[acc])
        gl.thread_barrier()
        if j + 2 < num_tiles:
            _issue_kv_tile_load(KV, pages, start_next + BLOCK_N, last_key,
                                k_smem_n.index(buf), k_smem_r.index(buf), stride_kvb,
                                stride_kvp, PAGE_SIZE, BLOCK_N, KV_LORA, ROPE, LD)
        async_copy.commit_group()
        pages = _tile_pages(BlockTable, bt_row, start_next + 2 * BLOCK_N, last_key,
                            PAGE_SIZE, BLOCK_N, LD)
        s = warpgroup_mma_wait(num_outstanding=0, deps=[s])
        p, alpha, m_i, l_i = _online_softmax(
            s, m_i, l_i, start_next, split_end, ctx_len, q_start, tok_s, AncestorBits,
            stride_bits, num_words, qk_scale, S_LAYOUT, BLOCK_N)
        acc = acc * gl.convert_layout(alpha, ROW_O)[:, None]
        p_smem.store(p.to(dtype))
        fence_async_shared()
        gl.thread_barrier()

    last = (num_tiles - 1) % 2
    acc = warpgroup_mma(p_smem, k_smem_n.index(last), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])

    seen = l_i > 0.0
    lse = gl.where(seen, (m_i + gl.log2(gl.where(seen, l_i, 1.0))) * LN2, float("-inf"))
    gl.store(lse_ptrs, lse, mask=rows_s < num_rows)
    inv_l = gl.convert_layout(1.0 / gl.where(seen, l_i, 1.0), ROW_O)
    out = acc * inv_l[:, None]
    rows_o = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, ROW_O)
    offs_o = gl.arange(0, KV_LORA, gl.SliceLayout(0, O_LAYOUT))
    out_row = ((q_start + rows_o // NUM_HEADS).to(gl.int64) * stride_ot
               + (rows_o % NUM_HEADS) * stride_oh + pid_s * stride_os)
    gl.store(Out + out_row[:, None] + offs_o[None, :], out.to(Out.dtype.element_ty),
             mask=(rows_o < num_rows)[:, None])


def gluon_supported(
    q: torch.Tensor, kv_cache: torch.Tensor, kv_lora_rank: int,
    active_query_lens: torch.Tensor | None = None,
) -> bool:
    """Whether :func:`mla_tree_fwd_gluon` handles this launch; else use the Triton
    ``ops.mla_tree_verify``.

    Args:
        q: ``[T, H, 576]`` query (bf16 or fp16 for the Gluon path).
        kv_cache: ``[num_blocks, page_size, 576]`` latent cache, q's dtype.
        kv_lora_rank: must be 512 (rope dim 64).
        active_query_lens: must be None (no active-row re-split).

    Returns:
        True on a CUDA device of compute capability 9.x (Hopper) with 16-bit q and
        cache, ``kv_lora_rank == 512``, rope 64, contiguous last dims, 16-byte aligned
        rows, no active rows.
    """
    if active_query_lens is not None or kv_lora_rank != KV_LORA_RANK:
        return False
    if not (isinstance(q, torch.Tensor) and isinstance(kv_cache, torch.Tensor)):
        return False
    if q.dim() != 3 or kv_cache.dim() != 3:
        return False
    if q.dtype not in (torch.bfloat16, torch.float16) or kv_cache.dtype != q.dtype:
        return False
    if q.shape[2] != KV_LORA_RANK + ROPE_DIM or kv_cache.shape[2] != q.shape[2]:
        return False
    if not (q.is_cuda and kv_cache.device == q.device):
        return False
    if torch.cuda.get_device_capability(q.device)[0] != 9:
        return False
    if q.stride(2) != 1 or kv_cache.stride(2) != 1:
        return False
    # cp.async moves 16-byte vectors: row starts must be 8-element aligned.
    aligned = all(s % 8 == 0 for s in (q.stride(0), q.stride(1), kv_cache.stride(0),
                                       kv_cache.stride(1)))
    return aligned and q.data_ptr() % 16 == 0 and kv_cache.data_ptr() % 16 == 0


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
    version: str | None = None,
    runtime_kv_splits: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA tree-verify attention with the Gluon sm_90 kernel (+ ``ops.merge_splits``).

    Same contract as ``ops.mla_tree_verify`` (absorbed MLA against a latent paged
    cache; every context key visible, new key ``j`` visible to new token ``t`` iff bit
    ``j`` of ``ancestor_bits[t]`` is set and ``j <= t``) for the launches
    :func:`gluon_supported` accepts.

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
            context length and the SM count (one 224 KiB CTA per SM).
        max_query_len, max_seq_len: host-side maxima; required with
            ``validate_values=False`` (CUDA-graph friendly).
        validate_values: check the metadata values on the host (one sync).
        out: optional ``[T, H, 512]`` output buffer in q's dtype.
        version: ``"v1"`` (this module's kernel) or ``"v2"`` (``gluon_kernels_v2``, the
            warp-specialized seesaw); None reads ``$VLLM_DDTREE_MLA_GLUON`` (default v2).
        runtime_kv_splits: ``num_kv_splits`` (or ``max_seq_len``'s choice) is only the
            grid's split count; each request takes the count chosen for its own length
            (``ops.mla_tree_verify``).

    Returns:
        ``out [T, H, 512]`` in q's dtype and ``lse [T, H]`` fp32 (natural log of the
        softmax denominator); a row that sees no key gets ``out = 0, lse = -inf``.

    Raises:
        ValueError: the launch is invalid or not supported (:func:`gluon_supported`).
    """
    version = gluon_version(version)
    _check_mla_inputs(q, kv_cache, scale, kv_lora_rank)
    if not gluon_supported(q, kv_cache, kv_lora_rank):
        raise ValueError("mla_tree_fwd_gluon: unsupported launch (see gluon_supported)")
    num_tokens, num_heads, _ = q.shape
    page_size = kv_cache.shape[1]
    stats, out, lse = prepare_outputs(
        q, kv_cache, block_table, seq_lens, query_start_loc, ancestor_bits, kv_lora_rank,
        max_query_len, max_seq_len, validate_values, out)
    num_reqs = seq_lens.shape[0]
    if num_reqs == 0 or stats.max_query_len == 0 or num_tokens == 0:
        return out, lse

    row_blocks = triton.cdiv(stats.max_query_len * num_heads, BLOCK_M)
    num_kv_splits = resolve_num_kv_splits(
        num_kv_splits, num_requests=num_reqs, row_blocks=row_blocks,
        max_keys=stats.max_seq_len, block_n=BLOCK_N, device=q.device, ctas_per_sm=1,
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

    log_launch_once("gluon", q, kv_cache, kv_lora_rank=kv_lora_rank, requests=num_reqs,
                    row_blocks=row_blocks, splits=num_kv_splits,
                    max_query_len=stats.max_query_len,
                    max_seq_len=stats.max_seq_len, runtime_splits=runtime_kv_splits)
    if version == "v2":
        from .gluon_kernels_v2 import NUM_WARPS as num_warps  # + a 4-warp worker
        from .gluon_kernels_v2 import _mla_tree_fwd_gluon_v2_kernel as kernel

    else:
        kernel, num_warps = _mla_tree_fwd_gluon_kernel, NUM_WARPS
    kernel[(row_blocks, num_kv_splits, num_reqs)](
        q, kv_cache, block_table, seq_lens, query_start_loc, ancestor_bits, out_buf, lse_buf,
        scale * LOG2E,
        q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1),
        block_table.stride(0), ancestor_bits.stride(0), ancestor_bits.shape[1],
        *out_strides, *lse_strides, split_slots(q.device, ctas_per_sm=1),
        NUM_HEADS=num_heads, KV_LORA=kv_lora_rank, ROPE=ROPE_DIM, PAGE_SIZE=page_size,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, RUNTIME_SPLITS=runtime_kv_splits and num_kv_splits > 1,
        num_warps=num_warps,
    )  # fmt: skip
    if num_kv_splits > 1:
        merge_splits(out_buf, lse_buf, out, lse, num_kv_splits, row_blocks, seq_lens,
                     seq_lens, BLOCK_M, kv_lora_rank, False)
    return out, lse
