"""``evals/check_ddtree_vllm.py``'s step-plan recorder, which the GPU tests read: each
verify step's shape with whether it held a prefill (``uniform``) and its load."""

import check_ddtree_vllm

from vllm_ddtree.verify.shape import StepPlan


def test_step_plan_recorder_keeps_the_prefill_load(monkeypatch):
    monkeypatch.setattr(StepPlan, "step_shape", StepPlan.step_shape)
    monkeypatch.setattr(StepPlan, "draft_next", StepPlan.draft_next)
    seen = check_ddtree_vllm.record_step_plan()
    plan = StepPlan(8, [0, 2, 4, 8])
    assert plan.step_shape(3) == 8
    assert plan.step_shape(4, (1, 100, 5050)) == 8
    assert plan.step_shape(4, (0, 0, 0)) == 8  # what prefill_load gives a decode step
    plan.draft_next(4)
    assert [(s["shape"], s["uniform"], s["prefill"]) for s in seen["steps"]] == [
        (8, True, [0, 0, 0]), (8, False, [1, 100, 5050]), (8, True, [0, 0, 0])]
    assert seen["drafts"] == [{"num_reqs": 4, "draft": True}]
