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


def test_inactive_rows_table_flag_defaults_off():
    assert bench_module.parse_args([]).inactive_rows_table is None
    args = bench_module.parse_args(["--inactive-rows-table", "out.md"])
    assert args.inactive_rows_table == "out.md" and args.timer == "graph"


def test_inactive_rows_table_times_triton_skipping_vs_gluon_computing_all(monkeypatch):
    """Per (H, ctx): one Gluon timing on the whole 65-row tree; per b, the Triton kernel
    (forced) with b + 1 active rows of the same inputs. CPU: the GPU calls are stubbed."""
    from types import SimpleNamespace

    cells, triton_calls = [], []
    monkeypatch.setattr(bench_module, "make_inputs",
                        lambda cell, dtype: cells.append(cell) or SimpleNamespace(bits_tree="T"))
    monkeypatch.setattr(bench_module, "gluon_all_rows", lambda inp: "gluon")

    def ours(inp, bits, active_rows=None, kernel="auto"):
        triton_calls.append((bits, active_rows, kernel))
        return ("triton", active_rows)

    monkeypatch.setattr(bench_module, "ours", ours)

    def bench(fn):
        return 2.0 if fn == "gluon" else fn[1] / 65

    lines = bench_module.inactive_rows_table(bench, torch.bfloat16)
    assert [(c.heads, c.ctx, c.qlen, c.page) for c in cells] == [
        (8, 8192, 65, 64), (8, 131072, 65, 64), (64, 8192, 65, 64), (64, 131072, 65, 64)]
    assert triton_calls == [("T", b + 1, "triton") for b in (8, 32, 64)] * 4
    assert "Triton, skips inactive rows" in lines[0] and "Gluon, all 65 rows" in lines[0]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]
    assert len(rows) == 12
    assert rows[0][:3] == ["8", "8k", "9"] and rows[-1][:3] == ["64", "128k", "65"]
    assert rows[-1][4] == "2.000" and rows[-1][5] == "2.00"  # gluon 2.0 / triton 1.0


def test_gluon_all_rows_is_unavailable_off_hopper():
    from types import SimpleNamespace

    inp = SimpleNamespace(q=torch.zeros(65, 8, 576, dtype=torch.bfloat16),
                          kv_cache=torch.zeros(2, 64, 576, dtype=torch.bfloat16))
    with pytest.raises(bench_module.Unavailable, match="sm_90"):
        bench_module.gluon_all_rows(inp)
