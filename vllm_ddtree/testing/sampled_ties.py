"""Sampled-token comparison with an allowance for bf16 ties of the perturbed scores.

vLLM's sampler draws ``argmax_v(logit_v / T + g_v)`` with Gumbel noise ``g_v`` keyed by
the request seed, the token's position and ``v`` (``sample/gumbel.py``), and DDTree's
verifier draws with the same function and keys. Two seeded runs therefore draw the
same token unless the two best *perturbed* scores are within logit rounding of each
other. At a first mismatch (AR drew ``x``, the other run ``y`` on the same prefix) we
measure, with vLLM's own kernel, the logit offset that would flip ``x`` into ``y``:
the flip is a tie iff that margin is within the greedy tie gap. Needs CUDA (Triton).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vllm_ddtree.testing.compare import (
    first_mismatch,
    max_excused,
    past_stop_string,
    witness_spread,
)

__all__ = ["gumbel_flip_margin", "sampled_mismatch_problems"]

MARGIN_RANGE = 1.0  # margins are resolved in [-MARGIN_RANGE, MARGIN_RANGE] ...
MARGIN_STEPS = 4001  # ... to 5e-4


def gumbel_flip_margin(x: int, y: int, value_x: float, value_y: float, seed: int,
                       position: int, temperature: float) -> float:
    """``x``'s perturbed lead over ``y`` in logit units: with logits ``{x: value_x,
    y: value_y + d}`` (all others -inf) vLLM's ``gumbel_sample`` at (seed, position,
    temperature) draws ``x`` iff ``d < d*``; returns ``d*`` (positive when ``x`` wins
    at the given values; +-inf beyond ``MARGIN_RANGE``). ``value_*`` are logits or
    logprobs of one distribution (only their difference counts).
    """
    from vllm.v1.worker.gpu.sample.gumbel import gumbel_sample

    offsets = torch.linspace(-MARGIN_RANGE, MARGIN_RANGE, MARGIN_STEPS, device="cuda")
    logits = torch.full((MARGIN_STEPS, max(x, y) + 1), float("-inf"), device="cuda")
    logits[:, x] = value_x
    logits[:, y] = value_y + offsets
    drawn = gumbel_sample(
        logits,
        torch.zeros(MARGIN_STEPS, dtype=torch.int32, device="cuda"),
        torch.tensor([temperature], dtype=torch.float32, device="cuda"),
        torch.tensor([seed], dtype=torch.int64, device="cuda"),
        torch.full((MARGIN_STEPS,), position, dtype=torch.int64, device="cuda"),
        apply_temperature=True,
    )
    y_wins = (drawn == y).nonzero()
    if y_wins.numel() == 0:
        return float("inf")
    first = int(y_wins[0])
    return float("-inf") if first == 0 else float(offsets[first])


def _values(entry: dict) -> dict[int, float]:
    return {int(t): float(v) for t, v in entry.items()}


def _flip_margin(got: dict, want: dict, pos: int) -> float | None:
    """The perturbed-score margin of ``want``'s token over ``got``'s at ``pos``, the
    first token where they part (:func:`gumbel_flip_margin`); None where neither run
    lists a log-prob of ``got``'s token."""
    x, y = want["tokens"][pos], got["tokens"][pos]
    ref_values = _values(want["top_logprobs"][pos])
    got_values = _values(got["top_logprobs"][pos]) if got.get("top_logprobs") else {}
    # Both logprobs from one run when it lists both tokens; else x's from the
    # reference (which drew it) and y's from the other run: the same prefix, so the same
    # distribution up to the rounding the tie gap allows for.
    if y in ref_values:
        values = ref_values
    elif x in got_values and y in got_values:
        values = got_values
    elif y in got_values:
        values = {x: ref_values[x], y: got_values[y]}
    else:
        return None
    return gumbel_flip_margin(x, y, values[x], values[y], int(want["seed"]),
                              len(want["prompt"]) + pos - 1, float(want["temperature"]))


def sampled_mismatch_problems(got: Sequence[dict], want: Sequence[dict],
                              tie_gap: float,
                              witnesses: Sequence[Sequence[dict]] = ()) -> list[str]:
    """Unexplained first mismatches of seeded sampled outputs. Outputs are dicts with
    ``prompt`` (token ids), ``tokens``, ``seed``, ``temperature`` and ``top_logprobs``
    (``{token: logprob}`` per position, the drawn token included); ``want`` is plain
    decoding. The drawn position of output token ``i`` is ``len(prompt) + i - 1``.
    ``witnesses``: as in ``compare.mismatch_problems`` (plain decoding itself at another
    batch shape): flips past the tie gap are excused within the witnesses' spread (no
    more outputs than they part on, no margin wider than theirs; never when ``tie_gap``
    is 0), and at most half of the outputs they part on may be excused so."""
    moved, widest = 0, 0.0
    if tie_gap > 0 and witnesses:
        def margin_at(i: int, pos: int, witness_output: dict) -> float:
            margin = _flip_margin(witness_output, want[i], pos)
            return float("nan") if margin is None else margin  # counted, widens nothing
        moved, widest = witness_spread(want, witnesses, margin_at)
    problems, past_gap = [], []
    for n, (a, b) in enumerate(zip(got, want, strict=True)):
        pos = first_mismatch(a["tokens"], b["tokens"])
        if past_stop_string(a, b) or pos is None:
            continue
        if pos >= min(len(a["tokens"]), len(b["tokens"])):
            problems.append(f"prompt {n}: lengths differ: {len(a['tokens'])} vs "
                            f"{len(b['tokens'])} tokens")
            continue
        margin = _flip_margin(a, b, pos)
        if margin is None:
            problems.append(f"prompt {n}: pos {pos}: drew {a['tokens'][pos]} vs "
                            f"{b['tokens'][pos]}, and neither run lists a log-prob of "
                            f"{a['tokens'][pos]} (top_logprobs must include the drawn token)")
            continue
        if abs(margin) <= tie_gap:
            continue
        problem = (f"prompt {n}: pos {pos}: drew {a['tokens'][pos]} vs {b['tokens'][pos]}, "
                   f"perturbed margin {margin:.3f} > tie gap {tie_gap:.3f}")
        if moved and abs(margin) <= widest:
            past_gap.append(problem)
        else:
            problems.append(problem)
    if len(past_gap) > min(moved, max_excused(moved)):
        problems += [f"{p} (plain decoding itself parts on {moved} outputs, up to a margin "
                     f"of {widest:.3f}; at most {max_excused(moved)} may be excused)"
                     for p in past_gap]
    return problems
