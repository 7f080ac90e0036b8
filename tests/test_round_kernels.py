"""The switch between the PyTorch and the Triton per-round kernels (walk, compaction)."""

import pytest
import torch

from vllm_ddtree import kv_compaction_kernel, round_kernels
from vllm_ddtree.round_kernels import ROUND_KERNELS_ENV, use_triton_round_kernels
from vllm_ddtree.tree import build_ddtree, follow_tree
from vllm_ddtree.tree_walk_kernel import follow_tree_fast


def test_default_is_triton_and_torch_is_selectable(monkeypatch):
    monkeypatch.delenv(ROUND_KERNELS_ENV, raising=False)
    assert round_kernels.round_kernels() == "triton"
    monkeypatch.setenv(ROUND_KERNELS_ENV, " Torch ")
    assert round_kernels.round_kernels() == "torch"


def test_unknown_value_names_the_variable(monkeypatch):
    monkeypatch.setenv(ROUND_KERNELS_ENV, "cuda")
    with pytest.raises(ValueError, match=ROUND_KERNELS_ENV):
        round_kernels.round_kernels()


def test_cpu_tensors_always_take_the_pytorch_path(monkeypatch):
    monkeypatch.setenv(ROUND_KERNELS_ENV, "triton")
    rows = torch.zeros(4, 8)
    assert not use_triton_round_kernels(rows)
    assert not kv_compaction_kernel.use_triton(rows)
    tree = build_ddtree(torch.randn(2, 3, 11, generator=torch.Generator().manual_seed(0)), 5)
    targets = torch.randint(0, 11, (2, 6), generator=torch.Generator().manual_seed(1))
    want = follow_tree(tree, targets, max_depth=3)
    got = follow_tree_fast(tree, targets, max_depth=3)
    for name in ("accepted_nodes", "committed_tokens", "kv_src_rows"):
        assert torch.equal(getattr(got, name), getattr(want, name))


def test_tree_build_switch(monkeypatch):
    from vllm_ddtree.round_kernels import TREE_BUILD_ENV, use_triton_tree_build

    cuda_like = torch.zeros(1, device="meta")  # not CUDA: always the PyTorch build
    monkeypatch.delenv(TREE_BUILD_ENV, raising=False)
    assert not use_triton_tree_build(cuda_like)
    monkeypatch.setenv(TREE_BUILD_ENV, "triton")
    assert not use_triton_tree_build(cuda_like)
    # The default is the Triton build (CUDA tensors only), "torch" opts out.
    from vllm_ddtree import round_kernels

    monkeypatch.delenv(TREE_BUILD_ENV, raising=False)
    assert round_kernels.tree_build() == "triton"
    monkeypatch.setenv(TREE_BUILD_ENV, "torch")
    assert round_kernels.tree_build() == "torch"
    monkeypatch.setenv(TREE_BUILD_ENV, "cuda")
    with pytest.raises(ValueError, match=TREE_BUILD_ENV):
        use_triton_tree_build(cuda_like)
