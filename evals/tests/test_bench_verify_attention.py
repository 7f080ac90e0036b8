"""The MLA verify benchmark's handling of a method that faults the CUDA context (CPU:
the GPU calls are stubbed)."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "evals"))
import bench_verify_attention as bench_module  # noqa: E402


def test_a_context_fault_stops_the_cell_and_names_the_method(monkeypatch):
    from types import SimpleNamespace

    inputs = SimpleNamespace(bits_tree=None, bits_chain=None)
    monkeypatch.setattr(bench_module, "make_inputs", lambda cell, dtype: inputs)
    for name in ("ours", "flashmla", "vllm_triton_decode", "prefill_path"):
        monkeypatch.setattr(bench_module, name, lambda *a, **k: (lambda: None))
    faulted = {"yes": False}

    def bench(fn):
        if faulted["yes"]:
            raise AssertionError("no method may run after the fault")
        return 1.0

    calls = iter(range(100))

    def synchronize():
        # The third method (ours_active) leaves the context poisoned.
        if next(calls) == 2:
            faulted["yes"] = True
        if faulted["yes"]:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    args = bench_module.parse_args(["--heads", "64"])
    cell = bench_module.Cell(64, 131072, 16, 64)
    with pytest.raises(bench_module.ContextLost) as lost:
        bench_module.run_cell(cell, args, [], bench, torch.bfloat16)
    result = lost.value.result
    assert result.times["ours_tree"] == 1.0 and result.times["ours_chain"] == 1.0
    assert "illegal memory access" in result.notes["ours_active"]
    assert "flashmla" not in result.times  # never started


def test_a_method_that_cannot_be_captured_is_host_timed_and_says_so(monkeypatch):
    from types import SimpleNamespace

    monkeypatch.setattr(bench_module, "make_inputs",
                        lambda cell, dtype: SimpleNamespace(bits_tree=None, bits_chain=None))
    for name in ("ours", "flashmla", "prefill_path"):
        monkeypatch.setattr(bench_module, name, lambda *a, **k: (lambda: "graph ok"))
    monkeypatch.setattr(bench_module, "vllm_triton_decode", lambda *a, **k: (lambda: "host"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)

    def graph_bench(fn):
        if fn() == "host":
            raise bench_module.NotCapturable("Cannot copy between CPU and CUDA tensors")
        return 1.0

    args = bench_module.parse_args([])
    cell = bench_module.Cell(8, 8192, 16, 64)
    result = bench_module.run_cell(cell, args, [], graph_bench, torch.bfloat16,
                                   fallback_bench=lambda fn: 7.0)
    assert result.times["vllm_triton"] == 7.0
    assert "host-timed" in result.notes["vllm_triton"]
    assert result.times["ours_tree"] == 1.0 and "ours_tree" not in result.notes
    strict = bench_module.run_cell(cell, args, [], graph_bench, torch.bfloat16)
    assert strict.times["vllm_triton"] is None  # no fallback: reported, not timed
    assert "NotCapturable" in strict.notes["vllm_triton"]
