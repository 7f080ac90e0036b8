"""The shared optimizer loop clips the gradients of every parameter at every step, also
when it is handed ``model.parameters()`` (a generator, spent after one pass); a run of
fixed steps takes them all, a time-budgeted run stops by the clock."""

from types import SimpleNamespace

import torch

from vllm_ddtree.training import common


def test_every_step_clips_every_parameter(monkeypatch):
    model = torch.nn.Linear(4, 3)
    clipped: list[int] = []

    def clip(params, max_norm):
        clipped.append(len(list(params)))

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip)
    steps = 3
    plan = SimpleNamespace(start=lambda: None, finished=lambda step: step >= steps,
                           horizon=lambda: steps, after_step=lambda step: None, total=steps,
                           elapsed=lambda: 0.0, stopped_by_clock=False)
    cfg = SimpleNamespace(lr=1e-3, warmup_steps=0, min_lr_ratio=0.1, grad_clip=1.0,
                          log_every=10, eval_every=10)
    bar = SimpleNamespace(total=steps, update=lambda n: None, close=lambda: None)
    log = SimpleNamespace(eval_steps=[], total_steps=0, seconds=0.0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(2, 4)
    taken = common.run_step_loop(plan, cfg, opt, model.parameters(),
                                 lambda: model(x).square().sum(), [], bar,
                                 flush=lambda step: None,
                                 evaluate=lambda step: log.eval_steps.append(step), log=log)
    assert taken == steps
    assert clipped == [2] * steps  # weight and bias, at every step


def _plan_past_its_clock(steps):
    plan = common.StepPlan(steps=steps, minutes=0.001, max_steps=100,
                           device=torch.device("cpu"))
    plan.start()
    plan._t0 -= 3600.0  # an hour past a 0.06 s budget
    return plan


def test_fixed_steps_are_not_cut_by_the_clock():
    plan = _plan_past_its_clock(steps=40)
    assert not plan.finished(10) and not plan.stopped_by_clock
    assert plan.finished(40)


def test_a_time_budgeted_run_stops_by_the_clock():
    plan = _plan_past_its_clock(steps=None)
    assert plan.finished(10) and plan.stopped_by_clock
