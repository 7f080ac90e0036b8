# SPDX-License-Identifier: Apache-2.0
"""Tree-mask helpers shared by the tree-verify kernels and their references.

The mask contract (docs/design.md, "Contracts"): ``ancestor_bits int64 [T, W]``,
``W = ceil(max_query_len / 64)``; bit ``j`` of row ``t`` is set iff query token ``t``
may attend the ``j``-th new token of its own request. New tokens are stored in
topological order, so a token only ever attends new tokens ``j <= t``; bits above the
diagonal are outside the contract and are ignored by the kernels and the references.
Context tokens (before the request's new tokens) are always visible.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

BITS_PER_WORD = 64


def num_mask_words(max_query_len: int) -> int:
    """Number of int64 words W needed for requests of up to ``max_query_len`` tokens."""
    return max(1, -(-max_query_len // BITS_PER_WORD))


def ancestor_bits_from_parents(
    parents: Sequence[int], num_words: int | None = None
) -> torch.Tensor:
    """Ancestor bits of one request's new tokens from a parent list.

    Args:
        parents: ``parents[i]`` is the index of token ``i``'s parent among the request's
            new tokens (``-1`` for a root). Topological order: ``parents[i] < i``.
        num_words: W, at least ``num_mask_words(len(parents))``.

    Returns:
        int64 ``[len(parents), W]`` on the CPU; row ``i`` has the bits of ``i`` and of all
        its ancestors set.
    """
    n = len(parents)
    num_words = num_mask_words(n) if num_words is None else num_words
    if num_words < num_mask_words(n):
        raise ValueError(f"num_words={num_words} is too small for {n} tokens")
    rows: list[int] = []
    for i, p in enumerate(parents):
        if p >= i:
            raise ValueError(f"parents must be topological (parent < child): parents[{i}]={p}")
        rows.append((rows[p] if p >= 0 else 0) | (1 << i))
    return _pack_rows(rows, num_words)


def causal_ancestor_bits(query_len: int, num_words: int | None = None) -> torch.Tensor:
    """Causal (chain) bits for ``query_len`` tokens: row ``t`` has bits ``0..t`` set."""
    num_words = num_mask_words(query_len) if num_words is None else num_words
    return _pack_rows([(1 << (t + 1)) - 1 for t in range(query_len)], num_words)


def _pack_rows(rows: list[int], num_words: int) -> torch.Tensor:
    out = torch.zeros(len(rows), num_words, dtype=torch.int64)
    mask64 = (1 << BITS_PER_WORD) - 1
    for i, row in enumerate(rows):
        for w in range(num_words):
            word = (row >> (BITS_PER_WORD * w)) & mask64
            # Reinterpret as a signed int64 (bit 63 set -> negative).
            out[i, w] = word - (1 << BITS_PER_WORD) if word >= (1 << 63) else word
    return out


def dense_new_token_mask(bits: torch.Tensor, query_len: int) -> torch.Tensor:
    """Decode one request's ``[query_len, W]`` bit rows into a bool ``[query_len, query_len]``.

    Entry ``[t, j]`` is True iff token ``t`` attends new token ``j``. Bits above the
    diagonal (``j > t``) are dropped, see the module docstring.
    """
    return dense_new_token_masks(bits, 1, query_len)[0]


def dense_new_token_masks(bits: torch.Tensor, num_reqs: int, query_len: int) -> torch.Tensor:
    """:func:`dense_new_token_mask` of ``num_reqs`` requests of ``query_len`` tokens each,
    from their ``[num_reqs * query_len, W]`` bit rows: bool ``[num_reqs, Q, Q]``."""
    j = torch.arange(query_len, device=bits.device)
    words = bits.reshape(num_reqs, query_len, -1)[:, :, j // BITS_PER_WORD]  # [R, Q, Q]
    visible = ((words >> (j % BITS_PER_WORD)) & 1) != 0
    return visible & (j[None, :] <= j[:, None])


@dataclass(frozen=True)
class BatchStats:
    """Host-side facts about a batch that size the launch grid."""

    max_query_len: int
    max_seq_len: int


def _check_active_query_lens_shape(
    active_query_lens: torch.Tensor, num_reqs: int, device: torch.device
) -> None:
    name = "active_query_lens"
    if not isinstance(active_query_lens, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(active_query_lens).__name__}")
    if active_query_lens.dtype != torch.int32:
        raise ValueError(f"{name} must be torch.int32, got {active_query_lens.dtype}")
    if active_query_lens.shape != (num_reqs,):
        raise ValueError(
            f"{name} must have shape [{num_reqs}] (one entry per request), "
            f"got {tuple(active_query_lens.shape)}"
        )
    if active_query_lens.device != device:
        raise ValueError(f"{name} is on {active_query_lens.device}, expected {device} (q's)")
    if num_reqs > 1 and active_query_lens.stride(0) != 1:
        raise ValueError(f"{name} must be contiguous")


def check_tree_batch(
    *,
    num_tokens: int,
    device: torch.device,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    ancestor_bits: torch.Tensor,
    page_size: int,
    num_blocks: int,
    max_query_len: int | None,
    max_seq_len: int | None,
    validate_values: bool,
    active_query_lens: torch.Tensor | None = None,
) -> BatchStats:
    """Validate the batch metadata shared by the tree-verify kernels.

    Shapes and dtypes are always checked (no device sync). Values (monotonic
    ``query_start_loc``, ``seq_lens >= query lens``, block table coverage and range,
    W large enough, ``1 <= active_query_lens <= query lens``) are checked when
    ``validate_values`` is set, which reads the metadata on the host once. With
    ``validate_values=False`` the caller must pass ``max_query_len`` and
    ``max_seq_len`` (e.g. from CPU-side metadata).

    Raises:
        ValueError naming the offending argument.
    """
    for name, t, dtype, ndim in (
        ("block_table", block_table, torch.int32, 2),
        ("seq_lens", seq_lens, torch.int32, 1),
        ("query_start_loc", query_start_loc, torch.int32, 1),
        ("ancestor_bits", ancestor_bits, torch.int64, 2),
    ):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != dtype:
            raise ValueError(f"{name} must be {dtype}, got {t.dtype}")
        if t.dim() != ndim:
            raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, expected {device} (the device of q)")
    num_reqs = seq_lens.shape[0]
    if query_start_loc.shape[0] != num_reqs + 1:
        raise ValueError(
            f"query_start_loc must have len(seq_lens) + 1 = {num_reqs + 1} entries, "
            f"got {query_start_loc.shape[0]}"
        )
    if block_table.shape[0] < num_reqs:
        raise ValueError(
            f"block_table has {block_table.shape[0]} rows, fewer than the {num_reqs} requests"
        )
    if block_table.stride(1) != 1:
        raise ValueError("block_table must be contiguous along its last dimension")
    if ancestor_bits.shape[0] < num_tokens:
        raise ValueError(
            f"ancestor_bits must have one row per query token ({num_tokens}), "
            f"got shape {tuple(ancestor_bits.shape)}"
        )
    num_words = ancestor_bits.shape[1]
    if num_words < 1:
        raise ValueError("ancestor_bits must have at least one int64 word per row (W >= 1)")
    if ancestor_bits.stride(1) != 1:
        raise ValueError("ancestor_bits must be contiguous along its last dimension")
    if active_query_lens is not None:
        _check_active_query_lens_shape(active_query_lens, num_reqs, device)

    if not validate_values:
        if max_query_len is None or max_seq_len is None:
            raise ValueError(
                "max_query_len and max_seq_len are required when validate_values=False"
            )
        if max_query_len > BITS_PER_WORD * num_words:
            raise ValueError(
                f"ancestor_bits has W={num_words} words per row, too few for "
                f"max_query_len={max_query_len} (needs {num_mask_words(max_query_len)})"
            )
        return BatchStats(max_query_len=max_query_len, max_seq_len=max_seq_len)

    if num_reqs == 0:
        return BatchStats(max_query_len=0, max_seq_len=0)
    qsl = query_start_loc.cpu().to(torch.int64)
    lens = seq_lens.cpu().to(torch.int64)
    qlens = qsl[1:] - qsl[:-1]
    if int(qsl[0]) < 0 or bool((qlens < 0).any()):
        raise ValueError("query_start_loc must be non-negative and non-decreasing")
    if int(qsl[-1]) > num_tokens:
        raise ValueError(
            f"query_start_loc[-1]={int(qsl[-1])} exceeds the number of query tokens {num_tokens}"
        )
    if bool((lens < qlens).any()):
        r = int(torch.nonzero(lens < qlens)[0])
        raise ValueError(
            f"seq_lens[{r}]={int(lens[r])} is smaller than the request's query length "
            f"{int(qlens[r])} (seq_lens counts context + new tokens)"
        )
    if active_query_lens is not None:
        active = active_query_lens.cpu().to(torch.int64)
        # A request without query tokens (outside the verify contract) may have 0.
        bad = (active < qlens.clamp(max=1)) | (active > qlens)
        if bool(bad.any()):
            r = int(torch.nonzero(bad)[0])
            raise ValueError(
                f"active_query_lens[{r}]={int(active[r])} must be in [1, {int(qlens[r])}] "
                f"(1 to the request's query length)"
            )
    true_max_q = int(qlens.max())
    true_max_s = int(lens.max())
    if max_query_len is not None and max_query_len < true_max_q:
        raise ValueError(f"max_query_len={max_query_len} < actual max query length {true_max_q}")
    if max_seq_len is not None and max_seq_len < true_max_s:
        raise ValueError(f"max_seq_len={max_seq_len} < actual max seq_len {true_max_s}")
    if true_max_q > BITS_PER_WORD * num_words:
        raise ValueError(
            f"ancestor_bits has W={num_words} words per row, too few for a request of "
            f"{true_max_q} query tokens (needs {num_mask_words(true_max_q)})"
        )
    blocks_needed = -(-lens // page_size)
    if int(blocks_needed.max()) > block_table.shape[1]:
        raise ValueError(
            f"block_table has {block_table.shape[1]} columns, a request of seq_len "
            f"{true_max_s} needs {int(blocks_needed.max())} pages of {page_size}"
        )
    bt = block_table[:num_reqs].cpu()
    cols = torch.arange(bt.shape[1])
    used = cols[None, :] < blocks_needed[:, None]
    if bool(used.any()):
        ids = bt[used]
        if int(ids.min()) < 0 or int(ids.max()) >= num_blocks:
            raise ValueError(
                f"block_table refers to pages outside the cache [0, {num_blocks}): "
                f"min {int(ids.min())}, max {int(ids.max())}"
            )
    return BatchStats(
        max_query_len=max_query_len if max_query_len is not None else true_max_q,
        max_seq_len=max_seq_len if max_seq_len is not None else true_max_s,
    )
