"""Host time of engine steps by Python function: decode steps apart from the steps that
prefill a refill (``count_host_syncs.py --cprofile``).

The child of ``count_host_syncs.py`` drives its engine through two windows of the same
refill schedule: the first unprofiled, timing each ``engine.step()`` (wall ms, the
figure to compare between runs), the second under one ``cProfile`` profile per kind of
step (where the host time goes; the profiler inflates every Python call, so read shares
and call counts, not absolute times). The report tables both per run and, for the steps
that prefill a refill, each run's per-function own time against the first run's
(``host_profile.diff_table``).
"""

from __future__ import annotations

import cProfile
import shutil
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

from host_profile import diff_table, per_step, summarize
from host_sync_trace import REFILL_STEP_NAME, STEP_NAME

KINDS = {STEP_NAME: "decode", REFILL_STEP_NAME: "refill"}
KIND_TITLES = {"decode": "decode steps", "refill": "steps that prefill a refill"}
# Runner entry points whose cumulative time per step the summary table shows.
ENTRY_POINTS = (("model_runner", "execute_model"), ("model_runner", "sample_tokens"))


class RangeClock:
    """Host time inside named functions, without a profiler: :meth:`wrap` gives a
    function a ``time.perf_counter`` pair (about a microsecond a call) that adds its
    inclusive seconds to ``totals[label]`` while ``enabled``."""

    def __init__(self) -> None:
        self.enabled = False
        self.totals: dict[str, float] = defaultdict(float)

    def wrap(self, original: Callable, label: str) -> Callable:
        def timed(*args, **kwargs):
            if not self.enabled:
                return original(*args, **kwargs)
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.totals[label] += time.perf_counter() - start

        return timed

    def take_ms(self) -> dict[str, float]:
        """The totals since the last call, in ms; resets them."""
        taken = {label: 1e3 * seconds for label, seconds in self.totals.items()}
        self.totals.clear()
        return taken


def profile_steps(engine, next_step: Callable[[int], str], steps: int, prof_dir: Path,
                  method: str, label: str, clock: RangeClock | None = None) -> list[dict]:
    """Run ``steps`` engine steps timed, then ``steps`` more under cProfile.

    Args:
        engine: vLLM's ``LLMEngine`` with its requests added.
        next_step: ``i -> kind`` (``STEP_NAME`` or ``REFILL_STEP_NAME``): adds step
            ``i``'s refill, if any (the second window continues the numbering, so its
            refills prefill new tails).
        prof_dir: where each kind's ``.prof`` file is written.
        clock: the annotated functions' host timers, read in the unprofiled window only.
    Returns:
        One dict per kind of step: ``method``, ``label``, ``kind``, ``wall_ms`` (the
        unprofiled steps), ``range_ms`` (label -> mean host ms a step inside it, in
        those steps; empty without ``clock``), ``profiled_wall_ms`` and ``prof``.
    """
    wall = {kind: [] for kind in KINDS.values()}
    ranges = {kind: defaultdict(float) for kind in KINDS.values()}
    if clock is not None:  # it adds nothing while disabled: its totals are empty here
        clock.enabled = True
    for i in range(steps):
        kind = KINDS[next_step(i)]
        start = time.perf_counter()
        engine.step()
        wall[kind].append(1e3 * (time.perf_counter() - start))
        if clock is not None:
            for name, ms in clock.take_ms().items():
                ranges[kind][name] += ms
    if clock is not None:
        clock.enabled = False
    profiles = {kind: cProfile.Profile() for kind in KINDS.values()}
    profiled = {kind: [] for kind in KINDS.values()}
    for i in range(steps, 2 * steps):
        kind = KINDS[next_step(i)]
        start = time.perf_counter()
        profiles[kind].enable()
        engine.step()
        profiles[kind].disable()
        profiled[kind].append(1e3 * (time.perf_counter() - start))
    results = []
    for kind, profile in profiles.items():
        if not profiled[kind]:
            continue
        path = prof_dir / f"{slug(method)}_{kind}.prof"
        profile.dump_stats(path)
        timed = max(len(wall[kind]), 1)
        results.append({"method": method, "label": label, "kind": kind,
                        "wall_ms": wall[kind],
                        "range_ms": {name: ms / timed for name, ms in ranges[kind].items()},
                        "profiled_wall_ms": profiled[kind], "prof": str(path)})
    return results


def slug(method: str) -> str:
    """A file-name form of a ``--methods`` entry (``ar@FLASH_ATTN_MLA``:
    ``ar_flash_attn_mla``)."""
    return method.replace("@", "_").replace("-", "_").lower()


def _median(values: list[float]) -> str:
    return f"{statistics.median(values):.2f}" if values else "-"


def _entry_ms(stats, steps: int) -> list[str]:
    """Cumulative ms per step of ``ENTRY_POINTS`` in a profile of ``steps`` steps."""
    per = per_step(stats, steps)
    out = []
    for path_part, name in ENTRY_POINTS:
        cum = [v[2] for (path, _line, fn), v in per.items()
               if fn == name and path_part in path]
        out.append(f"{max(cum):.2f}" if cum else "-")
    return out


def format_report(results: list[dict], command: str, out_dir: Path, limit: int = 25) -> str:
    """Markdown report of ``profile_steps`` results (several runs); copies each ``.prof``
    into ``out_dir`` as ``host_profile_<run>_<kind>.prof`` (``host_profile.py diff``)."""
    import pstats

    lines = ["# Host time of engine steps by Python function (cProfile)", "",
             f"Command: `{command}`", "",
             "Wall ms per step: medians of `engine.step()` in a window without the "
             "profiler; the profiled window repeats the refill schedule. Cumulative ms: "
             "the runner's `execute_model` and `sample_tokens` per step under cProfile "
             "(inflated by the profiler: compare runs, not with the wall column).", "",
             "| run | steps | wall ms / step (unprofiled) | wall ms / step (cProfile) "
             "| execute_model cum ms | sample_tokens cum ms |", "|---|---|---|---|---|---|"]
    stats = {}
    for r in results:
        if "prof" not in r:
            lines.append(f"| {r['label']} | 0 | - | - | - | - ({r.get('note', '')}) |")
            continue
        kept = out_dir / f"host_profile_{slug(r['method'])}_{r['kind']}.prof"
        out_dir.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(r["prof"], kept)
        # steps counted here: a step need not enter execute_model under the profiler
        st, steps = pstats.Stats(str(kept)), len(r["profiled_wall_ms"])
        stats[(r["label"], r["kind"])] = st, steps
        lines.append(f"| {r['label']}, {KIND_TITLES[r['kind']]} | {len(r['wall_ms'])} | "
                     f"{_median(r['wall_ms'])} | {_median(r['profiled_wall_ms'])} | "
                     + " | ".join(_entry_ms(st, steps)) + " |")
    lines += range_table(results)
    refills = [key for key in stats if key[1] == "refill"]
    for key in refills[1:]:
        lines += ["", f"## Steps that prefill a refill: {key[0]} against {refills[0][0]}", "",
                  diff_table(stats[key][0], stats[refills[0]][0], limit,
                             (key[0], refills[0][0]),
                             (stats[key][1], stats[refills[0]][1])).rstrip()]
    for (label, kind), (st, steps) in stats.items():
        lines += ["", summarize(st, f"{label}, {KIND_TITLES[kind]}", limit,
                                heading="##", steps=steps).rstrip()]
    return "\n".join(lines) + "\n"


def range_table(results: list[dict]) -> list[str]:
    """Markdown lines: per run and kind of step, the mean host ms a step spent inside
    each annotated range in the unprofiled window (inclusive: a range holds the ranges
    it calls); none where no result timed a range."""
    names = sorted({name for r in results for name in r.get("range_ms", {})})
    if not names:
        return []
    lines = ["", "Host ms per step inside each annotated range, unprofiled window (inclusive "
             "means over its steps of that kind; `time.perf_counter` around each call):", "",
             "| run | " + " | ".join(f"`{n}`" for n in names) + " |",
             "|---|" + "---|" * len(names)]
    for r in results:
        if "range_ms" not in r:
            continue
        cells = [f"{r['range_ms'][n]:.2f}" if n in r["range_ms"] else "-" for n in names]
        lines.append(f"| {r['label']}, {KIND_TITLES[r['kind']]} | " + " | ".join(cells) + " |")
    return lines
