# SPDX-License-Identifier: Apache-2.0
"""Pure-PyTorch reference of GQA tree-verify attention (the kernel's oracle)."""

from __future__ import annotations

import torch

from vllm_ddtree.attention_backends.mla_tree.reference import gather_request_kv, request_visibility


def tree_positions(ancestor_bits: torch.Tensor, query_len: int, ctx_len: int) -> torch.Tensor:
    """Sequence positions ``ctx_len + depth`` of one request's new tokens.

    The depth of a new token is its number of ancestors (the root has depth 0), i.e.
    the popcount of its bit row minus one; for causal rows this is the token index.
    """
    shifts = torch.arange(64, device=ancestor_bits.device)
    bits = (ancestor_bits[:query_len, :, None] >> shifts) & 1  # [qlen, W, 64]
    return ctx_len + bits.sum(dim=(1, 2)) - 1


def gqa_tree_verify_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    ancestor_bits: torch.Tensor,
    scale: float,
    *,
    sliding_window: int | None = None,
    active_query_lens: torch.Tensor | None = None,
    **_unused,
) -> torch.Tensor:
    """Reference of :func:`gqa_tree_verify`: fp32 math, one dense softmax per request.

    Args:
        q: ``[T, Hq, Dh]``.
        k_cache, v_cache: ``[num_blocks, page_size, Hkv, Dh]``.
        block_table: int32 ``[R, max_blocks]``.
        seq_lens: int32 ``[R]``, context + new tokens.
        query_start_loc: int32 ``[R + 1]``.
        ancestor_bits: int64 ``[T, W]``.
        scale: softmax scale.
        sliding_window: a token at position p (context key: its index; new token:
            ``ctx_len + tree depth``) sees keys at positions > ``p - sliding_window``.
        active_query_lens: optional int32 ``[R]``: request ``r`` is computed as if it had
            only its first ``active_query_lens[r]`` new tokens (the tree's active prefix);
            its other rows are 0.

    Returns:
        ``[T, Hq, Dh]`` in q's dtype; rows that see no key and inactive rows are 0.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    group = num_q_heads // k_cache.shape[2]
    out = torch.zeros(num_tokens, num_q_heads, head_dim, dtype=torch.float32, device=q.device)
    qsl = query_start_loc.tolist()
    active = None if active_query_lens is None else active_query_lens.tolist()
    for r, seq_len in enumerate(seq_lens.tolist()):
        start, end = qsl[r], qsl[r + 1]
        if active is not None:  # drop the inactive tokens, as queries and as keys
            keep = max(0, min(active[r], end - start))
            seq_len -= end - start - keep
            end = start + keep
        qlen = end - start
        if qlen == 0:
            continue
        bits = ancestor_bits[start:end]
        keys = gather_request_kv(k_cache, block_table[r], seq_len).float()  # [S, Hkv, Dh]
        values = gather_request_kv(v_cache, block_table[r], seq_len).float()
        keys = keys.repeat_interleave(group, dim=1)
        values = values.repeat_interleave(group, dim=1)
        visible = request_visibility(bits, qlen, seq_len)  # [qlen, S]
        if sliding_window is not None:
            ctx_len = seq_len - qlen
            q_pos = tree_positions(bits, qlen, ctx_len)
            k_pos = torch.arange(seq_len, device=q.device)
            k_pos[ctx_len:] = q_pos  # a new key's position is its own tree position
            visible &= k_pos[None, :] > q_pos[:, None] - sliding_window
        scores = torch.einsum("thd,shd->ths", q[start:end].float(), keys) * scale
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
        out[start:end] = torch.einsum("ths,shd->thd", probs, values)
    return out.to(q.dtype)
