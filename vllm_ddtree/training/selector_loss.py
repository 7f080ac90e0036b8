"""The DFlash2 candidate selector's training loss (teacher forced).

At every depth of a training block the selector scores the drafter's top candidates
after the true previous token (the anchor at depth 1; :meth:`CandidateSelector.given`);
the loss is the cross-entropy of those scores against the true token's slot, over the
depths whose true token is among the candidates. The unary term (the drafter's own
logits) is held fixed here: the DFlash loss trains it.

How many candidates: a DDTree tree ranks as many per position as a node may have
children (``vllm_ddtree.tree.selector_tree.tree_candidates``: 64 at B = 64), far more
than the checkpoint's ``selector_top_k`` (the chain walk's K, 8 on the embedded
drafter). Trained on K = 8 only, the edge term of the candidates ranked 9..64 is never
fitted, yet the tree orders them by it; ``num_candidates`` trains the count the tree
uses.

The loss splits in two: :func:`selector_targets` (what the drafter's outputs and the
labels fix: candidates, unary term, predecessors, the truth's slot) and
:func:`selector_cross_entropy` (what the selector's weights change), so that a refit of
the selector alone can compute the first once (:mod:`vllm_ddtree.training.train_selector`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class SelectorTargets:
    """Per depth of a batch of blocks (any leading shape ``[...]``, L depths last):
    ``candidate_ids`` int64 ``[..., L, K]`` and ``unary`` fp32 ``[..., L, K]`` (the
    drafter's top-K tokens and their logits), ``previous`` int64 ``[..., L]`` (the true
    previous token: the anchor at depth 1), ``slot`` int64 ``[..., L]`` (the truth's slot
    among the candidates, 0 where it is none) and ``covered`` bool ``[..., L]`` (it is
    one)."""

    candidate_ids: torch.Tensor
    unary: torch.Tensor
    previous: torch.Tensor
    slot: torch.Tensor
    covered: torch.Tensor


def check_num_candidates(num_candidates, vocab_size: int) -> None:
    if (isinstance(num_candidates, bool) or not isinstance(num_candidates, int)
            or not 1 <= num_candidates <= vocab_size):
        raise ValueError(f"num_candidates={num_candidates!r} is not allowed: an int in "
                         f"1..{vocab_size} (the vocabulary)")


@torch.no_grad()
def selector_targets(logits: torch.Tensor, anchor_ids: torch.Tensor, labels: torch.Tensor,
                     num_candidates: int) -> SelectorTargets:
    """The :class:`SelectorTargets` of blocks with draft logits ``[..., L, V]``, anchor
    tokens ``anchor_ids [...]`` and true tokens ``labels [..., L]``; the candidates are
    the ``num_candidates`` best tokens by logit."""
    check_num_candidates(num_candidates, logits.shape[-1])
    unary, ids = torch.topk(logits.float(), num_candidates, dim=-1)
    hit = ids == labels[..., None]
    previous = torch.cat([anchor_ids[..., None], labels[..., :-1]], dim=-1)
    return SelectorTargets(ids, unary, previous, hit.to(torch.int64).argmax(-1), hit.any(-1))


def selector_cross_entropy(selector, hidden: torch.Tensor, targets: SelectorTargets
                           ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Cross-entropy (scalar fp32) of ``selector``'s scores (a ``CandidateSelector``,
    drafter states ``hidden [..., L, H]``) against the truth's slot, averaged over the
    covered depths, and detached stats: ``sel_cover`` (fraction of depths whose truth
    is a candidate), ``sel_acc`` (selector top-1 among those) and ``sel_tau`` (1 +
    leading depths the teacher-forced selector gets right)."""
    scores = selector.given(targets.candidate_ids, targets.unary, hidden, targets.previous)
    covered = targets.covered
    ce = F.cross_entropy(scores.flatten(0, -2), targets.slot.flatten(), reduction="none")
    loss = (ce.view(covered.shape) * covered).sum() / covered.sum().clamp(min=1)
    with torch.no_grad():
        right = (scores.argmax(-1) == targets.slot) & covered
        stats = {"sel_cover": covered.float().mean(),
                 "sel_acc": right.float().sum() / covered.float().sum().clamp(min=1),
                 "sel_tau": 1.0 + right.long().cumprod(-1).sum(-1).float().mean()}
    return loss, stats


def selector_loss(drafter, hidden: torch.Tensor, logits: torch.Tensor,
                  anchor_ids: torch.Tensor, labels: torch.Tensor,
                  num_candidates: int | None = None
                  ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Selector cross-entropy (scalar fp32) and detached stats
    (:func:`selector_cross_entropy`).

    ``drafter``: a ``DFlash2DraftModel``; ``hidden [B, N, L, H]`` its final-normed states
    of depths 1..L, ``logits [B, N, L, V]`` their draft logits, ``anchor_ids [B, N]`` the
    blocks' anchor tokens, ``labels [B, N, L]`` the true tokens. ``num_candidates``:
    candidates scored per depth, the drafter's top by logit (default its
    ``selector_top_k``; at most V).
    """
    k = drafter.selector_top_k if num_candidates is None else num_candidates
    targets = selector_targets(logits, anchor_ids, labels, k)
    return selector_cross_entropy(drafter.candidate_selector, hidden, targets)
