"""DDTree speculator for vLLM 0.26's V2 GPU runner (a ``DFlashSpeculator`` subclass).

vLLM keeps seeing ``method: dflash`` (``vllm_ddtree.config``), so every DFlash code
path (aux hidden states ``model_runner.py:197``, multi-KV-group drafters, CUDA-graph
manager) keeps working; ``vllm_ddtree.patches.init_speculator`` builds this class instead of
``DFlashSpeculator`` when the speculative config carries a ``ddtree`` dict.

Deviations from ``DFlashSpeculator`` (``spec_decode/dflash/speculator.py``):

* **Block size decoupled from B.** DFlash drafts ``N = num_speculative_tokens``
  tokens with a query block of ``1 + N`` (``:45``) and samples ``N`` rows per
  request (``:70-84``). DDTree's drafter block is the drafter's own ``block_size``
  (HF config): ``num_query_per_req = block_size``, ``L = block_size - 1`` sample
  rows, while the runner verifies ``B = num_speculative_tokens`` tree nodes. We set
  ``self.num_speculative_steps = L`` after ``super().__init__`` because
  ``DFlashSpeculator.propose`` passes it to ``prepare_dflash_inputs`` as the sample
  stride (``:384``); ``self.draft_tokens`` stays ``[max_num_reqs, B]`` (allocated by
  ``DraftModelSpeculator.__init__``, ``spec_decode/speculator.py:119-124``, from the
  config's B) and ``self.budget`` is B.
* **``_generate_draft``** (captured in FULL CUDA graphs by
  ``DFlashCudaGraphManager``, ``dflash/cudagraph.py:66-110``): drafter logits of
  depths 1..L -> ``build_ddtree_fast(logits.view(R, L, V), B, top_k, out=...)`` (on
  CUDA log-softmax + two ranking launches + one launch for the beams, merge and
  ancestor bits, ``tree.build_kernel``; the PyTorch build on CPU), written straight
  into ``draft_tokens`` (the return value) and the batch-ordered parents / depths /
  ancestor bits / scores buffers. Greedy drafting only: no ``draft_logits [reqs, B,
  V]``.
* **``propose``**: (1) before DFlash's ``prepare_dflash_inputs`` overwrites the
  shared ``block_tables.slot_mappings`` (``:366-389``), move the KV of each request's
  accepted path into the slots of positions ``seq+1..seq+a`` in every target layer,
  using the target slot mappings ``propose`` receives (``model_runner.py:1510``);
  (2) gather the target hidden rows ``[0, src_1..src_a] -> [0..a]`` so DFlash's
  context precompute sees the committed path at linear positions (on CUDA the aux
  hidden states are moved in place, ``hidden_rows_kernel.move_path_rows_triton``);
  in a batch of tree decodes only, the paths go to ``1 + L`` rows a request and the
  drafter drafts from that smaller batch (``vllm_ddtree.draft.context_rows``: its ``fc`` and
  K/V precompute skip the rejected rows); (3) after the
  draft, scatter the batch trees to request-state rows via ``input_batch.idx_mapping``
  (as the runner does for draft tokens, ``model_runner.py:1521``).
  ``num_rejected`` needs no change: the runner passes the verifier's value
  (``num_logits - (a+1)``, i.e. ``B - a`` for a full tree), which is what DFlash's
  ``valid_ctx_end = ctx_end - num_rejected`` (``:502-503``) needs once rows 0..a
  hold the path.
* **``ddtree_budget: "auto"``** (``vllm_ddtree.budget.policy``): ``_generate_draft``
  also keeps the node scores (``batch_scores``) and picks the batch's active budget
  ``b`` from them and the target's sequence lengths (``BudgetPolicy.choose_in_graph``),
  storing it with the trees (``DDTREE_STATE.active_nodes``), all inside the drafter's
  CUDA graph; the backends skip the inactive rows and the verifier ignores them. At
  TP > 1 (the ranks' choices are broadcast) and on CPU, ``propose`` makes the same
  choice eagerly after the graph (no host sync either way). With
  adaptive verify shapes (``vllm_ddtree.verify.shape``, the default at TP = 1) ``b``
  also goes to the host without a sync, and later steps verify ``1 + s`` rows
  (``s >= b`` of a recent round) instead of ``1 + B``. Without the key none of this
  runs.

Assumptions about vLLM internals (to re-check on any vLLM upgrade):

* ``propose`` is called after ``postprocess_sampled`` in the same ``sample_tokens``
  call, with the ``input_batch`` that was verified (``model_runner.py:1489-1521``),
  and nothing recomputes the target slot mappings in between.
* Target layers' caches are ``static_forward_context[name].kv_cache``
  (``v1/worker/utils.py`` ``bind_kv_cache``) in the backend's logical layout, whose
  slot index is ``block * kernel_block_size + offset`` (``block_table.py:291-305``).
* The verify rows of a request with drafts are exactly ``[root, nodes...]`` at
  ``query_start_loc[r] ..`` (``combine_sampled_and_draft_tokens``,
  ``input_batch.py:304-361``).
"""

from __future__ import annotations

import time
from typing import Any

import torch
from vllm.config import VllmConfig
from vllm.config.compilation import CUDAGraphMode
from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator

from vllm_ddtree.attention_backends.tree_mask_state import TREE_MASK_STATE, decode_query_limit
from vllm_ddtree.compact.kv_kernel import PathCompactor
from vllm_ddtree.draft.context_kv_graphs import capture_for_speculator
from vllm_ddtree.draft.context_rows import (
    compact_path_rows_,
    compacted_batch,
    context_rows_per_request,
)
from vllm_ddtree.draft.dflash2_draft import selector_drafting_for
from vllm_ddtree.draft.hidden_rows_kernel import move_path_rows_triton
from vllm_ddtree.draft.inputs_kernel import prepare_dflash_inputs_groups
from vllm_ddtree.draft.target_kv import (
    kv_page_views,
    path_compaction_slots,
    target_layers_by_group,
)
from vllm_ddtree.runtime_state import (
    DDTREE_STATE,
    ddtree_config_of,
    drafter_block_size,
    hidden_row_gather_index,
)
from vllm_ddtree.tree.build_kernel import build_ddtree_fast
from vllm_ddtree.tree.draft_tree import DraftTree, num_mask_words
from vllm_ddtree.tree.store_kernel import store_trees_triton
from vllm_ddtree.triton_path import use_triton
from vllm_ddtree.verify.shape import warm_up_batch

__all__ = [
    "DDTreeSpeculator",
    "path_compaction_slots",
    "kv_page_views",
    "target_layers_by_group",
    "warm_tree_caches",
]


def warm_tree_caches(num_depths: int, vocab_size: int, budget: int, top_k: int | None,
                     device: torch.device) -> None:
    """Build one tree and its ancestor bits eagerly, so the host-made index tables that
    ``build_ddtree`` / ``tree_build_kernel.beam_plan`` and ``DraftTree.ancestor_bits``
    cache per (budget, top_k, depths, device) exist before ``_generate_draft`` is
    captured in a CUDA graph (a host-to-device copy is not allowed while a stream is
    capturing). The tables do not depend on the number of requests or on the logits."""
    logits = torch.zeros(1, num_depths, vocab_size, dtype=torch.float32, device=device)
    build_ddtree_fast(logits, budget, top_k).ancestor_bits()


class DDTreeSpeculator(DFlashSpeculator):
    """DFlash drafter + best-first draft tree of ``B`` nodes per request.

    Shapes: R = requests in the batch, B = ``num_speculative_tokens`` (tree nodes),
    L = drafter ``block_size - 1`` (draft depths), V = vocabulary.
    """

    _speculator_name = "DDTree"
    # ddtree_budget: "auto" (set in __init__); class defaults keep fakes working.
    adaptive = False
    budget_policy = None
    verify_shape = None  # VerifyShapeChooser with adaptive verify shapes
    step_plan = None  # StepPlan: auto's shapes and step gate, a batch schedule
    store_trees_in_graph = False  # the trees are stored in the draft step, see __init__
    _path_rows_warm = False  # the path-row move kernel compiled (_warm_path_rows)
    # (first cache of each group, PathCompactor over the groups' views), see
    # _path_compactor
    _compactor: tuple[list[torch.Tensor], PathCompactor] | None = None
    selector_drafting = None  # DFlash2 drafters: vllm_ddtree.draft.dflash2_draft

    def __init__(self, vllm_config: VllmConfig, device: torch.device):
        spec = vllm_config.speculative_config
        ddtree = ddtree_config_of(spec)
        if ddtree is None:
            raise ValueError("DDTreeSpeculator needs speculative_config.ddtree")
        if spec.draft_sample_method != "greedy":
            # Checked before super().__init__, which would allocate draft_logits
            # [max_num_reqs, B, V] (spec_decode/speculator.py:129-137).
            raise ValueError("DDTree drafts greedily: leave draft_sample_method unset")
        if spec.use_local_argmax_reduction:
            raise ValueError("DDTree needs full drafter logits: use_local_argmax_reduction "
                             "is not supported")
        parallel = vllm_config.parallel_config
        if getattr(parallel, "decode_context_parallel_size", 1) > 1 or getattr(
            parallel, "prefill_context_parallel_size", 1
        ) > 1:
            raise NotImplementedError("DDTree does not support context parallelism yet")
        super().__init__(vllm_config, device)

        block_size = drafter_block_size(spec)
        self.budget = self.num_speculative_steps  # B
        self.top_k = ddtree.top_k
        self.num_query_per_req = block_size
        self.num_draft_depths = block_size - 1  # L
        # DFlashSpeculator.propose hands this to prepare_dflash_inputs as the per-request
        # sample stride; for DDTree that is L (draft_tokens keeps its B columns).
        self.num_speculative_steps = self.num_draft_depths
        if self.max_num_reqs * block_size > self.max_num_tokens:
            raise ValueError(
                f"max_num_seqs ({self.max_num_reqs}) x drafter block_size ({block_size}) "
                f"exceeds max_num_batched_tokens ({self.max_num_tokens}): raise the latter"
            )

        num_sample = self.max_num_reqs * self.num_draft_depths
        self.sample_indices = torch.zeros(num_sample, dtype=torch.int64, device=device)
        self.sample_pos = torch.zeros(num_sample, dtype=torch.int64, device=device)
        self.sample_idx_mapping = torch.zeros(num_sample, dtype=torch.int32, device=device)
        self.sample_col = torch.arange(
            self.num_draft_depths, dtype=torch.int32, device=device
        ).repeat(self.max_num_reqs)

        # Batch-ordered trees written inside the (captured) draft step; scattered to
        # request-state rows in the step by sample_idx_mapping, whose padded CUDA-graph
        # rows are -1 (store_trees_in_graph), or eagerly in propose, so padded
        # CUDA-graph rows never touch live requests.
        words = num_mask_words(1 + self.budget)
        self.batch_parents = torch.zeros(
            self.max_num_reqs, self.budget, dtype=torch.int64, device=device
        )
        self.batch_depths = torch.ones_like(self.batch_parents)
        self.batch_ancestor_bits = torch.zeros(
            self.max_num_reqs, 1 + self.budget, words, dtype=torch.int64, device=device
        )
        # Node scores: the tree build writes them; only ``auto`` reads them.
        self.batch_scores = torch.zeros(
            self.max_num_reqs, self.budget, dtype=torch.float32, device=device
        )

        # The MLA tree backend treats queries up to its reorder_batch_threshold,
        # 1 + 2B for DFlash (backend.py:651-681; in fp32 every query), as decodes:
        # size the mask for them.
        max_decode_query = decode_query_limit(vllm_config, 1 + 2 * self.budget)
        self.state = DDTREE_STATE
        self.state.allocate(
            max_num_reqs=self.max_num_reqs,
            max_num_tokens=self.max_num_tokens,
            budget=self.budget,
            max_depth=self.num_draft_depths,
            max_query_len=max_decode_query,
            device=device,
        )
        self._target_layers_by_group: dict[int, list[str]] = {}
        # Context rows of tree-decode rounds, 1 + L a request (vllm_ddtree.draft.context_rows).
        rows = block_size
        self.context_query_start_loc = rows * torch.arange(
            self.max_num_reqs + 1, dtype=torch.int32, device=device)
        self.context_positions_compact = torch.zeros(
            self.max_num_reqs * rows, dtype=torch.int64, device=device)
        self.context_num_rejected = torch.zeros(self.max_num_reqs, dtype=torch.int32,
                                                device=device)
        warm_tree_caches(self.num_draft_depths, vllm_config.model_config.get_vocab_size(),
                         self.budget, self.top_k, device)
        self.selector_drafting = selector_drafting_for(vllm_config, self, device)
        if ddtree.adaptive:
            self._init_adaptive(vllm_config, device)
        # On CUDA the trees reach the request-state rows inside the drafter's step (its
        # CUDA graph) rather than in an eager launch after it; ``auto`` makes its budget
        # choice in the graph too, except at TP > 1, where the ranks' choice is broadcast
        # eagerly after the graph. CPU tensors store eagerly (PyTorch ops).
        self.store_trees_in_graph = device.type == "cuda" and (
            not self.adaptive or self.budget_policy.tp_group is None)
        if self.store_trees_in_graph and self.adaptive:
            self.budget_policy.enable_in_graph_()
        if self.store_trees_in_graph:
            # Compile the store (and auto's choice) before any capture: a -1 row writes
            # no tree and counts in no choice.
            padding = torch.full((1,), -1, dtype=torch.int32, device=device)
            active = None
            if self.adaptive:
                policy = self.budget_policy
                active = policy.choose_in_graph(self.batch_scores[:1], padding, padding, 1)
                policy.chosen.fill_(self.budget)
                policy.last_attention.zero_()
            self._store_trees_in_step(1, padding, active=active)
        self.step_plan = self._make_step_plan(vllm_config, ddtree, device)

    def _make_step_plan(self, vllm_config: VllmConfig, ddtree, device: torch.device):
        """The host's per-step plan (``vllm_ddtree.verify.shape.StepPlan``) when steps
        may verify fewer than B drafts: auto's adaptive verify shapes, its step gate,
        or a batch schedule; None otherwise (every step verifies B)."""
        from vllm_ddtree.budget.schedule import BatchSchedule
        from vllm_ddtree.verify.shape import StepPlan, auto_plain_steps, step_shapes

        parallel = vllm_config.parallel_config
        tp = parallel.tensor_parallel_size
        dp = getattr(parallel, "data_parallel_size", 1)
        shapes = step_shapes(ddtree, tp, self.max_num_reqs, dp)
        if shapes is None:
            return None
        schedule = None
        if ddtree.batch_schedule is not None:
            schedule = BatchSchedule(ddtree.batch_schedule, self.max_num_reqs, self.budget)
        gate = None
        if auto_plain_steps(ddtree, tp, dp):
            from vllm_ddtree.budget.gate import SpeculationGate

            gate = SpeculationGate(self.budget_policy.cost_model(), device, arms=shapes)
            self.state.enable_arm_counters_(gate.speculative_arms, device)
        return StepPlan(self.budget, shapes, schedule, self.verify_shape, gate)

    def capture(self) -> None:
        """DFlash's drafter graphs, then the context K/V precompute of full-tree decode
        batches (``vllm_ddtree.draft.context_kv_graphs``): ``R * min(1 + B, 1 + L)``
        context rows (and ``R * min(1 + s, 1 + L)`` for ``auto``'s verify shapes ``s``;
        tree decodes draft from at most ``1 + L`` rows a request,
        ``vllm_ddtree.draft.context_rows``) for request counts ``R`` up to the largest
        the drafter's graphs take (``context_kv_graphs.MAX_CONTEXT_GRAPHS`` lengths)."""
        super().capture()
        rows = [1 + self.budget]
        if self.step_plan is not None:  # auto / a batch schedule: 1 + s rows a request
            rows += [1 + s for s in self.step_plan.shapes]  # s = 0: a plain step's 1 row
        rows = [min(q, self.num_query_per_req) for q in rows]  # 1 + L at most
        capture_for_speculator(self, sorted(set(rows)))

    def _init_adaptive(self, vllm_config: VllmConfig, device: torch.device) -> None:
        """``ddtree_budget: "auto"``: batch-ordered node scores, the active-node
        buffers, and the budget policy (times the target's verify attention: syncs)."""
        from vllm_ddtree.budget.policy import BudgetPolicy

        self.adaptive = True
        self.state.enable_adaptive_(self.max_num_reqs, device)
        self.budget_policy = BudgetPolicy.from_vllm_config(vllm_config, self.budget, device)
        ddtree = ddtree_config_of(vllm_config.speculative_config)
        tp = vllm_config.parallel_config.tensor_parallel_size
        if ddtree is not None and ddtree.resolved_verify_shape(tp) == "adaptive":
            from vllm_ddtree.verify.shape import VerifyShapeChooser

            # Read by vllm_ddtree.patches.verify_shapes (the runner's execute_model). TP ranks
            # must cut alike: each reads the (broadcast) choice of two rounds before.
            self.verify_shape = VerifyShapeChooser(self.budget, device,
                                                   lag=2 if tp > 1 else None)
            # 1 + s rows with s < 2 b: most rows active, so the MLA backend lets the
            # Gluon kernel compute them all rather than Triton skip the inactive ones.
            TREE_MASK_STATE.mostly_active = True

    def set_attn(self, model_state, kv_cache_config, block_tables, target_input_buffers,
                 target_attn_groups) -> None:
        from vllm.v1.worker.gpu.model_states.default import DefaultModelState

        if type(model_state) is not DefaultModelState:
            # Only DefaultModelState's prepare_inputs / custom_sampler are patched.
            raise NotImplementedError(
                f"DDTree supports DefaultModelState targets only, not "
                f"{type(model_state).__name__} (M-RoPE, hybrid, encoder-decoder)"
            )
        # Every target attention layer must apply the tree mask (the front-end picks
        # CUSTOM for MLA targets; this catches configs built around it).
        for groups in target_attn_groups:
            for group in groups:
                names = [n for n in group.layer_names if n not in self.draft_attn_layer_names]
                if names and group.backend.get_name() != "CUSTOM":
                    raise NotImplementedError(
                        f"target layers {names[:2]}... use attention backend "
                        f"{group.backend.get_name()}, which cannot apply DDTree's tree mask; "
                        "DDTree needs the CUSTOM tree backend"
                    )
        super().set_attn(model_state, kv_cache_config, block_tables, target_input_buffers,
                         target_attn_groups)
        self._target_layers_by_group = target_layers_by_group(
            kv_cache_config, self.draft_attn_layer_names
        )
        self._compactor = None  # views of the new groups at the next round

    def _generate_draft(
        self,
        num_reqs: int,
        num_tokens_padded: int,
        attn_metadata: dict[str, Any] | None,
        slot_mappings: dict[str, torch.Tensor] | None,
        num_tokens_across_dp: torch.Tensor | None,
        cudagraph_runtime_mode: CUDAGraphMode = CUDAGraphMode.NONE,
    ) -> None:
        """Drafter forward + tree build (replaces DFlash's ``sample_draft``, ``:233-265``).

        Writes ``draft_tokens[:R]`` int64 ``[R, B]``, ``batch_parents[:R]``,
        ``batch_depths[:R]`` int64 ``[R, B]``, ``batch_ancestor_bits[:R]`` int64
        ``[R, 1+B, W]`` and ``batch_scores[:R]`` float32 ``[R, B]`` (in place: the Triton
        build writes them in its launch, the PyTorch one is copied).
        No host sync (graph-capturable once ``build_ddtree``'s cached
        index tables exist, i.e. after one eager run with the same B, top_k).
        """
        hidden = self._run_model(
            num_tokens_padded,
            attn_metadata,
            slot_mappings,
            num_tokens_across_dp,
            cudagraph_runtime_mode,
        )
        depths = self.num_draft_depths
        num_sample = num_reqs * depths
        rows = hidden[self.sample_indices[:num_sample]]
        out = DraftTree(tokens=self.draft_tokens[:num_reqs],
                        parents=self.batch_parents[:num_reqs],
                        depths=self.batch_depths[:num_reqs],
                        scores=self.batch_scores[:num_reqs],
                        packed_bits=self.batch_ancestor_bits[:num_reqs])
        if self.selector_drafting is not None:  # DFlash2: trees over selector scores
            self.selector_drafting.draft(self.model, rows, self.input_buffers.input_ids,
                                         num_reqs, out)
        else:
            logits = self.model.compute_logits(rows)
            build_ddtree_fast(logits.view(num_reqs, depths, -1), self.budget, self.top_k,
                              out=out)
        if self.store_trees_in_graph:
            active = None
            # vLLM's profile run drafts before set_attn hands over the target's buffers:
            # that dummy step stores full trees (no choice, nothing to choose for).
            target_buffers = getattr(self, "target_input_buffers", None)
            if self.adaptive and target_buffers is not None:  # auto's choice, in graph
                active = self.budget_policy.choose_in_graph(
                    self.batch_scores[:num_reqs], target_buffers.seq_lens[:num_reqs],
                    self.sample_idx_mapping, self.num_draft_depths)
            self._store_trees_in_step(num_reqs, active=active)

    def _store_trees_in_step(self, num_reqs: int,
                             row_of_sample: torch.Tensor | None = None,
                             active: torch.Tensor | None = None) -> None:
        """Scatter the batch's trees (``batch_parents`` / ``batch_depths`` /
        ``batch_ancestor_bits[:num_reqs]``) to their request-state rows inside the
        drafter's step (``store_trees_in_graph``), in one launch that a CUDA graph
        captures. Request ``r``'s row is ``sample_idx_mapping[r * L]``, which
        vLLM's ``prepare_dflash_inputs`` writes before every step (the graph reads the
        buffer) and sets to -1 for CUDA-graph padding requests: they write nothing.

        Dummy steps (start-up, DP padding) write their trees to the rows of their dummy
        batch too. That stays lossless: the tokens, positions, mask and walk of a
        verify all read one stored tree, whichever it is; a live request whose tree a
        dummy step replaced verifies that tree for one round.

        ``row_of_sample``: int32, the state row per sample (default
        ``sample_idx_mapping``, L per request). ``active``: int64 ``[1]``, ``auto``'s
        chosen budget for every request (``auto``'s in-graph choice), or None.
        """
        if not store_trees_triton(
                self.sample_idx_mapping if row_of_sample is None else row_of_sample,
                self.batch_parents[:num_reqs],
                self.batch_depths[:num_reqs], self.batch_ancestor_bits[:num_reqs],
                self.state.parents, self.state.depths, self.state.ancestor_bits,
                active, None if active is None else self.state.active_nodes,
                idx_stride=self.num_draft_depths):
            raise RuntimeError("the in-graph tree store refused the speculator's buffers "
                               "(their rows must be contiguous)")

    def _compact_target_kv(
        self,
        slot_mappings: dict[str, torch.Tensor],
        query_start_loc: torch.Tensor,
        kv_src_rows: torch.Tensor,
    ) -> None:
        """Move accepted-path KV to the slots of positions ``seq+1..seq+a`` in every
        target layer (drafter layers are rewritten by the context precompute).

        vLLM lets layers of *different* KV-cache groups share one storage tensor (the
        groups own disjoint block ids), so a cache is compacted once per group with
        that group's slots; only layers of one group that alias the same cache
        (KV sharing) are skipped, since a second pass over an overlapping path would
        read already-moved rows.

        ``compact.kv_kernel.compact_kv_paths_``: on CUDA it moves every group's views in
        one Triton launch per distinct row layout (normally one launch a round, however
        many groups: the slots are read from each group's slot mapping in-kernel); on
        CPU each group runs ``path_compaction_slots`` + ``compact_kv_cache_`` per view.
        """
        compactor = self._path_compactor()
        compactor([slot_mappings[layer_names[0]]
                   for layer_names in self._target_layers_by_group.values()],
                  query_start_loc, kv_src_rows)

    def _path_compactor(self) -> PathCompactor:
        """The groups' cache views, built at the first round and again only if vLLM
        re-binds a group's first cache (the per-layer walk is 61 layers on Kimi-K2)."""
        forward_context = self.vllm_config.compilation_config.static_forward_context
        firsts = [forward_context[names[0]].kv_cache
                  for names in self._target_layers_by_group.values()]
        cached = self._compactor
        if cached is not None and len(cached[0]) == len(firsts) and all(
                a is b for a, b in zip(cached[0], firsts, strict=True)):
            return cached[1]
        views_by_group = []
        for layer_names in self._target_layers_by_group.values():
            seen_in_group: set[int] = set()
            views: list[torch.Tensor] = []
            for name in layer_names:
                kv_cache = forward_context[name].kv_cache
                if kv_cache.data_ptr() in seen_in_group:
                    continue
                seen_in_group.add(kv_cache.data_ptr())
                views.extend(kv_page_views(kv_cache))
            views_by_group.append(views)
        compactor = PathCompactor(views_by_group)
        self._compactor = (firsts, compactor)
        return compactor

    def _prepare_inputs_in_one_launch(self, input_batch, num_sampled, num_rejected,
                                      last_sampled, next_prefill_tokens) -> bool:
        """DFlash's ``prepare_dflash_inputs`` for every drafter KV-cache group in one
        launch (``draft.inputs_kernel``); returns whether it ran. Rounds without CUDA
        tensors (CPU, test fakes) return False and keep DFlash's per-group loop."""
        if not (isinstance(num_sampled, torch.Tensor) and use_triton(num_sampled)):
            return False
        ids = list(self.draft_kv_cache_group_ids)
        return prepare_dflash_inputs_groups(
            self.input_buffers, self.block_tables.slot_mappings, ids, self.context_positions,
            self._context_slot_mappings, self.sample_indices, self.sample_pos,
            self.sample_idx_mapping, input_batch, num_sampled, num_rejected, last_sampled,
            next_prefill_tokens, [self.block_tables.input_block_tables[g] for g in ids],
            [self.block_tables.kernel_block_sizes[g] for g in ids],
            self.parallel_drafting_token_id, self.num_query_per_req,
            self.num_speculative_steps, self.max_num_reqs, self.max_num_tokens,
            self.max_model_len, self.sample_from_anchor)

    def _draft_next(self, input_batch, walk: torch.Tensor | None) -> bool:
        """Whether this ``propose`` runs the drafter's block pass (the next step verifies
        trees): the step plan's choice (a batch schedule's budget 0, auto's arm 0), yes
        without a plan and for V2 warm-up batches (their trees warm the verifier). Feeds
        auto's gate the acceptance counters after a verified step, and hands the gate's
        hidden GPU time to the device's budget choice (``BudgetPolicy.hide_``). Host
        only."""
        plan = self.step_plan
        if plan is None:
            return True
        if warm_up_batch(getattr(input_batch, "req_ids", None) or ()):
            plan.drafted = True
            return True
        num_reqs = input_batch.num_reqs
        if plan.gate is not None and walk is not None and self.state.accepted_sum is not None:
            plan.gate.record_acceptance_(self.state.accepted_sum, self.state.num_drafts,
                                         num_reqs, self.state.arm_accepted_sum)
        computed = getattr(input_batch, "num_computed_tokens_np", None)
        contexts = None if computed is None else computed[:num_reqs]
        draft = plan.draft_next(num_reqs, contexts)
        if draft and plan.gate is not None and self.budget_policy is not None:
            self.budget_policy.hide_(*plan.gate.device_hidden)
        return draft

    def _store_context_kv(self, input_batch, aux_hidden_states, last_hidden_states,
                          num_sampled, num_rejected, last_sampled,
                          next_prefill_tokens) -> None:
        """A ``propose`` without the block pass (the next step is a plain decoding step,
        b = 0): only what ``DFlashSpeculator.propose`` does before its block pass
        (``dflash/speculator.py:326-409``): the target hidden states of this step's rows
        through the drafter's ``fc``, the context positions and slots
        (``prepare_dflash_inputs``), and the drafter's context K/V written into its
        cache. The drafter's context is then complete at every committed position, as
        if it had drafted: when speculation resumes, its block pass sees the same cache
        (its own query rows of earlier passes are always overwritten by context rows
        before a query reads them). On the context K/V CUDA graphs when the length
        matches one (``R`` rows of a plain decoding batch are captured)."""
        num_tokens = input_batch.num_tokens
        if aux_hidden_states:
            hidden = self.model.combine_hidden_states(torch.cat(aux_hidden_states, dim=-1))
        else:
            hidden = last_hidden_states
        self.hidden_states[:num_tokens].copy_(hidden[:num_tokens])
        if not self._prepare_inputs_in_one_launch(input_batch, num_sampled, num_rejected,
                                                  last_sampled, next_prefill_tokens):
            from vllm.v1.worker.gpu.spec_decode.dflash.speculator import prepare_dflash_inputs

            for i, gid in enumerate(self.draft_kv_cache_group_ids):
                prepare_dflash_inputs(
                    self.input_buffers, self.block_tables.slot_mappings[gid],
                    self.context_positions, self._context_slot_mappings[i],
                    self.sample_indices, self.sample_pos, self.sample_idx_mapping,
                    input_batch, num_sampled, num_rejected, last_sampled,
                    next_prefill_tokens, self.block_tables.input_block_tables[gid],
                    self.block_tables.kernel_block_sizes[gid],
                    self.parallel_drafting_token_id, self.num_query_per_req,
                    self.num_speculative_steps, self.max_num_reqs, self.max_num_tokens,
                    self.max_model_len, self.sample_from_anchor)
        if self._layer_group_idx is not None:
            slots = [self._context_slot_mappings[g][:num_tokens] for g in self._layer_group_idx]
        else:
            slots = self._context_slot_mappings[0][:num_tokens]
        self.model.precompute_and_store_context_kv(
            self.hidden_states[:num_tokens], self.context_positions[:num_tokens], slots)

    def _warm_path_rows(self, aux_hidden_states: list[torch.Tensor],
                        query_start_loc: torch.Tensor) -> None:
        """Compile the path-row move for these aux states at start-up (vLLM's dummy
        runs reach here first): rounds whose requests verify at most 1 + L rows (``auto``'s
        small arms, prefill chunks) move rows instead of compacting them, and their first
        launch otherwise compiled mid-serving (477 ms inside ``auto``'s first batch-1
        cell, H100). Nothing moves: every source row is -1."""
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return
        self._path_rows_warm = True
        none = torch.full((1, self.num_draft_depths), -1, dtype=torch.int64,
                          device=aux_hidden_states[0].device)
        if use_triton(none):
            move_path_rows_triton(aux_hidden_states, query_start_loc[:2], none)

    @torch.inference_mode()
    def propose(
        self,
        input_batch,
        attn_metadata: dict[str, Any],
        slot_mappings: dict[str, torch.Tensor],
        last_hidden_states: torch.Tensor,
        aux_hidden_states: list[torch.Tensor] | None,
        num_sampled: torch.Tensor,
        num_rejected: torch.Tensor,
        last_sampled: torch.Tensor,
        next_prefill_tokens: torch.Tensor,
        temperature: torch.Tensor,
        seeds: torch.Tensor,
        num_tokens_across_dp: torch.Tensor | None = None,
        dummy_run: bool = False,
        skip_attn_for_dummy_run: bool = False,
        mm_inputs: tuple[list[torch.Tensor], torch.Tensor] | None = None,
        is_profile: bool = False,
    ) -> torch.Tensor:
        """Same contract as ``DFlashSpeculator.propose`` (``:286-454``): returns the
        draft tokens int64 ``[R, B]`` (a view of ``draft_tokens``)."""
        num_reqs = input_batch.num_reqs
        if aux_hidden_states and not self._path_rows_warm:
            self._warm_path_rows(aux_hidden_states, input_batch.query_start_loc)
        walk = None if dummy_run else self.state.take_walk(num_reqs)
        # auto's step gate keeps its held decision at this propose: the round's wall
        # time and the device's budget choice are taken where it decides
        held = not dummy_run and self.step_plan is not None and self.step_plan.holding
        if self.budget_policy is not None:
            if dummy_run:
                self.budget_policy.reset_round_clock()
            else:
                self.budget_policy.observe_round(time.perf_counter(), verified=walk is not None,
                                                 sample=not held)
        draft = dummy_run or self._draft_next(input_batch, walk)
        if walk is not None:
            query_start_loc = input_batch.query_start_loc[: num_reqs + 1]
            # Must precede super().propose: prepare_dflash_inputs rewrites the shared
            # slot-mapping rows these views point to (drafter and target may share a
            # KV-cache group).
            self._compact_target_kv(slot_mappings, query_start_loc, walk)
            rows = (context_rows_per_request(input_batch, self.num_draft_depths)
                    if aux_hidden_states else None)
            if rows is not None:
                # The drafter reads 1 + L context rows a request, not 1 + B: the
                # accepted paths go to rows r * (1 + L) + k of the aux states (in
                # place, as below) and the drafter sees a batch of 1 + L rows each.
                compact_path_rows_(aux_hidden_states, query_start_loc, walk,
                                   input_batch.positions, num_sampled, rows,
                                   self.context_positions_compact, self.context_num_rejected)
                aux_hidden_states = [h[: num_reqs * rows] for h in aux_hidden_states]
                input_batch = compacted_batch(input_batch, rows, self.context_query_start_loc,
                                              self.context_positions_compact)
                num_rejected = self.context_num_rejected[:num_reqs]
            elif aux_hidden_states:
                # The target's aux outputs are read only here until its next forward:
                # move the path rows in place (one launch) rather than gather copies.
                moved = use_triton(walk) and move_path_rows_triton(
                    aux_hidden_states, query_start_loc, walk
                )
                if not moved:
                    index = hidden_row_gather_index(
                        query_start_loc, walk, aux_hidden_states[0].shape[0]
                    )
                    aux_hidden_states = [h[index] for h in aux_hidden_states]
            else:
                index = hidden_row_gather_index(
                    query_start_loc, walk, last_hidden_states.shape[0]
                )
                last_hidden_states = last_hidden_states[index]

        if not draft:  # b = 0: the next step decodes plainly
            self._store_context_kv(input_batch, aux_hidden_states, last_hidden_states,
                                   num_sampled, num_rejected, last_sampled,
                                   next_prefill_tokens)
            if self.step_plan is not None:
                self.step_plan.step_finished()
            return self.draft_tokens[:num_reqs]
        fused = not dummy_run and self._prepare_inputs_in_one_launch(
            input_batch, num_sampled, num_rejected, last_sampled, next_prefill_tokens)
        group_ids = self.draft_kv_cache_group_ids if fused else None
        if fused:  # DFlash's per-group prepare loop has nothing left to do
            self.draft_kv_cache_group_ids = []
        try:
            draft_tokens = super().propose(
                input_batch,
                attn_metadata,
                slot_mappings,
                last_hidden_states,
                aux_hidden_states,
                num_sampled,
                num_rejected,
                last_sampled,
                next_prefill_tokens,
                temperature,
                seeds,
                num_tokens_across_dp=num_tokens_across_dp,
                dummy_run=dummy_run,
                skip_attn_for_dummy_run=skip_attn_for_dummy_run,
                mm_inputs=mm_inputs,
                is_profile=is_profile,
            )
        finally:
            if group_ids is not None:
                self.draft_kv_cache_group_ids = group_ids
        record = not (dummy_run or held) and self.verify_shape is not None
        if record and self.store_trees_in_graph:
            self.verify_shape.record_(self.budget_policy.chosen)  # auto, in graph
        if not dummy_run and not self.store_trees_in_graph:
            active = None
            if self.budget_policy is not None:
                active = self.budget_policy.choose(
                    self.batch_scores[:num_reqs], input_batch.seq_lens[:num_reqs]
                )
                if record:
                    self.verify_shape.record_(active)
            self.state.store_trees_(
                input_batch.idx_mapping,
                self.batch_parents[:num_reqs],
                self.batch_depths[:num_reqs],
                self.batch_ancestor_bits[:num_reqs],
                active,
            )
        if self.step_plan is not None and not dummy_run:
            self.step_plan.step_finished()
        return draft_tokens
