# SPDX-License-Identifier: Apache-2.0
"""Markdown and heatmaps of the verify-attention grid's JSON (``bench_verify_grid.py``);
CPU-only, so a JSON can be re-rendered anywhere:

    python evals/verify_grid_report.py evals/results/verify_attention_grid.json
"""

from __future__ import annotations

import argparse
import math

from vllm_ddtree.attention_backends.mla_tree.dispatch import dispatch_method

OURS_ORDER = ("gluon", "cascade", "triton_m16", "triton_m32", "triton_m64", "triton_sm120",
              "fp8t_m16", "fp8t_m32")
# Timed for comparison, not ours for the cell's cache: the Gluon kernel on the bf16 cache of
# an fp8 cell, the cascade's context part alone (``bench_verify_grid.cell_methods``).
REFERENCE_ORDER = ("bf16_gluon", "cascade_context")


def _ms(t: float | None) -> str:
    return "n/a" if t is None else f"{t:.4f}" if t < 0.1 else f"{t:.3f}"


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a and b else "n/a"


def _ctx(n: int) -> str:
    return f"{n // 1024}k"


def best_ours(times: dict) -> tuple[str | None, float | None]:
    ours = {m: t for m, t in times.items() if m in OURS_ORDER and t is not None}
    if not ours:
        return None, None
    best = min(ours, key=ours.get)
    return best, ours[best]


def dispatched(report: dict, cell: dict) -> str | None:
    """The method ``mla_tree_verify`` takes for the cell today (shipped table or rule),
    as a grid method name; None under ``--force-sm120-configs`` (one config only)."""
    if report.get("force_sm120_configs"):
        return "triton_sm120"
    return dispatch_method(report.get("arch"), cell["dtype"], cell["heads"], cell["rows"],
                           cell["ctx"] + cell["rows"])


def _bf16_best(report: dict) -> dict:
    return {(c["heads"], c["rows"], c["ctx"]): best_ours(c["times"])[1]
            for c in report["cells"] if c["dtype"] == "bf16"}


def write_markdown(report: dict, path: str) -> None:
    methods = [m for m in OURS_ORDER + REFERENCE_ORDER
               if any(m in c["times"] or m in c["notes"] for c in report["cells"])]
    header = (["H", "rows", "ctx", *methods, "ours best", "FlashMLA", "best / FlashMLA",
               "dispatched", "dispatched / FlashMLA", "fp8 best / bf16 best"])
    bf16 = _bf16_best(report)
    title = "MLA verify attention grid: ours vs FlashMLA"
    if report.get("force_sm120_configs"):
        title += " (sm_120 tile configs forced: a proxy)"
    lines = [f"# {title}", "", f"- GPU: {report['gpu']} ({report['arch']})",
             f"- command: `{report['command']}`",
             f"- one request, page {report['page']}, kv_lora_rank 512 + rope 64; ms per call, "
             "calls captured in a CUDA graph with an L2 flush before each (flush time "
             f"subtracted), about {report['rep_ms']:g} ms of calls per graph, median of 5 "
             "replays; ours with a DDTree-like tree mask, FlashMLA causal",
             "- fp8: e4m3 latent cache with one scale (vLLM's --kv-cache-dtype fp8); "
             "FlashMLA's dense fp8 path also takes fp8 queries",
             "- dispatched: what `mla_tree_verify` launches for the cell today "
             "(`attention_backends/mla_tree/dispatch_table.py`, else the rule)",
             "- cascade: FlashMLA's dense decode over the context (fp8 cells: its fp8 path; "
             "every fp8 method reads vLLM's e4m3 query) and our Triton kernel over the tree, "
             "folding the context in (`attention_backends/mla_tree/cascade.py`); its step "
             "plan (context lengths, FlashMLA's schedule) made once per step by the first "
             "layer and not timed here",
             "- fp8t_m16 / fp8t_m32 (fp8 cells): the fp8 kernel with transposed products "
             "(`configs.FP8_TRANSPOSED_TILE_CONFIGS`, sm_90's fp8 rule); bf16_gluon: the Gluon "
             "kernel on the fp8 cell's bf16 cache, not counted as ours, the fp8 / bf16 "
             "ratio's reference where the run has no bf16 cell"]
    notes: dict[str, set[str]] = {}
    for dtype in ("bf16", "fp8"):
        cells = [c for c in report["cells"] if c["dtype"] == dtype]
        if not cells:
            continue
        lines += ["", f"## {dtype} cache", "", "| " + " | ".join(header) + " |",
                  "|" + "---|" * len(header)]
        for c in cells:
            times = c["times"]
            _, best = best_ours(times)
            fm = times.get("flashmla")
            chosen = dispatched(report, c)
            chosen_t = times.get(chosen) if chosen else None
            own_bf16 = None
            if dtype == "fp8":  # the bf16 cell's best, else this cell's bf16 Gluon time
                own_bf16 = bf16.get((c["heads"], c["rows"], c["ctx"])) or times.get("bf16_gluon")
            row = [str(c["heads"]), str(c["rows"]), _ctx(c["ctx"])]
            row += [_ms(times.get(m)) for m in methods]
            row += [_ms(best), _ms(fm), _ratio(best, fm), chosen or "n/a",
                    _ratio(chosen_t, fm), _ratio(best, own_bf16)]
            lines.append("| " + " | ".join(row) + " |")
            for method, note in c["notes"].items():
                notes.setdefault(f"{dtype} {method}", set()).add(note)
    if notes:
        lines += ["", "notes (why a cell is n/a):"]
        lines += [f"- {name}: " + "; ".join(sorted(n))[:400] for name, n in sorted(notes.items())]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def write_heatmaps(report: dict, path: str) -> None:
    """One heatmap per (cache dtype, context) of time ratios per (H, rows): bf16, the best
    of ours / FlashMLA; fp8, the best of ours / our bf16 time (the cell's bf16 best, else
    its bf16 Gluon time): what the fp8 cache buys over serving bf16."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(c["dtype"], c["ctx"]) for c in report["cells"]},
                    key=lambda p: (p[0] != "bf16", p[1]))
    if not panels:
        return
    heads = sorted({c["heads"] for c in report["cells"]})
    rows = sorted({c["rows"] for c in report["cells"]})
    dtypes = sorted({p[0] for p in panels}, key=lambda d: d != "bf16")
    ctxs = sorted({p[1] for p in panels})
    fig, axes = plt.subplots(len(dtypes), len(ctxs), squeeze=False,
                             figsize=(1.0 + 0.75 * len(rows) * len(ctxs), 0.9 + 2.6 * len(dtypes)))
    bf16 = _bf16_best(report)
    image = None
    for i, dtype in enumerate(dtypes):
        for j, ctx in enumerate(ctxs):
            ax = axes[i][j]
            grid = [[math.nan] * len(rows) for _ in heads]
            for c in report["cells"]:
                if (c["dtype"], c["ctx"]) != (dtype, ctx):
                    continue
                _, best = best_ours(c["times"])
                base = c["times"].get("flashmla")
                if dtype == "fp8":
                    base = (bf16.get((c["heads"], c["rows"], c["ctx"]))
                            or c["times"].get("bf16_gluon"))
                if best and base:
                    grid[heads.index(c["heads"])][rows.index(c["rows"])] = best / base
            image = ax.imshow(grid, cmap="RdYlGn_r", vmin=0.5, vmax=2.0, aspect="auto")
            for y, line in enumerate(grid):
                for x, value in enumerate(line):
                    if not math.isnan(value):
                        ax.text(x, y, f"{value:.2f}", ha="center", va="center", fontsize=7)
            ax.set_xticks(range(len(rows)), [str(r) for r in rows], fontsize=7)
            ax.set_yticks(range(len(heads)), [str(h) for h in heads], fontsize=7)
            what = "ours / FlashMLA" if dtype == "bf16" else "ours fp8 / our bf16"
            ax.set(xlabel="query rows", ylabel="heads",
                   title=f"{dtype}, {_ctx(ctx)}: {what}")
    fig.suptitle("time ratio of our best kernel, lower is better", fontsize=10)
    if image is not None:
        fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.8)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    import json

    p = argparse.ArgumentParser(description="re-render the grid's markdown and PNG")
    p.add_argument("json")
    args = p.parse_args(argv)
    with open(args.json) as f:
        report = json.load(f)
    stem = args.json.removesuffix(".json")
    write_markdown(report, stem + ".md")
    write_heatmaps(report, stem + ".png")
    print(f"wrote {stem}.md and {stem}.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
