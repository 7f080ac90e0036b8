"""The tie rule of vllm_ddtree.testing.compare: a fixed bf16 gap, first divergences
only, at most half of the tie positions met may flip, nothing excused in fp32."""

import math

import pytest

from vllm_ddtree.testing.compare import (
    MAX_FLIP_SHARE,
    MAX_LOGIT,
    TIE_GAP,
    eager_graphable_steps,
    max_excused,
    mismatch_problem,
    mismatch_problems,
    non_full_verify_steps,
    tie_gap_of,
    tie_positions,
    top2_gaps,
)


def out(tokens, gaps):
    return {"tokens": tokens, "top2_gap": gaps}


def test_tie_gap_is_two_bf16_steps_below_the_logit_bound():
    """Derived independently: bf16 values in [16, 32) are multiples of 2**(4 - 7);
    a flip between two runs may span one rounding step of each."""
    assert MAX_LOGIT == 32.0
    step = 2.0 ** (4 - 7)
    assert TIE_GAP == 2 * step == 0.25
    assert tie_gap_of("bfloat16") == TIE_GAP == tie_gap_of("torch.bfloat16")
    assert tie_gap_of("float16") == 2 * 2.0 ** (4 - 10)
    assert tie_gap_of("float32") == 0.0 == tie_gap_of("fp32")
    with pytest.raises(ValueError, match="dtype='int8' is not allowed"):
        tie_gap_of("int8")
    # an fp8 cache widens bf16's gap only; fp32 excuses nothing on any cache
    assert tie_gap_of("bfloat16", "fp8") == 0.5 == tie_gap_of("bf16", "fp8_e4m3")
    assert tie_gap_of("bfloat16", "auto") == TIE_GAP == tie_gap_of("bfloat16", "bfloat16")
    assert tie_gap_of("float32", "fp8") == 0.0
    with pytest.raises(ValueError, match="dtype='float16' on an fp8 cache is not measured"):
        tie_gap_of("float16", "fp8")


def test_the_gap_bar_does_not_move_with_the_runs_judged():
    """The same flip is judged the same whatever the runs' gaps elsewhere (the old rule
    widened the bar to twice the gap disagreement at matched positions)."""
    want = [out([1, 2, 3], [0.70, 0.40, 0.30])] + [out([5, 6], [1.0, 1.0])] * 3
    for noise in (0.0, 0.2, 0.5):
        got = [out([1, 2, 9], [0.70 + noise, 0.40 - noise, 0.1])] + want[1:]
        problems = mismatch_problems(got, want)
        assert len(problems) == 1 and "pos 2" in problems[0]
    at_bar = [out([1, 2, 3], [0.70, 0.40, TIE_GAP])] + want[1:]
    assert mismatch_problems([out([1, 2, 9], [0.7, 0.4, 0.0])] + want[1:], at_bar) == []


def test_only_the_first_divergence_is_excused():
    gaps = [1.0, 0.05, 0.05, 0.05]
    assert mismatch_problem([1, 9, 9, 9], [1, 2, 3, 4], gaps) is None
    # a second tie later in the same output is never looked at: after the first
    # divergence nothing is compared, and a first divergence at a wide gap is a bug
    assert "pos 0" in mismatch_problem([9, 2, 3, 4], [1, 2, 3, 4], [1.0, 0.05, 0.05, 0.05])


@pytest.mark.parametrize("n", [1, 3, 4, 8, 20, 44])
def test_at_most_half_the_tie_positions_met_may_flip(n):
    """Each output meets one tie (position 1, gap 0.1) and none elsewhere: the cap is
    half of the ties met up to each first divergence, whoever parts there."""
    assert MAX_FLIP_SHARE == 0.5
    want = [out([1, 2, 3], [1.0, 0.1, 1.0]) for _ in range(n)]
    tied = out([1, 7, 8], [1.0, 0.1, 1.0])
    allowed = max_excused(n)
    assert allowed == math.ceil(n / 2)
    got = [tied] * allowed + want[allowed:]
    assert mismatch_problems(got, want) == []
    if allowed < n:
        got = [tied] * (allowed + 1) + want[allowed + 1:]
        problems = mismatch_problems(got, want)
        assert len(problems) == 1
        assert f"{allowed + 1} of {n} outputs part at a tie" in problems[0]
        assert f"among {n} tie positions met" in problems[0]


def test_tie_positions_count_only_up_to_the_first_divergence():
    """Ties after an output's first divergence are not opportunities: nothing after it
    is compared. Two outputs part at their only tie met (position 0); the ties behind
    it and a wide-gap output give no allowance."""
    want = [out([1, 2, 3, 4], [0.1, 0.1, 0.1, 0.1])] * 2 + [out([5, 6], [1.0, 1.0])] * 6
    got = [out([9, 2, 3, 4], [0.1] * 4)] * 2 + want[2:]
    assert tie_positions(want[0]["top2_gap"], 1, TIE_GAP) == 1
    problems = mismatch_problems(got, want)
    assert len(problems) == 1 and "2 of 8 outputs part at a tie" in problems[0]
    assert "among 2 tie positions met" in problems[0]
    # One of them parting later meets three ties: 4 met, 2 may flip.
    got[1] = out([1, 2, 9, 4], [0.1] * 4)
    assert mismatch_problems(got, want) == []
    assert tie_positions([0.1, 0.3, 0.2], 3, 0.0) == 0  # fp32: no tie at all


def test_fp32_excuses_nothing():
    want = [out([1, 2, 3], [1.0, 0.0, 1.0])] + [out([4], [1.0])] * 7
    got = [out([1, 9, 3], [1.0, 0.0, 1.0])] + want[1:]
    assert mismatch_problems(got, want) == []  # bf16: a tie (gap 0)
    problems = mismatch_problems(got, want, tie_gap_of("float32"))
    assert len(problems) == 1 and "pos 1" in problems[0]
    assert mismatch_problem([1, 9], [1, 2], [1.0, 0.0], tie_gap_of("float32")) is not None


def test_lengths_and_gaps_of_top_logprobs():
    assert "lengths differ" in mismatch_problem([1, 2], [1, 2, 3], [1.0] * 3)
    assert top2_gaps([{"a": -0.1, "b": -0.5}, {"a": -0.2}, None]) == pytest.approx(
        [0.4, float("inf"), float("inf")])


def test_sampled_mismatches_judged_by_the_perturbed_margin(monkeypatch):
    """The margin of the first flip decides; it is computed from one distribution
    (the reference's when it lists both tokens) at the drawn token's position."""
    from vllm_ddtree.testing import sampled_ties

    calls = []

    def fake_margin(x, y, value_x, value_y, seed, position, temperature):
        calls.append((x, y, value_x, value_y, seed, position, temperature))
        return value_x - value_y  # a noise-free stand-in for vLLM's Gumbel draw

    monkeypatch.setattr(sampled_ties, "gumbel_flip_margin", fake_margin)

    def out(tokens, top):
        return {"prompt": [0] * 10, "tokens": tokens, "seed": 7, "temperature": 0.8,
                "top_logprobs": top}

    ref = [out([1, 2, 3], [{"1": -0.1}, {"2": -1.00, "5": -1.05}, {"3": -0.2}]),
           out([4, 4], [{"4": -0.1}, {"4": -0.1}]),
           out([6, 6], [{"6": -0.1}, {"6": -0.1}])]
    got = [out([1, 5, 9], [{"1": -0.1}, {"5": -1.04}, {"9": -0.3}]),   # tie: 0.05
           out([4, 4], [{"4": -0.1}, {"4": -0.1}]),                      # equal
           out([6, 8], [{"6": -0.1}, {"8": -2.0}])]                      # no tie
    problems = sampled_ties.sampled_mismatch_problems(got, ref, tie_gap=0.07)
    assert len(problems) == 1 and problems[0].startswith("prompt 2: pos 1")
    # prompt 0 used the reference's two values, position len(prompt) + 1 - 1
    assert calls[0] == (2, 5, -1.00, -1.05, 7, 10, 0.8)
    # prompt 2: x from the reference, y from ours (neither lists both)
    assert calls[1][2:4] == (-0.1, -2.0)
    short = [out([1, 2], ref[0]["top_logprobs"][:2])] + ref[1:]
    assert "lengths differ" in sampled_ties.sampled_mismatch_problems(short, ref, 0.07)[0]
    # plain decoding itself parts on prompt 1 at a margin of 1.0 (its own run listing
    # both tokens): prompt 2's flip (margin 1.9) is wider than that spread, still a problem
    calls.clear()
    narrow = [ref[0], out([4, 3], [{"4": -0.1}, {"4": -0.1, "3": -1.1}]), ref[2]]
    assert sampled_ties.sampled_mismatch_problems(got, ref, 0.07, [narrow])[0].startswith(
        "prompt 2: pos 1")
    # a witness parting on prompt 1 at a margin of 2.5: one flip within the spread is
    # excused; never in fp32; a witness without logprobs of its token widens nothing
    wide = [ref[0], out([4, 3], [{"4": -0.1}, {"4": -0.1, "3": -2.6}]), ref[2]]
    assert sampled_ties.sampled_mismatch_problems(got, ref, 0.07, [wide]) == []
    assert sampled_ties.sampled_mismatch_problems(got, ref, 0.0, [wide])[0].startswith(
        "prompt 0: pos 1")
    blind = [ref[0], out([4, 3], [{"4": -0.1}, {"4": -0.1}]), ref[2]]
    assert sampled_ties.sampled_mismatch_problems(got, ref, 0.07, [blind])[0].startswith(
        "prompt 2: pos 1")
    # two flips past the gap where plain decoding itself parts on one output: at most
    # one may be excused, so both are reported
    two = [out([4, 5], [{"4": -0.1}, {"5": -2.0}]), out([6, 5], [{"6": -0.1}, {"5": -2.0}])]
    problems = sampled_ties.sampled_mismatch_problems(two, ref[1:], 0.07, [[wide[1], ref[2]]])
    assert len(problems) == 2 and all("parts on 1 outputs" in p for p in problems)
    # a witness that stops where another parts (a length, not a flip) is skipped
    stops = [ref[0], out([4], ref[1]["top_logprobs"][:1]), ref[2]]
    assert sampled_ties.sampled_mismatch_problems(got, ref, 0.07, [stops, wide]) == []
    # our drawn token without a log-prob in either run: reported, never excused as 0
    unlisted = [got[0], ref[1], out([6, 8], [{"6": -0.1}, {"6": -0.1}])]
    problems = sampled_ties.sampled_mismatch_problems(unlisted, ref, 0.07, [wide])
    assert len(problems) == 1 and "neither run lists a log-prob of 8" in problems[0]


def test_tokens_past_a_stop_string_are_not_a_mismatch():
    """vLLM keeps a multi-token step's tokens after a stop string in ``token_ids`` (it
    cuts only the text); plain decoding stops at it. E.g. DDTree committed "\\n" and one
    more token in the step that completed "\\n\\n"."""
    from vllm_ddtree.testing.compare import mismatch_problems, past_stop_string

    ref = {"tokens": [5, 200, 200], "text": "ab", "stop_reason": "\n\n",
           "top2_gap": [1.0, 1.0, 1.0]}
    longer = {"tokens": [5, 200, 200, 4], "text": "ab", "stop_reason": "\n\n",
              "top2_gap": [1.0, 1.0, 1.0, 0.4]}
    assert past_stop_string(longer, ref) and past_stop_string(ref, longer)
    assert mismatch_problems([longer], [ref], tie_gap=0.07) == []
    # Not explained: another text, no stop string, or tokens that differ before the end.
    for bad in ({**longer, "text": "abc"}, {**longer, "stop_reason": None},
                {**longer, "tokens": [5, 201, 200, 4]}):
        assert not past_stop_string(bad, {**ref, "stop_reason": bad["stop_reason"]})
    assert mismatch_problems([{**longer, "text": "abc"}], [ref], tie_gap=0.07)
    no_stop = [{**longer, "stop_reason": None}], [{**ref, "stop_reason": None}]
    assert "lengths differ" in mismatch_problems(*no_stop, tie_gap=0.07)[0]


def test_non_full_verify_steps_flags_uniform_steps_without_a_full_graph():
    full9 = {"num_reqs": 1, "num_tokens": 9, "uniform_token_count": 9, "mode": "FULL"}
    piecewise5 = {"num_reqs": 2, "num_tokens": 10, "uniform_token_count": 5,
                  "mode": "PIECEWISE"}
    prefill = {"num_reqs": 3, "num_tokens": 70, "uniform_token_count": None,
               "mode": "PIECEWISE"}
    single = {"num_reqs": 4, "num_tokens": 4, "uniform_token_count": 1, "mode": "NONE"}
    lone_prefill = {"num_reqs": 1, "num_tokens": 24, "uniform_token_count": 24,
                    "mode": "PIECEWISE"}
    shapes = [2, 3, 5, 9, 17, 33]
    assert non_full_verify_steps([full9, prefill, single, lone_prefill], shapes) == []
    assert non_full_verify_steps([full9, piecewise5, prefill], shapes) == [piecewise5]
    assert non_full_verify_steps([full9, piecewise5], [33]) == []


def test_eager_graphable_steps_flags_eager_batches_that_a_mixed_graph_holds():
    """With a mixed (PIECEWISE) mode every token count up to the largest capture size
    has a graph: an eager step there is a lookup hole; a larger prefill, or an engine
    without a mixed mode, runs eagerly by design."""
    eager65 = {"num_reqs": 2, "num_tokens": 65, "uniform_token_count": None, "mode": "NONE"}
    eager_long = {"num_reqs": 1, "num_tokens": 900, "uniform_token_count": 900,
                  "mode": "NONE"}
    piecewise = {"num_reqs": 3, "num_tokens": 70, "uniform_token_count": None,
                 "mode": "PIECEWISE"}
    graphs = {"mode": "FULL_AND_PIECEWISE", "mixed_mode": "PIECEWISE",
              "max_capture_size": 512}
    steps = [eager65, eager_long, piecewise]
    assert eager_graphable_steps(steps, graphs) == [eager65]
    assert eager_graphable_steps(steps, {**graphs, "mixed_mode": "NONE"}) == []
    assert eager_graphable_steps(steps, None) == []
    assert eager_graphable_steps([eager65], graphs) == []  # no mixed graph ever replayed


def test_a_witness_excuses_only_within_the_references_own_spread():
    """Past the tie gap, divergences are excused only within the spread of runs of the
    reference itself (another batch shape, another vLLM backend on the same fp8 cache):
    no more outputs than those runs part on, none at a wider reference gap than the
    widest where they part; never a length, never in fp32; the cap still holds."""
    from vllm_ddtree.testing.compare import witness_spread

    want = [out([1, 2, 3, 4], [1.0, 0.31, 1.0, 1.0])] + [out([5, 6, 7], [1.0, 0.2, 1.0])] * 3
    got = [out([1, 9, 3, 4], [1.0] * 4)] + want[1:]
    assert "pos 1" in mismatch_problems(got, want)[0]  # 0.31 > TIE_GAP
    stable = list(want)
    assert witness_spread(want, [stable]) == (0, 0.0)
    assert "pos 1" in mismatch_problems(got, want, witnesses=[stable])[0]
    narrow = [want[0], out([5, 0, 7], [1.0] * 3)] + want[2:]  # parts at a 0.2 gap only
    assert witness_spread(want, [narrow]) == (1, 0.2)
    problems = mismatch_problems(got, want, witnesses=[narrow])
    assert len(problems) == 1 and "up to a gap of 0.200" in problems[0]
    # parts at a 1.0 gap: on the same output later, or on another output: where a flip
    # falls is the run's, not the prompt's
    late = [out([1, 2, 8, 4], [1.0] * 4)] + want[1:]
    other = [want[0], want[1], out([5, 6, 0], [1.0] * 3), want[3]]
    for witness in (late, other):
        assert witness_spread(want, [stable, witness]) == (1, 1.0)
        assert mismatch_problems(got, want, witnesses=[stable, witness]) == []
    assert witness_spread(want, [late, other]) == (2, 1.0)
    # a witness parting where the reference lists no gap counts, but widens nothing
    unknown = [want[0], out([5, 6, 7, 8], [1.0] * 4), out([5, 6, 0], [1.0] * 3), want[3]]
    want_unknown = [want[0], out([5, 6, 7, 9], [1.0, 1.0, 1.0]), want[2], want[3]]
    assert witness_spread(want_unknown, [unknown]) == (2, 1.0)
    assert witness_spread(want_unknown, [unknown[:2] + want_unknown[2:]]) == (1, 0.0)
    with pytest.raises(ValueError, match="a witness has 3 outputs, the reference 4"):
        witness_spread(want, [want[:3]])
    short = [out([1, 2, 3], [1.0] * 3)] + want[1:]  # stops early: a length, not a token
    assert "lengths differ" in mismatch_problems(short, want, witnesses=[late])[0]
    assert witness_spread(want, [short]) == (0, 0.0)  # nor does a witness's length count
    fp32 = mismatch_problems(got, want, tie_gap_of("float32"), witnesses=[late])
    assert len(fp32) == 1 and "pos 1" in fp32[0]
    # two outputs past the gap, the witnesses part on one: both are reported
    two = [got[0], out([5, 6, 0], [1.0] * 3)] + want[2:]
    want2 = [want[0], out([5, 6, 7], [1.0, 1.0, 0.5])] + want[2:]
    problems = mismatch_problems(two, want2, witnesses=[late])
    assert len(problems) == 2 and all("the witnesses part on 1 outputs" in p for p in problems)
    # the witnesses part on all 4 outputs at a 0.5 gap; ours on all 4 too: each is
    # within the spread, but the cap (half of the 4 opportunities) holds
    want4 = [out([1, 2, 3], [1.0, 0.5, 1.0])] * 4
    everywhere = [out([1, 9, 3], [1.0] * 3)] * 4
    shaky = [out([1, 8, 3], [1.0] * 3)] * 4
    problems = mismatch_problems(everywhere, want4, witnesses=[shaky])
    assert len(problems) == 1 and "4 of 4 outputs part at a tie" in problems[0]
    assert mismatch_problems(everywhere[:2] + want4[2:], want4, witnesses=[shaky]) == []


def test_a_flip_reports_the_compared_runs_own_gap():
    """Past the tie gap, a flip names the compared run's own top-2 gap there too (their
    sum bounds how far the two runs' logits of the two tokens moved apart); a run that
    recorded no gaps is reported without it."""
    want = [out([1, 2, 3], [1.0, 0.31, 1.0])]
    (problem,) = mismatch_problems([out([1, 9, 3], [1.0, 0.125, 1.0])], want)
    assert "reference top-2 gap 0.310" in problem and "its own top-2 gap 0.125" in problem
    (bare,) = mismatch_problems([{"tokens": [1, 9, 3]}], want)
    assert "its own" not in bare


def test_an_arbiter_clears_a_flip_only_where_the_exact_result_sides_with_the_run():
    """Past the tie gap, a flip on which the exact result (``arbiter``: the margin of the
    compared run's token over the reference's, shared prefix forced) prefers the
    compared run's token is the reference's error: no problem. Where it prefers the
    reference's, it stays a problem and says by how much; fp32 clears nothing."""
    want = [out([1, 2, 3], [1.0, 0.5, 1.0]), out([4, 5, 6], [1.0, 1.0, 2.0])]
    got = [out([1, 9, 3], [1.0] * 3), out([4, 5, 0], [1.0] * 3)]
    asked = []

    def sides_with(first_output):
        def arbiter(i, pos, got_token, want_token):
            asked.append((i, pos, got_token, want_token))
            return 0.2 if i == first_output else -0.7
        return arbiter

    problems = mismatch_problems(got, want, arbiter=sides_with(0))
    assert asked == [(0, 1, 9, 2), (1, 2, 0, 6)]
    assert len(problems) == 1 and problems[0].startswith("prompt 1: pos 2")
    assert "prefers the reference's by 0.700" in problems[0]
    assert len(mismatch_problems(got, want, arbiter=sides_with(1))) == 1
    assert len(mismatch_problems(got, want, tie_gap_of("float32"), arbiter=sides_with(0))) == 2
    # a tie is excused before the arbiter is asked; a length difference never is
    asked.clear()
    tie = [out([1, 2, 3], [1.0, 0.1, 1.0])]
    assert mismatch_problems([out([1, 9, 3], [1.0] * 3)], tie, arbiter=sides_with(0)) == []
    short = mismatch_problems([out([1, 2], [1.0] * 2)], tie, arbiter=sides_with(0))
    assert asked == [] and "lengths differ" in short[0]
