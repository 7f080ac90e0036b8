"""CPU tests of the oracle drafter used by the GPU oracle test
(``vllm_ddtree.testing.oracle``, ``evals/check_ddtree_oracle_vllm.py``): the logits
put the true continuation at the chosen ranks, trees built from them contain the true
path exactly as deep as predicted, and the engine hooks find the right positions."""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace as NS

import pytest
import torch
from test_ddtree_integration_units import (
    BUDGET,
    DEPTHS,
    fake_speculator,
    feed_drafter_step,
    make_scenario,
    new_state,
)

from vllm_ddtree.testing.oracle import (
    CONFIDENT_LOGIT,
    acceptance_summary,
    install_oracle,
    oracle_depth_logits,
    oracle_logits,
    oracle_true_tokens,
    parse_ranks,
    predicted_accepted_depth,
    request_index,
    true_path_depth,
)
from vllm_ddtree.tree.draft_tree import build_ddtree
from vllm_ddtree.verify.verifier import DDTreeVerifier
from vllm_ddtree.walk.follow import follow_tree

V, L = 4096, 15  # the embedded pair: vocabulary 4096, drafter block_size 16


def rank_of(row: torch.Tensor, token: int) -> int:
    """Rank of ``token`` in ``row`` (0 = largest), ties broken by token id as
    build_ddtree breaks them."""
    value = row[token]
    return int(((row > value) | ((row == value) & (torch.arange(len(row)) < token))).sum())


def test_parse_ranks():
    assert parse_ranks("0,0,0,1,2") == [0, 0, 0, 1, 2]
    assert parse_ranks("0*15") == [0] * 15
    assert parse_ranks("0*3, 1, r*2") == [0, 0, 0, 1, None, None]
    for bad in ("", "-1", "0*0", "a"):
        with pytest.raises(ValueError):
            parse_ranks(bad)


def test_request_index_reads_llm_generate_ids_only():
    assert request_index("0-1a2b3c4d") == 0
    assert request_index("17-deadbeef") == 17
    assert request_index("3") == 3  # VLLM_DISABLE_REQUEST_ID_RANDOMIZATION
    for other in ("_warmup_0_", "req_0_abcdef", "cmpl-abc-0", "", "x1-ab"):
        assert request_index(other) is None


def test_true_tokens_follow_absolute_positions():
    truth = [10, 11, 12, 13, 14]
    assert oracle_true_tokens(truth, [3, 4, 5, 6]) == [13, 14, None, None]


def test_depth_logits_rank_the_true_token_as_told():
    true = torch.randint(0, V, (L,), generator=torch.Generator().manual_seed(3)).tolist()
    ranks = [0, 0, 0, 1, 2, 5]
    logits = oracle_depth_logits(true, ranks, V, seed=1)
    assert logits.shape == (L, V) and logits.dtype == torch.float32
    for d, rank in enumerate(ranks):
        assert rank_of(logits[d], true[d]) == rank
        assert logits[d, true[d]] == CONFIDENT_LOGIT
        probs = logits[d].softmax(-1)
        assert float(probs.topk(rank + 1).values.sum()) > 0.95  # confident depth
    # past the ranks: noise only, the true token is nowhere special
    assert float(logits[len(ranks):].max()) < 4.0
    assert torch.equal(logits, oracle_depth_logits(true, ranks, V, seed=1))  # seeded
    assert not torch.equal(logits, oracle_depth_logits(true, ranks, V, seed=2))
    # unknown true tokens (past the truth) are noise too
    partial = oracle_depth_logits([true[0], None, true[2]], [0, 0, 0], V, seed=1)
    assert rank_of(partial[0], true[0]) == 0 and float(partial[1].max()) < 4.0


def test_oracle_logits_replace_only_known_rows():
    drafter = torch.randn(3, L, V, dtype=torch.bfloat16)
    true = list(range(100, 100 + L))
    out = oracle_logits(drafter, [true, None, true], [0, 1], seeds=[5, 0, 6])
    assert out.dtype == torch.float32 and out.shape == drafter.shape
    assert torch.equal(out[1], drafter[1].float())
    assert rank_of(out[0, 0], 100) == 0 and rank_of(out[2, 1], 101) == 1
    assert torch.equal(out[0, 0], oracle_depth_logits(true, [0, 1], V, 5)[0])
    with pytest.raises(ValueError):
        oracle_logits(drafter, [true], [0], seeds=[0])
    with pytest.raises(ValueError):
        oracle_logits(drafter, [true[:3], None, None], [0], seeds=[0, 0, 0])


@pytest.mark.parametrize(("ranks", "budget", "want"), [
    ("0,0,0,1,2", 32, 5),  # the GPU test's default: depth 5 fits in 32 nodes
    ("0,0,0,1,2", 8, 4),   # 8 nodes: the rank-2 token of depth 5 under the rank-1 node is cut
    ("0*15", 32, 15),      # the whole drafter block
    ("0*15", 8, 8),        # a chain as long as the budget
    ("0,0,r,0", 32, 2),    # noise at depth 3 stops the path
])
def test_trees_hold_the_true_path_to_the_predicted_depth(ranks, budget, want):
    assert predicted_accepted_depth(parse_ranks(ranks), budget, L, V) == [want] * 8


def test_verifier_walk_accepts_the_true_path():
    """build_ddtree + follow_tree (the verifier's walk) on a batch of oracle drafts:
    the target's tokens are the truth, so the accepted depth is the true path's."""
    gen = torch.Generator().manual_seed(0)
    ranks = parse_ranks("0,0,0,1,2")
    truths = [torch.randint(0, V, (L + 1,), generator=gen).tolist() for _ in range(3)]
    rows = [t[1:] for t in truths]  # depth d predicts truth[d]; truth[0] is the root
    logits = oracle_logits(torch.zeros(3, L, V), rows, ranks, seeds=[1, 2, 3])
    tree = build_ddtree(logits, 32)
    targets = torch.full((3, 33), -1, dtype=torch.int64)
    for r, truth in enumerate(truths):
        targets[r, 0] = truth[1]
        for i in range(32):  # a node on the true path is followed by the next true token
            path, node = [], i
            while node >= 0:
                path.append(int(tree.tokens[r, node]))
                node = int(tree.parents[r, node])
            path.reverse()
            if path == truth[1 : 1 + len(path)] and len(path) < L:
                targets[r, i + 1] = truth[1 + len(path)]
    walk = follow_tree(tree, targets, max_depth=L)
    assert walk.accepted_depth.tolist() == [5, 5, 5]
    for r in range(3):
        assert true_path_depth(tree.tokens[r].tolist(), tree.parents[r].tolist(), rows[r]) == 5
        assert walk.committed_tokens[r, :6].tolist() == truths[r][1:7]


def test_acceptance_summary_counts_rounds_before_the_first_mismatch():
    rounds = [{"prompt": 0, "root_pos": 10, "depth": 5}, {"prompt": 0, "root_pos": 16, "depth": 5},
              {"prompt": 0, "root_pos": 22, "depth": 0}, {"prompt": 1, "root_pos": 4, "depth": 2}]
    # prompt 0: 10 prompt tokens, first mismatch at output index 12 (position 22)
    summary = acceptance_summary(rounds, [10, 4], [12, None], min_depth=3)
    assert summary["rounds"] == 3 and summary["rounds_total"] == 4
    assert summary["mean_depth"] == pytest.approx(4.0)
    assert summary["frac_at_least_min_depth"] == pytest.approx(2 / 3)
    assert summary["histogram"] == {2: 1, 5: 2}
    assert acceptance_summary([], [1], [None])["rounds"] == 0


def test_install_oracle_drafts_the_truth_and_records_rounds(monkeypatch):
    """The three hooks on CPU stand-ins: propose captures the batch's request ids,
    the draft of a known request follows sample_pos into the truth, warm-up rows keep
    the drafter's logits, and the verifier records root position and depth."""
    from vllm_ddtree.draft import speculator as speculator_mod

    vocab = 64
    state = new_state()
    spec = fake_speculator(state)
    num_reqs, block = 2, DEPTHS + 1
    hidden = torch.randn(num_reqs * block, vocab)
    feed_drafter_step(spec, hidden, num_reqs)
    # row 0: bonus at position 7 -> depths predict 8..11; row 1 a warm-up request
    spec.sample_pos = torch.zeros(6 * DEPTHS, dtype=torch.int64)
    spec.sample_pos[:DEPTHS] = torch.arange(8, 8 + DEPTHS)
    truth = list(range(20, 40))

    def fake_propose(self, input_batch, attn_metadata=None, *args, dummy_run=False, **kwargs):
        self._generate_draft(input_batch.num_reqs, input_batch.num_reqs * block, None, None,
                             None)
        return self.draft_tokens[: input_batch.num_reqs]

    monkeypatch.setattr(speculator_mod.DDTreeSpeculator, "propose", fake_propose)
    record, uninstall = install_oracle([truth], [0] * DEPTHS)
    try:
        batch = NS(num_reqs=2, req_ids=["0-0123abcd", "_warmup_1_"])
        tokens = speculator_mod.DDTreeSpeculator.propose(spec, batch, None)
        chain = tokens[0, :DEPTHS].tolist()  # a confident chain comes first, in order
        assert chain == truth[8 : 8 + DEPTHS]
        assert spec.batch_depths[0, :DEPTHS].tolist() == list(range(1, DEPTHS + 1))
        plain = build_ddtree(hidden.view(num_reqs, block, vocab)[1:, 1:], BUDGET)
        assert torch.equal(tokens[1], plain.tokens[0])
        assert record.drafts == [[0, 7]] and record.oracle_rows == 1
        assert record.passthrough_rows == 1
        # dummy runs pass through
        speculator_mod.DDTreeSpeculator.propose(spec, batch, None, dummy_run=True)
        assert record.oracle_rows == 1 and record.passthrough_rows == 1

        sc = make_scenario(0.0)
        sc.batch.req_ids = ["0-0123abcd", "1-0123abcd", "2-0123abcd", "_warmup_3_"]
        verifier = DDTreeVerifier(sc.sampler, NS(num_speculative_tokens=BUDGET), "cpu",
                                  DEPTHS, state=sc.state, draw_fn=sc.sampler.draw_fn)
        out = verifier(sc.logits.clone(), sc.batch)
        # rows 0, 1 verified trees; row 2 is a prefill chunk (no drafts), row 3 unknown
        roots = [len(c) - 1 for c in sc.contexts]
        assert record.rounds == [
            {"prompt": q, "root_pos": roots[q], "depth": int(out.num_sampled[q]) - 1,
             "nodes": sc.num_drafts[q]} for q in range(2)]
        assert record.rounds_without_draft() == 2  # these roots had no oracle draft
        record.drafts += [[0, roots[0]], [1, roots[1]]]
        assert record.rounds_without_draft() == 0
    finally:
        uninstall()
    assert speculator_mod.DDTreeSpeculator.propose is fake_propose
    assert DDTreeVerifier.__call__.__name__ == "__call__"


FAKE_LLM_RUNNER = '''
import json, runpy, sys
from types import SimpleNamespace as NS
import vllm

truth_path, llm_path, script = sys.argv[1:4]
truth = json.load(open(truth_path))

class FakeLLM:
    """Returns the truth's tokens (one changed at index 5 of prompt 1)."""
    def __init__(self, **kwargs):
        json.dump({k: str(v) for k, v in kwargs.items()}, open(llm_path, "w"))
    def generate(self, prompts, params):
        outs = []
        for i, (prompt, sp) in enumerate(zip(prompts, params)):
            assert prompt["prompt_token_ids"] == truth["outputs"][i]["prompt"]
            toks = truth["outputs"][i]["tokens"][: sp.max_tokens]
            if i == 1:
                toks = toks[:5] + [toks[5] + 1] + toks[6:]
            lps = [{t: NS(logprob=-0.1), t + 1: NS(logprob=-2.0)} for t in toks]
            outs.append(NS(outputs=[NS(token_ids=toks, logprobs=lps, text="")]))
        return outs
    def get_metrics(self):
        return []

vllm.LLM = FakeLLM
sys.argv = [script, *sys.argv[4:]]
runpy.run_path(script, run_name="__main__")
'''


def run_oracle_script_with_fake_engine(tmp_path: Path, truth_run: dict,
                                       args: list[str]) -> tuple[dict, dict, str]:
    """Run evals/check_ddtree_oracle_vllm.py on ``truth_run`` (the AR JSON) with the
    fake ``LLM`` of ``FAKE_LLM_RUNNER``; returns (its output JSON, the LLM kwargs it
    passed, its stdout)."""
    root = Path(__file__).resolve().parents[1]
    truth = tmp_path / "ar.json"
    truth.write_text(json.dumps(truth_run))
    runner = tmp_path / "runner.py"
    runner.write_text(FAKE_LLM_RUNNER)
    env = {**os.environ, "PYTHONPATH": f"{root / 'evals'}:{root}:" +
           os.environ.get("PYTHONPATH", "")}
    out = tmp_path / "out.json"
    script = root / "evals" / "check_ddtree_oracle_vllm.py"
    proc = subprocess.run([sys.executable, str(runner), str(truth), str(tmp_path / "llm.json"),
                           str(script), "--truth", str(truth), "--out", str(out), *args],
                          check=True, env=env, timeout=300, capture_output=True, text=True)
    return (json.loads(out.read_text()), json.loads((tmp_path / "llm.json").read_text()),
            proc.stdout)


def test_oracle_eval_script_glue_with_a_fake_engine(tmp_path):
    """evals/check_ddtree_oracle_vllm.py end to end with vllm.LLM replaced (the engine
    needs a GPU): truth parsing, max_tokens = truth - extra, sampling params, first
    mismatches, output JSON."""
    outs = [{"prompt": [7 + i] * (5 + i), "tokens": list(range(100 * i, 100 * i + 56)),
             "top2_gap": [1.0] * 56, "temperature": 0.8 if i == 2 else 0.0,
             "seed": 1002 if i == 2 else None} for i in range(3)]
    got, llm, _ = run_oracle_script_with_fake_engine(
        tmp_path, {"mode": "ar", "extra_tokens": 16, "max_num_seqs": 4, "outputs": outs},
        ["--budget", "8", "--ranks", "0*3,1,2"])
    assert llm["max_num_seqs"] == "4" and llm["enforce_eager"] == "True"
    assert "'num_speculative_tokens': 8" in llm["speculative_config"]
    assert [len(o["tokens"]) for o in got["outputs"]] == [40, 40, 40]
    assert [o["first_mismatch"] for o in got["outputs"]] == [None, 5, None]
    assert [o["temperature"] for o in got["outputs"]] == [0.0, 0.0, 0.8]
    assert got["predicted_depths"] == [4] * 8 and got["num_depths"] == 15
    assert got["summary"]["rounds"] == 0 and got["oracle_rows"] == 0
