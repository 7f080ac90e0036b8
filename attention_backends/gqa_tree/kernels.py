# SPDX-License-Identifier: Apache-2.0
"""Triton kernel of GQA tree-verify attention over vLLM's paged K/V caches.

``_gqa_tree_fwd_kernel``: grid ``(row_blocks, kv_heads * kv_splits, requests)``. A CTA
takes ``BLOCK_M`` rows ``row = token * GROUP + q_head_in_group`` of one request and one
KV head, and one split of the request's keys, so all query tokens and all query heads
of the group share each K/V tile. Axis 0 varies fastest: the CTAs reading the same
(request, KV head, split) run side by side (L2). With more than one split the partial
results are merged by ``vllm_ddtree.attention_backends.mla_tree.kernels._mla_tree_merge_kernel``.

``HAS_ACTIVE`` (constexpr) adds per-request active query rows (adaptive tree
budget): only the first ``ActiveQueryLens[r]`` tokens of request ``r`` are real. As in
the MLA kernel, the active rows of a (request, KV head) re-split its keys over the CTAs
of the inactive ones (``_resplit_active_rows``), writing compact partials and a per-row
split index that the merge reads; inactive rows get ``out = 0``. Without it
``ActiveQueryLens``, ``MergeBase`` and ``MergeCount`` are never read.
"""

import triton
import triton.language as tl

from vllm_ddtree.attention_backends.mla_tree.kernels import (
    _SPLIT_DEPENDENT,
    LN2,
    _resplit_active_rows,
)
from vllm_ddtree.attention_backends.mla_tree.tiles import _dot, _page_ids, _tree_visible

LOG2E = 1.4426950408889634
M1 = tl.constexpr(0x5555555555555555)
M2 = tl.constexpr(0x3333333333333333)
M4 = tl.constexpr(0x0F0F0F0F0F0F0F0F)


@triton.jit
def _popcount64(x):
    """Number of set bits of each int64 element (SWAR; Triton has no portable popcount)."""
    x = x - ((x >> 1) & M1)
    x = (x & M2) + ((x >> 2) & M2)
    x = (x + (x >> 4)) & M4
    # Sum the 8 byte counts without a 64-bit multiply overflow.
    x = x + (x >> 8)
    x = x + (x >> 16)
    x = x + (x >> 32)
    return (x & 0x7F).to(tl.int32)


@triton.jit
def _tree_depth(AncestorBits, rows, stride_bits, num_words, valid):
    """Depth of each new token: its number of ancestors (root = 0), from its bit row."""
    count = tl.full(rows.shape, 0, tl.int32)
    for w in range(num_words):
        word = tl.load(AncestorBits + rows * stride_bits + w, mask=valid, other=0)
        count += _popcount64(word)
    return count - 1


@triton.jit
def _load_kv(
    Cache, pages, start_n, key_valid, offs_d, stride_b, stride_p, kv_head_off,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    offs_n = start_n + tl.arange(0, BLOCK_N)
    row_off = pages.to(tl.int64) * stride_b + (offs_n % PAGE_SIZE) * stride_p + kv_head_off
    ptrs = Cache + row_off[:, None] + offs_d[None, :]
    if MASKED:
        return tl.load(ptrs, mask=key_valid[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    elif BLOCK_D != HEAD_DIM:
        return tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit(do_not_specialize=("num_splits", *_SPLIT_DEPENDENT))
def _gqa_tree_fwd_kernel(
    Q,
    KCache,
    VCache,
    BlockTable,
    SeqLens,
    QueryStartLoc,
    AncestorBits,
    Out,  # [T, Hq, Dh] (one split) or fp32 [T, Hq, S, Dh] partials
    Lse,  # fp32 [T, Hq, S] (natural log)
    qk_scale,  # softmax scale * log2(e)
    window,  # sliding window (keys), used when HAS_WINDOW
    num_splits,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kp,
    stride_kh,
    stride_vb,
    stride_vp,
    stride_vh,
    stride_bt,
    stride_bits,
    num_words,
    stride_ot,
    stride_oh,
    stride_os,
    stride_lt,
    stride_lh,
    stride_ls,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    ActiveQueryLens,  # int32 [R]; read only with HAS_ACTIVE
    MergeBase,  # int32 [T, Hq]; written only with HAS_ACTIVE
    MergeCount,  # int32 [T, Hq]; written only with HAS_ACTIVE
    stride_mt,
    HAS_ACTIVE: tl.constexpr,
    MIN_TILES: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
):
    """One CTA (see the module docstring)."""
    tl.static_assert(BLOCK_N <= 64)
    pid_m = tl.program_id(0)
    kv_head = tl.program_id(1) // num_splits
    pid_s = tl.program_id(1) % num_splits
    pid_r = tl.program_id(2)

    q_start = tl.load(QueryStartLoc + pid_r)
    q_len = tl.load(QueryStartLoc + pid_r + 1) - q_start
    num_rows = q_len * GROUP
    if not HAS_ACTIVE:
        if pid_m * BLOCK_M >= num_rows:
            return
    seq_len = tl.load(SeqLens + pid_r)
    ctx_len = seq_len - q_len

    if HAS_ACTIVE:
        # Every CTA of the (request, KV head) may take a work item (kernels of mla_tree).
        num_kv_heads = tl.num_programs(1) // num_splits
        slab_base = (pid_r * num_kv_heads + kv_head) * tl.num_programs(0) * num_splits * BLOCK_M
        keys = seq_len
        if HAS_WINDOW:
            keys = tl.minimum(seq_len, window + q_len)
        run, num_active, pid_m, pid_s, num_splits, part_row = _resplit_active_rows(
            ActiveQueryLens, MergeBase, MergeCount, stride_mt, kv_head * GROUP, slab_base,
            pid_r, pid_m, pid_s, num_splits, tl.num_programs(0), q_start, q_len, num_rows,
            tl.cdiv(keys, BLOCK_N), GROUP, BLOCK_M, MIN_TILES, MAX_SPLITS,
        )  # fmt: skip
        if not run:
            return

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_valid = offs_m < num_rows
    tok = offs_m // GROUP
    q_head = kv_head * GROUP + offs_m % GROUP
    q_row = (q_start + tok).to(tl.int64)
    row_active = row_valid
    if HAS_ACTIVE:
        row_active = row_valid & (tok < num_active)
        # Compact partials: stride_ot is the partial row stride, stride_lt Lse's.
        offs_lse = part_row * stride_lt
        offs_out = part_row[:, None] * stride_ot
    else:
        offs_lse = q_row * stride_lt + q_head * stride_lh + pid_s * stride_ls
        offs_out = q_row[:, None] * stride_ot + q_head[:, None] * stride_oh + pid_s * stride_os

    # Topological order: no row of this CTA sees a new token after its last token.
    last_tok = tl.minimum(pid_m * BLOCK_M + BLOCK_M - 1, num_rows - 1) // GROUP
    if HAS_ACTIVE:
        last_tok = tl.minimum(last_tok, num_active - 1)
    kv_end = ctx_len + last_tok + 1
    kv_start = 0
    if HAS_WINDOW:
        # A token at tree depth d has position ctx_len + d and sees positions
        # > ctx_len + d - window. Depth >= 0, so nothing before this start is visible.
        q_pos = ctx_len + _tree_depth(AncestorBits, q_row, stride_bits, num_words, row_active)
        kv_start = (tl.maximum(ctx_len - window + 1, 0) // BLOCK_N) * BLOCK_N
    # Even split of [kv_start, kv_end) in whole tiles (kv_start is tile aligned).
    keys_per_split = (((kv_end - kv_start + num_splits - 1) // num_splits + BLOCK_N - 1)
                      // BLOCK_N) * BLOCK_N  # fmt: skip
    split_start = kv_start + pid_s * keys_per_split
    split_end = tl.minimum(split_start + keys_per_split, kv_end)
    if split_start >= split_end:
        tl.store(Lse + offs_lse, tl.full([BLOCK_M], float("-inf"), tl.float32), mask=row_valid)
        return

    offs_d = tl.arange(0, BLOCK_D)
    q = tl.load(
        Q + q_row[:, None] * stride_qt + q_head[:, None] * stride_qh + offs_d[None, :],
        mask=row_active[:, None] & (offs_d[None, :] < HEAD_DIM),
        other=0.0,
    )
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
    bt_row = pid_r.to(tl.int64) * stride_bt
    k_head_off = kv_head.to(tl.int64) * stride_kh
    v_head_off = kv_head.to(tl.int64) * stride_vh

    ctx_tiles_end = tl.maximum(tl.minimum((ctx_len // BLOCK_N) * BLOCK_N, split_end), split_start)
    # Page ids are loaded one tile ahead (see the MLA kernel: keeps Triton's pipelining).
    pages = _page_ids(BlockTable, bt_row, split_start, split_end, PAGE_SIZE, BLOCK_N)
    # Phase 1: whole tiles of context keys (only the window can mask them).
    for start_n in range(split_start, ctx_tiles_end, BLOCK_N):
        cur_pages = pages
        pages = _page_ids(BlockTable, bt_row, start_n + BLOCK_N, split_end, PAGE_SIZE, BLOCK_N)
        k = _load_kv(
            KCache, cur_pages, start_n, None, offs_d, stride_kb, stride_kp, k_head_off,
            HEAD_DIM, BLOCK_D, PAGE_SIZE, BLOCK_N, False,
        )  # fmt: skip
        v = _load_kv(
            VCache, cur_pages, start_n, None, offs_d, stride_vb, stride_vp, v_head_off,
            HEAD_DIM, BLOCK_D, PAGE_SIZE, BLOCK_N, False,
        )  # fmt: skip
        qk = _dot(q, tl.trans(k), None, DOT_PRECISION, DOT_UPCAST) * qk_scale
        if HAS_WINDOW:
            offs_n = start_n + tl.arange(0, BLOCK_N)
            qk = tl.where(offs_n[None, :] > q_pos[:, None] - window, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_base = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_base)
        p = tl.exp2(qk - m_base[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = _dot(p.to(v.dtype), v, acc * alpha[:, None], DOT_PRECISION, DOT_UPCAST)
        m_i = m_new

    # Phase 2: partial context tile and new tokens (seq bound, tree mask, window).
    for start_n in range(ctx_tiles_end, split_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        key_valid = offs_n < split_end
        cur_pages = pages
        pages = _page_ids(BlockTable, bt_row, start_n + BLOCK_N, split_end, PAGE_SIZE, BLOCK_N)
        k = _load_kv(
            KCache, cur_pages, start_n, key_valid, offs_d, stride_kb, stride_kp, k_head_off,
            HEAD_DIM, BLOCK_D, PAGE_SIZE, BLOCK_N, True,
        )  # fmt: skip
        v = _load_kv(
            VCache, cur_pages, start_n, key_valid, offs_d, stride_vb, stride_vp, v_head_off,
            HEAD_DIM, BLOCK_D, PAGE_SIZE, BLOCK_N, True,
        )  # fmt: skip
        qk = _dot(q, tl.trans(k), None, DOT_PRECISION, DOT_UPCAST) * qk_scale

        visible = _tree_visible(AncestorBits, q_row, tok, row_active, offs_n, key_valid,
                                start_n, ctx_len, num_words, stride_bits, False)
        if HAS_WINDOW:
            new_idx = offs_n - ctx_len
            is_new = new_idx >= 0
            bit_idx = tl.maximum(new_idx, 0)
            key_rows = (q_start + bit_idx).to(tl.int64)
            key_depth = _tree_depth(
                AncestorBits, key_rows, stride_bits, num_words, is_new & key_valid
            )
            key_pos = tl.where(is_new, ctx_len + key_depth, offs_n)
            visible = visible & (key_pos[None, :] > q_pos[:, None] - window)
        qk = tl.where(visible, qk, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_base = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_base)
        p = tl.exp2(qk - m_base[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = _dot(p.to(v.dtype), v, acc * alpha[:, None], DOT_PRECISION, DOT_UPCAST)
        m_i = m_new

    seen = l_i > 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * LN2, float("-inf"))
    if HAS_ACTIVE:
        out = tl.where(row_active[:, None], out, 0.0)
        lse = tl.where(row_active, lse, float("-inf"))
    tl.store(
        Out + offs_out + offs_d[None, :],
        out.to(Out.dtype.element_ty),
        mask=row_valid[:, None] & (offs_d[None, :] < HEAD_DIM),
    )
    tl.store(Lse + offs_lse, lse, mask=row_valid)


