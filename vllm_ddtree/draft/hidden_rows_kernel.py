# SPDX-License-Identifier: Apache-2.0
"""The hidden-state row index of ``propose`` in one Triton launch, and the row moves
it stands for done in place (:func:`move_path_rows_triton`).

:func:`vllm_ddtree.runtime_state.hidden_row_gather_index` (about ten small PyTorch
kernels, every round) maps each request's accepted tree rows next to its root so
DFlash's context precompute reads the committed path. :func:`hidden_row_gather_index_triton`
computes the same index with one program per request (rows ``start_r + k`` take
``start_r + kv_src_rows[r, k - 1]`` for the accepted ``k``, every other row itself) and
one more for the rows past the batch (CUDA-graph padding: themselves).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["compact_path_rows_triton", "hidden_row_gather_index_triton", "move_path_rows_triton"]

BLOCK_ROWS = 128


@triton.jit(do_not_specialize=["num_reqs", "num_rows", "width"])
def _hidden_row_index_kernel(
    qsl_ptr,  # int32 [>= R + 1]
    src_ptr,  # int64 [R, width]
    out_ptr,  # int64 [num_rows]
    num_reqs,
    num_rows,
    width,
    stride_src_r,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    if r == num_reqs:  # rows past the batch map to themselves
        for first in range(tl.load(qsl_ptr + num_reqs), num_rows, BLOCK):
            rows = first + offs
            tl.store(out_ptr + rows, rows.to(tl.int64), mask=rows < num_rows)
        return
    start = tl.load(qsl_ptr + r)
    end = tl.minimum(tl.load(qsl_ptr + r + 1), num_rows)
    for first in range(start, end, BLOCK):
        rows = first + offs
        k = rows - start  # row k of the request: path depth k (k >= 1) when accepted
        path = (k >= 1) & (k <= width) & (rows < end)
        src = tl.load(src_ptr + r.to(tl.int64) * stride_src_r + (k - 1), mask=path, other=-1)
        index = tl.where(src >= 0, start + src, rows.to(tl.int64))
        tl.store(out_ptr + rows, index, mask=rows < end)


def hidden_row_gather_index_triton(
    query_start_loc: torch.Tensor, kv_src_rows: torch.Tensor, num_rows: int
) -> torch.Tensor:
    """:func:`vllm_ddtree.runtime_state.hidden_row_gather_index` in one launch.

    Args:
        query_start_loc: int32 ``[>= R + 1]``.
        kv_src_rows: int64 ``[R, L]`` from the walk (-1 padded), last dim contiguous.
        num_rows: rows of the hidden-state tensor (may include CUDA-graph padding).

    Returns:
        int64 ``[num_rows]``, the same index. No host sync.
    """
    num_reqs, width = kv_src_rows.shape
    if kv_src_rows.stride(1) != 1:
        raise ValueError("kv_src_rows must be contiguous in its last dim")
    out = torch.empty(num_rows, dtype=torch.int64, device=kv_src_rows.device)
    _hidden_row_index_kernel[(num_reqs + 1,)](
        query_start_loc, kv_src_rows, out, num_reqs, num_rows, width, kv_src_rows.stride(0),
        BLOCK=BLOCK_ROWS,
    )
    return out


MAX_MOVE_TENSORS = 4  # hidden-state tensors moved per launch


@triton.jit
def _move_tile(x_ptr, src_offs, dst_offs, mask):
    tile = tl.load(x_ptr + src_offs, mask=mask)
    tl.debug_barrier()  # every source row is read before any row is written
    tl.store(x_ptr + dst_offs, tile, mask=mask)


@triton.jit(do_not_specialize=["num_rows", "width", "hidden"])
def _move_path_rows_kernel(
    x0_ptr, x1_ptr, x2_ptr, x3_ptr,  # [num_rows, hidden] each, one row stride
    qsl_ptr,  # int32 [>= R + 1]
    src_ptr,  # int64 [R, width]
    num_rows,
    width,
    hidden,
    stride_row,
    stride_src_r,
    NUM: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    start = tl.load(qsl_ptr + r).to(tl.int64)
    end = tl.minimum(tl.load(qsl_ptr + r + 1).to(tl.int64), num_rows)
    k = 1 + tl.arange(0, BLOCK_L)  # row k of the request gets its path node's row
    src = tl.load(src_ptr + r * stride_src_r + (k - 1), mask=k <= width, other=-1)
    moves = (src >= 0) & (src != k) & (start + k < end) & (start + src < end)
    mask = moves[:, None] & (cols < hidden)[None, :]
    src_offs = (start + src)[:, None] * stride_row + cols[None, :]
    dst_offs = (start + k)[:, None] * stride_row + cols[None, :]
    _move_tile(x0_ptr, src_offs, dst_offs, mask)
    if NUM > 1:
        _move_tile(x1_ptr, src_offs, dst_offs, mask)
    if NUM > 2:
        _move_tile(x2_ptr, src_offs, dst_offs, mask)
    if NUM > 3:
        _move_tile(x3_ptr, src_offs, dst_offs, mask)


def move_path_rows_triton(
    hidden_states: list[torch.Tensor], query_start_loc: torch.Tensor,
    kv_src_rows: torch.Tensor, *, block_h: int = 128,
) -> bool:
    """``x.copy_(x[hidden_row_gather_index(query_start_loc, kv_src_rows, len(x))])`` for
    every ``x`` in ``hidden_states``, in place, one launch per four tensors (the gather
    path is one index launch, then one gather and one new tensor per ``x``).

    Rows ``start_r + k`` (``k = 1..a_r``) get row ``start_r + kv_src_rows[r, k - 1]``;
    every other row stays. Each program reads its whole ``[L, columns]`` tile before
    writing (a destination row can be a later move's source), so the result is the
    gather's, bit for bit.

    Args:
        hidden_states: tensors ``[num_rows, H]`` of one shape, dtype and row stride,
            last dim contiguous (the target's aux hidden states of a verify step).
        query_start_loc: int32 ``[>= R + 1]``; kv_src_rows: int64 ``[R, L]`` from the
            walk (-1 padded), last dim contiguous.

    Returns:
        False (nothing moved) when the tensors do not share one layout: the caller
        then gathers. No host sync.
    """
    if not hidden_states:
        return True
    first = hidden_states[0]
    if first.dim() != 2 or kv_src_rows.stride(1) != 1 or any(
            x.shape != first.shape or x.dtype != first.dtype or x.stride() != first.stride()
            or x.stride(1) != 1 for x in hidden_states):
        return False
    if len({x.data_ptr() for x in hidden_states}) != len(hidden_states):
        return False  # aliased tensors would be moved twice
    num_rows, hidden = first.shape
    num_reqs, width = kv_src_rows.shape
    if num_reqs == 0 or width == 0:
        return True
    grid = (num_reqs, triton.cdiv(hidden, block_h))
    for i in range(0, len(hidden_states), MAX_MOVE_TENSORS):
        group = hidden_states[i:i + MAX_MOVE_TENSORS]
        ptrs = group + [group[0]] * (MAX_MOVE_TENSORS - len(group))
        _move_path_rows_kernel[grid](
            *ptrs, query_start_loc, kv_src_rows, num_rows, width, hidden, first.stride(0),
            kv_src_rows.stride(0),
            NUM=len(group), BLOCK_L=triton.next_power_of_2(width), BLOCK_H=block_h,
        )  # fmt: skip
    return True


@triton.jit(do_not_specialize=["num_reqs", "width", "hidden", "rows_per_req"])
def _compact_path_rows_kernel(
    x0_ptr, x1_ptr, x2_ptr, x3_ptr,  # [num_rows, hidden] each, one row stride
    qsl_ptr,  # int32 [>= R + 1]
    src_ptr,  # int64 [R, width]
    positions_ptr,  # int64 [num_rows], the verify rows' (linear) positions
    num_sampled_ptr,  # int32 [R]
    out_positions_ptr,  # int64 [>= R * rows_per_req]
    out_num_rejected_ptr,  # int32 [>= R]
    num_reqs,
    width,
    hidden,
    rows_per_req,
    stride_row,
    stride_src_r,
    NUM: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    # One program per column block walks the requests in order: request r's
    # destination rows [r * c, r * c + c) lie below every row a later request reads
    # (>= qsl[r + 1] >= (r + 1) * c), and its own sources sit at or after their
    # destinations, so one barrier per request between its reads and writes suffices.
    block = tl.program_id(0)
    cols = block * BLOCK_H + tl.arange(0, BLOCK_H)
    k = tl.arange(0, BLOCK_C)
    in_req = k < rows_per_req
    mask = in_req[:, None] & (cols < hidden)[None, :]
    for r in range(0, num_reqs):
        start = tl.load(qsl_ptr + r).to(tl.int64)
        src = tl.load(src_ptr + r * stride_src_r + (k - 1),
                      mask=(k >= 1) & (k <= width) & in_req, other=-1)
        rows = start + tl.where(src >= 0, src, k)
        dst = (r * rows_per_req + k).to(tl.int64)
        src_offs = rows[:, None] * stride_row + cols[None, :]
        dst_offs = dst[:, None] * stride_row + cols[None, :]
        _move_tile(x0_ptr, src_offs, dst_offs, mask)
        if NUM > 1:
            _move_tile(x1_ptr, src_offs, dst_offs, mask)
        if NUM > 2:
            _move_tile(x2_ptr, src_offs, dst_offs, mask)
        if NUM > 3:
            _move_tile(x3_ptr, src_offs, dst_offs, mask)
        if block == 0:
            pos = tl.load(positions_ptr + start + k, mask=in_req)
            tl.store(out_positions_ptr + dst, pos, mask=in_req)
            sampled = tl.load(num_sampled_ptr + r)
            tl.store(out_num_rejected_ptr + r, rows_per_req - sampled)


def compact_path_rows_triton(
    hidden_states: list[torch.Tensor], query_start_loc: torch.Tensor,
    kv_src_rows: torch.Tensor, positions: torch.Tensor, num_sampled: torch.Tensor,
    rows_per_req: int, out_positions: torch.Tensor, out_num_rejected: torch.Tensor,
    *, block_h: int = 128,
) -> bool:
    """:func:`vllm_ddtree.draft.context_rows.compact_path_rows_torch` in place, one launch per
    four tensors (the positions and rejected counts written by the first).

    Same arguments and preconditions. Returns False (nothing done) when the tensors do
    not share one layout: the caller then takes the PyTorch path. No host sync.
    """
    if not hidden_states:
        return False
    first = hidden_states[0]
    if first.dim() != 2 or kv_src_rows.stride(1) != 1 or any(
            x.shape != first.shape or x.dtype != first.dtype or x.stride() != first.stride()
            or x.stride(1) != 1 for x in hidden_states):
        return False
    if len({x.data_ptr() for x in hidden_states}) != len(hidden_states):
        return False  # aliased tensors would be moved twice
    num_reqs, width = kv_src_rows.shape
    hidden = first.shape[1]
    grid = (triton.cdiv(hidden, block_h),)
    for i in range(0, len(hidden_states), MAX_MOVE_TENSORS):
        group = hidden_states[i:i + MAX_MOVE_TENSORS]
        ptrs = group + [group[0]] * (MAX_MOVE_TENSORS - len(group))
        _compact_path_rows_kernel[grid](
            *ptrs, query_start_loc, kv_src_rows, positions, num_sampled, out_positions,
            out_num_rejected, num_reqs, width, hidden, rows_per_req, first.stride(0),
            kv_src_rows.stride(0),
            NUM=len(group), BLOCK_C=triton.next_power_of_2(rows_per_req), BLOCK_H=block_h,
        )  # fmt: skip
    return True
