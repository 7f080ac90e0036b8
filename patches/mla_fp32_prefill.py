"""Patch ``vllm.model_executor.layers.attention.mla_attention.get_mla_prefill_backend``
(vLLM 0.26.0, imported by name at ``mla_attention.py:271`` and called in
``MLAAttention.__init__``, ``:515-538``): let an fp32 MLA model start on our tree
backend.

vLLM's MLA prefill backends (``v1/attention/backends/mla/prefill/``) take bf16 / fp16
only, so ``get_mla_prefill_backend`` raises for an fp32 model and the layer cannot be
built. With the ``CUSTOM`` MLA tree backend in fp32 no token takes the prefill path:
``TreeMLAMetadataBuilder`` counts every request as a decode
(``reorder_batch_threshold`` = the batch token budget) and the tree kernel computes
prefill chunks in the absorbed form with causal bits. The replacement returns
:class:`NoMLAPrefillBackend` there (a stand-in that refuses to run), and defers to
vLLM everywhere else. It exists for exactness checks in fp32 (lm-eval validation:
DDTree against no speculation, both on this backend), where bf16 ties would hide
real differences.
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_ddtree.patches._guard import mark_patched, require_vllm_version

PATCHED_FUNCTION = "vllm.model_executor.layers.attention.mla_attention.get_mla_prefill_backend"


class NoMLAPrefillBackend:
    """The prefill backend of an fp32 MLA layer on the tree backend: never runs
    (every token is a decode there). Carries the attributes ``MLAAttention`` and the
    metadata builder touch at start-up (``mla_attention.py:530-538, 759-770,
    1836-1838, 1961-1964``)."""

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs

    @staticmethod
    def get_name() -> str:
        return "NONE_FP32_TREE_KERNEL"

    def clone(self) -> NoMLAPrefillBackend:
        return NoMLAPrefillBackend(**self.kwargs)

    def supports_quant_output(self, quant_key: Any) -> bool:
        return False

    def prepare_metadata(self, prefill_metadata: Any) -> None:
        self._refuse()

    def run_prefill_new_tokens(self, *args: Any, **kwargs: Any) -> Any:
        self._refuse()

    def run_prefill_context_chunk(self, *args: Any, **kwargs: Any) -> Any:
        self._refuse()

    @staticmethod
    def _refuse() -> None:
        raise RuntimeError(
            "an fp32 MLA model on the DDTree tree backend has no prefill backend: every "
            "token must go through the tree kernel (TreeMLAMetadataBuilder's "
            "reorder_batch_threshold); this batch had a prefill request"
        )


def uses_fp32_tree_mla(vllm_config: Any) -> bool:
    """Whether ``vllm_config`` runs an fp32 model on the ``CUSTOM`` MLA tree backend."""
    from vllm_ddtree import settings

    model_config = getattr(vllm_config, "model_config", None)
    backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    name = str(getattr(backend, "name", backend)).upper()
    return (model_config is not None and model_config.dtype == torch.float32
            and name == "CUSTOM" and settings.get("VLLM_DDTREE_TREE_BACKEND") == "mla")


def apply() -> None:
    require_vllm_version(PATCHED_FUNCTION)
    from vllm.model_executor.layers.attention import mla_attention

    original = mla_attention.get_mla_prefill_backend
    if getattr(original, "_ddtree_patched", False):
        return

    def get_mla_prefill_backend(vllm_config):
        try:
            return original(vllm_config)
        except ValueError:
            if not uses_fp32_tree_mla(vllm_config):
                raise
            return NoMLAPrefillBackend

    mark_patched(get_mla_prefill_backend, original)
    mla_attention.get_mla_prefill_backend = get_mla_prefill_backend
