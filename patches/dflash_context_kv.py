"""Patch ``vllm.model_executor.models.qwen3_dflash.DFlashQwen3ForCausalLM.
precompute_and_store_context_kv`` (vLLM 0.26.0): replay a captured CUDA graph of it
when the drafter carries DDTree's ``ContextKVGraphs`` and the call matches one.

``DFlashSpeculator.propose`` calls the drafter's precompute eagerly every round
(``dflash/speculator.py:391-409``); ``DDTreeSpeculator.capture`` captures it per
full-tree context length (``vllm_ddtree.draft.context_kv_graphs``) and sets the drafter's
``_ddtree_context_kv_graphs``. Drafters without that attribute (vLLM's own DFlash
chain, any engine without DDTree) run the original unchanged.
"""

from __future__ import annotations

from vllm_ddtree.patches._guard import mark_patched, require_vllm_version

PATCHED_FUNCTION = ("vllm.model_executor.models.qwen3_dflash.DFlashQwen3ForCausalLM."
                    "precompute_and_store_context_kv")
GRAPHS_ATTR = "_ddtree_context_kv_graphs"


def apply() -> None:
    require_vllm_version(PATCHED_FUNCTION)
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM

    original = DFlashQwen3ForCausalLM.precompute_and_store_context_kv
    if getattr(original, "_ddtree_patched", False):
        return

    def precompute_and_store_context_kv(self, context_states, context_positions,
                                        context_slot_mapping=None):
        graphs = self.__dict__.get(GRAPHS_ATTR)
        if graphs is not None and graphs.replay(context_states, context_positions,
                                                context_slot_mapping):
            return None
        return original(self, context_states, context_positions, context_slot_mapping)

    mark_patched(precompute_and_store_context_kv, original)
    DFlashQwen3ForCausalLM.precompute_and_store_context_kv = precompute_and_store_context_kv
