"""Greedy token comparison with an allowance for bf16 ties.

Two greedy runs of the same target on different kernels or batch shapes (AR vs tree
verification, 1 vs 33 rows, other requests in the batch) may pick different tokens
where the two best logits are within bf16 rounding; everything after such a point
legitimately differs. A first mismatch is therefore accepted iff the reference's
top-2 logprob gap at that position is at most ``TIE_GAP``, and nothing after it is
compared (the rule of tests/gpu/test_mla_backend_vllm.py and test_ddtree_vllm.py).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "TIE_GAP",
    "first_mismatch",
    "mismatch_problem",
    "mismatch_problems",
    "top2_gaps",
    "vllm_top2_gaps",
]

TIE_GAP = 0.07  # two bf16 steps at logit magnitude 4-8


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


def mismatch_problems(got: Sequence[dict], want: Sequence[dict],
                      tie_gap: float = TIE_GAP) -> list[str]:
    """``mismatch_problem`` per output pair; outputs are dicts with ``tokens`` and (the
    reference) ``top2_gap``. Returns the unexplained ones, prefixed by their index."""
    problems = []
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        problem = mismatch_problem(a["tokens"], b["tokens"], b["top2_gap"], tie_gap)
        if problem is not None:
            problems.append(f"prompt {i}: {problem}")
    return problems
