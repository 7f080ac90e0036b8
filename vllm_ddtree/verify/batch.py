"""Batch-level tensors of one DDTree verify step, in vLLM's token order (pure PyTorch).

The V2 runner lays out the verify batch per request as ``[bonus, node_1..node_B]``
(query length 1+B) with linear positions and slots. DDTree needs, per token row:
its RoPE position (``seq_len + depth``), its ancestor bits, and after the target's
forward, the committed tokens and the KV moves of the accepted path. These helpers
compute them with device ops only (no host sync), for CUDA graphs.
"""

from __future__ import annotations

import torch

from vllm_ddtree.tree.draft_tree import num_mask_words


def _row_request_and_index(query_start_loc: torch.Tensor, num_tokens: int):
    """Per token row: its batch request index and its index inside the request."""
    rows = torch.arange(num_tokens, device=query_start_loc.device)
    starts = query_start_loc.to(torch.int64)
    req = torch.searchsorted(starts[1:], rows, right=True)
    return req, rows - starts[req]


def tree_verify_positions_and_bits(
    linear_positions: torch.Tensor,
    query_start_loc: torch.Tensor,
    is_tree: torch.Tensor,
    depths: torch.Tensor,
    ancestor_bits: torch.Tensor,
    num_words: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE positions and ancestor bits of every token row of a verify batch.

    Args:
        linear_positions: int64 ``[T]``, vLLM's positions (``num_computed + i``).
        query_start_loc: int32 ``[R+1]``.
        is_tree: bool ``[R]``, requests whose new tokens are ``[bonus, tree nodes]``
            (others: prefill chunks, plain decode, chains, get causal rows).
        depths: int64 ``[R, B]``, node depths of each request's tree (batch order).
        ancestor_bits: int64 ``[R, 1+B, W_tree]`` from ``DraftTree.ancestor_bits``.
        num_words: W of the output, ``>= ceil(max_query_len / 64)``.

    Returns:
        positions int64 ``[T]`` (tree row i of a request: its bonus position +
        depth of node i) and bits int64 ``[T, num_words]``.
    """
    num_tokens = linear_positions.shape[0]
    req, local = _row_request_and_index(query_start_loc, num_tokens)
    tree_row = is_tree[req] & (local > 0) & (local <= depths.shape[1])
    node = (local - 1).clamp(min=0, max=depths.shape[1] - 1)
    bonus_position = linear_positions - local
    positions = torch.where(tree_row, bonus_position + depths[req, node], linear_positions)

    words = torch.arange(num_words, device=linear_positions.device)
    count = (local[:, None] + 1 - 64 * words[None, :]).clamp(0, 64)
    full = count == 64
    causal = torch.where(
        full, torch.full_like(count, -1),
        torch.bitwise_left_shift(torch.ones_like(count), torch.where(full, 0, count)) - 1,
    )
    tree_words = min(num_words, ancestor_bits.shape[-1])
    tree_bits = torch.zeros_like(causal)
    row = local.clamp(max=ancestor_bits.shape[1] - 1)
    tree_bits[:, :tree_words] = ancestor_bits[req, row, :tree_words]
    in_tree = (is_tree[req] & (local < ancestor_bits.shape[1]))[:, None]
    return positions, torch.where(in_tree, tree_bits, causal)


def sampled_rows_from_walk(
    committed_tokens: torch.Tensor, accepted_depth: torch.Tensor, budget: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """vLLM ``SamplerOutput`` fields from a tree walk (``vllm_ddtree.walk.follow.follow_tree``).

    Args:
        committed_tokens: int64 ``[R, L+1]`` (path tokens then bonus, -1 padded).
        accepted_depth: int64 ``[R]``.
        budget: B, tree nodes per request.

    Returns:
        sampled_token_ids int64 ``[R, B+1]`` (first a+1 columns valid, then -1),
        num_sampled int32 ``[R]`` (= a+1) and num_rejected int32 ``[R]`` (= B-a), so
        vLLM's scheduler sees B draft tokens of which a were accepted.
    """
    num_reqs, width = committed_tokens.shape
    sampled = committed_tokens.new_full((num_reqs, budget + 1), -1)
    keep = min(width, budget + 1)
    sampled[:, :keep] = committed_tokens[:, :keep]
    num_sampled = (accepted_depth + 1).to(torch.int32)
    return sampled, num_sampled, (budget - accepted_depth).to(torch.int32)


__all__ = [
    "num_mask_words",
    "sampled_rows_from_walk",
    "tree_verify_positions_and_bits",
]
