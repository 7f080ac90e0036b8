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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def selector_loss(drafter, hidden: torch.Tensor, logits: torch.Tensor,
                  anchor_ids: torch.Tensor, labels: torch.Tensor,
                  num_candidates: int | None = None
                  ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Selector cross-entropy (scalar fp32) and detached stats.

    ``drafter``: a ``DFlash2DraftModel``; ``hidden [B, N, L, H]`` its final-normed states
    of depths 1..L, ``logits [B, N, L, V]`` their draft logits, ``anchor_ids [B, N]`` the
    blocks' anchor tokens, ``labels [B, N, L]`` the true tokens. ``num_candidates``:
    candidates scored per depth, the drafter's top by logit (default its
    ``selector_top_k``; at most V). Stats: ``sel_cover`` (fraction of depths whose truth
    is a candidate), ``sel_acc`` (selector top-1 among those) and ``sel_tau`` (1 +
    leading depths the teacher-forced selector gets right).
    """
    k = drafter.selector_top_k if num_candidates is None else num_candidates
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= logits.shape[-1]:
        raise ValueError(f"num_candidates={num_candidates!r} is not allowed: an int in "
                         f"1..{logits.shape[-1]} (the vocabulary) or None")
    with torch.no_grad():
        unary, ids = torch.topk(logits.float(), k, dim=-1)
        hit = ids == labels[..., None]
        covered = hit.any(-1)
        slot = hit.to(torch.int64).argmax(-1)
    previous = torch.cat([anchor_ids[..., None], labels[..., :-1]], dim=-1)
    scores = drafter.candidate_selector.given(ids, unary, hidden, previous)
    ce = F.cross_entropy(scores.flatten(0, -2), slot.flatten(), reduction="none")
    ce = ce.view(labels.shape)
    loss = (ce * covered).sum() / covered.sum().clamp(min=1)
    with torch.no_grad():
        right = (scores.argmax(-1) == slot) & covered
        stats = {"sel_cover": covered.float().mean(),
                 "sel_acc": right.float().sum() / covered.float().sum().clamp(min=1),
                 "sel_tau": 1.0 + right.long().cumprod(-1).sum(-1).float().mean()}
    return loss, stats
