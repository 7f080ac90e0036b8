"""The step gate's start-up cost model (``vllm_ddtree.budget.step_cost``): a step's
GPU time by batch size, verified rows, drafter pass and context."""

import numpy as np
import pytest

from vllm_ddtree.budget.step_cost import StepCostModel


def cost_model(num_layers=2, graphs=True) -> StepCostModel:
    """Attention 1 us a request and layer at one row, +0.1 us a row, doubling from 1k to
    2k context; verify forward 100 us + 1 us a row; drafter 200 us + 10 us a request."""
    contexts = [1024, 2048]
    budgets = [1, 2, 4, 8]
    tree = [[1e-6 + 1e-7 * (1 + b) for b in budgets], [2e-6 + 2e-7 * (1 + b) for b in budgets]]
    model = StepCostModel(num_layers, contexts, [1e-6, 2e-6], tree, budgets)
    if graphs:
        model.set_graph_costs({n: 1e-4 + 1e-6 * n for n in (1, 2, 4, 9, 16, 36)},
                              {r: 2e-4 + 1e-5 * r for r in (1, 2, 4)})
    return model


def test_cost_model_covers_batch_size_rows_and_context():
    model = cost_model()
    ctx = np.array([1024, 1024])
    # plain: 2 rows of verify forward + attention at one row
    assert model.step_seconds(2, ctx, 0, False) == pytest.approx(1e-4 + 2e-6 + 2 * 2 * 1e-6)
    # a tree step of shape 8: 18 rows (interpolated between 16 and 36), tree attention
    # at 9 rows, and the drafter's pass of 2 requests
    want = 1e-4 + 18e-6 + 2 * 2 * (1e-6 + 9e-7) + 2e-4 + 2e-5
    assert model.step_seconds(2, ctx, 8, True) == pytest.approx(want)
    # past the measured batch sizes and rows: the line continues
    assert model.step_seconds(8, np.full(8, 1024), 8, True) == pytest.approx(
        1e-4 + 72e-6 + 2 * 8 * (1e-6 + 9e-7) + 2e-4 + 8e-5)
    # context: linear between 1k and 2k, continued past 2k; rows between budgets
    assert model.attention_seconds(np.array([1536]), 0) == pytest.approx(2 * 1.5e-6)
    assert model.attention_seconds(np.array([4096]), 0) == pytest.approx(2 * 4e-6)
    assert model.attention_seconds(np.array([1024]), 3) == pytest.approx(
        2 * (1e-6 + 4e-7))
    # more rows never cost less: a reading above a larger count's is interference
    # (it only adds time) and is lowered to it
    model.set_graph_costs({1: 2e-4, 2: 1e-4}, {})
    assert model.verify_seconds.tolist() == [1e-4, 1e-4]
    bare = cost_model(graphs=False)
    assert not bare.has_graph_costs
    assert bare.step_seconds(4, np.full(4, 1024), 8, True) == pytest.approx(
        2 * 4 * (1e-6 + 9e-7))


def test_attention_columns_equal_per_request_interpolation():
    """The vectorized context interpolation equals ``np.interp`` per request and
    budget, clamped below the first timed context and continued past the last."""
    rng = np.random.default_rng(0)
    contexts = [512, 1024, 4096, 16384]
    budgets = [1, 2, 4, 8, 16]
    tree = rng.uniform(1e-6, 1e-5, size=(4, 5))
    plain = rng.uniform(1e-7, 1e-6, size=4)
    model = StepCostModel(3, contexts, plain, tree, budgets)
    table = np.concatenate([plain[:, None], tree], axis=1)
    xs = np.asarray(contexts, dtype=np.float64)
    ctx = np.array([1, 512, 700, 1024, 3000, 16384, 40000], dtype=np.float64)

    def one(c: float, k: int) -> float:
        if c > xs[-1]:
            slope = (table[-1, k] - table[-2, k]) / (xs[-1] - xs[-2])
            return table[-1, k] + slope * (c - xs[-1])
        return float(np.interp(c, xs, table[:, k]))

    want = [sum(one(c, k) for c in ctx) for k in range(table.shape[1])]
    assert model.attention_columns(ctx) == pytest.approx(want, rel=1e-12)
    assert model.attention_columns(np.zeros(0)).tolist() == [0.0] * 6
    # between budgets 4 and 8 (columns 3 and 4): linear in the row count
    assert model.attention_seconds(ctx, 6) == pytest.approx(3 * (want[3] + want[4]) / 2)
    single = StepCostModel(1, [1024], [2e-6], [[3e-6]], [4])
    assert single.attention_columns(np.array([100, 5000])).tolist() == [4e-6, 6e-6]
    # a batch of one takes a scalar path: the same figures as the per-request reference
    for c in ctx:
        got = model.attention_columns(np.array([c]))
        assert got == pytest.approx([one(c, k) for k in range(table.shape[1])], rel=1e-12)


@pytest.mark.parametrize("graphs", [True, False])
def test_step_seconds_by_drafts_equals_step_seconds_per_count(graphs):
    """The gate's vectorized step time of every arm equals the scalar model per count,
    the drafter's pass included exactly where the count is above 0, past the measured
    rows (continued slope) and budgets (clamped) included."""
    model = cost_model(graphs=graphs)
    ctx = np.array([700, 1024, 1500, 3000])
    columns = model.attention_columns(ctx)
    drafts = np.array([0, 1, 2, 3, 4, 8, 12, 64])
    want = [model.step_seconds(4, ctx, int(d), d > 0) for d in drafts]
    assert model.step_seconds_by_drafts(4, drafts, columns) == pytest.approx(want, rel=1e-12)
    single = StepCostModel(1, [1024], [2e-6], [[3e-6]], [4])
    single.set_graph_costs({5: 1e-4}, {1: 2e-4})
    want = [single.step_seconds(3, np.full(3, 1024), d, d > 0) for d in (0, 4, 9)]
    got = single.step_seconds_by_drafts(3, np.array([0, 4, 9]), single.attention_columns(
        np.full(3, 1024)))
    assert got == pytest.approx(want, rel=1e-12)


def test_step_seconds_by_drafts_follows_new_graph_costs_and_batch_sizes():
    """The per-batch-size arm costs the gate reads every step are kept between calls:
    new start-up timings replace them, and each batch size and draft set has its own
    (counts that are all timed budgets, and counts between them)."""
    model = cost_model()
    ctx = np.array([1024])
    columns = model.attention_columns(ctx)
    for drafts in (np.array([0, 1, 2, 4, 8]), np.array([0, 3, 5])):
        for num_reqs in (1, 3, 1):
            want = [model.step_seconds(num_reqs, np.full(num_reqs, 1024), int(d), d > 0)
                    for d in drafts]
            got = model.step_seconds_by_drafts(num_reqs, drafts,
                                               model.attention_columns(np.full(num_reqs, 1024)))
            assert got == pytest.approx(want, rel=1e-12)
    before = model.step_seconds_by_drafts(1, np.array([0, 4]), columns)
    model.set_graph_costs({n: 5e-4 + 1e-6 * n for n in (1, 2, 4, 9, 16, 36)},
                          {r: 3e-4 for r in (1, 2, 4)})
    after = model.step_seconds_by_drafts(1, np.array([0, 4]), columns)
    assert after == pytest.approx([model.step_seconds(1, ctx, 0, False),
                                   model.step_seconds(1, ctx, 4, True)], rel=1e-12)
    assert after[0] > before[0] + 3e-4


def test_prefill_tokens_are_priced_as_more_forward_rows():
    """A step's prefill tokens cost what the verify forward takes for that many more
    rows beside its decodes (1 us a row here), continued past the timed shapes; nothing
    without graph costs or without tokens."""
    model = cost_model()
    assert model.extra_rows_seconds(18, 10) == pytest.approx(10e-6)
    assert model.extra_rows_seconds(18, 2000) == pytest.approx(2000e-6)  # past 36 rows
    assert model.extra_rows_seconds(18, 0) == 0.0
    assert cost_model(graphs=False).extra_rows_seconds(18, 10) == 0.0


def test_rows_past_the_timed_graphs_follow_more_than_the_last_two():
    """vLLM captures verify graphs up to 512 tokens, and the timed token counts mix
    shapes and request counts: at 8 requests and B = 64 the largest are 260 (4 x 65) and
    264 (8 x 33) rows. 5 us between those two graphs beyond the forward's 0.1 us a row
    (timing noise, per-request work) made their segment's slope 1.35 us a row: a
    2,048-token prefill chunk cost 2.5 ms in the model instead of 0.2 ms, and the
    forward of 64 requests of 64 drafts 5.6 ms instead of 0.7 ms. The line past the
    timed graphs spans at least their last quarter of rows (0.28 and 0.87 ms here);
    exact timings still continue exactly."""
    model = cost_model()
    counts = [1, 2, 4, 8]
    rows = sorted({r * (1 + s) for r in counts for s in (0, 1, 2, 4, 8, 16, 32, 64)
                   if r * (1 + s) <= 512})
    assert rows[-2:] == [260, 264]
    timed = {n: 3e-4 + 1e-7 * n for n in rows}
    model.set_graph_costs(timed, {})
    assert model.extra_rows_seconds(72, 2048) == pytest.approx(2048e-7, rel=1e-9)
    timed[264] += 5e-6
    model.set_graph_costs(timed, {})
    assert model.extra_rows_seconds(72, 2048) == pytest.approx(2048e-7, rel=0.5)
    plain = model.step_seconds(64, np.full(64, 1024), 64, False) - model.attention_seconds(
        np.full(64, 1024), 64)
    assert plain == pytest.approx(3e-4 + 64 * 65e-7, rel=0.25)


def test_slow_start_up_readings_do_not_carry_to_larger_shapes():
    """The V2-Lite-shaped target's start-up graph times beside six starting engines
    (H100, us by verify rows): 33-96 rows read 6.1-8.1 ms, 128-136 rows 3.6-3.9 ms. The
    readings out of order are the slow ones: the model keeps every count at most what
    any larger count took, and the smaller, consistent readings as they are."""
    read = {1: 3051.7, 2: 3073.3, 4: 3087.9, 9: 3144.3, 16: 3236.4, 17: 3223.8,
            24: 3264.8, 32: 6990.3, 33: 7230.1, 64: 7431.9, 65: 7399.3, 96: 8093.1,
            128: 3925.2, 130: 3642.8, 136: 3662.8, 144: 5343.2, 160: 5986.5,
            260: 11140.3, 520: 17111.6, 1040: 32875.6, 1088: 17287.9, 4160: 70072.2}
    model = cost_model()
    model.set_graph_costs({n: t * 1e-6 for n, t in read.items()}, {})
    kept = dict(zip(model.verify_rows.astype(int).tolist(),
                    (model.verify_seconds * 1e6).tolist(), strict=True))
    assert all(kept[n] <= 3642.8 + 1e-6 for n in (32, 33, 64, 65, 96, 128))
    assert kept[16] == pytest.approx(3223.8) and kept[24] == pytest.approx(3264.8)
    assert kept[1040] == pytest.approx(17287.9) and kept[4160] == pytest.approx(70072.2)
    assert all(np.diff(model.verify_seconds) >= 0)
