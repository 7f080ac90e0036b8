"""KV compaction of the accepted tree paths in PyTorch: the reference of ``kv_kernel``
and the CPU path.

After the walk, the accepted nodes' KV rows move to the consecutive slots of positions
``seq_len + 1 .. seq_len + a`` (their RoPE is already right); every source is read before
any destination is written, since a source can be another move's destination.
"""

from __future__ import annotations

import torch

__all__ = ["compact_kv_cache_", "compaction_slots", "page_index"]


def compaction_slots(
    slot_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    kv_src_rows: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """KV cache slots to move so the accepted path sits at consecutive positions.

    Args:
        slot_mapping: int64 ``[T]``, the verify batch's (linear) slots.
        query_start_loc: int32 ``[R+1]``.
        kv_src_rows: int64 ``[R, L]`` from the walk (row offsets within the request,
            -1 padded); column k moves to row offset k+1.

    Returns:
        ``(src_slots, dst_slots)`` int64 ``[R * L]``; -1 where nothing moves
        (padding, or a row already in place).
    """
    starts = query_start_loc[:-1].to(torch.int64)[:, None]
    depth_index = torch.arange(1, kv_src_rows.shape[1] + 1, device=kv_src_rows.device)
    valid = kv_src_rows >= 0
    last = slot_mapping.shape[0] - 1
    # Padded columns of a short last request would index past the batch: clamp, mask.
    src_index = (starts + kv_src_rows.clamp(min=0)).clamp(max=last)
    dst_index = (starts + depth_index[None, :]).clamp(max=last)
    src = torch.where(valid, slot_mapping[src_index], -1)
    dst = torch.where(valid, slot_mapping[dst_index], -1)
    moving = valid & (src != dst)
    return torch.where(moving, src, -1).flatten(), torch.where(moving, dst, -1).flatten()


def compact_kv_cache_(cache_pages: torch.Tensor, src_slots: torch.Tensor,
                      dst_slots: torch.Tensor) -> None:
    """Move slot ``src`` -> slot ``dst`` for every pair with ``src >= 0``.

    ``cache_pages`` is a ``[num_blocks, page, *row]`` view of one layer's cache
    (``speculator.kv_page_views``: MLA ``[nb, bs, D]``; FlashAttention K or V
    ``[nb, bs, H, D]``); slot ``s`` is row ``s % page`` of block ``s // page``, and the
    block stride is free (vLLM pads pages to the model's largest). All sources are
    read before any write, since a source may be another pair's destination. Entries
    with ``src < 0`` repeat the first real move (or copy slot 0 onto itself when
    nothing moves), so every duplicate destination receives the same value and the
    shapes stay fixed for CUDA graphs.
    """
    valid = src_slots >= 0
    # First real move, 0 if none. Kept 1-D: indexing with a 0-dim tensor would read
    # it on the host (a device sync).
    first = torch.argmax(valid.to(torch.int32)).view(1)
    any_valid = valid.any()
    fill_src = torch.where(any_valid, src_slots[first], 0)
    fill_dst = torch.where(any_valid, dst_slots[first], 0)
    src = torch.where(valid, src_slots, fill_src)
    dst = torch.where(valid, dst_slots, fill_dst)
    rows = cache_pages[page_index(cache_pages, src)]  # gather first (copies)
    cache_pages.index_put_(page_index(cache_pages, dst), rows)


def page_index(cache_pages: torch.Tensor, slots: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(block, row)`` index tensors of int64 ``slots`` in a ``[num_blocks, page,
    *row]`` view: ``cache_pages[page_index(cache_pages, slots)]`` is ``[len, *row]``."""
    page = cache_pages.shape[1]
    return slots // page, slots % page
