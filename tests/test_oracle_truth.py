"""How evals/check_ddtree_oracle_vllm.py sizes each request from its AR truth (CPU).

A complete AR run (``max_tokens`` + ``extra_tokens``) gives the oracle ``extra``
tokens of look-ahead; one that ended early (EOS or a stop string: every third
request of ``check_ddtree_vllm.py --mixed``) still runs and is compared on all its
tokens, and the rounds drafting past its end leave the depth statistics.
"""

import os
import sys
from pathlib import Path
from unittest import mock

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXTRA = 16
L = 15  # drafter depths


def import_eval(name: str):
    """``evals/<name>.py`` as a module. The eval scripts set
    VLLM_ENABLE_V1_MULTIPROCESSING on import (restored here) and import vLLM only
    inside ``main``."""
    import importlib

    sys.path.insert(0, str(ROOT / "evals"))
    try:
        with mock.patch.dict(os.environ):
            return importlib.import_module(name)
    finally:
        sys.path.remove(str(ROOT / "evals"))


@pytest.fixture(scope="module")
def oracle_script():
    return import_eval("check_ddtree_oracle_vllm")


def test_complete_truths_keep_their_look_ahead(oracle_script):
    max_tokens, early = oracle_script.plan_max_tokens([144, 80, 17], EXTRA, [128, 64, 1])
    assert max_tokens == [128, 64, 1] and early == {}
    # requested lengths unknown: every truth longer than extra is taken as complete
    assert oracle_script.plan_max_tokens([144, 17], EXTRA) == ([128, 1], {})


def test_truths_that_ended_early_are_run_in_full(oracle_script):
    # asked for 64 + 16 / 32 + 16 / 40 + 16: the first two stopped early
    max_tokens, early = oracle_script.plan_max_tokens([4, 30, 56], EXTRA, [64, 32, 40])
    assert max_tokens == [4, 30, 40]
    assert sorted(early) == [0, 1]
    assert "after 4 of 80 tokens" in early[0] and "after 30 of 48 tokens" in early[1]
    # without requested lengths only a truth no longer than its look-ahead is seen
    max_tokens, early = oracle_script.plan_max_tokens([4, 16, 30], EXTRA)
    assert max_tokens == [4, 16, 14] and sorted(early) == [0, 1]
    assert "after 4 tokens" in early[0]
    # no look-ahead asked for: nothing ends early by length alone
    assert oracle_script.plan_max_tokens([5], 0) == ([5], {})


@pytest.mark.parametrize(("lens", "extra", "requested", "match"), [
    ([0, 20], EXTRA, None, "empty truth"),
    ([90], EXTRA, [64], "more than the 80 asked for"),
    ([20, 20], EXTRA, [4], "1 requested lengths for 2 truths"),
    ([20], -1, None, "extra_tokens must be >= 0"),
])
def test_inconsistent_truths_are_refused(oracle_script, lens, extra, requested, match):
    with pytest.raises(ValueError, match=match):
        oracle_script.plan_max_tokens(lens, extra, requested)


def test_rounds_drafting_past_the_truth_are_left_out(oracle_script):
    # request 0: prompt 10 + 4 AR tokens (ended early) -> truth positions 0..13;
    # request 1: prompt 10 + 144 tokens, 128 generated
    ends = [14, 154]
    rounds = [{"prompt": 0, "root_pos": 10, "depth": 3},   # drafts 11..25: past 13
              {"prompt": 1, "root_pos": 10, "depth": 15},
              {"prompt": 1, "root_pos": 136, "depth": 15},  # the last root of 128 tokens
              {"prompt": 1, "root_pos": 138, "depth": 15},  # drafts 139..153: still inside
              {"prompt": 1, "root_pos": 139, "depth": 2}]   # drafts up to 154: past it
    kept = oracle_script.rounds_within_truth(rounds, ends, L)
    assert kept == rounds[1:4]
    # a complete truth (extra = L + 1) covers every round that commits output tokens
    # (a root at output index <= max_tokens - 2), not a step async scheduling runs
    # after a deep acceptance already reached max_tokens (root up to index n - 2 + L)
    prompt_len, n = 10, 128
    last = {"prompt": 0, "root_pos": prompt_len + n - 2, "depth": 0}
    late = {"prompt": 0, "root_pos": prompt_len + n - 2 + L, "depth": 0}
    got = oracle_script.rounds_within_truth([last, late], [prompt_len + n + EXTRA], L)
    assert got == [last]


def test_mixed_truth_with_early_stops_through_the_script(tmp_path):
    """check_ddtree_oracle_vllm.py end to end with vllm.LLM replaced (the fake engine
    of test_oracle_logits.py, which returns the truth's tokens with one changed at
    index 5 of prompt 1) on a --mixed truth whose requests 0 and 3 stopped early."""
    from test_oracle_logits import run_oracle_script_with_fake_engine

    asked = list(import_eval("check_ddtree_vllm").MIXED_MAX_TOKENS)
    assert len(asked) == 12
    lens = [n + EXTRA for n in asked]
    lens[0], lens[3] = 4, 20  # request 0 shorter than the look-ahead, 3 only stopped early
    outs = [{"prompt": [7 + i] * (5 + i), "tokens": list(range(100 * i, 100 * i + n)),
             "top2_gap": [1.0] * n, "temperature": 0.8 if i >= 8 else 0.0,
             "seed": 1000 + i if i >= 8 else None} for i, n in enumerate(lens)]
    got, _, stdout = run_oracle_script_with_fake_engine(
        tmp_path, {"mode": "ar", "mixed": True, "extra_tokens": EXTRA, "max_num_seqs": 4,
                   "outputs": outs}, ["--ranks", "0*15"])
    want = [4, *asked[1:3], 20, *asked[4:]]
    assert [o["max_tokens"] for o in got["outputs"]] == want
    assert [len(o["tokens"]) for o in got["outputs"]] == want
    assert [i for i, o in enumerate(got["outputs"]) if o["truth_ended_early"]] == [0, 3]
    assert [o["first_mismatch"] for o in got["outputs"]] == [None, 5] + [None] * 10
    for i in (0, 3):
        line = f"oracle truth of request {i}: AR run ended after {lens[i]} of {asked[i] + EXTRA}"
        assert line in stdout, stdout
    assert got["summary"]["rounds"] == 0 and got["summary"]["rounds_past_truth"] == 0
