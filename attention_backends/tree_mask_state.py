"""Per-token ancestor bits of the verify batch, shared by the speculator and backends.

The DDTree speculator (GPU runner) writes the tree mask of the next target forward
into ``TreeMaskState.ancestor_bits`` (a persistent buffer, so FULL CUDA graphs
replay it) and sets ``active``; attention metadata builders read rows
``[:num_decode_tokens]``. Without an active tree, builders use causal bits.
"""

from __future__ import annotations

import torch

BITS_PER_WORD = 64


class TreeMaskState:
    """Holder of the batch's ancestor bits: int64 ``[max_num_tokens, max_words]``."""

    def __init__(self) -> None:
        self.ancestor_bits: torch.Tensor | None = None
        self.active = False

    def allocate(self, max_num_tokens: int, max_query_len: int, device) -> torch.Tensor:
        words = max(1, -(-max_query_len // BITS_PER_WORD))
        if (
            self.ancestor_bits is None
            or self.ancestor_bits.shape[0] < max_num_tokens
            or self.ancestor_bits.shape[1] < words
        ):
            self.ancestor_bits = torch.zeros(
                max_num_tokens, words, dtype=torch.int64, device=device
            )
        return self.ancestor_bits


TREE_MASK_STATE = TreeMaskState()


def causal_bits_(out: torch.Tensor, query_start_loc: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Write causal ancestor bits for ``num_tokens`` rows into ``out [>= num_tokens, W]``.

    Row t (local index i within its request, from ``query_start_loc`` int32
    ``[R+1]``) gets bits ``0..i``. Pure device ops, no host sync. Returns the view
    ``out[:num_tokens]`` (int64).
    """
    rows = out[:num_tokens]
    tokens = torch.arange(num_tokens, device=out.device, dtype=torch.int64)
    starts = query_start_loc.to(torch.int64)
    req = torch.searchsorted(starts[1:], tokens, right=True)
    local = tokens - starts[req]  # 0-based index inside the request
    words = torch.arange(rows.shape[1], device=out.device, dtype=torch.int64)
    # number of set bits in each word: clamp(local + 1 - 64 w, 0, 64)
    count = (local[:, None] + 1 - BITS_PER_WORD * words[None, :]).clamp(0, BITS_PER_WORD)
    full = count == BITS_PER_WORD
    partial = torch.where(full, torch.zeros_like(count), count)
    value = torch.bitwise_left_shift(torch.ones_like(count), partial) - 1
    rows.copy_(torch.where(full, torch.full_like(count, -1), value))
    return rows
