"""Every monkeypatch of vLLM internals, one module per patch point.

Each patch module exposes ``apply()``, names the vLLM function it replaces, calls
``require_vllm_version`` first and is idempotent. ``apply_all`` runs them in the
order of ``PATCH_MODULES``; the plugin entry point calls it in every process.
"""

from __future__ import annotations

import importlib
import os

from patches._guard import SUPPORTED_VLLM_VERSION, VllmVersionError, require_vllm_version

# Patch modules, applied in this order (each is ``patches.<name>``).
PATCH_MODULES: list[str] = ["speculative_config", "spec_decode_metrics", "request_validation"]

# The V2-runner integration of DDTree. It runs on the H200 but its equality with
# plain decoding is not yet confirmed there, so it is applied only on request
# (VLLM_DDTREE_EXPERIMENTAL_RUNNER=1, below); without it the front-end patch refuses
# method 'ddtree'. Once tests/gpu/test_ddtree_vllm.py passes, move these into
# PATCH_MODULES and drop the opt-in. Applied in this order; each is idempotent.
PENDING_GPU_VALIDATION: list[str] = [
    "drafting_slots",  # SpeculativeConfig.max_num_new_slots_for_drafting
    "scheduler_lookahead",  # Scheduler.__init__: num_lookahead_tokens = block_size
    "init_speculator",  # model_runner.init_speculator -> DDTreeSpeculator
    "custom_sampler",  # DefaultModelState.custom_sampler -> DDTreeVerifier
    "tree_positions",  # DefaultModelState.prepare_inputs / prepare_dummy_inputs
]


# Opt-in for the runner path before it is validated: with this variable set to 1 in
# the environment of `vllm serve` / the process that builds LLM(), every vLLM
# process (they inherit the environment and call the plugin) also applies
# PENDING_GPU_VALIDATION, so `method: ddtree` runs instead of being refused.
EXPERIMENTAL_RUNNER_ENV = "VLLM_DDTREE_EXPERIMENTAL_RUNNER"


def experimental_runner_enabled() -> bool:
    """Whether ``VLLM_DDTREE_EXPERIMENTAL_RUNNER=1`` asks for the pending runner patches."""
    value = os.environ.get(EXPERIMENTAL_RUNNER_ENV, "0")
    if value not in ("0", "1"):
        raise ValueError(f"{EXPERIMENTAL_RUNNER_ENV} must be 0 or 1, got {value!r}")
    return value == "1"


def apply_all() -> list[str]:
    """Apply every patch in ``PATCH_MODULES`` (and ``PENDING_GPU_VALIDATION`` when
    ``VLLM_DDTREE_EXPERIMENTAL_RUNNER=1``); returns the names applied."""
    applied = []
    for name in PATCH_MODULES:
        importlib.import_module(f"patches.{name}").apply()
        applied.append(name)
    if experimental_runner_enabled():
        for name in PENDING_GPU_VALIDATION:
            importlib.import_module(f"patches.{name}").apply()
            applied.append(name)
    return applied


def apply_pending_gpu_validation() -> list[str]:
    """Apply ``PATCH_MODULES`` then ``PENDING_GPU_VALIDATION`` in this process only
    (GPU validation runs: call it in every vLLM process, e.g. in-process engine with
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0``). Returns the names applied."""
    os.environ[EXPERIMENTAL_RUNNER_ENV] = "1"  # the front-end patch reads it per call
    return apply_all()


__all__ = [
    "EXPERIMENTAL_RUNNER_ENV",
    "experimental_runner_enabled",
    "PENDING_GPU_VALIDATION",
    "SUPPORTED_VLLM_VERSION",
    "VllmVersionError",
    "apply_all",
    "apply_pending_gpu_validation",
    "require_vllm_version",
]
