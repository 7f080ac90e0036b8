# SPDX-License-Identifier: Apache-2.0
"""DDTree trees over a DFlash2 candidate selector's path scores.

A DFlash2 drafter gives, per block position ``l = 1..L``, ``K`` candidate tokens and
edge scores ``s[l, p, c]`` of candidate ``c`` after predecessor slot ``p`` (the anchor
at ``l = 1``; see :mod:`vllm_ddtree.reference.dflash2`). Here a node is a path of
candidate slots from the anchor; the log-probability of a child ``c`` of a node whose
last slot is ``p`` is ``log_softmax(s[l, p, :])[c] + m[l]``, ``m[l] <= 0`` the log of the
marginal probability mass of position ``l``'s candidates (``position_log_mass``): the
selector redistributes that mass among them given the predecessor, and what lies
outside the candidates is on no path. Without ``m`` every position would look certain
to hold one of its K candidates and the tree would grow deep where the drafter is
unsure. A node's score is the fp32 sum along its path. :func:`build_selector_tree` keeps
the ``budget`` best nodes, best first, with the node order of
:mod:`vllm_ddtree.tree.draft_tree` (descending score, then shallower, then parent
index, then the child's rank among its siblings; siblings rank by descending log-prob,
then ascending slot). With ``top_k = 1`` and ``budget = L`` the tree is one chain: at
every position the best candidate given the previous pick, which is the walk vLLM's
DFlash2 drafts.

A tree ranks more candidates than the checkpoint's ``selector_top_k`` (the chain
walk's K): :func:`tree_candidates`, as many as a node may have children (``top_k``, else
the budget), so it can branch as widely as the marginal tree. On the embedded pair's
DFlash2 drafter, its selector then trained on 8 candidates (the first 16 HumanEval
prompts, B = 64), 64 candidates with the mass term committed 4.21 tokens per round at
T = 0 and 1.83 at T = 1, against 3.92 and 1.61 with the checkpoint's 8 and no mass term;
a selector trained on the candidates the tree ranks gains more
(:mod:`vllm_ddtree.training.train_selector`).

Pure PyTorch, no host reads: it runs inside a CUDA graph as it does on the CPU.
"""

from __future__ import annotations

import heapq

import torch

from vllm_ddtree.config import tree_capacity
from vllm_ddtree.tree.draft_tree import (
    DraftTree,
    _add_f32,
    _draft_logprobs,
    _ranked_top_k,
    _sort_keys,
    merge_beams,
)

__all__ = [
    "build_selector_tree",
    "build_selector_tree_reference",
    "candidate_log_mass",
    "top_k_candidates",
    "tree_candidates",
]


def top_k_candidates(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` best tokens of ``logits [..., V]``: (values fp32 ``[..., k]``, ids int64
    ``[..., k]``), by descending logit then ascending token id (NaN ranks last)."""
    values = logits.float()
    values = torch.where(torch.isnan(values), float("-inf"), values)
    return _ranked_top_k(values, k)


def tree_candidates(selector_top_k: int, budget: int, top_k: int | None,
                    vocab_size: int) -> int:
    """Candidates per position a selector tree ranks: as many as a node may have
    children (``top_k``, else ``budget``), at least the checkpoint's ``selector_top_k``
    (the chain walk's K), at most ``vocab_size``."""
    children = budget if top_k is None else top_k
    return max(1, min(vocab_size, max(selector_top_k, children)))


def candidate_log_mass(candidate_logits: torch.Tensor, log_normalizer: torch.Tensor
                       ) -> torch.Tensor:
    """``log sum_c exp(candidate_logits[..., c]) - log_normalizer`` fp32 ``[...]``: the
    log of the marginal probability mass of each position's candidates (``<= 0``);
    ``log_normalizer`` is the logsumexp of the position's whole logits."""
    mass = torch.logsumexp(candidate_logits.float(), dim=-1) - log_normalizer.float()
    return mass.clamp(max=0.0)


def _check_args(candidate_ids: torch.Tensor, edge_scores: torch.Tensor, budget: int,
                top_k: int | None) -> int:
    """Shapes, budget and top_k; returns the children kept per node."""
    if not isinstance(candidate_ids, torch.Tensor) or candidate_ids.dim() != 3:
        raise ValueError("candidate_ids must be an int tensor [R, L, K], got "
                         f"{getattr(candidate_ids, 'shape', type(candidate_ids).__name__)}")
    num_requests, num_depths, k_all = candidate_ids.shape
    want = (num_requests, num_depths, k_all, k_all)
    if not isinstance(edge_scores, torch.Tensor) or tuple(edge_scores.shape) != want:
        raise ValueError(f"edge_scores must be a float tensor {list(want)}, got "
                         f"{getattr(edge_scores, 'shape', type(edge_scores).__name__)}")
    if not edge_scores.is_floating_point():
        raise ValueError(f"edge_scores must be floating point, got {edge_scores.dtype}")
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(f"budget={budget!r} is not allowed: an int >= 1")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int)
                              or top_k < 1):
        raise ValueError(f"top_k={top_k!r} is not allowed: None or an int >= 1")
    k = k_all if top_k is None else min(top_k, k_all)
    capacity = tree_capacity(k, num_depths)
    if capacity < budget:
        raise ValueError(f"budget={budget} is not allowed: the tree holds at most {capacity} "
                         f"nodes (L={num_depths} positions, {k} candidates each)")
    return min(k, budget)


def _ranked_children(edge_scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (request, position, predecessor slot): the ``k`` best child slots.
    Returns (log-probs fp32 ``[R, L, K, k]``, slots int64 ``[R, L, K, k]``)."""
    return _ranked_top_k(_draft_logprobs(edge_scores), k)


def build_selector_tree(candidate_ids: torch.Tensor, edge_scores: torch.Tensor, budget: int,
                        top_k: int | None = None,
                        position_log_mass: torch.Tensor | None = None) -> DraftTree:
    """The ``budget`` best selector paths of each request, best first (module docstring).

    Args:
        candidate_ids: int64 ``[R, L, K]``, the candidates of positions 1..L.
        edge_scores: float ``[R, L, K, K]``, ``[r, l, p, c]`` the selector score of
            candidate ``c`` after slot ``p`` of position ``l - 1`` (at ``l = 0`` every
            row ``p`` is the anchor's; row 0 is read).
        budget: B >= 1 nodes per tree.
        top_k: children kept per node (default K, capped at K).
        position_log_mass: fp32 ``[R, L]`` (:func:`candidate_log_mass`), added to every
            child's log-prob at its position; None adds nothing (the chain walk, whose
            picks it cannot change).

    Returns:
        A :class:`~vllm_ddtree.tree.draft_tree.DraftTree` ``[R, B]``; ``scores`` are
        the fp32 path log-probs. One Python loop over the L positions, batched
        over requests; equal to :func:`build_selector_tree_reference`.
    """
    k = _check_args(candidate_ids, edge_scores, budget, top_k)
    num_requests, num_depths, _ = candidate_ids.shape
    child_lp, child_slot = _ranked_children(edge_scores, k)
    if position_log_mass is not None:
        _check_mass(position_log_mass, num_requests, num_depths)
        child_lp = child_lp + _safe_mass(position_log_mass)[:, :, None, None]
    ids = candidate_ids.to(torch.int64)

    beam_scores, beam_tokens, beam_parents, beam_slots = [], [], [], []
    for d in range(num_depths):
        if d == 0:
            width = min(budget, k)
            scores = child_lp[:, 0, 0, :width]
            slots = child_slot[:, 0, 0, :width]
            parents = torch.full_like(slots, -1)
        else:
            prev_slots, prev_scores = beam_slots[-1], beam_scores[-1]
            prev_width = prev_slots.shape[1]
            index = prev_slots[:, :, None].expand(-1, -1, k)
            lp = torch.gather(child_lp[:, d], 1, index)  # [R, W, k]
            slot = torch.gather(child_slot[:, d], 1, index)
            # Parent-major candidates: the index tie-break is (parent, rank).
            cand = (prev_scores[:, :, None] + lp).reshape(num_requests, prev_width * k)
            width = min(budget, prev_width * k)
            chosen = torch.topk(_sort_keys(cand), width, dim=-1, sorted=True).indices
            scores = torch.gather(cand, 1, chosen)
            slots = torch.gather(slot.reshape(num_requests, -1), 1, chosen)
            parents = chosen // k
        beam_scores.append(scores)
        beam_slots.append(slots)
        beam_tokens.append(torch.gather(ids[:, d], 1, slots))
        beam_parents.append(parents)

    return merge_beams(beam_scores, beam_tokens, beam_parents, budget)


def _check_mass(position_log_mass: torch.Tensor, num_requests: int, num_depths: int) -> None:
    if (not isinstance(position_log_mass, torch.Tensor)
            or tuple(position_log_mass.shape) != (num_requests, num_depths)):
        raise ValueError(f"position_log_mass must be a float tensor [{num_requests}, "
                         f"{num_depths}], got "
                         f"{getattr(position_log_mass, 'shape', type(position_log_mass).__name__)}")


def _safe_mass(position_log_mass: torch.Tensor) -> torch.Tensor:
    """fp32, NaN -> 0 (no term), at most 0, -0.0 -> +0.0 (children never outscore their
    parent; the integer sort keys agree with float comparison)."""
    mass = torch.nan_to_num(position_log_mass.float(), nan=0.0, posinf=0.0)
    return mass.clamp(max=0.0) + 0.0


def build_selector_tree_reference(candidate_ids: torch.Tensor, edge_scores: torch.Tensor,
                                  budget: int, top_k: int | None = None,
                                  position_log_mass: torch.Tensor | None = None) -> DraftTree:
    """Per-request heapq best-first enumeration (the oracle of
    :func:`build_selector_tree`; same arguments, result and errors)."""
    k = _check_args(candidate_ids, edge_scores, budget, top_k)
    num_requests, num_depths, k_all = candidate_ids.shape
    if position_log_mass is not None:
        _check_mass(position_log_mass, num_requests, num_depths)
    rows = {name: [] for name in ("tokens", "parents", "depths", "scores")}
    for r in range(num_requests):
        def children(depth: int, prev_slot: int, r=r) -> list[tuple[float, int]]:
            lp = _draft_logprobs(edge_scores[r, depth - 1, prev_slot])
            if position_log_mass is not None:
                lp = lp + _safe_mass(position_log_mass)[r, depth - 1]
            lp = lp.tolist()
            order = sorted(range(k_all), key=lambda c: (-lp[c], c))
            return [(lp[c], c) for c in order[:k]]

        tokens, parents, depths, scores, slots = [], [], [], [], []
        first = children(1, 0)
        # (-score, depth, parent node, rank, parent score, the parent's ranked children)
        frontier = [(-first[0][0], 1, -1, 0, 0.0, first)]
        while len(tokens) < budget:
            neg, depth, parent, rank, parent_score, ranked = heapq.heappop(frontier)
            node = len(tokens)
            slot = ranked[rank][1]
            tokens.append(int(candidate_ids[r, depth - 1, slot]))
            parents.append(parent)
            depths.append(depth)
            scores.append(-neg)
            slots.append(slot)
            if rank + 1 < len(ranked):
                sibling = _add_f32(parent_score, ranked[rank + 1][0])
                heapq.heappush(frontier, (-sibling, depth, parent, rank + 1, parent_score,
                                          ranked))
            if depth < num_depths:
                kids = children(depth + 1, slot)
                heapq.heappush(frontier, (-_add_f32(-neg, kids[0][0]), depth + 1, node, 0,
                                          -neg, kids))
        for name, values in zip(("tokens", "parents", "depths", "scores"),
                                (tokens, parents, depths, scores), strict=True):
            rows[name].append(values)
    device = candidate_ids.device

    def as_tensor(name: str, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(rows[name], dtype=dtype, device=device).reshape(num_requests, budget)

    return DraftTree(tokens=as_tensor("tokens", torch.int64),
                     parents=as_tensor("parents", torch.int64),
                     depths=as_tensor("depths", torch.int64),
                     scores=as_tensor("scores", torch.float32))
