# SPDX-License-Identifier: Apache-2.0
"""Triton KV compaction (``vllm_ddtree.compact.kv_kernel``) vs its PyTorch reference
``compact.reference.compact_kv_cache_``, on moves built by the real ``compaction_slots`` /
``path_compaction_slots`` from random trees and walks, in every cache layout
``speculator.kv_page_views`` knows; the path-order property of the moves; and
``DDTreeSpeculator._compact_target_kv`` on the Triton path.

Without a GPU the kernels run in Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1); ``use_triton`` is forced so CPU tensors take the kernel path.
"""

import random
import textwrap
from types import SimpleNamespace as NS

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

triton = pytest.importorskip("triton")

from kernel_testing import (  # noqa: E402
    DEVICE,
    compiled_shared_memory,  # runs a compile script, returns its JSON line
    skip_unless_kernels_run_here,
)
from kv_compaction_testing import (  # noqa: E402
    BUDGET,
    DEPTHS,
    HEAD_DIM,
    HEADS,
    LAYOUTS,
    Counted,
    bits,
    make_batch,
    on_device,
    paged_slots,
    random_physical,
    reference_views,
)

from vllm_ddtree.compact import kv_kernel as kck  # noqa: E402
from vllm_ddtree.compact.reference import compact_kv_cache_, compaction_slots  # noqa: E402
from vllm_ddtree.draft.speculator import (  # noqa: E402
    DDTreeSpeculator,
    kv_page_views,
    path_compaction_slots,
)
from vllm_ddtree.tree.draft_tree import DraftTree  # noqa: E402
from vllm_ddtree.walk.follow import follow_tree  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    skip_unless_kernels_run_here(kck._compact_rows_kernel, kck._compact_rows_table_kernel,
                                 kck._compact_paths_kernel),
]



# ----------------------------------------------------------------------------------
# Launch counting, forced Triton path
# ----------------------------------------------------------------------------------


@pytest.fixture
def launches(monkeypatch):
    """Forces the Triton path and counts launches and reference fallbacks."""
    single = Counted(kck._compact_rows_kernel)
    table = Counted(kck._compact_rows_table_kernel)
    paths = Counted(kck._compact_paths_kernel)
    fallbacks = []

    def counted_reference(rows, src, dst):
        fallbacks.append(tuple(rows.shape))
        compact_kv_cache_(rows, src, dst)

    monkeypatch.setattr(kck, "use_triton", lambda rows: True)
    monkeypatch.setattr(kck, "_compact_rows_kernel", single)
    monkeypatch.setattr(kck, "_compact_rows_table_kernel", table)
    monkeypatch.setattr(kck, "_compact_paths_kernel", paths)
    monkeypatch.setattr(kck, "compact_kv_cache_", counted_reference)
    monkeypatch.setattr(kck, "_PLANS", {})
    return NS(single=single.grids, table=table.grids, paths=paths.grids, fallbacks=fallbacks)


# ----------------------------------------------------------------------------------
# Kernel vs reference
# ----------------------------------------------------------------------------------

KINDS = ["tree", "prefill", "tree", "chain", "tree", "tree", "decode"]

CASES = [
    ("mla", torch.bfloat16), ("mla", torch.float32), ("mla", torch.float8_e4m3fn),
    ("mla_padded", torch.bfloat16), ("mla_page_padded", torch.bfloat16),
    ("mla_page_padded", torch.float8_e4m3fn), ("flash", torch.bfloat16), ("flash", torch.float32),
    # vLLM allocates --kv-cache-dtype fp8 caches as uint8 (viewed as e4m3 for attention)
    ("mla", torch.uint8), ("flash", torch.uint8),
    ("gqa", torch.bfloat16), ("gqa_padded", torch.float32), ("gqa_padded", torch.bfloat16),
]


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("layout,dtype", CASES)
def test_kernels_match_the_reference(layout, dtype, page_size, launches):
    batch = make_batch(KINDS, page_size, seed=sum(map(ord, layout)) + page_size,
                       depths=[DEPTHS, None, 0, None, 1, 2, None])
    assert (batch.src >= 0).any() and (batch.src < 0).any()
    shape, logical = LAYOUTS[layout]
    gen = torch.Generator().manual_seed(1)
    physical = random_physical(shape(batch.num_blocks, page_size), dtype, gen)
    src, dst = on_device(batch)

    want = physical.clone()
    for rows in reference_views(kv_page_views(logical(want))):
        compact_kv_cache_(rows, src, dst)
    assert not torch.equal(bits(want), bits(physical))  # something moved

    views = kv_page_views(logical(physical))
    single = physical.clone()
    for rows in kv_page_views(logical(single)):
        kck.compact_kv_rows_(rows, src, dst, DEPTHS)
    assert torch.equal(bits(single), bits(want))  # padding included
    assert len(launches.single) == len(views) and not launches.fallbacks
    assert launches.single[0] == (len(KINDS), 1)  # one program per request

    grouped = physical.clone()
    kck.compact_kv_views_(kv_page_views(logical(grouped)), src, dst, DEPTHS)
    assert torch.equal(bits(grouped), bits(want))
    if len(views) > 1:  # flash K and V: one launch through the address table
        assert launches.table == [(len(KINDS), 1, 2)]


def test_all_views_of_a_group_in_one_launch_per_row_layout(launches):
    batch = make_batch(KINDS, 16, seed=3)
    src, dst = on_device(batch)
    gen = torch.Generator().manual_seed(2)
    caches = [LAYOUTS[name][1](random_physical(LAYOUTS[name][0](batch.num_blocks, 16),
                                               torch.bfloat16, gen))
              for name in ("mla", "mla", "mla", "flash", "gqa_padded", "mla_padded")]
    # a row layout the kernel does not take (inner stride != 1): the reference moves it
    odd = torch.randn(batch.num_blocks * 16, HEAD_DIM, HEADS, generator=gen).to(DEVICE)
    odd = odd.transpose(1, 2).unsqueeze(1)  # pages of one slot
    assert kck.row_layout(odd) is None
    views = [v for c in caches for v in kv_page_views(c)] + [odd]
    want = [v.clone() for v in views]
    for v in want:
        compact_kv_cache_(v, src, dst)
    for _ in range(2):  # the second round reuses the cached address tables
        kck.compact_kv_views_(views, src, dst, DEPTHS)
        for i in range(len(views)):
            compact_kv_cache_(want[i], src, dst)
    for v, w in zip(views, want, strict=True):
        assert torch.equal(bits(v), bits(w))
    # layouts: MLA x3, flash K+V, gqa_padded, mla_padded -> 4 launches a round
    assert sorted(g[2] for g in launches.table) == [1, 1, 1, 1, 2, 2, 3, 3]
    assert len(kck._PLANS) == 1
    assert launches.fallbacks == [tuple(odd.shape)] * 2


def test_moves_that_overlap_and_moves_in_place(launches):
    # accepted nodes 1, 2, 3 of a chain hanging off the root's second child: rows
    # 2 -> 1, 3 -> 2, 4 -> 3, each destination the previous move's source
    parents = torch.tensor([[-1, -1, 1, 2, 0], [-1, 0, 1, 2, 3]])
    depths = torch.tensor([[1, 1, 2, 3, 2], [1, 2, 3, 4, 5]])
    tokens = torch.tensor([[0, 1, 2, 3, 4], [0, 1, 2, 3, 4]])
    tree = DraftTree(tokens, parents, depths, torch.zeros(2, 5))
    targets = torch.tensor([[1, 9, 2, 3, 9, 9], [0, 1, 2, 9, 9, 9]])
    walk = follow_tree(tree, targets, max_depth=5)
    assert walk.kv_src_rows.tolist() == [[2, 3, 4, -1, -1], [1, 2, 3, -1, -1]]
    qsl = torch.tensor([0, 6, 12], dtype=torch.int32)
    slots = torch.tensor([40, 41, 42, 43, 44, 45, 7, 8, 9, 10, 11, 12])
    src, dst = compaction_slots(slots, qsl, walk.kv_src_rows)
    assert src.tolist() == [42, 43, 44, -1, -1] + [-1] * 5  # request 1: all in place
    assert dst.tolist() == [41, 42, 43, -1, -1] + [-1] * 5
    cache = torch.arange(64 * 3, dtype=torch.float32).view(64, 3).to(DEVICE)
    want = cache.clone()
    want[41:44] = cache[42:45]
    kck.compact_kv_rows_(cache.unsqueeze(1), src.to(DEVICE), dst.to(DEVICE), 5)
    assert torch.equal(cache, want)

    # a source that is an earlier move's destination (no path does this): still the
    # reference's all-reads-first result, whatever the order of the moves
    for order in ([3, 1, -1], [1, 3, -1]):
        moves = torch.tensor(order, device=DEVICE), torch.tensor(
            [{3: 1, 1: 2, -1: -1}[s] for s in order], device=DEVICE)
        got = torch.arange(10.0, device=DEVICE)[:, None].repeat(1, 4)
        want = got.clone()
        compact_kv_cache_(want.unsqueeze(1), *moves)
        kck.compact_kv_rows_(got.unsqueeze(1), *moves)  # path_len None: one sequence
        assert torch.equal(got, want) and got[:, 0].tolist() == [0, 3, 1, 3, 4, 5, 6, 7, 8, 9]
    nothing = torch.arange(10.0, device=DEVICE)[:, None]
    kck.compact_kv_rows_(nothing.unsqueeze(1), torch.full((4,), -1, device=DEVICE),
                         torch.full((4,), -1, device=DEVICE), 2)
    assert nothing[:, 0].tolist() == list(range(10))


def test_row_layouts():
    def layout(t):
        return kck.row_layout(t)[1]

    mla = torch.zeros(8, 16, 576, dtype=torch.bfloat16)
    assert layout(mla) == kck.RowLayout(torch.int64, 16, 16 * 144, 144, 1, 144, 144)
    # a padded page: blocks 16 * 576 + 96 bf16 elements apart
    paged = torch.zeros(8, 16 * 576 + 96, dtype=torch.bfloat16)[:, :-96].view(8, 16, 576)
    view, got = kck.row_layout(paged)
    assert got == kck.RowLayout(torch.int64, 16, (16 * 576 + 96) // 4, 144, 1, 144, 144)
    assert view.data_ptr() == paged.data_ptr()
    padded = torch.zeros(8, 1, 2, 40)[..., :32]  # fp32 rows of 2 chunks of 32
    view, got = kck.row_layout(padded)
    assert got == kck.RowLayout(torch.int64, 1, 40, 40, 2, 20, 16)
    assert view.data_ptr() == padded.data_ptr()
    strided = torch.zeros(8, 1, 6, dtype=torch.float16)[..., ::2]  # one strided run
    assert layout(strided) == kck.RowLayout(torch.int16, 1, 6, 6, 3, 2, 1)
    assert layout(torch.zeros(8, 1)) == kck.RowLayout(torch.int32, 1, 1, 1, 1, 1, 1)
    assert layout(torch.zeros(8, 1, 1, 3, dtype=torch.bfloat16)).dtype == torch.int16
    assert kck.row_layout(torch.zeros(8, 1, 4, 5).transpose(2, 3)) is None  # inner stride 4
    assert kck.row_layout(torch.zeros(8, 1, 1).expand(8, 1, 4)) is None  # aliasing elements
    assert kck.row_layout(torch.zeros(8, 1, 2, 3, 4)[:, :, :, :2, :3]) is None  # 3 dims
    chunked = torch.zeros(8, 1, 2, 3, 4)[:, :, :, :2, :]  # the last two dims merge
    assert layout(chunked) == kck.RowLayout(torch.int64, 1, 12, 12, 2, 6, 4)
    assert kck.row_layout(torch.zeros(0, 1, 4)) is None
    assert kck.row_layout(torch.zeros(8)) is None  # no page dim


def test_fallback_layouts_and_bad_arguments(launches):
    gen = torch.Generator().manual_seed(4)
    odd = torch.randn(32, 4, 5, generator=gen).to(DEVICE).transpose(1, 2).unsqueeze(1)
    want = odd.clone()
    src, dst = torch.tensor([5, -1, 9], device=DEVICE), torch.tensor([1, -1, 2], device=DEVICE)
    compact_kv_cache_(want, src, dst)
    kck.compact_kv_rows_(odd, src, dst, 3)
    assert torch.equal(odd, want) and launches.fallbacks == [(32, 1, 5, 4)]
    assert not launches.single
    empty = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    kck.compact_kv_rows_(want, empty, empty, DEPTHS)  # no request: nothing runs
    kck.compact_kv_views_([want, odd], empty, empty, DEPTHS)
    assert torch.equal(odd, want) and len(launches.fallbacks) == 1
    with pytest.raises(ValueError, match="whole number"):
        kck.compact_kv_rows_(want, src, dst, 2)
    with pytest.raises(ValueError, match="differ"):
        kck.compact_kv_rows_(want, src, dst[:2], 1)
    with pytest.raises(ValueError, match="1-D"):
        kck.compact_kv_rows_(want, src.view(1, 3), dst.view(1, 3), 3)
    with pytest.raises(ValueError, match="1-D"):
        kck.compact_kv_rows_(want, src.float(), dst.float(), 3)


class NoLaunch:
    def __getitem__(self, grid):
        raise AssertionError("launched a kernel for CPU tensors")


def test_cpu_path_is_the_reference(monkeypatch):
    """Without ``use_triton`` (CPU tensors) nothing launches: the reference runs."""
    monkeypatch.setattr(kck, "_compact_rows_kernel", NoLaunch())
    monkeypatch.setattr(kck, "_compact_rows_table_kernel", NoLaunch())
    monkeypatch.setattr(kck, "_compact_paths_kernel", NoLaunch())
    batch = make_batch(KINDS, 4, seed=5)
    caches = [torch.randn(batch.num_blocks, 4, 8) for _ in range(4)]
    want = [c.clone() for c in caches]
    for w in want:
        compact_kv_cache_(w, batch.src, batch.dst)
    kck.compact_kv_views_(caches[:2], batch.src, batch.dst, DEPTHS)
    kck.compact_kv_rows_(caches[2], batch.src, batch.dst, DEPTHS)
    kck.compact_kv_paths_([(batch.slots, caches[3:])], batch.qsl, batch.kv_src_rows)
    assert all(torch.equal(c, w) for c, w in zip(caches, want, strict=True))
    assert not torch.equal(caches[0], torch.zeros_like(caches[0]))


# ----------------------------------------------------------------------------------
# The path order of the moves (what makes a sequential k = 0, 1, .. kernel safe)
# ----------------------------------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("seed", range(8))
def test_a_destination_is_only_an_earlier_moves_source(seed, page_size):
    rng = random.Random(seed)
    kinds = [rng.choice(["tree", "tree", "tree", "chain", "prefill", "decode"])
             for _ in range(rng.randint(1, 7))]
    batch = make_batch(kinds, page_size, seed=100 + seed)
    num_reqs = len(kinds)
    src = batch.src.view(num_reqs, DEPTHS).tolist()
    dst = batch.dst.view(num_reqs, DEPTHS).tolist()
    rows = batch.kv_src_rows.tolist()
    owned = []
    for r in range(num_reqs):
        path = [n for n in rows[r] if n >= 0]
        # node indices increase along the path and node k sits at row >= k + 1
        assert path == sorted(set(path)) and all(n >= k + 1 for k, n in enumerate(path))
        if kinds[r] == "chain":
            assert src[r] == [-1] * DEPTHS  # every row already in place
        pairs = [(k, s, d) for k, (s, d) in enumerate(zip(src[r], dst[r], strict=True))
                 if s >= 0]
        assert all(d >= 0 and s != d for _, s, d in pairs)
        assert len({d for _, _, d in pairs}) == len(pairs)
        for k, _, d in pairs:
            for j, s, _ in pairs:
                if s == d:
                    assert j < k, (r, j, k)
        owned.append({s for _, s, _ in pairs} | {d for _, _, d in pairs})
        # so moving k = 0, 1, .. one at a time gives the reference's result
        cache = torch.arange(int(batch.slots.max()) + 1, dtype=torch.float32)[:, None]
        want = cache.clone()
        compact_kv_cache_(want.unsqueeze(1), torch.tensor(src[r]), torch.tensor(dst[r]))
        for _, s, d in pairs:
            cache[d] = cache[s]
        assert torch.equal(cache, want)
    for a in range(num_reqs):  # different requests never share a slot
        for b in range(a):
            assert not owned[a] & owned[b]


# ----------------------------------------------------------------------------------
# DDTreeSpeculator._compact_target_kv on the Triton path
# ----------------------------------------------------------------------------------


def test_speculator_compacts_every_group_with_the_kernels(launches, monkeypatch):
    """Three KV-cache groups: group 0 has MLA layers t.0, t.1 and t.2 (t.2 shares t.0's
    cache: skipped); group 1 has t.3 (same storage as t.0, the group's own blocks) and
    a FlashAttention layer t.4; group 2 one padded GQA layer. Same result as the
    PyTorch path, with one launch per row layout for all groups."""
    page = 4
    batch = make_batch(KINDS, page, seed=6)
    num_groups, num_blocks = 3, 3 * batch.num_blocks
    gen = torch.Generator().manual_seed(7)
    slot_mappings = {}
    pool = torch.randperm(num_blocks, generator=gen)
    for g in range(num_groups):  # the batch's slots, on each group's own blocks
        own = pool[g * batch.num_blocks : (g + 1) * batch.num_blocks]
        slot_mappings[g] = (own[batch.slots // page] * page + batch.slots % page).to(DEVICE)

    def physical_tensors():
        g = torch.Generator().manual_seed(8)
        return {
            "mla0": random_physical((num_blocks, page, 576), torch.bfloat16, g),
            "mla1": random_physical((num_blocks, page, 576), torch.bfloat16, g),
            "flash": random_physical(LAYOUTS["flash"][0](num_blocks, page), torch.bfloat16, g),
            "gqa": random_physical(LAYOUTS["gqa_padded"][0](num_blocks, page), torch.float32,
                                   g),
        }

    layers = {"t.0": ("mla0", 0), "t.1": ("mla1", 0), "t.2": ("mla0", 0),
              "t.3": ("mla0", 1), "t.4": ("flash", 1), "t.5": ("gqa", 2)}
    logical = {"mla0": lambda p: p, "mla1": lambda p: p, "flash": lambda p: p,
               "gqa": LAYOUTS["gqa_padded"][1]}

    def run(triton_path: bool):
        physical = physical_tensors()
        caches = {name: logical[key](physical[key]) for name, (key, _) in layers.items()}
        spec = DDTreeSpeculator.__new__(DDTreeSpeculator)
        spec._target_layers_by_group = {
            g: [name for name, (_, group) in layers.items() if group == g]
            for g in range(num_groups)}
        spec.vllm_config = NS(compilation_config=NS(static_forward_context={
            name: NS(kv_cache=cache) for name, cache in caches.items()}))
        with monkeypatch.context() as m:
            if not triton_path:
                m.setattr(kck, "use_triton", lambda rows: False)
            spec._compact_target_kv(
                {name: slot_mappings[g] for name, (_, g) in layers.items()},
                batch.qsl.to(DEVICE), batch.kv_src_rows.to(DEVICE))
        return physical

    before, want = physical_tensors(), run(False)
    assert not launches.single and not launches.table
    launches.fallbacks.clear()  # the PyTorch path: every view through the reference
    got = run(True)
    for key in want:
        assert not torch.equal(want[key], before[key]), key
        assert torch.equal(bits(got[key]), bits(want[key])), key
    # one launch per row layout over the groups: bf16 MLA t.0, t.1, t.3; flash K+V; GQA
    assert sorted(g[2] for g in launches.paths) == [1, 2, 3]
    assert not launches.single and not launches.table and not launches.fallbacks


# ----------------------------------------------------------------------------------
# A whole round, every KV-cache group: compact_kv_paths_ (slots computed in-kernel)
# ----------------------------------------------------------------------------------

PAD_SLOT_ID = -1  # vLLM's slot of padded token rows


class OpCounter(TorchDispatchMode):
    """Records the aten ops dispatched outside kernel launches (``paused``)."""

    def __init__(self):
        super().__init__()
        self.ops, self.paused = [], False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def pause_during_launches(monkeypatch, counter: OpCounter):
    """Kernel launches (the interpreter runs them with torch ops) do not count."""
    kernel = kck._compact_paths_kernel  # the `launches` fixture's Counted wrapper

    class Paused:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                counter.paused = True
                try:
                    return kernel[grid](*args, **kwargs)
                finally:
                    counter.paused = False

            return launch

    monkeypatch.setattr(kck, "_compact_paths_kernel", Paused())


# Storages (physical tensors): layout, dtype, page size. Groups of one page size draw
# disjoint blocks from one pool (vLLM's block pool), so storages shared by groups are
# safe.
STORAGES = {
    "A": ("mla", torch.bfloat16, 16),  # shared by groups 0 and 1
    "B": ("mla", torch.bfloat16, 16),
    "C": ("flash", torch.bfloat16, 1),
    "D": ("gqa_padded", torch.float32, 1),
    "E": ("mla", torch.float32, 1),
    "F": ("gqa", torch.bfloat16, 16),
    "G": ("mla_page_padded", torch.bfloat16, 16),
}
# Target layers: name -> (storage, group). t.2 aliases t.0's cache (KV sharing inside a
# group: compacted once); t.3 is t.0's storage in another group (compacted again with
# its own slots).
GROUP_LAYERS = {"t.0": ("A", 0), "t.1": ("B", 0), "t.2": ("A", 0), "t.3": ("A", 1),
                "t.4": ("C", 2), "t.5": ("D", 3), "t.6": ("E", 3), "t.7": ("F", 4),
                "t.8": ("G", 4)}
GROUP_PAGES = {0: 16, 1: 16, 2: 1, 3: 1, 4: 16}
MAX_TOKENS = 8 * (1 + BUDGET)  # the slot-mapping buffer's row length


def round_batch(seed: int):
    """A random verify batch mixing tree / chain / prefill / decode requests, ending
    with a short request (so reads at ``start + 1 + k`` would pass the batch's end)."""
    rng = random.Random(seed)
    kinds = ["tree"] + [rng.choice(["tree", "tree", "chain", "prefill", "decode"])
                        for _ in range(rng.randint(1, 4))]
    kinds.append(rng.choice(["prefill", "decode"]))
    depths = [DEPTHS] + [None] * (len(kinds) - 1)
    return make_batch(kinds, 1, seed=seed, depths=depths)


def write_group_slots(buffer: torch.Tensor, batch, seed: int) -> torch.Tensor:
    """Each group's slots of ``batch`` (its own blocks and page size) written into the
    rows of ``buffer`` ``[num_groups, MAX_TOKENS]`` as vLLM's ``BlockTables`` does:
    ``PAD_SLOT_ID`` after the batch's rows up to a padded length, and stale valid slots
    further on (a read past the batch would find them). Returns ``buffer[:, :padded]``
    (row g: group g's slot mapping) and the blocks per page size."""
    gen = torch.Generator().manual_seed(seed)
    num_tokens = sum(batch.qlens)
    padded = num_tokens + random.Random(seed).randint(0, 3)
    pools, num_blocks = {}, {}
    for ps in set(GROUP_PAGES.values()):
        need = sum(-(-(c + q) // ps) for c, q in zip(batch.contexts, batch.qlens, strict=True))
        num_blocks[ps] = need * len(GROUP_PAGES) + 3
        pools[ps] = torch.randperm(num_blocks[ps], generator=gen).tolist()
    buffer.copy_(torch.randint(0, min(num_blocks.values()), buffer.shape, generator=gen))
    for g, ps in GROUP_PAGES.items():
        slots, _ = paged_slots(batch.contexts, batch.qlens, ps, gen, pool=pools[ps])
        buffer[g, :num_tokens] = slots.to(buffer.device)
        buffer[g, num_tokens:padded] = PAD_SLOT_ID
    return buffer[:, :padded], num_blocks


def group_storages(num_blocks, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {key: random_physical(LAYOUTS[layout][0](num_blocks[ps], ps), dtype, gen)
            for key, (layout, dtype, ps) in STORAGES.items()}


def logical_caches(physical) -> dict[str, torch.Tensor]:
    return {name: LAYOUTS[STORAGES[key][0]][1](physical[key])
            for name, (key, _) in GROUP_LAYERS.items()}


def per_group_reference_(physical, slot_rows, qsl, kv_src_rows) -> None:
    """The per-group PyTorch path: ``path_compaction_slots`` of each group's slots,
    ``compact_kv_cache_`` on each distinct cache of the group."""
    caches = logical_caches(physical)
    for g in GROUP_PAGES:
        src, dst = path_compaction_slots(slot_rows[g], qsl, kv_src_rows)
        seen = set()
        for name, (_, group) in GROUP_LAYERS.items():
            if group == g and caches[name].data_ptr() not in seen:
                seen.add(caches[name].data_ptr())
                for rows in reference_views(kv_page_views(caches[name])):
                    compact_kv_cache_(rows, src, dst)


def speculator_over(physical) -> DDTreeSpeculator:
    spec = DDTreeSpeculator.__new__(DDTreeSpeculator)
    spec._target_layers_by_group = {
        g: [name for name, (_, group) in GROUP_LAYERS.items() if group == g]
        for g in GROUP_PAGES}
    spec.vllm_config = NS(compilation_config=NS(static_forward_context={
        name: NS(kv_cache=cache) for name, cache in logical_caches(physical).items()}))
    return spec


@pytest.mark.parametrize("seed", range(3))
def test_whole_round_in_one_launch_per_layout_matches_the_per_group_path(seed, launches):
    """Five KV-cache groups (page sizes 16 and 1, own block tables; storage A shared by
    groups 0 and 1; t.2 a KV-sharing alias of t.0), MLA / FlashAttention / GQA layouts,
    two rounds through ``_compact_target_kv``: same caches as the per-group PyTorch
    path, one launch per row layout, the address table built once."""
    buffer = torch.zeros(len(GROUP_PAGES), MAX_TOKENS, dtype=torch.int64, device=DEVICE)
    batches = [round_batch(300 + 2 * seed), round_batch(301 + 2 * seed)]
    needs = [write_group_slots(buffer.clone(), b, 10 * seed + r)[1]
             for r, b in enumerate(batches)]
    num_blocks = {ps: max(n[ps] for n in needs) for ps in needs[0]}
    physical = group_storages(num_blocks, seed)
    want = {key: t.clone() for key, t in physical.items()}
    before = {key: t.clone() for key, t in physical.items()}
    spec = speculator_over(physical)
    for r, batch in enumerate(batches):
        slot_rows, _ = write_group_slots(buffer, batch, 10 * seed + r)
        for g, ps in GROUP_PAGES.items():
            assert int(slot_rows[g].max()) < num_blocks[ps] * ps
        qsl, kv_src_rows = batch.qsl.to(DEVICE), batch.kv_src_rows.to(DEVICE)
        per_group_reference_(want, slot_rows, qsl, kv_src_rows)
        launches.paths.clear()
        spec._compact_target_kv({name: slot_rows[g] for name, (_, g) in GROUP_LAYERS.items()},
                                qsl, kv_src_rows)
        for key in physical:
            assert torch.equal(bits(physical[key]), bits(want[key])), (r, key)
        # bf16 MLA t.0, t.1, t.3; flash K+V; bf16 GQA; fp32 padded GQA; fp32 MLA;
        # bf16 MLA with padded pages
        assert sorted(g[2] for g in launches.paths) == [1, 1, 1, 1, 2, 3]
        assert all(g[0] == len(batch.qlens) for g in launches.paths)
    assert len(kck._PLANS) == 1  # same addresses, other lengths: the table is reused
    assert not launches.fallbacks and not launches.single and not launches.table
    for key in physical:
        assert not torch.equal(bits(physical[key]), bits(before[key])), key


@pytest.mark.parametrize("num_groups", [1, 8])
def test_one_launch_and_no_other_device_op_per_round(num_groups, launches, monkeypatch):
    """H200 case: every target layer in its own KV-cache group, all in one storage
    tensor. A round is one launch per row layout (MLA: 1; + FlashAttention: 2),
    whatever the number of groups, and after the first round no other aten op."""
    batch = round_batch(7)
    gen = torch.Generator().manual_seed(9)
    per_group = batch.num_blocks
    pool = torch.randperm(num_groups * per_group, generator=gen)
    buffer = torch.full((num_groups, MAX_TOKENS), PAD_SLOT_ID, dtype=torch.int64)
    for g in range(num_groups):  # the batch's slots on each group's own blocks
        own = pool[g * per_group : (g + 1) * per_group]
        buffer[g, : batch.slots.shape[0]] = own[batch.slots // 16] * 16 + batch.slots % 16
    buffer = buffer.to(DEVICE)
    slot_rows = buffer[:, : batch.slots.shape[0]]
    mla = random_physical((num_groups * per_group, 16, 576), torch.bfloat16, gen)
    flash = random_physical(LAYOUTS["flash"][0](num_groups * per_group, 16), torch.bfloat16,
                            gen)
    qsl, kv_src_rows = batch.qsl.to(DEVICE), batch.kv_src_rows.to(DEVICE)
    counter = OpCounter()
    pause_during_launches(monkeypatch, counter)

    for views_of, want_grids in (
        (lambda: kv_page_views(mla), [(len(batch.qlens), 1, num_groups)]),
        (lambda: kv_page_views(mla) + kv_page_views(flash),
         [(len(batch.qlens), 1, num_groups), (len(batch.qlens), 1, 2 * num_groups)]),
    ):
        groups = [(slot_rows[g], views_of()) for g in range(num_groups)]
        want = [v.clone() for v in views_of()]
        for rnd in range(2):
            for g in range(num_groups):
                src, dst = path_compaction_slots(slot_rows[g], qsl, kv_src_rows)
                for w in want:
                    compact_kv_cache_(w, src, dst)
            launches.paths.clear()
            counter.ops.clear()
            with counter:
                kck.compact_kv_paths_(groups, qsl, kv_src_rows)
            assert launches.paths == want_grids
            if rnd == 1:  # the cached table: nothing but the launches
                assert counter.ops == []
        for v, w in zip(views_of(), want, strict=True):
            assert torch.equal(bits(v), bits(w))
    assert not launches.fallbacks and not launches.single and not launches.table


def test_walk_entries_outside_a_request_move_nothing(launches):
    """Masked entries are never read or moved: a walk row past its request's rows
    (request 0), past the batch's end (the short last request) or past the slot
    mapping's length (query_start_loc beyond it) moves nothing, although the memory
    after the slot mapping holds valid-looking slots."""
    qsl = torch.tensor([0, 3, 6, 7], dtype=torch.int32, device=DEVICE)
    buffer = torch.arange(32, dtype=torch.int64, device=DEVICE)  # 8.. : stale slots
    slots = buffer[:7]
    kv_src_rows = torch.tensor([[2, 5, -1], [1, 2, -1], [1, 2, 3]], device=DEVICE)
    cache = torch.arange(40.0, device=DEVICE)[:, None].repeat(1, 4)
    kck.compact_kv_paths_([(slots, [cache.unsqueeze(1)])], qsl, kv_src_rows)
    got = cache[:, 0].tolist()
    # request 0: row 2 -> 1 (row 5 is request 1's; its dst row 2 is in place anyway);
    # request 1: rows 1, 2 in place; request 2 (one row): nothing
    assert got == [0, 2] + list(range(2, 40))
    assert len(launches.paths) == 1

    # query_start_loc past the slot mapping (6 rows): request 1's rows stop at 6
    cache = torch.arange(40.0, device=DEVICE)[:, None].repeat(1, 4)
    kck.compact_kv_paths_([(buffer[:6], [cache.unsqueeze(1)])], qsl,
                          torch.tensor([[-1, -1, -1], [2, -1, -1], [-1, -1, -1]],
                                       device=DEVICE))
    assert cache[:, 0].tolist() == [0, 1, 2, 3, 5, 5] + list(range(6, 40))
    cache = torch.arange(40.0, device=DEVICE)[:, None].repeat(1, 4)
    kck.compact_kv_paths_([(buffer[:4], [cache.unsqueeze(1)])], qsl,
                          torch.tensor([[-1, -1, -1], [2, -1, -1], [-1, -1, -1]],
                                       device=DEVICE))
    assert cache[:, 0].tolist() == list(range(40))


def test_paths_fallbacks_and_new_addresses(launches):
    """Views the kernel does not take (an inner-strided row; a group whose slot
    mapping is int32) use the reference with their group's slots; a slot mapping at
    a new address builds a new table."""
    batch = round_batch(11)
    gen = torch.Generator().manual_seed(12)
    n = batch.slots.shape[0]
    other = (batch.slots + batch.num_blocks).to(DEVICE)  # group 1: the next blocks
    mla = random_physical((2 * batch.num_blocks, 1, 576), torch.bfloat16, gen)
    odd = torch.randn(2 * batch.num_blocks, HEAD_DIM, HEADS, generator=gen).to(DEVICE)
    odd = odd.transpose(1, 2).unsqueeze(1)
    mla2 = random_physical((2 * batch.num_blocks, 1, 64), torch.float32, gen)
    qsl, kv_src_rows = batch.qsl.to(DEVICE), batch.kv_src_rows.to(DEVICE)
    want = [mla.clone(), odd.clone(), mla2.clone()]
    for slots, views in ((batch.slots.to(DEVICE), want[:2]), (other, want[2:])):
        src, dst = path_compaction_slots(slots, qsl, kv_src_rows)
        for v in views:
            compact_kv_cache_(v, src, dst)
    groups = [(batch.slots.to(DEVICE), [mla, odd, mla]), (other.to(torch.int32), [mla2])]
    kck.compact_kv_paths_(groups, qsl, kv_src_rows)  # mla twice in a group: moved once
    for got, w in zip((mla, odd, mla2), want, strict=True):
        assert torch.equal(bits(got), bits(w))
    assert launches.fallbacks == [tuple(odd.shape), tuple(mla2.shape)]
    assert launches.paths == [(len(batch.qlens), 1, 1)]
    assert len(kck._PLANS) == 1
    copy = batch.slots.to(DEVICE).clone()  # new address: a new table
    kck.compact_kv_paths_([(copy[:n], [mla])], qsl, kv_src_rows)
    assert len(kck._PLANS) == 2
    with pytest.raises(ValueError, match="kv_src_rows"):
        kck.compact_kv_paths_(groups, qsl, kv_src_rows.float())
    with pytest.raises(ValueError, match="R \\+ 1"):
        kck.compact_kv_paths_(groups, qsl[:-1], kv_src_rows)


# ----------------------------------------------------------------------------------
# Compiled for the GPU (no GPU needed): the barrier separates all loads from all stores
# ----------------------------------------------------------------------------------

_COMPILE_SCRIPT = textwrap.dedent(
    """
    import json, triton, triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from vllm_ddtree.compact import kv_kernel as kck

    result = []
    pointers = {"Rows": "*i64", "Table": "*i64", "Src": "*i64", "Dst": "*i64",
                "QueryStart": "*i32", "KvSrcRows": "*i64"}
    for fn, extra in ((kck._compact_rows_kernel, {}),
                      (kck._compact_rows_table_kernel, {"ELEM": tl.int64}),
                      (kck._compact_paths_kernel, {"ELEM": tl.int64}),
                      (kck._compact_paths_kernel, {"ELEM": tl.int16})):
        for contiguous in (True, False):
            consts = dict(BLOCK_L=16, BLOCK_C=256, CONTIGUOUS=contiguous, **extra)
            sig = {n: pointers.get(n, "constexpr" if n in consts else "i32")
                   for n in fn.arg_names}
            k = triton.compile(ASTSource(fn, sig, constexprs=consts),
                               target=GPUTarget("cuda", 90, 32),
                               options={"num_warps": kck.NUM_WARPS})
            lines = k.asm["ptx"].splitlines()
            where = lambda op: [i for i, line in enumerate(lines) if op in line]
            result.append(dict(loads=where("ld.global"), stores=where("st.global"),
                               barriers=where("bar.sync")))
    print(json.dumps(result))
    """
)


def test_compiled_for_sm90_loads_then_barrier_then_stores():
    """Hopper PTX of the kernels: one CTA barrier, every global load before it, every
    store after it (the all-reads-first guarantee the interpreter cannot show). For
    the whole-round kernel the loads include the address table, the walk and the
    slot mappings."""
    compiled = compiled_shared_memory(_COMPILE_SCRIPT)
    assert len(compiled) == 8
    for ptx in compiled:
        (barrier,) = ptx["barriers"]
        assert ptx["loads"] and ptx["stores"]
        assert max(ptx["loads"]) < barrier < min(ptx["stores"])
