"""The engines' own generated token ids in the lm-eval tie rule
(``evals/lm_eval_generated_ids.py``, ``evals/lm_eval_ties.py``): recorded around a
scripted ``LLM.generate`` while lm-eval's ``vllm`` model runs ``generate_until``, mapped
to documents, cut at stop strings, and judged against re-encoded text."""

import importlib.metadata
from types import SimpleNamespace

import pytest
from evals_scripts import load_evals_script

pytest.importorskip("lm_eval")

ties = load_evals_script("lm_eval_ties")
generated = load_evals_script("lm_eval_generated_ids")
BF16 = 0.25  # vllm_ddtree.testing.compare.tie_gap_of("bfloat16")
STOP = "\n\n"


@pytest.fixture(scope="module")
def tok():
    from vllm_ddtree.demo.reference_engine import load_embedded_pair

    return load_embedded_pair().tokenizer


class ScriptedLLM:
    """``vllm.LLM.generate`` as vLLM answers it, from a script: ``outputs[prompt ids]``
    are the token ids the engine generates for that prompt, the tokens of a stop string
    included; the text is their decoding cut before the first stop string of the
    request's ``SamplingParams.stop``. A prefill (``max_tokens=1`` with
    ``prompt_logprobs``) answers as a model whose greedy path is ``prompt + path[prompt]``:
    after a prefix of that path its next token there is best (-0.1), the runner-up
    ``runner_up[prompt][i]`` (default 3 nats below) at generated position ``i``; after
    any other prefix another token (id 1) is best. Any token not named gets -6."""

    def __init__(self, tokenizer, outputs, path=None, runner_up=None):
        self.tokenizer, self.outputs = tokenizer, outputs
        self.path, self.runner_up = path or {}, runner_up or {}
        self.prefills: list[list[int]] = []

    def generate(self, prompts, sampling_params=None, use_tqdm=True, lora_request=None):
        params = (sampling_params if isinstance(sampling_params, list)
                  else [sampling_params] * len(prompts))
        return [self._prefill(p["prompt_token_ids"]) if sp.prompt_logprobs
                else self._generate(p["prompt_token_ids"], sp)
                for p, sp in zip(prompts, params, strict=True)]

    def _generate(self, prompt, params):
        ids = self.outputs[tuple(prompt)]
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        for stop in params.stop or []:
            text = text.split(stop)[0]
        return SimpleNamespace(prompt_token_ids=list(prompt), outputs=[
            SimpleNamespace(token_ids=list(ids), text=text)])

    def _prefill(self, ids):
        from vllm.logprobs import Logprob

        self.prefills.append(list(ids))
        prompt = next(p for p in self.path if list(p) == ids[:len(p)])
        greedy = list(prompt) + self.path[prompt]

        def entry(j, token=None):
            if ids[:j] == greedy[:j] and j < len(greedy):
                i = j - len(prompt)
                alt, alt_logprob = self.runner_up.get(prompt, {}).get(i, (1, -3.1))
                top = {greedy[j]: -0.1, alt: alt_logprob}
            else:
                top = {1: -0.1, 2: -3.1}
            if token is not None:
                top.setdefault(token, -6.0)
            return {t: Logprob(v, rank=None) for t, v in top.items()}

        entries = [None] + [entry(j, ids[j]) for j in range(1, len(ids))]
        return SimpleNamespace(prompt_token_ids=ids, prompt_logprobs=entries,
                               outputs=[SimpleNamespace(token_ids=[1], logprobs=[entry(len(ids))])])


def lm_eval_vllm(tokenizer, llm, monkeypatch):
    """lm-eval's ``vllm`` model around ``llm`` without starting an engine."""
    import vllm

    version = importlib.metadata.version  # lm-eval reads the distribution `vllm`'s version
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda name: vllm.__version__ if name == "vllm" else version(name))
    from lm_eval.models.vllm_causallms import VLLM

    lm = VLLM.__new__(VLLM)
    lm.tokenizer, lm.model = tokenizer, llm
    lm.add_bos_token, lm.custom_prefix_token_id, lm.think_end_token = None, None, None
    lm._max_length, lm._max_gen_toks, lm.truncation_side = 256, 32, "left"
    lm.batch_size, lm._rank, lm.data_parallel_size, lm.lora_request = 1, 0, 1, None
    lm.cache_hook = SimpleNamespace(add_partial=lambda *a: None)
    return lm


def run_generate_until(lm, contexts, gen_kwargs):
    """lm-eval's ``generate_until`` over the documents, with the engine recorded:
    ``(text per doc, compared ids per doc, recorder)``."""
    from lm_eval.api.instance import Instance

    requests = [Instance("generate_until", {}, (contexts[d], gen_kwargs[d]), d)
                for d in sorted(contexts)]
    with generated.GenerationRecorder(lm.model) as recorder:
        texts = lm.generate_until(requests, disable_tqdm=True)
    assert "generate" not in vars(lm.model)  # the engine's own generate is back
    texts = dict(zip(sorted(contexts), texts, strict=True))
    prompts = ties.lm_eval_prompts(lm, contexts, gen_kwargs, texts)
    return texts, recorder.doc_ids(lm.tokenizer, prompts, texts), recorder


def ids(tok, *pieces):
    return [i for piece in pieces for i in tok.encode(piece, add_special_tokens=False)]


def test_a_non_canonical_generation_is_excused_with_the_engines_ids(tok, monkeypatch):
    """Plain decoding emits "a" + "b" where "ab" is one token, then parts from DDTree at
    a tie (" x" / " y"). Re-encoding its text gives the canonical "ab": its own tokens
    no longer line up with its log-probs and the document is not excused. With the
    recorded ids the prefill reproduces them and the tie is excused. Documents 0 and 2
    share their prompt; document 1's longer prompt runs first (lm-eval sorts by length)."""
    a, b = tok.convert_tokens_to_ids("a"), tok.convert_tokens_to_ids("b")
    assert tok.encode("ab", add_special_tokens=False) not in ([a, b], [a], [b])
    contexts = {0: "def f():\n", 1: "import os\nimport sys\ndef g():\n", 2: "def f():\n"}
    kwargs = {d: {"until": [STOP], "max_gen_toks": 16} for d in contexts}
    prompts = {d: tuple(tok(contexts[d]).input_ids) for d in contexts}
    tail_x, tail_y = ids(tok, " = x"), ids(tok, " = y")
    assert tail_x[:-1] == tail_y[:-1] and tail_x[-1] != tail_y[-1]
    plain_ids = {prompts[0]: [a, b] + tail_x + ids(tok, STOP),
                 prompts[1]: ids(tok, "    return 1") + ids(tok, STOP)}
    spec_ids = {prompts[0]: [a, b] + tail_y + ids(tok, STOP), prompts[1]: plain_ids[prompts[1]]}
    tie = len(tail_x) + 1  # generated position of " x" / " y"
    plain_llm = ScriptedLLM(tok, plain_ids, plain_ids, {prompts[0]: {tie: (tail_y[-1], -0.2)}})
    base_lm = lm_eval_vllm(tok, plain_llm, monkeypatch)
    spec_lm = lm_eval_vllm(tok, ScriptedLLM(tok, spec_ids), monkeypatch)
    base, base_ids, recorder = run_generate_until(base_lm, contexts, kwargs)
    spec, spec_ids_by_doc, _ = run_generate_until(spec_lm, contexts, kwargs)
    assert base == {0: "ab = x", 1: "    return 1", 2: "ab = x"} and spec[0] == "ab = y"
    assert len(recorder.outputs[prompts[0]]) == 2  # one entry per request: a multimap
    assert base_ids == {0: [a, b] + tail_x, 1: ids(tok, "    return 1"), 2: [a, b] + tail_x}
    assert spec_ids_by_doc[0] == [a, b] + tail_y

    reference = ties.plain_reference(base_lm, contexts, kwargs, base, base_ids)
    assert plain_llm.prefills[0] == list(prompts[0]) + [a, b] + tail_x
    result = ties.tie_divergences(tok, base, spec, reference, BF16, base_ids, spec_ids_by_doc)
    first, second = result.divergences
    assert (first["doc"], first["position"], first["speculative_token"]) == (0, tie, tail_y[-1])
    assert first["excused"] and second["doc"] == 2 and second["reason"] == "over the cap of 1"
    assert result.reencoded == [] and "re-encoded" not in "\n".join(ties.ties_markdown(result))

    # The old path: the text re-encoded, "ab" one token; misaligned from position 0.
    old_reference = ties.plain_reference(base_lm, contexts, kwargs, base)
    old = ties.tie_divergences(tok, base, spec, old_reference, BF16)
    assert old.excused == set() and old.reencoded == [0, 2]
    assert old.divergences[0]["position"] == tie - 1  # the divergence moved too
    assert old.divergences[0]["reason"].startswith("plain decoding's token at 0 is 5.900 nats")
    assert "Token ids of 2 of the 2 differing documents" in "\n".join(ties.ties_markdown(old))


def test_identical_prompts_take_the_output_whose_text_is_the_documents(tok):
    """Two documents with one prompt map to outputs of that prompt; were two outputs of
    one prompt to differ, each document takes the one whose text starts with its own."""
    recorder = generated.GenerationRecorder(SimpleNamespace())
    prompt = tuple(tok("def f():\n").input_ids)
    recorder.outputs[prompt] = [(ids(tok, "    pass"), "    pass"),
                                (ids(tok, "    return"), "    return")]
    contexts = {3: "def f():\n", 8: "def f():\n", 9: "def h():\n"}
    texts = {3: "    return", 8: "    pass", 9: "x"}
    prompts = {d: tok(c).input_ids for d, c in contexts.items()}
    got = recorder.doc_ids(tok, prompts, texts)
    assert got == {3: ids(tok, "    return"), 8: ids(tok, "    pass")}  # 9: not recorded


def test_stop_strings_and_end_of_sequence_are_cut_equal_texts_compare_equal(tok):
    """vLLM's ids go on to the token that completes a stop string (and an end-of-sequence
    token); lm-eval's text is cut before it. The compared ids end with the token that
    completes the text, also where the stop string begins inside it."""
    body = ids(tok, "    return a + b")
    eos = tok.eos_token_id
    cut = generated.generation_ids
    assert cut(tok, body + ids(tok, STOP), "    return a + b") == body
    assert cut(tok, body + [eos], "    return a + b") == body
    assert cut(tok, body, "    return a + b") == body  # max_gen_toks: nothing to cut
    assert cut(tok, ids(tok, STOP), "") == []
    # stop "urn" completed inside " return": that token produced the text's end, kept
    assert cut(tok, body[:2], "    ret") == body[:2]
    # one text stopped by "\n\n", the other by end-of-sequence: not a divergence
    text = {5: "    return a + b"}
    result = ties.tie_divergences(tok, text, dict(text), {}, BF16,
                                  {5: cut(tok, body + ids(tok, STOP), text[5])},
                                  {5: cut(tok, body + [eos], text[5])})
    assert result.divergences == [] and result.reencoded == []


def test_sentencepiece_leading_space_is_not_counted():
    """A tokenizer that drops the leading space of a decoding (SentencePiece) while the
    engine's text keeps it: the stop string's token is still cut."""

    class LeadingSpace:
        pieces = {1: " foo", 2: " bar", 3: "\n\n"}

        def decode(self, token_ids, skip_special_tokens=True):
            return "".join(self.pieces[t] for t in token_ids).removeprefix(" ")

    assert generated.generation_ids(LeadingSpace(), [1, 2, 3], " foo bar") == [1, 2]
    assert generated.generation_ids(LeadingSpace(), [1, 2, 3], " foo") == [1]
