# SPDX-License-Identifier: Apache-2.0
"""``DDTreeRuntimeState.store_trees_`` in one Triton launch.

After each draft, ``propose`` scatters the batch-ordered trees (parents, depths,
packed ancestor bits and, with ``ddtree_budget: "auto"``, the active budget) to the
request-state rows ``idx_mapping``; the PyTorch path is an index conversion and three
or four ``index_put_`` launches. Here one program per request copies its rows.

On CUDA the speculator launches it inside the drafter's step (its CUDA graph), reading
each request's row from DFlash's ``sample_idx_mapping`` (``idx_stride`` = L entries per
request, -1 for CUDA-graph padding rows, which write nothing), so no eager launch is
left after the graph; only ``ddtree_budget: "auto"`` at TP > 1 (whose choice is
broadcast between the ranks after the graph) stores eagerly in ``propose``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["store_trees_triton"]

BLOCK_WORDS = 256


@triton.jit(do_not_specialize=["budget", "num_words", "stride_idx"])
def _store_trees_kernel(
    idx_ptr,  # int32 [(R - 1) * stride_idx + 1]; < 0: write nothing
    parents_ptr,  # int64 [R, B]
    depths_ptr,  # int64 [R, B]
    bits_ptr,  # int64 [R, (1 + B) * W]
    active_ptr,  # int [R] or [1]; read with ACTIVE
    state_parents_ptr,  # int64 [max_reqs, B]
    state_depths_ptr,  # int64 [max_reqs, B]
    state_bits_ptr,  # int64 [max_reqs, (1 + B) * W]
    state_active_ptr,  # int64 [max_reqs]; written with ACTIVE
    budget,
    num_words,
    stride_idx,
    stride_parents,
    stride_depths,
    stride_bits,
    stride_state_parents,
    stride_state_depths,
    stride_state_bits,
    ACTIVE: tl.constexpr,
    ACTIVE_PER_REQUEST: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_WORDS: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    slot = tl.load(idx_ptr + r * stride_idx).to(tl.int64)
    live = slot >= 0
    offs = tl.arange(0, BLOCK_B)
    for first in range(0, budget, BLOCK_B):
        cols = first + offs
        mask = (cols < budget) & live
        parents = tl.load(parents_ptr + r * stride_parents + cols, mask=mask)
        tl.store(state_parents_ptr + slot * stride_state_parents + cols, parents, mask=mask)
        depths = tl.load(depths_ptr + r * stride_depths + cols, mask=mask)
        tl.store(state_depths_ptr + slot * stride_state_depths + cols, depths, mask=mask)
    words = tl.arange(0, BLOCK_WORDS)
    for first in range(0, num_words, BLOCK_WORDS):
        cols = first + words
        mask = (cols < num_words) & live
        bits = tl.load(bits_ptr + r * stride_bits + cols, mask=mask)
        tl.store(state_bits_ptr + slot * stride_state_bits + cols, bits, mask=mask)
    if ACTIVE:
        if ACTIVE_PER_REQUEST:
            active = tl.load(active_ptr + r)
        else:
            active = tl.load(active_ptr)
        tl.store(state_active_ptr + slot, active.to(tl.int64), mask=live)


def _rows(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` as ``[R, n]`` without a copy (its non-leading dims contiguous), or None."""
    flat = t.reshape(t.shape[0], -1) if t.dim() > 1 else None
    if flat is None or flat.stride(1) != 1 or flat.data_ptr() != t.data_ptr():
        return None
    return flat


def store_trees_triton(
    idx_mapping: torch.Tensor,
    parents: torch.Tensor,
    depths: torch.Tensor,
    ancestor_bits: torch.Tensor,
    state_parents: torch.Tensor,
    state_depths: torch.Tensor,
    state_bits: torch.Tensor,
    active_nodes: torch.Tensor | None = None,
    state_active: torch.Tensor | None = None,
    idx_stride: int = 1,
) -> bool:
    """``state_x[idx_mapping] = x`` for the trees (and ``state_active[idx_mapping] =
    active_nodes``) in one launch.

    Args:
        idx_mapping: int32 / int64, request ``r``'s state row at ``idx_mapping[r *
            idx_stride]`` (``[R]`` with the default stride 1); a negative row writes
            nothing (CUDA-graph padding requests of DFlash's ``sample_idx_mapping``).
        parents, depths: int64 ``[R, B]``; ancestor_bits: int64 ``[R, 1 + B, W]``.
        state_parents, state_depths: int64 ``[max_reqs, B]``; state_bits: int64
            ``[max_reqs, 1 + B, W]``.
        active_nodes: int ``[R]``, or a 0-dim / one-element tensor for every request;
            state_active: int64 ``[max_reqs]`` (both or neither).
        idx_stride: entries of ``idx_mapping`` per request (>= 1).

    Returns:
        False (nothing written) when a tensor's rows are not contiguous or dtypes
        differ, or ``idx_mapping`` is not a stride-1 vector of ``(R - 1) * idx_stride +
        1`` entries or more: the caller then scatters with PyTorch. No host sync.
    """
    num_reqs = parents.shape[0]
    if (idx_stride < 1 or idx_mapping.dim() != 1 or idx_mapping.stride(0) != 1
            or idx_mapping.shape[0] < (num_reqs - 1) * idx_stride + 1):
        return False
    rows = [_rows(t) for t in (parents, depths, ancestor_bits, state_parents, state_depths,
                               state_bits)]
    if any(t is None or t.dtype != torch.int64 for t in rows):
        return False
    if idx_mapping.dtype not in (torch.int32, torch.int64) or (
            (active_nodes is None) != (state_active is None)):
        return False
    if active_nodes is not None and not (active_nodes.numel() in (1, num_reqs)
                                         and active_nodes.is_contiguous()):
        return False
    if num_reqs == 0:
        return True
    p, d, b, sp, sd, sb = rows
    per_request = (active_nodes is not None and active_nodes.dim() == 1
                   and active_nodes.numel() == num_reqs)
    _store_trees_kernel[(num_reqs,)](
        idx_mapping, p, d, b, active_nodes if active_nodes is not None else p, sp, sd, sb,
        state_active if state_active is not None else sp,
        p.shape[1], b.shape[1], idx_stride, p.stride(0), d.stride(0), b.stride(0), sp.stride(0),
        sd.stride(0), sb.stride(0),
        ACTIVE=active_nodes is not None, ACTIVE_PER_REQUEST=per_request,
        BLOCK_B=min(triton.next_power_of_2(max(p.shape[1], 1)), 512),
        BLOCK_WORDS=BLOCK_WORDS,
    )  # fmt: skip
    return True
