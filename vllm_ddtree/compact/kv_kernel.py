# SPDX-License-Identifier: Apache-2.0
"""Triton KV compaction of the accepted tree paths (one launch per row layout for a
whole verify round, over every KV-cache group), with the PyTorch
``compact.reference.compact_kv_cache_`` as reference and CPU path.

After each verify step every target attention layer moves, per request, the KV rows
of the accepted path ``src_k -> dst_k`` (``compact.reference.compaction_slots``: flattened
``[R * L]`` int64 slots, request-major, ``-1`` where nothing moves, including
``src == dst``). The reference does that with ~18 small device ops per KV-cache group
to compute the slots and 12 per view to move the rows (argmax, any, 4 where, 3 index,
...); here one program per ``(request, column block of the row[, view])`` does it in
one memory round-trip:

1. get the request's ``L`` source / destination slots (a ``[BLOCK_L]`` vector): loaded
   from precomputed ``src, dst`` (:func:`compact_kv_rows_`, :func:`compact_kv_views_`)
   or computed from the walk and the view's group slot mapping
   (:func:`compact_kv_paths_`: ``slots[start + kv_src_rows[r, k]] ->
   slots[start + 1 + k]``);
2. gather the ``[BLOCK_L, BLOCK_C]`` tile ``rows[src_k, cols]`` into registers;
3. ``tl.debug_barrier()`` (a CTA barrier: every thread's loads are performed before
   any thread stores);
4. scatter the tile to ``rows[dst_k, cols]``.

So, as in the reference, all sources are read before any write, and the result does
not depend on the order of the moves. That matters: a destination can be another
move's source (``dst_k == src_j`` for some ``j < k``, e.g. accepted nodes 1, 2 at
depths 1, 2 move rows 2 -> 1 and 3 -> 2). Programs never race with each other:
different requests own different slots, different column blocks different elements,
and different views of one launch different caches or (KV-cache groups sharing one
storage tensor) disjoint blocks. (The path layout also makes a sequential
``k = 0, 1, ..`` order safe: a destination is only ever an *earlier* move's source,
never a later one; ``tests/test_kv_compaction_kernel.py`` checks that property on
random walks. The kernel does not rely on it.)

Rows are copied bit for bit: the view is reinterpreted as the widest integer dtype
its strides allow (bf16 ``[nb, bs, 576]`` -> int64 ``[nb, bs, 144]``), so any dtype (fp8
included) works and values are never converted. A row may be non-contiguous: after
dropping size-1 dims and merging adjacent dims, it must be at most ``num_chunks``
equally spaced contiguous chunks (``[num_chunks, chunk_len]`` with strides
``[chunk_stride, 1]``), or one strided run (``chunk_len == 1``). Other row layouts
fall back to ``compact_kv_cache_`` (see :func:`row_layout`). Views are ``[num_blocks,
page, *row]``: slot ``s`` is row ``s % page`` of block ``s // page``, and the block and
page strides are free, so vLLM's padded pages (a layer's page padded to the model's
largest, e.g. an MLA target beside a GQA drafter) need no flat slot view.

Entry points:

* :func:`compact_kv_rows_`: one ``[num_blocks, page, *row]`` view, one launch.
* :func:`compact_kv_views_`: many views sharing one ``src, dst`` (one KV-cache
  group): one launch per distinct row layout, through a cached int64 table of the
  views' base addresses (cast to pointers in-kernel).
* :func:`compact_kv_paths_`: a whole round, every group (``_compact_target_kv``):
  one launch per distinct row layout over all groups' views, through a cached table
  of (view address, its group's slot-mapping address); the slots are computed
  in-kernel from the walk, so no per-group device op runs at all.

All run Triton for CUDA tensors and the PyTorch reference for CPU tensors
(``use_triton``, from ``vllm_ddtree.triton_path``; tests monkeypatch it here to run the
kernels in Triton's interpreter). Launches are host-sync free, with shapes fixed by
the tensors' shapes (CUDA-graph safe once an address table exists: building it copies
to the device once, see :func:`compact_kv_views_`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from vllm_ddtree.compact.reference import compact_kv_cache_, compaction_slots
from vllm_ddtree.triton_path import use_triton

__all__ = [
    "RowLayout",
    "compact_kv_paths_",
    "compact_kv_rows_",
    "compact_kv_views_",
    "row_layout",
]

# Elements of one program's [BLOCK_L, BLOCK_C] tile: 4096 x 8 bytes over 4 warps is
# 64 registers per thread.
TILE_ELEMS = 4096
NUM_WARPS = 4
# Integer dtypes the rows are reinterpreted as, widest first.
_BIT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8)
_TL_DTYPES = {torch.int64: tl.int64, torch.int32: tl.int32, torch.int16: tl.int16,
              torch.int8: tl.int8}


@triton.jit
def _slot_offsets(slot, page, block_stride, slot_stride):
    """Element offset of slot ``slot`` (int64) in a ``[num_blocks, page, *row]`` view:
    block ``slot // page`` (a padded page makes ``block_stride > page * slot_stride``),
    row ``slot % page`` in it."""
    return (slot // page) * block_stride + (slot % page) * slot_stride


@triton.jit
def _move_rows(
    Rows, src, dst, page, block_stride, slot_stride, chunk_stride, chunk_len, row_elems,
    BLOCK_C: tl.constexpr, CONTIGUOUS: tl.constexpr,
):  # fmt: skip
    """Moves ``Rows[src_k] -> Rows[dst_k]`` (``[BLOCK_L]`` int64 slots, ``-1``: no move)
    for this program's column block: one tile, all loads before all stores."""
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    if CONTIGUOUS:
        elem = offs_c
    else:
        elem = (offs_c // chunk_len) * chunk_stride + offs_c % chunk_len
    mask = (src >= 0)[:, None] & (offs_c < row_elems)[None, :]
    src_offs = _slot_offsets(tl.maximum(src, 0), page, block_stride, slot_stride)
    dst_offs = _slot_offsets(tl.maximum(dst, 0), page, block_stride, slot_stride)
    tile = tl.load(Rows + src_offs[:, None] + elem[None, :], mask=mask)
    # Every source element is read before any destination is written: a destination
    # can be another move's source, held by another thread of this program.
    tl.debug_barrier()
    tl.store(Rows + dst_offs[:, None] + elem[None, :], tile, mask=mask)


@triton.jit
def _move_tile(
    Rows, Src, Dst, path_len, page, block_stride, slot_stride, chunk_stride, chunk_len,
    row_elems,
    BLOCK_L: tl.constexpr, BLOCK_C: tl.constexpr, CONTIGUOUS: tl.constexpr,
):  # fmt: skip
    """Program ``(request, column block)``: all of the request's moves, one tile."""
    req = tl.program_id(0)
    offs_l = tl.arange(0, BLOCK_L)
    in_path = offs_l < path_len
    first = req.to(tl.int64) * path_len
    src = tl.load(Src + first + offs_l, mask=in_path, other=-1).to(tl.int64)
    dst = tl.load(Dst + first + offs_l, mask=in_path, other=-1).to(tl.int64)
    _move_rows(Rows, src, dst, page, block_stride, slot_stride, chunk_stride, chunk_len,
               row_elems, BLOCK_C, CONTIGUOUS)


@triton.jit
def _compact_rows_kernel(
    Rows, Src, Dst, path_len, page, block_stride, slot_stride, chunk_stride, chunk_len,
    row_elems,
    BLOCK_L: tl.constexpr, BLOCK_C: tl.constexpr, CONTIGUOUS: tl.constexpr,
):  # fmt: skip
    """Grid ``(R, cdiv(row_elems, BLOCK_C))`` over one view ``Rows``."""
    _move_tile(Rows, Src, Dst, path_len, page, block_stride, slot_stride, chunk_stride,
               chunk_len, row_elems, BLOCK_L, BLOCK_C, CONTIGUOUS)


@triton.jit
def _compact_rows_table_kernel(
    Table, Src, Dst, path_len, page, block_stride, slot_stride, chunk_stride, chunk_len,
    row_elems,
    ELEM: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_C: tl.constexpr,
    CONTIGUOUS: tl.constexpr,
):  # fmt: skip
    """Grid ``(R, cdiv(row_elems, BLOCK_C), num_views)``: view ``program_id(2)`` has its
    base address at ``Table[program_id(2)]`` (int64) and elements of type ``ELEM``."""
    rows = tl.load(Table + tl.program_id(2)).to(tl.pointer_type(ELEM))
    _move_tile(rows, Src, Dst, path_len, page, block_stride, slot_stride, chunk_stride,
               chunk_len, row_elems, BLOCK_L, BLOCK_C, CONTIGUOUS)


@triton.jit(do_not_specialize=["num_tokens"])  # num_tokens_padded changes every step
def _compact_paths_kernel(
    Table, QueryStart, KvSrcRows, kv_stride_r, kv_stride_k, path_len, num_tokens,
    page, block_stride, slot_stride, chunk_stride, chunk_len, row_elems,
    ELEM: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_C: tl.constexpr,
    CONTIGUOUS: tl.constexpr,
):  # fmt: skip
    """Grid ``(R, cdiv(row_elems, BLOCK_C), num_views)``: the moves of request
    ``program_id(0)`` in view ``v = program_id(2)``, computed from the walk.

    ``Table[v, 0]`` is the view's base address (elements of type ``ELEM``),
    ``Table[v, 1]`` the address of its KV-cache group's int64 slot mapping (stride 1).
    Request ``r``'s rows are ``QueryStart[r] .. QueryStart[r+1]`` (capped at
    ``num_tokens``, the slot mappings' length); walk entry ``k`` (``KvSrcRows[r, k]``,
    request-local row, ``-1``: none) moves slot ``slots[start + row]`` to
    ``slots[start + 1 + k]``, as ``compact.reference.compaction_slots``. Entries outside the
    request's rows, with a negative slot or with ``src == dst`` move nothing, and their
    slots are never read.
    """
    req = tl.program_id(0)
    view = tl.program_id(2).to(tl.int64)
    rows = tl.load(Table + 2 * view).to(tl.pointer_type(ELEM))
    slots = tl.load(Table + 2 * view + 1).to(tl.pointer_type(tl.int64))
    start = tl.load(QueryStart + req).to(tl.int64)
    end = tl.minimum(tl.load(QueryStart + req + 1).to(tl.int64), num_tokens)
    offs_l = tl.arange(0, BLOCK_L)
    node = tl.load(KvSrcRows + req.to(tl.int64) * kv_stride_r + offs_l * kv_stride_k,
                   mask=offs_l < path_len, other=-1).to(tl.int64)
    src_row = start + node
    dst_row = start + 1 + offs_l
    valid = (node >= 0) & (src_row < end) & (dst_row < end)
    src = tl.load(slots + src_row, mask=valid, other=-1)
    dst = tl.load(slots + dst_row, mask=valid, other=-1)
    moving = valid & (src >= 0) & (dst >= 0) & (src != dst)
    _move_rows(rows, tl.where(moving, src, -1), tl.where(moving, dst, -1), page,
               block_stride, slot_stride, chunk_stride, chunk_len, row_elems, BLOCK_C,
               CONTIGUOUS)


@dataclass(frozen=True)
class RowLayout:
    """How one slot's row sits in memory, in elements of ``dtype`` (an integer dtype
    the view is reinterpreted as): slot ``s``'s element ``c`` (``0 <= c < row_elems``)
    is at ``(s // page) * block_stride + (s % page) * slot_stride
    + (c // chunk_len) * chunk_stride + c % chunk_len``."""

    dtype: torch.dtype
    page: int
    block_stride: int
    slot_stride: int
    num_chunks: int
    chunk_stride: int
    chunk_len: int

    @property
    def row_elems(self) -> int:
        return self.num_chunks * self.chunk_len

    @property
    def contiguous(self) -> bool:
        return self.num_chunks == 1


def _bit_view(pages: torch.Tensor) -> torch.Tensor | None:
    """``pages`` reinterpreted as the widest integer dtype that keeps its block and
    page dims (only the last row dim may change size), or None (e.g. complex
    dtypes)."""
    size = pages.element_size()
    for dtype in _BIT_DTYPES:
        itemsize = dtype.itemsize
        if itemsize < size or (itemsize > size and pages.dim() < 3):
            continue
        try:
            return pages.view(dtype)
        except RuntimeError:
            continue
    return None


def _coalesced_row_dims(view: torch.Tensor) -> list[tuple[int, int]]:
    """``(size, stride)`` of a row's dims (after block and page) without size-1 dims,
    adjacent dims merged where ``stride[i] == size[i+1] * stride[i+1]``."""
    dims: list[tuple[int, int]] = []
    for size, stride in zip(view.shape[2:], view.stride()[2:], strict=True):
        if size == 1:
            continue
        if dims and dims[-1][1] == size * stride:
            dims[-1] = (dims[-1][0] * size, stride)
        else:
            dims.append((size, stride))
    return dims


def row_layout(pages: torch.Tensor) -> tuple[torch.Tensor, RowLayout] | None:
    """The integer view and :class:`RowLayout` the kernels move ``pages`` (a
    ``[num_blocks, page, *row]`` view, ``speculator.kv_page_views``) with, or None when
    the row layout is not supported (callers use ``compact_kv_cache_``).

    Block and page strides are free (padded pages included: vLLM pads a layer's page
    to the largest page of the model, e.g. an MLA target beside a GQA drafter).
    Supported rows: those that coalesce to ``[n]`` (any stride) or ``[num_chunks,
    chunk_len]`` with strides ``[chunk_stride >= chunk_len, 1]``. This covers every
    view ``speculator.kv_page_views`` returns: MLA ``[nb, bs, 576]``, FlashAttention K
    / V ``[nb, bs, H, D]`` and the vLLM Triton / GQA ``[nb, bs, H, 2D]`` view made by
    a transpose (``H`` chunks when the heads are padded). Not supported: empty views,
    rows of 3+ non-mergeable dims, an inner dim with stride != 1 under a chunk dim,
    zero strides (expanded, aliasing rows).
    """
    if pages.dim() < 2 or pages.numel() == 0:
        return None
    view = _bit_view(pages)
    if view is None:
        return None
    dims = _coalesced_row_dims(view)
    if any(stride <= 0 for _, stride in dims) or min(view.stride()[:2]) <= 0:
        return None
    if not dims:
        num_chunks, chunk_stride, chunk_len = 1, 1, 1
    elif len(dims) == 1 and dims[0][1] == 1:
        num_chunks, chunk_stride, chunk_len = 1, dims[0][0], dims[0][0]
    elif len(dims) == 1:
        num_chunks, chunk_stride, chunk_len = dims[0][0], dims[0][1], 1
    elif len(dims) == 2 and dims[1][1] == 1 and dims[0][1] >= dims[1][0]:
        num_chunks, chunk_stride, chunk_len = dims[0][0], dims[0][1], dims[1][0]
    else:
        return None
    return view, RowLayout(view.dtype, view.shape[1], view.stride(0), view.stride(1),
                           num_chunks, chunk_stride, chunk_len)


def _check_slots(src_slots: torch.Tensor, dst_slots: torch.Tensor,
                 path_len: int | None) -> int:
    """Validates the move lists (host-side only); returns the path length L."""
    for name, t in (("src_slots", src_slots), ("dst_slots", dst_slots)):
        if t.dim() != 1 or t.dtype not in (torch.int64, torch.int32) or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous 1-D int64/int32 tensor, got "
                             f"{t.dtype} {tuple(t.shape)}")
    if src_slots.shape != dst_slots.shape or src_slots.device != dst_slots.device:
        raise ValueError(f"src_slots {tuple(src_slots.shape)} on {src_slots.device} and "
                         f"dst_slots {tuple(dst_slots.shape)} on {dst_slots.device} differ")
    numel = src_slots.shape[0]
    path_len = numel if path_len is None else path_len
    if (path_len < 1 and numel > 0) or (path_len > 0 and numel % path_len):
        raise ValueError(f"{numel} moves are not a whole number of paths of {path_len}")
    return path_len


@functools.lru_cache(maxsize=512)
def _launch_args(layout: RowLayout, num_moves: int, path_len: int):
    """Grid dims 0-1, the runtime layout args and the constexprs of one launch."""
    block_l = triton.next_power_of_2(path_len)
    block_c = min(triton.next_power_of_2(layout.row_elems), max(32, TILE_ELEMS // block_l))
    grid = (num_moves // path_len, triton.cdiv(layout.row_elems, block_c))
    args = (path_len, layout.page, layout.block_stride, layout.slot_stride,
            layout.chunk_stride, layout.chunk_len, layout.row_elems)
    consts = dict(BLOCK_L=block_l, BLOCK_C=block_c, CONTIGUOUS=layout.contiguous)
    return grid, args, consts


def compact_kv_rows_(cache_rows: torch.Tensor, src_slots: torch.Tensor,
                     dst_slots: torch.Tensor, path_len: int | None = None) -> None:
    """Move slot ``src`` -> slot ``dst`` for every pair with ``src >= 0``, as
    ``compact.reference.compact_kv_cache_`` does (all sources read before any write).

    Args:
        cache_rows: ``[num_blocks, page, *row]`` view of one layer's cache (slot ``s``
            is row ``s % page`` of block ``s // page``), any dtype (see
            :func:`row_layout` for the row strides the kernel takes; others fall
            back to ``compact_kv_cache_``). Modified in place.
        src_slots, dst_slots: int64 (or int32) ``[R * L]``, request-major as
            ``compact.reference.compaction_slots`` returns them; ``-1`` where nothing
            moves. Destinations must be distinct and valid wherever ``src >= 0``,
            and moves of different requests must touch different slots.
        path_len: L, moves per request (``kv_src_rows.shape[1]``). One program per
            request moves its L rows; None treats all moves as one request (correct,
            less parallel).

    One Triton launch where :func:`use_triton`; ``compact_kv_cache_`` otherwise. No moves at all
    (``R * L == 0``): nothing runs.
    """
    path_len = _check_slots(src_slots, dst_slots, path_len)
    if src_slots.shape[0] == 0:
        return
    found = row_layout(cache_rows) if use_triton(cache_rows) else None
    if found is None:
        compact_kv_cache_(cache_rows, src_slots, dst_slots)
        return
    view, layout = found
    grid, args, consts = _launch_args(layout, src_slots.shape[0], path_len)
    _compact_rows_kernel[grid](view, src_slots, dst_slots, *args, **consts,
                               num_warps=NUM_WARPS)


@dataclass
class _Plan:
    """Launches of one view group: per row layout, the table of base addresses (int64
    ``[num_views]`` on the views' device) and, for CUDA, its pinned host source;
    views with unsupported rows are listed in ``fallback``."""

    launches: list[tuple[RowLayout, torch.Tensor, torch.Tensor | None]]
    fallback: list[int]


# Cached plans of view groups (compact_kv_views_), by the views' addresses, shapes,
# strides, dtypes and device. Bounded: cleared when full.
_MAX_PLANS = 64
_PLANS: dict[tuple, _Plan] = {}


def _interpreted() -> bool:
    return type(_compact_rows_table_kernel).__name__ == "InterpretedFunction"


def _plan_key(views: list[torch.Tensor]) -> tuple:
    return tuple((v.data_ptr(), v.shape, v.stride(), v.dtype, v.device) for v in views)


def _build_plan(views: list[torch.Tensor]) -> _Plan:
    by_layout: dict[RowLayout, list[int]] = {}
    fallback = []
    for i, v in enumerate(views):
        found = row_layout(v)
        if found is None:
            fallback.append(i)
        else:
            by_layout.setdefault(found[1], []).append(found[0].data_ptr())
    device = views[0].device
    launches = []
    for layout, addresses in by_layout.items():
        host = torch.tensor(addresses, dtype=torch.int64)
        if device.type == "cuda":
            # Pinned + non_blocking: no host sync (once per view group); the host
            # tensor stays referenced by the plan until long after the copy ran.
            host = host.pin_memory()
            launches.append((layout, host.to(device, non_blocking=True), host))
        else:
            launches.append((layout, host.to(device), None))
    return _Plan(launches, fallback)


def _cached_plan(key: tuple, build):
    """The launch plan cached under ``key`` (views' addresses and layouts), built by
    ``build()`` on a miss; the cache is bounded and holds only small address tables,
    never a KV cache."""
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        plan = _PLANS[key] = build()
    return plan


def compact_kv_views_(views: list[torch.Tensor], src_slots: torch.Tensor,
                      dst_slots: torch.Tensor, path_len: int) -> None:
    """:func:`compact_kv_rows_` on every view of ``views`` (same moves for all: e.g.
    every target layer of one KV-cache group), one Triton launch per distinct
    :class:`RowLayout` instead of one per view.

    Args:
        views: ``[num_blocks, page, *row]`` views of distinct, non-overlapping caches on
            one device (``speculator.kv_page_views`` of each deduplicated layer cache).
        src_slots, dst_slots, path_len: as in :func:`compact_kv_rows_`.

    The launch reads each view's base address from an int64 table (cast to a pointer
    in-kernel). The table is built once per view group (keyed by the views'
    addresses, shapes, strides, dtypes, device) with a pinned non-blocking copy, and
    reused while the caches stay where they are: no host sync, fixed shapes. Views
    whose rows :func:`row_layout` rejects use ``compact_kv_cache_``. On CPU (or when
    :func:`use_triton` says no) every view uses ``compact_kv_cache_``.
    """
    path_len = _check_slots(src_slots, dst_slots, path_len)
    if not views or src_slots.shape[0] == 0:
        return
    if not use_triton(views[0]):
        for v in views:
            compact_kv_cache_(v, src_slots, dst_slots)
        return
    if len(views) == 1 or (_interpreted() and views[0].device.type != "cpu"):
        # A table of device addresses is unreadable to the interpreter.
        for v in views:
            compact_kv_rows_(v, src_slots, dst_slots, path_len)
        return
    plan = _cached_plan(_plan_key(views), lambda: _build_plan(views))
    for i in plan.fallback:
        compact_kv_cache_(views[i], src_slots, dst_slots)
    for layout, table, _ in plan.launches:
        grid, args, consts = _launch_args(layout, src_slots.shape[0], path_len)
        _compact_rows_table_kernel[(*grid, table.shape[0])](
            table, src_slots, dst_slots, *args, ELEM=_TL_DTYPES[layout.dtype], **consts,
            num_warps=NUM_WARPS)


# ----------------------------------------------------------------------------------
# Whole round: every KV-cache group, slots computed in-kernel from the walk
# ----------------------------------------------------------------------------------

# Grid dim 2 (views of one launch) is limited to 65535 on CUDA.
_MAX_VIEWS_PER_LAUNCH = 65535


def _device_table(values: list[int], device: torch.device, shape: tuple[int, ...]):
    """``(device table, pinned host source or None)`` of int64 ``values``: on CUDA a
    pinned non-blocking copy (no host sync); the plan keeps the host tensor alive."""
    host = torch.tensor(values, dtype=torch.int64).view(shape)
    if device.type == "cuda":
        host = host.pin_memory()
        return host.to(device, non_blocking=True), host
    return host.to(device), None


def _padded_compaction_slots(slot_mapping: torch.Tensor, query_start_loc: torch.Tensor,
                             kv_src_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``speculator.path_compaction_slots`` (kept here: speculator imports this module):
    ``compaction_slots`` on the slot mapping padded by ``L + 1`` entries, so a short last
    request's masked columns never index past it."""
    slot_mapping = slot_mapping.to(torch.int64)  # no-op for vLLM's int64 slots
    pad = slot_mapping.new_full((kv_src_rows.shape[1] + 1,), -1)
    return compaction_slots(torch.cat([slot_mapping, pad]), query_start_loc, kv_src_rows)


def _slots_in_kernel(slot_mapping: torch.Tensor, view: torch.Tensor) -> bool:
    """Whether the kernel can read ``slot_mapping`` through a bare int64 pointer."""
    return (slot_mapping.dim() == 1 and slot_mapping.dtype == torch.int64
            and slot_mapping.stride(0) == 1 and slot_mapping.device == view.device)


def _unique_views(groups) -> dict[int, list[int]]:
    """``{group: [view index]}`` without repeats of one (slot mapping, view) pair: the
    same view twice with the same moves would move already-moved rows (or race)."""
    seen = set()
    unique: dict[int, list[int]] = {}
    for g, (slot_mapping, views) in enumerate(groups):
        for i, v in enumerate(views):
            ident = (slot_mapping.data_ptr(), v.data_ptr(), v.shape, v.stride(), v.dtype)
            if ident not in seen:
                seen.add(ident)
                unique.setdefault(g, []).append(i)
    return unique


@dataclass
class _PathPlan:
    """Launches of :func:`compact_kv_paths_`: per row layout (and chunk of at most
    ``_MAX_VIEWS_PER_LAUNCH`` views), an int64 ``[num_views, 2]`` table of (view base
    address, its group's slot-mapping address) on the views' device and, for CUDA, its
    pinned host source; ``fallback``: ``{group: [view index]}`` of views the kernel
    does not take (row layout, or a slot mapping that is not a stride-1 int64 row)."""

    launches: list[tuple[RowLayout, torch.Tensor, torch.Tensor | None]]
    fallback: dict[int, list[int]]


def _path_plan_key(groups, views_keys: tuple | None = None) -> tuple:
    """Slot mappings by address, dtype and stride, not length: vLLM's are rows of one
    persistent buffer sliced to each step's ``num_tokens_padded``. ``views_keys``: the
    groups' ``_plan_key`` of their views, when the caller keeps them
    (:class:`PathCompactor`)."""
    if views_keys is None:
        views_keys = tuple(_plan_key(views) for _, views in groups)
    return ("paths", tuple(
        (sm.data_ptr(), sm.dtype, sm.stride(), sm.device, views_key)
        for (sm, _), views_key in zip(groups, views_keys, strict=True)))


def _build_path_plan(groups) -> _PathPlan:
    by_layout: dict[RowLayout, list[int]] = {}
    fallback: dict[int, list[int]] = {}
    device = None
    for g, indices in _unique_views(groups).items():
        slot_mapping, views = groups[g]
        for i in indices:
            v = views[i]
            device = v.device
            found = row_layout(v) if _slots_in_kernel(slot_mapping, v) else None
            if found is None:
                fallback.setdefault(g, []).append(i)
            else:
                by_layout.setdefault(found[1], []).extend(
                    (found[0].data_ptr(), slot_mapping.data_ptr()))
    launches = []
    for layout, addresses in by_layout.items():
        step = 2 * _MAX_VIEWS_PER_LAUNCH
        for first in range(0, len(addresses), step):
            chunk = addresses[first : first + step]
            launches.append((layout, *_device_table(chunk, device, (len(chunk) // 2, 2))))
    return _PathPlan(launches, fallback)


def _check_walk(query_start_loc: torch.Tensor, kv_src_rows: torch.Tensor) -> None:
    """Validates the walk arguments (host-side only)."""
    if kv_src_rows.dim() != 2 or kv_src_rows.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"kv_src_rows must be a 2-D int64/int32 tensor, got "
                         f"{kv_src_rows.dtype} {tuple(kv_src_rows.shape)}")
    if (query_start_loc.dim() != 1 or query_start_loc.dtype not in (torch.int64, torch.int32)
            or query_start_loc.shape[0] < kv_src_rows.shape[0] + 1
            or query_start_loc.device != kv_src_rows.device):
        raise ValueError(f"query_start_loc must be a 1-D int32/int64 tensor of at least "
                         f"R + 1 = {kv_src_rows.shape[0] + 1} entries on "
                         f"{kv_src_rows.device}, got {query_start_loc.dtype} "
                         f"{tuple(query_start_loc.shape)} on {query_start_loc.device}")


def compact_kv_paths_(groups, query_start_loc: torch.Tensor,
                      kv_src_rows: torch.Tensor, views_keys: tuple | None = None) -> None:
    """One verify round's KV compaction in every KV-cache group: for each
    ``(slot_mapping, views)`` of ``groups``, moves the accepted path of every request
    in every view, as ``compact_kv_cache_(view, *path_compaction_slots(slot_mapping,
    query_start_loc, kv_src_rows))`` does, in one Triton launch per distinct
    :class:`RowLayout` (over all groups).

    Args:
        groups: ``(slot_mapping, views)`` pairs, one per KV-cache group:
            ``slot_mapping`` int64 ``[num_tokens]`` (the group's verify-batch slots,
            ``slot_mappings[layer]`` of ``propose``), ``views`` the ``[num_blocks,
            page, *row]`` views (``speculator.kv_page_views``) of the group's distinct
            caches. Groups may share storage (vLLM gives groups disjoint blocks of
            one tensor); a (slot mapping, view) pair given twice is moved once.
        query_start_loc: int32/int64 ``[>= R+1]``, request ``r``'s verify rows are
            ``query_start_loc[r] .. query_start_loc[r+1]``.
        kv_src_rows: int64/int32 ``[R, L]``, the walk (``runtime_state.take_walk``):
            request-local row of accepted node ``k``, ``-1``: none; it moves to local
            row ``k + 1``.

    Each program ``(request, column block, view)`` reads the request's ``L`` walk
    entries, its group's source / destination slots (only for valid entries, inside
    the request's rows) and moves the rows (all loads, barrier, all stores). The table
    of (view, slot-mapping) addresses is built once per set of addresses (a pinned
    non-blocking copy; vLLM's slot mappings are persistent buffer rows) and reused:
    no host sync, no other device op, fixed shapes. Views the kernel does not take
    (:func:`row_layout`, or a slot mapping that is not a stride-1 int64 row) use
    ``compact_kv_cache_`` with their group's slots. On CPU (``use_triton`` false)
    every group uses the PyTorch reference.
    """
    _check_walk(query_start_loc, kv_src_rows)
    if views_keys is None:
        groups = [(slot_mapping, list(views)) for slot_mapping, views in groups]
    num_reqs, path_len = kv_src_rows.shape
    views = [v for _, vs in groups for v in vs]
    if num_reqs == 0 or path_len == 0 or not views:
        return
    if not use_triton(views[0]) or (_interpreted() and views[0].device.type != "cpu"):
        # The PyTorch reference (CPU), or per-view launches (an address table of device
        # memory is unreadable to the interpreter).
        for g, indices in _unique_views(groups).items():
            slot_mapping, group_views = groups[g]
            src, dst = _padded_compaction_slots(slot_mapping, query_start_loc, kv_src_rows)
            compact_kv_views_([group_views[i] for i in indices], src, dst, path_len)
        return
    plan = _cached_plan(_path_plan_key(groups, views_keys), lambda: _build_path_plan(groups))
    for g, indices in plan.fallback.items():
        slot_mapping, group_views = groups[g]
        src, dst = _padded_compaction_slots(slot_mapping, query_start_loc, kv_src_rows)
        for i in indices:
            compact_kv_cache_(group_views[i], src, dst)
    if not plan.launches:
        return
    # vLLM's groups all have the batch's num_tokens_padded rows; the cap only guards
    # against a query_start_loc past a slot mapping's end.
    num_tokens = min(sm.shape[0] for sm, _ in groups)
    for layout, table, _ in plan.launches:
        grid, args, consts = _launch_args(layout, num_reqs * path_len, path_len)
        _compact_paths_kernel[(*grid, table.shape[0])](
            table, query_start_loc, kv_src_rows, kv_src_rows.stride(0), kv_src_rows.stride(1),
            path_len, num_tokens, *args[1:], ELEM=_TL_DTYPES[layout.dtype], **consts,
            num_warps=NUM_WARPS)


class PathCompactor:
    """:func:`compact_kv_paths_` over fixed views (a speculator's target layers, whose
    caches vLLM allocates once): the views' part of the plan key is computed here, once,
    so a round only keys the groups' slot mappings before its launches.

    Args:
        views_by_group: per KV-cache group, the ``[num_blocks, page, *row]`` views of
            its distinct caches (``speculator.kv_page_views``).
    """

    def __init__(self, views_by_group: list[list[torch.Tensor]]) -> None:
        self.views_by_group = [list(views) for views in views_by_group]
        self._views_keys = tuple(_plan_key(views) for views in self.views_by_group)

    def __call__(self, slot_mappings: list[torch.Tensor], query_start_loc: torch.Tensor,
                 kv_src_rows: torch.Tensor) -> None:
        """One round: ``slot_mappings[g]`` int64 ``[num_tokens]`` is group ``g``'s
        verify-batch slot mapping; the other arguments as in :func:`compact_kv_paths_`."""
        groups = list(zip(slot_mappings, self.views_by_group, strict=True))
        compact_kv_paths_(groups, query_start_loc, kv_src_rows, views_keys=self._views_keys)
