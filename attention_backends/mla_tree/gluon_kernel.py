# SPDX-License-Identifier: Apache-2.0
"""Gluon (sm_90) MLA tree-verify kernel: a FlashMLA-style "seesaw" of two warpgroups.

Same work split, inputs and partial outputs as the Triton ``kernels._mla_tree_fwd_kernel``
(grid ``(row_blocks, num_kv_splits, num_reqs)``, rows ``token * H + head``, a CTA loops
over the 64-key tiles of its split; per-split ``out``/``lse`` partials finished by
``ops.merge_splits``), restricted to Hopper, 16-bit dtypes, ``kv_lora_rank`` 512 + rope
64 and no active rows (:func:`gluon_supported`). Launched by ``ops.mla_tree_fwd_gluon``.

Why a seesaw: splitting ``S = Q K^T`` of every tile by key columns over two warpgroups
(n=32 wgmmas, each reading all of Q) needs CTA-wide barriers for the row max, and both
warpgroups then run their softmax at the same time with the tensor cores idle. Here
each warpgroup computes the full ``S`` of alternate tiles, and the softmax of one
overlaps the other's wgmmas.

Layout. ``gl.warp_specialize`` (it lowers for sm_90 in triton 3.6: named ``bar.sync``
per partition, ``setmaxnreg``) runs the same code as two 4-warp partitions: warpgroup
0 (default partition) and warpgroup 1 (worker). Warpgroup ``w`` owns the KV tiles
``j = w (mod 2)`` (buffer ``w``) and computes their FULL 64 x 64 ``S`` (n=64 wgmmas),
and accumulates the output columns ``256 w .. 256 w + 255`` of every tile (64 x 256
fp32, 128 registers a thread). Shared memory: Q (64 x 576, 72 KiB, split 256 | 256 |
64 so either V half is a whole operand) and two KV buffers (2 x 72 KiB; K = the 576-wide
latent row, V = its first 512 columns read in place): 216 KiB plus 1.3 KiB of row
statistics and mbarriers. No separate P buffer: once ``S(j)`` has retired, the rope
slot (64 x 64) of tile ``j``'s buffer is dead, so the owner writes ``P(j)`` there for
the other warpgroup; that warpgroup refills the slot after its ``P(j) V(j)`` retired.

Schedule of a pair ``(a, b) = (2p, 2p + 1)`` (the "seesaw" of FlashMLA's sm90 decode
kernel, with the running max ``m`` shared through shared memory)::

    wg0                                   wg1
    wait K(a); S0 = Q K(a)^T              wait K(b); S1 = Q K(b)^T; rowmax
    m0 = max(m, rowmax S0), sc0,
    P0 = exp(S0 - m0); publish m, sc0 --> wait; m1 = max(m0, rowmax S1), sc1,
    O_L = O_L sc0 + P0 V_L(a)   (async)   P1 = exp(S1 - m1); publish m, sc1
    wait PV; wait sc1               <--   P1 -> rope slot of buffer 1
    P0 sc1 -> rope slot of buffer 0  -->  O_R = O_R sc0 sc1 + P1 V_R(b)   (async)
    refill V_L of buffer 0                O_R += (P0 sc1) V_R(a)        (async)
    O_L = O_L sc1 + P1 V_L(b)  (async)
    wait; refill V_L + rope of buf 1      wait(1); refill V_R of buf 1; wait(0);
                                          refill V_R + rope of buffer 0

so while one warpgroup runs its softmax (CUDA cores), the other has wgmmas in flight:
wg1's softmax overlaps ``P0 V_L(a)``; wg0's rescale overlaps ``P1 V_R(b)``,
``P0 V_R(a)``; ``S`` of the next pair overlaps the other warpgroup's PV. The
hand-offs are mbarriers (count 1, one elected arrive after a partition-local barrier):
``m``/``sc0`` ready, ``m``/``sc1`` ready, ``P0`` ready, ``P1`` ready; there is no
CTA-wide barrier in the loop. KV tiles are gathered row by row through the block table
(any page size) with cp.async (16-byte vectors, 128-byte-swizzled NVMMA shared layouts)
by both warpgroups (each refills what it was the last to read) and completed on a
per-buffer mbarrier with ``cp.async.mbarrier.arrive.noinc`` (256 arrivals a phase). Key
indices past the split end are clamped to its last key (valid addresses, masked in
``S``); a split with an odd number of tiles runs one such fully masked tile (``P = 0``).
``tests/test_gluon_mla_protocol.py`` models this schedule (every interleaving of the two
warpgroups: no deadlock, phase slip or early buffer refill) and its arithmetic: keep it
in step with any change here.

The final ``l = l_0 + l_1`` (each warpgroup sums the ``P`` of its own tiles, both kept
relative to the same running max) is exchanged through shared memory at the end.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy,
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from . import configs, dispatch

LN2 = gl.constexpr(0.6931471805599453)

# The only shape the kernel takes (gluon_supported).
KV_LORA_RANK = 512
ROPE_DIM = 64
BLOCK_M = 64
BLOCK_N = 64
NUM_WARPS = 4  # launch num_warps: the default partition; + a 4-warp worker partition
WORKER_NUM_REGS = 248  # setmaxnreg of the worker (default: 256; 240 spilled)
_WARPS = gl.constexpr(NUM_WARPS)
_WORKER_REGS = gl.constexpr(WORKER_NUM_REGS)
# The split-count cost model of configs.select_num_kv_splits, for _runtime_num_splits.
MIN_TILES_PER_SPLIT = gl.constexpr(configs.MIN_TILES_PER_SPLIT)
MAX_KV_SPLITS = gl.constexpr(configs.MAX_KV_SPLITS)
SPLIT_OVERHEAD_TILES = gl.constexpr(configs.SPLIT_OVERHEAD_TILES)

# Rows (of BLOCK_M) of the fp32 [STAT_ROWS * BLOCK_M] statistics buffer.
STAT_M = gl.constexpr(0)  # running max (log2 units)
STAT_SC0 = gl.constexpr(1)  # wg0's rescale of the pair
STAT_SC1 = gl.constexpr(2)  # wg1's rescale of the pair
STAT_L0 = gl.constexpr(3)  # final l of wg0, then of wg1
STAT_ROWS = gl.constexpr(8)
# mbarriers: KV buffer 0 / 1 loaded, sc0 / sc1 published, P0 / P1 written, l written.
BAR_KV0 = gl.constexpr(0)
BAR_SC0 = gl.constexpr(2)
BAR_SC1 = gl.constexpr(3)
BAR_P0 = gl.constexpr(4)
BAR_P1 = gl.constexpr(5)
BAR_FIN0 = gl.constexpr(6)
NUM_BARS = gl.constexpr(8)


def gluon_supported(q: torch.Tensor, kv_cache: torch.Tensor, kv_lora_rank: int) -> bool:
    """Whether the Gluon kernel handles this launch (``ops.mla_tree_fwd_gluon``); else
    the Triton kernel does.

    Args:
        q: ``[T, H, 576]`` query (bf16 or fp16 for the Gluon kernel).
        kv_cache: ``[num_blocks, page_size, 576]`` latent cache, q's dtype.
        kv_lora_rank: must be 512 (rope dim 64).

    Returns:
        True on a CUDA device of compute capability 9.x (Hopper) with 16-bit q and
        cache, ``kv_lora_rank == 512``, rope 64, contiguous last dims, 16-byte aligned
        rows.
    """
    if kv_lora_rank != KV_LORA_RANK:
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
    # device_arch is cached: the driver's capability query costs tens of microseconds,
    # and this check runs at every launch (27 a step in an eager MLA forward)
    arch = dispatch.device_arch(q.device)
    if arch is None or not arch.startswith("sm_9"):
        return False
    if q.stride(2) != 1 or kv_cache.stride(2) != 1:
        return False
    # cp.async moves 16-byte vectors: row starts must be 8-element aligned.
    aligned = all(s % 8 == 0 for s in (q.stride(0), q.stride(1), kv_cache.stride(0),
                                       kv_cache.stride(1)))
    return aligned and q.data_ptr() % 16 == 0 and kv_cache.data_ptr() % 16 == 0


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
    an int32 scalar when a tile lies in one page, else int32 ``[BLOCK_N]``."""
    if PAGE_SIZE % BLOCK_N == 0:
        # The whole tile lies in one page (tiles start at multiples of BLOCK_N).
        return gl.load(BlockTable + bt_row + gl.minimum(start_n, last_key) // PAGE_SIZE)
    else:
        keys = gl.minimum(start_n + gl.arange(0, BLOCK_N, gl.SliceLayout(1, LD)), last_key)
        return gl.load(BlockTable + bt_row + keys // PAGE_SIZE)


@gluon.jit
def _mask_scores(
    s, start_n, split_end, ctx_len, q_start, row_tok, AncestorBits, stride_bits, num_words,
    S_LAYOUT: gl.constexpr, BLOCK_N: gl.constexpr,
):  # fmt: skip
    """``s`` fp32 ``[BLOCK_M, BLOCK_N]`` (keys ``start_n ..``) with the keys a row may not
    see set to -inf: past ``split_end``, new tokens outside the row's ancestor bits, and
    new tokens after the row's own (topological order). Only a tile that reaches past
    the context or past the split end (the dummy tile of an odd split) is masked."""
    if start_n + BLOCK_N > gl.minimum(ctx_len, split_end):
        offs_n = start_n + gl.arange(0, BLOCK_N, gl.SliceLayout(0, S_LAYOUT))
        new_idx = offs_n - ctx_len  # index among the request's new tokens; < 0: context
        bit_idx = gl.maximum(new_idx, 0)
        # BLOCK_N <= 64: the tile's new tokens span at most two mask words per row.
        word_lo = gl.maximum(start_n - ctx_len, 0) // 64
        bits_row = AncestorBits + (q_start + row_tok).to(gl.int64) * stride_bits
        lo = gl.load(bits_row + word_lo, mask=(row_tok * 0 + word_lo) < num_words, other=0)
        hi = gl.load(bits_row + word_lo + 1, mask=(row_tok * 0 + word_lo + 1) < num_words,
                     other=0)
        words = gl.where(((bit_idx // 64) == word_lo)[None, :], lo[:, None], hi[:, None])
        bit_set = ((words >> (bit_idx % 64).to(gl.int64)[None, :]) & 1) != 0
        visible = (offs_n < split_end)[None, :] & ((new_idx < 0)[None, :] | bit_set)
        visible = visible & (new_idx[None, :] <= row_tok[:, None])
        s = gl.where(visible, s, float("-inf"))
    return s


@gluon.jit
def _load_kv_part(KV, BlockTable, bt_row, start_n, last_key, dst_v, dst_r, bar, stride_kvb,
             stride_kvp, WG: gl.constexpr, WITH_ROPE: gl.constexpr, PAGE_SIZE: gl.constexpr,
             BLOCK_N: gl.constexpr, KV_LORA: gl.constexpr, ROPE: gl.constexpr,
             pred=None):
    """This warpgroup's share of KV tile ``start_n`` (keys clamped to ``last_key``):
    the V half ``WG`` (``[BLOCK_N, 256]`` into ``dst_v``) and, with ``WITH_ROPE``, the
    rope part (``[BLOCK_N, 64]`` into ``dst_r``); cp.async, completion counted on
    ``bar`` by each of the 128 threads (``.noinc``). ``pred`` (scalar bool) instead of a
    branch around the call, where wgmmas are in flight (ptxas retires them at a
    branch): when False nothing is read (the V half is zero-filled); with ``pred`` the
    caller arrives on ``bar`` itself (``async_copy.mbarrier_arrive``, only when ``pred``:
    a predicated-off refill must not leave arrivals pending on a barrier at exit)."""
    LD: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    pages = _tile_pages(BlockTable, bt_row, start_n, last_key, PAGE_SIZE, BLOCK_N, LD)
    keys = gl.minimum(start_n + gl.arange(0, BLOCK_N, gl.SliceLayout(1, LD)), last_key)
    row = pages.to(gl.int64) * stride_kvb + (keys % PAGE_SIZE) * stride_kvp
    ptrs = KV + row[:, None]
    offs_v = WG * (KV_LORA // 2) + gl.arange(0, KV_LORA // 2, gl.SliceLayout(0, LD))
    if pred is None:
        async_copy.async_copy_global_to_shared(dst_v, ptrs + offs_v[None, :])
    else:
        gl.static_assert(not WITH_ROPE)
        keep = (keys >= 0)[:, None] & (offs_v >= 0)[None, :] & pred
        async_copy.async_copy_global_to_shared(dst_v, ptrs + offs_v[None, :], mask=keep)
    if WITH_ROPE:
        offs_r = KV_LORA + gl.arange(0, ROPE, gl.SliceLayout(0, LD))
        async_copy.async_copy_global_to_shared(dst_r, ptrs + offs_r[None, :])
    if pred is None:
        async_copy.mbarrier_arrive(bar, increment_count=False)


@gluon.jit
def _opaque_zero(x):
    """int32 0 that the compiler cannot see through (``x``: any loop-variant int32).
    Indexing the shared buffers with it keeps the 2 x 36 wgmma descriptors of ``Q K^T``
    from being hoisted out of the KV loop into (spilled) registers."""
    return gl.inline_asm_elementwise("mov.u32 $0, 0;", "=r,r", [x], dtype=gl.int32,
                                     is_pure=True, pack=1)


@gluon.jit
def _qk(q_lo, q_hi, q_r, k_lo, k_hi, k_r, zero, S_LAYOUT: gl.constexpr,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """``S = Q K^T`` fp32 ``[BLOCK_M, BLOCK_N]`` of one warpgroup (n=64 wgmmas); all
    operands are ``[1, rows, *]`` buffers indexed by the opaque ``zero``."""
    s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, S_LAYOUT)
    s = warpgroup_mma(q_lo.index(zero), k_lo.index(zero).permute((1, 0)), s, use_acc=False,
                      is_async=True)
    s = warpgroup_mma(q_hi.index(zero), k_hi.index(zero).permute((1, 0)), s, is_async=True)
    s = warpgroup_mma(q_r.index(zero), k_r.index(zero).permute((1, 0)), s, is_async=True)
    return warpgroup_mma_wait(num_outstanding=0, deps=[s])


@gluon.jit
def _seesaw_partition(
    KV, BlockTable, AncestorBits, Out, Lse, q_lo, q_hi, q_r, lo0, hi0, r0, lo1, hi1, r1,
    stat, bars, qk_scale, stride_kvb, stride_kvp, stride_bits, num_words, stride_ot, stride_oh,
    stride_os, stride_lt, stride_lh, stride_ls, bt_row, q_start, ctx_len, split_start,
    split_end, num_rows, pid_m, pid_s,
    NUM_HEADS: gl.constexpr, KV_LORA: gl.constexpr, ROPE: gl.constexpr,
    PAGE_SIZE: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    WG: gl.constexpr,
):  # fmt: skip
    """Warpgroup ``WG`` of the seesaw (module docstring): its own tiles' ``S`` and
    softmax, the V columns ``256 WG ..`` of every tile, its share of the KV refills."""
    gl.static_assert(gl.num_warps() == 4)
    dtype: gl.constexpr = q_lo.dtype
    VH: gl.constexpr = KV_LORA // 2
    S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    O_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, VH, 16])
    P_OPERAND: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_LAYOUT,
                                                  k_width=2)
    ROW_S: gl.constexpr = gl.SliceLayout(1, S_LAYOUT)
    ROW_O: gl.constexpr = gl.SliceLayout(1, O_LAYOUT)
    OTHER: gl.constexpr = 1 - WG
    # Buffer b = (lo_b | hi_b | r_b): K columns 0..255 | 256..511 | rope, each its own
    # [1, BLOCK_N, *] allocation (so a refill of one never waits for a wgmma reading the
    # other). This warpgroup's own tile buffer, and its V half of both buffers:
    if WG == 0:
        own_lo, own_hi, own_r = lo0, hi0, r0
        v0, v1 = lo0, lo1
    else:
        own_lo, own_hi, own_r = lo1, hi1, r1
        v0, v1 = hi0, hi1

    rows_s = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, ROW_S)
    tok_s = gl.minimum(rows_s, num_rows - 1) // NUM_HEADS
    last_key = split_end - 1
    num_tiles = gl.cdiv(split_end - split_start, BLOCK_N)
    num_pairs = gl.cdiv(num_tiles, 2)

    # Tiles 0 and 1: this warpgroup's V half of each, and the rope part of the buffer
    # it does not own (the one whose rope slot it reads P from).
    _load_kv_part(KV, BlockTable, bt_row, split_start, last_key, v0.index(0), r0.index(0),
             bars.index(BAR_KV0), stride_kvb, stride_kvp, WG, WG == 1, PAGE_SIZE,
             BLOCK_N, KV_LORA, ROPE)
    _load_kv_part(KV, BlockTable, bt_row, split_start + BLOCK_N, last_key, v1.index(0),
             r1.index(0), bars.index(BAR_KV0 + 1), stride_kvb, stride_kvp, WG, WG == 0,
             PAGE_SIZE, BLOCK_N, KV_LORA, ROPE)

    acc = gl.zeros([BLOCK_M, VH], gl.float32, O_LAYOUT)
    l_i = gl.zeros([BLOCK_M], gl.float32, ROW_S)
    for pair in range(0, num_pairs):
        phase = pair & 1
        more = pair + 1 < num_pairs
        start_a = split_start + 2 * pair * BLOCK_N
        start_b = start_a + BLOCK_N
        start_own = start_a + WG * BLOCK_N
        zero = _opaque_zero(pair)
        # S of this warpgroup's tile (buffer WG), masked.
        mbarrier.wait(bars.index(BAR_KV0 + WG), phase)
        fence_async_shared()
        s = _qk(q_lo, q_hi, q_r, own_lo, own_hi, own_r, zero, S_LAYOUT, BLOCK_M, BLOCK_N)
        s = _mask_scores(s * qk_scale, start_own, split_end, ctx_len, q_start, tok_s,
                         AncestorBits, stride_bits, num_words, S_LAYOUT, BLOCK_N)
        s_max = gl.max(s, axis=1)
        if WG == 1:
            mbarrier.wait(bars.index(BAR_SC0), phase)
        m_old = stat.slice(STAT_M * BLOCK_M, BLOCK_M).load(ROW_S)
        m_new = gl.maximum(m_old, s_max)
        m_base = gl.where(m_new == float("-inf"), 0.0, m_new)  # a row that saw nothing
        sc = gl.exp2(m_old - m_base)
        p = gl.exp2(s - m_base[:, None])
        stat.slice(STAT_M * BLOCK_M, BLOCK_M).store(m_new)
        if WG == 0:
            stat.slice(STAT_SC0 * BLOCK_M, BLOCK_M).store(sc)
            mbarrier.arrive(bars.index(BAR_SC0))
            l_i = l_i * sc + gl.sum(p, axis=1)
            # O_L = O_L sc0 + P0 V_L(a).
            acc = acc * gl.convert_layout(sc, ROW_O)[:, None]
            acc = warpgroup_mma(gl.convert_layout(p.to(dtype), P_OPERAND), v0.index(zero),
                                acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
            # P0 rescaled to wg1's max goes to buffer 0's (dead) rope slot; then refill
            # V_L of buffer 0 (tile a + 2).
            mbarrier.wait(bars.index(BAR_SC1), phase)
            sc1 = stat.slice(STAT_SC1 * BLOCK_M, BLOCK_M).load(ROW_S)
            r0.index(zero).store((p * sc1[:, None]).to(dtype))
            fence_async_shared()
            mbarrier.arrive(bars.index(BAR_P0))
            if more:
                _load_kv_part(KV, BlockTable, bt_row, start_a + 2 * BLOCK_N, last_key,
                         v0.index(zero), r0.index(zero), bars.index(BAR_KV0), stride_kvb,
                         stride_kvp, 0, False, PAGE_SIZE, BLOCK_N, KV_LORA, ROPE)
            l_i = l_i * sc1
            acc = acc * gl.convert_layout(sc1, ROW_O)[:, None]
            # O_L += P1 V_L(b), P1 from buffer 1's rope slot; then refill buffer 1's
            # V_L and rope slot (tile b + 2).
            mbarrier.wait(bars.index(BAR_P1), phase)
            # V_L(b) landed from this warpgroup's own cp.async, seen only through wg1's
            # KV wait -> P1 arrive: fence here too before the wgmma (async proxy) reads it.
            fence_async_shared()
            acc = warpgroup_mma(r1.index(zero), v1.index(zero), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
            if more:
                _load_kv_part(KV, BlockTable, bt_row, start_b + 2 * BLOCK_N, last_key,
                         v1.index(zero), r1.index(zero), bars.index(BAR_KV0 + 1), stride_kvb,
                         stride_kvp, 0, True, PAGE_SIZE, BLOCK_N, KV_LORA, ROPE)
        else:
            sc0 = stat.slice(STAT_SC0 * BLOCK_M, BLOCK_M).load(ROW_S)
            stat.slice(STAT_SC1 * BLOCK_M, BLOCK_M).store(sc)
            mbarrier.arrive(bars.index(BAR_SC1))
            both = sc0 * sc
            l_i = l_i * both + gl.sum(p, axis=1)
            p_lo = p.to(dtype)
            r1.index(zero).store(p_lo)
            fence_async_shared()
            mbarrier.arrive(bars.index(BAR_P1))
            # O_R = O_R sc0 sc1 + P1 V_R(b) + (P0 sc1) V_R(a): both in flight at once.
            acc = acc * gl.convert_layout(both, ROW_O)[:, None]
            acc = warpgroup_mma(gl.convert_layout(p_lo, P_OPERAND), v1.index(zero), acc,
                                is_async=True)
            mbarrier.wait(bars.index(BAR_P0), phase)
            fence_async_shared()  # V_R(a): as wg0's V_L(b) above
            acc = warpgroup_mma(r0.index(zero), v0.index(zero), acc, is_async=True)
            # P1 V_R(b) retired (P0 V_R(a) still in flight): refill V_R of buffer 1,
            # predicated (no branch while a wgmma is in flight).
            acc = warpgroup_mma_wait(num_outstanding=1, deps=[acc])
            _load_kv_part(KV, BlockTable, bt_row, start_b + 2 * BLOCK_N, last_key,
                     v1.index(zero), r1.index(zero), bars.index(BAR_KV0 + 1), stride_kvb,
                     stride_kvp, 1, False, PAGE_SIZE, BLOCK_N, KV_LORA, ROPE, pred=more)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
            if more:
                # Buffer 1's V_R refill above completes on its barrier (noinc: tracks
                # all of this thread's earlier cp.asyncs); none without a next pair.
                async_copy.mbarrier_arrive(bars.index(BAR_KV0 + 1), increment_count=False)
                _load_kv_part(KV, BlockTable, bt_row, start_a + 2 * BLOCK_N, last_key,
                         v0.index(zero), r0.index(zero), bars.index(BAR_KV0), stride_kvb,
                         stride_kvp, 1, True, PAGE_SIZE, BLOCK_N, KV_LORA, ROPE)

    # The last pair's predicated-off refill may still be pending.
    async_copy.commit_group()
    async_copy.wait_group(0)
    # l = l_0 + l_1 (both relative to the final max, wg1's last m).
    stat.slice((STAT_L0 + WG) * BLOCK_M, BLOCK_M).store(l_i)
    mbarrier.arrive(bars.index(BAR_FIN0 + WG))
    mbarrier.wait(bars.index(BAR_FIN0 + OTHER), 0)
    l_i = l_i + stat.slice((STAT_L0 + OTHER) * BLOCK_M, BLOCK_M).load(ROW_S)
    seen = l_i > 0.0
    if WG == 0:
        m_i = stat.slice(STAT_M * BLOCK_M, BLOCK_M).load(ROW_S)
        lse = gl.where(seen, (m_i + gl.log2(gl.where(seen, l_i, 1.0))) * LN2, float("-inf"))
        lse_ptrs = (Lse + (q_start + rows_s // NUM_HEADS).to(gl.int64) * stride_lt
                    + (rows_s % NUM_HEADS) * stride_lh + pid_s * stride_ls)
        gl.store(lse_ptrs, lse, mask=rows_s < num_rows)
    inv_l = gl.convert_layout(1.0 / gl.where(seen, l_i, 1.0), ROW_O)
    out = acc * inv_l[:, None]
    rows_o = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, ROW_O)
    offs_o = WG * VH + gl.arange(0, VH, gl.SliceLayout(0, O_LAYOUT))
    out_row = ((q_start + rows_o // NUM_HEADS).to(gl.int64) * stride_ot
               + (rows_o % NUM_HEADS) * stride_oh + pid_s * stride_os)
    gl.store(Out + out_row[:, None] + offs_o[None, :], out.to(Out.dtype.element_ty),
             mask=(rows_o < num_rows)[:, None])


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
    """One CTA (launched with ``num_warps=4`` + a 4-warp worker): ``BLOCK_M`` rows of
    request ``program_id(2)`` against split ``program_id(1)`` of its keys (the Triton
    kernel's arguments, without its active-row ones). The 4 default warps load Q, the
    first two KV tiles' setup and the mbarriers, then fork into the two warpgroups
    (module docstring)."""
    gl.static_assert(BLOCK_M == 64)
    gl.static_assert(BLOCK_N == 64)
    gl.static_assert(KV_LORA == 512)
    gl.static_assert(gl.num_warps() == 4)
    dtype: gl.constexpr = Q.dtype.element_ty
    VH: gl.constexpr = KV_LORA // 2
    LD: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    ROW: gl.constexpr = gl.SliceLayout(1, LD)
    SMEM: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16,
                                              rank=2)
    STAT: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])

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
    if split_start >= split_end:
        rows = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, ROW)
        lse_ptrs = (Lse + (q_start + rows // NUM_HEADS).to(gl.int64) * stride_lt
                    + (rows % NUM_HEADS) * stride_lh + pid_s * stride_ls)
        gl.store(lse_ptrs, gl.full([BLOCK_M], float("-inf"), gl.float32, ROW),
                 mask=rows < num_rows)
        return

    q_lo = gl.allocate_shared_memory(dtype, [1, BLOCK_M, VH], SMEM)
    q_hi = gl.allocate_shared_memory(dtype, [1, BLOCK_M, VH], SMEM)
    q_r = gl.allocate_shared_memory(dtype, [1, BLOCK_M, ROPE], SMEM)
    lo0 = gl.allocate_shared_memory(dtype, [1, BLOCK_N, VH], SMEM)
    hi0 = gl.allocate_shared_memory(dtype, [1, BLOCK_N, VH], SMEM)
    r0 = gl.allocate_shared_memory(dtype, [1, BLOCK_N, ROPE], SMEM)
    lo1 = gl.allocate_shared_memory(dtype, [1, BLOCK_N, VH], SMEM)
    hi1 = gl.allocate_shared_memory(dtype, [1, BLOCK_N, VH], SMEM)
    r1 = gl.allocate_shared_memory(dtype, [1, BLOCK_N, ROPE], SMEM)
    stat = gl.allocate_shared_memory(gl.float32, [STAT_ROWS * BLOCK_M], STAT)
    bars = gl.allocate_shared_memory(gl.int64, [NUM_BARS, 1], mbarrier.MBarrierLayout())
    # KV buffers: 128 cp.async arrivals from each warpgroup a phase; the rest: 1.
    mbarrier.init(bars.index(BAR_KV0), count=256)
    mbarrier.init(bars.index(BAR_KV0 + 1), count=256)
    for i in gl.static_range(BAR_SC0, NUM_BARS):
        mbarrier.init(bars.index(i), count=1)

    # Q rows (past the last row: the last row again, never stored).
    rows_ld = gl.minimum(pid_m * BLOCK_M + gl.arange(0, BLOCK_M, ROW), num_rows - 1)
    q_off = ((q_start + rows_ld // NUM_HEADS).to(gl.int64) * stride_qt
             + (rows_ld % NUM_HEADS) * stride_qh)
    q_ptrs = Q + q_off[:, None]
    offs_h = gl.arange(0, VH, gl.SliceLayout(0, LD))
    offs_r = gl.arange(0, ROPE, gl.SliceLayout(0, LD))
    async_copy.async_copy_global_to_shared(q_lo.index(0), q_ptrs + offs_h[None, :])
    async_copy.async_copy_global_to_shared(q_hi.index(0), q_ptrs + VH + offs_h[None, :])
    async_copy.async_copy_global_to_shared(q_r.index(0), q_ptrs + KV_LORA + offs_r[None, :])
    async_copy.commit_group()
    stat.slice(STAT_M * BLOCK_M, BLOCK_M).store(gl.full([BLOCK_M], float("-inf"), gl.float32, ROW))
    async_copy.wait_group(0)
    fence_async_shared()
    gl.thread_barrier()

    bt_row = pid_r.to(gl.int64) * stride_bt
    gl.warp_specialize(
        [(_seesaw_partition,
          (KV, BlockTable, AncestorBits, Out, Lse, q_lo, q_hi, q_r, lo0, hi0, r0, lo1, hi1, r1,
           stat, bars, qk_scale, stride_kvb, stride_kvp, stride_bits, num_words, stride_ot,
           stride_oh, stride_os, stride_lt, stride_lh, stride_ls, bt_row, q_start,
           ctx_len, split_start, split_end, num_rows, pid_m, pid_s, NUM_HEADS, KV_LORA,
           ROPE, PAGE_SIZE, BLOCK_M, BLOCK_N, 0)),
         (_seesaw_partition,
          (KV, BlockTable, AncestorBits, Out, Lse, q_lo, q_hi, q_r, lo0, hi0, r0, lo1, hi1, r1,
           stat, bars, qk_scale, stride_kvb, stride_kvp, stride_bits, num_words, stride_ot,
           stride_oh, stride_os, stride_lt, stride_lh, stride_ls, bt_row, q_start,
           ctx_len, split_start, split_end, num_rows, pid_m, pid_s, NUM_HEADS, KV_LORA,
           ROPE, PAGE_SIZE, BLOCK_M, BLOCK_N, 1))],
        [_WARPS], [_WORKER_REGS])  # fmt: skip
