# SPDX-License-Identifier: Apache-2.0
"""evals/host_adjusted_steps.py on synthetic bench rows: the shared-slope fit recovers
known intercepts and slope, the ratios to the chain follow, and rows without the host
readings or of a lone run are left out."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "evals"))
import host_adjusted_steps as has  # noqa: E402


def row(run, method, python_ms, step_ms, context=1024, accept=1.0, **extra):
    return dict(dict(setup="kimi8", kind="random", batch=1, context=context, run=run,
                     method=method,
                     backend="CUSTOM" if method == "ddtree" else "FLASH_ATTN_MLA",
                     budget=64 if method == "ddtree" else None, status="ok",
                     step_ms=step_ms, python_ms=python_ms - 0.1,
                     python_ms_after=python_ms + 0.1,
                     tokens_per_s=1000 * accept / step_ms), **extra)


def synthetic(slope=0.5, chain=4.0, tree=3.6):
    """The chain's and the tree's cells measured on different host speeds: the tree's
    raw median step is the larger, its step at one host speed the smaller."""
    rows = [row("dflash@FLASH_ATTN_MLA", "dflash", x, chain + slope * x) for x in (1.5, 2.0, 2.5)]
    rows += [row("ddtree-64", "ddtree", x, tree + slope * x) for x in (3.0, 3.5, 4.0)]
    return rows


def test_shared_slope_fit_recovers_intercepts_and_slope():
    groups = has.host_points(synthetic())
    (points,) = groups.values()
    intercepts, slope = has.shared_slope_fit(points)
    assert slope == pytest.approx(0.5)
    assert intercepts == pytest.approx({"dflash@FLASH_ATTN_MLA": 4.0, "ddtree-64": 3.6})


def test_group_fit_compares_at_one_host_speed(tmp_path):
    data = tmp_path / "e2e_kimi8.json"
    rows = synthetic() + [
        row("ddtree-64", "ddtree", 2.0, 9.0, status="failed"),  # left out: failed
        dict(row("ar@FLASH_ATTN_MLA", "ar", 2.0, 2.0), python_ms=None),  # no reading
        row("ddtree-64", "ddtree", 2.0, 5.0, context=2048),  # a lone run in its group
    ]
    data.write_text(json.dumps({"rows": rows}))
    text = has.report([data], tmp_path / "out")
    x_ref = 2.75  # median of the six Python ms readings
    chain_step, tree_step = 4.0 + 0.5 * x_ref, 3.6 + 0.5 * x_ref
    (line,) = [s for s in text.splitlines() if s.startswith("| DDTree B=64 | 3 |")]
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[2:4] == ["3.00-4.00", "5.35"]  # raw median above the chain's 5.00
    assert cells[4].endswith("(extrapolated)")
    assert float(cells[4].split()[0]) == pytest.approx(tree_step, abs=0.006)
    assert float(cells[6].split()[0]) == pytest.approx(chain_step / tree_step, abs=0.006)
    assert "AR" not in text.split("## kimi8, random prompts, batch 1, 1k")[1].split("##")[0]
    assert "## kimi8, random prompts, batch 1, 2k" in text and "Not fitted" in text
    assert (tmp_path / "out.md").read_text() == text and (tmp_path / "out.png").exists()


def test_interval_holds_the_estimate_and_narrows_with_agreeing_points():
    rows = synthetic()
    rows += [row("ddtree-64", "ddtree", 3.2, 3.6 + 0.5 * 3.2 + 0.2),
             row("dflash@FLASH_ATTN_MLA", "dflash", 1.8, 4.0 + 0.5 * 1.8 - 0.2)]
    (points,) = has.host_points(rows).values()
    by_run = {r["run"]: r for r in rows}
    _, _, fits = has.fit_group(points, by_run)
    (tree,) = [f for f in fits if f.run == "ddtree-64"]
    lo, hi = tree.x_chain_interval
    assert lo <= tree.x_chain <= hi and tree.x_chain > 1
    chain = [f for f in fits if f.run.startswith("dflash")][0]
    assert chain.x_chain is None and chain.own_slope is not None
    assert has.fit_group({"ddtree-64": points["ddtree-64"]}, by_run) is None


def test_parts_of_a_step_are_fitted_like_the_step(tmp_path):
    """GPU spans and host regions at the reference Python ms; a region the chain never
    enters reads 0 for it, and rows without host regions leave those columns out."""
    rows = []
    for r in synthetic():
        tree = r["method"] == "ddtree"
        x = (r["python_ms"] + r["python_ms_after"]) / 2
        rows.append(dict(r, draft_ms=2.0 + 0.1 * x,
                         host_regions_ms={"draft": 1.0 + 0.3 * x + (0.5 if tree else 0.0),
                                          **({"compact": 0.14} if tree else {})}))
    data = tmp_path / "e2e_kimi8.json"
    data.write_text(json.dumps({"rows": rows}))
    text = has.report([data], tmp_path / "out")
    table = text.split("Parts of a step")[1]
    assert "| run | draft (GPU span) | host propose | host KV compaction |" in table
    x_ref = 2.75

    def cells(label):
        (line,) = [s for s in table.splitlines() if s.startswith(f"| {label} |")]
        return [c.strip() for c in line.strip("|").split("|")][1:]

    assert [float(c) for c in cells("DDTree B=64")] == pytest.approx(
        (2.0 + 0.1 * x_ref, 1.5 + 0.3 * x_ref, 0.14), abs=0.006)
    chain = cells("DFlash chain, FA-MLA")
    assert [float(c) for c in chain[:2]] == pytest.approx(
        (2.0 + 0.1 * x_ref, 1.0 + 0.3 * x_ref), abs=0.006)
    assert chain[2] == "—"  # the chain never compacts: out of that fit
    assert cells("*shared slope*") == ["0.10", "0.30", "0.00"]
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps({"rows": synthetic()}))
    assert "Parts of a step" not in has.report([bare], tmp_path / "bare")
