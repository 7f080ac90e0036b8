"""Patch ``vllm.config.speculative.SpeculativeConfig.max_num_new_slots_for_drafting``
(a property; vLLM 0.26.0).

``VllmConfig._set_max_num_scheduled_tokens`` (``config/vllm.py:1689-1736``) reserves
``max_num_new_slots_for_drafting * max_num_seqs`` batch slots for drafting. With
``parallel_drafting`` (set for DFlash, ``speculative.py:963-964``) that is
``num_speculative_tokens - 1`` per request (``speculative.py:1292-1306``), which
for DDTree scales with the tree budget B (e.g. 63 x 256 sequences) and can drive the
scheduled-token budget to <= 0. DDTree's drafter query block has ``block_size``
tokens whatever B is, so DDTree reserves what vLLM reserves for a DFlash drafter of
that block size: ``block_size - 2`` (= L - 1 mask slots).
"""

from __future__ import annotations

from vllm_ddtree.patches._guard import mark_patched, require_vllm_version

PATCHED_FUNCTION = "vllm.config.speculative.SpeculativeConfig.max_num_new_slots_for_drafting"


def ddtree_new_slots_for_drafting(block_size: int) -> int:
    """Slots per request DDTree reserves for drafting (see the module docstring)."""
    return max(0, block_size - 2)


def apply() -> None:
    require_vllm_version(PATCHED_FUNCTION)
    from vllm.config.speculative import SpeculativeConfig

    original = SpeculativeConfig.__dict__["max_num_new_slots_for_drafting"]
    if getattr(original.fget, "_ddtree_patched", False):
        return

    def max_num_new_slots_for_drafting(self) -> int:
        from vllm_ddtree.runtime_state import ddtree_config_of, drafter_block_size

        if ddtree_config_of(self) is None:
            return original.fget(self)
        return ddtree_new_slots_for_drafting(drafter_block_size(self))

    mark_patched(max_num_new_slots_for_drafting, original)
    SpeculativeConfig.max_num_new_slots_for_drafting = property(
        max_num_new_slots_for_drafting, doc=original.__doc__
    )
