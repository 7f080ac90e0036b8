# SPDX-License-Identifier: Apache-2.0
"""Triton vs Gluon (sm_90) MLA tree-verify attention vs FlashMLA, side by side.

One request per cell (bf16, kv_lora 512 + rope 64, a random DDTree-like tree mask for
ours, FlashMLA causal), inputs from ``bench_verify_attention.make_inputs``; each method
timed with ``triton.testing.do_bench_cudagraph`` (CUDA graph replay, no host launch
overhead), all in one run. Columns: milliseconds, the MMA floor (QK^T + PV flops at
``bench_verify_attention.MMA_FLOPS_PER_S``), its fraction reached by Gluon, and the
ratios Triton / Gluon and Gluon / FlashMLA.

    python evals/bench_gluon_mla.py --out evals/results/gluon_mla.md
    python evals/bench_gluon_mla.py --heads 8 --ctx 131072 --qlen 65 --out /tmp/one.md
    python evals/bench_gluon_mla.py --replot evals/results/gluon_mla.md   # PNG only (CPU)
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
for path in (REPO, REPO / "evals"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import triton  # noqa: E402
from bench_verify_attention import (  # noqa: E402
    KV_LORA,
    MMA_FLOPS_PER_S,
    Cell,
    Unavailable,
    flashmla,
    floors_ms,
    make_inputs,
    ours,
)

from vllm_ddtree.attention_backends.mla_tree.gluon_kernel import gluon_supported  # noqa: E402
from vllm_ddtree.attention_backends.mla_tree.ops import mla_tree_fwd_gluon  # noqa: E402

METHODS = ("triton", "gluon", "flashmla")
# Markdown column of each method's time (read_table finds them by name; a table
# without a method's column reads back that method as None).
COLUMNS = {"triton": "Triton ms", "gluon": "Gluon ms", "flashmla": "FlashMLA ms"}


def gluon(inp):
    """Zero-argument callable of the Gluon kernel on ``inp`` (tree mask), or
    Unavailable."""
    if not gluon_supported(inp.q, inp.kv_cache, KV_LORA):
        raise Unavailable("Gluon path unsupported here (needs sm_90, bf16/fp16)")
    kwargs = dict(validate_values=False, max_query_len=inp.cell.qlen,
                  max_seq_len=inp.cell.ctx + inp.cell.qlen)

    def run():
        return mla_tree_fwd_gluon(inp.q, inp.kv_cache, inp.block_table, inp.seq_lens,
                                  inp.query_start_loc, inp.bits_tree, inp.scale, KV_LORA,
                                  **kwargs)

    return run


def time_cell(cell: Cell, rep: int, methods=METHODS) -> tuple[dict, dict]:
    """``(times_ms, notes)`` of every method on one cell; a method that cannot run gets
    None and a note. Also checks Gluon against Triton (max abs difference)."""
    inp = make_inputs(cell, torch.bfloat16)
    makers = {"triton": lambda: ours(inp, inp.bits_tree, kernel="triton"),
              "gluon": lambda: gluon(inp),
              "flashmla": lambda: flashmla(inp)}
    times, notes = {}, {}
    for method in METHODS:
        times[method] = None
        if method not in methods:
            continue
        try:
            fn = makers[method]()
            fn()
            times[method] = triton.testing.do_bench_cudagraph(fn, rep=rep)
        except Unavailable as e:
            notes[method] = str(e)
        except Exception as e:  # noqa: BLE001 - keep timing the other methods
            notes[method] = f"{type(e).__name__}: {e}"[:200]
        torch.cuda.synchronize()
    if times["triton"] is not None and times["gluon"] is not None:
        triton_out = ours(inp, inp.bits_tree, kernel="triton")()[0]
        diff = (gluon(inp)()[0].float() - triton_out.float()).abs().max()
        notes["gluon vs triton max abs diff"] = f"{diff.item():.2e}"
    return times, notes


def read_table(md_path: str) -> list[dict]:
    """The rows of a table this script wrote: heads, ctx, qlen and each method's time
    (ms; None where n/a or where the table has no column for it)."""
    rows, cols = [], None
    for line in Path(md_path).read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells and cells[0] == "heads":
            cols = {name: i for i, name in enumerate(cells)}
            continue
        if cols is None or len(cells) < len(cols) - 1 or not cells[0].isdigit():
            continue
        times = {}
        for method in METHODS:
            i = cols.get(COLUMNS[method])
            times[method] = None if i is None or cells[i] == "n/a" else float(cells[i])
        rows.append(dict(heads=int(cells[0]), ctx=int(cells[1]), qlen=int(cells[2]), **times))
    return rows


def write_plot(rows: list[dict], png_path: str) -> None:
    """Time vs context (log-log), one panel per (heads, qlen), one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["heads"], r["qlen"]) for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8), squeeze=False)
    for ax, (heads, qlen) in zip(axes[0], panels, strict=True):
        sel = sorted((r for r in rows if (r["heads"], r["qlen"]) == (heads, qlen)),
                     key=lambda r: r["ctx"])
        for method in METHODS:
            pts = [(r["ctx"], r[method]) for r in sel if r[method] is not None]
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=method)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"H={heads}, qlen={qlen}")
        ax.set_xlabel("context tokens")
        ax.set_ylabel("ms (CUDA graph)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)


def _ms(t):
    return "n/a" if t is None else f"{t:.3f}"


def _ratio(a, b):
    return "n/a" if a is None or b is None else f"{a / b:.2f}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", nargs="+", type=int, default=[8, 64])
    p.add_argument("--ctx", nargs="+", type=int, default=[8192, 32768, 131072])
    p.add_argument("--qlen", nargs="+", type=int, default=[16, 65])
    p.add_argument("--page", type=int, default=64)
    p.add_argument("--rep", type=int, default=100, help="do_bench_cudagraph rep (ms)")
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS),
                   help="methods to time")
    p.add_argument("--out", help="markdown table path (the PNG beside it)")
    p.add_argument("--replot", metavar="MD", help="only redraw the PNG of a written table")
    args = p.parse_args(argv)
    if args.replot:
        write_plot(read_table(args.replot), str(Path(args.replot).with_suffix(".png")))
        return 0
    if not args.out:
        p.error("--out is required")
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 1
    lines = [
        "# MLA tree verify: Triton vs Gluon (sm_90) vs FlashMLA",
        "",
        f"command: `python evals/bench_gluon_mla.py {shlex.join(argv or sys.argv[1:])}`",
        f"({torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
        f"{triton.__version__}; bf16, one request, page {args.page}; "
        f"triton.testing.do_bench_cudagraph; MMA floor at {MMA_FLOPS_PER_S / 1e12:.0f} "
        "TFLOP/s)",
        "",
        "| heads | ctx | qlen | " + " | ".join(COLUMNS[m] for m in METHODS)
        + " | MMA floor ms | Gluon % of floor | Triton / Gluon | Gluon / FlashMLA | notes |",
        "|---" * (len(METHODS) + 8) + "|",
    ]
    for heads in args.heads:
        for ctx in args.ctx:
            for qlen in args.qlen:
                cell = Cell(heads=heads, ctx=ctx, qlen=qlen, page=args.page)
                times, notes = time_cell(cell, args.rep, args.methods)
                floor = floors_ms(cell)[1]
                frac = "n/a" if times["gluon"] is None else f"{100 * floor / times['gluon']:.0f}"
                note = "; ".join(f"{k}: {v}" for k, v in notes.items())
                lines.append(
                    f"| {heads} | {ctx} | {qlen} | "
                    + " | ".join(_ms(times[m]) for m in METHODS)
                    + f" | {floor:.3f} | {frac} | "
                    f"{_ratio(times['triton'], times['gluon'])} | "
                    f"{_ratio(times['gluon'], times['flashmla'])} | {note} |")
                print(lines[-1], flush=True)
                os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
                Path(args.out).write_text("\n".join(lines) + "\n")
    write_plot(read_table(args.out), str(Path(args.out).with_suffix(".png")))
    print(f"wrote {args.out} and its PNG")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
