"""``ddtree_budget: "auto"`` on CPU: config, nested trees under the verifier's mask,
the device choice against brute force, the start-up table (fake timer), the base-time
EMA, losslessness on the reference engine, and the speculator / verifier wiring."""

from types import SimpleNamespace as NS

import pytest
import torch
from oracle import OracleDrafter
from test_ddtree_integration_units import (
    BUDGET,
    DEPTHS,
    VOCAB,
    FakeSampler,
    make_scenario,
    new_state,
)
from tiny_models import drafter_config, tiny_drafter, tiny_target

from vllm_ddtree.attention_backends.tree_mask_state import ALL_ROWS_ACTIVE, TREE_MASK_STATE
from vllm_ddtree.budget.attention_timing import (
    CONTEXT_GRID,
    measure_attention_table,
    measurement_contexts,
)
from vllm_ddtree.budget.choice import (
    RATE_TOLERANCE,
    BudgetCostTable,
    choose_batch_budget,
    expected_committed_by_budget,
    mask_inactive_nodes,
)
from vllm_ddtree.budget.policy import (
    MAX_ROUND_SECONDS,
    BudgetPolicy,
    candidate_budgets,
)
from vllm_ddtree.config import DDTreeConfig, DDTreeConfigError, split_ddtree_spec
from vllm_ddtree.reference import generate
from vllm_ddtree.runtime_state import ddtree_config_of, verify_inputs_
from vllm_ddtree.tree.draft_tree import build_ddtree
from vllm_ddtree.verify.verifier import DDTreeVerifier
from vllm_ddtree.walk.follow import follow_tree, follow_tree_reference

BASE_SPEC = {"method": "ddtree", "model": "/drafter", "num_speculative_tokens": 64}
PROMPT = [5, 17, 33, 2, 60, 41, 9, 12, 77, 3, 28, 50]


@pytest.fixture(autouse=True)
def _restore_tree_mask_state():
    names = ("ancestor_bits", "active", "adaptive", "active_query_lens")
    saved = {n: getattr(TREE_MASK_STATE, n) for n in names if hasattr(TREE_MASK_STATE, n)}
    yield
    for name, value in saved.items():
        setattr(TREE_MASK_STATE, name, value)


# -- config ------------------------------------------------------------------------------


def test_config_accepts_auto_and_carries_it_to_the_engine():
    spec, cfg = split_ddtree_spec({**BASE_SPEC, "ddtree_budget": "auto", "ddtree_top_k": 4})
    assert cfg == DDTreeConfig(budget=64, top_k=4, adaptive=True)
    assert "ddtree_budget" not in spec and spec["num_speculative_tokens"] == 64
    assert split_ddtree_spec(BASE_SPEC)[1].adaptive is False
    raw = cfg.to_dict()
    assert raw == {"budget": 64, "top_k": 4, "adaptive": True, "verify_shape": None,
                   "batch_schedule": None}
    assert ddtree_config_of(NS(ddtree=raw)) == cfg
    # dicts written before the key existed still read as a fixed budget
    assert ddtree_config_of(NS(ddtree={"budget": 8, "top_k": None})).adaptive is False


@pytest.mark.parametrize("value", ["fixed", "AUTO", 32, True, ""])
def test_config_refuses_other_budget_values_by_name(value):
    with pytest.raises(DDTreeConfigError, match="ddtree_budget") as err:
        split_ddtree_spec({**BASE_SPEC, "ddtree_budget": value})
    assert '"auto"' in str(err.value) and "num_speculative_tokens" in str(err.value)


# -- nested trees under the verifier's mask ----------------------------------------------


def path_targets(tree, r: int, node: int, width: int) -> torch.Tensor:
    """Target tokens ``[1 + B]`` that follow request r's path to ``node`` (noise
    elsewhere): the target's token at each ancestor (and the root) is the next node's."""
    gen = torch.Generator().manual_seed(node)
    targets = torch.randint(0, width, (1 + tree.budget,), generator=gen)
    path, j = [], node
    while j >= 0:
        path.append(j)
        j = int(tree.parents[r, j])
    path.reverse()
    prev = -1
    for j in path:
        targets[prev + 1] = tree.tokens[r, j]
        prev = j
    return targets


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_masked_walk_equals_walk_of_the_smaller_tree(seed):
    gen = torch.Generator().manual_seed(seed)
    reqs, depths, vocab, big_b = 3, 5, 4, 48
    logits = torch.randn(reqs, depths, vocab, generator=gen) * 1.5
    big = build_ddtree(logits, big_b)
    deepest = big.depths.argmax(dim=1)  # deepest node of each tree (a late index)
    for b in (1, 2, 5, 13, 31, 48):
        small = build_ddtree(logits, b)
        # The first b nodes ARE the budget-b tree.
        assert torch.equal(small.tokens, big.tokens[:, :b])
        assert torch.equal(small.parents, big.parents[:, :b])
        for kind in ("random", "deep"):
            if kind == "random":
                targets = torch.randint(0, vocab, (reqs, 1 + big_b), generator=gen)
            else:
                targets = torch.stack([path_targets(big, r, int(deepest[r]), vocab)
                                       for r in range(reqs)])
            active = torch.full((reqs,), b)
            masked = big.__class__(mask_inactive_nodes(big.tokens, active), big.parents,
                                   big.depths, big.scores)
            got = follow_tree(masked, targets, max_depth=depths)
            want = follow_tree(small, targets[:, : 1 + b], max_depth=depths)
            for name in ("accepted_depth", "committed_tokens", "kv_src_rows", "bonus_tokens"):
                assert torch.equal(getattr(got, name), getattr(want, name)), (b, kind, name)
            if kind == "deep" and b == big_b:
                assert torch.equal(got.accepted_depth, big.depths[torch.arange(reqs), deepest])


def test_mask_takes_a_batch_scalar_or_per_request_budgets():
    tokens = torch.arange(12).view(2, 6)
    assert mask_inactive_nodes(tokens, torch.tensor(2)).tolist() == [
        [0, 1, -1, -1, -1, -1], [6, 7, -1, -1, -1, -1]]
    assert mask_inactive_nodes(tokens, torch.tensor([1, 6])).tolist() == [
        [0, -1, -1, -1, -1, -1], [6, 7, 8, 9, 10, 11]]


# -- the choice ----------------------------------------------------------------------------


def python_interp(contexts, seconds, ctx):
    """Linear interpolation clamped below and extrapolated above (plain Python)."""
    ctx = max(ctx, contexts[0])
    i = next((i for i in range(1, len(contexts)) if ctx <= contexts[i]), len(contexts) - 1)
    w = (ctx - contexts[i - 1]) / (contexts[i] - contexts[i - 1])
    return [max(0.0, a * (1 - w) + c * w) for a, c in zip(seconds[i - 1], seconds[i],
                                                           strict=True)]


def random_policy(gen, budgets, layers=4):
    contexts = sorted(set(torch.randint(10, 5000, (4,), generator=gen).tolist()))
    seconds = torch.rand(len(contexts), len(budgets), generator=gen).cumsum(1) * 1e-4
    seconds = seconds + torch.rand(len(contexts), 1, generator=gen) * 1e-4
    table = BudgetCostTable(torch.tensor(contexts), torch.tensor(budgets), seconds,
                            extrapolate=True)
    return BudgetPolicy(table, layers), contexts, seconds.tolist()


@pytest.mark.parametrize("seed", range(6))
def test_device_choice_equals_brute_force(seed):
    gen = torch.Generator().manual_seed(seed)
    big_b, reqs = 24, 5
    budgets = candidate_budgets(big_b)
    policy, contexts, seconds = random_policy(gen, budgets)
    scores = -torch.rand(reqs, big_b, generator=gen).cumsum(1) * 3 * torch.rand(1, generator=gen)
    ctx = torch.randint(1, 9000, (reqs,), generator=gen)
    base = float(torch.rand(1, generator=gen)) * 2e-3
    if seed % 2:
        policy.base_seconds.fill_(base)
    expected = expected_committed_by_budget(scores).tolist()
    per_req = [python_interp(contexts, seconds, int(c)) for c in ctx]
    attention = [policy.num_layers * sum(row[k] for row in per_req) for k in range(len(budgets))]
    base_used = base if seed % 2 else attention[-1]  # neutral start: attention at B
    rates = [sum(e[b - 1] for e in expected) / (base_used + attention[k])
             for k, b in enumerate(budgets)]
    # the smallest budget within RATE_TOLERANCE of the best rate
    want = budgets[min(k for k in range(len(budgets))
                       if rates[k] >= (1 - RATE_TOLERANCE) * max(rates))]
    got = policy.choose(scores, ctx)
    assert got.dim() == 0 and int(got) == want
    assert float(policy.last_attention) == pytest.approx(attention[budgets.index(want)],
                                                         rel=1e-5)
    # same as budget.choose_batch_budget on the modeled round times
    round_s = policy.round_seconds(policy.attention_seconds(ctx))
    assert int(choose_batch_budget(expected_committed_by_budget(scores), round_s,
                                   policy.budgets)) == want


def steep_policy(big_b=64):
    """Attention that is cheap at 1k and compute-bound at 128k (about 1.5 ms for a
    64-node tree per layer), on the real grid."""
    def fake(ctx, q):
        return 5e-6 + 1.5e-3 * (ctx / 131072) * (q / 65)

    table = measure_attention_table(fake, measurement_contexts(131072),
                                    candidate_budgets(big_b))
    policy = BudgetPolicy(table, num_layers=60)
    policy.base_seconds.fill_(0.02)
    return policy


def test_long_contexts_choose_smaller_trees_and_free_attention_chooses_b():
    # node probabilities 0.9 * 0.95^i: diminishing returns past a few dozen nodes
    scores = torch.log(0.9 * 0.95 ** torch.arange(64.0))[None].repeat(4, 1)
    policy = steep_policy()
    short = int(policy.choose(scores, torch.full((4,), 1024)))
    long = int(policy.choose(scores, torch.full((4,), 131072)))
    assert long < short
    assert short == 64
    free = BudgetPolicy(measure_attention_table(lambda c, q: 1e-12, [1024, 4096],
                                                candidate_budgets(64)), num_layers=60)
    free.base_seconds.fill_(0.01)
    assert int(free.choose(scores, torch.full((4,), 131072))) == 64


def test_near_ties_take_the_fewest_rows():
    """Where the model cannot tell budgets apart (a drafter whose nodes are all
    improbable, the dummy-weight case, over attention that costs the same for 2..9
    rows), the smallest wins: rows cost GEMM and sampling time the model does not see.
    Were the largest of the equal-cost budgets to win, kimi64 with dummy weights would
    choose 8.3 nodes on average at 1k."""
    table = measure_attention_table(lambda c, q: 2e-5 if q <= 9 else 2e-5 * q / 9,
                                    [1024, 4096], candidate_budgets(64))
    policy = BudgetPolicy(table, num_layers=4)
    policy.base_seconds.fill_(3e-3)
    improbable = torch.full((1, 64), -11.0)  # each node ~2e-5
    assert int(policy.choose(improbable, torch.tensor([1024]))) == 1
    confident = torch.log(0.9 * 0.97 ** torch.arange(64.0))[None]
    assert int(policy.choose(confident, torch.tensor([1024]))) == 64


def test_row_costs_shift_the_choice_to_fewer_rows():
    """Measured verify time per shape (adaptive shapes): when extra rows cost more than
    the tokens they are expected to add, the choice shrinks; the cost is that of the
    batch's total rows, so more requests shrink it further; the wall sample then
    covers attention + rows."""
    from vllm_ddtree.budget.choice import rows_seconds_for_batch

    table = measure_attention_table(lambda c, q: 1e-6, [1024, 4096], candidate_budgets(64))
    policy = BudgetPolicy(table, num_layers=4)
    policy.base_seconds.fill_(2e-3)
    scores = torch.log(0.9 * 0.9 ** torch.arange(64.0))[None]  # confident, fading
    ctx = torch.tensor([1024])
    free_rows = int(policy.choose(scores, ctx))
    # an MoE-like target: every extra row reads more expert weights (25 us / row)
    policy.set_row_costs({b: 1e-3 + 25e-6 * b for b in candidate_budgets(64)})
    assert policy.row_seconds.tolist()[:3] == pytest.approx([0.0, 25e-6, 75e-6], abs=1e-9)
    costly_rows = int(policy.choose(scores, ctx))
    assert costly_rows < free_rows
    batch = int(policy.choose(scores.repeat(8, 1), ctx.repeat(8)))
    assert batch <= costly_rows
    # the row cost at R requests is read at R * (1 + b) rows, extended past 1 + B
    rows = rows_seconds_for_batch(policy.row_seconds, policy.budgets, 2)
    assert rows.tolist() == pytest.approx([25e-6 * (2 * (1 + b) - 2)
                                           for b in candidate_budgets(64)], rel=1e-4)
    # the next wall sample subtracts the chosen round's attention and rows
    k = candidate_budgets(64).index(batch)
    attention = float(policy.attention_seconds(ctx.repeat(8))[k])
    assert float(policy.last_attention) == pytest.approx(attention + float(
        rows_seconds_for_batch(policy.row_seconds, policy.budgets, 8)[k]), rel=1e-5)
    with pytest.raises(ValueError, match="missing"):
        policy.set_row_costs({1: 1e-3})


# -- the start-up table and the base time ------------------------------------------------------


def test_grids():
    assert candidate_budgets(64) == [1, 2, 4, 8, 16, 32, 64]
    assert candidate_budgets(48) == [1, 2, 4, 8, 16, 32, 48]
    assert candidate_budgets(1) == [1] and candidate_budgets(2) == [1, 2]
    assert measurement_contexts(40000) == [1024, 4096, 16384, 40000]
    assert measurement_contexts(1 << 20) == list(CONTEXT_GRID)
    assert measurement_contexts(512) == [512]
    with pytest.raises(ValueError, match="max_budget"):
        candidate_budgets(0)


def test_measured_table_shape_interpolation_and_monotonicity():
    calls = []

    def fake(ctx, q):  # linear in the context; noisy (non-monotone) in q at 4096
        calls.append((ctx, q))
        noise = 1e-5 if (ctx == 4096 and q == 5) else 0.0
        return 1e-6 * (2 + ctx / 1000 * q) - noise

    contexts, budgets = measurement_contexts(40000), candidate_budgets(16)
    table = measure_attention_table(fake, contexts, budgets)
    assert table.seconds.shape == (4, 5) and len(calls) == 20
    assert sorted(calls) == sorted((c, 1 + b) for c in contexts for b in budgets)
    assert (table.seconds[:, 1:] >= table.seconds[:, :-1]).all()  # non-decreasing in b
    # the reading before the dip is lowered to it (interference only adds time); the
    # dip and the readings after it stay
    dip = 1e-6 * (2 + 4.096 * 5) - 1e-5
    assert float(table.seconds[1, 1]) == float(table.seconds[1, 2]) == pytest.approx(dip)
    assert float(table.seconds[1, 3]) == pytest.approx(1e-6 * (2 + 4.096 * 9))
    for ctx in (1024, 16384, 30000, 40000, 90000):  # linear: exact, also past the end
        want = [1e-6 * (2 + ctx / 1000 * (1 + b)) for b in budgets]
        assert table.at(torch.tensor(ctx)).tolist() == pytest.approx(want, rel=1e-4)
    assert table.at(torch.tensor(10)).tolist() == table.at(torch.tensor(1024)).tolist()
    many = table.at(torch.tensor([100, 5000, 60000]))
    assert many.shape == (3, 5) and (many[1:] >= many[:-1]).all()
    with pytest.raises(ValueError, match="non-positive"):
        measure_attention_table(lambda c, q: 0.0, [1024], [1, 2])


def test_base_time_ema_from_wall_times():
    """observe_round records the round's wall time; the next choose folds it into the
    base EMA (one launch with the choice on CUDA) before it chooses."""
    table = measure_attention_table(lambda c, q: 1e-5 * q, [1024, 4096], [1, 2, 4])
    policy = BudgetPolicy(table, num_layers=10, ema_weight=0.5)
    scores = torch.zeros(1, 4)  # certain drafts: every budget commits b + 1
    ctx = torch.tensor([2000])
    # neutral start: base = modeled attention at B = 10 * 1e-5 * 5 = 0.5 ms
    assert policy.round_seconds(policy.attention_seconds(ctx)).tolist() == pytest.approx(
        [0.5e-3 + 10 * 1e-5 * q for q in (2, 3, 5)])
    b = int(policy.choose(scores, ctx))
    attn = float(policy.last_attention)
    assert attn == pytest.approx(10 * 1e-5 * (1 + b))

    def round_ends(t, verified=True):
        policy.observe_round(t, verified=verified)
        assert int(policy.choose(scores, ctx)) == b  # certain drafts: always the largest
        return float(policy.base_seconds)

    assert round_ends(100.0) == -1.0  # first call: nothing to measure yet
    policy.observe_round(100.0 + attn + 0.004)
    assert float(policy.base_seconds) == -1.0  # recorded, not folded before the choice
    assert int(policy.choose(scores, ctx)) == b
    assert float(policy.base_seconds) == pytest.approx(0.004, rel=1e-4)
    assert round_ends(100.0 + attn + 0.004 + attn + 0.006) == pytest.approx(0.005, rel=1e-4)
    t = 200.0
    # idle engine (gap > MAX_ROUND_SECONDS), then a step without trees: both dropped
    assert round_ends(t) == pytest.approx(0.005, rel=1e-4)
    assert round_ends(t + 0.5, verified=False) == pytest.approx(0.005, rel=1e-4)
    # an outlier: at most 2x base + 0.1 ms
    assert round_ends(t + 0.5 + MAX_ROUND_SECONDS / 2) == pytest.approx(
        0.5 * 0.005 + 0.5 * 0.0101, rel=1e-4)
    policy.base_seconds.fill_(0.001)
    policy.last_attention.fill_(0.01)
    policy.update_base_(torch.tensor([0.002]))  # wall below the modeled attention: 0
    assert float(policy.base_seconds) == pytest.approx(0.0005)
    policy.observe_round(300.0)
    policy.observe_round(300.01)
    policy.reset_round_clock()  # a dummy run: the recorded sample is dropped too
    policy.choose(scores, ctx)
    assert float(policy.base_seconds) == pytest.approx(0.0005)


# -- lossless on the reference engine -------------------------------------------------------


def context_chooser(policy, seen):
    def choose(tree, context_len):
        b = int(policy.choose(tree.scores, torch.tensor([context_len])))
        seen.append((context_len, b))
        return b

    return choose


def growing_cost_policy(big_b):
    """Attention cost that explodes between 12 and 60 tokens of context."""
    table = measure_attention_table(lambda c, q: 1e-6 * q * (c / 12) ** 3, [12, 24, 48],
                                    candidate_budgets(big_b))
    policy = BudgetPolicy(table, num_layers=1)
    policy.base_seconds.fill_(1e-4)
    return policy


@pytest.mark.parametrize("kind", ["qwen3", "deepseek_v3"])
def test_reference_engine_with_adaptive_budgets_equals_ar(kind):
    target = tiny_target(kind)
    ar = generate(target, None, PROMPT, 36, "ar")
    torch.manual_seed(7)
    oracle = OracleDrafter(drafter_config(target.config)).eval().set_oracle(
        PROMPT + ar.tokens, [0, 1, 0, 0, 0, 0, 0])
    for drafter in (oracle, tiny_drafter(target)):
        seen = []
        out = generate(target, drafter, PROMPT, 36, "ddtree", budget=32,
                       budget_chooser=context_chooser(growing_cost_policy(32), seen))
        assert out.tokens == ar.tokens
        assert [s.nodes for s in out.stats] == [b for _, b in seen]
        assert len({b for _, b in seen}) > 1, seen  # the budget really varies
        assert seen[-1][1] < seen[0][1]  # and shrinks as the context grows
    sampled = generate(target, None, PROMPT, 20, "ar", temperature=1.0, seed=3)
    out = generate(target, tiny_drafter(target), PROMPT, 20, "ddtree", budget=32,
                   temperature=1.0, seed=3,
                   budget_chooser=context_chooser(growing_cost_policy(32), []))
    assert out.tokens == sampled.tokens


def test_budget_chooser_only_for_ddtree():
    target = tiny_target("qwen3")
    with pytest.raises(ValueError, match="budget_chooser"):
        generate(target, tiny_drafter(target), PROMPT, 4, "dflash",
                 budget_chooser=lambda tree, ctx: 1)


# -- speculator / verifier wiring (CPU fakes) --------------------------------------------------


def adaptive_state():
    state = new_state()
    state.enable_adaptive_(6, "cpu")
    return state


def test_enable_adaptive_sets_the_tree_mask_contract():
    state = adaptive_state()
    assert TREE_MASK_STATE.adaptive is True
    lens = TREE_MASK_STATE.active_query_lens
    assert lens.dtype == torch.int32 and lens.shape[0] >= 6
    assert (lens[:6] == ALL_ROWS_ACTIVE).all()
    assert state.active_nodes.tolist() == [BUDGET] * 6
    fixed = new_state()
    assert not fixed.adaptive and fixed.active_nodes is None


def test_propose_picks_a_budget_and_stores_it_per_request_state(monkeypatch):
    from test_ddtree_integration_units import fake_speculator
    from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator

    state = adaptive_state()
    spec = fake_speculator(state)
    spec.adaptive = True
    spec.batch_scores = torch.zeros(6, BUDGET)
    spec.budget_policy = steep_policy(BUDGET)
    num_reqs, block = 2, DEPTHS + 1
    logits = torch.randn(num_reqs, block, VOCAB) * 2
    trees = build_ddtree(logits[:, 1:], BUDGET)

    def fake_propose(self, input_batch, *args, **kwargs):  # DFlash + our _generate_draft
        hidden = logits.view(num_reqs * block, VOCAB)
        self._run_model = lambda *a: hidden
        self.model = NS(compute_logits=lambda h: h)
        self.sample_indices[: num_reqs * DEPTHS] = torch.tensor(
            [r * block + k for r in range(num_reqs) for k in range(1, block)])
        self._generate_draft(num_reqs, num_reqs * block, None, None, None)
        return self.draft_tokens[:num_reqs]

    monkeypatch.setattr(DFlashSpeculator, "propose", fake_propose)
    results = {}
    for ctx in (1024, 131072):
        batch = NS(num_reqs=2, idx_mapping=torch.tensor([4, 1], dtype=torch.int32),
                   seq_lens=torch.tensor([ctx, ctx, 0, 0], dtype=torch.int32))
        spec.propose(batch, None, {}, None, None, None, None, None, None, None, None)
        assert torch.equal(spec.batch_scores[:2], trees.scores)
        want = int(steep_policy(BUDGET).choose(trees.scores, torch.tensor([ctx, ctx])))
        assert state.active_nodes[[4, 1]].tolist() == [want, want]
        assert state.active_nodes[[0, 2, 3, 5]].tolist() == [BUDGET] * 4
        results[ctx] = want
    assert results[131072] < results[1024]
    # dummy runs choose nothing
    state.active_nodes.fill_(7)
    spec.propose(batch, None, {}, None, None, None, None, None, None, None, None,
                 dummy_run=True)
    assert state.active_nodes.tolist() == [7] * 6


def test_active_query_lens_follow_the_batch_order():
    sc = make_scenario(0.0)
    sc.state.enable_adaptive_(6, "cpu")
    b = sc.batch
    # batch: request state 3 (full tree), 0 (tree truncated to 5 nodes), 5 and 1 (prefill)
    sc.state.active_nodes[torch.tensor([3, 0, 5, 1])] = torch.tensor([9, 8, 2, 2])
    verify_inputs_(sc.state, b.positions, b.query_start_loc, b.cu_num_logits, b.idx_mapping,
                   b.num_tokens, b.num_tokens)
    qsl = b.query_start_loc.tolist()
    qlens = [qsl[r + 1] - qsl[r] for r in range(4)]
    lens = TREE_MASK_STATE.active_query_lens
    assert lens[:4].tolist() == [1 + 9, min(1 + 8, qlens[1]), qlens[2], qlens[3]]
    assert lens[:4].tolist() == [10, 6, 7, 12]
    assert (lens[4:] == ALL_ROWS_ACTIVE).all()  # graph padding skips nothing


@pytest.mark.parametrize("active", [1, 3, 11])
def test_verifier_ignores_inactive_nodes(active):
    sc = make_scenario(0.0)
    sc.state.enable_adaptive_(6, "cpu")
    idx = sc.batch.idx_mapping.long()
    sc.state.active_nodes[idx] = active
    verifier = DDTreeVerifier(sc.sampler, NS(num_speculative_tokens=BUDGET), "cpu", DEPTHS,
                              state=sc.state, draw_fn=sc.sampler.draw_fn)
    # drawn tokens that follow request 0's path to its deepest node, past the active ones
    deep = int(sc.trees.depths[0].argmax())
    assert deep >= active
    drawn, _, _ = verifier.draw_target_tokens(sc.logits.clone(), sc.batch)
    start = int(sc.batch.cu_num_logits[0])
    drawn[start : start + 1 + BUDGET] = path_targets(sc.trees, 0, deep, VOCAB)
    walk = verifier.walk(drawn, sc.batch)
    for r in range(2):
        n = min(sc.num_drafts[r], active)
        start = int(sc.batch.cu_num_logits[r])
        tree = build_ddtree(torch.zeros(1, 1, 1), 1)  # replaced below
        tree.tokens, tree.parents = sc.trees.tokens[r : r + 1, :n], sc.trees.parents[r : r + 1, :n]
        tree.depths, tree.scores = sc.trees.depths[r : r + 1, :n], sc.trees.scores[r : r + 1, :n]
        ref = follow_tree_reference(tree, drawn[start : start + 1 + n][None], DEPTHS)
        assert walk.accepted_depth[r] == ref.accepted_depth[0]
        assert torch.equal(walk.committed_tokens[r], ref.committed_tokens[0])
        assert (walk.kv_src_rows[r] <= n).all()
    # the counters: active nodes of each verified tree (capped by its drafts)
    out = verifier(sc.logits.clone(), sc.batch)
    assert out.sampled_token_ids.shape == (4, BUDGET + 1)
    assert int(sc.state.num_drafts) == 2
    assert int(sc.state.active_nodes_sum) == active + min(active, 5)
    assert sc.state.mean_active_nodes() == pytest.approx((active + min(active, 5)) / 2)


def test_fixed_budget_verifier_is_unchanged_by_active_nodes():
    sc = make_scenario(0.0)
    verifier = DDTreeVerifier(sc.sampler, NS(num_speculative_tokens=BUDGET), "cpu", DEPTHS,
                              state=sc.state, draw_fn=sc.sampler.draw_fn)
    assert isinstance(sc.sampler, FakeSampler) and not sc.state.adaptive
    drawn, _, _ = verifier.draw_target_tokens(sc.logits.clone(), sc.batch)
    start = int(sc.batch.cu_num_logits[0])
    deep = int(sc.trees.depths[0].argmax())
    drawn[start : start + 1 + BUDGET] = path_targets(sc.trees, 0, deep, VOCAB)
    walk = verifier.walk(drawn, sc.batch)
    assert int(walk.accepted_depth[0]) == int(sc.trees.depths[0, deep])


@pytest.mark.parametrize("in_graph", [False, True])
def test_a_round_sample_dispatches_one_torch_op(in_graph):
    """observe_round writes the round's seconds (and the graph's pending flag) through a
    NumPy view of its pinned slot and copies that slot to the device: one torch op (it
    dispatched eight in the graph's form: a select, two element writes, the copy).
    ``sample=False`` (the step gate holds its decision) only restarts the round clock:
    no op, no sample, and the next sample spans one round."""
    from test_verify_shape import TorchOps

    table = measure_attention_table(lambda c, q: 1e-5 * q, [1024, 4096], [1, 2, 4])
    policy = BudgetPolicy(table, num_layers=10, ema_weight=0.5)
    policy.in_graph = in_graph  # enable_in_graph_ refuses CPU tensors
    policy.observe_round(1.0)
    with TorchOps() as counted:
        policy.observe_round(1.004)
    assert counted.ops == ["aten.copy_.default"]
    sample = policy._wall_flagged if in_graph else policy._wall_device
    assert sample.tolist()[:2] == pytest.approx([0.004, 1.0][: sample.numel()], rel=1e-5)
    policy._wall_flagged.zero_()  # the graph consumed it
    policy._sample_pending = False
    with TorchOps() as counted:
        policy.observe_round(1.010, sample=False)
    assert counted.ops == [] and not policy._sample_pending
    assert float(policy._wall_flagged[1]) == 0.0
    policy.observe_round(1.013)
    assert float(sample[0]) == pytest.approx(0.003, rel=1e-4)


def test_auto_round_path_has_no_host_sync():
    """Observe the round time, choose b, store it, fill the verify inputs and walk:
    no host sync on the way (the detector treats CPU tensors as device tensors)."""
    from vllm_ddtree.testing.sync_guard import assert_no_host_sync

    sc = make_scenario(0.0)
    sc.state.enable_adaptive_(6, "cpu")
    b = sc.batch
    policy = steep_policy(BUDGET)
    verifier = DDTreeVerifier(sc.sampler, NS(num_speculative_tokens=BUDGET), "cpu", DEPTHS,
                              state=sc.state, draw_fn=sc.sampler.draw_fn)
    drawn, _, _ = verifier.draw_target_tokens(sc.logits.clone(), b)
    ctx = torch.tensor([2000, 90000], dtype=torch.int32)
    idx = b.idx_mapping[:2]
    tree_bits = sc.trees.ancestor_bits()
    policy.observe_round(10.0)
    with assert_no_host_sync(host_tensors=[policy._wall_host]):
        policy.observe_round(10.02)
        active = policy.choose(sc.trees.scores, ctx)
        sc.state.store_trees_(idx, sc.trees.parents, sc.trees.depths, tree_bits, active)
        verify_inputs_(sc.state, b.positions, b.query_start_loc, b.cu_num_logits,
                       b.idx_mapping, b.num_tokens, b.num_tokens)
        verifier.walk(drawn, b)
    assert float(policy.base_seconds) >= 0
    assert int(TREE_MASK_STATE.active_query_lens[0]) == 1 + int(active)


def clock(run):
    """A ``time_fn`` for CPU: one call (the Triton interpreter), wall seconds."""
    import time

    start = time.perf_counter()
    run()
    return max(time.perf_counter() - start, 1e-9)


def fake_vllm_config(use_mla: bool, max_model_len: int = 40, eager: bool = True):
    hf = NS(kv_lora_rank=16, qk_rope_head_dim=16)
    return NS(
        model_config=NS(
            hf_text_config=hf, dtype=torch.float32, max_model_len=max_model_len,
            use_mla=use_mla, enforce_eager=eager,
            get_num_attention_heads=lambda p: 4 // p.tensor_parallel_size,
            get_num_kv_heads=lambda p: 1, get_head_size=lambda: 16,
            get_num_layers=lambda p: 3),
        parallel_config=NS(tensor_parallel_size=2),
        compilation_config=NS(cudagraph_mode=None),
    )


@pytest.mark.parametrize("use_mla", [True, False])
def test_target_timers_run_the_tree_kernels_with_active_rows(use_mla):
    """The start-up timers call the real tree kernels (Triton interpreter on CPU) with
    the target's per-GPU shapes and 1 + b active rows of 1 + B."""
    from vllm_ddtree.budget.attention_timing import target_attention_timer

    config = fake_vllm_config(use_mla)
    seen = []

    def time_fn(run):
        seen.append(run())
        return clock(lambda: None)

    measure = target_attention_timer(config, 1 + 4, torch.device("cpu"), time_fn=time_fn)
    assert measure(24, 1 + 2) > 0
    out = seen[-1][0] if use_mla else seen[-1]
    assert out.shape == (5, 2, 16)  # 1 + B rows, 4 heads / TP 2, 16 dims
    assert out[3:].eq(0).all() and not out[:3].eq(0).all()  # rows past 1 + b skipped


def test_policy_from_vllm_config_logs_the_measured_table(monkeypatch):
    import logging

    import vllm.distributed.parallel_state as parallel_state

    from vllm_ddtree.budget import policy as budget_policy

    monkeypatch.setattr(parallel_state, "get_tp_group", lambda: NS(ranks=[0, 1]))

    calls, records = [], []

    def fake(ctx, q):
        calls.append((ctx, q))
        return 1e-6 * q * ctx

    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    log = budget_policy.logger
    saved_level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        policy = BudgetPolicy.from_vllm_config(fake_vllm_config(True, 20000), 16, "cpu",
                                               measure_fn=fake)
    finally:
        log.removeHandler(handler)
        log.setLevel(saved_level)
    assert policy.num_layers == 3 and policy.budgets.tolist() == [1, 2, 4, 8, 16]
    assert sorted({c for c, _ in calls}) == [1024, 4096, 16384, 20000]
    text = "\n".join(r.getMessage() for r in records)
    assert "auto budget" in text and "b=   16" in text and "20000" in text
    assert log.name.startswith("vllm.")  # reaches vLLM's handler


def test_policy_at_tp2_takes_the_first_ranks_budget(monkeypatch):
    """Each rank times its own table and wall clock; the ranks' walks must agree, so
    every rank takes the budget of the group's first rank (an NCCL broadcast)."""
    import vllm.distributed.parallel_state as parallel_state

    group = NS(ranks=[4, 5], device_group="tp-group")
    monkeypatch.setattr(parallel_state, "get_tp_group", lambda: group)
    sent = []

    def broadcast(tensor, src, group):
        sent.append((src, group))
        tensor.fill_(2)  # what rank 4 chose

    monkeypatch.setattr(torch.distributed, "broadcast", broadcast)
    policy = BudgetPolicy.from_vllm_config(fake_vllm_config(True, 20000), 16, "cpu",
                                           measure_fn=lambda ctx, q: 1e-9 * q * ctx)
    assert policy.tp_group is group
    scores = torch.full((1, 16), -0.01)  # a confident drafter: alone it picks b = 16
    assert int(BudgetPolicy(policy.table, 3).choose(scores, torch.tensor([1000]))) == 16
    assert int(policy.choose(scores, torch.tensor([1000]))) == 2
    assert sent == [(4, "tp-group")]


def test_in_graph_choice_reads_the_target_seq_lens_and_skips_the_profile_run():
    """``auto``'s choice in the graph: the drafter step chooses from the target's
    ``seq_lens`` buffer; vLLM's profile run drafts before ``set_attn`` hands that buffer
    over (reading it there fails), so that step stores full trees and chooses
    nothing."""
    from test_ddtree_integration_units import fake_speculator, feed_drafter_step

    spec = fake_speculator(adaptive_state())
    spec.adaptive = spec.store_trees_in_graph = True
    spec.batch_scores = torch.zeros(6, BUDGET)
    num_reqs, block = 2, DEPTHS + 1
    hidden = torch.randn(num_reqs * block, VOCAB)
    feed_drafter_step(spec, hidden, num_reqs)
    spec.sample_idx_mapping = torch.tensor([4] * DEPTHS + [1] * DEPTHS, dtype=torch.int32)
    chosen = torch.tensor([5])
    calls, stored = [], []
    spec.budget_policy = NS(choose_in_graph=lambda scores, lens, rows, stride: (
        calls.append((scores.clone(), lens.clone(), rows, stride)) or chosen))
    spec._store_trees_in_step = lambda n, active=None: stored.append((n, active))

    assert not hasattr(spec, "target_input_buffers")  # the profile run
    spec._generate_draft(num_reqs, num_reqs * block, None, None, None)
    assert calls == [] and stored == [(num_reqs, None)]

    spec.target_input_buffers = NS(seq_lens=torch.tensor([900, 70000, 0, 0],
                                                         dtype=torch.int32))
    spec._generate_draft(num_reqs, num_reqs * block, None, None, None)
    scores, lens, rows, stride = calls[0]
    assert lens.tolist() == [900, 70000] and stride == DEPTHS
    assert rows is spec.sample_idx_mapping
    assert torch.equal(scores, spec.batch_scores[:num_reqs])
    assert stored[1] == (num_reqs, chosen)


def test_cuda_time_fn_keeps_the_least_group(monkeypatch):
    """``cuda_time_fn(groups=3)``: the least mean of three timed groups (a burst of
    another process's kernels slows one group), the warm-up only before the first."""
    from vllm_ddtree.budget import attention_timing

    calls, means = [], iter([7.2e-3, 3.1e-3, 3.3e-3])

    def fake(run, warmup, iters):
        calls.append((warmup, iters))
        return next(means)

    monkeypatch.setattr(attention_timing, "_time_cuda", fake)
    assert attention_timing.cuda_time_fn(iters=3, groups=3)(lambda: None) == 3.1e-3
    assert calls == [(2, 3), (0, 3), (0, 3)]
