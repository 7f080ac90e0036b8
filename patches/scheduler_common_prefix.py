"""Patch ``vllm.v1.core.sched.scheduler.Scheduler.__init__`` (vLLM 0.26.0): no
common-prefix scan for the V2 model runner.

Every ``schedule()`` asks ``kv_cache_manager.get_num_common_prefix_blocks`` for the
blocks all running requests share (``scheduler.py:1077-1085``), for cascade
attention. Each KV-cache group walks the first running request's blocks in Python
until one is not shared (``single_type_kv_cache_manager.py:795-802``): at batch 1
every block is shared, so the walk is the whole context, every step, in every group
(at 16k context and 64-token pages, 256 blocks in each of 5 groups on the kimi8
bench). Only the V1 runner reads the result (``gpu_model_runner.py:2594-2654``); the
V2 runner, the only one DDTree runs on, never does (its warm-up writes zeros). With
this patch the scheduler of a V2-runner engine gets ``[0] * num_groups``, which is
what cascade attention's "no common prefix" reads as anyway.

It applies to the engines of DDTree runs (the runner patches); vLLM's own methods keep
vLLM's scheduler. (``evals/bench_e2e.py``'s ``+skipprefix`` runs give vLLM's chain the
same scheduler by calling :func:`skip_common_prefix_scan` in the benchmark's process.)
"""

from __future__ import annotations

from vllm_ddtree.patches._guard import require_vllm_version

PATCHED_FUNCTION = ("vllm.v1.core.sched.scheduler.Scheduler.__init__ "
                    "(kv_cache_manager.get_num_common_prefix_blocks)")


def skips_common_prefix(use_v2_model_runner: bool, is_ddtree: bool) -> bool:
    """Whether an engine's scheduler skips the common-prefix scan: DDTree engines on the
    V2 runner (the V1 runner reads the result, for cascade attention)."""
    return bool(use_v2_model_runner and is_ddtree)


def skip_common_prefix_scan(scheduler) -> None:
    """Make ``scheduler``'s KV-cache manager answer "no common prefix" (``[0]`` per
    KV-cache group) without walking any block. An instance attribute: this engine's
    manager only."""
    num_groups = len(scheduler.kv_cache_config.kv_cache_groups)
    scheduler.kv_cache_manager.get_num_common_prefix_blocks = (
        lambda running_request_id: [0] * num_groups)


def apply() -> None:
    require_vllm_version(PATCHED_FUNCTION)
    from vllm.v1.core.sched.scheduler import Scheduler

    original = Scheduler.__init__
    wrapper = original
    while wrapper is not None:  # other patches may wrap ours (scheduler_lookahead)
        if getattr(wrapper, "_ddtree_common_prefix_patched", False):
            return
        wrapper = getattr(wrapper, "_ddtree_original", None)

    def __init__(self, vllm_config, *args, **kwargs):
        original(self, vllm_config, *args, **kwargs)
        from vllm_ddtree.runtime_state import ddtree_config_of

        is_ddtree = ddtree_config_of(vllm_config.speculative_config) is not None
        if skips_common_prefix(bool(getattr(self, "use_v2_model_runner", False)), is_ddtree):
            skip_common_prefix_scan(self)

    # Not mark_patched: its _ddtree_patched flag is scheduler_lookahead's idempotency
    # check on Scheduler.__init__, which must still wrap this one.
    __init__._ddtree_original = original
    __init__._ddtree_common_prefix_patched = True
    Scheduler.__init__ = __init__
