"""The token ids a vLLM engine generated under lm-eval, per document, for the tie rule
(``evals/lm_eval_ties.py``).

lm-eval's ``vllm`` model returns text only. Re-encoding that text need not give back
the ids the engine generated: a model may emit a non-canonical tokenization ("a" + "b"
where "ab" is one token), and plain decoding's log-probs (one prefill of its
generation) then do not line up with its own tokens. :class:`GenerationRecorder` wraps
the engine's ``LLM.generate`` while lm-eval runs a task and keeps, per request, the
prompt ids and ``outputs[0].token_ids``; :meth:`GenerationRecorder.doc_ids` maps them
to documents through the prompt ids lm-eval sent (``lm_eval_ties.lm_eval_prompts``).

What is compared (:func:`generation_ids`): the recorded ids cut after the token that
completes lm-eval's text. vLLM's ids go on to the tokens of a stop string (lm-eval's
text is cut before it) and the end-of-sequence token; those are dropped, so a
generation that stopped is compared, and prefilled, up to and including the token whose
text reaches the end of lm-eval's text (a stop string may begin inside that token).
Two generations with equal text are never a divergence (``tie_divergences`` skips them
before comparing ids): equal text may come from different tokens, e.g. a stop string
completed inside another token.
"""

from __future__ import annotations


def generation_ids(tokenizer, token_ids: list[int], text: str) -> list[int]:
    """The shortest prefix of ``token_ids`` (one engine output) whose text, decoded by
    ``tokenizer`` without special tokens, is as long as lm-eval's ``text`` (the output's
    text cut before its stop string): the tokens of a stop string past that text, and the
    end-of-sequence token, are dropped. A SentencePiece tokenizer drops a leading space
    when decoding ids alone that the engine's text (decoded after the prompt) keeps; that
    space is not counted."""
    token_ids = list(token_ids)
    full = tokenizer.decode(token_ids, skip_special_tokens=True)
    need = len(text) - (text[:1] == " " and full[:1] != " ")
    keep = len(token_ids)
    while keep > 0 and len(tokenizer.decode(token_ids[:keep - 1],
                                            skip_special_tokens=True)) >= need:
        keep -= 1
    return token_ids[:keep]


class GenerationRecorder:
    """Records what ``llm.generate`` (a ``vllm.LLM``) generated while the ``with`` block
    runs: ``outputs[prompt ids] = [(token_ids, text), ...]``, one entry per request, in
    call order (lm-eval reorders requests by length; identical prompts in several
    documents give several entries). The engine's own ``generate`` is restored on exit."""

    def __init__(self, llm):
        self.llm = llm
        self.outputs: dict[tuple[int, ...], list[tuple[list[int], str]]] = {}

    def __enter__(self) -> GenerationRecorder:
        self._shadowed = vars(self.llm).get("generate")
        generate = self.llm.generate

        def recording(prompts, *args, **kwargs):
            outputs = generate(prompts, *args, **kwargs)
            for prompt, output in zip(prompts, outputs, strict=True):
                completion = output.outputs[0]
                key = tuple(prompt["prompt_token_ids"])
                self.outputs.setdefault(key, []).append((list(completion.token_ids),
                                                         completion.text))
            return outputs

        self.llm.generate = recording
        return self

    def __exit__(self, *exc) -> None:
        if self._shadowed is None:
            del self.llm.generate  # the instance attribute: the class's method again
        else:
            self.llm.generate = self._shadowed

    def doc_ids(self, tokenizer, prompts: dict[int, list[int]],
                generations: dict[int, str]) -> dict[int, list[int]]:
        """Per doc id of ``generations`` (lm-eval's text per document), the engine's
        compared ids (:func:`generation_ids` with ``tokenizer``), found by the prompt ids
        lm-eval sent for it (``prompts``, ``lm_eval_ties.lm_eval_prompts``). Of several
        outputs of one prompt, the first whose text starts with the document's (greedy
        outputs of one prompt are the same). A document without a recorded output gets
        no entry."""
        ids = {}
        for doc, text in generations.items():
            recorded = self.outputs.get(tuple(prompts.get(doc, ())))
            if not recorded:
                continue
            tokens, _ = next((r for r in recorded if r[1].startswith(text)), recorded[0])
            ids[doc] = generation_ids(tokenizer, tokens, text)
        return ids
