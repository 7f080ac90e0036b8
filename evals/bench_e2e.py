# SPDX-License-Identifier: Apache-2.0
"""End-to-end decoding on vLLM 0.26: AR, vLLM's DFlash chain and DDTree, same models and
prompts, with the split of a decoding step into draft / verify / other (GPU).

Methods ("runs"), each in its own child process with a fresh ``LLM``:

- ``ar@<backend>``: the target alone (``FLASH_ATTN_MLA``, ``TRITON_MLA`` or ``CUSTOM``,
  the project's MLA backend used as a plain backend);
- ``dflash@<backend>``: vLLM's own DFlash chain (``method: dflash``, block_size - 1
  draft tokens);
- ``ddtree-<B>``: DDTree with a tree of B nodes (``method: ddtree``; the target gets the
  ``CUSTOM`` tree backend automatically);
- ``ddtree-auto[-<M>]``: ``ddtree_budget: "auto"`` with ``num_speculative_tokens = M``
  as the maximum (default ``--auto-max``, else the largest B of the run's grid); rows
  add ``active_nodes_per_round`` (vLLM's draft-token counter still counts M per round).
  The target verifies ``1 + s`` rows, ``s`` rounded up from a recent round's budget
  (adaptive verify shapes, the default at TP = 1); ``ddtree-autofixed[-<M>]`` keeps
  ``1 + M`` rows (``ddtree_verify_shape: "fixed"``: inactive rows are skipped in
  attention only).

Run-name suffixes (``e2e_report.RUN_VARIANTS``): ``+skipprefix`` (``ar`` / ``dflash``:
without the scheduler's common-prefix scan), ``+perbatch`` (below), ``+dflash2``,
``+marginals``, ``+top1`` (the shipped DFlash2 drafter and its tree kinds), ``+hybrid``
(``ddtree``: vLLM's hybrid KV-cache manager where DDTree would pick one KV-cache group,
``vllm_ddtree/kv_group_choice.py``; e.g. ``ddtree-64 ddtree-64+hybrid`` compares them),
``+pin16`` / ``+pin32`` / ``+pin64`` (``ddtree-auto``: the gate pinned to that arm every
step; against ``ddtree-16`` / ``-32`` / ``-64`` it isolates what auto's machinery costs a
step, and ``ddtree-auto`` against ``+pin64`` what its choices cost).

Setups (``evals/e2e_models.py``): ``trained`` (the embedded pair: acceptance; 1k context
only, its target has 4096 positions), ``kimi64`` / ``kimi8`` (Kimi-K2-shaped MLA target
with 64 / 8 heads and a Kimi-K2.6-shaped DFlash drafter, dummy weights: step latency,
compared with reference step times of vLLM 0.26.0, ``e2e_report.ANCHORS``), ``v2lite`` /
``v2lite_moe`` (DeepSeek-V2-Lite-shaped MLA target, dense-MLP variant / MoE, dummy weights with the
rank oracle: the embedded drafter's measured acceptance at V2-Lite's cost;
``evals/e2e_v2lite.py``, ``evals/e2e_oracle.py``).

``--sweep`` (``evals/e2e_sweep.py``): the batch sweep. Each cell keeps its batch of
requests in flight with continuous batching (a pool of mixed-length requests refilled as
they finish, through ``LLM.llm_engine``), batches 1 4 8 16 32 64 by default, and writes
``e2e_batch_sweep[_<setup>].md / .png / .json`` (tokens/s against the batch). Runs take
``+perbatch`` for vLLM's ``num_speculative_tokens_per_batch_size``; a configuration the
front end refuses becomes skipped cells naming the refusal.

Per (context, batch, prompt kind) cell: a ``max_tokens=1`` generate prefills the prompts
into the prefix cache, then the measured generate (``max_tokens=N``, ``ignore_eos``)
re-sends them, so all requests decode together and prefill stays out of the figures.
Decode time, decode steps and the split come from CUDA events around the V2 runner's
stages (``evals/e2e_timing.py``); acceptance from vLLM's spec-decode counters.

Usage (GPU machine, project root; device-time estimates in evals/results/README.md):
    python evals/bench_e2e.py --quick                        # kimi64, 1k/32k, batch 1
    python evals/bench_e2e.py --setup trained                # acceptance, 1k, batch 1/8
    python evals/bench_e2e.py --setup kimi8 --max-minutes 9
    python evals/bench_e2e.py --setup kimi64 --runs ar@FLASH_ATTN_MLA dflash@FLASH_ATTN_MLA
    python evals/bench_e2e.py --setup kimi8 --lockstep --repeats 2  # all engines at once
    python evals/bench_e2e.py --from-json evals/results/e2e_kimi64.json   # re-render (CPU)
    python evals/bench_e2e.py --sweep --lockstep --setup v2lite --pool-factor 2 \
        --runs ar@FLASH_ATTN_MLA dflash@FLASH_ATTN_MLA dflash@FLASH_ATTN_MLA+perbatch \
        ddtree-16 ddtree-64 ddtree-64+perbatch ddtree-auto    # (scripts/gpu_suites.sh)

``--lockstep``: every run's child starts before the first cell (one ``LLM`` each on the
one GPU, its KV cache fixed by ``kv_cache_memory_bytes``; ``auto``'s first and alone, since
it times its graphs at start-up), then the parent has each cell measured by every
run in turn, one engine working at a time (order reversed on alternate rounds, rotated
from cell to cell), so that the methods of a cell are measured seconds apart, not
minutes (the host's speed drifts).

Writes ``<out-dir>/e2e_<setup>.md``, ``.png``, ``.json`` (raw rows; later invocations
merge into it, so a grid can be measured in several commands) and ``e2e_<setup>.log``
(the children's output), rewritten after every run.

Code: this file plans the cells and runs the command line; ``e2e_runs.py`` holds runs,
cells and rows, ``e2e_child.py`` the child process (one engine, its cells),
``e2e_children.py`` the parent's side of the children (``--lockstep`` included),
``e2e_models.py`` the setups and prompts, ``e2e_timing.py`` / ``e2e_engine.py`` the step
timer and its probes, ``e2e_report.py`` the tables and plots.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

EVALS = Path(__file__).resolve().parent
REPO_ROOT = EVALS.parent
for _p in (str(EVALS), str(REPO_ROOT)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from cli_args import (  # noqa: E402
    float_arg,
    non_negative_float,
    positive_float,
    positive_int,
)
from e2e_children import (  # noqa: E402
    LOCKSTEP_KV_FACTOR,
    child_spec,
    log_tail,
    run_lockstep,
    spawn_child,
)
from e2e_models import (  # noqa: E402
    SETUPS,
    Setup,
    parse_prompt_kind,
    prepare_setup,
)
from e2e_report import PROCESS_VARIANTS  # noqa: E402
from e2e_runs import (  # noqa: E402
    DEFAULT_AUTO_MAX,
    MAX_BUDGET,
    STATUS_FAILED,
    STATUS_NOT_RUN,
    STATUS_SKIPPED,
    RunSpec,
    base_row,
    interleaved,
    merge_rows,
    parse_context,
    parse_cpus,
    plan_cells,
    resolve_auto_runs,
    row_key,
    sequence_margin,
    write_json_atomic,
)
from e2e_sweep import MIN_POOL, SWEEP_BATCHES  # noqa: E402

DEFAULT_SETUPS = ("trained", "kimi64", "kimi8")

DEFAULT_CONTEXTS = [1024, 16384, 65536, 131072]
DEFAULT_BATCHES = [1, 8]
DEFAULT_BUDGETS = ["16", "32", "64", "128"]
AR_BACKENDS = ["FLASH_ATTN_MLA", "TRITON_MLA", "CUSTOM"]
DFLASH_BACKENDS = ["FLASH_ATTN_MLA", "TRITON_MLA"]
QUICK = {
    "setups": ["kimi64"],
    "contexts": [1024, 32768],
    "batches": [1],
    "runs": ["ar@FLASH_ATTN_MLA", "dflash@FLASH_ATTN_MLA", "ddtree-32", "ddtree-64"],
}


# ---------------------------------------------------------------------------------------
# Plan, spawn children, merge, render


def results_paths(out_dir: Path, setup: str, sweep: bool = False) -> dict[str, Path]:
    """``e2e_<setup>.*``, or with ``--sweep`` ``e2e_batch_sweep[_<setup>].*``
    (:func:`sweep_stem`)."""
    stem = out_dir / (sweep_stem(setup) if sweep else f"e2e_{setup}")
    return {k: stem.with_suffix(f".{k}") for k in ("json", "md", "png", "log")}


def sweep_stem(setup: str) -> str:
    """The sweep's result name: ``e2e_batch_sweep`` for the embedded pair served with
    YaRN (the trained sweep), ``e2e_batch_sweep_<setup>`` for the others."""
    return "e2e_batch_sweep" if setup == "trained_yarn" else f"e2e_batch_sweep_{setup}"


def setup_contexts(setup: Setup, args: argparse.Namespace) -> list[int]:
    """``--contexts``, else (``--sweep``) the contexts the setup serves
    (``e2e_sweep.SWEEP_CONTEXTS``)."""
    if args.contexts:
        return args.contexts
    from e2e_sweep import SWEEP_CONTEXTS

    return list(SWEEP_CONTEXTS.get(setup.name, ([1024],))[0])


def load_store(path: Path, setup: Setup) -> dict:
    if path.exists():
        with open(path) as f:
            data = json.load(f)
        if data.get("setup") == setup.name:
            return data
    return {"setup": setup.name, "setup_title": setup.title,
            "setup_description": setup.description, "invocations": [], "rows": []}


def render(data: dict, md_path: Path, png_path: Path | None) -> None:
    if data.get("sweep"):
        from e2e_sweep_report import write_sweep_markdown as write_markdown
        from e2e_sweep_report import write_sweep_plot as write_plot
    else:
        from e2e_plot import write_plot
        from e2e_report import write_markdown

    write_markdown(data, str(md_path))
    if png_path is None:
        return
    try:
        write_plot(data, str(png_path))
    except Exception as e:  # noqa: BLE001 - the table matters more than the plot
        print(f"plot failed: {type(e).__name__}: {e}")


def default_runs(args: argparse.Namespace) -> list[RunSpec]:
    runs = []
    if "ar" in args.methods:
        runs += [RunSpec("ar", b.upper()) for b in args.ar_backends]
    if "dflash" in args.methods:
        runs += [RunSpec("dflash", b.upper()) for b in args.dflash_backends]
    if "ddtree" in args.methods:
        runs += [RunSpec.parse(f"ddtree-{b}") for b in args.budgets]
    return runs


def run_setup(setup: Setup, args: argparse.Namespace, runs: list[RunSpec], progress,
              deadline: float | None, invocation: dict) -> None:
    paths = results_paths(Path(args.out_dir), setup.name, args.sweep)
    kinds = args.prompts or list(setup.default_kinds)
    margin = sequence_margin(runs, setup)
    contexts = setup_contexts(setup, args)
    longest = max(contexts) + args.max_tokens + margin
    models = prepare_setup(setup, Path(args.model_dir), min_positions=longest)
    cells, skipped = plan_cells(setup, contexts, args.batches, kinds, args.max_tokens,
                                margin, models.max_positions)
    if cells and args.sweep and args.lockstep and args.lockstep_kv_gib is None:
        from e2e_sweep import sweep_kv_bytes

        kv = sweep_kv_bytes(models, max(c[0] for c in cells), max(c[1] for c in cells),
                            args.pool_spec, margin)
        args.lockstep_kv_gib = kv / 2**30  # every engine of this setup
        invocation["kv_cache_gib"] = {"total": round(kv / 2**30, 2)}
        print(f"{setup.name}: sweep KV cache {kv / 2**30:.2f} GiB per engine (shared "
              f"prefix + {max(c[1] for c in cells)} requests' tails and outputs)")
    if cells and not args.sweep:  # the sweep's requests share their prefix (e2e_sweep)
        from e2e_models import kv_cache_bytes, read_config

        ctx, batch = max(c[0] for c in cells), max(c[1] for c in cells)
        kv = kv_cache_bytes(read_config(models.target), read_config(models.drafter), ctx, batch)
        invocation["kv_cache_gib"] = {k: round(v / 2**30, 2) for k, v in kv.items()}
        invocation["kv_cache_cell"] = [ctx, batch]
        print(f"{setup.name}: KV cache for {ctx} tokens x {batch} requests: "
              f"{kv['total'] / 2**30:.1f} GiB (target {kv['target'] / 2**30:.1f}, drafter "
              f"{kv['drafter'] / 2**30:.1f}); " + ("kv_cache_memory_bytes fixed (--lockstep)"
                                                    if args.lockstep else
                                                    f"gpu_memory_utilization {args.gpu_mem}"))
    data = load_store(paths["json"], setup)
    data["setup_title"], data["setup_description"] = setup.title, setup.description
    if args.sweep:
        from e2e_sweep import SWEEP_CONTEXTS

        data["sweep"] = dict(args.pool_spec.to_json(),
                             contexts_note=SWEEP_CONTEXTS.get(setup.name, ([], ""))[1])
    if setup.oracle:  # what the rank oracle was built from (evals/data/drafter_ranks.json)
        from drafter_ranks import load_table

        table = load_table()
        data["oracle"] = {k: table.get(k) for k in ("command", "prompts", "rounds",
                                                    "tokens_per_round",
                                                    "oracle_tokens_per_round")}
    data["invocations"].append(invocation)
    rows = []
    for run in runs:
        for context, batch, kind, why in skipped:
            rows.append(dict(base_row(setup.name, run, (context, batch, kind), args.max_tokens,
                                      engine_process=args.engine_process,
                                      temperature=args.temperature),
                             status=STATUS_SKIPPED, note=why))
    data["rows"] = merge_rows(data["rows"], rows)

    def save(plot: bool = True):
        paths["json"].parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(str(paths["json"]), data)
        render(data, paths["md"], paths["png"] if plot else None)

    save(plot=False)
    if not cells:
        print(f"{setup.name}: no runnable cell")
        return
    max_model_len = min(models.max_positions,
                        max(c[0] for c in cells) + args.max_tokens + margin)
    if args.lockstep:
        def add_rows(new_rows):
            data["rows"] = merge_rows(data["rows"], new_rows)
            save(plot=False)

        run_lockstep(setup, args, runs, cells, models, max_model_len, paths["log"],
                     add_rows, progress, deadline, invocation)
        save()
        print(f"wrote {paths['md']}, {paths['png']}, {paths['json']}")
        return
    for repeat, run in interleaved(runs, args.repeats):
        now = time.time()
        if deadline and now > deadline - 60 * args.min_child_minutes:
            data["rows"] = merge_rows(data["rows"], [
                dict(base_row(setup.name, run, c, args.max_tokens, repeat, args.engine_process,
                              args.temperature),
                     status=STATUS_NOT_RUN, note="--max-minutes reached") for c in cells])
            if progress is not None:
                progress.update(len(cells))
            continue
        if progress is not None:
            progress.set_postfix_str(f"{setup.name} {run.name}")
        spec = child_spec(setup, args, run, cells, models, max_model_len, deadline, repeat)
        hard = now + 60 * args.child_timeout_min
        if deadline:
            hard = min(hard, deadline + 60 * args.grace_minutes)
        done = [0]

        def on_rows(child_rows, done=done):  # keep what a killed command measured
            if progress is not None:
                progress.update(len(child_rows) - done[0])
            done[0] = len(child_rows)
            data["rows"] = merge_rows(data["rows"], child_rows)
            save(plot=False)

        result = spawn_child(spec, paths["log"], hard, on_rows)
        meta = result.get("meta") or {}
        if meta.get("gpu"):
            invocation["gpu"] = meta["gpu"]
        if meta.get("versions"):
            invocation["versions"] = meta["versions"]
        invocation.setdefault("startup_s", {})[run.name] = meta.get("startup_s")
        got = {row_key(r) for r in result.get("rows", [])}
        why = ("child killed at the time limit" if result.get("killed") else
               f"child exited {result.get('returncode')}: {log_tail(paths['log'])}")
        missing = [dict(base_row(setup.name, run, c, args.max_tokens, repeat, args.engine_process,
                                 args.temperature),
                        status=STATUS_FAILED, note=why) for c in cells
                   if row_key(base_row(setup.name, run, c, args.max_tokens, repeat,
                                       args.engine_process, args.temperature)) not in got]
        if progress is not None:
            progress.update(max(0, len(cells) - done[0]))
        data["rows"] = merge_rows(data["rows"], result.get("rows", []) + missing)
        save()
    save()
    print(f"wrote {paths['md']}, {paths['png']}, {paths['json']}")


def prompt_kind_arg(kind: str) -> str:
    """argparse type of ``--prompts``: a kind :func:`parse_prompt_kind` accepts."""
    try:
        parse_prompt_kind(kind)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return kind


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--setup", nargs="+", choices=sorted(SETUPS), dest="setups",
                   help="model setups (default: " + " ".join(DEFAULT_SETUPS)
                   + "; --quick: kimi64; trained_yarn: the trained pair served with "
                   "YaRN for long context)")
    p.add_argument("--runs", nargs="+", help="explicit runs, e.g. ar@FLASH_ATTN_MLA "
                   "dflash@TRITON_MLA ddtree-64 (default: from --methods/--*-backends/--budgets)")
    p.add_argument("--methods", nargs="+", choices=["ar", "dflash", "ddtree"],
                   default=["ar", "dflash", "ddtree"])
    p.add_argument("--ar-backends", nargs="+", default=AR_BACKENDS)
    p.add_argument("--dflash-backends", nargs="+", default=DFLASH_BACKENDS)
    p.add_argument("--budgets", nargs="+", help="DDTree B values, or 'auto' (adaptive, "
                   f"up to --auto-max); default {' '.join(DEFAULT_BUDGETS)}")
    p.add_argument("--auto-max", type=int, help="maximum B of ddtree-auto runs (default: "
                   f"the largest numeric B of the runs, else {DEFAULT_AUTO_MAX})")
    p.add_argument("--contexts", nargs="+", type=parse_context,
                   help="prompt lengths, e.g. 1k 16k 64k 128k (default)")
    p.add_argument("--batches", nargs="+", type=positive_int, help="default 1 8")
    p.add_argument("--prompts", nargs="+", type=prompt_kind_arg,
                   help="prompt kinds (default per setup: trained code+random, kimi "
                   "random); code@k / random@k: the k-th disjoint prompt set, e.g. "
                   "--prompts code code@1 code@2 at batch 1")
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens per request")
    p.add_argument("--repeats", type=positive_int, default=1,
                   help="start every run this many times, interleaved (A B C C B A ...); "
                   "the tables show each cell's median-step repeat and the spread")
    p.add_argument("--temperature", type=non_negative_float, default=0.0)
    p.add_argument("--eager", action="store_true", help="no CUDA graphs (enforce_eager)")
    p.add_argument("--gpu-mem", type=float_arg(0.0, 1.0, lo_open=True), default=0.85,
                   help="gpu_memory_utilization")
    p.add_argument("--prime", choices=["cache", "prefix", "none"], default="cache",
                   help="cache: prefill each cell's prompts into the prefix cache first "
                   "(default); prefix (--sweep only): only the shared prefix, so each "
                   "request prefills its own tail when it joins, as on a server; none: no "
                   "prefix caching, one generate (batch > 1 then decodes while later "
                   "requests still prefill)")
    p.add_argument("--llm-kwargs", type=json.loads, default={},
                   help="JSON merged into LLM(...) kwargs (compilation_config is merged)")
    p.add_argument("--quick", action="store_true",
                   help="kimi64, contexts 1k/32k, batch 1, AR and DFlash on FA-MLA, DDTree 32/64")
    p.add_argument("--max-minutes", type=non_negative_float, default=0.0,
                   help="stop starting runs and cells after this many minutes (0: no limit)")
    p.add_argument("--grace-minutes", type=non_negative_float, default=2.0,
                   help="with --max-minutes: kill a child this long after the limit")
    p.add_argument("--min-child-minutes", type=non_negative_float, default=1.5,
                   help="with --max-minutes: start no run with less time than this left "
                   "(an LLM takes about a minute to start)")
    p.add_argument("--child-timeout-min", type=positive_float, default=45.0)
    p.add_argument("--engine-process", action="store_true",
                   help="run vLLM's engine core in its own process, as vllm serve does "
                   "(the timer reads the runner there through collective_rpc); default: "
                   "in the child's process, with the front end on the engine's thread")
    p.add_argument("--lockstep", action="store_true",
                   help="start every run's engine first (auto's alone; fixed KV cache each, "
                   "--lockstep-kv-gib) and measure each cell by every run in turn, one "
                   "engine working at a time, alternate rounds reversed: the runs of a "
                   "cell are measured seconds apart (default: one run after another)")
    p.add_argument("--lockstep-kv-gib", type=positive_float,
                   help="with --lockstep: kv_cache_memory_bytes of every engine in GiB "
                   f"(default: {LOCKSTEP_KV_FACTOR} x the largest cell's KV cache + 1 GiB)")
    p.add_argument("--pin-cpus", help="run every child on these CPUs (e.g. 0-7), so that "
                   "host-bound steps of different runs see the same cores")
    p.add_argument("--out-dir", help="default evals/results (with --from-json: beside "
                   "each JSON)")
    p.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(),
                                                       "ddtree_e2e_models"),
                   help="where the dummy setups' config.json files are written")
    p.add_argument("--from-json", nargs="+", metavar="JSON",
                   help="re-render markdown + PNG from saved results (no GPU)")
    p.add_argument("--sweep", action="store_true",
                   help="batch sweep (evals/e2e_sweep.py): continuous batching at each "
                   "batch's concurrency, requests of mixed lengths; batches default "
                   "1 4 8 16 32 64, contexts default per setup; writes "
                   "e2e_batch_sweep[_<setup>].md / .png / .json")
    p.add_argument("--pool-factor", type=positive_int, default=3,
                   help="with --sweep: requests per cell = this x the batch")
    p.add_argument("--min-pool", type=positive_int, default=MIN_POOL,
                   help="with --sweep: requests per cell at least (small batches: a few "
                   "requests, about a second of decoding, decide the figure)")
    p.add_argument("--prompt-tails", nargs=2, type=positive_int, metavar=("LO", "HI"),
                   help="with --sweep: each prompt's own tail after the shared prefix, "
                   "uniform in LO..HI tokens (default 64 256)")
    p.add_argument("--output-lengths", nargs=2, type=positive_int, metavar=("LO", "HI"),
                   help="with --sweep: new tokens per request, uniform in LO..HI "
                   "(default 32 256)")
    p.add_argument("--interleave-s", type=positive_float, default=None, metavar="S",
                   help="with --sweep --lockstep: a cell's runs take turns, S seconds of "
                   "steps each, until each has spent its pool (the host's speed toggles "
                   "within seconds: turns put every run on it alike)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--fake", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child or args.from_json:
        return args
    if args.quick:
        args.setups = args.setups or list(QUICK["setups"])
        args.contexts = args.contexts or list(QUICK["contexts"])
        args.batches = args.batches or list(QUICK["batches"])
        if not args.runs and not args.budgets:
            args.runs = list(QUICK["runs"])
    args.out_dir = args.out_dir or str(EVALS / "results")
    args.setups = args.setups or list(DEFAULT_SETUPS)
    if args.sweep:
        check_sweep_args(p, args)
    else:
        for flag in ("prompt_tails", "output_lengths"):
            if getattr(args, flag) is not None:
                p.error(f"--{flag.replace('_', '-')} needs --sweep")
        if args.prime == "prefix":
            p.error("--prime prefix needs --sweep: its requests share a prefix (a cell "
                    "of the plain benchmark primes its prompts whole, --prime cache)")
    if args.contexts or not args.sweep:
        args.contexts = sorted(set(args.contexts or DEFAULT_CONTEXTS))
    args.batches = sorted(set(args.batches or (SWEEP_BATCHES if args.sweep
                                               else DEFAULT_BATCHES)))
    args.budgets = args.budgets or list(DEFAULT_BUDGETS)
    try:
        for b in args.budgets:
            RunSpec.parse(f"ddtree-{b}")
        runs = [RunSpec.parse(r) for r in args.runs] if args.runs else default_runs(args)
    except ValueError as e:
        p.error(str(e))
    if args.auto_max is not None and not 1 <= args.auto_max <= MAX_BUDGET:
        p.error(f"--auto-max must be in 1..{MAX_BUDGET}")
    runs = resolve_auto_runs(runs, [] if args.runs else args.budgets, args.auto_max)
    if not runs:
        p.error("no runs selected")
    patched = sorted({v for r in runs for v in r.variants
                      if v in PROCESS_VARIANTS})
    if args.engine_process and patched:
        p.error(f"{', '.join(patched)} patch the run's own process, not a separate engine "
                "core: drop --engine-process")
    if args.max_tokens < 2:
        p.error("--max-tokens must be >= 2 (the first token comes with the prefill)")
    if min(args.batches) < 1:
        p.error("--batches must be >= 1")
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    if args.lockstep_kv_gib is not None and (not args.lockstep or args.lockstep_kv_gib <= 0):
        p.error("--lockstep-kv-gib needs --lockstep and a size > 0")
    if args.interleave_s is not None and not (args.sweep and args.lockstep):
        p.error(f"--interleave-s {args.interleave_s:g} needs --sweep and --lockstep: the runs' "
                "engines alive at once, taking turns within a sweep cell")
    if args.interleave_s is not None and args.engine_process:
        p.error(f"--interleave-s {args.interleave_s:g} is not allowed with --engine-process: "
                "an engine core in its own process keeps stepping while its run waits for "
                "its turn")
    if args.pin_cpus:
        try:
            missing = parse_cpus(args.pin_cpus) - os.sched_getaffinity(0)
        except argparse.ArgumentTypeError as e:
            p.error(str(e))
        if missing:
            p.error(f"--pin-cpus: CPUs {sorted(missing)} are not available here")
    args.run_specs = list(dict.fromkeys(runs))
    args.lockstep_kv_gib_given = args.lockstep_kv_gib
    if not args.sweep:
        args.pool_spec = None
    return args


def check_sweep_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--sweep``'s arguments (before any model work): ranges, prefix caching, the
    oracle setups' in-process engine, contexts longer than the tails."""
    from e2e_sweep import DEFAULT_OUTPUTS, DEFAULT_TAILS, PRIMES, PoolSpec, check_range

    try:
        tails = check_range("--prompt-tails", list(args.prompt_tails or DEFAULT_TAILS))
        outputs = check_range("--output-lengths", list(args.output_lengths
                                                       or DEFAULT_OUTPUTS), lo_min=2)
    except ValueError as e:
        p.error(str(e))
    if args.prime not in PRIMES:
        p.error(f"--prime {args.prime} is not allowed with --sweep: one of "
                f"{', '.join(PRIMES)} (the shared prefix lives in the prefix cache)")
    if args.engine_process and any(SETUPS[s].oracle for s in args.setups):
        p.error("--engine-process is not allowed with the rank-oracle setups "
                f"({', '.join(s for s in args.setups if SETUPS[s].oracle)}): the oracle "
                "wraps the loader in the run's own process")
    short = [c for c in (args.contexts or []) if c <= tails[1]]
    if short:
        p.error(f"--contexts {short} are not allowed with --prompt-tails {tails[0]} "
                f"{tails[1]}: each context must be longer than the longest tail")
    args.pool_spec = PoolSpec(args.pool_factor, tails, outputs, min_pool=args.min_pool)
    args.max_tokens = outputs[1]


def from_json(paths: list[str], out_dir: str | None) -> int:
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        stem = Path(out_dir) / Path(path).stem if out_dir else Path(path).with_suffix("")
        render(data, stem.with_suffix(".md"), stem.with_suffix(".png"))
        print(f"wrote {stem.with_suffix('.md')} and {stem.with_suffix('.png')}")
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        from e2e_child import child_main

        child_main(args.child)
        return 0  # not reached: child_main exits
    if args.from_json:
        return from_json(args.from_json, args.out_dir)
    from tqdm import tqdm

    command = "python " + shlex.join([os.path.relpath(sys.argv[0], REPO_ROOT)] + (
        list(argv) if argv is not None else sys.argv[1:]))
    start = time.time()
    deadline = start + 60 * args.max_minutes if args.max_minutes else None
    total = 0
    for name in args.setups:
        setup = SETUPS[name]
        margin = sequence_margin(args.run_specs, setup)
        kinds = args.prompts or list(setup.default_kinds)
        cells, _ = plan_cells(setup, setup_contexts(setup, args), args.batches, kinds,
                              args.max_tokens, margin)
        total += len(cells) * len(args.run_specs) * args.repeats
    with tqdm(total=total, desc="cells", unit="cell") as progress:
        for name in args.setups:
            invocation = {"command": command, "date": time.strftime("%Y-%m-%d %H:%M"),
                          "runs": [r.name for r in args.run_specs],
                          "max_tokens": args.max_tokens, "temperature": args.temperature,
                          "graphs": not args.eager, "prime": args.prime,
                          "engine_process": args.engine_process}
            if args.lockstep:
                invocation["lockstep"] = True
            if args.interleave_s:
                invocation["interleave_s"] = args.interleave_s
            if args.sweep:
                invocation["sweep"] = args.pool_spec.to_json()
                args.lockstep_kv_gib = args.lockstep_kv_gib_given  # per setup
            run_setup(SETUPS[name], args, args.run_specs, progress, deadline, invocation)
    print(f"done in {(time.time() - start) / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
