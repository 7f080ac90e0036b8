# SPDX-License-Identifier: Apache-2.0
"""Markdown and PNG of ``evals/bench_e2e.py --sweep`` (CPU: re-render with ``--from-json``).

Per (context, prompt kind) panel: tokens/s of every run against the batch (the median
over ``--repeats``), ``auto``'s ratio to the best other run and to AR (the issue's
0.97 bar), tokens per round, the lossless checks (the oracle setups: requests that left
the target's own greedy chain; the others: requests whose first tokens differ from AR's
in the same cell) and the cells not measured with their reason.
"""

from __future__ import annotations

import statistics

from e2e_report import EQUAL_HOST_SPREAD, _host_spread, ctx_label, run_label, run_sort_key

AUTO_BAR = 0.97  # issue 42: auto >= 0.97 x the best other run, at every batch


def panels(rows: list[dict]) -> list[tuple[int, str]]:
    """The (context, kind) pairs with any row, in order."""
    return sorted({(r["context"], r["kind"]) for r in rows})


def runs_in_order(rows: list[dict]) -> list[str]:
    """Run names ordered as the e2e report orders them (AR, chain, DDTree by B)."""
    first = {}
    for r in rows:
        first.setdefault(r["run"], r)
    return [name for name, _ in sorted(first.items(), key=lambda kv: run_sort_key(kv[1]))]


def median_by_cell(rows: list[dict], value: str) -> dict[tuple, float]:
    """``{(run, context, kind, batch): median of value}`` over the measured rows."""
    got: dict[tuple, list[float]] = {}
    for r in rows:
        if r.get("status") == "ok" and r.get(value) is not None:
            got.setdefault((r["run"], r["context"], r["kind"], r["batch"]), []).append(
                float(r[value]))
    return {k: statistics.median(v) for k, v in got.items()}


def labels(rows: list[dict]) -> dict[str, str]:
    first = {}
    for r in rows:
        first.setdefault(r["run"], r)
    return {name: run_label(row) for name, row in first.items()}


def auto_ratios(speed: dict[tuple, float], runs: list[str], context: int, kind: str,
                batch: int) -> list[tuple[str, float | None, float | None]]:
    """``(auto run, auto / best other run, auto / AR)`` of one cell, for every
    ``ddtree-auto`` run; the other runs are those that are not ``auto`` (an A/B of two
    gates, ``+pin32`` beside plain auto, is held to the same fixed methods)."""
    out = []
    ar = [speed.get((r, context, kind, batch)) for r in runs if r.startswith("ar@")]
    ar_best = max((v for v in ar if v), default=None)
    for auto in (r for r in runs if r.startswith("ddtree-auto")):
        mine = speed.get((auto, context, kind, batch))
        others = [speed.get((r, context, kind, batch)) for r in runs
                  if not r.startswith("ddtree-auto")]
        best = max((v for v in others if v), default=None)
        out.append((auto, mine / best if mine and best else None,
                    mine / ar_best if mine and ar_best else None))
    return out


def repeat_ratio_ranges(rows: list[dict], runs: list[str], context: int, kind: str,
                        batch: int) -> dict[str, tuple[float, float]]:
    """``{auto run: (lowest, highest)}`` of its tokens/s over the best run that is not
    auto, repeat by repeat (lockstep measures a repeat's runs seconds apart), where a
    cell has two repeats or more: the spread the median ratio hides."""
    by_repeat: dict[int, dict[str, float]] = {}
    for r in rows:
        if ((r["context"], r["kind"], r["batch"]) == (context, kind, batch)
                and r.get("status") == "ok" and r.get("tokens_per_s")):
            by_repeat.setdefault(r.get("repeat", 0), {})[r["run"]] = float(r["tokens_per_s"])
    out: dict[str, tuple[float, float]] = {}
    for auto in (r for r in runs if r.startswith("ddtree-auto")):
        ratios = []
        for speeds in by_repeat.values():
            others = [v for run, v in speeds.items() if not run.startswith("ddtree-auto")]
            if auto in speeds and others:
                ratios.append(speeds[auto] / max(others))
        if len(ratios) >= 2:
            out[auto] = (min(ratios), max(ratios))
    return out


def equal_host_ratios(rows: list[dict], runs: list[str], context: int, kind: str,
                      batch: int) -> dict[str, list[float]]:
    """``{auto run: ratios}``: for each of auto's rows of the cell, its tokens/s over the
    best other run's, each run taken only from its rows (any repeat) whose fixed Python
    loop, before and after, agreed with auto's row within :data:`EQUAL_HOST_SPREAD`
    (the median of a run's matching rows; runs without a match left out); an auto row
    gives no ratio where the best other run by the cell's medians (over all its rows)
    has no match, or where its own loop moved past that spread within its window. The
    host's single-thread speed toggled about 2x within seconds on the GPU hosts, and a
    small target's steps follow it."""
    measured = [r for r in rows if (r["context"], r["kind"], r["batch"]) == (context, kind, batch)
                and r.get("status") == "ok" and r.get("tokens_per_s")]
    cell = [r for r in measured if r.get("python_ms") and r.get("python_ms_after")]
    others = [run for run in runs if not run.startswith("ddtree-auto")]
    medians = {run: v for (run, *_), v in median_by_cell(measured, "tokens_per_s").items()
               if run in others}
    out: dict[str, list[float]] = {}
    if not medians:
        return out
    yardstick = max(medians, key=medians.get)
    for auto in (run for run in runs if run.startswith("ddtree-auto")):
        ratios = []
        for mine in (r for r in cell if r["run"] == auto):
            best = {}
            for run in medians:
                matched = [float(r["tokens_per_s"]) for r in cell if r["run"] == run
                           and _host_spread(mine, r) <= EQUAL_HOST_SPREAD]
                if matched:
                    best[run] = statistics.median(matched)
            if yardstick in best:
                ratios.append(float(mine["tokens_per_s"]) / max(best.values()))
        out[auto] = ratios
    return out


def _fmt(v, digits: int = 0) -> str:
    return "—" if v is None else f"{v:,.{digits}f}"


def _speed_table(rows, speed, runs, names, context, kind) -> list[str]:
    batches = sorted({r["batch"] for r in rows if (r["context"], r["kind"]) == (context, kind)})
    autos = [r for r in runs if r.startswith("ddtree-auto")]
    head = ["batch"] + [names[r] for r in runs]
    equal_host = any(r.get("python_ms") for r in rows)
    for a in autos:
        head += [f"{names[a]} / best other", f"{names[a]} / AR"]
        head += [f"{names[a]} / best other, equal host"] if equal_host else []
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for b in batches:
        cells = [str(b)] + [_fmt(speed.get((r, context, kind, b))) for r in runs]
        spread = repeat_ratio_ranges(rows, runs, context, kind, b)
        matched = equal_host_ratios(rows, runs, context, kind, b) if equal_host else {}
        for auto, best, ar in auto_ratios(speed, runs, context, kind, b):
            mark = "" if best is None or best >= AUTO_BAR else " (below 0.97)"
            lo_hi = f" [{spread[auto][0]:.2f}-{spread[auto][1]:.2f}]" if auto in spread else ""
            cells += [_fmt(best, 2) + lo_hi + mark, _fmt(ar, 2)]
            if equal_host:
                ratios = matched.get(auto) or []
                cells.append(f"{statistics.median(ratios):.2f} (n={len(ratios)})" if ratios
                             else "none")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _cell_table(rows, cells: dict[tuple, str], runs, names, context, kind) -> list[str]:
    """A table of ``cells`` (``{(run, context, kind, batch): text}``) by batch, one
    column per run that has a cell; "—" where a run lacks a batch."""
    batches = sorted({r["batch"] for r in rows if (r["context"], r["kind"]) == (context, kind)})
    used = [r for r in runs if any((r, context, kind, b) in cells for b in batches)]
    if not used:
        return []
    lines = ["| batch | " + " | ".join(names[r] for r in used) + " |",
             "|" + "---|" * (len(used) + 1)]
    for b in batches:
        lines.append(f"| {b} | " + " | ".join(cells.get((r, context, kind, b), _fmt(None))
                                            for r in used) + " |")
    return lines


def _value_table(rows, values, runs, names, context, kind, digits=2) -> list[str]:
    """A table of ``values`` (``median_by_cell``) by batch and run."""
    return _cell_table(rows, {k: _fmt(v, digits) for k, v in values.items()}, runs, names,
                       context, kind)


def _pair_table(rows, first, second, runs, names, context, kind, digits=1) -> list[str]:
    """A table of ``first / second`` per run and batch (medians by cell of two row keys)."""
    a, b = median_by_cell(rows, first), median_by_cell(rows, second)
    cells = {k: f"{_fmt(a.get(k), digits)} / {_fmt(b.get(k), digits)}" for k in a.keys() | b}
    return _cell_table(rows, cells, runs, names, context, kind)


def _bucket_of(batch: int) -> str:
    """The step gate's bucket label of a batch size (``gate.bucket_batches``)."""
    from vllm_ddtree.budget.gate import batch_bucket, bucket_batches

    return bucket_batches(batch_bucket(batch))


def gate_in_cell(before: dict, after: dict) -> dict:
    """``after`` (``SpeculationGate.snapshot`` at a cell's end) with each arm's
    ``chosen_in_cell`` and ``samples_in_cell``: its steps and residual samples
    since ``before`` (the snapshot as the cell's timed window began). The gate lives as
    long as its engine, through the warm-up and every earlier cell; an arm with no
    sample in the cell shows a residual measured before it."""
    out = {}
    for bucket, state in after.items():
        old = {a["arm"]: a for a in before.get(bucket, {}).get("arms", [])}
        arms = []
        for a in state["arms"]:
            prev = old.get(a["arm"], {})
            arms.append(dict(a, chosen_in_cell=a["chosen"] - prev.get("chosen", 0),
                             samples_in_cell=a["residual_samples"]
                             - prev.get("residual_samples", 0)))
        out[bucket] = dict(state, arms=arms)
    return out


def gate_tables(rows: list[dict], runs, names, context, kind) -> list[str]:
    """Per ``auto`` run, what its step gate measured in each cell's own batch-size
    bucket at the cell's end (``row["gate"]``, ``SpeculationGate.snapshot``, with
    :func:`gate_in_cell`'s counts where the row has them): the settled arm, and per arm
    its share of the cell's steps, the residual (the gate's estimate of the step time
    beyond the start-up model, ms; "before" where no sample of the cell) and the
    committed tokens per tree."""
    lines = []
    for run in (r for r in runs if r.startswith("ddtree-auto")):
        cells = sorted((r for r in rows if r["run"] == run and r.get("gate")
                        and (r["context"], r["kind"]) == (context, kind)
                        and r.get("repeat", 0) == 0), key=lambda r: r["batch"])
        table = []
        for r in cells:
            bucket = r["gate"].get(_bucket_of(r["batch"]))
            if not bucket:
                continue
            def chosen(a):
                return a.get("chosen_in_cell", a["chosen"])

            def residual(a):
                if not a["residual_samples"]:
                    return f"{a['arm']}: —"
                if a.get("samples_in_cell") == 0:
                    return f"{a['arm']}: {a['residual_ms']:.2f} (before)"
                return (f"{a['arm']}: {a['residual_ms']:.2f} "
                        f"({a.get('samples_in_cell', a['residual_samples'])})")

            total = sum(chosen(a) for a in bucket["arms"]) or 1
            arms = sorted(bucket["arms"], key=lambda a: -chosen(a))
            table.append(
                f"| {r['batch']} | {bucket['settled']} | "
                + ", ".join(f"{a['arm']}: {100 * chosen(a) / total:.0f} %" for a in arms)
                + " | " + ", ".join(residual(a) for a in arms)
                + " | " + ", ".join(f"{a['arm']}: {a['committed']:.2f}" for a in arms)
                + " |")
        per_cell = any("chosen_in_cell" in a for r in cells
                       for b in r["gate"].values() for a in b["arms"])
        counts = ("steps in the cell; residual: the gate's estimate of the step time "
                  "beyond the start-up cost model (the bucket's level plus the arm's "
                  "offset), ms (samples in the cell; \"before\": none, measured in the "
                  "warm-up or an earlier cell)" if per_cell else
                  "steps and samples since the engine started, warm-up and earlier "
                  "cells included; residual: the gate's estimate of the step time beyond "
                  "the start-up cost model (the bucket's level plus the arm's offset), ms "
                  "(samples)")
        if table:
            lines += [f"{names[run]}: the step gate in each cell's batch-size bucket at the "
                      f"cell's end (arms by drafts per request, 0: plain decoding; {counts}):",
                      "",
                      "| batch | settled arm | steps by arm | residual ms by arm | "
                      "committed tokens per tree by arm |", "|---|---|---|---|---|"]
            lines += table + [""]
    return lines


def lossless_lines(rows: list[dict]) -> list[str]:
    """The checks of every measured row: off-chain requests (oracle setups) or requests
    whose first tokens' CRC differs from AR's in the same cell and repeat; a finding
    that repeats word for word over repeats of one cell is listed once, with its count."""
    ar = {(r["context"], r["kind"], r["batch"], r.get("repeat", 0)): r["output_crc"]
          for r in rows if r.get("status") == "ok" and r["run"].startswith("ar@")
          and r.get("output_crc") is not None}
    out: list[str] = []
    kinds = {r["kind"] for r in rows}
    for r in sorted(rows, key=lambda r: (r["context"], r["kind"], r["batch"], r["run"],
                                         r.get("repeat", 0))):
        if r.get("status") != "ok":
            continue
        where = f"{r['run']}, {ctx_label(r['context'])}, batch {r['batch']}"
        where += f", {r['kind']} prompts" if len(kinds) > 1 else ""
        if r.get("requests_off_chain") is not None:
            if r["requests_off_chain"]:
                out.append(f"- {where}: {r['requests_off_chain']} of {r['pool']} requests "
                           "left the target's own greedy chain (from output index "
                           f"{r.get('first_off_chain_index')})")
            continue
        ref = ar.get((r["context"], r["kind"], r["batch"], r.get("repeat", 0)))
        mine = r.get("output_crc")
        if ref is None or mine is None or r["run"].startswith("ar@"):
            continue
        both = [(a, b) for a, b in zip(mine, ref, strict=False) if a is not None and b is not None]
        diff = sum(a != b for a, b in both)
        if diff:
            out.append(f"- {where}: {diff} of {len(both)} requests differ from AR in their "
                       "first 16 tokens (bf16: batch shapes differ, ties can flip)")
    counts: dict[str, int] = {}
    for line in out:  # the same finding in several repeats: once, with its count
        counts[line] = counts.get(line, 0) + 1
    return [line if n == 1 else f"{line} (in {n} repeats)" for line, n in counts.items()]


def write_sweep_markdown(data: dict, path: str) -> None:
    rows = data["rows"]
    runs = runs_in_order(rows)
    names = labels(rows)
    speed = median_by_cell(rows, "tokens_per_s")
    accept = median_by_cell(rows, "acceptance_length")
    active = median_by_cell(rows, "active_nodes_per_round")
    engine_reqs = median_by_cell(rows, "engine_mean_reqs")
    host = median_by_cell([dict(r, host_ms=(r["python_ms"] + r["python_ms_after"]) / 2)
                           for r in rows if r.get("python_ms") and r.get("python_ms_after")],
                          "host_ms")
    stepped = [r for r in rows if r.get("steps") and r.get("decode_s")]
    per_step = median_by_cell([dict(r, tokens_per_step=r["tokens"] / r["steps"])
                               for r in stepped], "tokens_per_step")
    step_ms = median_by_cell([dict(r, step_ms=1000 * r["decode_s"] / r["steps"])
                              for r in stepped], "step_ms")
    median_step = median_by_cell(rows, "step_ms_median")
    refill_excess = median_by_cell(rows, "refill_excess_ms")
    sweep = data.get("sweep") or {}
    inv = (data.get("invocations") or [{}])[-1]
    lines = [f"# Batch sweep: {data.get('setup_title', data.get('setup'))}", "",
             data.get("setup_description", ""), "",
             "Continuous batching through vLLM's engine API (`LLM.llm_engine`): at batch b, "
             f"a pool of {sweep.get('pool_factor')} x b requests (at least "
             f"{sweep.get('min_pool', 6)}), each prompt "
             "a shared "
             "prefix (prefix-cached) plus its own tail of "
             f"{'..'.join(map(str, sweep.get('tails', [])))} tokens, each request "
             f"{'..'.join(map(str, sweep.get('outputs', [])))} new tokens (uniform, "
             "seeded); " + ("the shared prefix is prefilled first (each request "
                            "prefills its own tail when it joins)" if inv.get("prime")
                            == "prefix" else "the pool's prompts are prefilled first")
             + ", then b requests stay in "
             "flight, the next one added as one finishes, and tokens/s is taken over the "
             "window that ends when the pool is spent (concurrency b throughout). Greedy, "
             "bf16, CUDA graphs" + (", every engine alive at once (`--lockstep`), each cell "
                                    "measured by every run seconds apart" if inv.get(
                                        "lockstep") else "") + (
                 f", the runs of a cell taking turns of {inv['interleave_s']:g} s of steps "
                 "(`--interleave-s`) until each has spent its pool, so that the host's "
                 "speed falls on all alike" if inv.get("interleave_s") else "") + ".", ""]
    oracle = data.get("oracle")
    if oracle:
        measured, given = oracle.get("tokens_per_round") or {}, dict(
            oracle.get("oracle_tokens_per_round") or {})
        given.pop("command", None)
        lines += [f"Rank oracle: {oracle.get('rounds')} rounds of the embedded pair "
                  f"({oracle.get('prompts')}; `{oracle.get('command')}`). Tokens per round "
                  f"measured there: {measured}; what the oracle gives over the same "
                  f"rank vectors (CPU, `python evals/e2e_oracle.py`): {given}.", ""]
    if sweep.get("contexts_note"):
        lines += [f"Contexts: {sweep['contexts_note']}.", ""]
    lines += [f"Date {inv.get('date', '?')}, GPU {inv.get('gpu', '?')}, "
              f"versions {inv.get('versions', '?')}.", "", "Command:", "```"]
    lines += [i.get("command", "?") for i in data.get("invocations", [])] + ["```", ""]
    lines += [f"{i['left_out']}" for i in data.get("invocations", []) if i.get("left_out")]
    lines += [""] if any(i.get("left_out") for i in data.get("invocations", [])) else []
    for context, kind in panels(rows):
        title = f"{ctx_label(context)} context, {kind} prompts"
        lines += [f"## Tokens per second, {title}", ""]
        lines += _speed_table(rows, speed, runs, names, context, kind) + [""]
        if any(r.get("repeat", 0) > 0 for r in rows):
            lines += ["Tokens/s: the median over repeats; auto / best other: the ratio of the "
                      "medians, [lowest-highest] of the ratio repeat by repeat (a repeat's "
                      "runs measured seconds apart).", ""]
        if any(r.get("python_ms") for r in rows):
            lines += ["*Equal host*: auto's rows against the other runs' rows of the same cell "
                      "(any repeat) whose fixed Python loop, before and after both windows, "
                      f"agreed within {EQUAL_HOST_SPREAD:g}x (the median of the ratios over "
                      "auto's rows, n of them; none: the best other run by the medians had "
                      "no row on the host speed of any auto row, or auto's own loop moved "
                      "past that spread within its windows). The loop's time toggles between two "
                      "levels about 2x apart within seconds on the GPU hosts (table below), "
                      "and steps of a small target follow it.", ""]
        table = _value_table(rows, accept, runs, names, context, kind)
        if table:
            lines += [f"Tokens per round (1 + accepted drafts per draft), {title}:", ""]
            lines += table + [""]
        table = _value_table(rows, per_step, runs, names, context, kind, 1)
        if table:
            lines += [f"Tokens per engine step and ms per engine step (medians over "
                      f"repeats), {title}. Every run serves the same requests, so tokens per "
                      f"step depends only on the drafts chosen and accepted (auto's choices "
                      f"against a fixed B), ms per step also on the host's speed:", ""]
            lines += table + [""] + _value_table(rows, step_ms, runs, names, context,
                                                 kind) + [""]
        table = _value_table(rows, median_step, runs, names, context, kind)
        if table:
            lines += [f"Where the ms per step go, {title}: the median engine step (ms; a "
                      f"step without a refill's prefill where most steps have none), then "
                      f"the window's time beyond steps x that median, per request added in "
                      f"the window (ms; a refill's prefill, and for `auto` also its probes "
                      f"of other arms). Every run prefills the same requests:", ""]
            lines += table + [""] + _value_table(rows, refill_excess, runs, names, context,
                                                 kind, 1) + [""]
        table = _pair_table(rows, "decode_verify_ms", "prefill_verify_ms", runs, names,
                            context, kind)
        if table:
            lines += [f"The steps that only decode / those that also prefill a refill, "
                      f"{title} (CUDA events around vLLM's runner, means in ms, "
                      f"evals/e2e_timing.py): `execute_model`'s GPU span (input preparation "
                      f"and the target's forward), the host's time inside it (close to the "
                      f"span: the GPU waited for the host), the drafter's propose (GPU "
                      f"span), the host's time in `sample_tokens` (propose included) and "
                      f"the garbage collector's pauses:", ""]
            lines += table + [""]
            for first, second in (("decode_host_verify_ms", "prefill_host_verify_ms"),
                                  ("decode_draft_ms", "prefill_draft_ms"),
                                  ("decode_host_sample_ms", "prefill_host_sample_ms"),
                                  ("decode_gc_ms", "prefill_gc_ms")):
                lines += _pair_table(rows, first, second, runs, names, context, kind) + [""]
            table = _pair_table(rows, "decode_eager_share", "prefill_eager_share", runs,
                                names, context, kind, 2)
            if table:
                lines += ["The share of those steps whose target forward ran without a "
                          "CUDA graph (vLLM dispatched no graph for its token count):", ""]
                lines += table + [""]
        table = _value_table(rows, active, runs, names, context, kind, 1)
        if table:
            lines += [f"`auto`: verified tree nodes per round, {title}:", ""] + table + [""]
        lines += gate_tables(rows, runs, names, context, kind)
        table = _value_table(rows, engine_reqs, runs, names, context, kind, 1)
        if table:
            lines += [f"Requests per step as the engine scheduled them (mean over the window; "
                      f"below the batch: refills waiting a step, preemptions), {title}:", ""]
            lines += table + [""]
        table = _value_table(rows, host, runs, names, context, kind)
        if table:
            lines += [f"Host speed: ms of a fixed Python loop in the run's engine process "
                      f"before and after the cell's window (lower is faster; the mean of "
                      f"the two), {title}. Host-bound steps slow down with it: read a ratio "
                      f"between two runs against their host speeds.", ""] + table + [""]
    checks = lossless_lines(rows)
    lines += ["## Lossless checks", ""]
    lines += checks or ["Every measured request matched (the oracle setups: the target's "
                        "own greedy chain, token for token; the others: AR's first 16 "
                        "tokens, by CRC)."]
    lines += [""]
    missing = [r for r in rows if r.get("status") != "ok"]
    if missing:
        lines += ["## Cells not measured", "", "| run | context | batch | status | why |",
                  "|---|---|---|---|---|"]
        for r in sorted(missing, key=lambda r: (r["run"], r["context"], r["batch"])):
            lines.append(f"| {r['run']} | {ctx_label(r['context'])} | {r['batch']} | "
                         f"{r.get('status')} | {str(r.get('note', '')).replace('|', '/')} |")
        lines += [""]
    with open(path, "w") as f:
        f.write("\n".join(lines))


def write_sweep_plot(data: dict, path: str) -> bool:
    """Tokens/s against the batch, one line per run, one panel per (context, kind)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = data["rows"]
    speed = median_by_cell(rows, "tokens_per_s")
    if not speed:
        return False
    runs, names, keys = runs_in_order(rows), labels(rows), panels(rows)
    fig, axes = plt.subplots(1, len(keys), figsize=(6 * len(keys), 4.5), squeeze=False)
    for ax, (context, kind) in zip(axes[0], keys, strict=True):
        for run in runs:
            pts = sorted((b, v) for (r, c, k, b), v in speed.items()
                         if (r, c, k) == (run, context, kind))
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                        label=names[run])
        ax.set_xscale("log", base=2)
        batches = sorted({r["batch"] for r in rows if (r["context"], r["kind"]) == (context,
                                                                                   kind)})
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.set_xlabel("batch (requests in flight)")
        ax.set_ylabel("tokens / s")
        ax.set_title(f"{ctx_label(context)} context, {kind} prompts")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(data.get("setup_title", data.get("setup", "")), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
