"""Patch ``vllm.v1.core.kv_cache_utils.unify_hybrid_kv_cache_specs`` (vLLM 0.26.0): with
``disable_hybrid_kv_cache_manager`` a DFlash drafter's sliding-window layers take the
block size of the full-attention layers.

With the hybrid KV-cache manager off, vLLM keeps one KV-cache group for all layers and
turns every ``SlidingWindowSpec`` into a ``FullAttentionSpec``, but keeps the block size
the sliding layer chose for itself (``Attention.get_kv_cache_spec``: the backend's
smallest kernel block, 16 for FlashAttention, 1 for a backend that takes any size).
Beside an MLA target on 64-token pages (our backend's preference) the block sizes
differ and vLLM stops at start-up: "Hybrid KV cache manager is disabled but failed to
convert the KV cache specs to one unified type" (kimi8 setup).
vLLM's own chain ran because FLASH_ATTN_MLA stays on 16-token pages.

Before vLLM's conversion, each sliding spec whose block size divides the one block size
that every full-attention layer shares is given that block size (the sliding layer's
kernel then reads 64-token pages, a multiple of its own kernel block); any other mix is
left to vLLM's own error. The window is still applied in the layer's attention.
DDTree turns the hybrid manager off by default where one group costs no more KV memory
(``vllm_ddtree/kv_group_choice.py``), so this runs in those engines.
"""

from __future__ import annotations

import dataclasses

from vllm_ddtree.patches._guard import mark_patched, require_vllm_version

PATCHED_FUNCTION = "vllm.v1.core.kv_cache_utils.unify_hybrid_kv_cache_specs"


def align_sliding_block_sizes(kv_cache_spec: dict) -> list[str]:
    """Give every ``SlidingWindowSpec`` of ``kv_cache_spec`` (layer name -> spec, changed
    in place) the block size of its ``FullAttentionSpec`` layers (MLA included) when
    those share one block size that is a multiple of the sliding one. Returns the
    names of the layers changed (none when there is no such common block size)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    full_sizes = {spec.block_size for spec in kv_cache_spec.values()
                  if isinstance(spec, FullAttentionSpec)}
    if len(full_sizes) != 1:
        return []
    (block_size,) = full_sizes
    changed = []
    for name, spec in kv_cache_spec.items():
        if (isinstance(spec, SlidingWindowSpec) and spec.page_size_padded is None
                and spec.block_size != block_size and block_size % spec.block_size == 0):
            kv_cache_spec[name] = dataclasses.replace(spec, block_size=block_size)
            changed.append(name)
    return changed


def apply() -> None:
    require_vllm_version(PATCHED_FUNCTION)
    from vllm.v1.core import kv_cache_utils

    original = kv_cache_utils.unify_hybrid_kv_cache_specs
    if getattr(original, "_ddtree_patched", False):
        return

    def unify_hybrid_kv_cache_specs(kv_cache_spec):
        align_sliding_block_sizes(kv_cache_spec)
        return original(kv_cache_spec)

    mark_patched(unify_hybrid_kv_cache_specs, original)
    kv_cache_utils.unify_hybrid_kv_cache_specs = unify_hybrid_kv_cache_specs
