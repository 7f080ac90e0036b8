"""``evals/gate_variants.py``: ``ddtree-auto`` runs with the gate pinned (CPU)."""

import pytest
from e2e_runs import RunSpec
from gate_variants import (
    apply_max_prior_gate,
    apply_pinned_gate,
    remove_max_prior_gate,
    remove_pinned_gate,
)


def test_two_auto_runs_are_each_held_to_the_fixed_methods():
    """An A/B of two step gates: each auto run's ratio is to the best run that is not
    auto, not to the other gate."""
    from e2e_sweep_report import auto_ratios

    runs = ["ar@FLASH_ATTN_MLA", "ddtree-64", "ddtree-auto-64", "ddtree-auto-64+pin32"]
    speed = {(r, 1024, "code", 1): v for r, v in zip(runs, (100.0, 200.0, 180.0, 300.0),
                                                      strict=True)}
    ratios = dict((run, (best, ar)) for run, best, ar
                  in auto_ratios(speed, runs, 1024, "code", 1))
    assert ratios["ddtree-auto-64"] == pytest.approx((0.9, 1.8))
    assert ratios["ddtree-auto-64+pin32"] == pytest.approx((1.5, 3.0))


def test_pinned_gate_parses_for_auto_runs_only_and_one_gate_variant():
    run = RunSpec.parse("ddtree-auto-64+pin32")
    assert run.auto_max == 64 and run.variants == ("+pin32",)
    assert RunSpec.parse("ddtree-auto+pin64").variants == ("+pin64",)
    with pytest.raises(ValueError, match="ddtree-auto runs only"):
        RunSpec.parse("ddtree-32+pin32")
    with pytest.raises(ValueError, match="one step-gate variant"):
        RunSpec.parse("ddtree-auto+pin32+pin16")


def test_pinned_gate_runs_its_arm_every_step_and_still_times_it():
    """Pinned to 16: every step verifies 16 drafts at batch 1 and 64 (where the product
    gate settles on 8 and 4), the arm's residuals and trees are still measured; with the
    batch schedule's cap below the pin, the largest arm within the cap, and plain
    decoding below every speculative arm; removing the patch restores the product
    gate."""
    from test_budget_gate import Engine

    from vllm_ddtree.budget.schedule import BatchSchedule

    apply_pinned_gate(16)
    try:
        engine = Engine()
        assert engine.run(1, 50)[1:] == [16] * 49  # the first step precedes any decision
        assert engine.run(64, 50) == [16] * 50
        stats = engine.gate.stats[0]
        arm = engine.gate.arms.index(16)
        assert stats.residual_count[arm] > 40 and stats.committed_count[arm] > 40
        assert engine.gate.settled_arms() == {0: 16, 6: 16}
        capped = Engine(schedule=BatchSchedule([(1, 4, 4), (5, 8, 0), (9, 64, 64)], 64, 64))
        assert set(capped.run(2, 30)[1:]) == {4}
        assert set(capped.run(6, 30)[1:]) == {0}
    finally:
        remove_pinned_gate()
    assert Engine().run(1, 600)[-100:].count(8) >= 90  # the product gate again


def test_gate_variants_need_a_gate_and_the_runs_own_process():
    """ddtree-autofixed builds no step gate, and --engine-process runs the engine core in
    another process: a gate variant there would silently not apply."""
    import bench_e2e

    with pytest.raises(ValueError, match="autofixed has no gate"):
        RunSpec.parse("ddtree-autofixed-64+pin32")
    with pytest.raises(SystemExit):
        bench_e2e.parse_args(["--runs", "ddtree-auto+pin16", "--engine-process"])


def test_max_prior_gate_starts_new_buckets_at_the_largest_arm_and_still_descends():
    """After batch 1 settled on 8 drafts, the product gate opens batch 64's bucket on 8
    (the nearest bucket's arm); with +maxprior it opens on 64, and both settle on 4 (the
    simulated engine's best at batch 64). With a cap, the largest arm within it."""
    from test_budget_gate import Engine

    from vllm_ddtree.budget.schedule import BatchSchedule

    product = Engine()
    product.run(1, 400)
    assert product.run(64, 2)[1] == 8
    apply_max_prior_gate()
    try:
        engine = Engine()
        engine.run(1, 400)
        assert engine.gate.settled_arms() == {0: 8}
        assert engine.run(64, 2)[1] == 64
        engine.run(64, 1000)
        assert engine.gate.settled_arms()[6] == 4
        capped = Engine(schedule=BatchSchedule([(1, 4, 64), (5, 64, 16)], 64, 64))
        capped.run(1, 400)
        assert capped.run(64, 2)[1] == 16
    finally:
        remove_max_prior_gate()
    fresh = Engine()
    fresh.run(1, 400)
    assert fresh.run(64, 2)[1] == 8  # the product gate again

