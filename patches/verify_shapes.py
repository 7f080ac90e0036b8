"""Patch ``vllm.v1.worker.gpu.model_runner.GPUModelRunner.execute_model`` /
``.capture_model`` and ``vllm.v1.worker.gpu.cudagraph_utils.CudaGraphManager.
_init_candidates`` / ``.dispatch`` / ``.capture`` (vLLM 0.26.0): DDTree's adaptive verify
shapes (``vllm_ddtree.verify.shape``).

* ``execute_model``: before the runner builds the batch, cut each request's
  scheduled drafts to the shape the speculator's ``VerifyShapeChooser`` gives
  (``truncate_drafts`` copies the ``SchedulerOutput``; the scheduler's own object is
  untouched). Everything the runner derives from the batch (``num_tokens``, the
  uniform query length its graph dispatch keys on, ``cu_num_logits``) follows.
* ``_init_candidates`` of the target's ``ModelCudaGraphManager``: capture FULL decode
  graphs for every uniform query length ``1 + s``. vLLM captures one length per
  entry of ``num_speculative_tokens_per_batch_size`` (dynamic speculative decoding,
  ``cudagraph_utils.py:196-220``); the patch sets that list to the shapes for the
  duration of the call only, so the scheduler (which reads it to change the number
  of drafts it schedules, ``scheduler.py:243-248``) never sees it. The drafter's graph
  managers are other classes and keep their one shape.
* ``dispatch`` of that manager: vLLM looks for a graph only among the descriptors of
  the smallest captured token count >= the batch's (``cudagraph_utils.py:270-280``).
  With several query lengths that size often belongs to another length (3 requests
  of 5 rows = 15 tokens; 16 was captured for 2-row queries), and the step would run
  piecewise. When that happens the patch takes the smallest FULL graph of the same
  query length that holds the batch (the runner pads requests and tokens, as for
  any FULL graph).
* ``capture`` of that manager: each one-request verify graph is replayed right after
  its capture (``vllm_ddtree.budget.verify_costs``), and ``capture_model`` hands the
  times to ``ddtree_budget: "auto"``'s policy (``BudgetPolicy.set_row_costs``): what a
  verified row costs beside attention. Not at TP > 1: vLLM's custom all-reduce
  registers the graphs' buffers only when the capture context exits.

Both are no-ops unless the process runs DDTree with ``ddtree_budget: "auto"`` and an
adaptive verify shape.
"""

from __future__ import annotations

from vllm_ddtree.patches._guard import mark_patched, require_vllm_version

PATCHED_FUNCTION = (
    "vllm.v1.worker.gpu.model_runner.GPUModelRunner.execute_model / .capture_model, "
    "vllm.v1.worker.gpu.cudagraph_utils.CudaGraphManager._init_candidates / .dispatch / "
    ".capture"
)


def adaptive_verify_shapes(vllm_config) -> list[int] | None:
    """The candidate verify shapes (drafts per request) when ``vllm_config`` runs
    DDTree with adaptive verify shapes, else None."""
    from vllm_ddtree.budget.policy import candidate_budgets
    from vllm_ddtree.runtime_state import ddtree_config_of

    spec = vllm_config.speculative_config
    ddtree = ddtree_config_of(spec)
    if ddtree is None:
        return None
    tp = vllm_config.parallel_config.tensor_parallel_size
    if ddtree.resolved_verify_shape(tp) != "adaptive":
        return None
    return candidate_budgets(ddtree.budget)


def apply() -> None:
    require_vllm_version(PATCHED_FUNCTION)
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.worker.gpu.cudagraph_utils import (
        CudaGraphManager,
        ModelCudaGraphManager,
        _is_compatible,
    )
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    original_execute = GPUModelRunner.execute_model
    original_capture_model = GPUModelRunner.capture_model
    original_candidates = CudaGraphManager._init_candidates
    original_dispatch = CudaGraphManager.dispatch
    original_capture = CudaGraphManager.capture
    if getattr(original_execute, "_ddtree_patched", False):
        return

    def execute_model(self, scheduler_output, *args, **kwargs):
        chooser = getattr(getattr(self, "speculator", None), "verify_shape", None)
        if chooser is not None:
            from vllm_ddtree.verify.shape import truncate_drafts

            scheduler_output = truncate_drafts(scheduler_output, chooser.next_shape())
        return original_execute(self, scheduler_output, *args, **kwargs)

    def _init_candidates(self):
        shapes = None
        if isinstance(self, ModelCudaGraphManager):
            shapes = adaptive_verify_shapes(self.vllm_config)
        self._ddtree_shapes = shapes
        if shapes is None:
            return original_candidates(self)
        spec = self.vllm_config.speculative_config
        saved = spec.num_speculative_tokens_per_batch_size
        spec.num_speculative_tokens_per_batch_size = [
            (1, self.max_num_reqs, s) for s in shapes
        ]
        try:
            return original_candidates(self)
        finally:
            spec.num_speculative_tokens_per_batch_size = saved

    def dispatch(self, num_reqs, num_tokens, uniform_token_count, num_active_loras):
        desc = original_dispatch(self, num_reqs, num_tokens, uniform_token_count,
                                 num_active_loras)
        if (desc.cg_mode == CUDAGraphMode.FULL or uniform_token_count is None
                or not getattr(self, "_ddtree_shapes", None) or not self._graphs_captured):
            return desc
        loras = self._resolve_effective_loras(num_active_loras)
        fits = [d for d in self._capture_descs.get(CUDAGraphMode.FULL, [])
                if d in self.graphs and d.uniform_token_count == uniform_token_count
                and _is_compatible(d, num_reqs, num_tokens, uniform_token_count, loras)]
        return min(fits, key=lambda d: d.num_tokens) if fits else desc

    def capture(self, create_forward_fn, *args, **kwargs):
        shapes = getattr(self, "_ddtree_shapes", None)
        # At TP > 1 the graphs hold vLLM's custom all-reduce, whose buffers are only
        # registered when the capture context exits: no replay inside it.
        if not shapes or self.vllm_config.parallel_config.tensor_parallel_size > 1:
            return original_capture(self, create_forward_fn, *args, **kwargs)
        from vllm_ddtree.budget.verify_costs import ShapeGraphTimer

        timer = ShapeGraphTimer(self.graphs, shapes)

        def timed_create_forward_fn(desc, warmup):
            # The graph captured last still has its dummy inputs in the buffers.
            timer.time_new_graphs()
            return create_forward_fn(desc, warmup)

        result = original_capture(self, timed_create_forward_fn, *args, **kwargs)
        timer.time_new_graphs()
        self._ddtree_shape_seconds = None if timer.failed else timer.seconds
        return result

    def capture_model(self):
        result = original_capture_model(self)
        seconds = getattr(self.cudagraph_manager, "_ddtree_shape_seconds", None)
        policy = getattr(self.speculator, "budget_policy", None)
        if seconds and policy is not None:
            try:
                policy.set_row_costs(seconds)
            except ValueError as e:  # e.g. B beyond the largest captured size
                import logging

                logging.getLogger("vllm.ddtree.verify_shapes").warning(
                    "DDTree auto budget runs without row costs: %s", e)
        return result

    mark_patched(execute_model, original_execute)
    mark_patched(_init_candidates, original_candidates)
    mark_patched(dispatch, original_dispatch)
    mark_patched(capture, original_capture)
    mark_patched(capture_model, original_capture_model)
    GPUModelRunner.execute_model = execute_model
    CudaGraphManager._init_candidates = _init_candidates
    CudaGraphManager.dispatch = dispatch
    CudaGraphManager.capture = capture
    GPUModelRunner.capture_model = capture_model
