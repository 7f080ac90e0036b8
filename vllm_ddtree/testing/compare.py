"""Greedy token comparison with an allowance for bf16 ties.

Two greedy runs of the same target on different kernels or batch shapes (AR vs tree
verification, 1 vs 33 rows, other requests in the batch) may pick different tokens
where the two best logits are within bf16 rounding; everything after such a point
legitimately differs. A first mismatch is therefore accepted iff the reference's
top-2 logprob gap at that position is within bf16 noise, and nothing after it is
compared (the rule of tests/gpu/test_mla_backend_vllm.py and test_ddtree_vllm.py).

"Within bf16 noise" is measured, not assumed: where both runs saw the same prefix they
report the top-2 gap of the same distribution, so the largest disagreement of those
gaps over the matched positions of a batch (``gap_noise``) is the noise of this pair
of runs. A mismatch is explained when the reference gap is at most
``max(TIE_GAP, NOISE_FACTOR * gap_noise)``; a noise above ``MAX_GAP_NOISE`` is itself
a failure (a wrong mask or position moves logits by far more than rounding does).
Random-init models with large logits showed flips at gaps of 0.094 (3 bf16 steps at
logit magnitude 4-8), which a fixed 0.07 called bugs.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

__all__ = [
    "MAX_GAP_NOISE",
    "NOISE_FACTOR",
    "TIE_GAP",
    "first_mismatch",
    "gap_noise",
    "mismatch_problem",
    "mismatch_problems",
    "past_stop_string",
    "tie_gap_for",
    "top2_gaps",
    "vllm_top_logprobs",
    "vllm_top2_gaps",
]

TIE_GAP = 0.07  # floor: two bf16 steps at logit magnitude 4-8
NOISE_FACTOR = 2.0  # a flip may happen where the gap is up to twice the observed noise
MAX_GAP_NOISE = 0.25  # above this the two runs disagree by more than bf16 rounding


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
    """None when ``got`` equals ``want`` up to a bf16 tie of the reference (see the
    module docstring), else a description of the first unexplained mismatch."""
    pos = first_mismatch(got, want)
    if pos is None:
        return None
    if pos >= min(len(got), len(want)):
        return f"lengths differ: {len(got)} vs {len(want)} tokens"
    gap = want_gaps[pos] if pos < len(want_gaps) else float("inf")
    if gap <= tie_gap:
        return None
    return f"pos {pos}: {got[pos]} vs {want[pos]} (reference top-2 gap {gap:.3f})"


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


def gap_noise(got: Sequence[dict], want: Sequence[dict]) -> float:
    """Largest ``|got.top2_gap[i] - want.top2_gap[i]|`` over the positions before each
    pair's first mismatch (same prefix, so the same distribution up to rounding);
    0.0 when nothing is comparable. Outputs are dicts with ``tokens`` and ``top2_gap``."""
    noise = 0.0
    for a, b in zip(got, want, strict=True):
        if "top2_gap" not in a or "top2_gap" not in b:
            continue
        pos = first_mismatch(a["tokens"], b["tokens"])
        n = min(len(a["tokens"]), len(b["tokens"])) if pos is None else pos
        for x, y in zip(a["top2_gap"][:n], b["top2_gap"][:n], strict=False):
            if math.isfinite(x) and math.isfinite(y):
                noise = max(noise, abs(x - y))
    return noise


def tie_gap_for(got: Sequence[dict], want: Sequence[dict]) -> tuple[float, float]:
    """``(tie_gap, noise)``: the gap below which a flip counts as a bf16 tie for this
    pair of runs, ``max(TIE_GAP, NOISE_FACTOR * gap_noise)``, and the noise itself."""
    noise = gap_noise(got, want)
    return max(TIE_GAP, NOISE_FACTOR * noise), noise


def vllm_top_logprobs(logprobs: Sequence[dict | None] | None) -> list[dict[int, float]]:
    """``{token id: logprob}`` per position of a vLLM ``CompletionOutput.logprobs`` (the
    drawn token and the top ``logprobs``), JSON-friendly once keys become strings."""
    return [{int(t): float(lp.logprob) for t, lp in (entry or {}).items()}
            for entry in logprobs or []]


def mismatch_problems(got: Sequence[dict], want: Sequence[dict],
                      tie_gap: float | None = None) -> list[str]:
    """``mismatch_problem`` per output pair; outputs are dicts with ``tokens`` and
    ``top2_gap`` (the reference's is required, ``got``'s enables the noise measurement).
    ``tie_gap`` None: measured with ``tie_gap_for``; a measured noise above
    ``MAX_GAP_NOISE`` is reported as a problem. Returns the unexplained ones."""
    problems = []
    if tie_gap is None:
        tie_gap, noise = tie_gap_for(got, want)
        if noise > MAX_GAP_NOISE:
            problems.append(f"top-2 gaps at matched positions differ by up to {noise:.3f} "
                            f"(> {MAX_GAP_NOISE}): more than bf16 rounding")
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        if past_stop_string(a, b):
            continue
        problem = mismatch_problem(a["tokens"], b["tokens"], b["top2_gap"], tie_gap)
        if problem is not None:
            problems.append(f"prompt {i}: {problem} (tie gap {tie_gap:.3f})")
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
