"""Adaptive tree budget (``ddtree_budget: "auto"``): expected tokens per round and the
budget that maximises tokens per second.

DDTree's tree of budget ``b`` holds the ``b`` most probable prefixes under the
drafter's factorized distribution, so the trees of all budgets are nested: the tree
for ``b`` is the ``b`` best-scoring nodes of the tree for any larger budget (a
parent's score is never below its child's, so the set is prefix-closed). If the
target's tokens followed the drafter's distribution, a node is on the accepted path
with probability ``exp(score)``, hence the expected committed tokens of a round are
``1 + sum of the b largest exp(scores)`` — for every ``b`` from one tree build.

Status: the estimate and the choice are implemented and CPU-tested (against a Monte
Carlo walk); the start-up cost measurement and the scheduler hook that would let the
number of verified nodes vary per step are not wired into vLLM yet.
"""

from __future__ import annotations

import torch

__all__ = ["BudgetCostTable", "choose_batch_budget", "expected_committed_by_budget"]


def expected_committed_by_budget(scores: torch.Tensor) -> torch.Tensor:
    """Expected committed tokens per round for every budget ``1..B``.

    Args:
        scores: float ``[R, B]``, cumulative draft log-probs of a tree's nodes
            (``DraftTree.scores``), any node order.

    Returns:
        float32 ``[R, B]``: column ``b - 1`` is ``1 + sum of the b largest
        exp(scores)`` of the row (the bonus token plus the expected accepted depth).
    """
    if scores.dim() != 2:
        raise ValueError(f"scores must be [R, B], got shape {tuple(scores.shape)}")
    probs = scores.float().exp().sort(dim=-1, descending=True).values
    return 1.0 + probs.cumsum(dim=-1)


class BudgetCostTable:
    """Measured seconds per round of a batch, by context length and budget.

    Args:
        contexts: int ``[C]`` increasing context lengths the costs were measured at.
        budgets: int64 ``[K]`` candidate budgets (those with captured CUDA graphs).
        seconds: float ``[C, K]`` measured round time (draft + verify + other).
    """

    def __init__(self, contexts: torch.Tensor, budgets: torch.Tensor, seconds: torch.Tensor):
        if contexts.dim() != 1 or budgets.dim() != 1:
            raise ValueError("contexts and budgets must be 1-D")
        if seconds.shape != (contexts.numel(), budgets.numel()):
            raise ValueError(f"seconds must be [{contexts.numel()}, {budgets.numel()}], "
                             f"got {tuple(seconds.shape)}")
        if contexts.numel() > 1 and not bool((contexts[1:] > contexts[:-1]).all()):
            raise ValueError("contexts must be strictly increasing")
        if not bool((seconds > 0).all()):
            raise ValueError("seconds must be positive")
        if not bool((budgets >= 1).all()):
            raise ValueError("budgets must be >= 1")
        self.contexts = contexts.float()
        self.budgets = budgets.long()
        self.seconds = seconds.float()

    def at(self, context_len: torch.Tensor) -> torch.Tensor:
        """float32 ``[K]``: round time per candidate budget at ``context_len`` (0-dim
        tensor, e.g. the batch's longest context), linear between measured contexts
        and clamped outside them. Stays on the tensors' device (no host sync)."""
        ctx = context_len.float().clamp(self.contexts[0], self.contexts[-1])
        hi = torch.searchsorted(self.contexts, ctx.reshape(1)).clamp(1, len(self.contexts) - 1)
        lo = hi - 1
        span = (self.contexts[hi] - self.contexts[lo]).clamp_min(1e-9)
        w = ((ctx - self.contexts[lo]) / span).clamp(0, 1)
        if len(self.contexts) == 1:
            return self.seconds[0]
        return (self.seconds[lo] * (1 - w).unsqueeze(-1) + self.seconds[hi] * w.unsqueeze(-1))[0]


def choose_batch_budget(expected: torch.Tensor, round_seconds: torch.Tensor,
                        budgets: torch.Tensor) -> torch.Tensor:
    """The candidate budget that maximises the batch's expected tokens per second.

    One budget per batch: verify steps keep a uniform ``1 + b`` query length so
    they replay one captured graph.

    Args:
        expected: float ``[R, B_max]`` from :func:`expected_committed_by_budget`.
        round_seconds: float ``[K]`` round time per candidate (``BudgetCostTable.at``).
        budgets: int64 ``[K]`` candidate budgets, each in ``1..B_max`` (checked once
            where the candidates are chosen, not here: that would sync the host).

    Returns:
        int64 0-dim tensor on ``expected``'s device (no host sync).
    """
    if budgets.numel() != round_seconds.numel():
        raise ValueError("budgets and round_seconds must have the same length")
    tokens = expected[:, budgets - 1].sum(dim=0)  # [K]
    return budgets[torch.argmax(tokens / round_seconds)]
