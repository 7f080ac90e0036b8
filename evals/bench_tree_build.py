# SPDX-License-Identifier: Apache-2.0
"""Benchmark the DDTree tree build as the drafter's CUDA graph runs it, side by side.

The H200 end-to-end run (``evals/results/e2e_trained.md``) put DDTree's draft step at
3.1 ms against 0.9 ms for vLLM's DFlash chain with the same drafter: the tree build's
small kernels. This times each way of building the same trees, captured in a CUDA
graph and replayed (as ``_generate_draft`` runs), on the same logits:

- ``per-depth torch``: ``build_ddtree`` with the vocabulary ranked depth by depth (the
  code of that run);
- ``batched torch``: ``build_ddtree`` as it is now (one ranking for every depth);
- ``triton, torch ranking + bits``: the build kernel after the PyTorch ranking (int64
  keys + ``topk``), then ``DraftTree.ancestor_bits``' ~30 small kernels (the build
  before the ranking and the ancestor bits moved into Triton);
- ``triton``: ``tree_build_kernel.build_ddtree_triton`` as the speculator runs it now:
  log-softmax, the two ranking launches of ``vocab_top_k_kernel``, one launch for the
  beams, the merge and the ancestor bits;
- ``triton: ranking only`` / ``triton: build launch only``: the two halves of
  ``triton`` timed apart (where its time goes);
- ``chain argmax``: what DFlash's ``sample_draft`` does instead (greedy argmax of the
  ``[R, L, V]`` logits), the floor the tree build is compared with.

Every variant's trees are checked equal to ``build_ddtree``'s before timing.

Usage (GPU):
    python evals/bench_tree_build.py                       # R 1/8/32, V 4k/152k, B 16-128
    python evals/bench_tree_build.py --requests 1 --vocab 4096 --budgets 32 64
Writes ``evals/results/tree_build.md`` and ``.png`` (time vs budget, log scale).
On CPU (``--device cpu``, no graphs) it only checks the variants and times them
eagerly, for a dry run.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from vllm_ddtree.tree import build_kernel as tree_build_kernel  # noqa: E402
from vllm_ddtree.tree import draft_tree as tree_mod  # noqa: E402
from vllm_ddtree.tree.build_kernel import build_ddtree_triton  # noqa: E402
from vllm_ddtree.tree.draft_tree import DraftTree, build_ddtree  # noqa: E402

OUT_DIR = REPO / "evals" / "results"


def build_per_depth(logits: torch.Tensor, budget: int) -> DraftTree:
    """``build_ddtree`` ranking one depth at a time (the pre-batching code path)."""
    saved = tree_mod._RANK_BATCH_BYTES
    tree_mod._RANK_BATCH_BYTES = 1
    try:
        return build_ddtree(logits, budget)
    finally:
        tree_mod._RANK_BATCH_BYTES = saved


def build_triton_torch_ranking(logits: torch.Tensor, budget: int) -> torch.Tensor:
    """The build kernel after the PyTorch ranking, ancestor bits by PyTorch (the
    pre-``vocab_top_k_kernel`` path); returns the bits (the tree is checked in ``run``)."""
    saved = tree_build_kernel._ranked_top_k
    tree_build_kernel._ranked_top_k = tree_mod._ranked_top_k_by_depth
    try:
        tree = build_ddtree_triton(logits, budget)
    finally:
        tree_build_kernel._ranked_top_k = saved
    return DraftTree(tree.tokens, tree.parents, tree.depths, tree.scores).ancestor_bits()


def ranking_only(logits: torch.Tensor, budget: int):
    """The ``triton`` variant's vocabulary ranking alone (``.float()``, log-softmax, the
    two ``vocab_top_k_kernel`` launches)."""
    return tree_build_kernel._ranked_top_k(logits, min(budget, logits.shape[-1]))


_RANKED: dict = {}


def build_launch_only(logits: torch.Tensor, budget: int) -> DraftTree:
    """The ``triton`` variant's build launch alone (beams, merge, ancestor bits), on a
    ranking made once outside the timed graph."""
    key = (logits.data_ptr(), tuple(logits.shape), budget)
    if key not in _RANKED:
        _RANKED[key] = ranking_only(logits, budget)
    saved = tree_build_kernel._ranked_top_k
    tree_build_kernel._ranked_top_k = lambda *args: _RANKED[key]
    try:
        return build_ddtree_triton(logits, budget)
    finally:
        tree_build_kernel._ranked_top_k = saved


def chain_argmax(logits: torch.Tensor, budget: int) -> torch.Tensor:
    return logits.argmax(dim=-1)


VARIANTS = {
    "per-depth torch": build_per_depth,
    "batched torch": build_ddtree,
    "triton, torch ranking + bits": build_triton_torch_ranking,
    "triton": build_ddtree_triton,
    "triton: ranking only": ranking_only,
    "triton: build launch only": build_launch_only,
    "chain argmax": chain_argmax,
}


def same_tree(a: DraftTree, b: DraftTree) -> bool:
    return all(torch.equal(getattr(a, n), getattr(b, n))
               for n in ("tokens", "parents", "depths", "scores"))


def time_variant(fn, logits: torch.Tensor, budget: int, iters: int) -> float:
    """Mean milliseconds of one replay of ``fn`` captured in a CUDA graph (CUDA), or
    of one eager call (CPU)."""
    if logits.device.type != "cuda":
        fn(logits, budget)
        start = time.perf_counter()
        for _ in range(iters):
            fn(logits, budget)
        return (time.perf_counter() - start) / iters * 1e3
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm-up: Triton JIT, host-made tables, allocator
            fn(logits, budget)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(logits, budget)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def run(args) -> list[dict]:
    device = torch.device(args.device)
    rows = []
    cells = [(r, v, b) for r in args.requests for v in args.vocab for b in args.budgets]
    for requests, vocab, budget in tqdm(cells, desc="cells"):
        gen = torch.Generator().manual_seed(requests * 7 + budget)
        logits = (torch.randn(requests, args.depths, vocab, generator=gen) * 3).to(
            device, torch.bfloat16)
        want = build_ddtree(logits, budget)
        for name in ("per-depth torch", "triton", "triton: build launch only"):
            got = VARIANTS[name](logits, budget)
            if got is None or not same_tree(got, want):
                raise AssertionError(f"{name} built other trees (R={requests}, V={vocab}, "
                                     f"B={budget})")
        if not torch.equal(VARIANTS["triton"](logits, budget).packed_bits,
                           want.ancestor_bits()) or not torch.equal(
                build_triton_torch_ranking(logits, budget), want.ancestor_bits()):
            raise AssertionError(f"other ancestor bits (R={requests}, V={vocab}, B={budget})")
        row = {"requests": requests, "vocab": vocab, "budget": budget}
        for name, fn in VARIANTS.items():
            row[name] = time_variant(fn, logits, budget, args.iters)
        rows.append(row)
    return rows


def write(rows: list[dict], args, command: str) -> None:
    names = list(VARIANTS)
    lines = ["# Tree build inside a CUDA graph (`evals/bench_tree_build.py`)", "",
             f"command: `{command}`", "",
             f"device: {torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'}; "
             f"L = {args.depths} depths, bf16 logits; ms per graph replay "
             f"(mean of {args.iters}); ratios against `per-depth torch` (the first "
             "batched build).", "",
             "| R | V | B | " + " | ".join(names)
             + " | triton speed-up | triton vs torch ranking + bits |",
             "|---|---|---|" + "---|" * (len(names) + 2)]
    for row in rows:
        cells = " | ".join(f"{row[n]:.3f}" for n in names)
        lines.append(f"| {row['requests']} | {row['vocab']} | {row['budget']} | {cells} | "
                     f"{row['per-depth torch'] / row['triton']:.1f}x | "
                     f"{row['triton, torch ranking + bits'] / row['triton']:.2f}x |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(args.requests), figsize=(5 * len(args.requests), 4),
                             squeeze=False)
    for ax, requests in zip(axes[0], args.requests, strict=True):
        for name in names:
            for vocab in args.vocab:
                pts = [(r["budget"], r[name]) for r in rows
                       if r["requests"] == requests and r["vocab"] == vocab]
                if pts:
                    ax.plot(*zip(*pts, strict=True), marker="o", label=f"{name}, V={vocab}")
        ax.set(xscale="log", yscale="log", xlabel="budget B", ylabel="ms per replay",
               title=f"R = {requests}")
    axes[0][0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)
    print(f"wrote {out.with_suffix('.md')} and {out.with_suffix('.png')}")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", nargs="+", type=int, default=[1, 8, 32])
    p.add_argument("--vocab", nargs="+", type=int, default=[4096, 151936])
    p.add_argument("--budgets", nargs="+", type=int, default=[16, 32, 64, 128])
    p.add_argument("--depths", type=int, default=15)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=str(OUT_DIR / "tree_build.md"))
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    command = "python evals/bench_tree_build.py " + shlex.join(argv or sys.argv[1:])
    write(run(args), args, command)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
