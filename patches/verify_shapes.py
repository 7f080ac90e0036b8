"""Patch ``vllm.v1.worker.gpu.model_runner.GPUModelRunner.execute_model`` /
``.capture_model`` and ``vllm.v1.worker.gpu.cudagraph_utils.CudaGraphManager.
_init_candidates`` / ``.dispatch`` / ``.capture`` (vLLM 0.26.0): steps that verify fewer
than B drafts a request: ``ddtree_budget: "auto"``'s adaptive verify shapes and plain
decoding steps (b = 0), and the batch schedule ``num_speculative_tokens_per_batch_size``
(``vllm_ddtree.verify.shape``, ``vllm_ddtree.budget.schedule``).

* ``execute_model``: before the runner builds the batch, cut each request's
  scheduled drafts to the speculator's ``StepPlan.step_shape`` (``truncate_drafts``
  copies the ``SchedulerOutput``; the scheduler's own object is untouched; 0 drafts:
  a plain decoding step, sampled without the verifier). Everything the runner derives
  from the batch (``num_tokens``, the uniform query length its graph dispatch keys on,
  ``cu_num_logits``) follows.
* ``_init_candidates`` of the target's ``ModelCudaGraphManager``: capture FULL decode
  graphs for every uniform query length ``1 + s`` (``verify.shape.step_shapes``, s = 0
  included where plain steps occur). vLLM captures one length per entry of
  ``num_speculative_tokens_per_batch_size`` (dynamic speculative decoding,
  ``cudagraph_utils.py:196-220``); the patch sets that list to the shapes for the
  duration of the call only, so the scheduler (which reads it to change the number
  of drafts it schedules, ``scheduler.py:243-248``; DDTree keeps the user's schedule
  out of vLLM's config) never sees it. The drafter's graph managers are other classes
  and keep their one shape.
* ``dispatch`` of that manager: vLLM looks for a graph only among the descriptors of
  the smallest captured token count >= the batch's (``cudagraph_utils.py:270-280``).
  With several query lengths that size often belongs to another length (3 requests
  of 5 rows = 15 tokens; 16 was captured for 2-row queries), and the step would run
  piecewise. When that happens the patch takes the smallest FULL graph of the same
  query length that holds the batch (the runner pads requests and tokens, as for
  any FULL graph). The same lookup leaves a batch that holds a prefill without any
  graph where its token count falls just below a count captured only for uniform
  decodes (``round_up(size, 1 + s)``, not a capture size): with auto's shapes 303 of
  the counts 2-512 of vLLM's default capture sizes, with a fixed B = 64 28 (65, 129,
  130, ...), and such a step ran eagerly, every layer's kernels launched from Python.
  In any DDTree run ``_init_candidates`` adds to each such count's candidates the
  smallest graph of the mixed mode (PIECEWISE) that holds it, which vLLM's dispatch
  then finds as it does where no decode count shadows it.
* ``capture`` of that manager: each verify graph of one request, and with auto's
  step gate of 1, 2, 4, ... requests, is replayed right after its capture
  (``vllm_ddtree.budget.verify_costs``); with the gate, the drafter's graphs too. Then
  ``capture_model`` hands the times to auto: one request's verify forward per shape to
  the device choice (``BudgetPolicy.set_row_costs``), the verify forward by total rows
  and the drafter's block pass by requests to the gate's cost model
  (``vllm_ddtree.budget.step_cost.StepCostModel.set_graph_costs``). Not at TP > 1:
  vLLM's custom all-reduce registers the graphs' buffers only when the capture context
  exits.

All are no-ops unless the process runs DDTree with ``ddtree_budget: "auto"`` (adaptive
verify shapes) or a batch schedule, except the mixed-batch candidates of
``_init_candidates``, which serve every DDTree run.
"""

from __future__ import annotations

from vllm_ddtree.patches._guard import mark_patched, require_vllm_version

PATCHED_FUNCTION = (
    "vllm.v1.worker.gpu.model_runner.GPUModelRunner.execute_model / .capture_model, "
    "vllm.v1.worker.gpu.cudagraph_utils.CudaGraphManager._init_candidates / .dispatch / "
    ".capture"
)


def verify_shapes(vllm_config, max_num_reqs: int) -> list[int] | None:
    """Every drafts-per-request count a step of this run may verify
    (``vllm_ddtree.verify.shape.step_shapes``), or None when every step verifies B."""
    from vllm_ddtree.runtime_state import ddtree_config_of
    from vllm_ddtree.verify.shape import step_shapes

    parallel = vllm_config.parallel_config
    return step_shapes(ddtree_config_of(vllm_config.speculative_config),
                       parallel.tensor_parallel_size, max_num_reqs,
                       getattr(parallel, "data_parallel_size", 1))


def ddtree_run(vllm_config) -> bool:
    """Whether the process's speculative method is DDTree (any budget)."""
    from vllm_ddtree.runtime_state import ddtree_config_of

    return ddtree_config_of(vllm_config.speculative_config) is not None


def add_mixed_candidates(manager) -> None:
    """Each token count whose candidates hold no graph of the mixed mode (a count
    captured only for uniform decodes, ``round_up(size, 1 + s)``) also gets the
    mixed mode's smallest graph that holds it, last: vLLM's dispatch keeps its
    order and otherwise runs such a batch eagerly. Once, at start-up."""
    mixed = manager.cudagraph_mode.mixed_mode() if manager.cudagraph_mode else None
    descs = sorted(manager._capture_descs.get(mixed, []) if mixed else [],
                   key=lambda d: d.num_tokens)
    for (tokens, loras), candidates in list(manager._candidates.items()):
        if any(d.cg_mode == mixed and d.uniform_token_count is None for d in candidates):
            continue
        holds = next((d for d in descs if d.num_tokens >= tokens
                      and d.num_active_loras == loras), None)
        if holds is not None:
            manager._candidates[(tokens, loras)] = [*candidates, holds]


def gate_timings(vllm_config) -> bool:
    """Whether the run has auto's step gate, which times graphs of several batch
    sizes (``vllm_ddtree.verify.shape.auto_plain_steps``)."""
    from vllm_ddtree.runtime_state import ddtree_config_of
    from vllm_ddtree.verify.shape import auto_plain_steps

    parallel = vllm_config.parallel_config
    return auto_plain_steps(ddtree_config_of(vllm_config.speculative_config),
                            parallel.tensor_parallel_size,
                            getattr(parallel, "data_parallel_size", 1))


def _is_dummy(args, kwargs) -> bool:
    """``execute_model(scheduler_output, intermediate_tensors, dummy_run, ...)``."""
    if "dummy_run" in kwargs:
        return bool(kwargs["dummy_run"])
    return bool(args[1]) if len(args) > 1 else False


def _shape_timer(manager):
    """The ``ShapeGraphTimer`` for a graph manager's capture, or None (no timing):
    the target's verify graphs (one request for auto's row costs; with the step gate
    also 2, 4, ... requests) and, with the gate, the DDTree drafter's block-pass
    graphs. Not at TP > 1 (no replays inside vLLM's capture context there)."""
    config = manager.vllm_config
    if config.parallel_config.tensor_parallel_size > 1:
        return None
    from vllm_ddtree.budget.verify_costs import ShapeGraphTimer, timing_request_counts
    from vllm_ddtree.runtime_state import ddtree_config_of

    ddtree = ddtree_config_of(config.speculative_config)
    shapes = getattr(manager, "_ddtree_shapes", None)
    gate = gate_timings(config)
    counts = timing_request_counts(manager.max_num_reqs) if gate else [1]
    if shapes and ddtree is not None and ddtree.adaptive:
        return ShapeGraphTimer(manager.graphs, shapes, request_counts=counts)
    if gate:
        from vllm.v1.worker.gpu.spec_decode.dflash.cudagraph import DFlashCudaGraphManager

        if isinstance(manager, DFlashCudaGraphManager):
            return ShapeGraphTimer(manager.graphs, [manager.decode_query_len - 1],
                                   request_counts=counts)
    return None


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
        plan = getattr(getattr(self, "speculator", None), "step_plan", None)
        if (plan is not None and not _is_dummy(args, kwargs)
                and scheduler_output.total_num_scheduled_tokens > 0):
            from vllm_ddtree.verify.shape import prefill_load, truncate_drafts, warm_up_batch

            scheduled = scheduler_output.num_scheduled_tokens
            shape = plan.step_shape(len(scheduled), prefill_load(scheduler_output),
                                    warm_up_batch(scheduled))
            scheduler_output = truncate_drafts(scheduler_output, shape)
        return original_execute(self, scheduler_output, *args, **kwargs)

    def _init_candidates(self):
        shapes = None
        ddtree = isinstance(self, ModelCudaGraphManager) and ddtree_run(self.vllm_config)
        if ddtree:
            shapes = verify_shapes(self.vllm_config, self.max_num_reqs)
        self._ddtree_shapes = shapes
        if shapes is None:
            original_candidates(self)
        else:
            spec = self.vllm_config.speculative_config
            saved = spec.num_speculative_tokens_per_batch_size
            spec.num_speculative_tokens_per_batch_size = [
                (1, self.max_num_reqs, s) for s in shapes
            ]
            try:
                original_candidates(self)
            finally:
                spec.num_speculative_tokens_per_batch_size = saved
        if ddtree:
            add_mixed_candidates(self)

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
        timer = _shape_timer(self)
        if timer is None:
            return original_capture(self, create_forward_fn, *args, **kwargs)

        def timed_create_forward_fn(desc, warmup):
            # The graph captured last still has its dummy inputs in the buffers.
            timer.time_new_graphs()
            return create_forward_fn(desc, warmup)

        result = original_capture(self, timed_create_forward_fn, *args, **kwargs)
        timer.time_new_graphs()
        self._ddtree_shape_timer = None if timer.failed else timer
        return result

    def capture_model(self):
        result = original_capture_model(self)
        speculator = getattr(self, "speculator", None)
        target = getattr(self.cudagraph_manager, "_ddtree_shape_timer", None)
        policy = getattr(speculator, "budget_policy", None)
        if target is not None and target.seconds and policy is not None:
            try:
                policy.set_row_costs(target.seconds)
            except ValueError as e:  # e.g. B beyond the largest captured size
                import logging

                logging.getLogger("vllm.ddtree.verify_shapes").warning(
                    "DDTree auto budget runs without row costs: %s", e)
        gate = getattr(getattr(speculator, "step_plan", None), "gate", None)
        if gate is not None:
            drafter = getattr(getattr(speculator, "query_cudagraph_manager", None),
                              "_ddtree_shape_timer", None)
            gate.set_graph_costs(target.by_tokens() if target is not None else {},
                                 drafter.by_reqs() if drafter is not None else {})
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
