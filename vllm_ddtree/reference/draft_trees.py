"""The draft tree of one reference round, for DFlash and DFlash2 drafters.

Which tree a method drafts:

- ``"dflash"``: the chain of the marginals' argmax (``block_size - 1`` nodes).
- ``"dflash2"`` (DFlash2 drafter): the selector walk from the verified anchor, the best
  candidate at each position given the previous pick (vLLM's DFlash2 chain).
- ``"ddtree"``: ``budget`` nodes best first, over the marginals (DFlash; DFlash2 with
  ``draft_scores="marginals"``) or over the selector's path scores (DFlash2 with
  ``draft_scores="selector"``, its default), ranking ``tree_candidates`` candidates a
  position and weighing each position by its candidates' marginal mass
  (``vllm_ddtree.tree.selector_tree``).

The verify that follows samples the target alone (keyed by seed and position) and walks
the tree with its tokens, so every tree here is lossless at any temperature.
"""

from __future__ import annotations

from vllm_ddtree.tree.draft_tree import DraftTree, build_ddtree
from vllm_ddtree.tree.selector_tree import build_selector_tree, tree_candidates

DRAFT_SCORES = ("selector", "marginals")


def uses_selector(drafter, method: str, draft_scores: str | None) -> bool:
    """Whether the round's tree is built over selector scores."""
    from vllm_ddtree.reference.dflash2 import DFlash2DraftModel

    if not isinstance(drafter, DFlash2DraftModel):
        return False
    return method == "dflash2" or (method == "ddtree" and draft_scores != "marginals")


def draft_tree(drafter, runner, context, bonus: int, position: int, method: str,
               budget: int, top_k: int | None, draft_scores: str | None) -> DraftTree:
    """The ``[1, nodes]`` :class:`DraftTree` drafted after ``bonus`` (at ``position``);
    ``runner`` gives the target's ``embed`` and ``lm_head_logits``."""
    depth = drafter.block_size - 1
    if uses_selector(drafter, method, draft_scores):
        if method == "dflash2":  # the chain walk: top-1 children over the checkpoint's K
            budget, top_k = depth, 1
        k = tree_candidates(drafter.selector_top_k, budget, top_k, drafter.config.vocab_size)
        block = drafter.draft_block(bonus, position, context, runner.embed,
                                    runner.lm_head_logits, num_candidates=k)
        return build_selector_tree(block.candidate_ids[None], block.edge_scores[None],
                                   budget=budget, top_k=top_k,
                                   position_log_mass=block.candidate_log_mass()[None])
    logits = drafter.block_logits(bonus, position, context, runner.embed,
                                  runner.lm_head_logits)[None]  # [1, L, V]
    if method == "dflash":
        return build_ddtree(logits, budget=depth, top_k=1)
    return build_ddtree(logits, budget=budget, top_k=top_k)
