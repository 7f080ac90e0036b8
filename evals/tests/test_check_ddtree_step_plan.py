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


def test_step_plan_recorder_takes_the_patch_arguments(monkeypatch):
    """The patch (``patches/verify_shapes.py``) passes ``warm_up`` positionally; the
    recorder must take every argument ``StepPlan.step_shape`` takes, and keeps vLLM's
    warm-up steps (B whatever a schedule says) out of the served steps the GPU tests
    hold to the schedule."""
    import inspect

    from vllm_ddtree.verify.shape import warm_up_batch

    monkeypatch.setattr(StepPlan, "step_shape", StepPlan.step_shape)
    monkeypatch.setattr(StepPlan, "draft_next", StepPlan.draft_next)
    wanted = list(inspect.signature(StepPlan.step_shape).parameters)
    seen = check_ddtree_vllm.record_step_plan()
    assert list(inspect.signature(StepPlan.step_shape).parameters) == wanted
    plan = StepPlan(8, [0, 2, 4, 8])
    warm = {f"_warmup_{i}": 1 for i in range(3)}
    assert plan.step_shape(3, (0, 0, 0), warm_up_batch(warm)) == 8
    assert plan.step_shape(3, (0, 0, 0), False) == 8
    assert seen["warm_up_steps"] == [{"num_reqs": 3, "shape": 8}]
    assert [(s["num_reqs"], s["cap"], s["shape"]) for s in seen["steps"]] == [(3, 8, 8)]
