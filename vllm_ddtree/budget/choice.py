"""Adaptive tree budget (``ddtree_budget: "auto"``): expected tokens per round and the
budget that maximises tokens per second.

DDTree's tree of budget ``b`` holds the ``b`` most probable prefixes under the
drafter's factorized distribution, so the trees of all budgets are nested: the tree
for ``b`` is the ``b`` best-scoring nodes of the tree for any larger budget (a
parent's score is never below its child's, so the set is prefix-closed). If the
target's tokens followed the drafter's distribution, a node is on the accepted path
with probability ``exp(score)``, hence the expected committed tokens of a round are
``1 + sum of the b largest exp(scores)`` — for every ``b`` from one tree build.

This module holds the primitives (expected tokens, cost interpolation, the argmax,
masking inactive nodes); ``vllm_ddtree.budget.policy`` measures the costs at start-up
and applies them each round. Shapes stay fixed: the target always verifies ``1 + B``
rows per tree request, of which only the first ``1 + b`` are *active*.
"""

from __future__ import annotations

import torch

__all__ = [
    "BudgetCostTable",
    "choose_batch_budget",
    "expected_committed_by_budget",
    "mask_inactive_nodes",
]


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


def mask_inactive_nodes(tokens: torch.Tensor, active_nodes: torch.Tensor) -> torch.Tensor:
    """Tree tokens with every node of index ``>= active_nodes[r]`` set to -1.

    A -1 node never matches a target token, so :func:`vllm_ddtree.walk.follow.follow_tree`
    on the masked tokens walks the budget-``b`` tree (the first ``b`` nodes: node order
    is best-first and every prefix of it is prefix-closed).

    Args:
        tokens: int64 ``[R, B]`` node tokens (``DraftTree.tokens``).
        active_nodes: int ``[R]`` (or a 0-dim tensor for the whole batch), ``b`` per
            request.

    Returns:
        int64 ``[R, B]``, a new tensor. No host sync.
    """
    cols = torch.arange(tokens.shape[1], device=tokens.device)
    active = active_nodes.to(device=tokens.device, dtype=torch.int64).reshape(-1, 1)
    return torch.where(cols[None, :] < active, tokens.to(torch.int64), -1)


class BudgetCostTable:
    """Measured seconds by context length and candidate budget.

    Args:
        contexts: int ``[C]`` increasing context lengths the costs were measured at.
        budgets: int64 ``[K]`` candidate budgets.
        seconds: float ``[C, K]`` a measured cost (a round's time, or one request's
            attention time per layer at query length ``1 + budget``).
        extrapolate: past the last context, continue the last segment's line (costs
            that grow linearly with the context, e.g. attention) instead of clamping.
    """

    def __init__(self, contexts: torch.Tensor, budgets: torch.Tensor, seconds: torch.Tensor,
                 extrapolate: bool = False):
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
        self.extrapolate = extrapolate

    def to(self, device: torch.device | str) -> BudgetCostTable:
        """The same table with its tensors on ``device``."""
        return BudgetCostTable(self.contexts.to(device), self.budgets.to(device),
                               self.seconds.to(device), self.extrapolate)

    def at(self, context_len: torch.Tensor) -> torch.Tensor:
        """Cost per candidate budget at ``context_len``, linear between measured
        contexts, clamped below the first and (unless ``extrapolate``) above the last.

        Args:
            context_len: a 0-dim tensor (e.g. the batch's longest context) or int
                ``[R]`` (one context per request), on the table's device.

        Returns:
            float32 ``[K]`` for a 0-dim input, ``[R, K]`` for ``[R]``. No host sync.
        """
        flat = context_len.float().reshape(-1)
        if len(self.contexts) == 1:
            out = self.seconds[0].expand(flat.shape[0], -1)
        else:
            upper = float("inf") if self.extrapolate else self.contexts[-1]
            ctx = flat.clamp(min=self.contexts[0]).clamp(max=upper)
            hi = torch.searchsorted(self.contexts, ctx).clamp(1, len(self.contexts) - 1)
            lo = hi - 1
            span = (self.contexts[hi] - self.contexts[lo]).clamp_min(1e-9)
            w = ((ctx - self.contexts[lo]) / span).clamp(min=0)
            if not self.extrapolate:
                w = w.clamp(max=1)
            w = w.unsqueeze(-1)
            out = (self.seconds[lo] * (1 - w) + self.seconds[hi] * w).clamp_min(0)
        return out[0] if context_len.dim() == 0 else out


def rows_seconds_for_batch(row_seconds: torch.Tensor, budgets: torch.Tensor,
                           num_reqs: int) -> torch.Tensor:
    """A batch's modeled verify time beside attention, per candidate budget.

    Args:
        row_seconds: float32 ``[K]``: one request's whole verify forward at ``1 + b_k``
            rows minus that at the smallest candidate (>= 0, non-decreasing; measured at
            start-up, ``BudgetPolicy.set_row_costs``).
        budgets: int64 ``[K]`` candidate budgets (increasing).
        num_reqs: requests in the batch (a host int).

    Returns:
        float32 ``[K]``: the cost at ``num_reqs * (1 + b_k)`` rows, piecewise linear in
        the row count over the one-request points ``1 + b_k`` (the GEMMs, MoE experts,
        lm_head and sampling see total rows), the last segment extended. No host sync.
    """
    xs = (1 + budgets).float()
    if xs.numel() == 1:
        return torch.zeros_like(row_seconds)
    x = num_reqs * xs
    hi = torch.searchsorted(xs, x).clamp(1, xs.numel() - 1)
    lo = hi - 1
    w = (x - xs[lo]) / (xs[hi] - xs[lo])
    return (row_seconds[lo] + w * (row_seconds[hi] - row_seconds[lo])).clamp_min(0)


# Candidates within this fraction of the best modeled rate count as equal, and the
# smallest of them wins: where the model cannot tell two budgets apart (flat verify
# attention at short context, a drafter whose extra nodes add almost nothing, row costs
# not measured: fixed shapes or no graphs) fewer rows and a smaller tree are the safer
# bet, and timing noise in the start-up tables does not pick the largest of equals.
RATE_TOLERANCE = 0.01


def choose_batch_budget(expected: torch.Tensor, round_seconds: torch.Tensor,
                        budgets: torch.Tensor) -> torch.Tensor:
    """The smallest candidate budget whose expected tokens per second are within
    :data:`RATE_TOLERANCE` of the best.

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
    rates = tokens / round_seconds
    near_best = rates >= (1 - RATE_TOLERANCE) * rates.max()
    best = torch.argmax(near_best.to(torch.int8)).reshape(1)  # the first: smallest b
    # index_select, not budgets[best]: a 0-dim tensor index may be read on the host.
    return budgets.index_select(0, best)[0]
