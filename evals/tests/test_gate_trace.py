"""``evals/gate_trace.py``: the step gate's decisions and measurements, step by step
(CPU: a gate driven as vLLM drives it, on a fake GPU clock)."""

import json

import gate_trace
import numpy as np
import torch
from test_budget_gate import Clock

from vllm_ddtree.budget.gate import SpeculationGate
from vllm_ddtree.budget.step_cost import StepCostModel
from vllm_ddtree.verify.shape import StepPlan

ARMS = [0, 1, 2, 4, 8, 16, 32, 64]


def _drive(steps: int, num_reqs: int) -> SpeculationGate:
    budgets = ARMS[1:]
    model = StepCostModel(2, [1024, 2048], [1e-7, 2e-7],
                          [[1e-7] * len(budgets), [2e-7] * len(budgets)], budgets)
    model.set_graph_costs({n: 3e-4 + 1e-7 * n for n in (1, 64, 4160)}, {1: 2e-4, 64: 3e-4})
    clock = Clock()
    gate = SpeculationGate(model, "cpu", ARMS, make_event=clock.event,
                           host_clock=lambda: 0.0)  # every step decides
    plan = StepPlan(64, ARMS, gate=gate)
    accepted, trees = torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    for step in range(steps):
        shape = plan.step_shape(num_reqs)
        if shape > 0:
            trees += num_reqs
            accepted += 2 * num_reqs
            gate.record_acceptance_(accepted, trees, num_reqs)
        plan.draft_next(num_reqs, np.full(num_reqs, 1024))
        clock.now += 1e-3 * (1.0 + 0.01 * shape) * (1.5 if step % 50 < 25 else 1.0)
    return gate


def test_trace_holds_every_decision_and_the_gates_measurements(tmp_path):
    gate_trace.install()
    try:
        gate = _drive(300, 3)
        records = gate_trace.take()
    finally:
        gate_trace.uninstall()
    assert not getattr(SpeculationGate.decide, "_traced", False)
    decisions = [r for r in records if r[0] == "d"]
    assert len(decisions) == 300
    assert all(r[2] == 3 and r[3] == 64 and r[4] in ARMS for r in decisions)
    assert [r[1] for r in records] == sorted(r[1] for r in records)
    residuals = [r for r in records if r[0] == "r"]
    committed = [r for r in records if r[0] == "c"]
    assert len(residuals) > 200 and {r[2] for r in residuals} == {"3-4"}
    assert {r[3] for r in residuals} <= set(ARMS) and len({r[3] for r in residuals}) > 1
    assert committed and all(r[4] == 3.0 for r in committed)  # 1 + 2 accepted a tree
    assert all(r[5] == 3 for r in committed)  # one step's three trees a sample
    # every step decides (no hold) and is timed; each interval met the prefill check
    # (none holds a prefill: typical) unless its step mixed kinds; residuals follow
    timed = [r for r in records if r[0] == "s"]
    checked = [r for r in records if r[0] == "p"]
    assert len(timed) == 300 and all(r[2:] == [3, r[3], 0] for r in timed)
    assert len(residuals) <= len(checked) <= len(timed) and len(checked) > 250
    assert all(r[2] == "3-4" and r[3:] == [0, 1] for r in checked)
    # the slow half of every 50 steps shows in the residuals
    assert max(r[4] for r in residuals) - min(r[4] for r in residuals) > 4e-4
    assert gate_trace.take() == []  # uninstalled: nothing recorded
    path = gate_trace.write(records, tmp_path, "ddtree-auto-64", 1024, 3, 0)
    assert path.name == "gate_trace_ddtree-auto-64_1024x3_r0.json"
    assert json.loads(path.read_text())["records"] == json.loads(json.dumps(records))
    assert gate.settled_arms()  # the wrapped gate still decides


def test_summary_and_plot_of_a_trace(tmp_path):
    gate_trace.install()
    try:
        _drive(200, 1)
        records = gate_trace.take()
    finally:
        gate_trace.uninstall()
    path = gate_trace.write(records, tmp_path, "ddtree-auto-64", 1024, 1, 0)
    text = gate_trace.summary(records)
    decided = {r[4] for r in records if r[0] == "d"}
    for arm in decided:
        assert f"| {arm} | " in text
    assert "200 steps" in text
    assert gate_trace.main([str(path), "--plot-dir", str(tmp_path / "plots")]) == 0
    assert (tmp_path / "plots" / f"{path.stem}.png").stat().st_size > 1000


def test_switch_table_separates_the_first_step_of_an_arm():
    """A step that costs more just after the arm changed shows in the first column:
    here every change to an arm costs 5 ms more than repeating it."""
    arms = [64] * 10 + [32] * 3 + [64] * 10 + [32] * 3 + [64] * 5
    t, records = 0.0, []
    for i, arm in enumerate(arms):
        records.append(["d", t, 1, 64, arm])
        t += 0.003 + (0.005 if i and arm != arms[i - 1] else 0.0)
    text = gate_trace.summary(records)
    assert "| 32 | 8.00 (8.00-8.00) (2) | 3.00 (3.00-3.00) (4) |" in text
    assert "| 64 | 8.00 (8.00-8.00) (2) | 3.00 (3.00-3.00) (21) |" in text


def test_refill_table_keeps_steps_around_a_refill_apart():
    """Continuous batching: the intervals where a request finished and the next one was
    prefilled (the batch below its full size before or after) go to their own column;
    another run's turn (0.25 s or more) counts nowhere."""
    records, t = [], 0.0
    for i in range(12):
        num_reqs = 31 if i in (4, 8) else 32
        records.append(["d", t, num_reqs, 64, 4])
        t += 0.040 if num_reqs == 31 else (1.0 if i == 10 else 0.006)
    text = gate_trace.summary(records)
    # full: 6 intervals of 6 ms; around each refill the step into it (6 ms) and the
    # refill's own (40 ms)
    assert "| 4 | 6.00 (6.00-6.00) (6) | 23.00 (6.00-40.00) (4) | 0.04 / 0.09 |" in text


def test_sample_table_shows_where_timing_samples_were_lost():
    """Per bucket: steps timed, intervals that reached the prefill check, those found
    atypical, residual samples taken."""
    records = [["s", 0.0, 3, 16, 0], ["s", 0.1, 4, 16, 1], ["s", 0.2, 3, 16, 1],
               ["p", 0.15, "3-4", 0, 1], ["p", 0.25, "3-4", 90000, 0],
               ["r", 0.15, "3-4", 16, 0.001], ["s", 0.3, 64, 4, 0]]
    text = gate_trace.summary(records)
    assert "| 3-4 | 3 | 2 | 1 | 1 |" in text
    assert "| 33-64 | 1 | 0 | 0 | 0 |" in text
