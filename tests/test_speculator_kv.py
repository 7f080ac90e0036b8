"""CPU tests of the speculator's target-KV side: the accepted paths moved to consecutive
rows (hidden-row gather, KV compaction) in every KV-cache group, the groups' layers and
cache views, and the attention backends it accepts."""


from types import SimpleNamespace as NS

import numpy as np
import pytest
import torch
from test_ddtree_integration_units import (
    BUDGET,
    DEPTHS,
    _restore_tree_mask_state,  # noqa: F401 - autouse fixture
    fake_speculator,
    new_state,
)

from vllm_ddtree.runtime_state import (
    hidden_row_gather_index,
)


def test_hidden_gather_and_kv_compaction_put_the_path_at_consecutive_rows():
    from vllm_ddtree.compact.reference import compact_kv_cache_
    from vllm_ddtree.draft.speculator import kv_page_views, path_compaction_slots

    qlens = [1 + BUDGET, 1 + BUDGET, 3]
    qsl = torch.tensor([0] + np.cumsum(qlens).tolist(), dtype=torch.int32)
    total = int(qsl[-1])
    kv_src_rows = torch.tensor([[2, 9, 17, -1], [-1, -1, -1, -1], [-1, -1, -1, -1]])
    index = hidden_row_gather_index(qsl, kv_src_rows, total + 4)  # + graph padding
    want = list(range(total + 4))
    want[1:4] = [2, 9, 17]
    assert index.tolist() == want

    page, dim = 4, 3
    num_blocks = 40
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0))
    slots = torch.cat([perm[t // page] * page + t % page for t in [torch.arange(total)]])
    cache = torch.zeros(num_blocks, page, dim)
    pages = kv_page_views(cache)[0]
    assert pages.data_ptr() == cache.data_ptr()
    cache.view(-1, dim)[slots] = torch.arange(total, dtype=torch.float32)[:, None].expand(-1, dim)
    src, dst = path_compaction_slots(slots, qsl, kv_src_rows)  # short last request
    compact_kv_cache_(pages, src, dst)
    got = cache.view(-1, dim)[slots][:, 0].long().tolist()
    want = list(range(total))
    want[1:4] = [2, 9, 17]
    assert got == want

    # A page padded to the model's largest (vLLM's unify_kv_cache_spec_page_size):
    # blocks 7 rows apart, each holding 4 slots; the padding is never touched.
    padded = torch.full((num_blocks, page + 3, dim), -5.0)[:, :page]
    cache.view(-1, dim)[slots] = torch.arange(total, dtype=torch.float32)[:, None].expand(-1, dim)
    padded.copy_(cache)
    compact_kv_cache_(kv_page_views(padded)[0], src, dst)
    compact_kv_cache_(pages, src, dst)
    assert torch.equal(padded, cache)
    assert (padded.as_strided((num_blocks, 3, dim), padded.stride(), page * dim) == -5).all()

    fa = torch.zeros(2, num_blocks, page, 2, 5)
    views = kv_page_views(fa)
    assert [v.shape for v in views] == [(num_blocks, page, 2, 5)] * 2
    assert views[1].data_ptr() == fa[1].data_ptr()
    with pytest.raises(NotImplementedError, match="layout"):
        kv_page_views(torch.zeros(3, 4, 2, 3, 5))  # 5-D but not [2, ...]

    # vLLM Triton / GQA tree backend: logical [nb, H, page, 2D] over a physical
    # [nb, page, H, 2D] tensor; one page view moves K and V together.
    physical = torch.arange(num_blocks * page * 2 * 6, dtype=torch.float32).view(
        num_blocks, page, 2, 6)
    triton_cache = physical.permute(0, 2, 1, 3)
    (rows,) = kv_page_views(triton_cache)
    assert rows.shape == (num_blocks, page, 2, 6) and rows.data_ptr() == physical.data_ptr()
    want = physical.view(-1, 2, 6)[5].clone()
    compact_kv_cache_(rows, torch.tensor([5]), torch.tensor([1]))
    assert torch.equal(triton_cache[0, :, 1], want)  # block 0, page offset 1, all heads


def test_set_attn_refuses_targets_without_the_tree_backend():
    from vllm.v1.worker.gpu.model_states.default import DefaultModelState

    spec = fake_speculator(new_state())
    spec.draft_attn_layer_names = {"draft.0"}
    flash = NS(get_name=lambda: "FLASH_ATTN")
    groups = [[NS(backend=flash, layer_names=["draft.0"]),
               NS(backend=flash, layer_names=["model.layers.0.attn"])]]
    with pytest.raises(NotImplementedError, match="tree mask"):
        spec.set_attn(DefaultModelState.__new__(DefaultModelState), None, None, None, groups)
    with pytest.raises(NotImplementedError, match="DefaultModelState"):
        spec.set_attn(object(), None, None, None, groups)


def test_target_layers_by_group_reads_uniform_type_groups():
    """An MLA target beside a GQA drafter's full layers shares one
    UniformTypeKVCacheSpecs group: its target layers must still be compacted."""
    import torch as _torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheGroupSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
        UniformTypeKVCacheSpecs,
    )

    from vllm_ddtree.draft.speculator import target_layers_by_group

    mla = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=_torch.bfloat16)
    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=_torch.bfloat16)
    swa = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=_torch.bfloat16,
                            sliding_window=256)
    uniform = UniformTypeKVCacheSpecs(
        block_size=16, kv_cache_specs={"t.0": mla, "t.1": mla, "d.1": full})
    config = NS(kv_cache_groups=[
        KVCacheGroupSpec(["t.0", "t.1", "d.1"], uniform),
        KVCacheGroupSpec(["d.0", "d.2"], swa),
    ])
    assert target_layers_by_group(config, {"d.0", "d.1", "d.2"}) == {0: ["t.0", "t.1"]}

    mamba = MambaSpec(block_size=16, shapes=((4,),), dtypes=(_torch.float32,))
    config.kv_cache_groups.append(KVCacheGroupSpec(["t.2"], mamba))
    with pytest.raises(NotImplementedError, match="t.2"):
        target_layers_by_group(config, {"d.0", "d.1", "d.2"})


def test_compaction_reaches_every_group_sharing_one_storage():
    """Found on the H200: vLLM gave each target MLA layer its own KV-cache group, all
    backed by one storage tensor (disjoint block ids). Deduplicating caches by address
    compacted only the first layer, and DDTree diverged from AR at the first
    accepted off-chain node. Every group must move its own slots, exactly once."""
    state = new_state()
    spec = fake_speculator(state)
    total = 2 * (1 + BUDGET)
    qsl = torch.tensor([0, 1 + BUDGET, total], dtype=torch.int32)
    storage = torch.zeros(400, 1, 2)
    group_slots = {g: torch.arange(100 * g, 100 * g + total) for g in range(3)}
    for g, slots in group_slots.items():
        storage[slots, 0, 0] = 1000.0 * g + torch.arange(total, dtype=torch.float32)
    spec._target_layers_by_group = {g: [f"target.{g}"] for g in group_slots}
    spec.vllm_config = NS(compilation_config=NS(static_forward_context={
        f"target.{g}": NS(kv_cache=storage) for g in group_slots}))
    # request 0's path: rows 2, 3, 5 (row 3 is both a source and a destination)
    kv_src_rows = torch.full((2, DEPTHS), -1, dtype=torch.int64)
    kv_src_rows[0, :3] = torch.tensor([2, 3, 5])
    spec._compact_target_kv({f"target.{g}": s for g, s in group_slots.items()}, qsl,
                            kv_src_rows)
    for g, slots in group_slots.items():
        got = (storage[slots[:4], 0, 0] - 1000.0 * g).tolist()
        assert got == [0.0, 2.0, 3.0, 5.0], f"group {g}: {got}"
        assert (storage[slots[1 + BUDGET:], 0, 0] - 1000.0 * g).tolist() == list(
            range(1 + BUDGET, total))


def test_compaction_views_are_kept_across_rounds_and_rebuilt_on_a_rebound_cache():
    """The speculator builds its PathCompactor at the first round and keeps it; a cache
    vLLM binds anew (another tensor object) gets a new one, and rounds then move the
    new cache's rows, not the old one's."""
    state = new_state()
    spec = fake_speculator(state)
    total = 2 * (1 + BUDGET)
    qsl = torch.tensor([0, 1 + BUDGET, total], dtype=torch.int32)
    slots = torch.arange(10, 10 + total)
    kv_src_rows = torch.full((2, DEPTHS), -1, dtype=torch.int64)
    kv_src_rows[0, :2] = torch.tensor([4, 7])

    def fresh_cache():
        cache = torch.zeros(100, 1, 2)
        cache[slots, 0, 0] = torch.arange(total, dtype=torch.float32)
        return cache

    context = {"target.0": NS(kv_cache=fresh_cache())}
    spec._target_layers_by_group = {0: ["target.0"]}
    spec.vllm_config = NS(compilation_config=NS(static_forward_context=context))
    spec._compact_target_kv({"target.0": slots}, qsl, kv_src_rows)
    first = spec._compactor[1]
    spec._compact_target_kv({"target.0": slots}, qsl, kv_src_rows)
    assert spec._compactor[1] is first  # same caches: built once
    rebound = fresh_cache()
    context["target.0"] = NS(kv_cache=rebound)
    spec._compact_target_kv({"target.0": slots}, qsl, kv_src_rows)
    assert spec._compactor[1] is not first
    assert rebound[slots[:3], 0, 0].tolist() == [0.0, 4.0, 7.0]


def test_path_row_move_is_compiled_at_the_first_propose_with_aux_states(monkeypatch):
    """``_warm_path_rows``: once, with the aux states' own tensors (the compiled variant
    is keyed on their dtype, strides and count) and a walk of width L whose every source
    is -1 (nothing moves); skipped while a CUDA graph is being captured."""
    from vllm_ddtree.draft import speculator as module

    calls = []
    move = module.move_path_rows_triton  # the kernel, in Triton's interpreter on CPU

    def recorded(xs, qsl, src):
        calls.append((xs, qsl.clone(), src.clone()))
        return move(xs, qsl, src)

    monkeypatch.setattr(module, "use_triton", lambda t: True)
    monkeypatch.setattr(module, "move_path_rows_triton", recorded)
    spec = NS(num_draft_depths=DEPTHS, _path_rows_warm=False)
    aux = [torch.randn(9, 8) for _ in range(3)]
    before = [x.clone() for x in aux]
    qsl = torch.tensor([0, 9, 9], dtype=torch.int32)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    module.DDTreeSpeculator._warm_path_rows(spec, aux, qsl)
    assert not calls and not spec._path_rows_warm
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    module.DDTreeSpeculator._warm_path_rows(spec, aux, qsl)
    assert spec._path_rows_warm and len(calls) == 1
    xs, got_qsl, src = calls[0]
    assert xs is aux and got_qsl.tolist() == [0, 9]
    assert src.shape == (1, DEPTHS) and bool((src == -1).all())
    assert all(torch.equal(a, b) for a, b in zip(aux, before, strict=True))  # nothing moved
    # the same launch with a real source row would have moved one: the check can fail
    src[0, 0] = 2
    assert move(aux, got_qsl, src) and torch.equal(aux[0][1], before[0][2])
