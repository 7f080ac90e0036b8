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


@triton.jit
def _tree_visible(AncestorBits, q_row, tok, row_active, offs_n, key_valid, start_n, ctx_len,
                  num_words, stride_bits, KEYS_FIRST: tl.constexpr):
    """Which keys each query row sees: bool ``[M, N]`` (``KEYS_FIRST``: ``[N, M]``, for
    products computed transposed). Row ``m`` is tree node ``tok[m]`` (int ``[M]``) of
    its request, its ancestor-bit row at ``q_row[m]`` (int64 ``[M]``; rows not
    ``row_active`` read no words); key ``n`` is token ``offs_n[n]`` (``[N]``, from
    ``start_n``) of a request whose first new token is at ``ctx_len``. A context key
    is always seen, a new token where it is the row's ancestor (its bit set) and not
    after the row's node; ``key_valid`` masks keys past the split. ``N <= 64``: the
    tile's new tokens span at most two mask words of a row."""
    new_idx = offs_n - ctx_len  # index among the request's new tokens; < 0: context
    is_new = new_idx >= 0
    bit_idx = tl.maximum(new_idx, 0)
    word_lo = tl.maximum(start_n - ctx_len, 0) // 64
    bits_row = AncestorBits + q_row * stride_bits
    lo = tl.load(bits_row + word_lo, mask=row_active, other=0)
    hi = tl.load(bits_row + word_lo + 1, mask=row_active & (word_lo + 1 < num_words), other=0)
    if KEYS_FIRST:
        words = tl.where(((bit_idx // 64) == word_lo)[:, None], lo[None, :], hi[None, :])
        bit_set = ((words >> (bit_idx % 64).to(tl.int64)[:, None]) & 1) != 0
        visible = key_valid[:, None] & ((~is_new)[:, None] | bit_set)
        visible = visible & (new_idx[:, None] <= tok[None, :])
    else:
        words = tl.where(((bit_idx // 64) == word_lo)[None, :], lo[:, None], hi[:, None])
        bit_set = ((words >> (bit_idx % 64).to(tl.int64)[None, :]) & 1) != 0
        visible = key_valid[None, :] & ((~is_new)[None, :] | bit_set)
        visible = visible & (new_idx[None, :] <= tok[:, None])
    return visible
