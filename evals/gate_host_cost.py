"""Host microseconds per step of ``ddtree_budget: "auto"``'s step gate, by batch size.

At batch 1 the embedded pair's steps wait on the host, so every microsecond the gate
spends in ``propose`` is a microsecond of the step. This drives the gate through the
CPU test suite's simulated engine (``tests/test_budget_gate.Engine``: a fake GPU clock,
steps of the durations that suite uses), lets it settle, then times the calls auto
makes each step: ``StepPlan.step_shape`` (``execute_model``; with a
``VerifyShapeChooser`` holding B, so the arms cap the shape as without one),
``SpeculationGate.record_acceptance_``, ``BudgetPolicy.observe_round``,
``StepPlan.draft_next`` and the chooser's ``record_`` of the device's choice after a
drafted round (``propose``; the last two skipped where the gate holds its decision,
in versions whose ``StepPlan`` has ``holding``, as ``DDTreeSpeculator.propose`` does),
and ``StepPlan.step_finished`` at the end of ``propose`` (in versions that have it).
The engine's own simulation is not timed. The gate times its decisions on the real host
clock, as in vLLM, so a decision holds for as many of the simulated steps (about 1 ms
at batch 1, 4 ms at 64) as in a run with steps that long. CPU host time only (no
CUDA events, no pinned copies): compare versions on one machine, not across machines.

``--baseline REV`` times the package as committed at ``REV`` beside the working tree's,
alternating child processes run by run (the host's speed drifts over minutes), and adds
their ratio: an A/B of a change to the gate in one run.

    python evals/gate_host_cost.py [--batches 1 16 64] [--steps 3000] [--repeats 3]
    python evals/gate_host_cost.py --baseline main~1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

CALLS = ("step_shape", "record_acceptance_", "observe_round", "draft_next", "shape_record_",
         "step_finished")


def host_microseconds(num_reqs: int, steps: int, warmup: int = 500) -> dict[str, float]:
    """Mean host microseconds per step of each of :data:`CALLS` over ``steps`` steps
    at batch ``num_reqs``, after ``warmup`` steps in which the gate settles."""
    from test_budget_gate import Engine

    engine = Engine(seed=0, host_clock=None)  # the gate's own clock: its decisions hold
    if not hasattr(engine.plan, "step_finished"):  # versions before the GPU-end mark
        engine.plan.step_finished = lambda: None
    policy, chooser, chosen = _auto_parts(engine.plan.max_budget)
    engine.plan.chooser = chooser
    spent = dict.fromkeys(CALLS, 0.0)

    def timed(name, call):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            result = call(*args, **kwargs)
            spent[name] += time.perf_counter() - start
            return result
        return wrapper

    observe = timed("observe_round", lambda plan: _observe(policy, plan))
    record = timed("shape_record_", chooser.record_)
    draft_next = timed("draft_next", engine.plan.draft_next)

    def propose(num_reqs, contexts=None):  # DDTreeSpeculator.propose's order
        held = observe(engine.plan)
        drafted = draft_next(num_reqs, contexts)
        if drafted and not held:
            record(chosen)
        return drafted

    engine.plan.draft_next = propose
    engine.run(num_reqs, warmup)
    spent = dict.fromkeys(CALLS, 0.0)
    engine.plan.step_shape = timed("step_shape", engine.plan.step_shape)
    engine.gate.record_acceptance_ = timed("record_acceptance_",
                                           engine.gate.record_acceptance_)
    engine.plan.step_finished = timed("step_finished", engine.plan.step_finished)
    engine.run(num_reqs, steps)
    return {name: 1e6 * seconds / steps for name, seconds in spent.items()}


def _auto_parts(max_budget: int):
    """``(BudgetPolicy, VerifyShapeChooser, the device's choice)`` on the CPU: a policy
    over a linear attention table, a chooser of B, and the choice: int64 ``[1]`` B."""
    import torch

    from vllm_ddtree.budget.attention_timing import measure_attention_table
    from vllm_ddtree.budget.policy import BudgetPolicy, candidate_budgets
    from vllm_ddtree.verify.shape import VerifyShapeChooser

    table = measure_attention_table(lambda c, q: 1e-9 * c * q, [1024, 4096],
                                    candidate_budgets(max_budget))
    chosen = torch.full((1,), max_budget, dtype=torch.int64)
    return BudgetPolicy(table, num_layers=2), VerifyShapeChooser(max_budget, "cpu"), chosen


def _observe(policy, plan) -> bool:
    """``observe_round`` as the speculator calls it; whether the gate holds (versions
    before ``StepPlan.holding``: never, every round sampled)."""
    held = getattr(plan, "holding", False)
    verified = plan.last_shape > 0
    if held:
        policy.observe_round(time.perf_counter(), verified=verified, sample=False)
    else:
        policy.observe_round(time.perf_counter(), verified=verified)
    return held


def _measure(batches: list[int], steps: int, package_root: Path | None) -> dict:
    """``{batch: {call: us}}`` from a child process importing ``vllm_ddtree`` from
    ``package_root`` (the working tree: None)."""
    env = dict(os.environ)
    if package_root is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(package_root), env.get("PYTHONPATH", "")])
    out = subprocess.run(
        [sys.executable, __file__, "--child", "--steps", str(steps), "--batches",
         *map(str, batches)], env=env, check=True, capture_output=True, text=True).stdout
    return {int(b): calls for b, calls in json.loads(out.splitlines()[-1]).items()}


def _checkout(rev: str, into: Path) -> Path:
    """``vllm_ddtree`` as committed at ``rev``, unpacked under ``into``."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "vllm_ddtree"],
                             check=True, capture_output=True).stdout
    with tempfile.TemporaryFile() as f:
        f.write(archive)
        f.seek(0)
        with tarfile.open(fileobj=f) as tar:
            tar.extractall(into, filter="data")
    return into


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs per version; the table shows their median")
    parser.add_argument("--baseline", metavar="REV",
                        help="also time vllm_ddtree as committed at this git revision")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps({b: host_microseconds(b, args.steps) for b in args.batches}))
        return
    with tempfile.TemporaryDirectory() as tmp:
        versions = {"working tree": None}
        if args.baseline:
            versions = {args.baseline: _checkout(args.baseline, Path(tmp)), **versions}
        runs: dict[str, list[dict]] = {name: [] for name in versions}
        for _ in range(args.repeats):
            for name, root in versions.items():
                runs[name].append(_measure(args.batches, args.steps, root))
    print(f"command: python evals/gate_host_cost.py {' '.join(argv or sys.argv[1:])}")
    print("host microseconds per step, median of the runs\n")
    head = ["batch", "version", *(f"`{c}`" for c in CALLS), "total"]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for b in args.batches:
        totals = {}
        for name in versions:
            medians = [statistics.median(run[b][c] for run in runs[name]) for c in CALLS]
            totals[name] = sum(medians)
            print(f"| {b} | {name} | " + " | ".join(f"{m:.1f}" for m in medians)
                  + f" | {totals[name]:.1f} |")
        if args.baseline:
            ratio = totals["working tree"] / totals[args.baseline]
            print("| " + " | ".join([str(b), "ratio", *[""] * len(CALLS), f"{ratio:.2f}"])
                  + " |")


if __name__ == "__main__":
    main()
