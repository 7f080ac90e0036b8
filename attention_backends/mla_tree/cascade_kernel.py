# SPDX-License-Identifier: Apache-2.0
"""Triton kernel of the cascade's tree part (``cascade.py``): the new tokens of each
request under the ancestor mask, folded into the context's partial result.

``_mla_tree_suffix_kernel``: grid ``(row_blocks, requests)``; a CTA takes ``BLOCK_M``
flattened rows ``row = token * H + head`` of one request (as ``kernels._mla_tree_fwd_kernel``)
and only the keys ``ctx_len .. seq_len`` (at most the tree's ``qlen``; tiles start at the
``BLOCK_N`` boundary below ``ctx_len``, whose context keys are masked out). Its online
softmax starts from the context partial: ``CtxOut`` (normalized, any float dtype) and
``CtxLse`` (natural log of its softmax denominator), which is what FlashMLA's dense decode
returns for the context alone. A request with
``ctx_len == 0`` reads no context partial. ``CtxOut`` may alias ``Out``: each row is read
before it is written, by the same CTA.
"""

import triton
import triton.language as tl

from .kernels import LN2, _attend_tile
from .tiles import _page_ids

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _mla_tree_suffix_kernel(
    Q, KV, BlockTable, SeqLens, QueryStartLoc, AncestorBits, Out, Lse, CtxOut, CtxLse,
    qk_scale,  # softmax scale * log2(e)
    stride_qt, stride_qh, stride_kvb, stride_kvp, stride_bt, stride_bits, num_words,
    stride_ot, stride_oh, stride_lt, stride_lh, stride_cot, stride_coh,
    stride_clr, stride_clh, stride_cli,  # CtxLse: per request, head, token of the request
    KVScale, QScale,  # fp32 [1] each (the cache's, the e4m3 query's); read only with KV_FP8
    NUM_HEADS: tl.constexpr, KV_LORA: tl.constexpr, ROPE: tl.constexpr,
    BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr, KV_FP8: tl.constexpr,
):  # fmt: skip
    """One CTA (module docstring)."""
    tl.static_assert(BLOCK_N <= 64)
    pid_m = tl.program_id(0)
    pid_r = tl.program_id(1)
    q_start = tl.load(QueryStartLoc + pid_r)
    q_len = tl.load(QueryStartLoc + pid_r + 1) - q_start
    num_rows = q_len * NUM_HEADS
    if pid_m * BLOCK_M >= num_rows:
        return
    seq_len = tl.load(SeqLens + pid_r)
    ctx_len = seq_len - q_len

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_valid = offs_m < num_rows
    tok = offs_m // NUM_HEADS
    head = offs_m % NUM_HEADS
    q_row = (q_start + tok).to(tl.int64)
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    if KV_FP8:
        kv_scale = tl.load(KVScale)
        qk_scale = qk_scale * kv_scale * tl.load(QScale)

    q_ptrs = Q + q_row[:, None] * stride_qt + head[:, None] * stride_qh
    q_nope = tl.load(q_ptrs + offs_l[None, :],
                     mask=row_valid[:, None] & (offs_l[None, :] < KV_LORA), other=0.0)
    q_rope = q_nope  # placeholder when ROPE == 0
    if ROPE > 0:
        q_rope = tl.load(q_ptrs + KV_LORA + offs_r[None, :],
                         mask=row_valid[:, None] & (offs_r[None, :] < ROPE), other=0.0)
    if KV_FP8:  # the e4m3 query FlashMLA took, widened to fp16 (exact)
        q_nope, q_rope = q_nope.to(tl.float16), q_rope.to(tl.float16)

    # The context partial is the online softmax's starting state: one "key" of weight
    # 2^lse (log2 units) and value CtxOut, i.e. m = lse, l = 1, acc = CtxOut. (Folded in
    # after the keys instead, its [BLOCK_M, BLOCK_L] tile lives beside acc: ptxas spilled
    # 0.5-1 KB a thread at 64-row tiles.) Without context: m = -inf, l = 0, acc = 0.
    has_ctx = row_valid & (ctx_len > 0)
    ctx_lse = tl.load(CtxLse + pid_r * stride_clr + head * stride_clh + tok * stride_cli,
                      mask=has_ctx, other=float("-inf")) * LOG2E
    m_i = tl.where(has_ctx, ctx_lse, float("-inf"))
    l_i = tl.where(has_ctx, 1.0, 0.0)
    acc = tl.load(CtxOut + q_row[:, None] * stride_cot + head[:, None] * stride_coh
                  + offs_l[None, :],
                  mask=has_ctx[:, None] & (offs_l[None, :] < KV_LORA), other=0.0)
    acc = acc.to(tl.float32)
    if KV_FP8:
        # acc holds kv_scale-free sums of the tree keys (scaled once at the end): the
        # context's already-scaled output enters divided by the scale.
        acc = acc / kv_scale
    bt_row = pid_r.to(tl.int64) * stride_bt
    # Topological order: the CTA's last token sees no new token after itself.
    last_tok = tl.minimum(pid_m * BLOCK_M + BLOCK_M - 1, num_rows - 1) // NUM_HEADS
    key_end = ctx_len + last_tok + 1
    for start_n in range((ctx_len // BLOCK_N) * BLOCK_N, key_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        key_valid = (offs_n >= ctx_len) & (offs_n < key_end)
        pages = _page_ids(BlockTable, bt_row, start_n, key_end, PAGE_SIZE, BLOCK_N)
        acc, m_i, l_i = _attend_tile(
            KV, AncestorBits, pages, start_n, offs_n, key_valid, q_nope, q_rope, qk_scale,
            acc, m_i, l_i, offs_l, offs_r, q_row, tok, row_valid, ctx_len, num_words,
            stride_kvb, stride_kvp, stride_bits, KV_LORA, ROPE, BLOCK_L, BLOCK_R, PAGE_SIZE,
            BLOCK_N, DOT_PRECISION, DOT_UPCAST, KV_FP8, True,
        )  # fmt: skip
    if KV_FP8:
        acc = acc * kv_scale
    seen = l_i > 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * LN2, float("-inf"))
    tl.store(Out + q_row[:, None] * stride_ot + head[:, None] * stride_oh + offs_l[None, :],
             out.to(Out.dtype.element_ty),
             mask=row_valid[:, None] & (offs_l[None, :] < KV_LORA))
    tl.store(Lse + q_row * stride_lt + head * stride_lh, lse, mask=row_valid)
