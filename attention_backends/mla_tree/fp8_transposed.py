# SPDX-License-Identifier: Apache-2.0
"""KV loop of the MLA tree-verify kernel on an fp8 (e4m3) cache with transposed products:
``kernels._mla_tree_fwd_kernel`` with ``KV_FP8_TRANSPOSED`` (a tile config with
``fp8_transposed``; sm_90's dispatch rule for an fp8 cache, ``dispatch.
fp8_transposed_method``; 1.2-1.8x faster than ``KV_FP8`` there at 128k, H100:
``evals/results/README.md``, the grid's entry).

Why: in the plain fp8 variant (``KV_FP8``) the widened tile is the *B* operand of both
MMAs. On sm_90 a wgmma B operand must sit in shared memory, so the 64-row tile writes the
widened K (``[64, 576]``) and V (``[64, 512]``) back to shared memory every tile, and
the mma.sync tiles (16 / 32 rows) gather V's key pairs byte by byte (``ld.shared.b8``);
``python evals/kernel_structure.py`` counts them offline. Here the products are
transposed, ``S^T = K q^T`` and ``O^T = V^T P^T``: the widened tile is the *A* operand,
which wgmma takes from registers, and the keys (``BLOCK_N = 64``) are the wgmma M
dimension, so even 16 query rows run on wgmma (N = ``BLOCK_M``). Only ``q^T`` (staged
once) and ``P^T`` (``[BLOCK_N, BLOCK_M]`` fp16 per tile) go through shared memory.

Layout: the latent dim is taken in chunks of ``CHUNK = 128`` columns (fewer A registers
live at once, one wgmma wait per chunk), each loaded one chunk ahead of its product.
Column orders are permuted where the mathematics allows it, so that what one thread
holds of an MMA fragment is contiguous in shared memory (vectorized loads):

- the reduction dim of ``S^T`` (latent columns) in K and q alike (``_reduction_order``);
- the rows of ``O^T`` (latent columns of V) per chunk (``_value_rows_order``), undone on
  the accumulator at the end (``_value_rows_restore``).

V's key pairs (the A fragment pairs two keys of one latent column) are made by widening
even and odd keys apart and interleaving the fp16 halves (``_widened_key_pairs``). K
and V are loaded as separate pipelined tiles (V again, ``.cg``: from L2), so that V's
shared-memory reads happen just before its products rather than with K's. The row sum
of the probabilities is kept elementwise (``[BLOCK_N, BLOCK_M]``) and reduced once at
the end: the per-tile reductions over keys cross warps (shared memory and a barrier);
only the running maximum needs one per tile.

Any ``BLOCK_N <= 64`` / ``BLOCK_L`` up to 1024 is correct (Triton's interpreter runs the
tests at small dims); the intended sm_90 tile is ``BLOCK_N = 64`` with 4 warps, 16 or 32
query rows (``configs.FP8_TRANSPOSED_TILE_CONFIGS``).
"""

import triton
import triton.language as tl

from .tiles import _dot, _page_ids, _tile_row_ptrs, _tree_visible

LATENT_CHUNK = tl.constexpr(128)
# The widest latent dim (``kv_lora_rank``, padded to a power of two) the loop takes: eight
# chunks (``_column_chunks`` / ``_row_concat`` split and stack in three levels).
MAX_KV_LORA_RANK = 8 * 128


@triton.jit
def _reduction_order(x, ROWS: tl.constexpr, CHUNK: tl.constexpr):
    """``x [ROWS, CHUNK]`` with its columns (an MMA's reduction dim) reordered so that the
    ``CHUNK / 4`` columns one thread holds of an MMA operand fragment (pairs ``2c, 2c+1``
    and ``2c+8, 2c+9`` of every 16, ``c = lane % 4``) are contiguous columns of ``x``.
    Applied to both operands of a product it leaves the product unchanged."""
    x = tl.reshape(x, (ROWS, 4, CHUNK // 16, 2, 2))
    return tl.reshape(tl.permute(x, (0, 2, 3, 1, 4)), (ROWS, CHUNK))


@triton.jit
def _value_rows_order(v, ROWS: tl.constexpr, CHUNK: tl.constexpr):
    """``v [ROWS, CHUNK]`` with its columns reordered so that the ``CHUNK / 16`` rows one
    thread holds of ``trans(v)`` as the A operand of a 4-warp MMA (rows ``16w + r``,
    ``+ 8``, ``+ 64j``) are contiguous columns of ``v`` (``_value_rows_restore`` undoes
    it on the product's rows). Chunks under 64 columns keep their order."""
    if CHUNK >= 64:
        v = tl.reshape(v, (ROWS, 4, 8, CHUNK // 64, 2))
        v = tl.reshape(tl.permute(v, (0, 3, 1, 4, 2)), (ROWS, CHUNK))
    return v


@triton.jit
def _value_rows_restore(acc, COLS: tl.constexpr, CHUNK: tl.constexpr):
    """The rows of ``acc [CHUNK, COLS]`` back in latent order (``_value_rows_order``)."""
    if CHUNK >= 64:
        acc = tl.reshape(acc, (CHUNK // 64, 4, 2, 8, COLS))
        acc = tl.reshape(tl.permute(acc, (1, 3, 0, 2, 4)), (CHUNK, COLS))
    return acc


@triton.jit
def _widened_key_pairs(v, dtype: tl.constexpr, ROWS: tl.constexpr, CHUNK: tl.constexpr):
    """fp8 ``v [ROWS, CHUNK]`` widened to ``dtype``: even and odd rows apart (each
    ``e4m3x2 -> f16x2`` conversion then takes two adjacent columns of one row, as loaded),
    then interleaved into the row pairs of ``trans(v)``'s A fragment."""
    even, odd = tl.split(tl.permute(tl.reshape(v, (ROWS // 2, 2, CHUNK)), (0, 2, 1)))
    pairs = tl.join(even.to(dtype), odd.to(dtype))
    return tl.reshape(tl.permute(pairs, (0, 2, 1)), (ROWS, CHUNK))


@triton.jit
def _column_chunks(x, CHUNKS: tl.constexpr):
    """``x [ROWS, CHUNKS * CHUNK]`` as a tuple of its ``CHUNKS`` (a power of two, at most
    8) column blocks, in order."""
    chunks = (x,)
    for level in tl.static_range(3):
        if (1 << level) < CHUNKS:
            halves = ()
            for i in tl.static_range(1 << level):
                part = chunks[i]
                part = tl.reshape(part, (part.shape[0], 2, part.shape[1] // 2))
                lo, hi = tl.split(tl.permute(part, (0, 2, 1)))
                halves = halves + (lo, hi)
            chunks = halves
    return chunks


@triton.jit
def _row_concat(chunks, CHUNKS: tl.constexpr):
    """A tuple of ``CHUNKS`` (a power of two, at most 8) ``[CHUNK, COLS]`` blocks stacked
    along the rows."""
    for level in tl.static_range(3):
        if (CHUNKS >> level) > 1:
            pairs = ()
            for i in tl.static_range(CHUNKS >> (level + 1)):
                top = chunks[2 * i]
                both = tl.permute(tl.join(top, chunks[2 * i + 1]), (2, 0, 1))
                pairs = pairs + (tl.reshape(both, (2 * top.shape[0], top.shape[1])),)
            chunks = pairs
    return chunks[0]


@triton.jit
def _columns(ptrs, key_valid, START: tl.constexpr, WIDTH: tl.constexpr, END: tl.constexpr,
             MASKED: tl.constexpr, CACHE: tl.constexpr):
    """fp8 ``[BLOCK_N, WIDTH]``: columns ``START ..`` of the cached rows ``ptrs``, zero from
    column ``END`` on and, when ``MASKED``, for keys outside ``key_valid``."""
    offs = START + tl.arange(0, WIDTH)
    if MASKED:
        return tl.load(ptrs + offs[None, :], mask=key_valid[:, None] & (offs[None, :] < END),
                       other=0.0, cache_modifier=CACHE)
    elif START + WIDTH > END:
        return tl.load(ptrs + offs[None, :], mask=offs[None, :] < END, other=0.0,
                       cache_modifier=CACHE)
    else:
        return tl.load(ptrs + offs[None, :], cache_modifier=CACHE)


@triton.jit
def _tile_update(
    KV, pages, start_n, key_valid, q_chunks, q_rope_t, scale_t, m_i, l_t, acc_chunks,
    AncestorBits, q_row, tok, row_active, ctx_len, num_words, stride_kvb, stride_kvp,
    stride_bits, KV_LORA: tl.constexpr, ROPE: tl.constexpr, BLOCK_R: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CHUNK: tl.constexpr, CHUNKS: tl.constexpr, MASKED: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
):  # fmt: skip
    """One KV tile of ``_attend_transposed``: ``(m_i, l_t, acc_chunks)`` updated. ``MASKED``:
    keys outside ``key_valid`` and the tree mask apply (the partial context tile and
    the new tokens); else every key is a visible context key."""
    ptrs = _tile_row_ptrs(KV, pages, start_n, stride_kvb, stride_kvp, PAGE_SIZE, BLOCK_N)
    dtype = q_rope_t.dtype
    s = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    # Each chunk is loaded (from shared memory) one chunk ahead of its product.
    k8_next = _columns(ptrs, key_valid, 0, CHUNK, KV_LORA, MASKED, "")
    for c in tl.static_range(CHUNKS):
        k8 = k8_next
        if c + 1 < CHUNKS:
            k8_next = _columns(ptrs, key_valid, (c + 1) * CHUNK, CHUNK, KV_LORA, MASKED, "")
        k = _reduction_order(k8, BLOCK_N, CHUNK).to(dtype)
        s = _dot(k, q_chunks[c], s, DOT_PRECISION, DOT_UPCAST)
    if ROPE > 0:
        k8 = _columns(ptrs, key_valid, KV_LORA, BLOCK_R, KV_LORA + ROPE, MASKED, "")
        k_rope = _reduction_order(k8, BLOCK_N, BLOCK_R).to(dtype)
        s = _dot(k_rope, q_rope_t, s, DOT_PRECISION, DOT_UPCAST)
    s = s * scale_t
    if MASKED:
        offs_n = start_n + tl.arange(0, BLOCK_N)
        visible = _tree_visible(AncestorBits, q_row, tok, row_active, offs_n, key_valid,
                                start_n, ctx_len, num_words, stride_bits, True)
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 0))
    m_base = m_new
    if MASKED:
        # A row may have seen nothing yet: keep exp2 arguments finite.
        m_base = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_base)
    p = tl.exp2(s - m_base[None, :])
    l_t = l_t * alpha[None, :] + p
    p = p.to(dtype)
    acc_next = ()
    v8_next = _columns(ptrs, key_valid, 0, CHUNK, KV_LORA, MASKED, ".cg")
    for c in tl.static_range(CHUNKS):
        v8 = v8_next
        if c + 1 < CHUNKS:
            v8_next = _columns(ptrs, key_valid, (c + 1) * CHUNK, CHUNK, KV_LORA, MASKED, ".cg")
        v = _widened_key_pairs(_value_rows_order(v8, BLOCK_N, CHUNK), dtype, BLOCK_N, CHUNK)
        acc = acc_chunks[c] * alpha[None, :]
        acc_next = acc_next + (_dot(tl.trans(v), p, acc, DOT_PRECISION, DOT_UPCAST),)
    return m_new, l_t, acc_next


@triton.jit
def _attend_transposed(
    KV, BlockTable, AncestorBits, q_nope, q_rope, qk_scale, bt_row, q_row, tok, row_active,
    split_start, split_end, ctx_len, num_words, stride_kvb, stride_kvp, stride_bits,
    KV_LORA: tl.constexpr, ROPE: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
):  # fmt: skip
    """The keys ``split_start .. split_end`` of one CTA's rows (the kernel's two phases:
    whole context tiles unmasked, then the partial context tile and the new tokens).

    ``q_nope [BLOCK_M, BLOCK_L]`` / ``q_rope [BLOCK_M, BLOCK_R]``: the MMA dtype (fp16:
    the e4m3 query widened); ``qk_scale``: fp32 scalar. Returns ``(acc
    [BLOCK_M, BLOCK_L], m_i [BLOCK_M], l_i [BLOCK_M])`` fp32, as the kernel's own loops
    leave them (unnormalized output, running maximum in log2 units, softmax
    denominator)."""
    CHUNK: tl.constexpr = min(BLOCK_L, LATENT_CHUNK)
    CHUNKS: tl.constexpr = BLOCK_L // CHUNK
    tl.static_assert(CHUNKS <= 8, "fp8_transposed: kv_lora_rank over MAX_KV_LORA_RANK")
    q_chunks = ()
    for c in tl.static_range(CHUNKS):
        q_c = _column_chunks(q_nope, CHUNKS)[c]
        q_chunks = q_chunks + (tl.trans(_reduction_order(q_c, BLOCK_M, CHUNK)),)
    q_rope_t = q_chunks[0]  # placeholder when ROPE == 0
    if ROPE > 0:
        q_rope_t = tl.trans(_reduction_order(q_rope, BLOCK_M, BLOCK_R))
    scale_t = tl.reshape(qk_scale * tl.full((BLOCK_M, 1), 1.0, tl.float32), (1, BLOCK_M))
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_t = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    acc_chunks = ()
    for _c in tl.static_range(CHUNKS):
        acc_chunks = acc_chunks + (tl.zeros([CHUNK, BLOCK_M], tl.float32),)

    ctx_tiles_end = tl.maximum(tl.minimum(split_end, (ctx_len // BLOCK_N) * BLOCK_N), split_start)
    # Page ids one tile ahead, as in the kernel's own loops (Triton's pipeliner).
    pages = _page_ids(BlockTable, bt_row, split_start, split_end, PAGE_SIZE, BLOCK_N)
    for start_n in range(split_start, ctx_tiles_end, BLOCK_N):
        cur_pages = pages
        pages = _page_ids(BlockTable, bt_row, start_n + BLOCK_N, split_end, PAGE_SIZE,
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
        pages = _page_ids(BlockTable, bt_row, start_n + BLOCK_N, split_end, PAGE_SIZE,
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
    acc = tl.trans(_row_concat(restored, CHUNKS))
    return acc, m_i, tl.sum(l_t, 0)
