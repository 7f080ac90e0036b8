"""Host microseconds per step of ``ddtree_budget: "auto"``'s step gate, by batch size.

At batch 1 the embedded pair's steps wait on the host, so every microsecond the gate
spends in ``propose`` is a microsecond of the step. This drives the gate through the
CPU test suite's simulated engine (``tests/test_budget_gate.Engine``: a fake GPU clock,
steps of the durations that suite uses), lets it settle, then times the three calls it
makes each step: ``StepPlan.step_shape`` (``execute_model``),
``SpeculationGate.record_acceptance_`` and ``StepPlan.draft_next`` (``propose``). The
engine's own simulation is not timed. CPU host time only (no CUDA events, no pinned
copies): compare versions on one machine, not across machines.

    python evals/gate_host_cost.py [--batches 1 16 64] [--steps 3000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from test_budget_gate import Engine  # noqa: E402

CALLS = ("step_shape", "record_acceptance_", "draft_next")


def host_microseconds(num_reqs: int, steps: int, warmup: int = 500) -> dict[str, float]:
    """Mean host microseconds per step of each of :data:`CALLS` over ``steps`` steps
    at batch ``num_reqs``, after ``warmup`` steps in which the gate settles."""
    engine = Engine(seed=0)
    engine.run(num_reqs, warmup)
    spent = dict.fromkeys(CALLS, 0.0)

    def timed(name, call):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            result = call(*args, **kwargs)
            spent[name] += time.perf_counter() - start
            return result
        return wrapper

    engine.plan.step_shape = timed("step_shape", engine.plan.step_shape)
    engine.plan.draft_next = timed("draft_next", engine.plan.draft_next)
    engine.gate.record_acceptance_ = timed("record_acceptance_",
                                           engine.gate.record_acceptance_)
    engine.run(num_reqs, steps)
    return {name: 1e6 * seconds / steps for name, seconds in spent.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs per batch size; the table shows their median")
    args = parser.parse_args(argv)
    print("| batch | " + " | ".join(f"`{c}` us" for c in CALLS) + " | total us |")
    print("|---|" + "---|" * (len(CALLS) + 1))
    for num_reqs in args.batches:
        runs = [host_microseconds(num_reqs, args.steps) for _ in range(args.repeats)]
        medians = [statistics.median(run[c] for run in runs) for c in CALLS]
        print(f"| {num_reqs} | " + " | ".join(f"{m:.1f}" for m in medians)
              + f" | {sum(medians):.1f} |")


if __name__ == "__main__":
    main()
