"""``replay`` forces the reference engine along given greedy tokens: on the engine's own
output it reproduces ``generate``'s per-round counts exactly (fp32, CPU, embedded pair),
and on other tokens it counts what the trees accept on those tokens."""

import pytest

from vllm_ddtree.demo.reference_engine import humaneval_prompts, load_embedded_pair
from vllm_ddtree.reference import clip_rounds, compare_rounds, generate, replay

NEW_TOKENS = 24
RUNS = [("ddtree", 8), ("ddtree", 32), ("dflash", 1)]  # B=32 > L=15: wider than the block


@pytest.fixture(scope="module")
def pair():
    return load_embedded_pair()


@pytest.fixture(scope="module")
def prompts(pair):
    return [pair.tokenizer.encode(p) for p in humaneval_prompts(3)]


@pytest.fixture(scope="module")
def generated(pair, prompts):
    """``(method, budget, prompt index) -> GenerationResult``, greedy, computed once."""
    cache = {}

    def get(method, budget, i):
        key = (method, budget, i)
        if key not in cache:
            cache[key] = generate(
                pair.target, pair.drafter, prompts[i], NEW_TOKENS, method, budget=budget
            )
        return cache[key]

    return get


@pytest.mark.parametrize(("method", "budget"), RUNS, ids=[f"{m}-B{b}" for m, b in RUNS])
def test_replay_of_own_output_equals_generate_rounds(pair, prompts, generated, method, budget):
    clipped_any = False
    for i, prompt in enumerate(prompts):
        out = generated(method, budget, i)
        want = clip_rounds([s.committed for s in out.stats], len(out.tokens))
        clipped_any |= want != [s.committed for s in out.stats]
        got = replay(pair.target, pair.drafter, prompt, out.tokens, method, budget=budget)
        assert got == want, (method, budget, i)
        assert sum(got) == len(out.tokens) - 1
        assert compare_rounds(got, want) == (len(want), None)
    if method == "ddtree":
        assert out.mean_committed > 1.5  # the trained drafter: trees accepted beyond the root
    print(f"{method} B={budget}: last round clipped in some run: {clipped_any}")


def test_replay_follows_the_given_tokens_not_the_target(pair, prompts, generated):
    """A token inside an accepted path replaced by another: the rounds before are
    unchanged, the round that holds it stops just before it."""
    out = generated("ddtree", 32, 0)
    rounds = [s.committed for s in out.stats]
    assert replay(pair.target, pair.drafter, prompts[0], out.tokens, budget=32) == rounds
    r = next(r for r, n in enumerate(rounds) if n >= 3)
    start = 1 + sum(rounds[:r])  # index in out.tokens of round r's first committed token
    k = start + 1  # the depth-2 node of round r's accepted path
    tokens = list(out.tokens)
    tokens[k] = (tokens[k] + 1) % pair.target.config.vocab_size
    got = replay(pair.target, pair.drafter, prompts[0], tokens, budget=32)
    assert got[:r] == rounds[:r]
    assert got[r] == 2  # depth 1 accepted, depth 2 is not the given token
    assert sum(got) == len(tokens) - 1
    same, first = compare_rounds(got, rounds)
    assert first == r and same < len(rounds)


def test_replay_short_outputs_and_validation(pair, prompts):
    assert replay(pair.target, pair.drafter, prompts[0], []) == []
    assert replay(pair.target, pair.drafter, prompts[0], [7]) == []
    # One token after the root: a single round committing 1 (clipped to what is left).
    assert replay(pair.target, pair.drafter, prompts[0], [7, 9], budget=8) == [1]
    with pytest.raises(ValueError, match="speculative"):
        replay(pair.target, pair.drafter, prompts[0], [7, 9], "ar")
    with pytest.raises(ValueError, match="drafter"):
        replay(pair.target, None, prompts[0], [7, 9])


def test_clip_and_compare_rounds():
    assert clip_rounds([3, 4, 5], 9) == [3, 4, 1]  # 8 committed by rounds
    assert clip_rounds([3, 4, 5], 8) == [3, 4]
    assert clip_rounds([3, 4, 5, 2], 13) == [3, 4, 5]  # a round past the end is dropped
    assert clip_rounds([3, 4], 20) == [3, 4]  # rounds missing: unchanged
    assert clip_rounds([3], 1) == [] and clip_rounds([3], 0) == []
    assert compare_rounds([2, 3, 1], [2, 3, 1]) == (3, None)
    # differ at round 1; rounds realign at token 5, where both commit 1
    assert compare_rounds([2, 3, 1], [2, 1, 2, 1]) == (2, 1)
    assert compare_rounds([2, 3], [2, 3, 1]) == (2, 2)
