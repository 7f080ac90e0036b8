# SPDX-License-Identifier: Apache-2.0
"""One Triton launch for the tree tail of the split verify and its merge with the context
part (``split.tree_tail_attention`` + ``split.merge_partial_attention`` in PyTorch are its
reference). Experimental: CPU-interpreter tested only.

A program takes ``BLOCK_M`` of one request's ``Q * H`` query rows (row ``t * H + h``:
q is ``[R * Q, H, D]``, so a request's rows are contiguous) against its ``Q`` tree keys
(the last ``Q`` slots of its sequence): scores over ``D`` in 64-wide chunks, the ancestor
mask from the bit words, softmax, then ``P @ V`` chunk by chunk, each chunk merged with
the context part's output through the two log-sum-exps before it is stored. Tiles are
sm_120-sized: ``BLOCK_M x BLOCK_N`` fp32 scores (at most 64 x 128 or 32 x 256) and
64-wide K / V chunks, no shared-memory staging beyond what ``tl.dot`` needs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kernels import _dot

BLOCK_D = 64
MAX_TAIL_KEYS = 256


@triton.jit
def _tail_merge_kernel(
    Q, KV, BlockTable, SeqLens, Bits, CtxOut, CtxLse, Out, Lse,
    stride_q_tok, stride_q_head,
    stride_kv_block, stride_kv_slot,
    stride_bt,
    stride_ctx_tok, stride_ctx_head,
    stride_out_tok, stride_out_head,
    scale,
    QUERY_LEN: tl.constexpr, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    V_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, NUM_WORDS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    req = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)  # t * H + h within the request
    row_ok = rows < QUERY_LEN * NUM_HEADS
    t = rows // NUM_HEADS
    h = rows % NUM_HEADS
    tok = req * QUERY_LEN + t  # global token index
    keys = tl.arange(0, BLOCK_N)
    seq_len = tl.load(SeqLens + req)
    # a CUDA-graph padding request (seq_len < Q, e.g. 0) sees no key: out 0, lse -inf
    positions = tl.maximum(seq_len - QUERY_LEN, 0) + keys
    key_ok = (keys < QUERY_LEN) & (positions < seq_len)
    pages = tl.load(BlockTable + req * stride_bt + positions // PAGE_SIZE, mask=key_ok,
                    other=0)
    slot_off = pages.to(tl.int64) * stride_kv_block + (positions % PAGE_SIZE) * stride_kv_slot
    d = tl.arange(0, BLOCK_D)

    scores = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for d0 in range(0, HEAD_DIM, BLOCK_D):
        dd = d0 + d
        q = tl.load(Q + tok[:, None] * stride_q_tok + h[:, None] * stride_q_head + dd[None, :],
                    mask=row_ok[:, None] & (dd[None, :] < HEAD_DIM), other=0.0)
        k = tl.load(KV + slot_off[None, :] + dd[:, None],
                    mask=key_ok[None, :] & (dd[:, None] < HEAD_DIM), other=0.0)  # [D, N]
        scores = _dot(q, k, scores, DOT_PRECISION, UPCAST)
    scores = scores * scale
    words = tl.load(Bits + tok[:, None] * NUM_WORDS + (keys // 64)[None, :],
                    mask=row_ok[:, None] & key_ok[None, :], other=0)
    bit = (words >> (keys % 64).to(tl.int64)[None, :]) & 1  # 64-bit words (tree_mask)
    visible = (bit != 0) & key_ok[None, :] & (keys[None, :] <= t[:, None]) & row_ok[:, None]
    scores = tl.where(visible, scores, float("-inf"))
    row_max = tl.max(scores, axis=1)
    safe_max = tl.where(row_max == float("-inf"), 0.0, row_max)
    probs = tl.exp(scores - safe_max[:, None])
    denom = tl.sum(probs, axis=1)
    tail_lse = tl.where(denom > 0, safe_max + tl.log(tl.where(denom > 0, denom, 1.0)),
                        float("-inf"))

    ctx_lse = tl.load(CtxLse + tok * NUM_HEADS + h, mask=row_ok, other=float("-inf"))
    both_max = tl.maximum(ctx_lse, tail_lse)
    both_max = tl.where(both_max == float("-inf"), 0.0, both_max)
    w_ctx = tl.exp(ctx_lse - both_max)
    w_tail = tl.exp(tail_lse - both_max)
    total = w_ctx + w_tail
    total_safe = tl.where(total > 0, total, 1.0)
    # the tail's softmax weights already divided by its own denominator
    w_tail_row = w_tail / tl.where(denom > 0, denom, 1.0) / total_safe
    w_ctx_row = w_ctx / total_safe
    tl.store(Lse + tok * NUM_HEADS + h,
             tl.where(total > 0, both_max + tl.log(total_safe), float("-inf")), mask=row_ok)

    p = probs.to(KV.dtype.element_ty)
    for v0 in range(0, V_DIM, BLOCK_D):
        dv = v0 + d
        v = tl.load(KV + slot_off[:, None] + dv[None, :],
                    mask=key_ok[:, None] & (dv[None, :] < V_DIM), other=0.0)  # [N, D]
        acc = _dot(p, v, tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32), DOT_PRECISION, UPCAST)
        ctx = tl.load(CtxOut + tok[:, None] * stride_ctx_tok + h[:, None] * stride_ctx_head
                      + dv[None, :], mask=row_ok[:, None] & (dv[None, :] < V_DIM), other=0.0)
        merged = acc * w_tail_row[:, None] + ctx.to(tl.float32) * w_ctx_row[:, None]
        tl.store(Out + tok[:, None] * stride_out_tok + h[:, None] * stride_out_head
                 + dv[None, :], merged.to(Out.dtype.element_ty),
                 mask=row_ok[:, None] & (dv[None, :] < V_DIM))


def tail_block_sizes(query_len: int) -> tuple[int, int]:
    """``(BLOCK_M, BLOCK_N)`` for ``query_len`` tree keys: the keys padded to a power of
    two (at least 16, for ``tl.dot``), and fewer rows per program at 256 keys so that
    the fp32 score tile stays 32 KB."""
    block_n = max(16, triton.next_power_of_2(query_len))
    return (64 if block_n <= 128 else 32), block_n


def tree_tail_merge(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_len: int,
    ancestor_bits: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
    ctx_out: torch.Tensor,
    ctx_lse: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tree-tail attention merged with the context part, in one launch.

    Args:
        q, kv_cache, block_table, seq_lens, query_len, ancestor_bits, scale,
        kv_lora_rank: as ``split.tree_tail_attention``.
        ctx_out: ``[R * Q, H, kv_lora_rank]`` (any float dtype, last dim contiguous);
        ctx_lse: fp32 ``[R * Q, H]`` contiguous, ``-inf`` where a row saw no context.

    Returns:
        ``out [R * Q, H, kv_lora_rank]`` in q's dtype and ``lse [R * Q, H]`` fp32.

    Raises:
        ValueError: more than ``MAX_TAIL_KEYS`` tree keys, or a non-contiguous last dim.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_reqs = seq_lens.shape[0]
    if query_len > MAX_TAIL_KEYS:
        raise ValueError(f"query_len {query_len} > {MAX_TAIL_KEYS}: use "
                         "split.tree_tail_attention (PyTorch) for larger trees")
    if q.stride(2) != 1 or kv_cache.stride(2) != 1 or ctx_out.stride(2) != 1:
        raise ValueError("q, kv_cache and ctx_out need a contiguous last dimension")
    ctx_lse = ctx_lse.float().contiguous()
    out = torch.empty(num_tokens, num_heads, kv_lora_rank, dtype=q.dtype, device=q.device)
    lse = torch.empty(num_tokens, num_heads, dtype=torch.float32, device=q.device)
    block_m, block_n = tail_block_sizes(query_len)
    grid = (num_reqs, triton.cdiv(query_len * num_heads, block_m))
    _tail_merge_kernel[grid](
        q, kv_cache, block_table, seq_lens, ancestor_bits.contiguous(), ctx_out, ctx_lse,
        out, lse,
        q.stride(0), q.stride(1),
        kv_cache.stride(0), kv_cache.stride(1),
        block_table.stride(0),
        ctx_out.stride(0), ctx_out.stride(1),
        out.stride(0), out.stride(1),
        scale,
        QUERY_LEN=query_len, NUM_HEADS=num_heads, HEAD_DIM=head_dim, V_DIM=kv_lora_rank,
        PAGE_SIZE=kv_cache.shape[1], NUM_WORDS=ancestor_bits.shape[1],
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=BLOCK_D,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        UPCAST=type(_tail_merge_kernel).__name__ == "InterpretedFunction",
    )
    return out, lse

