"""Which tree-verify backend fills vLLM's single ``AttentionBackendEnum.CUSTOM`` slot.

vLLM has one ``CUSTOM`` backend per process, and the plugin's ``register()`` runs in
every process (front-end, engine core, workers). The choice therefore travels as the
switch ``VLLM_DDTREE_TREE_BACKEND`` (``vllm_ddtree.settings``; an environment variable
that vLLM's child processes inherit): ``mla`` (default) for MLA targets, ``gqa`` for
GQA/MHA targets.
"""

from __future__ import annotations

from vllm_ddtree import settings

TREE_BACKEND_ENV = "VLLM_DDTREE_TREE_BACKEND"
TREE_BACKEND_CLASSES = {
    "mla": "vllm_ddtree.attention_backends.mla_tree.backend.TreeMLABackend",
    "gqa": "vllm_ddtree.attention_backends.gqa_tree.backend.TreeGQABackend",
}


def tree_backend_kind_from_env() -> str:
    """The tree backend kind named by ``VLLM_DDTREE_TREE_BACKEND``: ``"mla"`` or ``"gqa"``
    (``"mla"`` when unset or empty).

    Raises:
        vllm_ddtree.settings.SettingError (a ValueError) naming the variable, its value
        and the choices, for any other value.
    """
    return settings.get(TREE_BACKEND_ENV)


def register_tree_backend(kind: str) -> str:
    """Register the ``kind`` (``"mla"`` / ``"gqa"``) tree backend as ``CUSTOM``.

    Only the class path is recorded (nothing is imported), so this is cheap and safe
    on machines without a GPU. Returns the registered class path.

    Raises:
        ValueError for an unknown ``kind``.
    """
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if kind not in TREE_BACKEND_CLASSES:
        choices = ", ".join(repr(k) for k in TREE_BACKEND_CLASSES)
        raise ValueError(f"kind={kind!r} is not a DDTree tree backend; use one of {choices}")
    register_backend(AttentionBackendEnum.CUSTOM, TREE_BACKEND_CLASSES[kind])
    return TREE_BACKEND_CLASSES[kind]
