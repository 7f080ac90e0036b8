"""Step latency against each run's interpreter speed, from ``bench_e2e`` outputs.

Host-bound decode steps of two processes compare only when both processes run Python
at the same speed. This reads bench_e2e result directories (``e2e_<setup>.json`` and
the ``profiles/host_profile_*.md`` written with ``BENCH_E2E_HOST_PROFILE``), takes one
pure-Python builtin's own time per call from each profile as that process's speed
(``builtins.isinstance``, in every run's top own-time list; ``prometheus_client``'s
counter ``inc``, 83 calls per engine step in every DDTree run, as a cross-check where
listed), and writes a markdown table and a scatter plot of step ms against it.

    python evals/host_speed_report.py DIR [DIR ...] --out evals/results/host_speed_variance
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

# The speed proxy (in every run's top own-time list) and a cross-check where listed.
PROXIES = ("builtins.isinstance", "prometheus_client/values.py:27 inc")
_ROW = re.compile(r"\| `(.*)` \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|")


def proxy_us_per_call(profile_md: str) -> dict[str, float]:
    """``{proxy: own microseconds per call}`` from a host profile's own-time table."""
    section, found = None, {}
    for line in profile_md.splitlines():
        if line.startswith("## "):
            section = line.strip()
        m = _ROW.match(line)
        if m and section == "## By own time":
            for proxy in PROXIES:
                if proxy in m.group(1) and float(m.group(2)) > 0:
                    found[proxy] = 1000 * float(m.group(3)) / float(m.group(2))
    return found


def collect(dirs: list[Path]) -> list[dict]:
    """One entry per profiled run: call directory, run order, run, step ms, proxy."""
    entries = []
    for d in dirs:
        results = sorted(d.glob("e2e_*.json"))
        if not results:
            continue
        data = json.loads(results[0].read_text())
        order = data["invocations"][-1]["runs"] if data.get("invocations") else []
        for profile in sorted((d / "profiles").glob("host_profile_*.md")):
            text = profile.read_text()
            title = text.splitlines()[0].removeprefix("# Host profile: ")
            run = title.split(",")[0]
            remote = title.endswith("(engine-core process)")  # bench_e2e --engine-process
            speeds = proxy_us_per_call(text)
            cell = re.search(r"context (\d+), batch (\d+)", title)  # the profiled cell
            rows = [r for r in data["rows"] if r.get("run") == run and r.get("status") == "ok"
                    and bool(r.get("engine_process")) == remote
                    and (cell is None or (r.get("context"), r.get("batch"))
                         == (int(cell[1]), int(cell[2])))]
            if PROXIES[0] not in speeds or not rows:
                continue
            entries.append({"call": d.name, "order": order.index(run) + 1 if run in order
                            else None, "run": run + (" (engine process)" if remote else ""),
                            "context": rows[-1].get("context"),
                            "step_ms": rows[-1]["step_ms"],
                            "us_per_call": speeds[PROXIES[0]],
                            "check_us_per_call": speeds.get(PROXIES[1])})
    return entries


def write(entries: list[dict], out: Path, command: str) -> None:
    lines = ["# Step latency against the run's interpreter speed", "",
             f"Command: `{command}`", "",
             "Each row is one bench_e2e run (its own process). *isinstance µs*: the own "
             "time per call of `builtins.isinstance` in the run's cProfile summary "
             "(cProfile's overhead included, alike in every run), the process's interpreter "
             "speed; *inc µs*: the same for `prometheus_client`'s counter `inc` (83 calls "
             "per step in every DDTree run), a cross-check. *step / speed*: step ms over "
             "the isinstance figure, a step normalised to one interpreter speed (a fully "
             "host-bound step scales with it; GPU time does not).", "",
             "| call | order | run | context | step ms | isinstance µs | inc µs | step / speed |",
             "|---|---|---|---|---|---|---|---|"]
    for e in entries:
        check = e["check_us_per_call"]
        lines.append(f"| {e['call']} | {e['order'] or '—'} | {e['run']} | "
                     f"{e.get('context') or '—'} | {e['step_ms']:.2f} | "
                     f"{e['us_per_call']:.3f} | {f'{check:.3f}' if check else '—'} | "
                     f"{e['step_ms'] / e['us_per_call']:.1f} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run in sorted({e["run"] for e in entries}):
        pts = [e for e in entries if e["run"] == run]
        ax.scatter([e["us_per_call"] for e in pts], [e["step_ms"] for e in pts], label=run)
        for e in pts:
            ax.annotate(e["call"], (e["us_per_call"], e["step_ms"]), fontsize=7,
                        xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("isinstance µs per call under cProfile (lower = faster interpreter)")
    ax.set_ylabel("decode step (ms)")
    ax.set_title("Host-bound steps follow the process's interpreter speed")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    import shlex
    import sys

    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dirs", nargs="+", type=Path, help="bench_e2e output directories")
    p.add_argument("--out", type=Path, default=Path("evals/results/host_speed_variance"))
    args = p.parse_args(argv)
    entries = collect(args.dirs)
    if not entries:
        p.error("no profiled runs found (BENCH_E2E_HOST_PROFILE outputs)")
    argv_text = sys.argv[1:] if argv is None else argv
    write(entries, args.out, "python evals/host_speed_report.py " + shlex.join(
        [str(a) for a in argv_text]))
    print(f"wrote {args.out.with_suffix('.md')} and .png ({len(entries)} runs)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
