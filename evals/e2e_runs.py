# SPDX-License-Identifier: Apache-2.0
"""Runs, cells and result rows of ``evals/bench_e2e.py`` (pure Python: tested on CPU).

A run is one method (``RunSpec``: ``ar@BACKEND``, ``dflash@BACKEND``, ``ddtree-B``,
``ddtree-auto[fixed][-M]``, optionally with ``e2e_report.RUN_VARIANTS`` suffixes); a cell
is one (context, batch, prompt kind). A row holds a cell's figures for one run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
from dataclasses import dataclass

from e2e_models import CHECKPOINTS, Setup, parse_prompt_kind
from e2e_report import GATE_VARIANTS, RUN_VARIANTS, split_run_variants

from vllm_ddtree.metrics import SPEC_DECODE_COUNTERS

TREE_BACKEND = "CUSTOM"
DEFAULT_AUTO_MAX = 64  # maximum B of ddtree-auto when neither --auto-max nor a grid says
MAX_BUDGET = 512  # vllm_ddtree.config.MAX_BUDGET
SPEC_COUNTERS = SPEC_DECODE_COUNTERS
STATUS_OK, STATUS_SKIPPED, STATUS_FAILED, STATUS_NOT_RUN = "ok", "skipped", "failed", "not run"


def chain_schedule(block_size: int) -> list[list[int]]:
    """``num_speculative_tokens_per_batch_size`` of ``dflash@...+perbatch``: the whole
    block (block_size - 1) at batch <= 4, fewer above, 0 (plain decoding) from 32."""
    full = block_size - 1
    return [[1, 4, full], [5, 8, max(1, full // 2)], [9, 16, max(1, full // 4)],
            [17, 31, 1], [32, 4096, 0]]


def ddtree_schedule(budget: int) -> list[list[int]]:
    """The same for ``ddtree-B+perbatch``: B at batch <= 4, B/2, B/4, B/16 (>= 1), then
    0 from 32."""
    return [[1, 4, budget], [5, 8, max(1, budget // 2)], [9, 16, max(1, budget // 4)],
            [17, 31, max(1, budget // 16)], [32, 4096, 0]]


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
            gate = [v for v in variants if v in GATE_VARIANTS]
            if gate and (run.budget != "auto" or run.fixed_shape):
                raise ValueError(f"{text!r}: {gate[0]} changes auto's step gate: "
                                 "ddtree-auto runs only (ddtree-autofixed has no gate)")
            if len(gate) > 1:
                raise ValueError(f"{text!r}: one step-gate variant a run, got {gate}")
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
            config = {"method": "dflash", "model": drafter,
                      "num_speculative_tokens": self.num_spec_tokens(setup)}
            if "+perbatch" in self.variants:
                config["num_speculative_tokens_per_batch_size"] = self.batch_schedule(setup)
            return config
        if "+dflash2" in self.variants:
            drafter = dflash2_drafter(setup, self.name)
        elif "+marginals" in self.variants:
            raise ValueError(f"{self.name}: +marginals needs +dflash2 (a DFlash drafter's "
                             "trees are always over its marginals)")
        config = {"method": "ddtree", "model": drafter,
                  "num_speculative_tokens": self.num_spec_tokens(setup)}
        if "+top1" in self.variants:
            config["ddtree_top_k"] = 1
        if self.budget == "auto":
            config["ddtree_budget"] = "auto"
            if self.fixed_shape:
                config["ddtree_verify_shape"] = "fixed"
        if "+perbatch" in self.variants:
            config["num_speculative_tokens_per_batch_size"] = self.batch_schedule(setup)
        return config

    def engine_args(self) -> dict:
        """vLLM engine arguments of the run's variants: ``+hybrid`` keeps vLLM's hybrid
        KV-cache manager (``disable_hybrid_kv_cache_manager=False``, the
        ``--no-disable-hybrid-kv-cache-manager`` of ``vllm serve``) where DDTree would
        pick one KV-cache group."""
        if "+hybrid" in self.variants:
            return {"disable_hybrid_kv_cache_manager": False}
        return {}

    def batch_schedule(self, setup: Setup) -> list[list[int]] | None:
        """``num_speculative_tokens_per_batch_size`` of a ``+perbatch`` run
        (``e2e_sweep.chain_schedule`` / ``ddtree_schedule``), else None."""
        if "+perbatch" not in self.variants:
            return None
        if self.method == "dflash":
            return chain_schedule(setup.block_size)
        return ddtree_schedule(self.num_spec_tokens(setup))


# Setups whose target the shipped DFlash2 drafter was trained for (the embedded target;
# trained_yarn serves the same weights with YaRN x4).
DFLASH2_SETUPS = ("trained", "trained_dflash2", "trained_yarn")


def dflash2_drafter(setup: Setup, run_name: str) -> str:
    """The shipped DFlash2 drafter of a ``+dflash2`` run (``vllm_ddtree/checkpoints/
    dflash2_drafter``); a ValueError names the run where the setup's target is another."""
    if setup.name not in DFLASH2_SETUPS:
        raise ValueError(f"{run_name}: +dflash2 is for the setups "
                         f"{', '.join(DFLASH2_SETUPS)} (the shipped DFlash2 drafter is "
                         f"trained for their target), not {setup.name}")
    return str(CHECKPOINTS / "dflash2_drafter")


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


def interleaved(runs: list[RunSpec], repeats: int) -> list[tuple[int, RunSpec]]:
    """``(repeat, run)`` in the order the children start: every run once per pass,
    alternate passes reversed (A B C C B A A B C ...), so a drift of the machine over
    the invocation (clocks, a neighbour's load) falls on every run alike."""
    order = []
    for repeat in range(repeats):
        order += [(repeat, run) for run in (runs if repeat % 2 == 0 else runs[::-1])]
    return order


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
# Arithmetic of one cell


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
# Result rows on disk


def write_json_atomic(path: str, data: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


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
