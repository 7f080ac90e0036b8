"""Which implementation runs a round's work: Triton for CUDA tensors, the PyTorch ops
for CPU tensors (vllm_ddtree.triton_path)."""

import torch

from vllm_ddtree import runtime_state
from vllm_ddtree.triton_path import use_triton


def test_cpu_tensors_always_take_the_pytorch_path(monkeypatch):
    rows = torch.zeros(4, 8)
    assert not use_triton(rows)
    assert not use_triton(torch.zeros(1, device="meta"))  # not CUDA either

    # a round function with a Triton path takes its PyTorch ops for CPU tensors
    def no_kernel(*args):
        raise AssertionError("the Triton kernel ran on CPU tensors")

    monkeypatch.setattr(runtime_state, "hidden_row_gather_index_triton", no_kernel)
    qsl = torch.tensor([0, 3, 5], dtype=torch.int32)
    src = torch.tensor([[2, -1], [-1, -1]])
    index = runtime_state.hidden_row_gather_index(qsl, src, 6)
    assert index.tolist() == [0, 2, 2, 3, 4, 5]
