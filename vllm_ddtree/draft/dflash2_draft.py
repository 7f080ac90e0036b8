"""DDTree drafting with a DFlash2 drafter inside the speculator's draft step.

:class:`SelectorDrafting` replaces the marginal tree build of
``DDTreeSpeculator._generate_draft`` when the drafter is a ``DFlash2DraftModel``
(:mod:`vllm_ddtree.draft.dflash2_model`): the drafter's hidden rows of depths 1..L give
the top-K candidates, unary terms and the marginals' normalizer
(``compute_candidates``; K = ``selector_tree.tree_candidates``: as many as a node may
have children), the selector scores the edges from the verified anchor (row 0 of each
request's query block), and :func:`vllm_ddtree.tree.selector_tree.build_selector_tree`
keeps the ``B`` best selector paths, each position weighed by its candidates' marginal
mass. PyTorch ops on device tensors only, no host reads: the draft step's CUDA graph
captures it as it captures the marginal build.
"""

from __future__ import annotations

import torch

from vllm_ddtree.tree.draft_tree import DraftTree
from vllm_ddtree.tree.selector_tree import (
    build_selector_tree,
    candidate_log_mass,
    tree_candidates,
)

__all__ = ["SelectorDrafting"]


class SelectorDrafting:
    """Selector-scored trees of ``budget`` nodes over ``num_depths`` positions.

    ``block_size``: query rows a request (the anchor is row 0 of each block);
    ``top_k``: children per node (None: as many as the candidates);
    ``num_candidates``: candidates a position (``selector_tree.tree_candidates``).
    """

    def __init__(self, *, num_depths: int, budget: int, top_k: int | None, block_size: int,
                 num_candidates: int, max_num_reqs: int, device: torch.device):
        self.num_depths = num_depths
        self.budget = budget
        self.top_k = top_k
        self.num_candidates = num_candidates
        self.anchor_rows = torch.arange(max_num_reqs, dtype=torch.int64,
                                        device=device) * block_size
        # The ancestor bits' bit table is made on the host once per device; make it
        # before any capture (a host-to-device copy cannot run while a graph captures).
        k = num_candidates
        ids = torch.zeros(1, num_depths, k, dtype=torch.int64, device=device)
        scores = torch.zeros(1, num_depths, k, k, device=device)
        build_selector_tree(ids, scores, budget, top_k).ancestor_bits()

    def draft(self, model, hidden_rows: torch.Tensor, input_ids: torch.Tensor, num_reqs: int,
              out: DraftTree) -> None:
        """Write the trees of ``num_reqs`` requests into ``out`` (``[R, B]`` views of the
        speculator's buffers, ``packed_bits`` included).

        ``model``: the ``DFlash2Qwen3ForCausalLM``; ``hidden_rows`` ``[R * L, H]`` its
        final-normed states at depths 1..L, request-major; ``input_ids``: the drafter's
        query-token buffer (each request's anchor at ``r * block_size``).
        """
        depths = self.num_depths
        ids, unary, log_norm = model.compute_candidates(hidden_rows, self.num_candidates)
        ids = ids.view(num_reqs, depths, -1)
        unary = unary.view(num_reqs, depths, -1)
        mass = candidate_log_mass(unary, log_norm.view(num_reqs, depths))
        anchors = input_ids[self.anchor_rows[:num_reqs]].to(torch.int64)
        scores = model.model.candidate_selector(
            ids, unary, hidden_rows.view(num_reqs, depths, -1), anchors)
        tree = build_selector_tree(ids, scores, self.budget, self.top_k, mass)
        out.tokens.copy_(tree.tokens)
        out.parents.copy_(tree.parents)
        out.depths.copy_(tree.depths)
        out.scores.copy_(tree.scores)
        out.packed_bits.copy_(tree.ancestor_bits())


def selector_drafting_for(vllm_config, speculator, device: torch.device
                          ) -> SelectorDrafting | None:
    """A :class:`SelectorDrafting` for ``speculator`` (a ``DDTreeSpeculator`` after its
    own set-up: ``num_draft_depths``, ``budget``, ``top_k``, ``num_query_per_req``,
    ``max_num_reqs``) when the drafter is a DFlash2 one, else None."""
    from vllm_ddtree.drafter_config import dflash2_config_of, is_dflash2

    hf_config = vllm_config.speculative_config.draft_model_config.hf_config
    # vLLM wraps DFlash drafter configs in an EAGLEConfig that holds the drafter's own.
    hf_config = getattr(hf_config, "model", None) or hf_config
    if not is_dflash2(hf_config):
        return None
    # (ddtree_top_k 1, the chain walk: the checkpoint's K, as vLLM's DFlash2 drafts)
    k = tree_candidates(dflash2_config_of(hf_config)["selector_top_k"], speculator.budget,
                        speculator.top_k, hf_config.vocab_size)
    return SelectorDrafting(
        num_depths=speculator.num_draft_depths, budget=speculator.budget,
        top_k=speculator.top_k, block_size=speculator.num_query_per_req,
        num_candidates=k, max_num_reqs=speculator.max_num_reqs, device=device)
