"""The PNG plot of ``evals/bench_e2e.py`` results (CPU only: needs matplotlib): step ms
against context per method, and each step's split into draft / verify / other."""

from __future__ import annotations

import os
from collections import defaultdict

from e2e_report import (
    ANCHORS,
    collapse_repeats,
    ctx_label,
    ok_rows,
    run_id,
    run_label,
    run_sort_key,
)


def _throughput_bars(ax, rows: list[dict], kinds: list[str], order: list[str]) -> None:
    width = 0.8 / max(len(kinds), 1)
    labels = {}
    for k, kind in enumerate(kinds):
        by_run = {run_id(r): r for r in rows if r["kind"] == kind}
        for i, run in enumerate(order):
            r = by_run.get(run)
            if r is None or not r.get("tokens_per_s"):
                continue
            labels[i] = run_label(r)
            x = i + (k - (len(kinds) - 1) / 2) * width
            ax.bar(x, r["tokens_per_s"], width, color=f"C{k}",
                   label=f"{kind} prompts" if i == 0 else None)
            if r.get("acceptance_length") is not None:
                ax.annotate(f"{r['acceptance_length']:.2f}", (x, r["tokens_per_s"]),
                            ha="center", va="bottom", fontsize=6)
    ax.set_xticks(sorted(labels), [labels[i] for i in sorted(labels)], rotation=30,
                  ha="right", fontsize=8)
    ax.set_ylabel("tokens/s")
    ax.legend(fontsize=7)


def write_plot(data: dict, path: str) -> bool:
    """Left: step ms vs context (log2 x) per method (smallest batch, first prompt kind).
    Right: stacked draft / verify / other at the shortest and the longest context."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return False
    rows = ok_rows(collapse_repeats(data.get("rows") or []))
    if not rows:
        return False
    batch = min(r["batch"] for r in rows)
    kinds = sorted({r["kind"] for r in rows if r["batch"] == batch})
    kind = "random" if "random" in kinds else kinds[0]
    sel = [r for r in rows if r["batch"] == batch and r["kind"] == kind]
    runs: dict[str, list[dict]] = defaultdict(list)
    for r in sel:
        runs[run_id(r)].append(r)
    order = sorted(runs, key=lambda k: run_sort_key(runs[k][0]))
    contexts = sorted({r["context"] for r in sel})

    fig, axes = plt.subplots(1, 2, figsize=(14, 5))
    ax = axes[0]
    if len(contexts) > 1:
        anchors = ANCHORS.get(data.get("setup"), {}) if batch == 1 else {}
        ticks = set(contexts)
        for run in order:
            pts = sorted((r["context"], r["step_ms"]) for r in runs[run] if r.get("step_ms"))
            if not pts:
                continue
            (line,) = ax.plot(*zip(*pts, strict=True), marker="o",
                              label=run_label(runs[run][0]))
            if run in anchors:  # vLLM's own reference figure, same colour
                apts = sorted(anchors[run].items())
                ax.plot(*zip(*apts, strict=True), linestyle=":", marker="x", alpha=0.7,
                        color=line.get_color(), label=f"reference: {run_label(runs[run][0])}")
                ticks.update(anchors[run])
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(ticks), [ctx_label(c) for c in sorted(ticks)])
        ax.set_xlabel("context tokens")
        ax.set_ylabel("ms per decoding step")
        ax.set_title(f"{data.get('setup')}: step latency, batch {batch}, {kind} prompts")
        ax.legend(fontsize=7)
    else:  # one context (the trained pair): tokens/s per method and prompt kind
        _throughput_bars(ax, [r for r in rows if r["batch"] == batch], kinds, order)
        ax.set_title(f"{data.get('setup')}: tokens/s at {ctx_label(contexts[0])}, batch "
                     f"{batch} (labels: accept len)")
    ax.grid(True, which="both", alpha=0.3)

    ax = axes[1]
    ends = sorted({contexts[0], contexts[-1]})
    colors = {"draft_ms": "tab:orange", "verify_ms": "tab:blue", "other_ms": "tab:gray"}
    labels, x = [], 0
    for run in order:
        by_ctx = {r["context"]: r for r in runs[run]}
        for c in ends:
            r = by_ctx.get(c)
            if r is None or r.get("step_ms") is None:
                continue
            bottom = 0.0
            for key, color in colors.items():
                value = max(r.get(key) or 0.0, 0.0)
                ax.bar(x, value, bottom=bottom, color=color,
                       label=key[:-3] if x == 0 else None)
                bottom += value
            labels.append(f"{run_label(r)}\n{ctx_label(c)}")
            x += 1
    ax.set_xticks(range(len(labels)), labels, rotation=60, ha="right", fontsize=6)
    ax.set_ylabel("ms per decoding step")
    ax.set_title("split of a step: draft / verify / other (" +
                 " vs ".join(ctx_label(c) for c in ends) + ")")
    ax.grid(True, axis="y", alpha=0.3)
    if labels:
        ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
