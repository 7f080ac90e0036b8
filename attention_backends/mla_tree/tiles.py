# SPDX-License-Identifier: Apache-2.0
"""Tile helpers shared by the MLA tree-verify kernels (``kernels.py``, its fp8 KV loop with
transposed products ``fp8_transposed.py``) and the GQA one: the dot product and the
addressing of a KV tile in the paged cache."""

import triton
import triton.language as tl


@triton.jit
def _dot(a, b, acc, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``acc + a @ b``. ``UPCAST`` works around the Triton interpreter's bf16 dot."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc=acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc=acc, input_precision=DOT_PRECISION)


@triton.jit
def _page_ids(BlockTable, bt_row, start_n, limit, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Page ids of the keys ``start_n .. start_n + BLOCK_N`` (clamped/masked to ``limit``):
    an int32 scalar when the tile lies in one page, else int32 ``[BLOCK_N]``, one per key.
    ``start_n`` is a multiple of ``BLOCK_N`` (tiles start at split starts)."""
    if PAGE_SIZE % BLOCK_N == 0:
        # The whole tile lies in one page: one scalar lookup.
        return tl.load(BlockTable + bt_row + tl.minimum(start_n, limit - 1) // PAGE_SIZE)
    elif BLOCK_N % PAGE_SIZE == 0 and PAGE_SIZE > 1:
        # Whole pages (vLLM's default 16-token pages under 32- or 64-key tiles): one
        # lookup per page, broadcast to its keys. Fewer live registers than a lookup per
        # key (offline ptxas, aligned as launched: 32 against 304 spilled bytes per
        # thread for m32 n32 w4 at page 16). Past ``limit`` the last page stands in.
        NP: tl.constexpr = BLOCK_N // PAGE_SIZE
        first = tl.minimum(start_n, limit - 1) // PAGE_SIZE
        last = (limit - 1) // PAGE_SIZE
        ids = tl.load(BlockTable + bt_row + tl.minimum(first + tl.arange(0, NP), last))
        return tl.reshape(tl.broadcast_to(ids[:, None], (NP, PAGE_SIZE)), (BLOCK_N,))
    else:
        offs_n = start_n + tl.arange(0, BLOCK_N)
        return tl.load(BlockTable + bt_row + offs_n // PAGE_SIZE, mask=offs_n < limit, other=0)


@triton.jit
def _tile_row_ptrs(KV, pages, start_n, stride_kvb, stride_kvp, PAGE_SIZE: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    """Pointers ``[BLOCK_N, 1]`` to the cached rows of the keys ``start_n .. + BLOCK_N``."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    row_off = pages.to(tl.int64) * stride_kvb + (offs_n % PAGE_SIZE) * stride_kvp
    return KV + row_off[:, None]
