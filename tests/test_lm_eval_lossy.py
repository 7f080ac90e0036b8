"""``evals/validate.py`` catches a lossy verifier on the CPU reference engine: PASS with
the exact verifier, FAIL when 2 % of the rounds commit the drafter's token instead of
the target's (``--inject-lossy-rate 0.02``), on ``ddtree_target_agreement``.

Detection at 2 %: a 128-token continuation takes about 40 DDTree rounds of the embedded
pair, so a document is hit with probability 1 - 0.98**40 = 0.55 and loses its exact
match (1.0 for plain decoding in fp32); over the documents the expected difference is
about -0.55 against the 0.05 margin (6 documents: 4 hit with the fixed seed, -0.67).
The rounds hit are drawn from a fixed seed, so the outcome is deterministic.
"""

import sys

import pytest
from evals_scripts import load_evals_script

pytest.importorskip("lm_eval")

TASK = "ddtree_target_agreement"


@pytest.fixture(scope="module")
def ref_runs():
    """The pair, plain decoding's run and DDTree's runs at lossy rates 0 and 0.02 on the
    first 6 documents (one plain-decoding run for both)."""
    validate = load_evals_script("validate")
    from vllm_ddtree.evaluation.ref_lm import DDTreeRefLM, acceptance_summary, load_pair
    from vllm_ddtree.testing.lossy_verifier import lossy_reference

    pair = load_pair(None, None)
    limit, metadata = 6, {}
    base = validate.run_task(DDTreeRefLM(method="ar", pair=pair, threads=1), TASK, limit,
                             metadata, None, "ar")
    runs = {}
    for rate in (0.0, 0.02):
        lm = DDTreeRefLM(method="ddtree", budget=32, pair=pair, threads=1)
        with lossy_reference(rate, seed=0) as lossy:
            run = validate.run_task(lm, TASK, limit, metadata, None, f"ddtree lossy {rate}")
        run.acceptance = {**acceptance_summary(lm.records), "corrupted": lossy["corrupted"]}
        runs[rate] = run
    return validate, pair, base, runs


def test_validate_passes_the_exact_verifier_and_fails_a_lossy_one(ref_runs):
    """One plain-decoding run, then DDTree exact and DDTree with 2 % lossy rounds, judged
    by ``validate.compare`` (the verdict ``validate.py`` prints); ``validate.py
    --inject-lossy-rate`` runs the same wrapper (``_run_ref``)."""
    validate, _, base, runs = ref_runs
    limit = len(base.generations)
    reports = {rate: validate.compare(TASK, "ddtree-ref", base, run, {})
               for rate, run in runs.items()}
    exact, lossy = reports[0.0], reports[0.02]
    for report in (exact, lossy):
        assert report.verdict.metric == "exact_match" and report.verdict.docs == limit
    assert exact.verdict.baseline == 1.0, "the stored continuations are no longer the " \
        "target's: rebuild them (python evals/make_target_agreement.py)"
    assert exact.passed, exact.line()
    assert (exact.verdict.low, exact.verdict.high) == (0.0, 0.0) and exact.identical == limit
    assert not lossy.passed, lossy.line()
    assert lossy.speculative.acceptance["corrupted"] > 0
    assert lossy.verdict.mean_difference <= -0.3 and lossy.verdict.low < -lossy.verdict.margin
    text = validate.report_markdown(lossy, "pytest")
    assert "**FAIL**" in text and "Baseline exact_match: 1.0000" in text


def test_a_lossy_verifier_still_fails_with_bf16_ties_excused(ref_runs):
    """The tie rule with the bf16 gap (0.25 nats) on the same runs, plain decoding's
    log-probs from one prefill of its own generations (the target through Hugging Face
    standing in for vLLM's prompt log-probs): the exact verifier differs nowhere and
    PASSES; the lossy one commits the drafter's tokens mostly where the target is far
    from a tie, and FAILS with whatever the rule excuses."""
    HFPromptLogprobLLM = load_evals_script("hf_prompt_logprobs").HFPromptLogprobLLM

    from vllm_ddtree.testing.compare import tie_gap_of

    validate, pair, base, runs = ref_runs
    ties = sys.modules["lm_eval_ties"]  # the module validate judges with
    tok, tie_gap = pair.tokenizer, tie_gap_of("bfloat16")
    prompts = {d: tok.encode(c, add_special_tokens=False) for d, c in base.contexts.items()}
    base.reference = ties.reference_logprobs(HFPromptLogprobLLM(pair.target), tok, prompts,
                                             base.generations)
    assert sorted(base.reference) == sorted(base.generations)
    for ref in base.reference.values():  # fp32 greedy: every token is the prefill's best
        assert ref.misaligned(1e-4) is None
    reports = {}
    for rate, run in runs.items():
        run.ties = ties.tie_divergences(tok, base.generations, run.generations,
                                        base.reference, tie_gap)
        reports[rate] = validate.compare(TASK, "vllm", base, run, {"tie_gap": tie_gap})
    exact, lossy = reports[0.0], reports[0.02]
    assert exact.passed and exact.speculative.ties.divergences == []
    lossy_ties = lossy.speculative.ties
    assert lossy_ties.tie_positions > 0 and lossy_ties.cap >= 1
    assert len(lossy_ties.divergences) == len(base.generations) - lossy.identical
    assert lossy_ties.excused == {d["doc"] for d in lossy_ties.divergences if d["excused"]}
    assert len(lossy_ties.excused) <= lossy_ties.cap and lossy.verdict.excused == len(
        lossy_ties.excused)
    for entry in lossy_ties.divergences:
        if entry["excused"]:
            assert entry["gap"] <= tie_gap
    assert not lossy.passed, lossy.line()
    assert lossy.verdict.low < -lossy.verdict.margin
    text = validate.report_markdown(lossy, "pytest")
    assert f"(cap {lossy_ties.cap})" in text and "| excused |" in text


def test_validate_command_line_takes_the_rate():
    validate = load_evals_script("validate")
    args = validate.parse_args(["--tasks", TASK, "--inject-lossy-rate", "0.02"])
    assert args.inject_lossy_rate == 0.02 and args.margin == 0.05
    with pytest.raises(SystemExit):
        validate.parse_args(["--inject-lossy-rate", "1.5"])


def test_target_agreement_16k_data_is_the_yarn_targets_own_text():
    """``ddtree_target_agreement_16k``: 24 stored contexts of about 16k tokens (counted
    again with the pair's tokenizer), and the first document's continuation starts with
    what the shipped target served with YaRN x64 writes after it (fp32, greedy): the
    data was made by that model (rebuild it when the pair changes)."""
    import tempfile
    from pathlib import Path

    import torch
    from transformers import AutoModelForCausalLM

    from vllm_ddtree.demo.reference_engine import CHECKPOINTS, load_embedded_pair
    from vllm_ddtree.evaluation import task_data
    from vllm_ddtree.long_context import write_rope_scaled, yarn_parameters
    from vllm_ddtree.reference import generate

    docs = task_data.target_agreement_docs(task_data.TARGET_AGREEMENT_16K)
    assert len(docs) == 24
    tok = load_embedded_pair().tokenizer
    first = docs[0]
    ids = tok.encode(first["context"], add_special_tokens=False)
    assert len(ids) == first["context_tokens"]
    assert all(15_000 <= d["context_tokens"] <= 16_384 and d["target"] for d in docs)
    assert len({d["context"][-2000:] for d in docs}) == len(docs)
    with tempfile.TemporaryDirectory() as tmp:
        scaled = write_rope_scaled(CHECKPOINTS / "target", Path(tmp) / "target",
                                   yarn_parameters(64.0))
        target = AutoModelForCausalLM.from_pretrained(scaled, dtype=torch.float32).eval()
        out = generate(target, None, ids, 4, "ar", eos_token_id=tok.eos_token_id)
    assert first["target"].startswith(tok.decode(out.tokens, skip_special_tokens=True)), (
        "the stored 16k continuations are no longer the YaRN x64 target's: rebuild them "
        "(evals/make_target_agreement.py, command in evals/tasks/README.md)")
