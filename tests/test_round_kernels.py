"""The switch between the PyTorch and the Triton per-round kernels (walk, compaction)."""

import pytest
import torch

from vllm_ddtree import round_kernels, runtime_state
from vllm_ddtree.compact import kv_kernel as kv_compaction_kernel
from vllm_ddtree.round_kernels import ROUND_KERNELS_ENV, use_triton_round_kernels


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
    # a round function with a Triton path takes its PyTorch ops for CPU tensors
    def no_kernel(*args):
        raise AssertionError("the Triton kernel ran on CPU tensors")

    monkeypatch.setattr(runtime_state, "hidden_row_gather_index_triton", no_kernel)
    qsl = torch.tensor([0, 3, 5], dtype=torch.int32)
    src = torch.tensor([[2, -1], [-1, -1]])
    index = runtime_state.hidden_row_gather_index(qsl, src, 6)
    assert index.tolist() == [0, 2, 2, 3, 4, 5]


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
