"""Every monkeypatch of vLLM internals, one module per patch point.

Each patch module exposes ``apply()``, names the vLLM function it replaces, calls
``require_vllm_version`` first and is idempotent. ``apply_all`` runs them in the
order of ``PATCH_MODULES``; the plugin entry point calls it in every process.
"""

from __future__ import annotations

import importlib

from patches._guard import SUPPORTED_VLLM_VERSION, VllmVersionError, require_vllm_version

# Patch modules, applied in this order (each is ``patches.<name>``).
PATCH_MODULES: list[str] = ["speculative_config"]


def apply_all() -> list[str]:
    """Apply every patch in ``PATCH_MODULES``; returns the names applied."""
    applied = []
    for name in PATCH_MODULES:
        importlib.import_module(f"patches.{name}").apply()
        applied.append(name)
    return applied


__all__ = ["SUPPORTED_VLLM_VERSION", "VllmVersionError", "apply_all", "require_vllm_version"]
