# SPDX-License-Identifier: Apache-2.0
"""The verify-attention grid (``bench_verify_attention.py --grid``): every MLA tree-verify
kernel and tile config of ours against FlashMLA over H 8/16/32/64/128, query rows
2/5/9/17/33/65/129/257 and contexts 8k/32k/128k, with a bf16 and an fp8 (e4m3) latent
cache; one request, page 64, each method timed in a CUDA graph
(``graph_timing.graph_time_ms``: captured calls with an L2 flush before each,
replayed, median of 5 replays).

Methods per cell: the Gluon kernel (bf16 only), the Triton kernel forced to each tile
config that fits the rows (``triton_m16`` / ``m32`` / ``m64``: the configs of
``configs.MLA_TILE_CONFIGS`` and ``LARGE_SMEM_TILE_CONFIGS``), FlashMLA causal (bf16; fp8
through vLLM's dense fp8 FlashMLA). With an fp8 cache every method reads vLLM's e4m3
query (``operands``). fp8 cells also time the
transposed-products fp8 kernel (``fp8t_m16`` everywhere, ``fp8t_m32`` from 32 rows:
``configs.FP8_TRANSPOSED_TILE_CONFIGS``, sm_90's fp8 rule) and, as the bf16 reference of
an fp8-only run (``--grid-dtype fp8``), the Gluon kernel on the same cell's bf16 cache
(``bf16_gluon``). Both caches time the cascade (``cascade``: FlashMLA over the context,
our kernel over the tree; sm_90) and its context part alone (``cascade_context``, a
reference: the rest is the tree part's cost). Ours use the DDTree-like tree mask, FlashMLA a causal
chain. ``--grid-methods`` times only the methods named (a shorter run: the tiles that
never win a cell left out). ``--grid-keep`` keeps the JSON's cells of the cache dtypes a
run does not measure (a run per dtype fits the 10-minute limit of a device call).
``--force-sm120-configs`` times instead the Triton config sm_120 would pick
(``select_config`` at 99 KB of shared memory), a proxy.

Writes ``<out>.md`` (a table per cache dtype), ``<out>.png`` (heatmaps of ours / FlashMLA
per context) and ``<out>.json`` (every time: ``evals/make_dispatch_table.py`` turns it
into ``attention_backends/mla_tree/dispatch_table.py``), after every context, so an
interrupted run keeps what it measured.
"""

from __future__ import annotations

import json
import os
import re
import time

import torch

GRID = dict(heads=(8, 16, 32, 64, 128), rows=(2, 5, 9, 17, 33, 65, 129, 257),
            ctx=(8192, 32768, 131072), dtype=("bf16", "fp8"))
PAGE = 64
REP_MS = 6.0  # GPU time captured per graph: sized so the grid fits in about 8 minutes
FP8_KV_SCALE = 0.02  # randn / 0.02 spans e4m3's range
FP8_Q_SCALE = 0.02  # FlashMLA's fp8 path quantizes q as well (vLLM's _q_scale)


def config_name(config) -> str:
    return f"{'fp8t' if config.fp8_transposed else 'triton'}_m{config.block_m}"


def fp8_transposed_configs(rows: int, heads: int):
    """The transposed fp8 tile configs timed for ``rows * heads`` rows per request: the
    16-row tile always, the 32-row one from 32 rows (below, it computes padding)."""
    from vllm_ddtree.attention_backends.mla_tree.configs import FP8_TRANSPOSED_TILE_CONFIGS

    return [c for c in FP8_TRANSPOSED_TILE_CONFIGS if c.block_m <= max(16, rows * heads)]


def candidate_configs(rows: int, heads: int, sm120: bool):
    """Our Triton tile configs worth timing for ``rows * heads`` rows per request: the
    table's configs whose row tile fits the rows and is not far below them; with ``sm120`` only
    the one ``select_config`` picks at sm_120's 99 KB. Rows 16-63: m16 (and m32 from 32);
    64 and more: m32 and m64."""
    from bench_verify_attention import HEAD_DIM, KV_LORA

    from vllm_ddtree.attention_backends.mla_tree.configs import (
        LARGE_SMEM_TILE_CONFIGS,
        MLA_TILE_CONFIGS,
        SM120_SHARED_MEMORY_BYTES,
        select_config,
    )

    if sm120:
        return [select_config(rows * heads, HEAD_DIM, KV_LORA, torch.bfloat16,
                              SM120_SHARED_MEMORY_BYTES)]
    configs = list(MLA_TILE_CONFIGS) + list(LARGE_SMEM_TILE_CONFIGS)
    total = rows * heads
    # A row tile larger than the rows computes padding; one under a quarter of them
    # re-reads the KV from L2 four times or more (m16 trails m32 from 64 rows up).
    return [c for c in configs if c.block_m <= max(16, total) and 4 * c.block_m > min(total, 64)]


def operands(inp, dtype: str) -> dict:
    """The launch's ``q``, ``kv_cache``, ``kv_scale`` and ``q_scale`` for a cache of
    ``dtype``: "bf16" as made; "fp8" with the cache quantized as vLLM's
    ``concat_and_cache_mla`` (saturating) and q as ``MLAAttention`` quantizes it
    (``ops.quantize_query``: every fp8 kernel, FlashMLA's too, reads the e4m3 query;
    vLLM fuses that quantization into its query concatenation, so it is not timed)."""
    if dtype != "fp8":
        return dict(q=inp.q, kv_cache=inp.kv_cache, kv_scale=None, q_scale=None)
    from vllm_ddtree.attention_backends.mla_tree.ops import quantize_query

    kv_scale = torch.tensor([FP8_KV_SCALE], dtype=torch.float32, device="cuda")
    q_scale = torch.tensor([FP8_Q_SCALE], dtype=torch.float32, device="cuda")
    cache = (inp.kv_cache.float() / kv_scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    return dict(q=quantize_query(inp.q, q_scale), kv_cache=cache, kv_scale=kv_scale,
                q_scale=q_scale)


def triton_method(inp, ops, config):
    from bench_verify_attention import KV_LORA

    from vllm_ddtree.attention_backends.mla_tree import mla_tree_verify

    kwargs = dict(validate_values=False, max_query_len=inp.cell.qlen,
                  max_seq_len=inp.cell.ctx + inp.cell.qlen, config=config, kernel="triton",
                  kv_scale=ops["kv_scale"], q_scale=ops["q_scale"])

    def run():
        return mla_tree_verify(ops["q"], ops["kv_cache"], inp.block_table, inp.seq_lens,
                               inp.query_start_loc, inp.bits_tree, inp.scale, KV_LORA,
                               **kwargs)

    return run


def flashmla_fp8(inp, ops):
    """vLLM 0.26's dense fp8 FlashMLA (``FlashMLAImpl.forward_mqa`` with an fp8 cache):
    fp8 q and cache, descale factors, causal."""
    from bench_verify_attention import HEAD_DIM, KV_LORA, Unavailable

    if torch.cuda.get_device_capability()[0] != 9:
        raise Unavailable("FlashMLA is Hopper-only")
    try:
        from vllm.v1.attention.ops import flashmla as fm
    except Exception as e:  # noqa: BLE001 - any import failure means "not available"
        raise Unavailable(f"import vllm.v1.attention.ops.flashmla failed: {e}") from e
    cell = inp.cell
    q = ops["q"].view(1, cell.qlen, cell.heads, HEAD_DIM)
    meta, num_splits = fm.get_mla_metadata_dense_fp8(inp.seq_lens, cell.qlen * cell.heads, 1)

    def run():
        return fm.flash_mla_with_kvcache_fp8(
            q, ops["kv_cache"].unsqueeze(2), inp.block_table, inp.seq_lens, KV_LORA, meta,
            num_splits, softmax_scale=inp.scale, causal=True, descale_q=ops["q_scale"],
            descale_k=ops["kv_scale"])

    run()
    return run


def cascade_method(inp, ops):
    """``cascade.mla_tree_verify_cascade`` as a layer after its KV-cache group's first
    launches it: the plan (context lengths, FlashMLA's schedule) made by a first call and
    not timed (a group's first layer pays it once a step; under vLLM's hybrid KV-cache
    manager every MLA layer is its own group)."""
    from bench_verify_attention import KV_LORA, Unavailable

    from vllm_ddtree.attention_backends.mla_tree import cascade

    cell = inp.cell
    if not cascade.cascade_supported(ops["q"], ops["kv_cache"], KV_LORA, 1, cell.qlen):
        raise Unavailable("the cascade needs FlashMLA's dense decode (sm_90)")
    out = torch.empty(cell.qlen, cell.heads, KV_LORA, dtype=inp.q.dtype, device="cuda")
    lse = torch.empty(cell.qlen, cell.heads, dtype=torch.float32, device="cuda")
    plan = cascade.CascadePlan()
    smem = torch.cuda.get_device_properties(0).shared_memory_per_block_optin

    def run():
        return cascade.mla_tree_verify_cascade(
            ops["q"], ops["kv_cache"], inp.block_table, inp.seq_lens, inp.query_start_loc,
            inp.bits_tree, inp.scale, out, lse, cell.qlen, plan, ops["kv_scale"],
            ops["q_scale"], smem)

    run()
    return run


def cascade_context_method(inp, ops):
    """The cascade's context part alone (``cascade.flashmla_context``: FlashMLA over the
    context): ``cascade`` minus this is what its tree part and the launches between
    cost."""
    from bench_verify_attention import KV_LORA, Unavailable

    from vllm_ddtree.attention_backends.mla_tree import cascade

    cell = inp.cell
    if not cascade.cascade_supported(ops["q"], ops["kv_cache"], KV_LORA, 1, cell.qlen):
        raise Unavailable("the cascade needs FlashMLA's dense decode (sm_90)")
    plan = cascade.CascadePlan(ctx_lens=cascade.context_lens(inp.seq_lens, inp.query_start_loc))

    def run():
        return cascade.flashmla_context(ops["q"], ops["kv_cache"], inp.block_table,
                                        inp.scale, cell.qlen, plan, ops["kv_scale"],
                                        ops["q_scale"])

    run()
    return run


def cell_methods(inp, dtype: str, sm120: bool) -> dict:
    """``{method: maker}`` of one cell; a maker returns the callable to time."""
    from bench_verify_attention import flashmla, gluon_all_rows

    ops = operands(inp, dtype)
    makers = {}
    if dtype == "bf16" and not sm120:
        makers["gluon"] = lambda: gluon_all_rows(inp)
    configs = candidate_configs(inp.cell.qlen, inp.cell.heads, sm120)
    if dtype == "fp8" and not sm120:
        configs += fp8_transposed_configs(inp.cell.qlen, inp.cell.heads)
        makers["bf16_gluon"] = lambda: gluon_all_rows(inp)
    for config in configs:
        makers["triton_sm120" if sm120 else config_name(config)] = (
            lambda c=config: triton_method(inp, ops, c))
    if not sm120:
        makers["cascade"] = lambda: cascade_method(inp, ops)
        makers["cascade_context"] = lambda: cascade_context_method(inp, ops)
    makers["flashmla"] = ((lambda: flashmla(inp)) if dtype == "bf16"
                          else (lambda: flashmla_fp8(inp, ops)))
    return makers


SWEEP_MIN_TILES = (8, 4, 2)  # 8: configs.MIN_TILES_PER_SPLIT, the shipped heuristic


def split_choices(method: str, rows: int, heads: int, ctx: int) -> dict[int, int]:
    """``{min tiles per split: KV split count}`` the heuristic would pick for ``method``'s
    launch (one request on 132 SMs) with each of :data:`SWEEP_MIN_TILES`."""
    from vllm_ddtree.attention_backends.mla_tree import gluon_kernel
    from vllm_ddtree.attention_backends.mla_tree.configs import select_num_kv_splits
    from vllm_ddtree.attention_backends.mla_tree.dispatch import TRITON_CONFIGS

    if method == "gluon":
        block_m, block_n, per_sm = gluon_kernel.BLOCK_M, gluon_kernel.BLOCK_N, 1
    else:
        c = TRITON_CONFIGS[method]
        block_m, block_n, per_sm = c.block_m, c.block_n, c.ctas_per_sm
    row_blocks = -(-rows * heads // block_m)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return {m: select_num_kv_splits(num_requests=1, row_blocks=row_blocks,
                                    max_seq_len=ctx + rows, block_n=block_n, num_sms=sms,
                                    ctas_per_sm=per_sm, min_tiles_per_split=m)
            for m in SWEEP_MIN_TILES}


def split_sweep(args, bench, gpu: str, command: str) -> int:
    """``--split-sweep``: the rule's kernel of each grid cell (Gluon in bf16, the rule's
    Triton tile in fp8) timed at the split counts of a smaller minimum of KV tiles per
    split, where that changes the count (few row blocks: idle SMs). Writes
    ``<grid-out>_splits.md`` / ``.json``: the data for lowering MIN_TILES_PER_SPLIT."""
    from bench_verify_attention import Cell, Unavailable, make_inputs
    from tqdm import tqdm

    from vllm_ddtree.attention_backends.mla_tree.dispatch import rule_method

    axes = {k: getattr(args, f"grid_{k}") or v for k, v in GRID.items()}
    cells = []
    for d in axes["dtype"]:
        for c in axes["ctx"]:
            for h in axes["heads"]:
                for r in axes["rows"]:
                    method = rule_method(_arch(), d, h, r)
                    choices = split_choices(method, r, h, c)
                    if len(set(choices.values())) > 1:
                        cells.append((d, c, h, r, method, choices))
    rows_md = ["| cache | H | rows | ctx | kernel | "
               + " | ".join(f"min {m} tiles: splits, ms" for m in SWEEP_MIN_TILES) + " |",
               "|" + "---|" * (5 + len(SWEEP_MIN_TILES))]
    records = []
    for dtype, ctx, heads, rows, method, choices in tqdm(cells, desc="split sweep"):
        inp = make_inputs(Cell(heads, ctx, rows, PAGE), torch.bfloat16)
        ops = operands(inp, dtype)
        times = {}
        for min_tiles, splits in choices.items():
            try:
                times[min_tiles] = bench(split_method(inp, method, ops, splits))
            except (Unavailable, RuntimeError, ValueError) as e:
                print(f"{dtype} H{heads} {rows} {ctx} {method} s{splits}: {e}"[:300])
                times[min_tiles] = None
        records.append(dict(dtype=dtype, heads=heads, rows=rows, ctx=ctx, method=method,
                            splits={str(k): v for k, v in choices.items()},
                            times={str(k): v for k, v in times.items()}))
        rows_md.append(f"| {dtype} | {heads} | {rows} | {ctx // 1024}k | {method} | " + " | ".join(
            f"{choices[m]}, {'n/a' if times[m] is None else f'{times[m]:.4f}'}"
            for m in SWEEP_MIN_TILES) + " |")
        del inp
        torch.cuda.empty_cache()
    out = args.grid_out + "_splits"
    write_sweep_files(out, gpu, command, records,
                      "KV split count at fewer tiles per split (the rule's kernel per cell)",
                      "ms per call in CUDA graphs as in the grid; cells where the minimum of "
                      "KV tiles per split changes the split count only", rows_md)
    print(f"wrote {out}.md and {out}.json")
    return 0


# The cells where the cascade's tree part decides: bf16 over 1.15x FlashMLA, fp8 slower
# than bf16 at 8k (evals/results/verify_attention_grid.md). The tree part reads only the
# tree's keys and the context partial, so 8k stands for every context.
SUFFIX_CELLS = (("bf16", 32, 257), ("bf16", 64, 129), ("bf16", 8, 129), ("bf16", 128, 65),
                ("fp8", 8, 257), ("fp8", 8, 65), ("fp8", 16, 33), ("fp8", 64, 9),
                ("fp8", 128, 5))


def suffix_candidates(dtype: str):
    """Tile configs of the cascade's tree part to time beside ``cascade.suffix_config``'s:
    row tiles 16 / 32 / 64, key tiles 32 / 64, 4 or 8 warps, 1 or 2 stages (fp8: the
    64-row tile with 32-key tiles and one stage only; larger ones spilled, see
    ``suffix_config``)."""
    from vllm_ddtree.attention_backends.mla_tree.configs import MLATileConfig

    out = []
    for block_m in (16, 32, 64):
        for block_n in (32, 64):
            for num_warps in (4, 8):
                for num_stages in (1, 2):
                    if dtype == "fp8" and block_m == 64 and (block_n, num_stages) != (32, 1):
                        continue
                    out.append(MLATileConfig(block_m=block_m, block_n=block_n,
                                             num_warps=num_warps, num_stages=num_stages))
    return out


def suffix_method(inp, ops, config):
    """The cascade's tree part alone (``cascade.tree_suffix``) with ``config`` in place of
    ``suffix_config``'s tile (None: its own), folding a context partial FlashMLA made
    once (not timed)."""
    from bench_verify_attention import KV_LORA, Unavailable

    from vllm_ddtree.attention_backends.mla_tree import cascade

    cell = inp.cell
    if not cascade.cascade_supported(ops["q"], ops["kv_cache"], KV_LORA, 1, cell.qlen):
        raise Unavailable("the cascade needs FlashMLA's dense decode (sm_90)")
    plan = cascade.CascadePlan(ctx_lens=cascade.context_lens(inp.seq_lens, inp.query_start_loc))
    ctx_out, ctx_lse = cascade.flashmla_context(ops["q"], ops["kv_cache"], inp.block_table,
                                                inp.scale, cell.qlen, plan, ops["kv_scale"],
                                                ops["q_scale"])
    out = torch.empty_like(ctx_out)
    lse = torch.empty(cell.qlen, cell.heads, dtype=torch.float32, device="cuda")
    smem = torch.cuda.get_device_properties(0).shared_memory_per_block_optin
    shipped = cascade.suffix_config

    def run():
        if config is not None:  # the module global tree_suffix looks up, for this call
            cascade.suffix_config = lambda *a, **k: config
        try:
            cascade.tree_suffix(ops["q"], ops["kv_cache"], inp.block_table, inp.seq_lens,
                                inp.query_start_loc, inp.bits_tree, inp.scale, KV_LORA,
                                ctx_out, ctx_lse, out, lse, cell.qlen, ops["kv_scale"],
                                ops["q_scale"], smem)
        finally:
            cascade.suffix_config = shipped

    run()
    run.out = out  # what the tile computed, for the sweep's check against the shipped one
    return run


def suffix_sweep(args, bench, gpu: str, command: str) -> int:
    """``--suffix-sweep``: the cascade's tree part alone at :data:`SUFFIX_CELLS`, with
    its shipped tile and each of :func:`suffix_candidates`. Writes
    ``<grid-out>_suffix.md`` / ``.json`` after every cell (``--max-minutes``: no cell
    starts past it): the data for ``cascade.suffix_config``."""
    from bench_verify_attention import Cell, Unavailable, make_inputs
    from tqdm import tqdm
    from triton.errors import TritonError

    from vllm_ddtree.attention_backends.mla_tree import cascade

    records, lines = [], []
    start = time.time()
    for dtype, heads, rows in tqdm(SUFFIX_CELLS, desc="suffix sweep"):
        if args.max_minutes and time.time() - start > 60 * args.max_minutes:
            print(f"--max-minutes reached: stopping before {dtype} H{heads} {rows}")
            break
        inp = make_inputs(Cell(heads, 8192, rows, PAGE), torch.bfloat16)
        ops = operands(inp, dtype)
        shipped = cascade.suffix_config(rows * heads, dtype == "fp8")
        times, want = {}, None
        for config in [None, *suffix_candidates(dtype)]:
            name = "shipped" if config is None else (
                f"m{config.block_m}n{config.block_n}w{config.num_warps}s{config.num_stages}")
            try:
                run = suffix_method(inp, ops, config)
                want = run.out if config is None else want
                if want is not None and not (  # NaN fails too
                        (run.out.float() - want.float()).abs().max() <= 0.02):
                    raise ValueError("its output differs from the shipped tile's")
                times[name] = bench(run)
            except (Unavailable, RuntimeError, ValueError, TritonError) as e:
                print(f"{dtype} H{heads} {rows} {name}: {e}"[:300])  # resources, no FlashMLA
                times[name] = None
        del inp
        torch.cuda.empty_cache()
        if times["shipped"] is None:
            continue
        best = min((t, n) for n, t in times.items() if t is not None and n != "shipped")
        records.append(dict(dtype=dtype, heads=heads, rows=rows, times=times,
                            shipped=f"m{shipped.block_m}n{shipped.block_n}"
                                    f"w{shipped.num_warps}s{shipped.num_stages}"))
        lines.append(f"| {dtype} | {heads} | {rows} | {records[-1]['shipped']} | "
                     f"{1000 * times['shipped']:.1f} | {best[1]} | {1000 * best[0]:.1f} | "
                     f"{best[0] / times['shipped']:.2f} |")
        write_sweep_files(
            args.grid_out + "_suffix", gpu, command, records,
            "The cascade's tree part alone: its shipped tile against the others",
            "us per call in CUDA graphs as in the grid (8k context; the tree part reads only "
            "the tree's keys and the context partial); every tile's time in the run's JSON "
            "(not kept in evals/results)",
            ["| cache | H | rows | shipped | us | best other | us | best / shipped |",
             "|---|---|---|---|---|---|---|---|", *lines])
    print(f"wrote {args.grid_out}_suffix.md and .json ({len(records)} cells)")
    return 0


def write_sweep_files(out: str, gpu: str, command: str, records: list[dict], title: str,
                      note: str, table: list[str]) -> None:
    """``<out>.json`` (the cells' records) and ``<out>.md`` (title, GPU, command, note,
    table) of the grid's side sweeps (``--split-sweep``, ``--suffix-sweep``)."""
    with open(out + ".json", "w") as f:
        json.dump(dict(gpu=gpu, command=command, arch=_arch(), cells=records), f, indent=1)
    with open(out + ".md", "w") as f:
        f.write("\n".join([f"# {title}", "", f"- GPU: {gpu}", f"- command: `{command}`",
                           f"- {note}", "", *table]) + "\n")


def split_method(inp, method: str, ops, splits: int):
    """``method`` (``"gluon"`` or a ``triton_m*`` tile) forced to ``splits`` KV splits."""
    from bench_verify_attention import KV_LORA

    from vllm_ddtree.attention_backends.mla_tree import mla_tree_verify
    from vllm_ddtree.attention_backends.mla_tree.dispatch import TRITON_CONFIGS
    from vllm_ddtree.attention_backends.mla_tree.ops import mla_tree_fwd_gluon

    lens = dict(validate_values=False, max_query_len=inp.cell.qlen,
                max_seq_len=inp.cell.ctx + inp.cell.qlen, num_kv_splits=splits)
    args = (ops["q"], ops["kv_cache"], inp.block_table, inp.seq_lens, inp.query_start_loc,
            inp.bits_tree, inp.scale, KV_LORA)
    if method == "gluon":
        return lambda: mla_tree_fwd_gluon(*args, **lens)
    config = TRITON_CONFIGS[method]
    return lambda: mla_tree_verify(*args, **lens, kernel="triton", config=config,
                                   kv_scale=ops["kv_scale"], q_scale=ops["q_scale"])


def run_grid(args, bench, gpu: str, command: str) -> int:
    """Time the grid (``args.grid_*`` narrow it), writing results as it goes."""
    from bench_verify_attention import Cell, Unavailable, make_inputs
    from tqdm import tqdm

    sm120 = args.force_sm120_configs
    if os.path.basename(args.grid_out) == "verify_attention_grid":
        # the curated grid, written first into a GPU stage's log folder: its command
        # names the results path; any other --grid-out is recorded as given
        command = command.replace(args.grid_out, "evals/results/verify_attention_grid")
    axes = {k: getattr(args, f"grid_{k}") or v for k, v in GRID.items()}
    cells = [(d, c, h, r) for d in axes["dtype"] for c in axes["ctx"] for h in axes["heads"]
             for r in axes["rows"]]
    out = args.grid_out + ("_sm120" if sm120 else "")
    report = dict(gpu=gpu, command=command, arch=_arch(), force_sm120_configs=sm120,
                  page=PAGE, rep_ms=REP_MS, cells=[])
    if args.grid_keep:
        report = keep_other_cells(report, out + ".json", set(cells))
    start = time.time()
    last_ctx = None
    for dtype, ctx, heads, rows in tqdm(cells, desc="grid cells"):
        if args.max_minutes and time.time() - start > 60 * args.max_minutes:
            print(f"--max-minutes reached: stopping before {dtype} H{heads} {ctx} {rows}")
            break
        if last_ctx is not None and (dtype, ctx) != last_ctx:
            write_outputs(report, out)
        last_ctx = (dtype, ctx)
        inp = make_inputs(Cell(heads, ctx, rows, PAGE), torch.bfloat16)
        entry = dict(dtype=dtype, heads=heads, rows=rows, ctx=ctx, times={}, notes={})
        makers = cell_methods(inp, dtype, sm120)
        if args.grid_methods:
            makers = {m: f for m, f in makers.items() if m in args.grid_methods}
        for method, maker in makers.items():
            try:
                entry["times"][method] = bench(maker())
            except Unavailable as e:
                entry["notes"][method] = str(e)
            except Exception as e:  # noqa: BLE001 - keep timing the other methods
                entry["notes"][method] = f"{type(e).__name__}: {e}"[:200]
            try:
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001 - a sticky fault: no later cell can run
                entry["notes"][method] = f"CUDA context lost after this method: {e}"[:200]
                report["cells"].append(entry)
                write_outputs(report, out)
                print(f"CUDA context lost in {entry}; wrote the cells so far to {out}.md")
                return 1
        report["cells"].append(entry)
        del inp
        torch.cuda.empty_cache()
    write_outputs(report, out)
    print(f"wrote {out}.md, {out}.png and {out}.json ({time.time() - start:.0f} s)")
    return 0


def keep_other_cells(report: dict, path: str, measured: set[tuple]) -> dict:
    """``--grid-keep``: ``report`` with the cells of the JSON at ``path`` that this run
    does not time (``measured``: its ``(dtype, ctx, heads, rows)`` cells; one grid from
    runs per dtype, each under the 10-minute limit of a call, or a narrowed rerun of a
    few cells), and the commands that made them; nothing from a JSON of another GPU."""
    if not os.path.exists(path):
        return report
    with open(path) as f:
        old = json.load(f)
    if (old.get("gpu"), old.get("arch")) != (report["gpu"], report["arch"]):
        print(f"--grid-keep: {path} was measured on {old.get('gpu')}, this is "
              f"{report['gpu']}: nothing kept")
        return report
    kept = [c for c in old["cells"]
            if (c["dtype"], c["ctx"], c["heads"], c["rows"]) not in measured]
    if not kept:
        return report
    replaced = {d for d, *_ in measured} - {c["dtype"] for c in kept}
    return {**report, "command": kept_commands(old["command"], report["command"], replaced),
            "cells": kept}


def _command_key(part: str) -> tuple:
    """(cache dtypes, narrowed axes) of one grid command."""
    found = re.search(r"--grid-dtype ((?:[\w]+ ?)+)", part)
    measured = tuple(found.group(1).split()) if found else ("bf16", "fp8")
    return measured, tuple(re.findall(r"--grid-(?:heads|rows|ctx) ((?:\d+ ?)+)", part))


def kept_commands(old: str, new: str, dtypes: set[str]) -> str:
    """The commands that made a kept grid: of ``old`` (``" && "``-joined), the last one
    per set of cache dtypes and narrowed axes measured that still has cells this run
    does not replace (``dtypes``: those whose every cell it replaces), then ``new``.
    Reruns replace their dtype's command instead of piling up; a narrowed rerun keeps
    the full run's command beside its own."""
    latest: dict[tuple, str] = {}
    for part in old.split(" && "):
        measured, narrowed = _command_key(part)
        if set(measured) - dtypes:
            latest[(measured, narrowed)] = part
    latest.pop(_command_key(new), None)
    return " && ".join([*latest.values(), new])


def _arch() -> str:
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}"


def write_outputs(report: dict, out: str) -> None:
    """``<out>.json``, ``.md`` and ``.png`` of ``report``, its cells in grid order (a narrowed
    rerun's cells take their places among the kept ones)."""
    from verify_grid_report import write_heatmaps, write_markdown

    def order(cell: dict) -> tuple:
        return (GRID["dtype"].index(cell["dtype"]), cell["ctx"], cell["heads"], cell["rows"])

    report = {**report, "cells": sorted(report["cells"], key=order)}
    with open(out + ".json", "w") as f:
        json.dump(report, f, indent=1)
    write_markdown(report, out + ".md")
    try:
        write_heatmaps(report, out + ".png")
    except ImportError as e:
        print(f"no heatmap: {e}")
