"""Patch ``vllm.model_executor.models.qwen3_dflash.DFlashQwen3ForCausalLM.
precompute_and_store_context_kv`` (vLLM 0.26.0): replay a captured CUDA graph of it
when the drafter carries DDTree's ``ContextKVGraphs`` and the call matches one.

``DFlashSpeculator.propose`` calls the drafter's precompute eagerly every round
(``dflash/speculator.py:391-409``); ``DDTreeSpeculator.capture`` captures it per
full-tree context length (``vllm_ddtree.draft.context_kv_graphs``) and sets the drafter's
``_ddtree_context_kv_graphs``. Drafters without that attribute (vLLM's own DFlash
chain, any engine without DDTree) run the original unchanged.

``VLLM_DDTREE_CHAIN_CONTEXT_KV_GRAPH=1`` also patches ``vllm.v1.worker.gpu.spec_decode.
dflash.speculator.DFlashSpeculator.capture`` so that vLLM's own DFlash chain captures
the same graphs (``1 + N`` rows a request): a benchmark switch (bench ``+ctxgraph``),
so the chain can be timed with DDTree's host savings; off by default.
"""

from __future__ import annotations

import os

from vllm_ddtree.patches._guard import mark_patched, require_vllm_version

PATCHED_FUNCTION = ("vllm.model_executor.models.qwen3_dflash.DFlashQwen3ForCausalLM."
                    "precompute_and_store_context_kv")
GRAPHS_ATTR = "_ddtree_context_kv_graphs"
CHAIN_ENV = "VLLM_DDTREE_CHAIN_CONTEXT_KV_GRAPH"
CHAIN_PATCHED_FUNCTION = "vllm.v1.worker.gpu.spec_decode.dflash.speculator.DFlashSpeculator.capture"


def chain_graphs_requested() -> bool:
    """``VLLM_DDTREE_CHAIN_CONTEXT_KV_GRAPH`` is ``1`` (raises ``ValueError`` naming it
    on a value other than ``0`` / ``1``)."""
    raw = os.environ.get(CHAIN_ENV, "0").strip()
    if raw not in ("0", "1"):
        raise ValueError(f"{CHAIN_ENV}={raw!r}: use 1 (vLLM's DFlash chain captures the "
                         "context K/V graphs too) or 0")
    return raw == "1"


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


def apply_chain() -> None:
    """Patch ``DFlashSpeculator.capture``: vLLM's chain captures its context K/V graphs
    after its drafter graphs (``VLLM_DDTREE_CHAIN_CONTEXT_KV_GRAPH=1``; also applies
    :func:`apply`). ``DDTreeSpeculator`` captures its own and is left alone."""
    require_vllm_version(CHAIN_PATCHED_FUNCTION)
    apply()
    from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator

    original = DFlashSpeculator.capture
    if getattr(original, "_ddtree_patched", False):
        return

    def capture(self):
        original(self)
        from vllm_ddtree.draft.context_kv_graphs import capture_for_speculator
        from vllm_ddtree.draft.speculator import DDTreeSpeculator

        if not isinstance(self, DDTreeSpeculator):
            # the chain verifies 1 + N rows a request: its query block
            capture_for_speculator(self, [self.num_query_per_req])

    mark_patched(capture, original)
    DFlashSpeculator.capture = capture
