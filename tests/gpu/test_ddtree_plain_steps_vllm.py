"""Plain decoding steps (b = 0) and ``num_speculative_tokens_per_batch_size`` with
``method: ddtree`` on the embedded pair (GPU).

The mixed batch of ``check_ddtree_vllm.py --mixed`` (12 requests of 16..3000 prompt
tokens, 8 running at a time, later ones arriving while others decode, the batch
draining to 1 at the end) runs with budgets that change with the batch and with plain
steps in between; its tokens must equal AR's: bf16 up to the fixed tie rule
(``vllm_ddtree.testing.compare``), fp32 token for token. The step plan is recorded
(``--record-steps``): the budget each step verified, and whether each propose drafted.
auto's forced plain steps in bf16 with CUDA graphs: ``test_ddtree_vllm.py::
test_ddtree_auto_cycled_verify_shapes_equal_ar``.
"""

import json

import pytest
from test_ddtree_vllm import (  # noqa: F401 - ar_mixed is a fixture
    ar_mixed,
    first_mismatches,
    pytestmark,
    run_mixed_vs_ar,
    run_script,
)

from vllm_ddtree.testing.compare import mismatch_problems, tie_gap_of

# Budget per batch size for B = 32: every range of the mixed batch's sizes (8 running,
# then draining) gets another budget, 0 (plain decoding) included.
SCHEDULE = [[1, 2, 32], [3, 4, 8], [5, 6, 0], [7, 8, 4]]


def schedule_lookup(schedule, max_num_seqs: int, budget: int) -> list[int]:
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    return build_dynamic_sd_schedule_lookup(schedule, max_num_seqs, budget)


def test_schedule_budget_follows_the_batch_size(ar_mixed, tmp_path):  # noqa: F811
    """``num_speculative_tokens_per_batch_size`` without auto, CUDA graphs: every step
    verifies the schedule's budget for its own batch size (vLLM's own lookup), or
    nothing right after a propose at a batch size whose budget is 0 (that propose ran
    no drafter pass); every propose drafts exactly where its batch size's budget is
    above 0. Each uniform step, plain ones included, replays a FULL graph of its
    ``1 + k`` rows. Tokens equal AR."""
    args = ["--mixed", "--budget", "32", "--graphs", "--schedule", json.dumps(SCHEDULE),
            "--record-steps"]
    lookup = schedule_lookup(SCHEDULE, 8, 32)
    lens = tuple(sorted({1 + k for k in lookup[1:]} | {33}))
    got = run_mixed_vs_ar(ar_mixed, args, tmp_path / "schedule.json", "batch schedule", lens)
    assert got["schedule"] == SCHEDULE
    steps, drafts = got["step_plan"]["steps"], got["step_plan"]["drafts"]
    wrong = [s for s in steps
             if s["shape"] != (lookup[s["num_reqs"]] if s["drafted_before"] else 0)]
    assert not wrong, f"steps off the schedule: {wrong[:5]}"
    wrong = [d for d in drafts if d["draft"] != (lookup[d["num_reqs"]] > 0)]
    assert not wrong, f"proposes off the schedule: {wrong[:5]}"
    uniform = [s for s in steps if s["uniform"]]
    by_size = {}
    for s in uniform:
        by_size.setdefault(s["num_reqs"], set()).add(s["shape"])
    print(f"schedule: {len(steps)} steps, {len(uniform)} uniform; budgets by batch size "
          f"{dict(sorted(by_size.items()))}")
    shapes = {s["shape"] for s in uniform}
    assert 0 in shapes and len(shapes) >= 3, f"budgets seen: {sorted(shapes)}"
    full = {d["uniform_token_count"] for d in got["verify_dispatches"] if d["mode"] == "FULL"}
    assert 1 in full, f"plain steps never replayed a FULL graph: {sorted(full)}"
    assert got["ddtree_mean_acceptance_length"] > 1.0


@pytest.fixture(scope="module")
def ar_mixed_fp32(tmp_path_factory):
    """AR in fp32 on the same runner and backend (CUSTOM), eager."""
    return run_script("check_ddtree_vllm.py", ["--mixed", "--method", "ar", "--dtype",
                                               "float32"],
                      tmp_path_factory.mktemp("ar32") / "ar.json")


def test_auto_with_plain_steps_fp32_equals_ar_token_for_token(ar_mixed_fp32, tmp_path):
    """The same in fp32 (eager), a tree of 32 nodes after every plain step: greedy and
    seeded tokens equal AR's exactly. The trees after plain steps accept as trees do
    without them (a drafter context with holes at the plain steps' positions would
    accept little): the plain steps' proposes wrote the drafter's context K/V."""
    got = run_script("check_ddtree_vllm.py",
                     ["--mixed", "--budget", "32", "--auto", "--verify-shape", "adaptive",
                      "--dtype", "float32", "--cycle-budgets", "0,32", "--record-steps"],
                     tmp_path / "plain32.json")
    firsts = first_mismatches(got, ar_mixed_fp32)
    print(f"fp32 auto 0,32: first mismatch per request {firsts}; mean acceptance length "
          f"{got['ddtree_mean_acceptance_length']:.3f}")
    # Exact (fp32 excuses no tie); only tokens a multi-token step committed past a stop
    # string, which vLLM keeps in token_ids, are not compared.
    problems = mismatch_problems(got["outputs"], ar_mixed_fp32["outputs"],
                                 tie_gap_of("float32"))
    assert not problems, "\n".join(problems)
    plain = [s for s in got["step_plan"]["steps"] if s["uniform"] and s["shape"] == 0]
    assert len(plain) >= 20
    # Eager B = 32 on this batch commits 1.93 tokens per tree (test_ddtree_vllm.py).
    assert got["ddtree_mean_acceptance_length"] > 1.5
