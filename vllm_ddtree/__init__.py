"""vllm-ddtree: DDTree tree speculative decoding with a DFlash drafter for vLLM 0.26.

``register`` is the ``vllm.general_plugins`` entry point: vLLM calls it once in
every process (front-end, engine core, workers). It is idempotent and does no
GPU work, so it is harmless on CPU-only machines.
"""

from __future__ import annotations

import logging

__version__ = "0.1.0"

logger = logging.getLogger(__name__)
_registered = False


def register() -> None:
    """Apply the plugin's vLLM patches and backend registrations (idempotent)."""
    global _registered
    if _registered:
        return
    from vllm_ddtree.patches import apply_all, require_vllm_version

    require_vllm_version("vllm_ddtree.register")
    applied = apply_all()
    _register_attention_backends()
    _register_models()
    _registered = True
    logger.debug("vllm-ddtree registered; patches applied: %s", applied)


def _register_models() -> None:
    """DFlash2 drafters (``"architectures": ["DFlash2DraftModel"]``) load through vLLM's
    model registry as :class:`vllm_ddtree.draft.dflash2_model.DFlash2Qwen3ForCausalLM`
    (imported when vLLM first builds one)."""
    from vllm import ModelRegistry

    ModelRegistry.register_model(
        "DFlash2DraftModel", "vllm_ddtree.draft.dflash2_model:DFlash2Qwen3ForCausalLM")


def _register_attention_backends() -> None:
    """Expose the tree-verify backend named by ``VLLM_DDTREE_TREE_BACKEND`` (``mla``
    default, ``gqa``) as ``--attention-backend CUSTOM``."""
    from vllm_ddtree import settings
    from vllm_ddtree.attention_backends.registration import register_tree_backend

    register_tree_backend(settings.get("VLLM_DDTREE_TREE_BACKEND"))
