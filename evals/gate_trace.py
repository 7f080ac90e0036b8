"""Step by step, what ``ddtree_budget: "auto"``'s step gate decided and measured, for
offline study of its choices (``BENCH_E2E_GATE_TRACE=<dir>`` in ``evals/bench_e2e.py``:
one ``gate_trace_<run>_<context>x<batch>_r<repeat>.json`` per auto cell, the run's name
followed by the prompt set outside ``--sweep``).

The product code keeps no trace; :func:`install` wraps, in the engine's process,
``SpeculationGate.decide`` (host time, batch, cap, the arm chosen) and
``GateStats.add_residual`` / ``add_committed`` (the bucket's measured step residual of an
arm, its committed tokens per tree), ``SpeculationGate.step_started`` where it times a
step and ``GateStats.typical_prefill`` (a timed interval's prefill check): from timed
step to residual sample, where each bucket's timing samples were lost. The host times
of successive decisions are the step intervals as the host saw them: with the arms
chosen, they show how the host's speed moved under each arm, which the gate's medians
summarize away.

Record layout (JSON lists): ``["d", t_s, num_reqs, cap, arm]`` (every step's ``decide``,
held or not),
``["r", t_s, bucket, arm, residual_s]``, ``["c", t_s, bucket, arm, tokens, trees]``
(``trees``: the trees the sample averages, its EMA weight; null where not given),
``["s", t_s, num_reqs, shape, prefill_reqs]`` (a step the gate timed),
``["p", t_s, bucket, prefill_pairs, typical]`` (its interval reached the prefill check,
``typical`` 1 or 0), ``["u", t_s, bucket, arm, slack_s]`` (a timed step's GPU idle time
before the next step's start, ``GateStats.add_slack``),
``["m", t_s, bucket, arms, model_ms, predicted_ms, rates]`` (each
rating of the arms, ``SpeculationGate.rates``: the start-up model's step time, the time
predicted with the bucket's residuals, and the predicted tokens per second a request,
one value per arm); ``t_s`` from
the first record of the trace, ``bucket`` the gate's batch-size bucket
(``vllm_ddtree.budget.gate.bucket_batches``), ``arm`` drafts per request (0: plain).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

_RECORDS: list[list] | None = None
_STATS_OWNER: dict[int, Any] = {}  # id(GateStats) -> its SpeculationGate
_ORIGINALS: dict[tuple[type, str], Any] = {}  # the methods install() replaced


def install() -> None:
    """Wrap the gate's methods in this process (once) and start an empty trace."""
    global _RECORDS
    from vllm_ddtree.budget import gate as gate_module

    _RECORDS = []
    gate_cls, stats_cls = gate_module.SpeculationGate, gate_module.GateStats
    if getattr(gate_cls.decide, "_traced", False):
        return
    decide, bucket = gate_cls.decide, gate_cls.bucket
    add_residual, add_committed = stats_cls.add_residual, stats_cls.add_committed
    step_started, typical_prefill = gate_cls.step_started, stats_cls.typical_prefill
    add_slack = stats_cls.add_slack
    rates = gate_cls.rates

    def traced_rates(self, stats, num_reqs, columns, num_arms):
        rated = rates(self, stats, num_reqs, columns, num_arms)
        if _RECORDS is not None:
            arms = self._arm_values[:num_arms]
            model = self.model.step_seconds_by_drafts(num_reqs, arms, columns)
            _RECORDS.append(["m", time.perf_counter(), id(stats), arms.tolist(),
                             [1e3 * float(x) for x in model],
                             [1e3 * float(x) for x in self._arm_seconds],
                             [float(x) for x in rated]])
        return rated

    def traced_step_started(self, num_reqs, shape, prefill_reqs=0, prefill_tokens=0,
                            prefill_pairs=0, cap=None):
        last = self.marks[-1] if self.marks else None
        step_started(self, num_reqs, shape, prefill_reqs, prefill_tokens, prefill_pairs,
                     cap)
        mark = self.marks[-1] if self.marks else None
        if _RECORDS is not None and mark is not None and mark is not last and mark.timed:
            _RECORDS.append(["s", time.perf_counter(), int(num_reqs), int(shape),
                             int(prefill_reqs)])

    def traced_typical(self, pairs):
        typical = typical_prefill(self, pairs)
        if _RECORDS is not None:
            _RECORDS.append(["p", time.perf_counter(), id(self), int(pairs), int(typical)])
        return typical

    def traced_decide(self, num_reqs, contexts, cap):
        arm = decide(self, num_reqs, contexts, cap)
        if _RECORDS is not None:
            _RECORDS.append(["d", time.perf_counter(), int(num_reqs), int(cap), int(arm)])
        return arm

    def traced_bucket(self, num_reqs, cap=None):
        stats = bucket(self, num_reqs, cap)
        _STATS_OWNER[id(stats)] = self
        return stats

    def traced_residual(self, arm, seconds):
        add_residual(self, arm, seconds)
        if _RECORDS is not None:
            _RECORDS.append(["r", time.perf_counter(), id(self), int(arm), float(seconds)])

    def traced_slack(self, arm, seconds):
        add_slack(self, arm, seconds)
        if _RECORDS is not None:
            _RECORDS.append(["u", time.perf_counter(), id(self), int(arm), float(seconds)])

    def traced_committed(self, arm, tokens, trees=None):
        add_committed(self, arm, tokens, trees)
        if _RECORDS is not None:
            _RECORDS.append(["c", time.perf_counter(), id(self), int(arm), float(tokens),
                             None if trees is None else int(trees)])

    originals = {(gate_cls, "decide"): decide, (gate_cls, "bucket"): bucket,
                 (gate_cls, "rates"): rates,
                 (gate_cls, "step_started"): step_started,
                 (stats_cls, "add_residual"): add_residual,
                 (stats_cls, "add_committed"): add_committed,
                 (stats_cls, "add_slack"): add_slack,
                 (stats_cls, "typical_prefill"): typical_prefill}
    for fn in (traced_decide, traced_bucket, traced_residual, traced_committed,
               traced_step_started, traced_typical, traced_rates, traced_slack):
        fn._traced = True
    _ORIGINALS.update(originals)
    gate_cls.decide, gate_cls.bucket = traced_decide, traced_bucket
    gate_cls.rates = traced_rates
    gate_cls.step_started = traced_step_started
    stats_cls.add_residual, stats_cls.add_committed = traced_residual, traced_committed
    stats_cls.typical_prefill = traced_typical
    stats_cls.add_slack = traced_slack


def uninstall() -> None:
    """Restore the gate's methods and drop the trace."""
    global _RECORDS
    for (cls, name), fn in _ORIGINALS.items():
        setattr(cls, name, fn)
    _ORIGINALS.clear()
    _STATS_OWNER.clear()
    _RECORDS = None


def take() -> list[list]:
    """The records since :func:`install` or the last take (then cleared), with buckets
    and arms resolved (see the module docstring); [] without a trace."""
    global _RECORDS
    from vllm_ddtree.budget.gate import bucket_batches

    if not _RECORDS:
        return []
    records, _RECORDS = _RECORDS, []
    t0 = records[0][1]
    # id(GateStats) -> (its bucket's batches, its gate's arms), once per take
    where = {id(stats): (bucket_batches(b), gate.arms)
             for gate in {id(g): g for g in _STATS_OWNER.values()}.values()
             for b, stats in gate.stats.items()}
    out = []
    for kind, t, *rest in records:
        if kind in ("d", "s"):
            out.append([kind, round(t - t0, 6), *rest])
            continue
        if kind == "m":
            stats_id, *values = rest
            if stats_id in where:
                out.append([kind, round(t - t0, 6), where[stats_id][0],
                             *[[round(x, 4) for x in v] for v in values]])
            continue
        stats_id, arm, value, *extra = rest  # "c": + trees
        if stats_id not in where:
            continue
        batches, arms = where[stats_id]
        if kind == "p":  # (pairs, typical), no arm
            out.append([kind, round(t - t0, 6), batches, arm, value])
        else:
            out.append([kind, round(t - t0, 6), batches, arms[arm], round(value, 7), *extra])
    return out


def write(records: list[list], directory: str | Path, run: str, context: int, batch: int,
          repeat: int) -> Path:
    """``gate_trace_<run>_<context>x<batch>_r<repeat>.json`` in ``directory``."""
    name = f"gate_trace_{run}_{context}x{batch}_r{repeat}.json".replace("@", "_").replace(
        "+", "_")
    path = Path(directory) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"run": run, "context": context, "batch": batch,
                                "repeat": repeat, "records": records}))
    return path


def summary(records: list[list]) -> str:
    """Markdown: per bucket and arm, the steps (``decide`` calls, held ones included),
    the host-side interval after each
    decision (median and 10-90 % range, ms) and the residuals the gate measured (median
    and range, ms), and how often the decided arm changed. Where an arm's residuals span
    far more than its neighbours' at the same time, the host's speed moved."""
    import numpy as np

    lines = ["| arm | steps | interval after it, ms (median, 10-90 %) | "
             "residuals, ms (median, 10-90 %) |", "|---|---|---|---|"]
    decisions = [r for r in records if r[0] == "d"]
    intervals: dict[int, list[float]] = {}
    for first, second in zip(decisions, decisions[1:], strict=False):
        intervals.setdefault(first[4], []).append(1e3 * (second[1] - first[1]))
    residuals: dict[int, list[float]] = {}
    for r in records:
        if r[0] == "r":
            residuals.setdefault(r[3], []).append(1e3 * r[4])

    def spread(values: list[float]) -> str:
        if not values:
            return "—"
        q10, q50, q90 = np.percentile(values, [10, 50, 90])
        return f"{q50:.2f} ({q10:.2f}-{q90:.2f})"

    chosen = Counter(d[4] for d in decisions)
    for arm in sorted(set(intervals) | set(residuals)):
        lines.append(f"| {arm} | {chosen[arm]} | "
                     f"{spread(intervals.get(arm, []))} | {spread(residuals.get(arm, []))} |")
    changes = sum(1 for a, b in zip(decisions, decisions[1:], strict=False) if a[4] != b[4])
    return ("\n".join(lines) + f"\n\n{len(decisions)} steps, the arm changed {changes} "
            "times.\n\n" + switch_table(decisions, spread) + "\n"
            + refill_table(decisions, spread) + "\n" + sample_table(records)
            + "\n" + rating_table(records))


def refill_table(decisions: list[list], spread, turn_s: float = 0.25) -> str:
    """Markdown: per arm, the interval after a decision where the batch stayed full (the
    most requests any decision saw, before and after) and where it did not (a request
    finished and the next one's prompt was prefilled around it: continuous batching's
    refills), with counts and the time each kind took in all. A refill scheduled in the
    step its predecessor finished keeps the batch full and counts as full here (the
    sweep's CUDA-event split, ``e2e_timing.split_by_prefill``, labels every step).
    Intervals of ``turn_s`` or more (the other runs' turns of ``--interleave-s``) are
    left out."""
    if not decisions:
        return ""
    full = max(d[2] for d in decisions)
    split: dict[int, tuple[list[float], list[float]]] = {}
    for a, b in zip(decisions, decisions[1:], strict=False):
        ms = 1e3 * (b[1] - a[1])
        if ms >= 1e3 * turn_s:
            continue
        steady, refill = split.setdefault(a[4], ([], []))
        (steady if a[2] == b[2] == full else refill).append(ms)
    lines = [f"| arm | full batch ({full}): interval, ms (median, 10-90 %) (n) | around a "
             "refill | time, s: full / refill |", "|---|---|---|---|"]
    for arm, (steady, refill) in sorted(split.items()):
        lines.append(f"| {arm} | {spread(steady)} ({len(steady)}) | {spread(refill)} "
                     f"({len(refill)}) | {sum(steady) / 1e3:.2f} / {sum(refill) / 1e3:.2f} |")
    return "\n".join(lines) + "\n"


def rating_table(records: list[list]) -> str:
    """Markdown: per bucket, the gate's last rating of its arms: the start-up model's
    step time, the time predicted with the measured residuals, the committed tokens
    per tree the rate implies, and the predicted rate. Where the model's step times
    part far more than the measured intervals do (a host-bound step hides the GPU's),
    an arm's residual offset must carry the difference."""
    last = {r[2]: r for r in records if r[0] == "m"}
    lines = ["| batches | arm | model ms | predicted ms | committed | tokens/s a request |",
             "|---|---|---|---|---|---|"]
    for batches in sorted(last, key=_bucket_order):
        _, _, _, arms, model, predicted, rated = last[batches]
        for arm, m, p, r in zip(arms, model, predicted, rated, strict=True):
            lines.append(f"| {batches} | {arm} | {m:.2f} | {p:.2f} | {r * p / 1e3:.2f} | "
                         f"{r:.0f} |")
    return "\n".join(lines) + "\n"


def sample_table(records: list[list]) -> str:
    """Markdown: per bucket, the steps the gate timed, the intervals that reached the
    prefill check (those with no decode, no propose or past ``MAX_STEP_SECONDS`` stop
    before it), how many of them it found atypical, and the residual samples taken
    (the rest: a step whose arm, draft and shape disagreed, e.g. the last step before
    plain decoding), and the GPU's idle time after the settled arm's steps (the host's
    step outlasting the GPU's: up to it the model's difference between arms is hidden).
    Where residuals are few against timed steps, the gate decided blind."""
    import numpy as np

    from vllm_ddtree.budget.gate import batch_bucket, bucket_batches

    timed = Counter(bucket_batches(batch_bucket(r[2])) for r in records if r[0] == "s")
    checked = Counter(r[2] for r in records if r[0] == "p")
    atypical = Counter(r[2] for r in records if r[0] == "p" and not r[4])
    sampled = Counter(r[2] for r in records if r[0] == "r")
    slack: dict[str, list[float]] = {}
    for r in records:
        if r[0] == "u":
            slack.setdefault(r[2], []).append(1e3 * r[4])
    lines = ["| batches | steps timed | reached the prefill check | atypical prefill | "
             "residual samples | GPU idle after a step, ms (median, 10-90 %) |",
             "|---|---|---|---|---|---|"]
    for b in sorted(set(timed) | set(checked) | set(sampled), key=_bucket_order):
        idle = "—"
        if slack.get(b):
            q10, q50, q90 = np.percentile(slack[b], [10, 50, 90])
            idle = f"{q50:.2f} ({q10:.2f}-{q90:.2f}, {len(slack[b])})"
        lines.append(f"| {b} | {timed[b]} | {checked[b]} | {atypical[b]} | {sampled[b]} | "
                     f"{idle} |")
    return "\n".join(lines) + "\n"


def _bucket_order(batches: str) -> int:
    return int(batches.split("-")[0])


def switch_table(decisions: list[list], spread) -> str:
    """Markdown: per arm, the host interval after a decision that changed the arm (the
    first step of the new arm) against one that repeated it. A step that costs more
    just after a change (a new verify shape's first use) inflates a probe's few
    samples far more than the settled arm's many: the gate then favours the arm it is
    on."""
    first: dict[int, list[float]] = {}
    repeat: dict[int, list[float]] = {}
    for prev, cur, nxt in zip(decisions, decisions[1:], decisions[2:], strict=False):
        target = first if cur[4] != prev[4] else repeat
        target.setdefault(cur[4], []).append(1e3 * (nxt[1] - cur[1]))
    lines = ["| arm | interval after a change to it, ms (n) | after repeating it, ms (n) |",
             "|---|---|---|"]
    for arm in sorted(set(first) | set(repeat)):
        a, b = first.get(arm, []), repeat.get(arm, [])
        lines.append(f"| {arm} | {spread(a)} ({len(a)}) | {spread(b)} ({len(b)}) |")
    return "\n".join(lines) + "\n"


def plot(records: list[list], path: str | Path, title: str) -> None:
    """PNG: each residual the gate measured against time, one colour per arm, and the
    arm decided at each step (below)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6), sharex=True,
                                      gridspec_kw={"height_ratios": [3, 1]})
    arms = sorted({r[3] for r in records if r[0] == "r"})
    for arm in arms:
        points = [(r[1], 1e3 * r[4]) for r in records if r[0] == "r" and r[3] == arm]
        top.plot(*zip(*points, strict=True), ".", markersize=3, label=f"arm {arm}")
    top.set_ylabel("residual, ms")
    top.legend(fontsize=7, ncol=4)
    top.set_title(title)
    decided = [(r[1], r[4]) for r in records if r[0] == "d"]
    if decided:
        bottom.step(*zip(*decided, strict=True), where="post")
    bottom.set_ylabel("arm")
    bottom.set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """``python evals/gate_trace.py TRACE.json ... [--plot-dir DIR]``: :func:`summary` of
    each trace (and :func:`plot` into DIR)."""
    import argparse

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("traces", nargs="+", type=Path)
    p.add_argument("--plot-dir", type=Path, default=None)
    args = p.parse_args(argv)
    for path in args.traces:
        data = json.loads(path.read_text())
        title = f"{data['run']}, context {data['context']}, batch {data['batch']}"
        print(f"## {title}\n\n{summary(data['records'])}")
        if args.plot_dir is not None:
            args.plot_dir.mkdir(parents=True, exist_ok=True)
            plot(data["records"], args.plot_dir / f"{path.stem}.png", title)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
