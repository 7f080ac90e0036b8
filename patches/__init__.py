"""Every monkeypatch of vLLM internals, one module per patch point.

Each patch module exposes ``apply()``, names the vLLM function it replaces, calls
``require_vllm_version`` first and is idempotent. ``apply_all`` runs them in the
order of ``PATCH_MODULES``; the plugin entry point calls it in every process.
"""

from __future__ import annotations

import importlib

from vllm_ddtree import settings
from vllm_ddtree.patches._guard import (
    SUPPORTED_VLLM_VERSION,
    VllmVersionError,
    require_vllm_version,
)

# Patch modules, applied in this order (each is ``patches.<name>``).
PATCH_MODULES: list[str] = [
    "speculative_config", "spec_decode_metrics", "request_validation", "prompt_token_ids",
    "mla_fp32_prefill",
]

# The V2-runner integration of DDTree: applied only in processes that run DDTree, so
# a vLLM process without ``method: ddtree`` keeps vLLM's own runner code untouched.
# The front-end patch applies them when it builds a DDTree config and sets
# ``RUNNER_ENV`` so the engine-core and worker processes started afterwards (they
# inherit the environment and load the plugin) apply them too. In this order; each
# is idempotent.
RUNNER_PATCHES: list[str] = [
    "drafting_slots",  # SpeculativeConfig.max_num_new_slots_for_drafting
    # Before scheduler_lookahead, whose idempotency flag must stay on the outer wrapper.
    "scheduler_common_prefix",  # Scheduler.__init__: no common-prefix scan (V2 runner)
    "scheduler_lookahead",  # Scheduler.__init__: num_lookahead_tokens = block_size
    "init_speculator",  # model_runner.init_speculator -> DDTreeSpeculator
    "dflash_context_kv",  # DFlashQwen3ForCausalLM.precompute_and_store_context_kv graphs
    "custom_sampler",  # DefaultModelState.custom_sampler -> DDTreeVerifier
    "tree_positions",  # DefaultModelState.prepare_inputs / prepare_dummy_inputs
    "verify_shapes",  # GPUModelRunner.execute_model, CudaGraphManager._init_candidates
    "unify_kv_block_size",  # kv_cache_utils.unify_hybrid_kv_cache_specs (one KV group)
    "batch_defaults",  # EngineArgs._set_default_max_num_seqs_and_batched_tokens_args
]

RUNNER_ENV = "VLLM_DDTREE_RUNNER"  # declared in vllm_ddtree.settings


def runner_patches_requested() -> bool:
    """Whether this process must apply ``RUNNER_PATCHES`` (``VLLM_DDTREE_RUNNER=1``,
    set by the front-end patch of a parent process that configured DDTree; raises
    ``settings.SettingError`` on a value other than ``0`` / ``1``)."""
    return settings.get(RUNNER_ENV) == "1"


def apply_all() -> list[str]:
    """Apply every patch in ``PATCH_MODULES`` (and ``RUNNER_PATCHES`` when
    ``VLLM_DDTREE_RUNNER=1``); returns the names applied."""
    applied = []
    for name in PATCH_MODULES:
        importlib.import_module(f"vllm_ddtree.patches.{name}").apply()
        applied.append(name)
    if runner_patches_requested():
        for name in RUNNER_PATCHES:
            importlib.import_module(f"vllm_ddtree.patches.{name}").apply()
            applied.append(name)
    return applied


def apply_runner_patches() -> list[str]:
    """Apply ``PATCH_MODULES`` and ``RUNNER_PATCHES`` in this process and set
    ``VLLM_DDTREE_RUNNER=1`` for the processes it starts. Returns the names applied."""
    settings.set_for_children(RUNNER_ENV, "1")
    return apply_all()


__all__ = [
    "RUNNER_ENV",
    "RUNNER_PATCHES",
    "runner_patches_requested",
    "SUPPORTED_VLLM_VERSION",
    "VllmVersionError",
    "apply_all",
    "apply_runner_patches",
    "require_vllm_version",
]
