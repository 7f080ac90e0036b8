"""The reference engine is lossless: DFlash and DDTree give AR's tokens, fp32, CPU."""

import pytest
import torch
from oracle import OracleDrafter
from tiny_models import drafter_config, tiny_drafter, tiny_target

from vllm_ddtree.reference import generate
from vllm_ddtree.reference.drafter import DFlashAttention

PROMPT = [5, 17, 33, 2, 60, 41, 9, 12, 77, 3, 28, 50]
KINDS = ["qwen3", "deepseek_v3"]


@pytest.fixture(scope="module", params=[(k, s) for k in KINDS for s in (0, 1)],
                ids=lambda p: f"{p[0]}-seed{p[1]}")
def pair(request):
    kind, seed = request.param
    target = tiny_target(kind, seed=seed)
    return target, tiny_drafter(target, seed=seed)


def oracle_for(target, truth, ranks, **kwargs):
    torch.manual_seed(7)
    config = drafter_config(target.config, **kwargs)
    return OracleDrafter(config).eval().set_oracle(truth, ranks)


@pytest.mark.parametrize("budget", [1, 8, 64, 200])
def test_ddtree_and_dflash_equal_ar_greedy(pair, budget):
    target, drafter = pair
    ar = generate(target, None, PROMPT, 32, "ar")
    tree = generate(target, drafter, PROMPT, 32, "ddtree", budget=budget)
    assert tree.tokens == ar.tokens
    assert len(ar.tokens) == 32
    if budget == 1:
        chain = generate(target, drafter, PROMPT, 32, "dflash")
        assert chain.tokens == ar.tokens


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sampling_t1_equals_ar(pair, seed):
    target, drafter = pair
    ar = generate(target, None, PROMPT, 24, "ar", temperature=1.0, seed=seed)
    greedy = generate(target, None, PROMPT, 24, "ar")
    assert ar.tokens != greedy.tokens  # T=1 really samples
    for method, budget in [("ddtree", 16), ("ddtree", 64), ("dflash", 1)]:
        out = generate(target, drafter, PROMPT, 24, method, budget=budget, temperature=1.0,
                       seed=seed)
        assert out.tokens == ar.tokens, (method, budget)


@pytest.mark.parametrize("kind", KINDS)
def test_deep_acceptance_with_oracle(kind):
    target = tiny_target(kind)
    ar = generate(target, None, PROMPT, 40, "ar")
    truth = PROMPT + ar.tokens
    # The true token is the drafter's favourite except at depth 2 (rank 1): the
    # chain stops at depth 1, a tree with siblings goes on to depth 7.
    ranks = [0, 1, 0, 0, 0, 0, 0]
    oracle = oracle_for(target, truth, ranks)
    chain = generate(target, oracle, PROMPT, 40, "dflash")
    tree = generate(target, oracle, PROMPT, 40, "ddtree", budget=32)
    assert chain.tokens == ar.tokens and tree.tokens == ar.tokens
    assert all(s.accepted_depth == 1 for s in chain.stats[:-1])
    assert all(s.accepted_depth == 7 for s in tree.stats[:-1])
    assert all(s.committed == s.accepted_depth + 1 for s in chain.stats + tree.stats)
    full = oracle_for(target, truth, [0] * 7)
    perfect = generate(target, full, PROMPT, 40, "dflash")
    assert perfect.tokens == ar.tokens and perfect.rounds == 5  # 8 tokens per round


@pytest.mark.parametrize("kind", KINDS)
def test_deep_acceptance_sampling_with_oracle(kind):
    target = tiny_target(kind)
    ar = generate(target, None, PROMPT, 30, "ar", temperature=1.0, seed=11)
    oracle = oracle_for(target, PROMPT + ar.tokens, [0, 0, 1, 0, 2, 0, 0])
    tree = generate(target, oracle, PROMPT, 30, "ddtree", budget=64, temperature=1.0, seed=11)
    assert tree.tokens == ar.tokens
    assert max(s.accepted_depth for s in tree.stats) == 7


@pytest.mark.parametrize("method", ["dflash", "ddtree"])
def test_eos_and_max_tokens_inside_accepted_path(method):
    target = tiny_target("qwen3")
    ar = generate(target, None, PROMPT, 40, "ar")
    oracle = oracle_for(target, PROMPT + ar.tokens, [0] * 7)
    # First output token is the prefill's; rounds then commit 8 tokens each, so
    # index 11 lies in the middle of round 2's accepted path.
    k = next(i for i in range(11, 40) if ar.tokens[i] not in ar.tokens[:i])
    stop = generate(target, oracle, PROMPT, 40, method, budget=16, eos_token_id=ar.tokens[k])
    assert stop.tokens == ar.tokens[: k + 1]
    assert stop.stats[-1].accepted_depth == 7  # the round went on past the stop
    short = generate(target, oracle, PROMPT, 13, method, budget=16)
    assert short.tokens == ar.tokens[:13]


def test_context_kv_computed_once_per_committed_token(monkeypatch):
    target = tiny_target("deepseek_v3")
    drafter = tiny_drafter(target)
    rows = []
    original = DFlashAttention.project_kv

    def counting(self, hidden, positions, rotary):
        rows.append(hidden.shape[0])
        return original(self, hidden, positions, rotary)

    monkeypatch.setattr(DFlashAttention, "project_kv", counting)
    out = generate(target, drafter, PROMPT, 30, "ddtree", budget=32)
    layers = len(drafter.layers)
    block_rows = layers * drafter.block_size * out.rounds
    context_rows = (sum(rows) - block_rows) // layers
    assert context_rows == len(PROMPT) + sum(s.committed for s in out.stats)


def test_target_cache_after_compaction_matches_fresh_prefill():
    from vllm_ddtree.reference.target import TargetRunner
    from vllm_ddtree.tree.draft_tree import build_ddtree

    target = tiny_target("deepseek_v3")
    runner = TargetRunner(target)
    prompt = torch.tensor(PROMPT)
    runner.forward(prompt, torch.arange(len(PROMPT)), None)
    tree = build_ddtree(torch.randn(1, 5, target.config.vocab_size), budget=12)
    node = int(tree.depths[0].argmax())  # deepest node; its path is the accepted one
    path = [node]
    while tree.parents[0, path[-1]] >= 0:
        path.append(int(tree.parents[0, path[-1]]))
    path = path[::-1]
    bonus = 7
    ids = torch.cat([torch.tensor([bonus]), tree.tokens[0]])
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), tree.depths[0]])
    runner.forward(ids, len(PROMPT) + offsets, tree.ancestor_mask()[0])
    runner.keep_accepted(len(PROMPT), torch.tensor(path) + 1)
    committed = PROMPT + [bonus] + tree.tokens[0, path].tolist()
    fresh = TargetRunner(target)
    fresh.forward(torch.tensor(committed), torch.arange(len(committed)), None)
    assert runner.num_cached == len(committed)
    for got, want in zip(runner.cache.layers, fresh.cache.layers, strict=True):
        torch.testing.assert_close(got.keys, want.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.values, want.values, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("method", ["ddtree", "ar"])
def test_stop_callback_ends_after_the_round_that_reaches_it(method):
    """`stop` is asked once per round: generation ends at the first round whose output
    satisfies it, with every token up to there equal to AR's (a speculative round may
    overshoot; callers cut at their own stop condition)."""
    target = tiny_target("qwen3")
    ar = generate(target, None, PROMPT, 40, "ar")
    oracle = oracle_for(target, PROMPT + ar.tokens, [0] * 7)
    asked = []

    def stop(tokens):
        asked.append(len(tokens))
        return len(tokens) >= 12

    got = generate(target, oracle if method != "ar" else None, PROMPT, 40, method,
                   budget=16, stop=stop)
    assert got.tokens == ar.tokens[: len(got.tokens)]
    assert len(got.tokens) >= 12 and asked[-1] == len(got.tokens)
    if method == "ar":
        assert len(got.tokens) == 12
    else:  # rounds of 8 after the prefill's token: stops at 17
        assert len(got.tokens) == 17 and len(got.tokens) < 40
