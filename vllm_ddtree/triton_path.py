"""Which implementation runs a round's work on a tensor: DDTree's Triton kernels for
CUDA tensors, the batched PyTorch ops for CPU tensors (the CPU path, and the reference
the kernel tests compare the kernels with)."""

from __future__ import annotations

import torch

__all__ = ["use_triton"]


def use_triton(tensor: torch.Tensor) -> bool:
    """True when ``tensor`` (a tensor of the round) goes to the Triton kernels: it is a
    CUDA tensor. Tests monkeypatch the name where it is imported to run the kernels in
    Triton's interpreter on CPU tensors."""
    return tensor.is_cuda
