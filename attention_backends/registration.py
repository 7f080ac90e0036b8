"""Which tree-verify backend fills vLLM's single ``AttentionBackendEnum.CUSTOM`` slot.

vLLM has one ``CUSTOM`` backend per process, and the plugin's ``register()`` runs in
every process (front-end, engine core, workers). The choice therefore travels as the
environment variable ``VLLM_DDTREE_TREE_BACKEND`` (inherited by vLLM's child
processes): ``mla`` (default) for MLA targets, ``gqa`` for GQA/MHA targets.
"""

from __future__ import annotations

import os

TREE_BACKEND_ENV = "VLLM_DDTREE_TREE_BACKEND"
DEFAULT_TREE_BACKEND = "mla"
TREE_BACKEND_CLASSES = {
    "mla": "vllm_ddtree.attention_backends.mla_tree.backend.TreeMLABackend",
    "gqa": "vllm_ddtree.attention_backends.gqa_tree.backend.TreeGQABackend",
}


def _check_kind(kind: str, source: str) -> str:
    if kind not in TREE_BACKEND_CLASSES:
        choices = ", ".join(repr(k) for k in TREE_BACKEND_CLASSES)
        raise ValueError(f"{source}={kind!r} is not a DDTree tree backend; use one of {choices}")
    return kind


def tree_backend_kind_from_env() -> str:
    """The tree backend kind named by ``VLLM_DDTREE_TREE_BACKEND``: ``"mla"`` or ``"gqa"``.

    Unset or empty means ``"mla"``; case and surrounding spaces are ignored.

    Raises:
        ValueError naming the variable for any other value.
    """
    value = os.environ.get(TREE_BACKEND_ENV, "").strip().lower() or DEFAULT_TREE_BACKEND
    return _check_kind(value, TREE_BACKEND_ENV)


def register_tree_backend(kind: str) -> str:
    """Register the ``kind`` (``"mla"`` / ``"gqa"``) tree backend as ``CUSTOM``.

    Only the class path is recorded (nothing is imported), so this is cheap and safe
    on machines without a GPU. Returns the registered class path.

    Raises:
        ValueError for an unknown ``kind``.
    """
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    class_path = TREE_BACKEND_CLASSES[_check_kind(kind, "kind")]
    register_backend(AttentionBackendEnum.CUSTOM, class_path)
    return class_path
