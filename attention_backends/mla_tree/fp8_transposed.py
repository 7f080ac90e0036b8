# SPDX-License-Identifier: Apache-2.0
"""KV loop of the MLA tree-verify kernel on an fp8 cache with transposed products
(``kernels._mla_tree_fwd_kernel`` with ``KV_FP8_TRANSPOSED``). Draft.
"""

import triton
import triton.language as tl

from . import kernels


@triton.jit
def _reduction_order(x, ROWS: tl.constexpr, CHUNK: tl.constexpr):
    """``x [ROWS, CHUNK]`` with its columns (an MMA's reduction dim) reordered so that the
    ``CHUNK / 4`` columns one thread holds of an MMA operand fragment (pairs ``2c, 2c+1``
    and ``2c+8, 2c+9`` of every 16, ``c`` = lane % 4) are contiguous in memory. Applied
    to both operands of a product it leaves the product unchanged."""
    KSTEPS: tl.constexpr = CHUNK // 16
    x = tl.reshape(x, (ROWS, 4, KSTEPS, 2, 2))
    return tl.reshape(tl.permute(x, (0, 2, 3, 1, 4)), (ROWS, CHUNK))


@triton.jit
def _value_rows_order(v, ROWS: tl.constexpr, CHUNK: tl.constexpr):
    """``v [ROWS, CHUNK]`` with its columns reordered so that the 4 * CHUNK / 64 rows one
    thread holds of ``trans(v)`` as a 4-warp MMA's A operand (rows ``16w + r``, ``+ 8``,
    ``+ 64j``) are contiguous columns of ``v`` in memory (``_value_rows_restore``
    undoes it on the product's rows)."""
    if CHUNK >= 64:
        J: tl.constexpr = CHUNK // 64
        v = tl.reshape(v, (ROWS, 4, 8, J, 2))
        v = tl.reshape(tl.permute(v, (0, 3, 1, 4, 2)), (ROWS, CHUNK))
    return v


@triton.jit
def _value_rows_restore(acc, COLS: tl.constexpr, CHUNK: tl.constexpr):
    """Inverse of ``_value_rows_order`` on the rows of ``acc [CHUNK, COLS]``."""
    if CHUNK >= 64:
        J: tl.constexpr = CHUNK // 64
        acc = tl.reshape(acc, (J, 4, 2, 8, COLS))
        acc = tl.reshape(tl.permute(acc, (1, 3, 0, 2, 4)), (CHUNK, COLS))
    return acc


@triton.jit
def _column_chunks(x, ROWS: tl.constexpr, CHUNK: tl.constexpr, CHUNKS: tl.constexpr):
    """``x [ROWS, CHUNKS * CHUNK]`` as a tuple of ``CHUNKS`` (1, 2 or 4) column blocks."""
    if CHUNKS == 1:
        return (x,)
    elif CHUNKS == 2:
        a, b = tl.split(tl.permute(tl.reshape(x, (ROWS, 2, CHUNK)), (0, 2, 1)))
        return (a, b)
    else:
        x = tl.permute(tl.reshape(x, (ROWS, 2, 2, CHUNK)), (0, 3, 1, 2))
        lo, hi = tl.split(x)  # second chunk bit
        a, c = tl.split(lo)
        b, d = tl.split(hi)
        return (a, b, c, d)


@triton.jit
def _row_concat(chunks, COLS: tl.constexpr, CHUNK: tl.constexpr, CHUNKS: tl.constexpr):
    """Tuple of ``CHUNKS`` (1, 2 or 4) ``[CHUNK, COLS]`` blocks stacked along the rows."""
    if CHUNKS == 1:
        return chunks[0]
    elif CHUNKS == 2:
        x = tl.join(chunks[0], chunks[1])
        return tl.reshape(tl.permute(x, (2, 0, 1)), (2 * CHUNK, COLS))
    else:
        x = tl.join(tl.join(chunks[0], chunks[1]), tl.join(chunks[2], chunks[3]))
        return tl.reshape(tl.permute(x, (3, 2, 0, 1)), (4 * CHUNK, COLS))


@triton.jit
def _latent_chunk(ptrs, key_valid, c: tl.constexpr, KV_LORA: tl.constexpr,
                  CHUNK: tl.constexpr, MASKED: tl.constexpr):
    """fp8 ``[BLOCK_N, CHUNK]``: latent columns ``c * CHUNK ..`` of the rows ``ptrs``."""
    offs = c * CHUNK + tl.arange(0, CHUNK)
    if MASKED:
        return tl.load(ptrs + offs[None, :], mask=key_valid[:, None] & (offs[None, :] < KV_LORA),
                       other=0.0)
    elif (c + 1) * CHUNK > KV_LORA:
        return tl.load(ptrs + offs[None, :], mask=offs[None, :] < KV_LORA, other=0.0)
    else:
        return tl.load(ptrs + offs[None, :])


@triton.jit
def _rope_chunk(ptrs, key_valid, KV_LORA: tl.constexpr, ROPE: tl.constexpr,
                BLOCK_R: tl.constexpr, MASKED: tl.constexpr):
    offs = tl.arange(0, BLOCK_R)
    if MASKED:
        return tl.load(ptrs + KV_LORA + offs[None, :],
                       mask=key_valid[:, None] & (offs[None, :] < ROPE), other=0.0)
    elif BLOCK_R != ROPE:
        return tl.load(ptrs + KV_LORA + offs[None, :], mask=offs[None, :] < ROPE, other=0.0)
    else:
        return tl.load(ptrs + KV_LORA + offs[None, :])


@triton.jit
def _tile_update(
    KV, pages, start_n, key_valid, q_chunks, q_rope_t, scale_t, m_i, l_t, acc_chunks,
    AncestorBits, q_row, tok, row_active, ctx_len, num_words, stride_kvb, stride_kvp,
    stride_bits, KV_LORA: tl.constexpr, ROPE: tl.constexpr, BLOCK_R: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CHUNK: tl.constexpr, CHUNKS: tl.constexpr, MASKED: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
):  # fmt: skip
    ptrs = kernels._tile_row_ptrs(KV, pages, start_n, stride_kvb, stride_kvp, PAGE_SIZE,
                                  BLOCK_N)
    dtype = q_rope_t.dtype
    s = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    tiles = ()
    for c in tl.static_range(CHUNKS):
        k8 = _latent_chunk(ptrs, key_valid, c, KV_LORA, CHUNK, MASKED)
        tiles = tiles + (k8,)
        k = _reduction_order(k8, BLOCK_N, CHUNK).to(dtype)
        s = kernels._dot(k, q_chunks[c], s, DOT_PRECISION, DOT_UPCAST)
    if ROPE > 0:
        k_rope = _reduction_order(_rope_chunk(ptrs, key_valid, KV_LORA, ROPE, BLOCK_R, MASKED),
                                  BLOCK_N, BLOCK_R).to(dtype)
        s = kernels._dot(k_rope, q_rope_t, s, DOT_PRECISION, DOT_UPCAST)
    s = s * scale_t
    if MASKED:
        offs_n = start_n + tl.arange(0, BLOCK_N)
        new_idx = offs_n - ctx_len  # index among the request's new tokens; < 0: context
        is_new = new_idx >= 0
        bit_idx = tl.maximum(new_idx, 0)
        word_lo = tl.maximum(start_n - ctx_len, 0) // 64
        bits_row = AncestorBits + q_row * stride_bits
        lo = tl.load(bits_row + word_lo, mask=row_active, other=0)
        hi = tl.load(bits_row + word_lo + 1, mask=row_active & (word_lo + 1 < num_words), other=0)
        words = tl.where(((bit_idx // 64) == word_lo)[:, None], lo[None, :], hi[None, :])
        bit_set = ((words >> (bit_idx % 64).to(tl.int64)[:, None]) & 1) != 0
        visible = key_valid[:, None] & ((~is_new)[:, None] | bit_set)
        visible = visible & (new_idx[:, None] <= tok[None, :])
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 0))
    m_base = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_base)
    p = tl.exp2(s - m_base[None, :])
    l_t = l_t * alpha[None, :] + p
    p = p.to(dtype)
    new_acc = ()
    for c in tl.static_range(CHUNKS):
        v = tl.trans(_value_rows_order(tiles[c], BLOCK_N, CHUNK)).to(dtype)
        new_acc = new_acc + (kernels._dot(v, p, acc_chunks[c] * alpha[None, :], DOT_PRECISION,
                                          DOT_UPCAST),)
    return m_new, l_t, new_acc


@triton.jit
def _transposed_tiles(
    KV, BlockTable, AncestorBits, q_nope, q_rope, qk_scale, bt_row, q_row, tok, row_active,
    split_start, split_end, ctx_len, num_words, stride_kvb, stride_kvp, stride_bits,
    KV_LORA: tl.constexpr, ROPE: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
):  # fmt: skip
    CHUNK: tl.constexpr = min(BLOCK_L, 128)
    CHUNKS: tl.constexpr = BLOCK_L // CHUNK
    q_chunks = ()
    for c in tl.static_range(CHUNKS):
        q_c = _column_chunks(q_nope, BLOCK_M, CHUNK, CHUNKS)[c]
        q_chunks = q_chunks + (tl.trans(_reduction_order(q_c, BLOCK_M, CHUNK)),)
    q_rope_t = q_chunks[0]  # placeholder when ROPE == 0
    if ROPE > 0:
        q_rope_t = tl.trans(_reduction_order(q_rope, BLOCK_M, BLOCK_R))
    scale_t = tl.reshape(qk_scale * tl.full((BLOCK_M, 1), 1.0, tl.float32), (1, BLOCK_M))
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_t = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    acc_chunks = ()
    for c in tl.static_range(CHUNKS):
        acc_chunks = acc_chunks + (tl.zeros([CHUNK, BLOCK_M], tl.float32),)

    ctx_tiles_end = tl.maximum(tl.minimum(split_end, (ctx_len // BLOCK_N) * BLOCK_N), split_start)
    pages = kernels._page_ids(BlockTable, bt_row, split_start, split_end, PAGE_SIZE, BLOCK_N)
    for start_n in range(split_start, ctx_tiles_end, BLOCK_N):
        cur_pages = pages
        pages = kernels._page_ids(BlockTable, bt_row, start_n + BLOCK_N, split_end, PAGE_SIZE,
                                  BLOCK_N)
        m_i, l_t, acc_chunks = _tile_update(
            KV, cur_pages, start_n, None, q_chunks, q_rope_t, scale_t, m_i, l_t, acc_chunks,
            AncestorBits, q_row, tok, row_active, ctx_len, num_words, stride_kvb, stride_kvp,
            stride_bits, KV_LORA, ROPE, BLOCK_R, PAGE_SIZE, BLOCK_M, BLOCK_N, CHUNK, CHUNKS,
            False, DOT_PRECISION, DOT_UPCAST,
        )  # fmt: skip
    for start_n in range(ctx_tiles_end, split_end, BLOCK_N):
        key_valid = start_n + tl.arange(0, BLOCK_N) < split_end
        cur_pages = pages
        pages = kernels._page_ids(BlockTable, bt_row, start_n + BLOCK_N, split_end, PAGE_SIZE,
                                  BLOCK_N)
        m_i, l_t, acc_chunks = _tile_update(
            KV, cur_pages, start_n, key_valid, q_chunks, q_rope_t, scale_t, m_i, l_t,
            acc_chunks, AncestorBits, q_row, tok, row_active, ctx_len, num_words, stride_kvb,
            stride_kvp, stride_bits, KV_LORA, ROPE, BLOCK_R, PAGE_SIZE, BLOCK_M, BLOCK_N,
            CHUNK, CHUNKS, True, DOT_PRECISION, DOT_UPCAST,
        )  # fmt: skip
    restored = ()
    for c in tl.static_range(CHUNKS):
        restored = restored + (_value_rows_restore(acc_chunks[c], BLOCK_M, CHUNK),)
    acc = tl.trans(_row_concat(restored, BLOCK_M, CHUNK, CHUNKS))
    return acc, m_i, tl.sum(l_t, 0)
