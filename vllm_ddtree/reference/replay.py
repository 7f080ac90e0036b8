"""Replay the reference engine along a given greedy continuation.

:func:`generate` lets every engine write its own text, so two engines whose greedy
outputs part at an argmax tie (bf16 vs fp32) end up counting acceptance on different
texts. :func:`replay` forces the reference engine along *given* tokens (e.g. vLLM's
output) and reports what it would have committed per round on exactly that text:
an apples-to-apples comparison with the other engine's per-round counts.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vllm_ddtree.reference.engine import (
    Method,
    draft_and_verify,
    keep_accepted,
    prefill,
)
from vllm_ddtree.reference.inputs import (
    check_generate_args,
    check_token_ids,
    refuse,
    vocab_size_of,
)
from vllm_ddtree.reference.target import TargetRunner
from vllm_ddtree.testing.compare import first_mismatch
from vllm_ddtree.walk.follow import follow_tree

__all__ = ["clip_rounds", "compare_rounds", "replay"]

_NO_TOKEN = -1  # never a tree token: ends the walk past the end of `tokens`


@torch.no_grad()
def replay(
    target,
    drafter,
    prompt_ids: Sequence[int],
    tokens: Sequence[int],
    method: Method = "ddtree",
    budget: int = 64,
    top_k: int | None = None,
) -> list[int]:
    """Tokens the engine commits per round when forced along ``tokens`` (greedy only).

    Args:
        target: the target causal LM (transformers; any dtype/device, e.g. fp32 CPU or
            CUDA), as for :func:`generate`.
        drafter: the :class:`DFlashDraftModel`, on the target's device.
        prompt_ids: the prompt, ``list[int]`` of length ``n >= 1``.
        tokens: the output after the prompt, ``list[int]``; ``tokens[0]`` is the token
            chosen at prefill (the first round's root), ``tokens[1:]`` are committed by
            the rounds. Any length (0 or 1: no round, returns ``[]``).
        method: ``"ddtree"`` (a tree of ``budget`` nodes, ``top_k`` children cap) or
            ``"dflash"`` (the drafter's greedy chain of ``block_size - 1`` tokens).
        budget, top_k: as for :func:`generate`.

    Each round runs exactly what a round of :func:`generate` runs on the same prefix
    (draft from the drafter's context, build the tree, verify ``[root, nodes...]`` on
    the target), but the walk follows ``tokens`` instead of the target's argmax: the
    accepted depth ``a`` is the deepest tree path whose tokens equal the next tokens
    of ``tokens``; the round commits ``min(a + 1, tokens left)`` tokens of ``tokens``,
    then the target KV cache and the drafter context keep the root and the accepted
    path as in :func:`generate`. The target's own choices are not consulted, so
    ``tokens`` need not be this target's argmax (another engine's bf16 output is fine).

    Greedy only: a sampled run (``temperature > 0``) accepts a path by the target's
    keyed draws, which depend on more than the committed text; replaying it here
    would count by the greedy rule. On the engine's own greedy output,
    ``replay(prompt, out.tokens) == clip_rounds([s.committed for s in out.stats],
    len(out.tokens))`` (only the last round can be clipped, where ``max_new_tokens``
    or EOS cut the output inside an accepted path).

    Returns:
        ``list[int]``, tokens committed per round (every entry >= 1, summing to
        ``len(tokens) - 1``), what vLLM reports per request as ``committed_per_round``.
    """
    _check_replay_args(target, drafter, prompt_ids, tokens, method, budget, top_k)
    tokens = [int(t) for t in tokens]
    if len(tokens) <= 1:
        return []
    device = next(target.parameters()).device
    forced = torch.tensor(tokens + [_NO_TOKEN], dtype=torch.long, device=device)
    runner = TargetRunner(target, drafter.target_layer_ids)
    try:
        _, context = prefill(runner, drafter, list(prompt_ids))
        rounds: list[int] = []
        done = 1  # tokens[:done] are committed; tokens[done - 1] is the root
        while done < len(tokens):
            position = len(prompt_ids) + done - 1  # position of the root
            verified = draft_and_verify(
                runner, drafter, context, tokens[done - 1], position, method, budget, top_k
            )
            # "Target token" at a row of depth d: the forced token at depth d + 1
            # (tokens[done + d]); past the end of `tokens`, none matches.
            rows = (done + verified.offsets).clamp(max=len(tokens))
            walk = follow_tree(verified.tree, forced[rows][None])
            left = len(tokens) - done
            committed = min(int(walk.accepted_depth[0]) + 1, left)
            rounds.append(committed)
            done += committed
            if done < len(tokens):
                keep_accepted(runner, context, verified, walk, position)
        return rounds
    finally:
        runner.close()


def _check_replay_args(target, drafter, prompt_ids, tokens, method, budget, top_k) -> None:
    """As :func:`generate`'s checks (method ``ddtree`` or ``dflash`` only); ``tokens``
    is a list of token ids of the target's vocabulary (possibly empty)."""
    if method not in ("ddtree", "dflash"):
        raise refuse("replay", "method", method, "a speculative method, 'ddtree' or 'dflash'")
    check_generate_args(target, drafter, prompt_ids, 1, method, budget, 0.0, None, None,
                        top_k, None, None, where="replay")
    if not isinstance(tokens, (list, tuple)) or tokens:
        check_token_ids("replay", "tokens", tokens, vocab_size_of("replay", target))


def clip_rounds(committed_per_round: Sequence[int], num_tokens: int) -> list[int]:
    """Per-round committed counts cut to an output of ``num_tokens`` tokens.

    An engine counts a round's committed tokens before the output is cut (max
    tokens, EOS, stop strings), and may even run rounds past the cut; the output's
    ``num_tokens`` tokens are the prefill token plus ``num_tokens - 1`` committed
    by rounds. Returns the leading rounds that cover those ``num_tokens - 1`` tokens,
    the last one clipped to what is left (the counts :func:`replay` reports).
    A shorter total (rounds missing) is returned unchanged.
    """
    left = max(0, num_tokens - 1)
    out: list[int] = []
    for n in committed_per_round:
        if left <= 0:
            break
        out.append(min(int(n), left))
        left -= out[-1]
    return out


def compare_rounds(got: Sequence[int], want: Sequence[int]) -> tuple[int, int | None]:
    """Agreement of two per-round committed counts over the same output.

    Returns ``(same, first)``: ``same`` counts the rounds of ``got`` that start at the
    same output token as a round of ``want`` and commit as many tokens (after a
    difference the rounds may realign); ``first`` is the index of the first round
    where the two differ (a length difference counts), None when equal.
    """

    def starts(rounds: Sequence[int]) -> set[tuple[int, int]]:
        out, start = set(), 0
        for n in rounds:
            out.add((start, int(n)))
            start += int(n)
        return out

    same = len(starts(got) & starts(want))
    return same, first_mismatch(got, want)
