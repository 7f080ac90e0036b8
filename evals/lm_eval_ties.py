"""Ties in the lm-eval validation (``evals/validate.py``): which documents whose
generations differ part at a rounding tie of plain decoding, and are excused.

In bf16 the two best logits of a step are often within rounding of each other; two
correct engines (plain decoding, DDTree's tree verification) then legitimately pick
different tokens there, and an exact-answer generation differs from that point on.
The rule, fixed in advance (the gap is a constant of the dtype,
``vllm_ddtree.testing.compare.tie_gap_of``: 0.25 nats in bf16, 0.03125 in fp16, 0 in
fp32; nothing is calibrated on the runs judged):

- generations are compared, and plain decoding's is prefilled, in the token ids the
  engines generated, recorded while lm-eval ran (``evals/lm_eval_generated_ids.py``; cut
  after the token that completes lm-eval's text, so a stop string's and the
  end-of-sequence tokens are not compared; the reference engine ``ddtree-ref`` records
  them itself). Where no ids were recorded, the generated text is re-encoded, which need
  not give back the engine's tokens; the report says for how many documents. Equal
  texts never diverge;
- plain decoding's log-probs come from ONE prefill of its own generation (prompt +
  generated tokens) on the baseline engine (:func:`reference_logprobs`; ``ddtree-ref``:
  through its target, ``evals/hf_prompt_logprobs.py``): at each generated position its
  two best log-probs and that of the token it chose;
- only the first divergence of a document counts. It is excused when both tokens there
  (plain decoding's and DDTree's) are within ``tie_gap`` of plain decoding's best
  log-prob, and plain decoding's own tokens before it line up with the recorded
  log-probs (each within ``tie_gap`` of the best there: the prefill reproduces them);
- a generation that stopped at the divergence (one side has no token there) is not
  excused, nor a divergence past the prefilled positions or without log-probs;
- at most ``max_excused(T)`` documents are excused, half of the ``T`` tie positions
  plain decoding met (positions of its generations with a top-2 gap ``<= tie_gap``, up
  to and including each document's first divergence, the whole generation where the
  two agree, over the documents whose tokens line up there: as
  ``vllm_ddtree.testing.compare.mismatch_problems`` counts them); beyond the cap, the
  documents with the lowest ids are excused;
- fp32 (``tie_gap == 0``) excuses nothing.

An excused document's metric difference is set to 0 before the bootstrap
(``lm_eval_verdict.paired_verdict(..., excused=...)``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from vllm_ddtree.testing.compare import first_mismatch, max_excused

# Plain decoding's top log-probs recorded per position: the two best, and the chosen token.
TOP_LOGPROBS = 2


@dataclass
class PlainLogprobs:
    """Plain decoding's log-probs over its own generation of one document.

    ``tokens``: the generation's token ids (the engine's, else its text encoded without
    special tokens).
    ``top``: per prefilled generated position ``i``, ``{token id: log-prob}`` of the two
    best tokens and ``tokens[i]``; shorter than ``tokens`` when the prompt and the
    generation did not fit the model length. ``after``: the two best of the step after
    the last prefilled token."""

    tokens: list[int]
    top: list[dict[int, float]]
    after: dict[int, float] = field(default_factory=dict)

    def _entry(self, position: int) -> dict[int, float]:
        return self.top[position] if position < len(self.top) else self.after

    def gap(self, position: int) -> float | None:
        """Top-2 log-prob gap at ``position`` (inf with fewer than two entries; None
        past the prefilled positions and the step after them)."""
        if position > len(self.top):
            return None
        values = sorted(self._entry(position).values(), reverse=True)
        return values[0] - values[1] if len(values) > 1 else math.inf

    def drop(self, position: int, token: int) -> float:
        """How far ``token`` is below the best log-prob at prefilled ``position`` (inf
        when not among the recorded tokens)."""
        entry = self.top[position]
        logprob = entry.get(token)
        return math.inf if logprob is None else max(entry.values()) - logprob

    def misaligned(self, tie_gap: float, end: int | None = None) -> int | None:
        """The first position before ``end`` (default: the whole generation) whose
        chosen token is more than ``tie_gap`` below the best, or that was not
        prefilled; None when every one lines up."""
        end = len(self.tokens) if end is None else end
        for i in range(end):
            if i >= len(self.top) or self.drop(i, self.tokens[i]) > tie_gap:
                return i
        return None

    def tie_positions(self, tie_gap: float, end: int | None = None) -> int:
        """Generated positions before ``end`` (default: the whole generation) with a
        top-2 gap ``<= tie_gap``; 0 when those positions do not line up with the
        log-probs, or when ``tie_gap`` is 0 (fp32)."""
        end = len(self.tokens) if end is None else min(end, len(self.tokens))
        if tie_gap <= 0 or self.misaligned(tie_gap, end) is not None:
            return 0
        return sum(self.gap(i) <= tie_gap for i in range(end))


@dataclass
class TieExcusal:
    """The tie rule applied to one task with ``tie_gap`` (nats): ``divergences``, one
    dict per document whose generations differ (``doc``, ``position`` of the first
    differing generated token, ``baseline_token`` / ``speculative_token`` (None: that
    generation stopped there), plain decoding's top-2 ``gap`` there (None without its
    log-probs), ``tie`` (gap ``<= tie_gap``), ``excused``, ``reason`` it is not); the
    ``tie_positions`` plain decoding met; the ``cap`` on excused documents; the
    ``excused`` doc ids; ``has_reference``: whether plain decoding's log-probs were
    recorded at all; ``reencoded``: the doc ids whose generations were compared, on
    one side or both, as re-encoded text (no engine ids recorded)."""

    tie_gap: float
    divergences: list[dict] = field(default_factory=list)
    tie_positions: int = 0
    cap: int = 0
    excused: set[int] = field(default_factory=set)
    has_reference: bool = False
    reencoded: list[int] = field(default_factory=list)


def first_divergence(ours: list[int], theirs: list[int]
                     ) -> tuple[int, int | None, int | None] | None:
    """Where two generations of one prompt part, in token ids: ``(index of the first
    differing generated token, our token, their token)``. When one generation is a
    prefix of the other (it stopped there: a stop sequence the other did not produce,
    whose text lm-eval cut off), the shorter side's token is None. None when equal."""
    i = first_mismatch(ours, theirs)
    if i is None:
        return None
    return i, ours[i] if i < len(ours) else None, theirs[i] if i < len(theirs) else None


def lm_eval_prompt_ids(lm, context: str, gen_kwargs: dict) -> list[int]:
    """The prompt token ids lm-eval's ``vllm`` model (``lm``) sent for ``context``:
    its own encoding (``tok_encode``), left-truncated as its ``generate_until`` does
    (``maybe_truncate`` to ``max_length - max_gen_toks``, ``truncation_side``)."""
    from lm_eval.models.utils import maybe_truncate

    ids = lm.tok_encode(context)
    _, _, max_gen_toks = lm.modify_gen_kwargs(dict(gen_kwargs or {}),
                                              default_max_gen_toks=lm.max_gen_toks)
    ids, _ = maybe_truncate(ids, max_gen_toks=max_gen_toks, max_model_len=lm.max_length,
                            side=lm.truncation_side, verbose=False)
    return list(ids)


def lm_eval_prompts(lm, contexts: dict[int, str], gen_kwargs: dict[int, dict],
                    docs) -> dict[int, list[int]]:
    """:func:`lm_eval_prompt_ids` of each doc id in ``docs`` that has a context."""
    return {doc: lm_eval_prompt_ids(lm, contexts[doc], gen_kwargs.get(doc, {}))
            for doc in docs if doc in contexts}


def reference_logprobs(llm, tokenizer, prompts: dict[int, list[int]],
                       generations: dict[int, str], max_model_len: int | None = None,
                       generated_ids: dict[int, list[int]] | None = None
                       ) -> dict[int, PlainLogprobs]:
    """Plain decoding's log-probs over its own generations: per document, ONE prefill
    of ``prompts[doc]`` + its generated tokens (``generated_ids[doc]``, the engine's own;
    else ``generations[doc]`` encoded by ``tokenizer`` without special tokens) through
    ``llm``, the baseline's ``vllm.LLM`` (``SamplingParams(max_tokens=1,
    prompt_logprobs=2, logprobs=2)``), all documents in one ``generate`` call.

    ``prompts``: the ids the generation saw (:func:`lm_eval_prompt_ids`); a document
    without one, or with an empty one, gets no entry. With ``max_model_len``, the
    generation is cut to fit it (vLLM needs one free position), and the positions past
    the cut stay without log-probs."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    docs, inputs = [], []
    for doc in sorted(generations):
        prompt = list(prompts.get(doc) or [])
        if not prompt:
            continue
        tokens = _ids(tokenizer, generations[doc], (generated_ids or {}).get(doc))
        fit = len(tokens) if max_model_len is None else max(0, max_model_len - 1 - len(prompt))
        docs.append((doc, len(prompt), tokens))
        inputs.append(TokensPrompt(prompt_token_ids=prompt + tokens[:fit]))
    if not inputs:
        return {}
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=TOP_LOGPROBS,
                            logprobs=TOP_LOGPROBS, detokenize=False)
    outputs = llm.generate(inputs, params, use_tqdm=False)
    reference = {}
    for (doc, prompt_len, tokens), prompt, out in zip(docs, inputs, outputs, strict=True):
        entries = out.prompt_logprobs
        if entries is None or len(entries) != len(prompt["prompt_token_ids"]):
            raise RuntimeError(f"doc {doc}: {0 if entries is None else len(entries)} prompt "
                               f"log-prob entries for {len(prompt['prompt_token_ids'])} "
                               "prefilled tokens")
        top = [_logprobs(entries[j]) for j in range(prompt_len, len(entries))]
        reference[doc] = PlainLogprobs(tokens, top, _logprobs(out.outputs[0].logprobs[0]))
    return reference


def _ids(tokenizer, text: str, recorded: list[int] | None) -> list[int]:
    """A generation's token ids: the ``recorded`` engine ids, else ``text`` re-encoded."""
    if recorded is not None:
        return list(recorded)
    return tokenizer.encode(text, add_special_tokens=False)


def _logprobs(entry) -> dict[int, float]:
    """``{token id: log-prob}`` of one position of vLLM's logprobs (``{id: Logprob}``)."""
    return {int(t): float(lp.logprob) for t, lp in (entry or {}).items()}


def plain_reference(lm, contexts: dict[int, str], gen_kwargs: dict[int, dict],
                    generations: dict[int, str],
                    generated_ids: dict[int, list[int]] | None = None
                    ) -> dict[int, PlainLogprobs]:
    """:func:`reference_logprobs` of one task's plain-decoding run through lm-eval's
    ``vllm`` model ``lm`` (its engine, tokenizer, prompt encoding and model length),
    prefilling the engine's ``generated_ids`` where recorded."""
    prompts = lm_eval_prompts(lm, contexts, gen_kwargs, generations)
    return reference_logprobs(lm.model, lm.tokenizer, prompts, generations, lm.max_length,
                              generated_ids)


def _not_excused(ref: PlainLogprobs | None, position: int, ours: int | None,
                 theirs: int | None, tie_gap: float) -> str | None:
    """Why a first divergence is not a tie of plain decoding; None when it is."""
    if tie_gap <= 0:
        return "tie gap 0 (fp32)"
    if ref is None:
        return "no log-probs of plain decoding"
    if ours is None or theirs is None:
        return f"{'plain decoding' if ours is None else 'DDTree'} stopped here"
    if position >= len(ref.top):
        return "past the prefilled positions"
    wrong = ref.misaligned(tie_gap, position)
    if wrong is not None:
        return (f"plain decoding's token at {wrong} is {ref.drop(wrong, ref.tokens[wrong]):.3f}"
                " nats below its best (the prefill does not reproduce it)")
    for side, token in (("plain decoding's", ours), ("DDTree's", theirs)):
        drop = ref.drop(position, token)
        if drop > tie_gap:
            return (f"{side} token is not among plain decoding's top {TOP_LOGPROBS}"
                    if math.isinf(drop) else f"{side} token is {drop:.3f} nats below the best")
    return None


def tie_divergences(tokenizer, baseline: dict[int, str], speculative: dict[int, str],
                    reference: dict[int, PlainLogprobs], tie_gap: float,
                    baseline_ids: dict[int, list[int]] | None = None,
                    speculative_ids: dict[int, list[int]] | None = None) -> TieExcusal:
    """The tie rule (module docstring) on one task: ``baseline`` / ``speculative``
    generations (text) per doc id, ``reference`` plain decoding's log-probs per doc id
    (:func:`reference_logprobs`; empty: nothing can be excused), ``tie_gap`` from
    ``tie_gap_of(dtype)``. Documents with equal text are skipped; the others are
    compared in the engines' token ids ``baseline_ids`` / ``speculative_ids``
    (``lm_eval_generated_ids``; plain decoding's as prefilled in ``reference``), a
    side without them in its text encoded by ``tokenizer`` without special tokens."""
    result = TieExcusal(tie_gap, has_reference=bool(reference))
    candidates = []
    compared: dict[int, int] = {}  # doc -> positions compared (up to its first divergence)
    for doc in sorted(baseline):
        text, other = baseline[doc], speculative.get(doc)
        if other is None or other == text:
            continue
        ref = reference.get(doc)
        recorded_ours = (baseline_ids or {}).get(doc)
        recorded_theirs = (speculative_ids or {}).get(doc)
        if recorded_ours is None or recorded_theirs is None:
            result.reencoded.append(doc)
        ours = ref.tokens if ref else _ids(tokenizer, text, recorded_ours)
        found = first_divergence(ours, _ids(tokenizer, other, recorded_theirs))
        if found is None:
            result.divergences.append({"doc": doc, "position": None, "gap": None, "tie": None,
                                       "excused": False, "reason": "same tokens"})
            continue
        position, ours_token, theirs_token = found
        compared[doc] = position + 1
        gap = ref.gap(position) if ref else None
        reason = _not_excused(ref, position, ours_token, theirs_token, tie_gap)
        if reason is None:
            candidates.append(doc)
        result.divergences.append({
            "doc": doc, "position": position, "baseline_token": ours_token,
            "speculative_token": theirs_token, "gap": gap,
            "tie": tie_gap > 0 and gap is not None and gap <= tie_gap,
            "excused": False, "reason": reason})
    result.tie_positions = sum(ref.tie_positions(tie_gap, compared.get(doc))
                               for doc, ref in reference.items())
    result.cap = max_excused(result.tie_positions)
    result.excused = set(candidates[:result.cap])
    for entry in result.divergences:
        if entry["doc"] in result.excused:
            entry["excused"] = True
        elif entry["reason"] is None:
            entry["reason"] = f"over the cap of {result.cap}"
    return result


def _token(token_id: int | None) -> str:
    return "stop" if token_id is None else str(token_id)


def ties_markdown(ties: TieExcusal) -> list[str]:
    """The report's lines on where the generations part and what the tie rule excused."""
    if ties.tie_gap <= 0:
        rule = ("Tie rule: tie gap 0 in fp32, nothing is excused.")
    elif not ties.has_reference:
        rule = (f"Tie rule: no log-probs of plain decoding were recorded (tie gap "
                f"{ties.tie_gap} nats), nothing is excused.")
    else:
        rule = (f"Tie rule (`evals/lm_eval_ties.py`, fixed in advance): a document is excused "
                f"(its metric difference set to 0) when the generations first part where both "
                f"tokens are within the tie gap {ties.tie_gap} nats of plain decoding's best "
                f"log-prob, plain decoding's own tokens before it line up with its log-probs "
                f"(one prefill of its generation on the plain engine) and neither generation "
                f"stopped there; at most half of the {ties.tie_positions} tie positions plain "
                f"decoding met may be excused. **Excused: {len(ties.excused)} of "
                f"{len(ties.divergences)} (cap {ties.cap}).**")
    lines = [rule, ""]
    if ties.reencoded:
        lines += [f"Token ids of {len(ties.reencoded)} of the {len(ties.divergences)} differing "
                  "documents are their generated text re-encoded (no engine token ids were "
                  "recorded): a non-canonical tokenization there can misalign plain "
                  "decoding's log-probs or move the first divergence.", ""]
    if not ties.divergences:
        return lines
    lines += ["Where they part (plain decoding's top-2 log-prob gap at the first differing "
              "token; 'stop': that generation ended there):", "",
              "| doc | first differing token | baseline / speculative token | top-2 gap | tie "
              "| excused |", "|---|---|---|---|---|---|"]
    for p in ties.divergences:
        gap = "—" if p["gap"] is None else format(p["gap"], ".4f")
        excused = "yes" if p["excused"] else f"no: {p['reason']}"
        lines.append(f"| {p['doc']} | {p['position']} | {_token(p.get('baseline_token'))} / "
                     f"{_token(p.get('speculative_token'))} | {gap} | {p['tie']} | {excused} |")
    return lines + [""]
