"""Host-bound ``bench_e2e`` cells compared at one host speed (CPU only).

On a shared GPU host, batch-1 decode steps are host-bound, and the host's Python
speed (``bench_e2e``'s fixed loop, the rows' ``python_ms`` / ``python_ms_after``) flips
about 2x between cells measured seconds apart, so even ``--lockstep`` pairs rarely run
at equal speed. Over repeats, a cell's step follows its Python ms closely (correlation
0.8-1.0 over repeated kimi8 runs). This script pools the rows of one or more
bench JSONs of a setup and fits, per (prompts, batch, context), one line per run with a
slope shared by all runs (least squares)::

    step_ms = a_run + b * python_ms        (python_ms: mean of before / after the cell)

It reports each run's step at the group's median Python ms, its tokens/s there (mean
tokens per step over the adjusted step) and that over vLLM's DFlash chain, with a
bootstrap interval (each run's points resampled), beside each run's own slope (a check
on the shared slope) and its median measured step; then the parts of a step (GPU spans
and host regions, ``STEP_PARTS``) fitted the same way. This is an adjustment under a model,
not a measurement: read it beside the paired rounds, never instead of them.

Usage::

    python evals/host_adjusted_steps.py /tmp/run_a/e2e_kimi8.json \\
        /tmp/run_b/e2e_kimi8.json --out evals/results/host_adjusted_kimi8
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from e2e_report import ctx_label, run_label, run_sort_key

BOOTSTRAP_SAMPLES = 2000
# Parts of a step fitted like the step itself: (row key or host region, column name).
STEP_PARTS = (("draft_ms", "draft (GPU span)"), ("verify_ms", "verify (GPU span)"),
              ("other_ms", "other"), ("host:verify", "host execute_model"),
              ("host:sample_tokens", "host sample_tokens"), ("host:draft", "host propose"),
              ("host:dflash_propose", "host vLLM DFlash propose"),
              ("host:compact", "host KV compaction"), ("host:store_trees", "host tree scatter"),
              ("host:verifier", "host verifier"))


@dataclass
class Point:
    python_ms: float
    step_ms: float
    tokens_per_step: float
    parts: dict[str, float] = field(default_factory=dict)  # STEP_PARTS keys present


@dataclass
class RunFit:
    run: str
    label: str
    points: list[Point]
    adjusted_step_ms: float
    adjusted_tokens_per_s: float
    own_slope: float | None
    x_chain: float | None = None
    x_chain_interval: tuple[float, float] | None = None


def host_points(rows: list[dict]) -> dict[tuple, dict[str, list[Point]]]:
    """``{(setup, prompts, batch, context): {run: [Point]}}`` from measured rows that
    carry both Python ms readings (failed, skipped and older rows are left out)."""
    groups: dict[tuple, dict[str, list[Point]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        if (r.get("status") != "ok" or not r.get("step_ms") or not r.get("python_ms")
                or not r.get("python_ms_after") or not r.get("tokens_per_s")):
            continue
        key = (r.get("setup"), r["kind"], r["batch"], r["context"])
        regions = r.get("host_regions_ms") or {}
        # a region a run never enters (the chain's KV compaction) reads 0; rows
        # measured before the regions were kept have none
        parts = {name: (regions.get(name[5:], 0.0) if regions else None)
                 if name.startswith("host:") else r.get(name) for name, _ in STEP_PARTS}
        groups[key][r["run"]].append(Point(
            python_ms=(r["python_ms"] + r["python_ms_after"]) / 2, step_ms=r["step_ms"],
            tokens_per_step=r["tokens_per_s"] * r["step_ms"] / 1000,
            parts={k: v for k, v in parts.items() if v is not None}))
    return groups


def shared_slope_fit(points_by_run: dict[str, list[Point]],
                     value: Callable[[Point], float] = lambda p: p.step_ms,
                     ) -> tuple[dict[str, float], float]:
    """Least-squares ``value = a_run + b * python_ms`` over every run's points (value:
    the step ms by default): returns (``{run: a_run}``, ``b``)."""
    runs = list(points_by_run)
    design, target = [], []
    for i, run in enumerate(runs):
        for p in points_by_run[run]:
            row = [0.0] * len(runs)
            row[i] = 1.0
            design.append(row + [p.python_ms])
            target.append(value(p))
    coef, *_ = np.linalg.lstsq(np.array(design), np.array(target), rcond=None)
    return dict(zip(runs, coef[:-1].tolist(), strict=True)), float(coef[-1])


def _chain_run(runs: list[str]) -> str | None:
    chains = sorted(r for r in runs if r.startswith("dflash@"))
    return chains[0] if chains else None


def _adjusted(points_by_run: dict[str, list[Point]], x_ref: float,
              fit: tuple[dict[str, float], float] | None = None) -> dict[str, float]:
    """Adjusted tokens/s per run at Python ms ``x_ref`` (``fit``: the runs'
    ``shared_slope_fit``, made here when not given)."""
    intercepts, slope = fit or shared_slope_fit(points_by_run)
    return {run: 1000 * statistics.fmean(p.tokens_per_step for p in pts)
            / (intercepts[run] + slope * x_ref) for run, pts in points_by_run.items()}


def fit_group(points_by_run: dict[str, list[Point]], rows_by_run: dict[str, dict],
              seed: int = 0) -> tuple[float, float, list[RunFit]] | None:
    """The shared-slope fit of one group: (reference Python ms, slope, per-run fits),
    or None when it is undetermined (fewer than two runs, or no spread of Python ms
    within the runs)."""
    if len(points_by_run) < 2:
        return None
    spread = [p.python_ms - statistics.fmean(q.python_ms for q in pts)
              for pts in points_by_run.values() for p in pts]
    if max(abs(s) for s in spread) < 1e-9:
        return None
    x_ref = statistics.median(p.python_ms for pts in points_by_run.values() for p in pts)
    intercepts, slope = shared_slope_fit(points_by_run)
    tps = _adjusted(points_by_run, x_ref, (intercepts, slope))
    chain = _chain_run(list(points_by_run))
    rng = np.random.default_rng(seed)
    ratios: dict[str, list[float]] = defaultdict(list)
    if chain is not None:
        for _ in range(BOOTSTRAP_SAMPLES):
            sample = {run: [pts[i] for i in rng.integers(0, len(pts), len(pts))]
                      for run, pts in points_by_run.items()}
            sample_tps = _adjusted(sample, x_ref)
            for run in sample:
                ratios[run].append(sample_tps[run] / sample_tps[chain])
    fits = []
    for run, pts in points_by_run.items():
        xs = [p.python_ms for p in pts]
        own = (float(np.polyfit(xs, [p.step_ms for p in pts], 1)[0])
               if len(pts) >= 3 and max(xs) > min(xs) else None)
        fit = RunFit(run, run_label(rows_by_run[run]), pts, intercepts[run] + slope * x_ref,
                     tps[run], own)
        if chain is not None and run != chain:
            fit.x_chain = tps[run] / tps[chain]
            lo, hi = np.percentile(ratios[run], [5, 95])
            fit.x_chain_interval = (float(lo), float(hi))
        fits.append(fit)
    fits.sort(key=lambda f: run_sort_key(rows_by_run[f.run]))
    return x_ref, slope, fits


def _parts_table(points_by_run: dict[str, list[Point]], fits: list[RunFit],
                 x_ref: float) -> list[str]:
    """Each part of a step (``STEP_PARTS``) fitted like the step, at ``x_ref``: a
    markdown table, runs as rows, with each part's shared slope in the last row."""
    columns, slopes, values = [], [], {f.run: [] for f in fits}
    for key, name in STEP_PARTS:
        # runs that never enter the part (AR's propose, the chain's KV compaction)
        # are left out of its fit and read "—"
        runs = {run: pts for run, pts in points_by_run.items()
                if all(key in p.parts for p in pts) and any(p.parts[key] for p in pts)}
        if not runs or (len(runs) == 1 and len(next(iter(runs.values()))) < 2):
            continue
        intercepts, slope = shared_slope_fit(runs, lambda p, key=key: p.parts[key])
        columns.append(name)
        slopes.append(f"{round(slope, 2) + 0.0:.2f}")
        for f in fits:
            values[f.run].append(f"{round(intercepts[f.run] + slope * x_ref, 2) + 0.0:.2f}"
                                 if f.run in intercepts else "—")  # + 0.0: no "-0.00"
    if not columns:
        return []
    lines = ["Parts of a step at the reference Python ms (ms per decode step, same fit):", "",
             "| run | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
    lines += [f"| {f.label} | " + " | ".join(values[f.run]) + " |" for f in fits]
    lines += ["| *shared slope* | " + " | ".join(slopes) + " |", ""]
    return lines


def report(data_files: list[Path], out: Path) -> str:
    """Markdown of every group of the pooled rows (also written to ``out``.md, with a
    PNG of the points and fitted lines to ``out``.png)."""
    rows = [r for f in data_files for r in json.loads(f.read_text())["rows"]]
    groups = host_points(rows)
    rows_by_run = {r["run"]: r for r in rows}
    lines = ["# Steps at one host speed (shared-slope fit of step ms on Python ms)", "",
             "Pooled from: " + ", ".join(f"`{f.name}`" for f in data_files) + ".", "",
             "Command: `python evals/host_adjusted_steps.py "
             + " ".join(str(f) for f in data_files) + f" --out {out}`", "",
             "Per group, `step = a_run + b * Python ms` with one slope `b` for all runs; "
             "*adjusted* = at the group's median Python ms. *x chain* = adjusted tokens/s "
             "over vLLM's DFlash chain's, with a 90 % bootstrap interval (each run's points "
             "resampled). *own slope*: each run fitted alone (a check on the shared "
             "slope). *extrapolated*: the reference lies outside the run's own Python ms "
             "range. An adjustment under a model, not a measurement.", ""]
    plotted = []
    for key in sorted(groups, key=lambda k: (str(k[0]), k[1], k[2], k[3])):
        setup, kind, batch, context = key
        fitted = fit_group(groups[key], rows_by_run)
        title = f"{setup}, {kind} prompts, batch {batch}, {ctx_label(context)}"
        if fitted is None:
            lines += [f"## {title}", "", "Not fitted: fewer than two runs, or no spread "
                      "of Python ms within the runs.", ""]
            continue
        x_ref, slope, fits = fitted
        plotted.append((title, x_ref, slope, fits))
        lines += [f"## {title}", "", f"Shared slope {slope:.2f} ms of step per ms of "
                  f"Python loop; reference Python ms {x_ref:.2f}.", "",
                  "| run | n | Python ms range | median step ms | adjusted step ms | "
                  "adjusted tok/s | x chain (90 % interval) | own slope |",
                  "|---|---|---|---|---|---|---|---|"]
        for f in fits:
            xs = [p.python_ms for p in f.points]
            ratio = "—" if f.x_chain is None else (
                f"{f.x_chain:.2f} ({f.x_chain_interval[0]:.2f}-{f.x_chain_interval[1]:.2f})")
            own = "—" if f.own_slope is None else f"{f.own_slope:.2f}"
            # outside the run's own Python ms: the line is extrapolated there
            mark = "" if min(xs) <= x_ref <= max(xs) else " (extrapolated)"
            lines.append(
                f"| {f.label} | {len(f.points)} | {min(xs):.2f}-{max(xs):.2f} | "
                f"{statistics.median(p.step_ms for p in f.points):.2f} | "
                f"{f.adjusted_step_ms:.2f}{mark} | {f.adjusted_tokens_per_s:.0f} | {ratio} | "
                f"{own} |")
        lines += [""] + _parts_table(groups[key], fits, x_ref)
    text = "\n".join(lines)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(text)
    if plotted:
        _plot(plotted, out.with_suffix(".png"))
    return text


def _plot(plotted: list, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(plotted), figsize=(4.5 * len(plotted), 4), squeeze=False)
    for ax, (title, x_ref, slope, fits) in zip(axes[0], plotted, strict=True):
        for f in fits:
            xs = np.array([p.python_ms for p in f.points])
            (dots,) = ax.plot(xs, [p.step_ms for p in f.points], "o", label=f.label)
            line_x = np.linspace(xs.min(), xs.max(), 2)
            intercept = f.adjusted_step_ms - slope * x_ref
            ax.plot(line_x, intercept + slope * line_x, "-", color=dots.get_color())
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("Python ms (fixed loop)")
        ax.set_ylabel("step ms")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("data", nargs="+", type=Path, help="bench_e2e JSON files of one setup")
    p.add_argument("--out", type=Path, required=True, help="output path without suffix")
    args = p.parse_args(argv)
    print(report(args.data, args.out))


if __name__ == "__main__":
    main()
