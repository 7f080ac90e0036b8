"""Greedy token comparison with an allowance for bf16 ties.

Two greedy runs of the same target on different kernels or batch shapes (AR vs tree
verification, 1 vs 33 rows, other requests in the batch) may pick different tokens
where the two best logits are within bf16 rounding; everything after such a point
legitimately differs. The rule, fixed in advance (not calibrated on the runs judged):

- an output may be excused only at its *first* divergence, and only when the
  reference's top-2 log-prob gap there is at most ``TIE_GAP``; nothing after it is
  compared;
- at most half of the tie positions a batch meets may flip (``max_excused``): a tie
  position is one the reference reaches (up to and including each output's first
  divergence) with a top-2 gap ``<= TIE_GAP``. Rounding noise is symmetric, so at a
  positive gap it flips the order at most half the time (``MAX_FLIP_SHARE``); a
  verifier that commits wrong tokens flips at wide gaps, or at ties far more often;
- fp32 runs excuse nothing (``tie_gap_of("float32") == 0``);
- where the gap does not model the rounding (an fp8 cache in bf16), a divergence past it
  is excused only within the spread of *witnesses*, the reference itself run at another
  batch shape or on vLLM's other backend: no more such outputs than the witnesses part
  on, none at a wider reference gap than theirs (:func:`witness_spread`,
  :func:`mismatch_problems`).

``TIE_GAP`` from bf16 arithmetic: bf16 keeps 8 significant bits (7 stored), so a
value in ``[2**e, 2**(e+1))`` is a multiple of ``2**(e-7)`` (one *step*) and rounds
with an error of at most half a step. The top logits of the targets tested stay below
``MAX_LOGIT = 32`` (the embedded pair: median 11.7, 99th percentile 17.5, largest
23.1 on HumanEval prompts; random tiny models 4-8), where a step is at most
``2**(4-7) = 0.125``. The log-prob gap of the two best tokens is their logit gap; each
run's rounding moves it by at most one step (half a step per logit), so the final
rounding of two runs alone can flip a gap of up to 2 steps when their hidden states
agree; ``TIE_GAP = TIE_STEPS * 0.125 = 0.25`` nats allows 2 steps. (A flip at a 0.125
gap, one step at logit magnitude 16-32, was seen on the H200; a wrong mask or
position moves logits by whole nats.) fp16 keeps 11 significant bits: the same
2 steps at |logit| < 32 are ``2 * 2**(4-10) = 0.03125``.

bf16 on an fp8 cache (``tie_gap_of("bfloat16", "fp8")``): the e4m3 query turns a
last-bit difference into a whole e4m3 step (1/8 of the entry), so rounding moves the
top-2 gap by far more than 2 logit steps. ``FP8_CACHE_BF16_TIE_GAP`` comes from bf16
arithmetic emulated on the exact fp8 result (``evals/fp8_margin_noise.py --bf16``: every
linear and norm output of the embedded target rounded by up to half a bf16 step, the
e4m3 query and cache as vLLM's): over 2,300 positions the exact top-2 gap moved by at
most 0.19 / 0.31 / 0.46 / 0.53 nats (95th / 99th / 99.9th percentile / largest), and
the log-probs by a median of 0.022 and a 95th percentile of 0.12, as the H100 measured
for vLLM's FLASHMLA (0.027 / 0.14) and our backend (0.023 / 0.13) on that cache.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

__all__ = [
    "MAX_FLIP_SHARE",
    "MAX_LOGIT",
    "TIE_GAP",
    "TIE_STEPS",
    "first_mismatch",
    "max_excused",
    "mismatch_problem",
    "mismatch_problems",
    "past_stop_string",
    "tie_gap_of",
    "tie_positions",
    "top2_gaps",
    "witness_spread",
    "vllm_top_logprobs",
    "vllm_top2_gaps",
]

MAX_LOGIT = 32.0  # bound on |logit| of the top tokens of the targets tested
TIE_STEPS = 2  # rounding steps a flip may span (one per run)


def _step(significant_bits: int, magnitude: float = MAX_LOGIT) -> float:
    """Spacing of a float with ``significant_bits`` just below ``magnitude``."""
    return 2.0 ** (math.floor(math.log2(magnitude)) - 1 - (significant_bits - 1))


TIE_GAP = TIE_STEPS * _step(8)  # bf16: 2 * 0.125 = 0.25 nats
MAX_FLIP_SHARE = 0.5  # of the tie positions met: symmetric rounding flips at most half
_TIE_GAPS = {"bfloat16": TIE_GAP, "float16": TIE_STEPS * _step(11), "float32": 0.0}
FP8_CACHE_BF16_TIE_GAP = 0.5  # the emulation's 99.9th percentile (0.46), rounded up
_FP8_CACHE_TIE_GAPS = {"bfloat16": FP8_CACHE_BF16_TIE_GAP, "float32": 0.0}
_FP8_CACHE_DTYPES = ("fp8", "fp8_e4m3")


def tie_gap_of(dtype: str, kv_cache_dtype: str = "auto") -> float:
    """The tie gap of runs in ``dtype`` (``"bfloat16"``, ``"float16"``, ``"float32"``;
    a ``torch.dtype`` or ``"torch.float32"`` also works) on a ``kv_cache_dtype`` cache
    (vLLM's ``--kv-cache-dtype``; ``"fp8"``: ``FP8_CACHE_BF16_TIE_GAP`` in bf16): 0.0 in
    fp32, nothing excused."""
    name = str(dtype).removeprefix("torch.")
    name = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
            "float": "float32"}.get(name, name)
    if name not in _TIE_GAPS:
        raise ValueError(f"dtype={dtype!r} is not allowed: one of {', '.join(_TIE_GAPS)}")
    if kv_cache_dtype not in _FP8_CACHE_DTYPES:
        return _TIE_GAPS[name]
    if name not in _FP8_CACHE_TIE_GAPS:
        raise ValueError(f"dtype={dtype!r} on an fp8 cache is not measured: one of "
                         f"{', '.join(_FP8_CACHE_TIE_GAPS)}")
    return _FP8_CACHE_TIE_GAPS[name]


def max_excused(tie_positions: int) -> int:
    """How many outputs may be excused by a tie when the compared tokens met
    ``tie_positions`` reference positions with a top-2 gap ``<= TIE_GAP``:
    ``ceil(MAX_FLIP_SHARE * tie_positions)``.

    The cap counts opportunities, not outputs: on the embedded pair's mixed batch (8
    greedy outputs, 496 tokens, fp32 on CPU) 70 positions (14 %) have a gap <= 0.25
    nats, so several outputs parting at a tie is what bf16 noise does there."""
    return math.ceil(MAX_FLIP_SHARE * tie_positions)


def tie_positions(want_gaps: Sequence[float], compared: int, tie_gap: float) -> int:
    """Reference positions among the first ``compared`` with a top-2 gap ``<= tie_gap``
    (none when ``tie_gap`` is 0: fp32 excuses nothing)."""
    if tie_gap <= 0:
        return 0
    return sum(1 for gap in list(want_gaps)[:compared] if gap <= tie_gap)


def first_mismatch(got: Sequence[int], want: Sequence[int]) -> int | None:
    """Index of the first differing token (a length difference counts at the end of
    the shorter one), or None when equal."""
    for i, (x, y) in enumerate(zip(got, want, strict=False)):
        if x != y:
            return i
    return None if len(got) == len(want) else min(len(got), len(want))


def mismatch_problem(
    got: Sequence[int], want: Sequence[int], want_gaps: Sequence[float],
    tie_gap: float = TIE_GAP,
) -> str | None:
    """None when ``got`` equals ``want`` up to a tie of the reference at the first
    divergence (reference top-2 gap ``<= tie_gap``; ``tie_gap`` 0 excuses nothing),
    else a description of the first unexplained mismatch. One output: the cap on
    excused outputs is :func:`mismatch_problems`'."""
    pos = first_mismatch(got, want)
    if pos is None:
        return None
    if pos >= min(len(got), len(want)):
        return f"lengths differ: {len(got)} vs {len(want)} tokens"
    gap = want_gaps[pos] if pos < len(want_gaps) else float("inf")
    if tie_gap > 0 and gap <= tie_gap:
        return None
    return f"pos {pos}: {got[pos]} vs {want[pos]} (reference top-2 gap {gap:.3f})"


def own_gap_note(got: dict, pos: int) -> str:
    """The compared run's own top-2 gap where it parted (when it recorded one): with the
    reference's, how far apart the two runs' logits of the two tokens are (their sum)."""
    gaps = got.get("top2_gap") or ()
    return f" (its own top-2 gap {gaps[pos]:.3f})" if pos < len(gaps) else ""


def past_stop_string(got: dict, want: dict) -> bool:
    """Whether two outputs differ only by tokens after a stop string: one token list
    extends the other, the texts are equal, and a run stopped on a stop string.

    vLLM appends all of a step's tokens before it looks for stop strings and then
    cuts only the text (``v1/engine/detokenizer.py:95-142``), so a step that commits
    several tokens (speculative decoding) keeps the ones after the stop string in
    ``token_ids``; plain decoding stops at it. Outputs are dicts with ``tokens``,
    ``text`` and ``stop_reason`` (vLLM's ``CompletionOutput.stop_reason``)."""
    a, b = list(got["tokens"]), list(want["tokens"])
    short, long = (a, b) if len(a) <= len(b) else (b, a)
    stopped = any(isinstance(o.get("stop_reason"), str) for o in (got, want))
    return (stopped and len(short) < len(long) and long[: len(short)] == short
            and got.get("text") == want.get("text"))


def top2_gaps(top_logprobs: Sequence[dict | None]) -> list[float]:
    """Top-2 logprob gap per position from OpenAI-style ``top_logprobs`` dicts
    (``{token: logprob}``); inf where fewer than two are given."""
    gaps = []
    for entry in top_logprobs:
        values = sorted((entry or {}).values(), reverse=True)
        gaps.append(values[0] - values[1] if len(values) > 1 else float("inf"))
    return gaps


def vllm_top2_gaps(logprobs: Sequence[dict | None] | None) -> list[float]:
    """``top2_gaps`` of a vLLM ``CompletionOutput.logprobs`` (``{token: Logprob}`` per
    position, requested with ``logprobs >= 2``)."""
    return top2_gaps([{t: lp.logprob for t, lp in (entry or {}).items()}
                      for entry in logprobs or []])


def vllm_top_logprobs(logprobs: Sequence[dict | None] | None) -> list[dict[int, float]]:
    """``{token id: logprob}`` per position of a vLLM ``CompletionOutput.logprobs`` (the
    drawn token and the top ``logprobs``), JSON-friendly once keys become strings."""
    return [{int(t): float(lp.logprob) for t, lp in (entry or {}).items()}
            for entry in logprobs or []]


def witness_spread(want: Sequence[dict], witnesses: Sequence[Sequence[dict]],
                   margin_at=None) -> tuple[int, float]:
    """How far the reference's own runs part from it: the number of ``want``'s outputs
    on which a witness (the reference engine run differently; one output per prompt,
    as ``want``) parts on a token (not a length, not past a stop string), and the
    widest reference margin at such a first divergence (0.0 where none; a margin that
    is not finite or not known counts the output but widens nothing).
    ``margin_at(i, pos, witness_output)``: the margin of the reference's token over the
    witness's at output ``i``'s ``pos``; by default the reference's top-2 gap there
    (greedy).

    On the H100 with an fp8 cache, vLLM's FLASHMLA at one request a step and TRITON_MLA
    parted from FLASHMLA on 3 of 5 outputs, at tokens 2-18, at the same token on only one
    of them (and our backend on a fourth): where a flip falls is mostly a property of
    the run, not of the prompt, so the spread is a count and a width, not positions."""
    if margin_at is None:
        def margin_at(i: int, pos: int, witness_output: dict) -> float:
            gaps = want[i].get("top2_gap") or []
            return gaps[pos] if pos < len(gaps) else float("inf")
    outputs, widest = 0, 0.0
    for witness in witnesses:
        if len(witness) != len(want):
            raise ValueError(f"a witness has {len(witness)} outputs, the reference "
                             f"{len(want)}: a witness runs the same prompts")
    for i, reference in enumerate(want):
        moved = False
        for witness in witnesses:
            w = witness[i]
            if past_stop_string(w, reference):
                continue
            pos = first_mismatch(w["tokens"], reference["tokens"])
            if pos is None or pos >= min(len(w["tokens"]), len(reference["tokens"])):
                continue
            moved = True
            margin = abs(margin_at(i, pos, w))
            if math.isfinite(margin):
                widest = max(widest, margin)
        outputs += moved
    return outputs, widest


def mismatch_problems(got: Sequence[dict], want: Sequence[dict],
                      tie_gap: float = TIE_GAP,
                      witnesses: Sequence[Sequence[dict]] = (),
                      arbiter: Callable[[int, int, int, int], float] | None = None,
                      ) -> list[str]:
    """The unexplained mismatches of a batch; outputs are dicts with ``tokens`` and
    (the reference's) ``top2_gap``. Each output: :func:`mismatch_problem` (ties only
    at the first divergence, reference gap ``<= tie_gap``; ``tie_gap_of(dtype)`` for
    other dtypes, 0 in fp32); tokens past a stop string are not compared. More
    excused outputs than ``max_excused`` of the tie positions met (up to and including
    each first divergence) is itself a problem.

    ``witnesses``: runs of the reference itself on the same prompts where its rounding
    legitimately differs (another batch shape; vLLM's other backend on the same fp8
    cache), for what the tie gap does not model: with an fp8 cache a latent one bf16
    step apart can round to e4m3 codes a whole e4m3 step (16 bf16 steps) apart, and the
    reference's own fp8 kernel may round P to e4m3. Divergences past the tie gap are
    excused only within the witnesses' spread (:func:`witness_spread`): at most as many
    outputs as the witnesses part on, none at a reference gap wider than the widest at
    which a witness parted; each output a witness parts on is one more opportunity for
    the cap. A verifier that commits wrong tokens parts on more outputs, at wider gaps,
    than vLLM does from itself.

    ``arbiter(i, pos, got_token, want_token)``: the exact result's logit margin of
    ``got``'s token over ``want``'s at output ``i``'s ``pos`` (the shared prefix teacher
    forced, e.g. :func:`vllm_ddtree.testing.fp8_mla_reference.fp8_cache_logits`). A flip
    past the tie gap where it is positive is the reference's error, not ``got``'s, and
    is no problem (nor counted as excused); a verifier that commits wrong tokens parts
    where the exact result sides with the reference. fp32 (``tie_gap`` 0) excuses
    nothing, witnessed, arbitrated or not, and a length difference is never excused."""
    moved, widest = witness_spread(want, witnesses) if tie_gap > 0 else (0, 0.0)
    spread = (f"; the witnesses part on {moved} outputs, up to a gap of {widest:.3f}"
              if tie_gap > 0 and witnesses else "")
    problems, excused, ties, past_gap = [], [], moved, []
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        if past_stop_string(a, b):
            continue
        problem = mismatch_problem(a["tokens"], b["tokens"], b["top2_gap"], tie_gap)
        pos = first_mismatch(a["tokens"], b["tokens"])
        compared = len(b["tokens"]) if pos is None else pos + 1
        ties += tie_positions(b["top2_gap"], compared, tie_gap)
        flip = problem is not None and pos < min(len(a["tokens"]), len(b["tokens"]))
        if flip:
            problem += own_gap_note(a, pos)
            if tie_gap > 0 and arbiter is not None:
                margin = arbiter(i, pos, a["tokens"][pos], b["tokens"][pos])
                if margin > 0:
                    continue
                problem += f" (the exact result prefers the reference's by {-margin:.3f})"
            gap = b["top2_gap"][pos] if pos < len(b["top2_gap"]) else float("inf")
            if moved and gap <= widest:
                past_gap.append((i, problem))  # within the spread, if few enough
                continue
        if problem is not None:
            problems.append(f"prompt {i}: {problem} (tie gap {tie_gap:.3f}"
                            f"{spread if flip else ''})")
        elif pos is not None:
            excused.append(i)
    if len(past_gap) <= moved:
        excused += [i for i, _ in past_gap]
    else:
        problems += [f"prompt {i}: {problem} (tie gap {tie_gap:.3f}{spread})"
                     for i, problem in past_gap]
    if len(excused) > max_excused(ties):
        problems.append(f"{len(excused)} of {len(want)} outputs part at a tie (prompts "
                        f"{sorted(excused)}) among {ties} tie positions met; at most "
                        f"{max_excused(ties)} may (MAX_FLIP_SHARE {MAX_FLIP_SHARE})")
    return problems


def non_full_verify_steps(dispatches: Sequence[dict], query_lens: Iterable[int]) -> list[dict]:
    """The target graph dispatches (``check_ddtree_vllm.record_verify_dispatches``:
    ``num_reqs``, ``num_tokens``, ``uniform_token_count``, ``mode``) of uniform
    verify batches, ``uniform_token_count`` in ``query_lens`` (``1 + s`` for each verify
    shape s), that did not replay a FULL CUDA graph. With CUDA graphs every such step
    must (adaptive verify shapes capture one graph per shape): a miss runs the target
    piecewise or eagerly, tokens unchanged but the step far slower, so only this check
    sees it. (A lone prefill is "uniform" too; its length is rarely a verify shape.)"""
    lens = set(query_lens)
    return [d for d in dispatches
            if d.get("uniform_token_count") in lens and d.get("mode") != "FULL"]


def eager_graphable_steps(dispatches: Sequence[dict], graphs: dict | None) -> list[dict]:
    """The target graph dispatches (as :func:`non_full_verify_steps`) that ran without
    any CUDA graph (``NONE``) although a graph of vLLM's mixed mode could serve them:
    ``graphs`` (``check_ddtree_vllm.graph_config``) has a mixed mode other than
    ``NONE`` and the step's token count is at most the largest capture size, every
    one of which has such a graph. vLLM's lookup alone left such batches eager where
    their count sat just below a count captured only for uniform decodes
    (``patches/verify_shapes.add_mixed_candidates``); tokens are unchanged, the step
    far slower. Empty without ``graphs``, a mixed mode, or any step that replayed a
    graph of that mode (the runner used another setup than the config says)."""
    mixed = (graphs or {}).get("mixed_mode", "NONE")
    if mixed == "NONE" or not any(d.get("mode") == mixed for d in dispatches):
        return []
    largest = graphs.get("max_capture_size") or 0
    return [d for d in dispatches
            if d.get("mode") == "NONE" and 0 < d.get("num_tokens", 0) <= largest]

