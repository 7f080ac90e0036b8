"""The drafter's context rows of a tree-decode round: ``1 + L`` a request, not ``1 + B``.

``DFlashSpeculator.propose`` hands every verified row to the drafter as context: the
target's aux hidden states go through the drafter's ``fc`` (``combine_hidden_states``)
and its per-layer K/V precompute, and the rows past ``valid_ctx_end = ctx_end -
num_rejected`` are computed and then never read (``dflash/speculator.py:326-332,
391-409, 502-503``). A chain verifies ``1 + N`` rows; a DDTree round verifies ``1 + B``
(65 at B = 64) of which the accepted path holds at most ``1 + L`` (8 for a block-8
drafter). On an H200 profile of kimi8 at 16k, DDTree's drafter took 0.24 ms more GPU
time a round than the chain's, its ``fc`` GEMM on 72-row tiles among it.

When every request of the batch is a tree decode (no prefill chunk, root + drafts)
with at least ``c = 1 + L`` rows, ``propose`` compacts each request's accepted path to
rows ``r * c .. r * c + a_r`` of the aux hidden states (in place, one launch) and
drafts from a copy of the batch whose requests hold ``c`` rows each: positions of the
first ``c`` rows, ``num_rejected = c - num_sampled``. Other batches keep the in-place
move within each request's rows.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import torch

from vllm_ddtree.triton_path import use_triton

__all__ = [
    "compact_path_rows_",
    "compact_path_rows_torch",
    "compacted_batch",
    "context_rows_per_request",
]

def context_rows_per_request(input_batch: Any, num_draft_depths: int) -> int | None:
    """``c = 1 + L`` when every request of ``input_batch`` is a tree decode of at least
    ``c`` rows (its scheduled tokens are the root and its drafts, no prefill chunk),
    so its accepted path fits in its first ``c`` context rows; None otherwise. Host
    arrays only: no device work."""
    drafts = getattr(input_batch, "num_draft_tokens_per_req", None)
    if drafts is None or input_batch.num_reqs == 0:
        return None
    rows = 1 + num_draft_depths
    scheduled = input_batch.num_scheduled_tokens[: input_batch.num_reqs]
    if (np.any(input_batch.is_prefilling_np[: input_batch.num_reqs])
            or not np.array_equal(scheduled, drafts[: input_batch.num_reqs] + 1)
            or int(scheduled.min()) < rows or int(scheduled.max()) == rows):
        return None  # nothing to gain when every request already holds c rows
    return rows


def compact_path_rows_torch(
    hidden_states: list[torch.Tensor], query_start_loc: torch.Tensor,
    kv_src_rows: torch.Tensor, positions: torch.Tensor, num_sampled: torch.Tensor,
    rows_per_req: int, out_positions: torch.Tensor, out_num_rejected: torch.Tensor,
) -> None:
    """Each request's context in ``c = rows_per_req`` consecutive rows, in place.

    For request ``r`` and ``k < c``: row ``r * c + k`` of every tensor gets the old row
    ``qsl[r] + kv_src_rows[r, k - 1]`` where that is an accepted node (``k >= 1`` and
    ``>= 0``), else ``qsl[r] + k``; ``out_positions[r * c + k] = positions[qsl[r] + k]``
    (the verify rows' positions are linear, so these are the path's); and
    ``out_num_rejected[r] = c - num_sampled[r]``.

    Args:
        hidden_states: tensors ``[num_rows, H]`` (the target's aux hidden states).
        query_start_loc: int32 ``[>= R + 1]``; every request holds ``>= c`` rows.
        kv_src_rows: int64 ``[R, L]`` from the walk (-1 padded), ``L < c``.
        positions: int64 ``[num_rows]``; num_sampled: int32 ``[R]`` (``a_r + 1``).
        out_positions: int64 ``[>= R * c]``; out_num_rejected: int32 ``[>= R]``.
    """
    num_reqs, width = kv_src_rows.shape
    device = kv_src_rows.device
    starts = query_start_loc[:num_reqs].to(torch.int64)[:, None]
    k = torch.arange(rows_per_req, device=device)[None, :]
    src = torch.full((num_reqs, rows_per_req), -1, dtype=torch.int64, device=device)
    span = min(width, rows_per_req - 1)
    src[:, 1:1 + span] = kv_src_rows[:, :span]
    rows = (starts + torch.where(src >= 0, src, k)).flatten()
    count = num_reqs * rows_per_req
    for x in hidden_states:
        x[:count] = x[rows]
    out_positions[:count] = positions[(starts + k).flatten()]
    out_num_rejected[:num_reqs] = (rows_per_req - num_sampled[:num_reqs]).to(
        out_num_rejected.dtype)


def compact_path_rows_(
    hidden_states: list[torch.Tensor], query_start_loc: torch.Tensor,
    kv_src_rows: torch.Tensor, positions: torch.Tensor, num_sampled: torch.Tensor,
    rows_per_req: int, out_positions: torch.Tensor, out_num_rejected: torch.Tensor,
) -> None:
    """:func:`compact_path_rows_torch`; on CUDA one Triton launch per four tensors
    (``hidden_rows_kernel.compact_path_rows_triton``). No host sync."""
    if use_triton(kv_src_rows):
        from vllm_ddtree.draft.hidden_rows_kernel import compact_path_rows_triton

        if compact_path_rows_triton(hidden_states, query_start_loc, kv_src_rows, positions,
                                    num_sampled, rows_per_req, out_positions,
                                    out_num_rejected):
            return
    compact_path_rows_torch(hidden_states, query_start_loc, kv_src_rows, positions,
                            num_sampled, rows_per_req, out_positions, out_num_rejected)


def compacted_batch(input_batch: Any, rows_per_req: int, query_start_loc: torch.Tensor,
                    positions: torch.Tensor) -> Any:
    """A shallow copy of vLLM's ``InputBatch`` whose ``R`` requests hold ``c =
    rows_per_req`` rows each: what ``DFlashSpeculator.propose`` reads of it
    (``num_tokens``, ``num_scheduled_tokens``, ``query_start_loc``, ``positions``).

    Args:
        query_start_loc: int32 ``[>= R + 1]`` holding ``0, c, 2c, ...``.
        positions: int64 ``[>= R * c]``, :func:`compact_path_rows_`'s ``out_positions``.
    """
    num_reqs = input_batch.num_reqs
    count = num_reqs * rows_per_req
    batch = copy.copy(input_batch)
    batch.num_tokens = count
    batch.num_tokens_after_padding = count
    batch.num_scheduled_tokens = np.full(num_reqs, rows_per_req, dtype=np.int32)
    batch.query_start_loc = query_start_loc[: num_reqs + 1]
    batch.query_start_loc_np = np.arange(num_reqs + 1, dtype=np.int32) * rows_per_req
    batch.positions = positions[:count]
    return batch
