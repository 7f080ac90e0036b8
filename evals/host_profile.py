"""Host (Python) time of a decode run by function: cProfile around one ``generate``.

``evals/bench_e2e.py`` calls :func:`profile_generate` after a cell's measured generate
when ``BENCH_E2E_HOST_PROFILE=<dir>`` is set, so the measured figures are not slowed by
the profiler. With the engine in-process (the default) the runner is called from the
calling thread, so cProfile sees the scheduler, the runner and the speculator alike;
with ``--engine-process`` ``e2e_engine`` profiles the engine core's thread with
:func:`summarize` instead. The
profiler inflates every Python call by a similar factor: read the shares and the call
counts per step, not the absolute milliseconds.
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import time
from pathlib import Path
from typing import Any

# Functions whose file contains one of these are listed in the "ours" table.
OWN_PATHS = ("vllm_ddtree", "patches", "attention_backends", "spec_decode")


def _label(key: tuple[str, int, str]) -> str:
    path, line, name = key
    short = "/".join(Path(path).parts[-3:]) if path != "~" else "builtin"
    return f"`{short}:{line} {name}`"


def _rows(stats: pstats.Stats, sort: str, limit: int,
          only: tuple[str, ...] | None, steps: int | None = None) -> list[str]:
    entries = [(key, values) for key, values in per_step(stats, steps).items()
               if only is None or any(part in key[0] for part in only)]
    column = 1 if sort == "tottime" else 2
    entries.sort(key=lambda e: e[1][column], reverse=True)
    lines = ["| function | calls / step | own ms / step | cum ms / step |", "|---|---|---|---|"]
    for key, (calls, own, cum) in entries[:limit]:
        lines.append(f"| {_label(key)} | {calls:.1f} | {own:.3f} | {cum:.3f} |")
    return lines


def engine_steps(stats: pstats.Stats) -> int:
    """Calls of the V2 runner's ``execute_model`` (one per engine step) in a profile."""
    return max((ncalls for (path, _line, name), (_cc, ncalls, *_rest) in stats.stats.items()
                if name == "execute_model" and "model_runner" in path), default=0)


def summarize(profile: cProfile.Profile | pstats.Stats, title: str, limit: int = 40,
              heading: str = "# Host profile", steps: int | None = None) -> str:
    """Markdown tables of a profile, per engine step: the top functions by own time
    and by cumulative time, and our own functions (``OWN_PATHS``) by cumulative time.
    ``steps``: the engine steps profiled, where the caller counted them (default:
    :func:`engine_steps`)."""
    stats = (profile if isinstance(profile, pstats.Stats)
             else pstats.Stats(profile, stream=io.StringIO()))
    steps = _steps(stats, steps)
    sub = "#" * (heading.count("#") + 1)
    out = [f"{heading}: {title}", "",
           f"{steps} engine steps under cProfile (times include the profiler's overhead).",
           "", f"{sub} By own time", ""]
    out += _rows(stats, "tottime", limit, None, steps)
    out += ["", f"{sub} By cumulative time", ""]
    out += _rows(stats, "cumtime", limit, None, steps)
    out += ["", f"{sub} Speculator, patches and backends by cumulative time", ""]
    out += _rows(stats, "cumtime", limit, OWN_PATHS, steps)
    return "\n".join(out) + "\n"


def _thread_times() -> dict[int, tuple[float, float]]:
    """``{thread id: (user s, system s)}`` of this process's threads (psutil), or {}."""
    try:
        import psutil
    except ImportError:
        return {}
    return {t.id: (t.user_time, t.system_time) for t in psutil.Process().threads()}


def thread_report(before: dict, after: dict, wall_s: float) -> str:
    """Markdown table of each thread's CPU time during the profiled generate, busiest
    first: a thread other than the main one that burns CPU slows the whole process
    (the GIL, or a shared core), which no per-function table shows."""
    rows = []
    for tid, (user, system) in after.items():
        u0, s0 = before.get(tid, (0.0, 0.0))
        rows.append((user - u0 + system - s0, user - u0, system - s0, tid))
    rows.sort(reverse=True)
    try:
        load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        load = "?"
    lines = ["## Threads: CPU time during the profiled generate", "",
             f"Wall {wall_s:.2f} s, load average {load}, "
             f"{len(os.sched_getaffinity(0))} CPUs in this process's affinity.", "",
             "| thread id | CPU s | share of wall | user s | system s |", "|---|---|---|---|---|"]
    for cpu, user, system, tid in rows[:12]:
        lines.append(f"| {tid} | {cpu:.3f} | {cpu / max(wall_s, 1e-9):.0%} | {user:.3f} | "
                     f"{system:.3f} |")
    return "\n".join(lines) + "\n"


def profile_generate(llm: Any, inputs: list, params: Any, out_path: Path, title: str) -> Path:
    """Run ``llm.generate(inputs, params)`` under cProfile and write :func:`summarize`
    and :func:`thread_report` to ``out_path`` (markdown)."""
    threads_before = _thread_times()
    start = time.perf_counter()
    profile = cProfile.Profile()
    profile.enable()
    try:
        llm.generate(inputs, params, use_tqdm=False)
    finally:
        profile.disable()
    wall = time.perf_counter() - start
    out_path.parent.mkdir(parents=True, exist_ok=True)
    report = summarize(profile, title)
    if threads_before:
        report += "\n" + thread_report(threads_before, _thread_times(), wall)
    out_path.write_text(report)
    profile.dump_stats(out_path.with_suffix(".prof"))
    return out_path


def _steps(stats: pstats.Stats, steps: int | None) -> int:
    """``steps`` where given, else :func:`engine_steps` (at least 1)."""
    return max(1, engine_steps(stats) if steps is None else steps)


def per_step(stats: pstats.Stats, steps: int | None = None
             ) -> dict[tuple[str, int, str], tuple[float, float, float]]:
    """``{(file, line, function): (calls, own ms, cumulative ms)}`` per engine step
    (``steps``: as in :func:`summarize`)."""
    steps = _steps(stats, steps)
    return {key: (ncalls / steps, 1e3 * tottime / steps, 1e3 * cumtime / steps)
            for key, (_cc, ncalls, tottime, cumtime, _callers) in stats.stats.items()}


def diff_table(first: pstats.Stats, second: pstats.Stats, limit: int = 40,
               names: tuple[str, str] = ("A", "B"),
               steps: tuple[int | None, int | None] = (None, None)) -> str:
    """Markdown: own ms per engine step of every function in ``first`` and ``second``
    (a function missing from one run counts 0 there), sorted by how much more the
    first spends (its surplus first, then its savings); calls per step beside them.
    The two totals of own time head the table. ``steps``: each profile's engine steps
    where the caller counted them (:func:`summarize`)."""
    a, b = per_step(first, steps[0]), per_step(second, steps[1])
    keys = set(a) | set(b)
    zero = (0.0, 0.0, 0.0)
    rows = sorted(keys, key=lambda k: a.get(k, zero)[1] - b.get(k, zero)[1], reverse=True)
    total_a = sum(v[1] for v in a.values())
    total_b = sum(v[1] for v in b.values())
    lines = [f"Own host ms per engine step: {names[0]} {total_a:.3f} "
             f"({_steps(first, steps[0])} steps), {names[1]} {total_b:.3f} "
             f"({_steps(second, steps[1])} steps), difference {total_a - total_b:+.3f} "
             "(profiler overhead included).", "",
             f"| function | {names[0]} calls / step | {names[1]} calls / step | "
             f"{names[0]} own ms | {names[1]} own ms | difference |", "|---|---|---|---|---|---|"]
    shown = rows[:limit // 2] + [k for k in rows[-(limit // 2):] if k not in rows[:limit // 2]]
    for key in shown:
        (ca, oa, _), (cb, ob, _) = a.get(key, zero), b.get(key, zero)
        lines.append(f"| {_label(key)} | {ca:.1f} | {cb:.1f} | {oa:.3f} | {ob:.3f} | "
                     f"{oa - ob:+.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """``diff A.prof B.prof``: where A's host time per engine step differs from B's."""
    import argparse

    p = argparse.ArgumentParser(description=main.__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("diff", help="per-function own time per step, A minus B")
    d.add_argument("first", type=Path)
    d.add_argument("second", type=Path)
    d.add_argument("--limit", type=int, default=40)
    args = p.parse_args(argv)
    for path in (args.first, args.second):
        if not path.is_file():
            p.error(f"{path}: no such profile (the .prof beside a host_profile_*.md)")
    print(diff_table(pstats.Stats(str(args.first)), pstats.Stats(str(args.second)),
                     args.limit, (args.first.stem, args.second.stem)), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
