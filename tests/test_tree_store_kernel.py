# SPDX-License-Identifier: Apache-2.0
"""The one-launch tree scatter (vllm_ddtree.tree.store_kernel) against the PyTorch
``index_put_`` path of DDTreeRuntimeState.store_trees_, exactly; Triton's interpreter
on CPU, compiled on a GPU."""

import pytest
import torch

triton = pytest.importorskip("triton")

from kernel_testing import DEVICE  # noqa: E402

from vllm_ddtree.tree.store_kernel import store_trees_triton  # noqa: E402


def _state(max_reqs, budget, words, fill):
    return [torch.full(shape, fill, dtype=torch.int64)
            for shape in ((max_reqs, budget), (max_reqs, budget), (max_reqs, 1 + budget, words),
                          (max_reqs,))]


@pytest.mark.parametrize("active", ["none", "per_request", "scalar"])
@pytest.mark.parametrize("budget,words", [(9, 1), (600, 10)])
def test_scatter_equals_index_put(active, budget, words):
    gen = torch.Generator().manual_seed(budget + len(active))
    max_reqs, num_reqs = 7, 4
    idx = torch.randperm(max_reqs, generator=gen)[:num_reqs].int()
    parents = torch.randint(-1, budget, (num_reqs, budget), generator=gen)
    depths = torch.randint(1, 16, (num_reqs, budget), generator=gen)
    bits = torch.randint(-2**62, 2**62, (num_reqs, 1 + budget, words), generator=gen)
    act = {"none": None, "per_request": torch.randint(1, budget, (num_reqs,), generator=gen),
           "scalar": torch.tensor(5, dtype=torch.int32)}[active]
    want = _state(max_reqs, budget, words, -3)
    i = idx.long()
    want[0][i], want[1][i], want[2][i] = parents, depths, bits
    if act is not None:
        want[3][i] = act.to(torch.int64).expand(num_reqs)
    got = [t.to(DEVICE) for t in _state(max_reqs, budget, words, -3)]
    assert store_trees_triton(idx.to(DEVICE), parents.to(DEVICE), depths.to(DEVICE),
                              bits.to(DEVICE), got[0], got[1], got[2],
                              None if act is None else act.to(DEVICE),
                              None if act is None else got[3])
    for g, w, name in zip(got, want, ("parents", "depths", "bits", "active"), strict=True):
        assert torch.equal(g.cpu(), w), name


def test_strided_rows_and_padding_requests_write_only_live_rows():
    """The in-graph store (the speculator on CUDA): request ``r``'s row is
    ``sample_idx_mapping[r * L]``, and CUDA-graph padding requests (-1) write nothing."""
    gen = torch.Generator().manual_seed(11)
    max_reqs, num_reqs, budget, words, depths = 6, 4, 9, 1, 3
    parents = torch.randint(-1, budget, (num_reqs, budget), generator=gen)
    node_depths = torch.randint(1, 16, (num_reqs, budget), generator=gen)
    bits = torch.randint(-2**62, 2**62, (num_reqs, 1 + budget, words), generator=gen)
    rows = [3, 0, -1, -1]  # two live requests, then two padding requests
    sample_idx_mapping = torch.tensor([r for r in rows for _ in range(depths)],
                                      dtype=torch.int32)
    want = _state(max_reqs, budget, words, -3)
    for r, row in enumerate(rows[:2]):
        want[0][row], want[1][row], want[2][row] = parents[r], node_depths[r], bits[r]
    got = [t.to(DEVICE) for t in _state(max_reqs, budget, words, -3)]
    assert store_trees_triton(sample_idx_mapping.to(DEVICE), parents.to(DEVICE),
                              node_depths.to(DEVICE), bits.to(DEVICE), *got[:3],
                              idx_stride=depths)
    for g, w, name in zip(got[:3], want[:3], ("parents", "depths", "bits"), strict=True):
        assert torch.equal(g.cpu(), w), name
    # too short for R requests at this stride, or strided itself: refused, nothing written
    assert not store_trees_triton(sample_idx_mapping[:9].to(DEVICE), parents.to(DEVICE),
                                  node_depths.to(DEVICE), bits.to(DEVICE), *got[:3],
                                  idx_stride=depths)
    # sliced after the copy: a CUDA copy of a strided CPU view is contiguous
    assert not store_trees_triton(sample_idx_mapping.to(DEVICE)[::2], parents.to(DEVICE),
                                  node_depths.to(DEVICE), bits.to(DEVICE), *got[:3])


def test_other_layouts_are_refused():
    """Strided rows or other dtypes: False, nothing written (the caller scatters)."""
    state = _state(4, 5, 1, -3)
    idx = torch.tensor([1, 0], dtype=torch.int32)
    parents = torch.zeros(2, 10, dtype=torch.int64)[:, ::2]
    ok = torch.zeros(2, 5, dtype=torch.int64)
    bits = torch.zeros(2, 6, 1, dtype=torch.int64)
    assert not store_trees_triton(idx, parents, ok, bits, *state[:3])
    assert not store_trees_triton(idx, ok.int(), ok, bits, *state[:3])
    assert not store_trees_triton(idx, ok, ok, bits, *state[:3], torch.tensor([1, 2]), None)
    assert all(bool((t == -3).all()) for t in state)


def test_runtime_state_uses_the_kernel_and_matches_the_torch_path(monkeypatch):
    """store_trees_ with the kernels forced on (the interpreter on CPU) leaves the state
    as the PyTorch path does, adaptive budgets included (a GPU run failed here on CPU
    tensors before the state moved to DEVICE: compiled Triton cannot read them)."""
    from vllm_ddtree import runtime_state
    from vllm_ddtree.runtime_state import DDTreeRuntimeState
    from vllm_ddtree.tree.draft_tree import build_ddtree

    gen = torch.Generator().manual_seed(3)
    trees = build_ddtree(torch.randn(3, 4, 11, generator=gen), 6, 3)
    idx = torch.tensor([5, 0, 2], dtype=torch.int32, device=DEVICE)
    active = torch.tensor([2, 6, 4], device=DEVICE)
    bits = trees.ancestor_bits().to(DEVICE)
    states = []
    for forced in (False, True):
        state = DDTreeRuntimeState()
        state.allocate(8, 64, 6, 4, 7, DEVICE)
        state.enable_adaptive_(8, DEVICE)
        monkeypatch.setattr(runtime_state, "use_triton", lambda t, f=forced: f)
        state.store_trees_(idx, trees.parents.to(DEVICE), trees.depths.to(DEVICE), bits, active)
        states.append(state)
    for name in ("parents", "depths", "ancestor_bits", "active_nodes"):
        assert torch.equal(getattr(states[0], name), getattr(states[1], name)), name
    assert int(states[1].active_nodes[5]) == 2


def test_kernel_compiles_for_sm90_and_sm120():
    """Compiled (no GPU needed) for Hopper and sm_120, with and without the budgets."""
    import textwrap

    from kernel_testing import compiled_shared_memory

    script = textwrap.dedent(
        """
        import json, triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from vllm_ddtree.tree.store_kernel import _store_trees_kernel as fn

        result = []
        for arch in (90, 120):
            for active in (False, True):
                consts = dict(ACTIVE=active, ACTIVE_PER_REQUEST=active, BLOCK_B=512,
                              BLOCK_WORDS=256)
                sig = {n: "constexpr" if n in consts else ("*i32" if n == "idx_ptr" else
                       "*i64") if n.endswith("_ptr") else "i32" for n in fn.arg_names}
                k = triton.compile(ASTSource(fn, sig, constexprs=consts),
                                   target=GPUTarget("cuda", arch, 32), options={"num_warps": 4})
                result.append(k.metadata.shared)
        print(json.dumps(result))
        """
    )
    shared = compiled_shared_memory(script)
    assert len(shared) == 4 and max(shared) <= 99 * 1024, shared
