"""Shared helpers of the Triton kernel tests (CPU interpreter or GPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

TOLS = {
    torch.float32: dict(atol=2e-4, rtol=2e-4),
    torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
    torch.float16: dict(atol=5e-3, rtol=5e-3),
}


def chain(n: int) -> list[int]:
    """Parents of a chain of n tokens (token 0 is the root)."""
    return list(range(-1, n - 1))


def random_tree(n: int, rng) -> list[int]:
    """Parents of a random tree on n tokens rooted at token 0 (parent < child)."""
    return [-1] + [rng.randrange(i) for i in range(1, n)]


def kernels_run_here(*jit_functions) -> bool:
    """True on a GPU, or when the kernels were built for Triton's interpreter
    (TRITON_INTERPRET=1 set by conftest.py before triton's first import)."""
    return DEVICE == "cuda" or all(
        type(f).__name__ == "InterpretedFunction" for f in jit_functions
    )


def skip_unless_kernels_run_here(*jit_functions) -> pytest.MarkDecorator:
    """pytest mark: skip unless ``kernels_run_here(*jit_functions)``."""
    return pytest.mark.skipif(
        not kernels_run_here(*jit_functions),
        reason="triton was imported before TRITON_INTERPRET was set (see tests/conftest.py)",
    )


def compiled_shared_memory(script: str) -> list[int]:
    """Run ``script`` (compiles kernels for sm_120 with Triton's ptxas, no GPU needed,
    prints a JSON list) outside the interpreter; returns the shared bytes per config.
    Skips the calling test when Triton's CUDA toolchain is missing."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=600)
    if proc.returncode != 0:
        if "ptxas" in proc.stderr or "No such file" in proc.stderr:
            pytest.skip(f"Triton's CUDA toolchain is unavailable: {proc.stderr[-300:]}")
        raise AssertionError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


VLLM_TRITON_OPS = (
    "vllm.v1.attention.ops.triton_attention_helpers",
    "vllm.v1.attention.ops.triton_unified_attention",
    "vllm.v1.attention.ops.triton_reshape_and_cache_flash",
)


def interpreted_vllm_triton_ops() -> dict:
    """Fresh copies of vLLM's Triton attention op modules built with the real ``triton``.

    On CPU, vLLM replaces ``triton`` by a placeholder (``vllm.triton_utils``: no active
    driver), so its kernels are plain functions. Re-executing the modules' source with
    the real package (in Triton's interpreter, see conftest.py) makes them runnable.
    ``sys.modules`` is restored; returns ``{module short name: module}``.
    """
    import importlib.util
    import sys
    import types

    import triton
    import vllm.triton_utils as placeholder

    real = types.ModuleType("vllm.triton_utils")
    real.__dict__.update(placeholder.__dict__)
    real.triton, real.tl, real.HAS_TRITON = triton, triton.language, True
    real.tldevice = triton.language.extra.libdevice
    saved = {name: sys.modules.get(name) for name in ("vllm.triton_utils", *VLLM_TRITON_OPS)}
    modules = {}
    try:
        sys.modules["vllm.triton_utils"] = real
        for name in VLLM_TRITON_OPS:
            spec = importlib.util.find_spec(name)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module  # later modules import the fresh helpers
            spec.loader.exec_module(module)
            modules[name.rsplit(".", 1)[1]] = module
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
    return modules
