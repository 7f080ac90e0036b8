# SPDX-License-Identifier: Apache-2.0
"""The acceptance walk: from the root, follow the child whose token the target chose.

Pure PyTorch (CPU and CUDA); ``walk_kernel.verify_walk_triton`` is the same walk in one
Triton launch, with :func:`follow_tree` as its reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_ddtree.tree.draft_tree import DraftTree

__all__ = ["WalkResult", "follow_tree", "follow_tree_reference"]

@dataclass
class WalkResult:
    """Outcome of walking the draft trees with the target's tokens.

    ``L_max`` is the maximum depth of the trees (or the ``max_depth`` passed to
    :func:`follow_tree`).

    Attributes:
        accepted_nodes: int64 ``[R, L_max]``, node indices of the accepted path
            in depth order, padded with -1.
        accepted_depth: int64 ``[R]``, a = number of accepted nodes (0..L_max).
        committed_tokens: int64 ``[R, L_max + 1]``, the accepted path's tokens
            then the bonus token, padded with -1.
        num_committed: int64 ``[R]``, a + 1.
        bonus_tokens: int64 ``[R]``, the target's token at the last accepted
            node (at the root when a = 0); the root of the next round.
        kv_src_rows: int64 ``[R, L_max]``, verify-batch rows (node index + 1) of
            the accepted nodes, padded with -1. Column ``k`` must move to row
            offset ``k + 1`` relative to the root row (positions ``seq_len + 1 ..
            seq_len + a``); read all sources before writing (a source can equal
            its destination).
    """

    accepted_nodes: torch.Tensor
    accepted_depth: torch.Tensor
    committed_tokens: torch.Tensor
    num_committed: torch.Tensor
    bonus_tokens: torch.Tensor
    kv_src_rows: torch.Tensor


def _check_walk_args(tree: DraftTree, target_tokens: torch.Tensor) -> None:
    expected = (tree.num_requests, 1 + tree.budget)
    if target_tokens.dim() != 2 or tuple(target_tokens.shape) != expected:
        raise ValueError(
            f"target_tokens must be [R, 1 + B] = {list(expected)}, got {list(target_tokens.shape)}"
        )


def follow_tree(
    tree: DraftTree, target_tokens: torch.Tensor, max_depth: int | None = None
) -> WalkResult:
    """Walk the draft trees with the target's tokens (batched over requests).

    From the root, move to the child whose token equals the target's token at
    the current node; stop when no child matches. Children of a node have
    distinct tokens (a malformed tree with duplicates takes the lowest index).

    Args:
        tree: the draft trees, ``[R, B]``.
        target_tokens: int64 ``[R, 1 + B]``, the target's token at the root
            (column 0) and at node ``i`` (column ``i + 1``).
        max_depth: pad width ``L_max``; must be >= the trees' maximum depth.
            Default: ``tree.depths.max()``, which costs one device sync.

    Returns:
        A :class:`WalkResult`.
    """
    _check_walk_args(tree, target_tokens)
    if max_depth is None:
        max_depth = int(tree.depths.max().item()) if tree.depths.numel() else 0
    num_requests, budget = tree.num_requests, tree.budget
    device = tree.device
    target_tokens = target_tokens.to(torch.int64)
    tokens = tree.tokens.to(torch.int64)
    parents = tree.parents.to(torch.int64)
    node_ids = torch.arange(budget, dtype=torch.int64, device=device)

    current = torch.full((num_requests,), -1, dtype=torch.int64, device=device)
    accepted = torch.full((num_requests, max_depth), -1, dtype=torch.int64, device=device)
    for step in range(max_depth):
        wanted = torch.gather(target_tokens, 1, (current + 1).unsqueeze(1))
        # A stopped walk stays stopped without extra state: `current` and its
        # target token do not change, so nothing matches again.
        match = (parents == current.unsqueeze(1)) & (tokens == wanted)
        child = torch.where(match, node_ids, budget).amin(dim=1) if budget else current
        alive = match.any(dim=1)
        current = torch.where(alive, child, current)
        accepted[:, step] = torch.where(alive, child, -1)

    is_accepted = accepted >= 0
    accepted_depth = is_accepted.sum(dim=1)
    bonus = torch.gather(target_tokens, 1, (current + 1).unsqueeze(1)).squeeze(1)
    committed = torch.full((num_requests, max_depth + 1), -1, dtype=torch.int64, device=device)
    committed[:, :max_depth] = torch.where(
        is_accepted, torch.gather(tokens, 1, accepted.clamp(min=0)), -1
    )
    committed.scatter_(1, accepted_depth.unsqueeze(1), bonus.unsqueeze(1))
    return WalkResult(
        accepted_nodes=accepted,
        accepted_depth=accepted_depth,
        committed_tokens=committed,
        num_committed=accepted_depth + 1,
        bonus_tokens=bonus,
        kv_src_rows=torch.where(is_accepted, accepted + 1, -1),
    )


def follow_tree_reference(
    tree: DraftTree, target_tokens: torch.Tensor, max_depth: int | None = None
) -> WalkResult:
    """Per-request Python version of :func:`follow_tree` (the test oracle)."""
    _check_walk_args(tree, target_tokens)
    tokens = tree.tokens.tolist()
    parents = tree.parents.tolist()
    targets = target_tokens.tolist()
    if max_depth is None:
        max_depth = max((d for row in tree.depths.tolist() for d in row), default=0)

    rows = {name: [] for name in ("nodes", "depth", "committed", "bonus", "src")}
    for r in range(tree.num_requests):
        path = []
        current = -1
        while True:
            children = [i for i, p in enumerate(parents[r]) if p == current]
            matches = [i for i in children if tokens[r][i] == targets[r][current + 1]]
            if not matches:
                break
            current = matches[0]
            path.append(current)
        bonus = targets[r][current + 1]
        pad = [-1] * (max_depth - len(path))
        rows["nodes"].append(path + pad)
        rows["depth"].append(len(path))
        rows["committed"].append([tokens[r][i] for i in path] + [bonus] + pad)
        rows["bonus"].append(bonus)
        rows["src"].append([i + 1 for i in path] + pad)

    def as_tensor(data: list, *shape: int) -> torch.Tensor:
        return torch.tensor(data, dtype=torch.int64, device=tree.device).reshape(*shape)

    num_requests = tree.num_requests
    depth = as_tensor(rows["depth"], num_requests)
    return WalkResult(
        accepted_nodes=as_tensor(rows["nodes"], num_requests, max_depth),
        accepted_depth=depth,
        committed_tokens=as_tensor(rows["committed"], num_requests, max_depth + 1),
        num_committed=depth + 1,
        bonus_tokens=as_tensor(rows["bonus"], num_requests),
        kv_src_rows=as_tensor(rows["src"], num_requests, max_depth),
    )
