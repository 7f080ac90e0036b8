"""The verify-attention grid's outputs on the CPU: the dispatch table generated from its
JSON (``make_dispatch_table.py``) and its markdown / heatmap (``verify_grid_report.py``),
from a synthetic grid."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "evals"))
import make_dispatch_table as gen  # noqa: E402
import verify_grid_report as report_module  # noqa: E402

from vllm_ddtree.attention_backends.mla_tree import dispatch  # noqa: E402


def cell(dtype, heads, rows, ctx, **times):
    return dict(dtype=dtype, heads=heads, rows=rows, ctx=ctx, times=times, notes={})


def grid(**overrides):
    cells = [
        # The slow case: Triton 0.17 ms against Gluon 0.29 ms.
        cell("bf16", 16, 33, 32768, gluon=0.29, triton_m16=0.30, triton_m32=0.2,
             triton_m64=0.17, flashmla=0.09),
        cell("bf16", 8, 2, 8192, gluon=0.0300, triton_m16=0.0295, flashmla=0.02),  # in margin
        cell("bf16", 8, 5, 131072, gluon=0.5, triton_m16=0.4, triton_m32=0.41, flashmla=0.3),
        cell("fp8", 16, 33, 32768, triton_m16=0.2, triton_m32=0.12, triton_m64=0.123,
             fp8t_m32=0.121,
             flashmla=None),
        cell("fp8", 8, 2, 8192),  # nothing of ours timed: no entry
    ]
    cells[-2]["notes"]["flashmla"] = "RuntimeError: unsupported"
    return {**dict(gpu="NVIDIA H200", command="python evals/bench_verify_attention.py --grid",
                   arch="sm_90", force_sm120_configs=False, page=64, rep_ms=8.0, cells=cells),
            **overrides}


def test_table_takes_the_fastest_unless_the_rule_is_within_the_margin():
    table = gen.build_table(grid(), margin=0.03)
    assert table["bf16"] == {(16, 33, 32768): "triton_m64", (8, 2, 8192): "gluon",
                             (8, 5, 131072): "triton_m16"}
    # fp8's rule at 33 x 16 rows on sm_90 is the transposed kernel's 32-row tile: within 3 %
    # of m32, kept; a cell that did not time it gives no entry.
    assert dispatch.rule_method("sm_90", "fp8", 16, 33) == "fp8t_m32"
    assert table["fp8"] == {(16, 33, 32768): "fp8t_m32"}
    assert gen.build_table(grid(), margin=0.0)["fp8"] == {(16, 33, 32768): "triton_m32"}
    old = grid()
    for cell in old["cells"]:
        cell["times"].pop("fp8t_m32", None)
    assert "fp8" not in gen.build_table(old, margin=0.03)


def test_rendered_module_is_the_table_and_lint_clean(tmp_path):
    table = gen.build_table(grid(), margin=0.03)
    source = "verify_attention_grid.json: NVIDIA H200, " + "x" * 250
    text = gen.render(table, source)
    namespace = _run(text)
    assert namespace["TABLE"] == {"sm_90": table} and namespace["SOURCE"] == source
    assert max(len(line) for line in text.splitlines()) <= 100
    src, out = tmp_path / "grid.json", tmp_path / "dispatch_table.py"
    src.write_text(json.dumps(grid()))
    assert gen.main([str(src), "--out", str(out)]) == 0
    assert _run(out.read_text())["TABLE"] == {"sm_90": table}


def _run(text: str) -> dict:
    namespace: dict = {}
    exec(compile(text, "dispatch_table.py", "exec"), namespace)  # noqa: S102
    return namespace


@pytest.mark.parametrize("overrides", [dict(arch="sm_120"), dict(force_sm120_configs=True)])
def test_only_an_sm90_grid_of_the_real_configs_makes_a_table(overrides):
    with pytest.raises(ValueError, match="must be measured on sm_90"):
        gen.build_table(grid(**overrides), margin=0.03)


def test_cells_outside_the_buckets_are_refused():
    bad = grid()
    bad["cells"][0]["rows"] = 16
    with pytest.raises(ValueError, match="outside the dispatch buckets"):
        gen.build_table(bad, margin=0.03)


def test_report_markdown_and_heatmap(tmp_path):
    pytest.importorskip("matplotlib")
    data = grid()
    md, png = tmp_path / "grid.md", tmp_path / "grid.png"
    report_module.write_markdown(data, str(md))
    report_module.write_heatmaps(data, str(png))
    text = md.read_text()
    assert "## bf16 cache" in text and "## fp8 cache" in text
    # H16 33 rows 32k: best 0.17 / FlashMLA 0.09; dispatched today (empty table): gluon.
    row = next(line for line in text.splitlines() if line.startswith("| 16 | 33 | 32k | 0.290"))
    cols = [c.strip() for c in row.strip("|").split("|")]
    # ours best, FlashMLA, best / FlashMLA, dispatched, dispatched / FlashMLA, fp8 / bf16
    assert cols[-6:] == ["0.170", "0.0900", "1.89", "gluon", "3.22", "n/a"]
    fp8_row = next(line for line in text.splitlines() if "| 16 | 33 | 32k | n/a" in line)
    assert fp8_row.rstrip(" |").endswith("0.71")  # fp8 best 0.12 / bf16 best 0.17
    assert "RuntimeError: unsupported" in text
    assert png.stat().st_size > 10_000


def test_split_sweep_choices(monkeypatch):
    """The sweep's split counts are the heuristic's at each minimum of tiles per split:
    H8, 5 rows at 8k on 132 SMs leaves the Gluon grid at 15 CTAs with the shipped 8."""
    from types import SimpleNamespace

    import bench_verify_grid as grid_module
    import torch

    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: SimpleNamespace(multi_processor_count=132))
    assert grid_module.split_choices("gluon", 5, 8, 8192) == {8: 15, 4: 26, 2: 43}
    assert grid_module.split_choices("triton_m64", 65, 64, 32768) == {8: 2, 4: 2, 2: 2}


@pytest.mark.parametrize("heads,rows,want", [
    (8, 2, ["triton_m16", "fp8t_m16"]),
    (16, 2, ["triton_m16", "triton_m32", "fp8t_m16", "fp8t_m32"]),
    (128, 257, ["triton_m32", "triton_m64", "fp8t_m16", "fp8t_m32"]),
])
def test_fp8_cells_time_the_transposed_kernel_and_bf16_gluon(monkeypatch, heads, rows, want):
    """An fp8 cell times the transposed fp8 tiles (the 32-row one from 32 rows) and the
    Gluon kernel on the bf16 cache beside the current fp8 tiles and FlashMLA; a bf16
    cell and an sm_120 proxy run do not."""
    from types import SimpleNamespace

    import bench_verify_grid as grid_module

    monkeypatch.setattr(grid_module, "operands", lambda inp, dtype: {})
    inp = SimpleNamespace(cell=SimpleNamespace(heads=heads, qlen=rows), kv_cache=None)
    fp8 = grid_module.cell_methods(inp, "fp8", sm120=False)
    assert list(fp8) == ["bf16_gluon", *want, "cascade", "cascade_context", "flashmla"]
    assert not [m for m in grid_module.cell_methods(inp, "bf16", sm120=False) if "fp8t" in m]
    assert "cascade" in grid_module.cell_methods(inp, "bf16", sm120=False)
    assert list(grid_module.cell_methods(inp, "fp8", sm120=True)) == ["triton_sm120", "flashmla"]


def test_transposed_and_reference_methods_in_the_report_not_the_table(tmp_path, monkeypatch):
    """fp8t times are ours (a column, in the best, the table's fp8 entries: sm_90's fp8
    rule); bf16_gluon is a reference: the fp8 / bf16 ratio of an fp8-only run, never ours
    and never in the table."""
    cells = [cell("fp8", 16, 33, 32768, triton_m32=0.12, triton_m64=0.123, fp8t_m16=0.09,
                  fp8t_m32=0.06, bf16_gluon=0.08, flashmla=0.04),
             cell("fp8", 8, 2, 8192, triton_m16=0.05, fp8t_m16=0.03, bf16_gluon=0.02,
                  flashmla=0.01)]
    monkeypatch.setattr(dispatch, "TABLE", {})  # "dispatched" is the rule's choice
    data = grid(cells=cells)
    assert gen.build_table(data, margin=0.0)["fp8"] == {(16, 33, 32768): "fp8t_m32",
                                                        (8, 2, 8192): "fp8t_m16"}
    md = tmp_path / "grid.md"
    report_module.write_markdown(data, str(md))
    lines = md.read_text().splitlines()
    header = next(line for line in lines if line.startswith("| H |"))
    assert "| fp8t_m16 | fp8t_m32 | bf16_gluon |" in header
    row = next(line for line in lines if line.startswith("| 16 | 33 | 32k |"))
    cols = [c.strip() for c in row.strip("|").split("|")]
    # ours best 0.06 (fp8t_m32), / FlashMLA; dispatched (the rule) fp8t_m32, / FlashMLA;
    # fp8 best / bf16 Gluon 0.06 / 0.08
    assert cols[-6:] == ["0.0600", "0.0400", "1.50", "fp8t_m32", "1.50", "0.75"]


def test_cascade_is_ours_and_a_table_entry_where_fastest():
    cells = [cell("bf16", 64, 257, 131072, gluon=8.5, cascade=7.5, flashmla=7.4),
             cell("bf16", 8, 2, 8192, gluon=0.031, cascade=0.045, flashmla=0.037),
             cell("fp8", 8, 2, 131072, fp8t_m16=0.15, cascade=0.055, flashmla=0.047)]
    table = gen.build_table(grid(cells=cells), margin=0.03)
    assert table == {"bf16": {(64, 257, 131072): "cascade", (8, 2, 8192): "gluon"},
                     "fp8": {(8, 2, 131072): "cascade"}}
    assert report_module.best_ours(cells[0]["times"]) == ("cascade", 7.5)


def test_grid_keep_merges_the_other_dtypes_cells(tmp_path):
    import bench_verify_grid as grid_module

    path = tmp_path / "grid.json"
    old = grid()
    path.write_text(json.dumps(old))
    new = {**grid(command="python evals/bench_verify_attention.py --grid --grid-dtype fp8"),
           "cells": []}
    fp8 = {("fp8", c["ctx"], c["heads"], c["rows"]) for c in old["cells"]
           if c["dtype"] == "fp8"}
    merged = grid_module.keep_other_cells(new, str(path), fp8)
    assert [c["dtype"] for c in merged["cells"]] == ["bf16"] * 3
    assert merged["command"] == (old["command"] + " && " + new["command"])
    assert grid_module.keep_other_cells(new, str(tmp_path / "none.json"), fp8) is new
    h100 = {**new, "gpu": "NVIDIA H100"}
    assert grid_module.keep_other_cells(h100, str(path), fp8) is h100
    # a narrowed rerun of one bf16 cell keeps the others, and both commands
    narrow = {**grid(command="python evals/bench_verify_attention.py --grid --grid-dtype "
                             "bf16 --grid-heads 8 --grid-rows 2 --grid-ctx 8192"), "cells": []}
    merged = grid_module.keep_other_cells(narrow, str(path), {("bf16", 8192, 8, 2)})
    assert [(c["dtype"], c["heads"], c["rows"]) for c in merged["cells"]] == [
        ("bf16", 16, 33), ("bf16", 8, 5), ("fp8", 16, 33), ("fp8", 8, 2)]
    assert merged["command"] == old["command"] + " && " + narrow["command"]
    # the same narrowed rerun again replaces its own command, not the full run's
    again = grid_module.kept_commands(merged["command"], narrow["command"], set())
    assert again == merged["command"]


def test_written_cells_are_in_grid_order(tmp_path):
    """A narrowed rerun appends its cells after the kept ones; the files list every cell
    in grid order (cache dtype, context, heads, rows), so a rerun cell takes its place."""
    import bench_verify_grid as grid_module

    report = grid()
    report["cells"] = report["cells"][::-1]
    grid_module.write_outputs(report, str(tmp_path / "grid"))
    cells = json.loads((tmp_path / "grid.json").read_text())["cells"]
    assert [(c["dtype"], c["ctx"], c["heads"], c["rows"]) for c in cells] == [
        ("bf16", 8192, 8, 2), ("bf16", 32768, 16, 33), ("bf16", 131072, 8, 5),
        ("fp8", 8192, 8, 2), ("fp8", 32768, 16, 33)]
    assert report["cells"][0]["dtype"] == "fp8"  # the caller's report is left as it was


def test_grid_keep_replaces_the_rerun_dtypes_command():
    import bench_verify_grid as grid_module

    bf16 = "python evals/bench_verify_attention.py --grid --grid-dtype bf16 --grid-keep"
    fp8 = "python evals/bench_verify_attention.py --grid --grid-dtype fp8 --grid-keep"
    fp8_again = fp8 + " --grid-methods cascade"
    both = "python evals/bench_verify_attention.py --grid"
    assert grid_module.kept_commands(f"{bf16} && {fp8}", fp8_again, {"fp8"}) == (
        f"{bf16} && {fp8_again}")
    assert grid_module.kept_commands(f"{bf16} && {fp8} && {bf16}", fp8_again, {"fp8"}) == (
        f"{bf16} && {fp8_again}")
    assert grid_module.kept_commands(both, fp8, {"fp8"}) == f"{both} && {fp8}"
    assert grid_module.kept_commands(f"{both} && {bf16}", fp8, {"bf16", "fp8"}) == fp8


def test_suffix_sweep_candidates_hold_the_shipped_tiles():
    """``--suffix-sweep`` times the cascade's tree part with every candidate tile; the
    tiles ``cascade.suffix_config`` ships are among them, and fp8 leaves out the 64-row
    tiles that spilled."""
    import bench_verify_grid as grid_module

    from vllm_ddtree.attention_backends.mla_tree.cascade import suffix_config

    for dtype in ("bf16", "fp8"):
        got = grid_module.suffix_candidates(dtype)
        assert len(set(got)) == len(got) > 8
        for _, heads, rows in (c for c in grid_module.SUFFIX_CELLS if c[0] == dtype):
            assert suffix_config(rows * heads, dtype == "fp8") in got
    fp8_64 = [c for c in grid_module.suffix_candidates("fp8") if c.block_m == 64]
    assert {(c.block_n, c.num_stages) for c in fp8_64} == {(32, 1)}
