# SPDX-License-Identifier: Apache-2.0
"""Triton kernels of MLA tree-verify attention (absorbed form, latent paged cache).

``_mla_tree_fwd_kernel``: grid ``(row_blocks, kv_splits, requests)``. A CTA takes
``BLOCK_M`` flattened rows ``row = token * H + head`` of one request and one split of
that request's keys, so every query token and head of the request shares each KV tile
it loads. Axis 0 varies fastest in launch order: the CTAs that read the same split of
the same request run side by side and share the tile through L2.

``HAS_ACTIVE`` (constexpr) adds per-request active query rows (adaptive tree
budget): only the first ``ActiveQueryLens[r]`` tokens of request ``r`` are real. The
grid keeps its (CUDA-graph) shape, so a request with ``A`` active row blocks out of
``M`` launched has ``M * S`` CTAs for ``A`` blocks: they split its keys
``S_eff = (M // A) * S`` ways instead of ``S`` (at most ``MAX_SPLITS``, at least
``MIN_TILES`` tiles a split, never below ``S``). CTA ``(m, s)`` takes work item
``m * S + s = m' * S_eff + s'`` (row block ``m'``, split ``s'``); items past ``A * S_eff``
return at once. Skipping inactive rows thus shortens the critical path, not only the
total work: at long context a few active rows finish ``M // A`` times sooner. Partial
results go to a compact buffer, row ``(r * M * S + item) * BLOCK_M + i``; CTA ``(m, 0)``
writes for each of its rows where its splits start (``MergeBase``) and how many there
are (``MergeCount``, 0 for an inactive row). Without ``HAS_ACTIVE`` none of this is
compiled in and ``ActiveQueryLens``, ``MergeBase`` and ``MergeCount`` are never read.

``RUNTIME_SPLITS`` (constexpr): the grid's ``S`` is an upper bound (a CUDA graph freezes
it at capture, sized for the longest context) and each request takes
``_runtime_num_splits`` of its own ``seq_len``: the split count the host would pick for
that length (``configs.select_num_kv_splits``), capped by ``S``. Splits past it have no
keys. Without it a 16k-token request replayed in a graph captured for 160k ran in 4x
the waves of 4x shorter splits the host would give it.

``KV_FP8`` (constexpr): the cache holds fp8 (e4m3) latent rows, vLLM's ``--kv-cache-dtype
fp8`` layout for MLA (``concat_and_cache_mla``: ``row = fp8(x / k_scale)``, one fp32 scale
per layer, for the latent and rope parts alike), and q is vLLM's e4m3 query (``q /
q_scale``, quantized by ``MLAAttention`` as for FlashMLA's fp8 path, one static scale per
layer: its rounding depends on neither the batch nor the kernel). The scales are applied
once, not per key: ``(s_q q) . (s k) = s_q s (q . k)`` folds into the softmax scale and
``sum p (s v) = s sum p v`` into the output. The MMAs take fp16 operands (fp32
accumulation): e4m3 -> fp16 is exact (every e4m3 value is an fp16 value) and one ``cvt``
per pair of values on sm_89+, whereas e4m3 -> bf16 has no conversion instruction on
sm_90 / sm_120 and goes through fp16 with one more conversion per value, a cost that
would bound a kernel reading half the bytes of the 16-bit cache. ``p`` is cast to fp16
(11 significant bits, bf16 has 8). V is not the widened K tile: the fp8 tile is loaded
again (``.cg``, from L2) and widened just before the PV MMA, so no widened 16-bit tile
stays live from the QK MMA to the PV MMA; the pipeline stages two fp8 tiles (K, V)
where the 16-bit cache stages one 16-bit tile.

``KV_FP8_TRANSPOSED`` (constexpr, with ``KV_FP8``; a tile config's ``fp8_transposed``):
the KV loop of ``fp8_transposed.py`` instead, with transposed products (``S^T = K q^T``,
``O^T = V^T P^T``) so that the widened tile is an A operand, which sm_90's wgmma takes
from registers (that module's docstring). The prologue (splits, q rows) and the
epilogue are this kernel's.

``_mla_tree_merge_kernel``: combines the per-split partial (out, lse) when the keys
were split across CTAs (flash-decoding). A row whose splits are all ``-inf`` (no key)
gets ``out = 0, lse = -inf``. With ``HAS_ACTIVE`` it reads a row's ``MergeCount``
splits from ``MergeBase`` on (an inactive row: none, so ``out = 0, lse = -inf``).
"""

import triton
import triton.language as tl

from . import configs, fp8_transposed
from .tiles import _dot, _page_ids, _tile_row_ptrs, _tree_visible

LOG2E = 1.4426950408889634
LN2 = tl.constexpr(0.6931471805599453)
SPLIT_OVERHEAD_TILES = tl.constexpr(configs.SPLIT_OVERHEAD_TILES)


@triton.jit
def _load_latent(ptrs, key_valid, offs_l, KV_LORA: tl.constexpr, BLOCK_L: tl.constexpr,
                 MASKED: tl.constexpr, CACHE: tl.constexpr):
    """The latent part ``[BLOCK_N, BLOCK_L]`` of the rows ``ptrs`` (K's nope part and V),
    zero past ``KV_LORA`` and, when ``MASKED``, for keys outside ``key_valid``."""
    if MASKED:
        return tl.load(
            ptrs + offs_l[None, :],
            mask=key_valid[:, None] & (offs_l[None, :] < KV_LORA),
            other=0.0,
            cache_modifier=CACHE,
        )
    elif BLOCK_L != KV_LORA:
        return tl.load(ptrs + offs_l[None, :], mask=offs_l[None, :] < KV_LORA, other=0.0,
                       cache_modifier=CACHE)
    else:
        return tl.load(ptrs + offs_l[None, :], cache_modifier=CACHE)


@triton.jit
def _load_kv_tile(
    KV,
    pages,
    start_n,
    key_valid,
    offs_l,
    offs_r,
    stride_kvb,
    stride_kvp,
    KV_LORA: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
):
    """``k_nope [BLOCK_N, BLOCK_L]`` and ``k_rope [BLOCK_N, BLOCK_R]`` of one KV tile."""
    ptrs = _tile_row_ptrs(KV, pages, start_n, stride_kvb, stride_kvp, PAGE_SIZE, BLOCK_N)
    k_nope = _load_latent(ptrs, key_valid, offs_l, KV_LORA, BLOCK_L, MASKED, "")
    k_rope = k_nope  # placeholder when ROPE == 0
    if ROPE > 0:
        if MASKED:
            k_rope = tl.load(
                ptrs + KV_LORA + offs_r[None, :],
                mask=key_valid[:, None] & (offs_r[None, :] < ROPE),
                other=0.0,
            )
        elif BLOCK_R != ROPE:
            k_rope = tl.load(
                ptrs + KV_LORA + offs_r[None, :], mask=offs_r[None, :] < ROPE, other=0.0
            )
        else:
            k_rope = tl.load(ptrs + KV_LORA + offs_r[None, :])
    return k_nope, k_rope


@triton.jit
def _fp8_value_tile(KV, pages, start_n, key_valid, offs_l, stride_kvb, stride_kvp,
                    KV_LORA: tl.constexpr, BLOCK_L: tl.constexpr, PAGE_SIZE: tl.constexpr,
                    BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    """V ``[BLOCK_N, BLOCK_L]`` fp8 of a tile, loaded again (the K load brought it into
    L2: ``.cg``) for the caller to widen just before the PV MMA, rather than keeping K's
    widened tile live from the QK MMA on. ``MASKED``: keys outside ``key_valid`` read 0
    (their probability is 0, but 0 * NaN is NaN and past ``seq_len`` a slot is garbage)."""
    ptrs = _tile_row_ptrs(KV, pages, start_n, stride_kvb, stride_kvp, PAGE_SIZE, BLOCK_N)
    return _load_latent(ptrs, key_valid, offs_l, KV_LORA, BLOCK_L, MASKED, ".cg")


@triton.jit
def _runtime_num_splits(key_tiles, base_ctas, split_slots, grid_splits,
                        MIN_TILES: tl.constexpr, MAX_SPLITS: tl.constexpr):
    """``configs.select_num_kv_splits`` on the device: the split count of a request of
    ``key_tiles`` KV tiles when ``base_ctas`` CTAs (requests x row blocks) share
    ``split_slots`` resident CTA slots, at most ``grid_splits``. Every candidate is
    costed in one vector (``waves * (tiles per split + overhead)``); ties go to the
    fewest splits, as on the host."""
    tiles = tl.maximum(key_tiles, 1)
    limit = tl.maximum(tl.minimum(tl.minimum(grid_splits, MAX_SPLITS), tiles // MIN_TILES), 1)
    splits = tl.arange(0, MAX_SPLITS) + 1
    waves = tl.cdiv(base_ctas * splits, split_slots)
    cost = tl.where(splits <= limit,
                    waves * (tl.cdiv(tiles, splits) + SPLIT_OVERHEAD_TILES), 2**30)
    best_cost = tl.min(cost, 0)
    return tl.min(tl.where(cost == best_cost, splits, MAX_SPLITS), 0)


@triton.jit
def _resplit_active_rows(
    ActiveQueryLens, MergeBase, MergeCount, stride_mt, head_offset, slab_base,
    pid_r, pid_m, pid_s, num_splits, num_row_blocks, q_start, q_len, num_rows, key_tiles,
    ROWS_PER_TOKEN: tl.constexpr, BLOCK_M: tl.constexpr, MIN_TILES: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
):  # fmt: skip
    """Active-row work item of CTA ``(pid_m, pid_s)`` (module docstring). Returns
    ``(run, num_active, pid_m, pid_s, splits, part_row)``: the CTA works iff ``run``
    (a request without active rows, e.g. CUDA-graph padding, has no work), as row block
    ``pid_m`` and split ``pid_s`` of ``splits``, its partials in compact rows
    ``part_row`` (int64 ``[BLOCK_M]``). CTA ``(m, 0)`` writes MergeBase / MergeCount of
    its rows: ``row = token * ROWS_PER_TOKEN + i`` is query head ``head_offset + i``;
    its split ``s`` is compact row ``slab_base + (m * splits + s) * BLOCK_M + row %
    BLOCK_M``."""
    num_active = tl.minimum(tl.load(ActiveQueryLens + pid_r), q_len)
    active_blocks = tl.maximum(tl.cdiv(num_active * ROWS_PER_TOKEN, BLOCK_M), 1)
    splits = (num_row_blocks // active_blocks) * num_splits
    splits = tl.minimum(splits, tl.maximum(num_splits, tl.minimum(key_tiles // MIN_TILES,
                                                                  MAX_SPLITS)))
    if pid_s == 0:
        offs = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        tok = offs // ROWS_PER_TOKEN
        idx = (q_start + tok).to(tl.int64) * stride_mt + head_offset + offs % ROWS_PER_TOKEN
        base = slab_base + pid_m * splits * BLOCK_M + tl.arange(0, BLOCK_M)
        valid = offs < num_rows
        tl.store(MergeBase + idx, base, mask=valid)
        tl.store(MergeCount + idx, tl.where(tok < num_active, splits, 0), mask=valid)
    item = pid_m * num_splits + pid_s
    run = (num_active > 0) & (item < active_blocks * splits)
    part_row = (slab_base + item * BLOCK_M).to(tl.int64) + tl.arange(0, BLOCK_M)
    return run, num_active, item // splits, item % splits, splits, part_row


@triton.jit
def _attend_tile(
    KV, AncestorBits, pages, start_n, offs_n, key_valid, q_nope, q_rope, qk_scale, acc, m_i,
    l_i, offs_l, offs_r, q_row, tok, row_active, ctx_len, num_words, stride_kvb, stride_kvp,
    stride_bits, KV_LORA: tl.constexpr, ROPE: tl.constexpr, BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr, KV_FP8: tl.constexpr,
    MASKED: tl.constexpr,
):
    """One KV tile of ``BLOCK_N`` keys from ``start_n`` (its ``pages``) into the rows'
    online softmax: ``(acc fp32 [M, L], m_i fp32 [M], l_i fp32 [M])`` updated. Without
    ``MASKED`` every key is a context key the rows all see (phase 1: whole context
    tiles; ``offs_n`` and ``key_valid`` None); with it the keys ``offs_n`` not
    ``key_valid`` (past the split) are masked, new tokens follow the tree mask
    (``tiles._tree_visible``), and a row that has seen nothing yet keeps its exp2
    arguments finite."""
    k_nope, k_rope = _load_kv_tile(
        KV, pages, start_n, key_valid, offs_l, offs_r, stride_kvb, stride_kvp,
        KV_LORA, ROPE, BLOCK_L, BLOCK_R, PAGE_SIZE, BLOCK_N, MASKED,
    )  # fmt: skip
    if KV_FP8:
        k_nope, k_rope = k_nope.to(q_nope.dtype), k_rope.to(q_nope.dtype)
    qk = _dot(q_nope, tl.trans(k_nope), None, DOT_PRECISION, DOT_UPCAST)
    if ROPE > 0:
        qk = _dot(q_rope, tl.trans(k_rope), qk, DOT_PRECISION, DOT_UPCAST)
    qk = qk * qk_scale
    if MASKED:
        visible = _tree_visible(AncestorBits, q_row, tok, row_active, offs_n, key_valid,
                                start_n, ctx_len, num_words, stride_bits, False)
        qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_base = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_base = m_new
    alpha = tl.exp2(m_i - m_base)
    p = tl.exp2(qk - m_base[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    v = k_nope
    if KV_FP8:
        v = _fp8_value_tile(
            KV, pages, start_n, key_valid, offs_l, stride_kvb, stride_kvp,
            KV_LORA, BLOCK_L, PAGE_SIZE, BLOCK_N, MASKED,
        ).to(q_nope.dtype)  # fmt: skip
    acc = _dot(p.to(v.dtype), v, acc, DOT_PRECISION, DOT_UPCAST)
    return acc, m_new, l_i


# Arguments that change with the KV split count (context length, batch) are not
# specialized (== 1 / multiple of 16), so eager launches do not JIT a new variant when a
# step's split count crosses a class. Only scalar LSE strides: the 512-wide partial rows
# keep their (always multiple-of-16) strides specialized for vectorized access.
_SPLIT_DEPENDENT = ("stride_lt", "stride_lh", "stride_ls")


@triton.jit(do_not_specialize=_SPLIT_DEPENDENT)
def _mla_tree_fwd_kernel(
    Q,
    KV,
    BlockTable,
    SeqLens,
    QueryStartLoc,
    AncestorBits,
    Out,
    Lse,
    qk_scale,  # softmax scale * log2(e)
    stride_qt,
    stride_qh,
    stride_kvb,
    stride_kvp,
    stride_bt,
    stride_bits,
    num_words,
    stride_ot,
    stride_oh,
    stride_os,
    stride_lt,
    stride_lh,
    stride_ls,
    NUM_HEADS: tl.constexpr,
    KV_LORA: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    ActiveQueryLens,  # int32 [R]; read only with HAS_ACTIVE
    MergeBase,  # int32 [T, H]; written only with HAS_ACTIVE
    MergeCount,  # int32 [T, H]; written only with HAS_ACTIVE
    stride_mt,
    HAS_ACTIVE: tl.constexpr,
    MIN_TILES: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
    split_slots=0,  # resident CTA slots; read only with RUNTIME_SPLITS
    RUNTIME_SPLITS: tl.constexpr = False,
    KVScale=None,  # fp32 [1]: the fp8 cache's dequantization scale; read only with KV_FP8
    QScale=None,  # fp32 [1]: the e4m3 query's dequantization scale; read only with KV_FP8
    KV_FP8: tl.constexpr = False,
    KV_FP8_TRANSPOSED: tl.constexpr = False,
):
    """One CTA (see the module docstring)."""
    tl.static_assert(BLOCK_N <= 64)
    tl.static_assert(not (RUNTIME_SPLITS and HAS_ACTIVE))
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_r = tl.program_id(2)
    num_splits = tl.num_programs(1)

    q_start = tl.load(QueryStartLoc + pid_r)
    q_len = tl.load(QueryStartLoc + pid_r + 1) - q_start
    num_rows = q_len * NUM_HEADS
    if not HAS_ACTIVE:
        if pid_m * BLOCK_M >= num_rows:
            return

    seq_len = tl.load(SeqLens + pid_r)
    ctx_len = seq_len - q_len

    if HAS_ACTIVE:
        # Every CTA of the request may take a work item, also those past its rows; a
        # request without active rows (CUDA-graph padding: no query) has none.
        run, num_active, pid_m, pid_s, num_splits, part_row = _resplit_active_rows(
            ActiveQueryLens, MergeBase, MergeCount, stride_mt, 0,
            pid_r * tl.num_programs(0) * num_splits * BLOCK_M, pid_r, pid_m, pid_s,
            num_splits, tl.num_programs(0), q_start, q_len, num_rows,
            tl.cdiv(seq_len, BLOCK_N), NUM_HEADS, BLOCK_M, MIN_TILES, MAX_SPLITS,
        )  # fmt: skip
        if not run:
            return

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_valid = offs_m < num_rows
    tok = offs_m // NUM_HEADS
    head = offs_m % NUM_HEADS
    q_row = (q_start + tok).to(tl.int64)
    row_active = row_valid
    if HAS_ACTIVE:
        row_active = row_valid & (tok < num_active)
        # Compact partials: stride_ot is the partial row stride, stride_lt Lse's.
        offs_lse = part_row * stride_lt
        offs_out = part_row[:, None] * stride_ot
    else:
        offs_lse = q_row * stride_lt + head * stride_lh + pid_s * stride_ls
        offs_out = q_row[:, None] * stride_ot + head[:, None] * stride_oh + pid_s * stride_os

    if RUNTIME_SPLITS:
        num_splits = _runtime_num_splits(
            tl.cdiv(seq_len, BLOCK_N), tl.num_programs(0) * tl.num_programs(2), split_slots,
            num_splits, MIN_TILES, MAX_SPLITS)
    # Even split of the request's keys, in whole tiles.
    keys_per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    split_start = pid_s * keys_per_split
    split_end = tl.minimum(split_start + keys_per_split, seq_len)
    # Topological order: the last token of this CTA sees no new token after itself.
    last_tok = tl.minimum(pid_m * BLOCK_M + BLOCK_M - 1, num_rows - 1) // NUM_HEADS
    if HAS_ACTIVE:
        last_tok = tl.minimum(last_tok, num_active - 1)
    split_end = tl.minimum(split_end, ctx_len + last_tok + 1)

    if KV_FP8:
        kv_scale = tl.load(KVScale)
        qk_scale = qk_scale * kv_scale * tl.load(QScale)

    if split_start >= split_end:
        # Nothing to attend in this split; the merge kernel skips it.
        tl.store(Lse + offs_lse, tl.full([BLOCK_M], float("-inf"), tl.float32), mask=row_valid)
        return

    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    q_ptrs = Q + q_row[:, None] * stride_qt + head[:, None] * stride_qh
    q_nope = tl.load(
        q_ptrs + offs_l[None, :],
        mask=row_active[:, None] & (offs_l[None, :] < KV_LORA),
        other=0.0,
    )
    q_rope = q_nope  # placeholder when ROPE == 0
    if ROPE > 0:
        q_rope = tl.load(
            q_ptrs + KV_LORA + offs_r[None, :],
            mask=row_active[:, None] & (offs_r[None, :] < ROPE),
            other=0.0,
        )
    if KV_FP8:  # the e4m3 query widened to fp16 MMA operands (exact)
        q_nope, q_rope = q_nope.to(tl.float16), q_rope.to(tl.float16)

    bt_row = pid_r.to(tl.int64) * stride_bt
    if KV_FP8_TRANSPOSED:
        acc, m_i, l_i = fp8_transposed._attend_transposed(
            KV, BlockTable, AncestorBits, q_nope, q_rope, qk_scale, bt_row, q_row, tok,
            row_active, split_start, split_end, ctx_len, num_words, stride_kvb, stride_kvp,
            stride_bits, KV_LORA, ROPE, BLOCK_L, BLOCK_R, PAGE_SIZE, BLOCK_M, BLOCK_N,
            DOT_PRECISION, DOT_UPCAST,
        )  # fmt: skip
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_L], tl.float32)

        # Phase 1: whole tiles of context keys; no mask at all.
        ctx_tiles_end = tl.maximum(tl.minimum(split_end, (ctx_len // BLOCK_N) * BLOCK_N),
                                   split_start)
        # The page ids of the next tile are loaded one iteration ahead: an address that
        # depends on a load of the same iteration limits Triton's pipeliner to one buffer.
        pages = _page_ids(BlockTable, bt_row, split_start, split_end, PAGE_SIZE, BLOCK_N)
        for start_n in range(split_start, ctx_tiles_end, BLOCK_N):
            cur_pages = pages
            pages = _page_ids(BlockTable, bt_row, start_n + BLOCK_N, split_end, PAGE_SIZE, BLOCK_N)
            acc, m_i, l_i = _attend_tile(
                KV, AncestorBits, cur_pages, start_n, None, None, q_nope, q_rope, qk_scale,
                acc, m_i, l_i, offs_l, offs_r, q_row, tok, row_active, ctx_len, num_words,
                stride_kvb, stride_kvp, stride_bits, KV_LORA, ROPE, BLOCK_L, BLOCK_R,
                PAGE_SIZE, BLOCK_N, DOT_PRECISION, DOT_UPCAST, KV_FP8, False,
            )  # fmt: skip

        # Phase 2: the partial context tile and the new tokens; seq_len bound + tree mask.
        for start_n in range(ctx_tiles_end, split_end, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            key_valid = offs_n < split_end
            cur_pages = pages
            pages = _page_ids(BlockTable, bt_row, start_n + BLOCK_N, split_end, PAGE_SIZE, BLOCK_N)
            acc, m_i, l_i = _attend_tile(
                KV, AncestorBits, cur_pages, start_n, offs_n, key_valid, q_nope, q_rope,
                qk_scale, acc, m_i, l_i, offs_l, offs_r, q_row, tok, row_active, ctx_len,
                num_words, stride_kvb, stride_kvp, stride_bits, KV_LORA, ROPE, BLOCK_L,
                BLOCK_R, PAGE_SIZE, BLOCK_N, DOT_PRECISION, DOT_UPCAST, KV_FP8, True,
            )  # fmt: skip

    seen = l_i > 0.0
    if KV_FP8:
        acc = acc * kv_scale
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * LN2, float("-inf"))
    if HAS_ACTIVE:
        out = tl.where(row_active[:, None], out, 0.0)
        lse = tl.where(row_active, lse, float("-inf"))
    tl.store(
        Out + offs_out + offs_l[None, :],
        out.to(Out.dtype.element_ty),
        mask=row_valid[:, None] & (offs_l[None, :] < KV_LORA),
    )
    tl.store(Lse + offs_lse, lse, mask=row_valid)


def dot_options(q_dtype) -> dict:
    """``DOT_PRECISION`` / ``DOT_UPCAST`` of a launch whose q has ``q_dtype`` (a torch
    dtype): IEEE dots for fp32 (exactness), tf32 otherwise; bf16 upcast where the kernels
    run in Triton's interpreter (its bf16 dot)."""
    interpreted = type(_mla_tree_fwd_kernel).__name__ == "InterpretedFunction"
    return dict(DOT_PRECISION="ieee" if str(q_dtype) == "torch.float32" else "tf32",
                DOT_UPCAST=str(q_dtype) == "torch.bfloat16" and interpreted)


@triton.jit(do_not_specialize=("num_splits", "stride_lpt", "stride_lph", "stride_lps"))
def _mla_tree_merge_kernel(
    OutPart,  # fp32 [T, H, S, L]; with HAS_ACTIVE compact [P, L]
    LsePart,  # fp32 [T, H, S]; with HAS_ACTIVE compact [P]
    Out,  # [T, H, L]
    Lse,  # fp32 [T, H]
    num_splits,  # S; with HAS_ACTIVE the most splits a row may have
    stride_pt,
    stride_ph,
    stride_ps,
    stride_lpt,
    stride_lph,
    stride_lps,
    stride_ot,
    stride_oh,
    stride_lt,
    stride_lh,
    MergeBase,  # int32 [T, H]; read only with HAS_ACTIVE
    MergeCount,  # int32 [T, H]; read only with HAS_ACTIVE
    stride_mt,
    split_stride,  # compact partial rows between two splits of a row (BLOCK_M)
    KV_LORA: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_S: tl.constexpr,
    HAS_ACTIVE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_l = tl.arange(0, BLOCK_L)
    mask_l = offs_l < KV_LORA

    if HAS_ACTIVE:
        # A row's splits: compact rows base, base + split_stride, ... (none if inactive).
        count = tl.load(MergeCount + t * stride_mt + h)
        count = tl.minimum(tl.maximum(count, 0), num_splits)
        base_row = tl.load(MergeBase + t * stride_mt + h).to(tl.int64)
        m_run = float("-inf")
        denom = 0.0
        acc = tl.zeros([BLOCK_L], tl.float32)
        for s in range(count):
            row = base_row + s * split_stride
            lse_one = tl.load(LsePart + row * stride_lpt)
            m_new = tl.maximum(m_run, lse_one)
            m_base = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_run - m_base)
            weight = tl.exp(lse_one - m_base)
            # Splits without keys left their partial output unwritten: load nothing.
            width = tl.where(lse_one > float("-inf"), KV_LORA, 0)
            part = tl.load(OutPart + row * stride_pt + offs_l, mask=offs_l < width, other=0.0)
            acc = acc * alpha + weight * part
            denom = denom * alpha + weight
            m_run = m_new
        base = tl.where(m_run == float("-inf"), 0.0, m_run)
    else:
        offs_s = tl.arange(0, BLOCK_S)
        lse_base = LsePart + t * stride_lpt + h * stride_lph
        lse_s = tl.load(lse_base + offs_s * stride_lps, mask=offs_s < num_splits,
                        other=float("-inf"))
        lse_max = tl.max(lse_s, 0)
        base = tl.where(lse_max == float("-inf"), 0.0, lse_max)
        denom = tl.sum(tl.exp(lse_s - base), 0)

        acc = tl.zeros([BLOCK_L], tl.float32)
        part_base = OutPart + t * stride_pt + h * stride_ph
        for s in range(num_splits):
            lse_one = tl.load(lse_base + s * stride_lps)
            # Splits without keys left their partial output unwritten: skip the read
            # (with run-time split counts most of a graph's splits are empty) and drop it.
            width = tl.where(lse_one > float("-inf"), KV_LORA, 0)
            part = tl.load(part_base + s * stride_ps + offs_l, mask=offs_l < width, other=0.0)
            acc += tl.where(lse_one > float("-inf"), tl.exp(lse_one - base) * part, 0.0)

    seen = denom > 0.0
    out = acc / tl.where(seen, denom, 1.0)
    lse = tl.where(seen, base + tl.log(tl.where(seen, denom, 1.0)), float("-inf"))
    out_ptrs = Out + t * stride_ot + h * stride_oh + offs_l
    tl.store(out_ptrs, out.to(Out.dtype.element_ty), mask=mask_l)
    tl.store(Lse + t * stride_lt + h * stride_lh, lse)
