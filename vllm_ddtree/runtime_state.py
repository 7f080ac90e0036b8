"""Per-process DDTree state shared by the speculator, the verifier and the patches.

The V2 runner has no channel for tree structure: it stores only the draft *tokens*
(``req_states.draft_tokens``, ``model_runner.py:1521``) and its attention metadata has
no request ids. DDTree therefore keeps its own persistent GPU buffers here, written
by :class:`vllm_ddtree.draft.speculator.DDTreeSpeculator` and read by
:class:`vllm_ddtree.verify.verifier.DDTreeVerifier` and the ``tree_positions`` patch:

* request-state indexed (``idx_mapping`` values, like vLLM's ``RequestState``):
  ``parents`` / ``depths`` ``[max_num_reqs, B]`` and ``ancestor_bits``
  ``[max_num_reqs, 1+B, W]`` of the tree whose tokens the runner holds as draft
  tokens;
* batch-token ordered: ``positions [max_num_tokens]`` (RoPE positions of the verify
  batch, a stable address for FULL CUDA graphs) and, in ``TREE_MASK_STATE``, the
  per-token ancestor bits the MLA tree backend reads;
* the last walk (batch order), handed from the verifier to the next ``propose``;
* with ``ddtree_budget: "auto"`` (:meth:`DDTreeRuntimeState.enable_adaptive_`):
  ``active_nodes [max_num_reqs]`` (request-state indexed ``b`` of each stored tree),
  and, in ``TREE_MASK_STATE``, the batch-ordered ``active_query_lens`` the tree
  backends use to skip inactive rows.

One worker process serves one model runner, so a module-level singleton is enough
(as ``TREE_MASK_STATE``). Everything here is pure PyTorch and runs on CPU tensors.
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_ddtree.attention_backends.tree_mask_state import ALL_ROWS_ACTIVE, TREE_MASK_STATE
from vllm_ddtree.config import DDTreeConfig
from vllm_ddtree.draft.hidden_rows_kernel import hidden_row_gather_index_triton
from vllm_ddtree.tree.draft_tree import num_mask_words, pack_ancestor_mask
from vllm_ddtree.tree.store_kernel import store_trees_triton
from vllm_ddtree.triton_path import use_triton
from vllm_ddtree.verify.batch import tree_verify_positions_and_bits
from vllm_ddtree.verify.inputs_kernel import verify_inputs_triton

__all__ = [
    "DDTREE_STATE",
    "DDTreeRuntimeState",
    "ddtree_config_of",
    "drafter_block_size",
    "ddtree_lookahead_tokens",
    "hidden_row_gather_index",
    "logit_row_positions",
    "verify_inputs_",
]


def ddtree_config_of(speculative_config: Any) -> DDTreeConfig | None:
    """The ``DDTreeConfig`` the front-end patch attached to a ``SpeculativeConfig``
    (attribute ``ddtree``, a plain dict so that it pickles to the workers), or None."""
    raw = getattr(speculative_config, "ddtree", None) if speculative_config else None
    if raw is None:
        return None
    if isinstance(raw, DDTreeConfig):
        return raw
    return DDTreeConfig(**raw)


def drafter_block_size(speculative_config: Any) -> int:
    """The DFlash drafter's block size (``drafter_config.block_size_of`` its HF config:
    ``block_size`` or ``dflash_config.block_size``): one bonus query plus
    ``block_size - 1`` mask queries, i.e. draft depths ``1..block_size-1``."""
    from vllm_ddtree.drafter_config import block_size_of, field_of

    hf_config = speculative_config.draft_model_config.hf_config
    if field_of(hf_config, "block_size") is None and field_of(
            field_of(hf_config, "dflash_config") or {}, "block_size") is None:
        # vLLM wraps DFlash drafter configs in EAGLEConfig (speculative.py:914-932),
        # which copies the inner config's keys; fall back to the inner config.
        hf_config = getattr(hf_config, "model", None) or hf_config
    return block_size_of(hf_config)


def ddtree_lookahead_tokens(block_size: int) -> int:
    """KV slots the scheduler must allocate past a step's scheduled tokens.

    After a step that scheduled ``n`` tokens from ``nc`` and committed up to position
    ``nc + a`` (a <= B accepted nodes; a prefill chunk: ``nc + n - 1``), the drafter
    writes its query block at positions ``nc + a + 1 .. nc + a + block_size``
    (``speculator.py:535``). Slots exist up to ``nc + n + lookahead - 1`` with
    ``n >= 1 + a``, so ``lookahead = block_size`` always suffices, and is needed
    for the drafter pass after a prefill. vLLM's DFlash value ``B + 1``
    (``scheduler.py:254-258``) is short for ``B < block_size - 1`` and wastes slots
    for large B.
    """
    return block_size


class DDTreeRuntimeState:
    """Persistent DDTree buffers of one worker process (see the module docstring)."""

    def __init__(self) -> None:
        self.enabled = False
        self.budget = 0
        self.max_depth = 0
        self.num_tree_words = 0
        self.parents: torch.Tensor | None = None
        self.depths: torch.Tensor | None = None
        self.ancestor_bits: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None
        # Real tokens of the batch whose RoPE positions verify_inputs_ last wrote to
        # ``positions`` (-1: none); the verifier then gathers its logit rows' positions.
        self.positions_num_tokens = -1
        self.walk_kv_src_rows: torch.Tensor | None = None
        self.walk_num_reqs = 0
        self.walk_valid = False
        self.accepted_sum: torch.Tensor | None = None
        self.num_drafts: torch.Tensor | None = None
        self.adaptive = False
        self.active_nodes: torch.Tensor | None = None
        self.active_nodes_sum: torch.Tensor | None = None
        self.arm_sizes: torch.Tensor | None = None
        self.arm_accepted_sum: torch.Tensor | None = None

    def allocate(
        self,
        max_num_reqs: int,
        max_num_tokens: int,
        budget: int,
        max_depth: int,
        max_query_len: int,
        device: torch.device | str,
    ) -> None:
        """Allocate every buffer once (their addresses must not change afterwards:
        FULL CUDA graphs and the attention builders keep views of them).

        Args:
            max_num_reqs: ``scheduler_config.max_num_seqs``.
            max_num_tokens: ``scheduler_config.max_num_batched_tokens``.
            budget: B, tree nodes per request (vLLM's ``num_speculative_tokens``).
            max_depth: L = drafter ``block_size - 1``.
            max_query_len: longest query the tree backend treats as a decode
                (its ``reorder_batch_threshold``); sizes the per-token mask words.
        """
        # An earlier engine of this process may have been auto: this one is not until
        # enable_adaptive_ says so (its buffers were sized for that engine's batch).
        self.adaptive = False
        self.active_nodes = self.active_nodes_sum = None
        TREE_MASK_STATE.reset_modes()
        self.budget = budget
        self.max_depth = max_depth
        self.num_tree_words = num_mask_words(1 + budget)
        i64 = dict(dtype=torch.int64, device=device)
        self.parents = torch.empty(max_num_reqs, budget, **i64)
        self.depths = torch.empty(max_num_reqs, budget, **i64)
        self.ancestor_bits = torch.empty(max_num_reqs, 1 + budget, self.num_tree_words, **i64)
        self.reset_trees_()
        self.positions = torch.zeros(max_num_tokens, **i64)
        self.walk_kv_src_rows = torch.full((max_num_reqs, max_depth), -1, **i64)
        self.walk_num_reqs = 0
        self.walk_valid = False
        self.accepted_sum = torch.zeros(1, **i64)
        self.num_drafts = torch.zeros(1, **i64)
        self.arm_sizes = self.arm_accepted_sum = None  # until a step gate asks
        bits = TREE_MASK_STATE.allocate(max_num_tokens, max(max_query_len, 1 + budget), device)
        bits.fill_(-1)  # all visible until the first step writes real rows
        TREE_MASK_STATE.active = True
        self.enabled = True

    def enable_adaptive_(self, max_num_reqs: int, device: torch.device | str) -> None:
        """Allocate the ``ddtree_budget: "auto"`` buffers (after :meth:`allocate`):
        ``active_nodes`` int64 ``[max_num_reqs]`` (B until a tree is stored),
        ``active_nodes_sum`` int64 ``[1]`` (active nodes of every counted tree, beside
        ``accepted_sum``), and ``TREE_MASK_STATE.active_query_lens`` int32
        ``[max_num_reqs]`` (``ALL_ROWS_ACTIVE``: nothing skipped until the first verify
        step writes it); sets ``TREE_MASK_STATE.adaptive``."""
        i64 = dict(dtype=torch.int64, device=device)
        self.active_nodes = torch.full((max_num_reqs,), self.budget, **i64)
        self.active_nodes_sum = torch.zeros(1, **i64)
        TREE_MASK_STATE.allocate_active(max_num_reqs, device).fill_(ALL_ROWS_ACTIVE)
        TREE_MASK_STATE.adaptive = True
        self.adaptive = True

    def enable_arm_counters_(self, sizes: list[int], device: torch.device | str) -> None:
        """Count, beside ``accepted_sum``, what each tree would have accepted cut to its
        first ``sizes[a]`` nodes (``arm_accepted_sum`` int64 ``[A]``; ``arm_sizes`` int64
        ``[A]``): ``auto``'s step gate reads the committed tokens of its smaller arms
        from the trees the settled arm verifies (``vllm_ddtree.budget.gate``)."""
        if not sizes or any(s <= 0 for s in sizes):
            raise ValueError(f"arm sizes must be verify shapes above 0, got {sizes}")
        self.arm_sizes = torch.tensor(sizes, dtype=torch.int64, device=device)
        self.arm_accepted_sum = torch.zeros(len(sizes), dtype=torch.int64, device=device)

    def reset_trees_(self) -> None:
        """Make every request's tree a chain (node i at depth i+1, parent i-1).

        A valid tree is required wherever the runner verifies drafts that no
        ``propose`` wrote (warm-up feeds zeros as draft tokens,
        ``warmup.py:301-303``); a chain is one, and it is topologically ordered.
        """
        assert self.parents is not None and self.depths is not None
        assert self.ancestor_bits is not None
        nodes = torch.arange(self.budget, dtype=torch.int64, device=self.parents.device)
        self.parents.copy_((nodes - 1).expand_as(self.parents))
        self.depths.copy_((nodes + 1).expand_as(self.depths))
        chain = torch.ones(1 + self.budget, 1 + self.budget, dtype=torch.bool).tril()
        bits = pack_ancestor_mask(chain).to(self.ancestor_bits.device)
        self.ancestor_bits.copy_(bits.expand_as(self.ancestor_bits))
        if self.active_nodes is not None:
            self.active_nodes.fill_(self.budget)

    def store_trees_(
        self,
        idx_mapping: torch.Tensor,
        parents: torch.Tensor,
        depths: torch.Tensor,
        ancestor_bits: torch.Tensor,
        active_nodes: torch.Tensor | None = None,
    ) -> None:
        """Scatter batch-ordered trees (``[R, B]``, ``[R, B]``, ``[R, 1+B, W]``) to the
        request-state rows ``idx_mapping`` (int32 ``[R]``), as the runner scatters the
        draft tokens (``model_runner.py:1521``). ``active_nodes``: int ``[R]`` or a
        0-dim tensor for the whole batch (``ddtree_budget: "auto"`` only). On CUDA one
        Triton launch (``tree_store_kernel``)."""
        assert self.parents is not None and self.depths is not None
        assert self.ancestor_bits is not None
        if active_nodes is not None and self.active_nodes is None:
            raise RuntimeError("active_nodes given but enable_adaptive_ was not called")
        if use_triton(parents) and store_trees_triton(
                idx_mapping, parents, depths, ancestor_bits, self.parents, self.depths,
                self.ancestor_bits, active_nodes,
                self.active_nodes if active_nodes is not None else None):
            return
        idx = idx_mapping.to(torch.int64)
        self.parents[idx] = parents
        self.depths[idx] = depths
        self.ancestor_bits[idx] = ancestor_bits
        if active_nodes is not None:
            self.active_nodes[idx] = active_nodes.to(torch.int64).expand(idx.shape[0])

    def record_walk_(self, kv_src_rows: torch.Tensor) -> None:
        """Keep the verifier's ``kv_src_rows`` (int64 ``[R, L]``, batch order) for
        the ``propose`` of the same step."""
        assert self.walk_kv_src_rows is not None
        num_reqs, width = kv_src_rows.shape
        self.walk_kv_src_rows[:num_reqs, :width] = kv_src_rows
        self.walk_kv_src_rows[:num_reqs, width:] = -1
        self.mark_walk_(num_reqs)

    def mark_walk_(self, num_reqs: int) -> None:
        """A walk of ``num_reqs`` requests is in ``walk_kv_src_rows`` (written by
        ``record_walk_`` or by ``tree_walk_kernel.verify_walk_triton``)."""
        self.walk_num_reqs = num_reqs
        self.walk_valid = True

    def take_walk(self, num_reqs: int) -> torch.Tensor | None:
        """The walk recorded since the last call, if it was for ``num_reqs``
        requests; None when this step verified no drafts. Clears the record."""
        valid = self.walk_valid and self.walk_num_reqs == num_reqs
        self.walk_valid = False
        if not valid:
            return None
        assert self.walk_kv_src_rows is not None
        return self.walk_kv_src_rows[:num_reqs]

    def mean_acceptance_length(self) -> float:
        """1 + accepted depth per verified tree (vLLM's "mean acceptance length").
        Syncs the device; for tests and benchmarks only.

        Counts every tree verified on the device, including the round that async
        scheduling runs for a request that already finished one step earlier; vLLM's
        scheduler drops those rounds from its counters (``scheduler.py:1660``), so the
        two differ slightly in runs where requests stop inside a round."""
        assert self.accepted_sum is not None and self.num_drafts is not None
        drafts = int(self.num_drafts.item())
        return 1.0 + int(self.accepted_sum.item()) / max(1, drafts)

    def mean_active_nodes(self) -> float:
        """Verified (active) tree nodes per counted tree with ``ddtree_budget: "auto"``.
        vLLM's ``num_draft_tokens`` still counts B per round (the scheduled drafts).
        Syncs the device; for tests and benchmarks only."""
        assert self.active_nodes_sum is not None and self.num_drafts is not None
        return int(self.active_nodes_sum.item()) / max(1, int(self.num_drafts.item()))


DDTREE_STATE = DDTreeRuntimeState()


def verify_inputs_(
    state: DDTreeRuntimeState,
    linear_positions: torch.Tensor,
    query_start_loc: torch.Tensor,
    cu_num_logits: torch.Tensor,
    idx_mapping: torch.Tensor,
    num_tokens: int,
    num_tokens_padded: int,
) -> torch.Tensor:
    """Fill the RoPE positions and per-token ancestor bits of a verify batch.

    A request is a tree request iff it has draft rows (``cu_num_logits`` step > 1);
    its rows are ``[root, node_1..node_n]`` (n <= B: the scheduler may truncate the
    drafts to a prefix, ``scheduler.py:622-638``, which is still a tree since nodes are
    topologically ordered). Other rows keep linear positions and causal bits.

    Args:
        linear_positions: int64 ``[>= num_tokens_padded]``, ``input_batch.positions``.
        query_start_loc: int32 ``[R+1]``.
        cu_num_logits: int32 ``[R+1]``.
        idx_mapping: int32 ``[R]``.
        num_tokens / num_tokens_padded: real and CUDA-graph padded token counts.

    Returns:
        ``state.positions[:num_tokens_padded]`` (int64); ``TREE_MASK_STATE.ancestor_bits
        [:num_tokens]`` (and, when ``state.adaptive``, ``active_query_lens``) are
        written as side effects, and ``state.positions_num_tokens = num_tokens``. No
        host sync.
    """
    assert state.positions is not None and state.depths is not None
    assert state.ancestor_bits is not None and TREE_MASK_STATE.ancestor_bits is not None
    if use_triton(linear_positions):
        verify_inputs_triton(
            linear_positions, query_start_loc, cu_num_logits, idx_mapping, state.depths,
            state.ancestor_bits, state.positions, TREE_MASK_STATE.ancestor_bits, num_tokens,
            num_tokens_padded,
            active_nodes=state.active_nodes if state.adaptive else None,
            active_lens_out=TREE_MASK_STATE.active_query_lens if state.adaptive else None,
        )
        state.positions_num_tokens = num_tokens
        return state.positions[:num_tokens_padded]
    num_reqs = idx_mapping.shape[0]
    is_tree = (cu_num_logits[1 : num_reqs + 1] - cu_num_logits[:num_reqs]) > 1
    idx = idx_mapping.to(torch.int64)
    out_bits = TREE_MASK_STATE.ancestor_bits
    positions, bits = tree_verify_positions_and_bits(
        linear_positions[:num_tokens],
        query_start_loc[: num_reqs + 1],
        is_tree,
        state.depths[idx],
        state.ancestor_bits[idx],
        out_bits.shape[1],
    )
    state.positions[:num_tokens].copy_(positions)
    if num_tokens_padded > num_tokens:
        state.positions[num_tokens:num_tokens_padded].copy_(
            linear_positions[num_tokens:num_tokens_padded]
        )
    out_bits[:num_tokens].copy_(bits)
    if state.adaptive:
        _active_query_lens_(state, query_start_loc, is_tree, idx)
    state.positions_num_tokens = num_tokens
    return state.positions[:num_tokens_padded]


def _active_query_lens_(
    state: DDTreeRuntimeState, query_start_loc: torch.Tensor, is_tree: torch.Tensor,
    idx: torch.Tensor,
) -> None:
    """Batch-ordered rows the tree backends compute, ``TREE_MASK_STATE.
    active_query_lens``: ``min(1 + b, query_len)`` for a tree request (its root and
    first ``b`` nodes; a truncated tree may hold fewer), the query length otherwise;
    entries past the batch (CUDA-graph padding) skip nothing."""
    assert state.active_nodes is not None
    out = TREE_MASK_STATE.active_query_lens
    num_reqs = idx.shape[0]
    qlen = (query_start_loc[1 : num_reqs + 1] - query_start_loc[:num_reqs]).to(torch.int64)
    active = torch.where(is_tree, torch.minimum(1 + state.active_nodes[idx], qlen), qlen)
    out[:num_reqs].copy_(active)
    out[num_reqs:].fill_(ALL_ROWS_ACTIVE)


def logit_row_positions(
    linear_positions: torch.Tensor,
    expanded_local_pos: torch.Tensor,
    expanded_idx_mapping: torch.Tensor,
    depths: torch.Tensor,
) -> torch.Tensor:
    """RoPE position of each logit row (the position vLLM keys Gumbel noise with).

    Plain decoding draws the token that follows input position ``p`` with the key
    ``p`` (``sampler.py:79,249-257``); chain spec decoding does the same per row
    (``rejection_sampler.py:114``). A tree row's input token sits at ``root + depth``,
    so that is its key: the verifier then draws, at the node that ends an accepted
    path, exactly what plain decoding draws after that path. These are the RoPE
    positions ``verify_inputs_`` gives the rows' tokens, so when it wrote them for this
    batch the verifier gathers them instead (one kernel instead of about ten).

    Args:
        linear_positions: int64 ``[num_logits]``, ``positions[logits_indices]``.
        expanded_local_pos: int32 ``[num_logits]``, row index within its request's
            logits (0 = root/bonus row).
        expanded_idx_mapping: int32 ``[num_logits]``, request-state index per row.
        depths: int64 ``[max_num_reqs, B]``, request-state indexed node depths.

    Returns:
        int64 ``[num_logits]``.
    """
    local = expanded_local_pos.to(torch.int64)
    node = (local - 1).clamp(min=0, max=depths.shape[1] - 1)
    depth = depths[expanded_idx_mapping.to(torch.int64), node]
    root = linear_positions.to(torch.int64) - local
    return torch.where(local > 0, root + depth, root)


def hidden_row_gather_index(
    query_start_loc: torch.Tensor, kv_src_rows: torch.Tensor, num_rows: int
) -> torch.Tensor:
    """Row index that moves each request's accepted tree rows next to its root.

    ``gather[start_r + k] = start_r + kv_src_rows[r, k-1]`` for the accepted depths
    ``k = 1..a_r``; every other row maps to itself. Gathering the target hidden
    states with it makes rows ``start_r .. start_r + a_r`` the committed path, which
    is what DFlash's context precompute reads (``dflash/speculator.py:326-332,
    404-408``: rows ``< valid_ctx_end`` at linear positions).

    Args:
        query_start_loc: int32 ``[>= R+1]``.
        kv_src_rows: int64 ``[R, L]`` from the walk (-1 padded).
        num_rows: rows of the hidden-state tensor (may include CUDA-graph padding).

    Returns:
        int64 ``[num_rows]``. No host sync. On CUDA one Triton launch
        (``hidden_rows_kernel``); CPU tensors: the ops below.
    """
    if use_triton(kv_src_rows):
        return hidden_row_gather_index_triton(query_start_loc, kv_src_rows, num_rows)
    num_reqs, width = kv_src_rows.shape
    device = kv_src_rows.device
    starts = query_start_loc[:num_reqs].to(torch.int64)[:, None]
    valid = kv_src_rows >= 0
    dst = starts + torch.arange(1, width + 1, device=device)[None, :]
    src = starts + kv_src_rows
    # Invalid entries all write row `num_rows` of a one-longer index, dropped below.
    dst = torch.where(valid, dst, num_rows).flatten()
    src = torch.where(valid, src, num_rows).flatten()
    index = torch.arange(num_rows + 1, dtype=torch.int64, device=device)
    index.scatter_(0, dst, src)
    return index[:num_rows]
