# SPDX-License-Identifier: Apache-2.0
"""Pure-PyTorch reference of MLA tree-verify attention (the kernels' oracle)."""

from __future__ import annotations

import torch

from .tree_mask import dense_new_token_mask


def gather_request_kv(
    kv_cache: torch.Tensor, block_table_row: torch.Tensor, seq_len: int
) -> torch.Tensor:
    """The first ``seq_len`` cached rows of one request, in sequence order.

    Args:
        kv_cache: ``[num_blocks, page_size, ...]`` paged cache.
        block_table_row: int32 ``[max_blocks]`` page ids of the request.
        seq_len: number of cached tokens to gather.

    Returns:
        ``[seq_len, ...]`` (same dtype as the cache).
    """
    page_size = kv_cache.shape[1]
    pos = torch.arange(seq_len, device=kv_cache.device)
    pages = block_table_row.to(torch.long)[pos // page_size]
    return kv_cache[pages, pos % page_size]


def request_visibility(ancestor_bits: torch.Tensor, query_len: int, seq_len: int) -> torch.Tensor:
    """Bool ``[query_len, seq_len]``: which keys each new token of one request may attend.

    The context (first ``seq_len - query_len`` keys) is always visible; the last
    ``query_len`` keys follow the request's ancestor bits ``[query_len, W]``.
    """
    ctx_len = seq_len - query_len
    visible = torch.ones(query_len, seq_len, dtype=torch.bool, device=ancestor_bits.device)
    visible[:, ctx_len:] = dense_new_token_mask(ancestor_bits, query_len)
    return visible


def mla_tree_verify_reference(
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
    active_query_lens: torch.Tensor | None = None,
    kv_scale: torch.Tensor | None = None,
    q_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    **_unused,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of :func:`mla_tree_verify`: fp32 math, one dense softmax per request.

    Args:
        q: ``[T, H, kv_lora_rank + rope_dim]``.
        kv_cache: ``[num_blocks, page_size, kv_lora_rank + rope_dim]``, q's dtype or
            fp8 (``kv_scale`` then required).
        block_table: int32 ``[R, max_blocks]``.
        seq_lens: int32 ``[R]``, context + new tokens.
        query_start_loc: int32 ``[R + 1]``.
        ancestor_bits: int64 ``[T, W]``.
        scale: softmax scale applied to ``q . k``.
        kv_lora_rank: V is the first ``kv_lora_rank`` entries of a cached row.
        num_kv_splits: ignored (signature parity with the kernel).
        active_query_lens: optional int32 ``[R]``: request ``r`` is computed as if it had
            only its first ``active_query_lens[r]`` new tokens (the tree's active prefix);
            its other rows are zero / ``-inf``.
        kv_scale: fp32 one-element tensor: the cache is dequantized as
            ``kv_scale * row`` in fp32 (vLLM's fp8 MLA cache); None: rows as stored.
        q_scale: the same for an e4m3 q (``q_scale * q``); None: q as it is.
        out_dtype: the output's dtype (default q's; bf16 for an e4m3 q).

    Returns:
        ``out [T, H, kv_lora_rank]`` in ``out_dtype`` and ``lse [T, H]`` fp32 (natural log of
        the softmax denominator of ``scale * q.k``). A row that sees no key gets ``out = 0``
        and ``lse = -inf``; rows outside ``query_start_loc`` and inactive rows are zero /
        ``-inf``.
    """
    del num_kv_splits
    if out_dtype is None:
        out_dtype = torch.bfloat16 if q.dtype == torch.float8_e4m3fn else q.dtype
    q = q.float() if q_scale is None else q.float() * q_scale.float().reshape(())
    num_tokens, num_heads, _ = q.shape
    out = torch.zeros(num_tokens, num_heads, kv_lora_rank, dtype=torch.float32, device=q.device)
    lse = torch.full((num_tokens, num_heads), float("-inf"), dtype=torch.float32, device=q.device)
    qsl = query_start_loc.tolist()
    active = None if active_query_lens is None else active_query_lens.tolist()
    for r, seq_len in enumerate(seq_lens.tolist()):
        start, end = qsl[r], qsl[r + 1]
        if active is not None:  # drop the inactive tokens, as queries and as keys
            keep = max(0, min(active[r], end - start))
            seq_len -= end - start - keep
            end = start + keep
        if end <= start:
            continue
        kv = gather_request_kv(kv_cache, block_table[r], seq_len).float()  # [S, D]
        if kv_scale is not None:
            kv = kv * kv_scale.float().reshape(())
        visible = request_visibility(ancestor_bits[start:end], end - start, seq_len)
        scores = torch.einsum("thd,sd->ths", q[start:end].float(), kv) * scale
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        row_lse = torch.logsumexp(scores, dim=-1)  # [t, H]
        seen = torch.isfinite(row_lse)
        probs = torch.exp(scores - torch.where(seen, row_lse, 0.0)[..., None])
        out[start:end] = torch.einsum("ths,sd->thd", probs, kv[:, :kv_lora_rank])
        lse[start:end] = row_lse
    return out.to(out_dtype), lse
