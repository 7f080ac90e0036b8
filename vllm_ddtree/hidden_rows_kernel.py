# SPDX-License-Identifier: Apache-2.0
"""The hidden-state row index of ``propose`` in one Triton launch.

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

__all__ = ["hidden_row_gather_index_triton"]

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
