"""Markdown tables of ``evals/bench_e2e.py`` results (CPU only, standard library; the
PNG plot is ``e2e_plot.py``).

Input: the JSON a run writes beside its markdown (``e2e_<setup>.json``)::

    {"setup": ..., "setup_title": ..., "setup_description": ...,
     "invocations": [{"command", "date", "gpu", "versions", ...}, ...],
     "rows": [{"run", "method", "backend", "budget", "context", "batch", "kind",
               "status", "tokens_per_s", "step_ms", ...}, ...]}
"""

from __future__ import annotations

import os
from collections import defaultdict

from vllm_ddtree.testing.compare import first_mismatch

# Run variants of bench_e2e: (suffix, label in the tables, methods it applies to). The
# run's child applies the variant in its own process before its engine starts, so one
# lockstep run times each variant beside the plain run.
# +skipprefix: vLLM's own methods without the scheduler's common-prefix scan, as DDTree
# engines always run (vllm_ddtree.patches.scheduler_common_prefix).
RUN_VARIANTS = (
    ("+skipprefix", "no common-prefix scan", ("ar", "dflash")),
    # vLLM's num_speculative_tokens_per_batch_size (evals/e2e_sweep.py schedules)
    ("+perbatch", "per-batch schedule", ("dflash", "ddtree")),
    # the DFlash2 drafter shipped for the embedded target (trained / trained_yarn setups)
    ("+dflash2", "DFlash2 selector", ("ddtree",)),
    # with +dflash2: trees over the DFlash2 drafter's marginals, not its selector
    ("+marginals", "over its marginals", ("ddtree",)),
    # ddtree_top_k 1: at B = block_size - 1 the selector's chain walk (vLLM's DFlash2)
    ("+top1", "top-1 children", ("ddtree",)),
    # vLLM's hybrid KV-cache manager where DDTree would pick one KV-cache group
    # (vllm_ddtree/kv_group_choice.py): --no-disable-hybrid-kv-cache-manager
    ("+hybrid", "hybrid KV-cache manager", ("ddtree",)),
    # ddtree-auto: the step gate pinned to one arm, every step (evals/gate_variants.py):
    # auto's machinery at a verify shape below its maximum, against ddtree-16 / ddtree-32
    ("+pin16", "gate pinned to 16", ("ddtree",)),
    ("+pin32", "gate pinned to 32", ("ddtree",)),
    # ... and to its maximum: against ddtree-64, what auto's machinery (the gate's timing
    # and counters, the device's cut) costs where the arm is the same
    ("+pin64", "gate pinned to 64", ("ddtree",)),
    # ddtree-auto: a new batch-size bucket starts on the largest arm within the cap, not
    # on the nearest bucket's arm (evals/gate_variants.py)
    ("+maxprior", "buckets start at B", ("ddtree",)),
    # ddtree-auto: no per-round cut on the device below the gate's arm
    ("+nocut", "no device cut", ("ddtree",)),
    # the MLA tree backend takes extends of up to 512 new tokens (a refill's uncached
    # tail) as decodes through the tree kernel, as FLASH_ATTN_MLA sends them through its
    # decode kernel, not through vLLM's MLA prefill path (gather and up-project the
    # cached context)
    ("+extends512", "extends <= 512 via the tree kernel", ("ddtree",)),
)
# Suffixes that change auto's step gate (ddtree-auto runs only): evals/gate_variants.py
GATE_VARIANTS = ("+pin16", "+pin32", "+pin64", "+maxprior", "+nocut")
# Suffixes whose patch applies in the run's own process (not with --engine-process).
PROCESS_VARIANTS = ("+skipprefix", "+marginals", "+extends512", *GATE_VARIANTS)


def split_run_variants(name: str) -> tuple[str, tuple[str, ...]]:
    """``(base run name, suffixes in RUN_VARIANTS order)`` of a run name such as
    ``dflash@FLASH_ATTN_MLA+skipprefix``."""
    found: set[str] = set()
    stripped = True
    while stripped:
        stripped = False
        for suffix, *_ in RUN_VARIANTS:
            if name.endswith(suffix):
                name, stripped = name[: -len(suffix)], True
                found.add(suffix)
    return name, tuple(s for s, *_ in RUN_VARIANTS if s in found)


METHOD_ORDER = {"ar": 0, "dflash": 1, "ddtree": 2}
BACKEND_ORDER = {"FLASH_ATTN_MLA": 0, "TRITON_MLA": 1, "CUSTOM": 2}
BACKEND_SHORT = {"FLASH_ATTN_MLA": "FA-MLA", "TRITON_MLA": "Triton-MLA", "CUSTOM": "CUSTOM"}

# vLLM 0.26.0 on an H200, batch 1, ms per step: reference figures measured with the same
# shapes in an earlier run (the anchors the kimi setups compare vLLM's own paths with).
ANCHORS: dict[str, dict[str, dict[int, float]]] = {
    "kimi64": {
        "ar@FLASH_ATTN_MLA": {1024: 1.86, 16384: 2.23, 65536: 2.22, 131072: 2.37},
        "dflash@FLASH_ATTN_MLA": {1024: 4.55, 16384: 7.54, 65536: 9.55, 131072: 10.50},
        "ar@TRITON_MLA": {1024: 2.44, 16384: 2.52, 65536: 2.96, 131072: 3.63},
        "dflash@TRITON_MLA": {1024: 20.1, 16384: 20.9, 65536: 26.7, 131072: 39.3},
    },
    "kimi8": {
        "ar@FLASH_ATTN_MLA": {1024: 1.73, 16384: 1.87, 65536: 1.86, 131072: 2.79},
        "dflash@FLASH_ATTN_MLA": {1024: 2.94, 16384: 5.03, 65536: 4.99, 131072: 5.97},
        "dflash@TRITON_MLA": {1024: 11.2, 16384: 14.0, 65536: 21.9, 131072: 17.3},
    },
}


def run_sort_key(row: dict) -> tuple:
    budget = row.get("budget")
    return (METHOD_ORDER.get(row.get("method"), 9), BACKEND_ORDER.get(row.get("backend"), 9),
            budget if isinstance(budget, int) else 10**9, run_id(row))


def run_id(row: dict) -> str:
    """The run a row belongs to: its ``run`` name, told apart from the same run measured
    with ``--engine-process`` or sampled (``--temperature``)."""
    temperature = f" @T={row['temperature']:g}" if row.get("temperature") else ""
    return (str(row.get("run")) + (" @engine-process" if row.get("engine_process") else "")
            + temperature)


def run_label(row: dict) -> str:
    """The method's name in the tables (``(engine process)`` for ``--engine-process``
    rows, which sit beside the in-process ones of the same run; the ``RUN_VARIANTS``
    labels, e.g. ``no common-prefix scan`` for ``+skipprefix`` runs)."""
    suffix = " (engine process)" if row.get("engine_process") else ""
    if row.get("temperature"):
        suffix += f", T = {row['temperature']:g}"
    method, backend = row.get("method"), row.get("backend")
    variants = split_run_variants(str(row.get("run", "")))[1]
    suffix = "".join(f", {label}" for name, label, _ in RUN_VARIANTS
                     if name in variants) + suffix
    if method == "ddtree":
        if str(row.get("run", "")).startswith("ddtree-autofixed"):
            return "DDTree B=auto, fixed shape" + suffix
        return f"DDTree B={row.get('budget')}{suffix}"
    name = {"ar": "AR", "dflash": "DFlash chain"}.get(method, str(method))
    return f"{name}, {BACKEND_SHORT.get(backend, backend)}{suffix}"


def ctx_label(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 and n >= 1024 else str(n)


def _f(value, digits: int = 2) -> str:
    if value is None:
        return "—"
    if isinstance(value, str):  # already formatted
        return value
    if isinstance(value, float) and value != value:  # NaN
        return "—"
    if abs(value) >= 1000:
        return f"{value:.0f}"
    if abs(value) >= 100:
        return f"{value:.0f}" if digits <= 2 else f"{value:.1f}"
    return f"{value:.{digits}f}"


def ok_rows(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r.get("status") == "ok"]


def collapse_repeats(rows: list[dict]) -> list[dict]:
    """One row per (run, context, batch, kind): with several measured repeats
    (``bench_e2e.py --repeats``) the repeat of median step time (the lower median), with
    ``repeats`` (n), ``step_ms_min`` and ``step_ms_max`` added; its own split and
    counters stay, so every column comes from one measurement. Cells without a
    measured repeat keep their first row."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        groups[(run_id(r), r.get("context"), r.get("batch"), r.get("kind"))].append(r)
    out = []
    for group in groups.values():
        measured = sorted(ok_rows(group), key=lambda r: r.get("step_ms") or float("inf"))
        if len(measured) < 2:
            out.append(measured[0] if measured else group[0])
            continue
        steps = [r["step_ms"] for r in measured if r.get("step_ms") is not None]
        median = dict(measured[(len(measured) - 1) // 2], repeats=len(measured))
        if steps:
            median.update(step_ms_min=min(steps), step_ms_max=max(steps))
        out.append(median)
    return out


def _spread_table(rows: list[dict]) -> list[str]:
    """Step ms over repeats, ``median (min-max, n)``, per (batch, kind); empty without
    repeated cells."""
    repeated = [r for r in ok_rows(rows) if r.get("repeats", 1) > 1]
    if not repeated:
        return []
    for r in repeated:
        r["step_spread"] = (f"{_f(r['step_ms'])} ({_f(r.get('step_ms_min'))}-"
                            f"{_f(r.get('step_ms_max'))}, n={r['repeats']})")
    lines = ["## Step ms over repeats (median, min-max, n)", "",
             "Runs were started interleaved (A B C C B A ...); the tables above show each "
             "cell's median repeat.", ""]
    return lines + _pivot(repeated, "step_spread", "Step ms spread")


def ar_key(row: dict) -> tuple:
    """The AR row a row is compared with: same cell, engine layout and temperature."""
    return (row["context"], row["batch"], row["kind"], bool(row.get("engine_process")),
            row.get("temperature", 0.0))


def reference_ar(rows: list[dict]) -> dict[tuple, float]:
    """tokens/s of the AR reference per :func:`ar_key` (context, batch, kind, engine
    process, temperature): the ``ar@FLASH_ATTN_MLA`` of the same engine layout when
    measured, else the first AR run in table order."""
    best: dict[tuple, tuple] = {}
    for r in ok_rows(rows):
        if r.get("method") != "ar" or not r.get("tokens_per_s"):
            continue
        key = ar_key(r)
        rank = run_sort_key(r)
        if key not in best or rank < best[key][0]:
            best[key] = (rank, r["tokens_per_s"])
    return {k: v[1] for k, v in best.items()}


def ar_outputs(rows: list[dict]) -> dict[tuple, list[list[int]]]:
    """AR's generated ids per (context, batch, kind): those of the first AR row in
    table order that recorded them (``output_token_ids``, one list per request)."""
    out: dict[tuple, list[list[int]]] = {}
    for r in sorted(ok_rows(rows), key=run_sort_key):
        key = (r.get("context"), r.get("batch"), r.get("kind"))
        if (r.get("method") == "ar" and r.get("output_token_ids") and key not in out
                and not r.get("temperature")):
            out[key] = r["output_token_ids"]
    return out


def tokens_vs_ar(row: dict, ref: dict[tuple, list[list[int]]]) -> str:
    """``same`` when every request generated AR's ids in the same cell, else how many
    did and the earliest differing token (bf16 argmax ties can cause one: the GPU
    tests measure those gaps); ``ref`` for AR rows with the reference's ids."""
    if row.get("temperature"):
        return "sampled"  # same distribution, not the same tokens
    ids = row.get("output_token_ids")
    ar = ref.get((row.get("context"), row.get("batch"), row.get("kind")))
    if not ids or not ar:
        return "—"
    if row.get("method") == "ar" and ids == ar:
        return "ref"
    diffs = [first_mismatch(a, b) for a, b in zip(ar, ids, strict=False)]
    same = sum(d is None for d in diffs)
    if same == len(diffs) and len(ar) == len(ids):
        return "same"
    firsts = [d for d in diffs if d is not None]
    where = f", first diff at token {min(firsts)}" if firsts else ""
    return f"{same}/{len(ids)} same{where}"


def distinct_ngrams(ids: list[list[int]], n: int = 4) -> float | None:
    """Share of distinct ``n``-grams among a cell's generated ids (all requests): near
    1 for varied text, low when the greedy continuation loops (which drafters predict
    well, so acceptance alone can flatter a method)."""
    grams = [tuple(seq[i:i + n]) for seq in ids for i in range(len(seq) - n + 1)]
    return len(set(grams)) / len(grams) if grams else None


def prompt_set_of(kind: str) -> str:
    """``code@2`` -> ``code``: the prompt set a cell's prompts belong to."""
    return kind.split("@", 1)[0]


def _prompt_set_table(rows: list[dict]) -> list[str]:
    """Tokens/s over each prompt set measured on several prompts (``code``,
    ``code@1``, ...) at one context and batch: total tokens over total decode time of
    the run's cells, so every prompt weighs by the time it took; x AR / x chain against
    the AR and DFlash-chain runs of the same set. Runs missing a prompt are left out."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in ok_rows(rows):
        if r.get("tokens") and r.get("decode_s"):
            groups[(prompt_set_of(r["kind"]), r["context"], r["batch"],
                    r.get("temperature", 0.0))].append(r)
    lines: list[str] = []
    for (pset, context, batch, temperature), group in sorted(groups.items()):
        kinds = sorted({r["kind"] for r in group})
        if len(kinds) < 2:
            continue
        by_run: dict[str, list[dict]] = defaultdict(list)
        for r in group:
            by_run[run_id(r)].append(r)
        totals = []
        for runs in by_run.values():
            if sorted(r["kind"] for r in runs) != kinds:
                continue
            tps = sum(r["tokens"] for r in runs) / sum(r["decode_s"] for r in runs)
            drafts = sum(r.get("drafts") or 0 for r in runs)
            accepted = sum(r.get("accepted") or 0 for r in runs)
            accept = 1 + accepted / drafts if drafts else (
                1.0 if runs[0].get("method") == "ar" else None)
            speeds = [r[k] for r in runs for k in ("python_ms", "python_ms_after")
                      if r.get(k) is not None]
            speed = f"{min(speeds):.2f}-{max(speeds):.2f}" if speeds else "—"
            totals.append((runs[0], tps, accept, speed))
        totals.sort(key=lambda t: run_sort_key(t[0]))
        ar = next((t[1] for t in totals if t[0].get("method") == "ar"), None)
        chain = next((t[1] for t in totals if t[0].get("method") == "dflash"), None)
        if not lines:
            lines = ["## Over each prompt set", "",
                     "Total tokens over total decode time of a run's cells on every prompt "
                     "of the set (the median repeat of each cell); accept len = 1 + all "
                     "accepted / all drafts. Python ms: the range of the fixed host loop "
                     "(before / after each cell; host-bound steps compare only where it "
                     "agrees).", ""]
        sampled = f", T = {temperature:g}" if temperature else ""
        lines += [f"### {pset} prompts ({', '.join(kinds)}), {ctx_label(context)}, "
                  f"batch {batch}{sampled}", "",
                  "| method | tok/s | x AR | x chain | accept len | Python ms |",
                  "|---|---|---|---|---|---|"]
        for row, tps, accept, speed in totals:
            lines.append(f"| {run_label(row)} | {_f(tps, 0)} | {_f(tps / ar if ar else None)}"
                         f" | {_f(tps / chain if chain else None)} | {_f(accept)} | {speed} |")
        lines.append("")
    return lines


EQUAL_HOST_SPREAD = 1.25  # a pair's four fixed-loop timings within this factor


def _host_spread(*rows: dict) -> float | None:
    """max / min of the rows' fixed Python loop timings (before and after each)."""
    speeds = [r[k] for r in rows for k in ("python_ms", "python_ms_after")
              if r.get(k) is not None]
    return max(speeds) / min(speeds) if speeds and min(speeds) > 0 else None


def _median(values: list[float]) -> float:
    values = sorted(values)
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def _paired_table(rows: list[dict]) -> list[str]:
    """``--lockstep`` rows only: per cell and round, each run's tokens/s over the DFlash
    chain's and AR's of the same round (measured seconds apart), summarised as median
    (min-max) and how many rounds the run was ahead; then the same over the pairs whose
    fixed Python loop agreed within :data:`EQUAL_HOST_SPREAD` (host-bound steps follow
    the interpreter's speed, which moved up to 2x between measurements on the H200
    host). Empty without lockstep rows."""
    paired = [r for r in ok_rows(rows) if r.get("measured_seq") is not None
              and r.get("tokens_per_s")]
    if not paired:
        return []
    rounds: dict[tuple, dict[str, dict]] = defaultdict(dict)
    for r in paired:
        rounds[(r["context"], r["batch"], r["kind"], r.get("temperature", 0.0),
                r.get("repeat", 0))][run_id(r)] = r
    cells: dict[tuple, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for (context, batch, kind, temperature, _), by_run in rounds.items():
        refs = {m: next((r for r in sorted(by_run.values(), key=run_sort_key)
                         if r.get("method") == m), None) for m in ("dflash", "ar")}
        for key, r in by_run.items():
            for m, ref in refs.items():
                if ref is None or ref is r or r.get("method") == "ar":
                    continue
                spread = _host_spread(r, ref)
                cells[(kind, batch, context, temperature)][(key, m)].append(
                    (r["tokens_per_s"] / ref["tokens_per_s"], spread, r))
    lines = ["## Paired rounds (`--lockstep`)", "",
             "Each round measured every run's cell seconds apart; *x chain* / *x AR* = the "
             "run's tokens/s over the DFlash chain's / AR's of the same round: median "
             "(min-max), then rounds ahead out of rounds. *equal host*: only the pairs whose "
             f"fixed Python loop (before and after both cells) agreed within "
             f"{EQUAL_HOST_SPREAD:g}x.", "",
             "| prompts | batch | ctx | method | x chain | ahead | x chain, equal host | "
             "x AR | ahead | x AR, equal host |", "|---|---|---|---|---|---|---|---|---|---|"]

    def summary(values):
        if not values:
            return "—", "—", "—"
        ratios = [v[0] for v in values]
        equal = [v[0] for v in values if v[1] is not None and v[1] <= EQUAL_HOST_SPREAD]
        eq = (f"{_median(equal):.2f} (n={len(equal)})" if equal else "none")
        return (f"{_median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})",
                f"{sum(x > 1 for x in ratios)}/{len(ratios)}", eq)

    for (kind, batch, context, _), by_key in sorted(cells.items()):
        runs = sorted({key for key, _ in by_key}, key=lambda k: run_sort_key(
            next(v[2] for (kk, _), vs in by_key.items() if kk == k for v in vs)))
        for key in runs:
            example = next(v[2] for (kk, _), vs in by_key.items() if kk == key for v in vs)
            chain = summary(by_key.get((key, "dflash"), []))
            ar = summary(by_key.get((key, "ar"), []))
            lines.append(f"| {kind} | {batch} | {ctx_label(context)} | {run_label(example)} | "
                         f"{' | '.join(chain)} | {' | '.join(ar)} |")
    return lines + [""]


def sorted_rows(rows: list[dict]) -> list[dict]:
    return sorted(rows, key=lambda r: (r.get("kind", ""), r.get("batch", 0),
                                       run_sort_key(r), r.get("context", 0)))


# ---------------------------------------------------------------------------------------
# Markdown


def _lockstep_text(invocations: list[dict]) -> str:
    """The "How to read" sentence on how the runs shared the machine: one after another,
    or (``--lockstep`` invocations) all engines alive at once, each cell measured by every
    run in turn; empty when no invocation was lockstep."""
    lockstep = [i for i in invocations if i.get("lockstep")]
    if not lockstep:
        return ""
    kv = sorted({i["lockstep_kv_cache_gib"] for i in lockstep if i.get("lockstep_kv_cache_gib")})
    size = f" of {', '.join(str(g) for g in kv)} GiB" if kv else ""
    which = ("" if len(lockstep) == len(invocations) else
             "In the `--lockstep` invocations (the others ran the methods one after "
             "another), ")
    start = which or "With `--lockstep`, "
    return (f"{start}all runs' engines were alive at once on the GPU (each with a fixed "
            f"KV cache{size}, `kv_cache_memory_bytes`: no start-up memory profiling), and "
            "each cell was measured by every run in turn, one engine working at a time, "
            "the order reversed on alternate rounds (repeats): the methods of a cell were "
            "measured seconds apart, not minutes. ")


def _header(data: dict) -> list[str]:
    lines = [f"# End-to-end decoding: {data.get('setup_title') or data.get('setup')}", ""]
    if data.get("setup_description"):
        lines += [data["setup_description"], ""]
    invocations = data.get("invocations") or []
    gpus = sorted({i.get("gpu") for i in invocations if i.get("gpu")})
    versions = {}
    for inv in invocations:
        versions.update(inv.get("versions") or {})
    if gpus:
        lines.append(f"- GPU: {', '.join(gpus)}")
    if versions:
        lines.append("- versions: " + ", ".join(f"{k} {v}" for k, v in sorted(versions.items())))
    for inv in invocations:
        when = f" ({inv['date']})" if inv.get("date") else ""
        lines.append(f"- command{when}: `{inv.get('command', '?')}`")
    kv = [i for i in invocations if i.get("kv_cache_gib")]
    if kv:
        largest = max(kv, key=lambda i: i["kv_cache_gib"]["total"])
        ctx, batch = largest["kv_cache_cell"]
        gib = largest["kv_cache_gib"]
        lines.append(f"- KV cache of the largest cell ({ctx_label(ctx)} x {batch}): "
                     f"{gib['total']} GiB (target {gib['target']}, drafter {gib['drafter']})")
    settings = sorted({(i.get("max_tokens"), i.get("graphs"), i.get("prime"), i.get("temperature"))
                       for i in invocations})
    for max_tokens, graphs, prime, temperature in settings:
        lines.append(f"- {max_tokens} new tokens per request (ignore_eos), temperature "
                     f"{temperature}, CUDA graphs {'on' if graphs else 'off'}, "
                     f"prompts primed into the prefix cache: {prime}")
    layouts = sorted({bool(i.get("engine_process")) for i in invocations})
    for remote in layouts:
        lines.append("- engine: " + (
            "engine core in its own process, as `vllm serve` runs it (`--engine-process`; "
            "the step timer runs there)" if remote else
            "in the run's process (the front end's work shares the engine's thread)"))
    lines += [
        "",
        "How to read: every method runs in its own process (a fresh `LLM`) on vLLM's V2 "
        "model runner (the engine's process: see *engine* above). " + _lockstep_text(
            invocations) + "Per cell, a "
        "`max_tokens=1` generate first prefills the prompts into the prefix cache, then "
        "the measured generate "
        "re-sends them (all requests start decoding together; prefill is excluded). "
        "*decode time* is the GPU timeline (CUDA events) from the first to the last pure "
        "decode step; tokens/s = batch x (max_tokens - 1) / decode time; step = decode "
        "time / decode steps. Accept len = 1 + accepted / drafts (tokens per round per "
        "request, vLLM's spec-decode counters), depth = accepted / drafts. Split of a step "
        "(means per decode step): draft = `speculator.propose` (for DDTree incl. KV "
        "compaction), verify = `execute_model` (input preparation + target forward), "
        "other = step - draft - verify (sampling / rejection / tree walk = *sample*, "
        "scheduler and output handling). x AR = tokens/s over the AR reference "
        "(FA-MLA AR) in the same cell. Active nodes (`ddtree_budget: \"auto\"`): tree "
        "nodes verified per round, the mean of the chosen budgets. Host draft / verify: "
        "host time inside propose / execute_model; a GPU span close to its host time "
        "means the GPU waited for the host's launches. FULL graph steps: decode steps "
        "whose target (verify) / drafter (draft) forward replayed a FULL CUDA graph, out "
        "of those that dispatched one; fewer means piecewise or eager forwards.",
        "",
    ]
    return lines


def _pivot(rows: list[dict], value: str, title: str, digits: int = 2) -> list[str]:
    """One table per (batch, kind): runs x contexts."""
    lines: list[str] = []
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in ok_rows(rows):
        groups[(r["batch"], r["kind"])].append(r)
    for (batch, kind), group in sorted(groups.items()):
        contexts = sorted({r["context"] for r in group})
        by_run: dict[str, dict] = {}
        order: dict[str, tuple] = {}
        for r in group:
            by_run.setdefault(run_id(r), {})[r["context"]] = r.get(value)
            order[run_id(r)] = (run_sort_key(r), run_label(r))
        lines += [f"### {title}, batch {batch}, {kind} prompts", "",
                  "| method | " + " | ".join(ctx_label(c) for c in contexts) + " |",
                  "|---|" + "---|" * len(contexts)]
        for run in sorted(by_run, key=lambda k: order[k][0]):
            cells = [_f(by_run[run].get(c), digits) for c in contexts]
            lines.append(f"| {order[run][1]} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def _anchor_table(data: dict) -> list[str]:
    anchors = ANCHORS.get(data.get("setup"), {})
    if not anchors:
        return []
    measured = {(r["run"], r["context"]): r.get("step_ms") for r in ok_rows(data["rows"])
                if r["batch"] == 1 and not r.get("engine_process")}
    contexts = sorted({c for a in anchors.values() for c in a})
    runs = list(anchors)
    head = []
    for run in runs:
        method, backend = run.split("@")
        label = run_label({"method": method, "backend": backend})
        head.append(f"{label}: ours / anchor")
    lines = ["## vLLM's own paths against the reference figures (batch 1, ms per step)", "",
             "| context | " + " | ".join(head) + " |", "|---|" + "---|" * len(runs)]
    for c in contexts:
        cells = [f"{_f(measured.get((run, c)))} / {_f(anchors[run].get(c))}" for run in runs]
        lines.append(f"| {ctx_label(c)} | " + " | ".join(cells) + " |")
    lines += ["", "Anchor figures were measured with the same shapes in another run "
              "(its AR runs may have used the V1 runner: a DeepSeek-V3 target with experts "
              "listed defaults to V1; here every run uses V2).", ""]
    return lines


def _host_split(row: dict) -> str:
    """``host draft / host verify`` ms (rows measured before the timer kept host time
    have neither)."""
    if row.get("host_draft_ms") is None and row.get("host_verify_ms") is None:
        return "—"
    return f"{_f(row.get('host_draft_ms'))} / {_f(row.get('host_verify_ms'))}"


def _graph_steps(row: dict) -> str:
    """``verify / draft``: decode steps that replayed a FULL CUDA graph, of those
    dispatched (rows measured before the timer noted graph modes have neither)."""
    counts = row.get("full_graph_steps") or {}
    if not counts:
        return "—"
    cells = [f"{counts[k][0]}/{counts[k][1]}" if k in counts else "—"
             for k in ("verify", "draft")]
    return " / ".join(cells)


# (column, host region of e2e_timing.HOST_REGIONS) of the host-time table
_HOST_COLUMNS = (("execute_model", "verify"), ("sample_tokens", "sample_tokens"),
                 ("propose", "draft"), ("vLLM DFlash propose", "dflash_propose"),
                 ("KV compaction", "compact"), ("tree scatter", "store_trees"),
                 ("budget choice", "budget"), ("verifier", "verifier"),
                 ("GC pauses", "gc"))


def _host_table(rows: list[dict]) -> list[str]:
    """Host ms per decode step by region (``host_regions_ms``): ``execute_model`` +
    ``sample_tokens`` is the runner's host time per step (``propose`` runs inside
    ``sample_tokens``; vLLM's DFlash ``propose`` inside DDTree's). Empty when no row
    has the regions (rows measured before the timer kept them)."""
    measured = [r for r in sorted_rows(ok_rows(rows)) if r.get("host_regions_ms")]
    if not measured:
        return []
    header = ["method", "ctx", "batch", "prompts", "step ms", "runner host / step"]
    header += [name for name, _ in _HOST_COLUMNS] + ["Python threads",
                                                      "Python ms (fixed loop, before -> after)",
                                                      "machine steal % / busy % / MHz"]
    lines = ["## Host time per decode step by region (ms)", "",
             "Host (CPU) time inside each call, means over the decode steps. A runner "
             "host time near the step time means the step is host-bound (the GPU waits "
             "for launches); the rest of a step's host time is vLLM's scheduler and "
             "output handling. GC pauses: Python garbage collections that ran inside a "
             "step (in any region). Python threads: live threads of the engine's process "
             "(names in the JSON); Triton's launcher releases the GIL around each "
             "launch, so another thread may run inside a round. Python ms: one fixed "
             "pure-Python workload timed in "
             "the run's process just before the cell (`e2e_timing.python_speed_ms`), with "
             "the CPU and NUMA node it ran on, and again just after it (on a shared host it "
             "can change up to 2x between two cells of one process); machine steal / busy / "
             "MHz: the whole machine's CPU time over the measured generate given to other "
             "guests (hypervisor steal) and not idle, and its clock (`e2e_timing."
             "host_cpu_delta`); "
             "host-bound steps of two runs compare only where it agrees (it can differ "
             "by 1.8x between processes of one run).", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in measured:
        regions = r["host_regions_ms"]
        runner = regions.get("verify", 0.0) + regions.get("sample_tokens", 0.0)
        cells = [run_label(r), ctx_label(r["context"]), str(r["batch"]), r["kind"],
                 _f(r.get("step_ms")), _f(runner)]
        cells += [_f(regions.get(key)) if regions.get(key) else "—" for _, key in _HOST_COLUMNS]
        threads = r.get("engine_threads")
        cells.append(str(len(threads)) if threads else "—")
        speed = _f(r.get("python_ms")) if r.get("python_ms") else "—"
        if r.get("python_ms_after"):
            speed += f" -> {_f(r['python_ms_after'])}"
        if r.get("cpu") is not None:
            node = r.get("numa_node")
            speed += f" (cpu {r['cpu']}{'' if node is None else f', node {node}'})"
        cells.append(speed)
        machine = "—"
        if r.get("host_steal_pct") is not None:
            machine = f"{r['host_steal_pct']:.1f} / {r['host_busy_pct']:.0f}"
            if r.get("host_mhz"):
                machine += f" / {r['host_mhz']:.0f}"
        cells.append(machine)
        lines.append("| " + " | ".join(cells) + " |")
    return lines + [""]


def _full_table(rows: list[dict]) -> list[str]:
    ref = reference_ar(rows)
    header = ["method", "ctx", "batch", "prompts", "tok/s", "x AR", "step ms",
              "median step", "accept len", "depth", "draft ms", "verify ms", "other ms",
              "(sample ms)", "(compact ms)", "host draft / verify ms",
              "FULL graph steps verify / draft", "active nodes", "tokens vs AR",
              "distinct 4-grams", "note"]
    lines = ["## All cells", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    outputs = ar_outputs(rows)
    for r in sorted_rows(rows):
        note = r.get("note") or ""
        if r.get("status") != "ok":
            cells = [run_label(r), ctx_label(r["context"]), str(r["batch"]), r["kind"]]
            cells += ["—"] * (len(header) - 5) + [f"{r.get('status')}: {note}".strip(": ")]
            lines.append("| " + " | ".join(cells) + " |")
            continue
        base = ref.get(ar_key(r))
        speedup = r["tokens_per_s"] / base if base and r.get("tokens_per_s") else None
        compact = r.get("compact_ms") if r.get("method") == "ddtree" else None
        cells = [run_label(r), ctx_label(r["context"]), str(r["batch"]), r["kind"],
                 _f(r.get("tokens_per_s"), 0), _f(speedup), _f(r.get("step_ms")),
                 _f(r.get("step_ms_median")), _f(r.get("acceptance_length")),
                 _f(r.get("accepted_depth")), _f(r.get("draft_ms")), _f(r.get("verify_ms")),
                 _f(r.get("other_ms")), _f(r.get("sample_ms")), _f(compact),
                 _host_split(r), _graph_steps(r), _f(r.get("active_nodes_per_round"), 1),
                 tokens_vs_ar(r, outputs),
                 _f(distinct_ngrams(r["output_token_ids"]) if r.get("output_token_ids")
                    else None), note]
        lines.append("| " + " | ".join(cells) + " |")
    return lines + [""]


def _answers(data: dict) -> list[str]:
    """Generated reading of the table: growth of step latency with context, and the
    split of a step at the shortest and the longest context."""
    rows = ok_rows(data["rows"])
    lines = ["## Reading (generated from the rows above)", ""]
    by_run: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        by_run[(r["kind"], r["batch"], run_id(r))].append(r)
    growth = []
    for (kind, _batch, _run), group in sorted(
            by_run.items(), key=lambda kv: (kv[0][0], kv[0][1], run_sort_key(kv[1][0]))):
        group.sort(key=lambda r: r["context"])
        lo, hi = group[0], group[-1]
        if lo["context"] == hi["context"] or not lo.get("step_ms") or not hi.get("step_ms"):
            continue
        parts = []
        for key in ("draft_ms", "verify_ms", "other_ms"):
            if lo.get(key) is not None and hi.get(key) is not None:
                parts.append(f"{key[:-3]} {_f(lo[key])}->{_f(hi[key])}")
        growth.append(
            f"- {run_label(lo)} ({kind}, batch {lo['batch']}): step {_f(lo['step_ms'])} ms at "
            f"{ctx_label(lo['context'])} -> {_f(hi['step_ms'])} ms at {ctx_label(hi['context'])} "
            f"(x{hi['step_ms'] / lo['step_ms']:.2f}); " + ", ".join(parts))
    if growth:
        lines += ["Step latency from the shortest to the longest context (ms):", ""] + growth
        lines.append("")
    spec = [r for r in rows if r.get("method") != "ar" and r.get("acceptance_length")]
    if spec:
        best = max(spec, key=lambda r: r.get("tokens_per_s") or 0)
        lines.append(
            f"- Fastest speculative cell: {run_label(best)} at {ctx_label(best['context'])}, "
            f"batch {best['batch']}, {best['kind']} prompts: {_f(best['tokens_per_s'], 0)} "
            f"tok/s, accept len {_f(best['acceptance_length'])}.")
        lines.append("")
    if len(lines) == 2:
        lines += ["(no context sweep in these rows)", ""]
    return lines


def write_markdown(data: dict, path: str) -> None:
    rows = collapse_repeats(data.get("rows") or [])
    lines = _header(data)
    lines += _anchor_table(dict(data, rows=rows))
    lines += ["## Step latency (ms per decoding step)", ""] + _pivot(rows, "step_ms", "Step ms")
    lines += ["## Throughput (tokens/s)", ""] + _pivot(rows, "tokens_per_s", "tok/s", 0)
    if any(r.get("method") != "ar" for r in ok_rows(rows)):
        lines += ["## Mean acceptance length (tokens per round)", ""]
        lines += _pivot([r for r in rows if r.get("method") != "ar"], "acceptance_length",
                        "Accept len")
    lines += _prompt_set_table(rows)
    lines += _paired_table(data.get("rows") or [])
    lines += _spread_table(rows)
    lines += _full_table(rows)
    lines += _host_table(rows)
    lines += _answers(dict(data, rows=rows))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write("\n".join(lines).rstrip() + "\n")
