"""The bf16 tie allowance of vllm_ddtree.testing.compare: measured noise, not a constant."""

import pytest

from vllm_ddtree.testing.compare import (
    MAX_GAP_NOISE,
    NOISE_FACTOR,
    TIE_GAP,
    gap_noise,
    mismatch_problems,
    non_full_verify_steps,
    tie_gap_for,
)


def out(tokens, gaps):
    return {"tokens": tokens, "top2_gap": gaps}


def test_gap_noise_counts_only_matched_positions():
    got = [out([1, 2, 3, 4], [0.50, 0.30, 0.90, 5.0]), out([7, 8], [1.0, 1.0])]
    want = [out([1, 2, 9, 4], [0.52, 0.25, 0.10, 0.0]), out([7, 8], [1.01, float("inf")])]
    # request 0 matches up to position 2 (|0.30 - 0.25| = 0.05); later positions and
    # infinite gaps are ignored
    assert gap_noise(got, want) == pytest.approx(0.05)
    assert tie_gap_for(got, want) == (pytest.approx(max(TIE_GAP, NOISE_FACTOR * 0.05)),
                                      pytest.approx(0.05))


def test_measured_noise_widens_the_tie_gap_and_flags_large_noise():
    # a flip at reference gap 0.094 with 0.06 of observed noise on matched positions
    want = [out([1, 2, 3], [0.70, 0.40, 0.094]), out([5, 6], [0.3, 0.3])]
    got = [out([1, 2, 9], [0.76, 0.40, 0.20]), out([5, 6], [0.3, 0.3])]
    tie_gap, noise = tie_gap_for(got, want)
    assert noise == pytest.approx(0.06) and tie_gap == pytest.approx(NOISE_FACTOR * 0.06)
    assert mismatch_problems(got, want) == []
    # the same flip with runs that agree to 1e-3 elsewhere is not a tie
    got[0]["top2_gap"][0] = 0.701
    problems = mismatch_problems(got, want)
    assert len(problems) == 1 and "pos 2" in problems[0]
    # runs whose gaps disagree by more than rounding are a failure even without flips
    noisy = [out([1, 2, 3], [0.70 + 2 * MAX_GAP_NOISE, 0.40, 0.094]), want[1]]
    assert any("more than bf16" in p for p in mismatch_problems(noisy, want))
    # an explicit tie gap keeps the old fixed rule
    assert len(mismatch_problems(got, want, tie_gap=TIE_GAP)) == 1


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
