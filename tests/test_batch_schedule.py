"""``num_speculative_tokens_per_batch_size`` with ``method: ddtree`` on CPU: the key on
the front end (accepted, refused with the key, the value and what is allowed; kept from
vLLM's scheduler), the budget lookup by batch size, the step plan that cuts each step's
drafts to it (0: a plain decoding step, no drafter pass), and the verify shapes whose
CUDA graphs are captured."""

from types import SimpleNamespace as NS

import pytest
from test_config_front_end import (  # noqa: F401 - fixtures
    DRAFTER,
    SPEC,
    DrafterModelConfigReached,
    front_end,
    pair_dirs,
)

from vllm_ddtree.budget.schedule import BatchSchedule, schedule_budgets
from vllm_ddtree.config import (
    BATCH_SCHEDULE_KEY,
    DDTreeConfig,
    DDTreeConfigError,
    check_parallel_setup,
    split_ddtree_spec,
)
from vllm_ddtree.verify.shape import StepPlan, prefill_load, step_shapes, truncate_drafts

BASE = {"method": "ddtree", "model": "/drafter", "num_speculative_tokens": 32}
SCHEDULE = [[1, 2, 32], [3, 4, 8], [5, 8, 0]]


# -- the key ---------------------------------------------------------------------------


def test_schedule_is_accepted_normalised_and_kept_from_vllm():
    vllm_spec, cfg = split_ddtree_spec({**BASE, BATCH_SCHEDULE_KEY: [[5, 8, 0], [1, 4, 6]]})
    assert cfg.batch_schedule == ((1, 4, 6), (5, 8, 0))  # vLLM's normalisation: sorted
    # vLLM's scheduler never sees it (it would lag a step and stop padding decodes)
    assert BATCH_SCHEDULE_KEY not in vllm_spec and vllm_spec["method"] == "dflash"
    # k >= B is allowed (capped at lookup), k = 0 too; with auto it is auto's cap
    _, auto = split_ddtree_spec({**BASE, "ddtree_budget": "auto",
                                 BATCH_SCHEDULE_KEY: [(1, 1, 500), (2, 64, 0)]})
    assert auto.adaptive and auto.batch_schedule == ((1, 1, 500), (2, 64, 0))
    # the dict the workers get reads back, also after a JSON round trip (lists)
    raw = cfg.to_dict()
    assert DDTreeConfig(**raw) == cfg
    assert DDTreeConfig(**{**raw, "batch_schedule": [[1, 4, 6], [5, 8, 0]]}) == cfg


@pytest.mark.parametrize("value, reason", [
    ([], "non-empty list"),
    ("[[1, 4, 2]]", "non-empty list"),
    ([[1, 4]], "non-empty list"),
    ([[1, 4, "2"]], "non-empty list"),
    ([[1, 4, 2.5]], "non-empty list"),
    ([[1, 4, True]], "non-empty list"),
    ([[2, 4, 2]], "must start at 1"),
    ([[1, 4, 2], [3, 8, 1]], "non-overlapping"),
    ([[1, 4, -1]], ">= 0"),
    ([[0, 4, 1]], "must be positive"),
    ([[1, 4, 2], [8, 5, 1]], "start must be <= end"),
])
def test_bad_schedules_name_the_key_the_value_and_what_is_allowed(value, reason):
    with pytest.raises(DDTreeConfigError) as err:
        split_ddtree_spec({**BASE, BATCH_SCHEDULE_KEY: value})
    message = str(err.value)
    assert message.startswith(f"speculative config: {BATCH_SCHEDULE_KEY}={value!r}")
    assert reason in message
    assert "range_start, range_end, k" in message and "0 = plain decoding" in message


def test_schedule_refused_with_data_parallelism():
    _, cfg = split_ddtree_spec({**BASE, BATCH_SCHEDULE_KEY: SCHEDULE})
    check_parallel_setup(cfg, 1)
    with pytest.raises(DDTreeConfigError, match=f"{BATCH_SCHEDULE_KEY}.*data_parallel_size=2"):
        check_parallel_setup(cfg, 2)
    check_parallel_setup(split_ddtree_spec(BASE)[1], 2)  # no schedule: nothing to refuse


def test_pipeline_parallelism_is_refused():
    _, cfg = split_ddtree_spec(BASE)
    check_parallel_setup(cfg, 1, 1)
    with pytest.raises(DDTreeConfigError) as err:
        check_parallel_setup(cfg, 1, 2)
    assert str(err.value).startswith(
        "speculative config: pipeline_parallel_size=2 is not allowed: 1 with method 'ddtree'")


def test_front_end_accepts_the_schedule_before_model_work(front_end):  # noqa: F811
    """Through ``EngineArgs.create_speculative_config``: a good schedule reaches vLLM's
    drafter ModelConfig (the key itself does not reach vLLM); a bad one is refused
    before it."""
    with pytest.raises(DrafterModelConfigReached):
        front_end({**SPEC, "model": DRAFTER, BATCH_SCHEDULE_KEY: [[1, 4, 8], [5, 256, 0]]})
    assert BATCH_SCHEDULE_KEY not in front_end.engine_args.speculative_config
    with pytest.raises(DDTreeConfigError, match=BATCH_SCHEDULE_KEY):
        front_end({**SPEC, "model": DRAFTER, BATCH_SCHEDULE_KEY: [[3, 4, 8]]})


# -- the lookup ------------------------------------------------------------------------


def test_lookup_follows_vllms_ranges_gaps_and_tail_capped_at_b():
    schedule = BatchSchedule([(1, 2, 64), (4, 5, 8), (9, 9, 0)], max_num_reqs=12, max_budget=32)
    got = [schedule.budget_for(r) for r in range(1, 13)]
    # 1-2: 64 capped at B = 32; 3: the gap takes the previous k; 6-8 likewise; 10-12:
    # the last k carries on
    assert got == [32, 32, 32, 8, 8, 8, 8, 8, 0, 0, 0, 0]
    assert schedule.budget_for(0) == 32 and schedule.budget_for(99) == 0  # clamped
    assert schedule.budgets() == [0, 8, 32]
    assert schedule_budgets(None, 12, 32) == []


# -- the step plan ----------------------------------------------------------------------


def scheduler_output(num_reqs: int, drafts: int = 32, prefill: bool = False):
    from vllm.v1.core.sched.output import SchedulerOutput

    out = SchedulerOutput.make_empty()
    out.num_scheduled_tokens = {f"r{i}": 1 + drafts for i in range(num_reqs)}
    out.scheduled_spec_decode_tokens = {f"r{i}": [-1] * drafts for i in range(num_reqs)}
    if prefill:
        out.num_scheduled_tokens["p"] = 100
    out.total_num_scheduled_tokens = sum(out.num_scheduled_tokens.values())
    return out


def test_truncate_to_zero_is_a_plain_step_and_leaves_the_original():
    original = scheduler_output(3, prefill=True)
    plain = truncate_drafts(original, 0)
    assert plain.scheduled_spec_decode_tokens == {}  # the runner samples without trees
    assert plain.num_scheduled_tokens == {"r0": 1, "r1": 1, "r2": 1, "p": 100}
    assert plain.total_num_scheduled_tokens == 103
    assert original.total_num_scheduled_tokens == 3 * 33 + 100
    assert len(original.scheduled_spec_decode_tokens["r0"]) == 32
    with pytest.raises(ValueError, match="num_drafts"):
        truncate_drafts(original, -1)


def test_prefill_load_counts_what_is_not_a_root_and_its_drafts():
    """Decodes (a root and its drafts, also after truncation) are no load; a prompt
    chunk, a new request (even one of one token) and a request scheduled otherwise than
    1 + its drafts are, with all their tokens and their attention's query-key pairs (n
    tokens after c computed: n * c + n * (n + 1) / 2)."""
    from types import SimpleNamespace as NS

    assert prefill_load(scheduler_output(3)) == (0, 0, 0)
    assert prefill_load(scheduler_output(3, prefill=True)) == (1, 100, 5050)
    assert prefill_load(truncate_drafts(scheduler_output(3), 0)) == (0, 0, 0)
    assert prefill_load(truncate_drafts(scheduler_output(3, prefill=True), 4)) == (
        1, 100, 5050)
    out = scheduler_output(2)
    out.num_scheduled_tokens["new"] = 1
    out.scheduled_new_reqs = [NS(req_id="new", num_computed_tokens=0)]
    out.num_scheduled_tokens["r1"] = 7  # 7 of its 1 + 32 (a recompute, say)
    assert prefill_load(out) == (2, 8, 1 + 28)


def test_prefill_load_pairs_follow_the_computed_prefix():
    """A prompt's later chunk attends to the tokens computed before it, a new request to
    its prefix-cached ones: 2,048 tokens after 30,000 are 2,048 * 30,000 + 2,048 * 2,049
    / 2 pairs, 30x those of the first chunk."""
    from types import SimpleNamespace as NS

    from vllm.v1.core.sched.output import CachedRequestData

    out = scheduler_output(2, prefill=True)  # "p": 100 tokens
    out.num_scheduled_tokens["p"] = 2048
    out.scheduled_cached_reqs = CachedRequestData.make_empty()
    out.scheduled_cached_reqs.req_ids = ["r0", "p", "r1"]
    out.scheduled_cached_reqs.num_computed_tokens = [500, 30_000, 700]
    first = 2048 * 2049 // 2
    assert prefill_load(out) == (1, 2048, 2048 * 30_000 + first)
    out.num_scheduled_tokens["cached"] = 2048
    out.scheduled_new_reqs = [NS(req_id="cached", num_computed_tokens=4096)]
    assert prefill_load(out) == (2, 4096, 2048 * 30_000 + 2048 * 4096 + 2 * first)


def test_prefill_load_takes_a_new_request_padded_with_placeholder_drafts_as_a_decode():
    """vLLM pads a new or resumed request with one token left to compute (its prompt
    prefix-cached) to ``1 + B`` with placeholder drafts when no prefill is scheduled
    (``scheduler.py``: "Pad new decode requests"). It verifies like the decodes, cut to
    the step's shape with them: no load (before, its 1 + 32 tokens were priced as extra
    rows where the step verified 1 + 4 a request, or 1 in a plain step)."""
    from types import SimpleNamespace as NS

    out = scheduler_output(3)
    out.num_scheduled_tokens["resumed"] = 33
    out.scheduled_spec_decode_tokens["resumed"] = [-1] * 32
    out.scheduled_new_reqs = [NS(req_id="resumed", num_computed_tokens=4000)]
    out.total_num_scheduled_tokens += 33
    assert prefill_load(out) == (0, 0, 0)
    cut = truncate_drafts(out, 4)
    assert cut.num_scheduled_tokens["resumed"] == 5
    assert prefill_load(cut) == (0, 0, 0)


def test_plan_cuts_each_step_to_the_schedule_of_its_batch_size():
    """Without auto, a step verifies the schedule's budget for its own batch size;
    a propose at a batch size whose budget is 0 skips the drafter's pass, so the next
    step decodes plainly whatever its size; the step after a drafted propose verifies
    its own size's budget again."""
    schedule = BatchSchedule(SCHEDULE, max_num_reqs=8, max_budget=32)
    plan = StepPlan(32, [0, 8, 32], schedule)
    seen = []
    for num_reqs in (1, 2, 3, 6, 7, 4, 2, 8, 1):
        shape = plan.step_shape(num_reqs)
        draft = plan.draft_next(num_reqs)
        seen.append((num_reqs, shape, draft))
    assert seen == [(1, 32, True), (2, 32, True), (3, 8, True), (6, 0, False),
                    (7, 0, False), (4, 0, True), (2, 32, True), (8, 0, False),
                    (1, 0, True)]
    assert {shape for _, shape, _ in seen} <= set(plan.shapes)


def test_plan_caps_autos_shape_with_the_schedule():
    from vllm_ddtree.verify.shape import VerifyShapeChooser

    chooser = VerifyShapeChooser(32, "cpu")
    import torch

    chooser.record_(torch.tensor(16))
    plan = StepPlan(32, [0, 1, 2, 4, 8, 16, 32], BatchSchedule(SCHEDULE, 8, 32), chooser)
    assert plan.step_shape(1) == 16  # auto's shape under the cap 32
    assert plan.step_shape(3) == 8  # the cap 8 under auto's 16
    assert plan.draft_next(5) is False  # cap 0: no drafter pass ...
    assert plan.step_shape(1) == 0  # ... so the next step is plain at any size


def test_step_shapes_hold_every_budget_a_step_can_verify():
    auto = DDTreeConfig(budget=32, adaptive=True)
    assert step_shapes(auto, 1, 8) == [0, 1, 2, 4, 8, 16, 32]  # b = 0 at TP = 1
    assert step_shapes(auto, 2, 8) is None  # fixed shapes at TP > 1, no b = 0
    adaptive_tp2 = DDTreeConfig(budget=32, adaptive=True, verify_shape="adaptive")
    assert step_shapes(adaptive_tp2, 2, 8) == [1, 2, 4, 8, 16, 32]  # no b = 0 at TP > 1
    fixed = DDTreeConfig(budget=32)
    assert step_shapes(fixed, 1, 8) is None
    scheduled = DDTreeConfig(budget=32, batch_schedule=((1, 2, 12), (3, 8, 0)))
    assert step_shapes(scheduled, 1, 8) == [0, 12, 32]
    assert step_shapes(scheduled, 4, 8) == [0, 12, 32]  # host-known: any TP
    assert step_shapes(scheduled, 1, 2) == [12, 32]  # batches of 3+ never run
    both = DDTreeConfig(budget=32, adaptive=True, batch_schedule=((1, 2, 12), (3, 8, 0)))
    assert step_shapes(both, 1, 8) == [0, 1, 2, 4, 8, 12, 16, 32]


@pytest.fixture
def plan_patch(monkeypatch):
    """``patches/verify_shapes.py`` applied over vLLM's own functions (restored after
    the test); ``execute_model`` records the scheduler output it gets."""
    from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    import vllm_ddtree.patches.verify_shapes as verify_shapes

    for cls, names in ((CudaGraphManager, ("_init_candidates", "dispatch", "capture")),
                       (GPUModelRunner, ("capture_model",))):
        for name in names:
            fn = getattr(cls, name)
            monkeypatch.setattr(cls, name, getattr(fn, "_ddtree_original", fn))
    calls = []
    monkeypatch.setattr(GPUModelRunner, "execute_model",
                        lambda self, so, *a, **k: calls.append(so) or "ran")
    verify_shapes.apply()
    return GPUModelRunner, calls


def test_graph_manager_captures_the_plain_and_scheduled_shapes(plan_patch):
    """The verify-shape patch plans a FULL decode graph of 1 + s rows for every shape,
    s = 0 (one row) included, through vLLM's own ``_init_candidates``."""
    from test_verify_shape import full_decode_lengths, graph_manager

    manager, spec = graph_manager(DDTreeConfig(budget=8, batch_schedule=((1, 2, 3),
                                                                         (3, 4, 0))))
    manager._init_candidates()
    assert full_decode_lengths(manager) == {1, 4, 9}
    assert spec.num_speculative_tokens_per_batch_size is None
    manager, _ = graph_manager(DDTreeConfig(budget=8, adaptive=True))
    manager._init_candidates()
    assert full_decode_lengths(manager) == {1, 2, 3, 5, 9}


def test_execute_model_cuts_each_step_by_the_plan(plan_patch):
    runner_cls, calls = plan_patch
    plan = StepPlan(32, [0, 8, 32], BatchSchedule(SCHEDULE, 8, 32))
    runner = NS(speculator=NS(step_plan=plan))
    assert runner_cls.execute_model(runner, scheduler_output(3)) == "ran"
    assert calls[-1].num_scheduled_tokens == {f"r{i}": 9 for i in range(3)}
    plan.drafted = False
    runner_cls.execute_model(runner, scheduler_output(2))
    assert calls[-1].scheduled_spec_decode_tokens == {}
    # dummy runs and empty steps pass as they are
    original = scheduler_output(3)
    runner_cls.execute_model(runner, original, dummy_run=True)
    assert calls[-1] is original
    # without a plan (fixed budget, other methods) nothing changes
    runner_cls.execute_model(NS(speculator=NS()), original)
    assert calls[-1] is original
