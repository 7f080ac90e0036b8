"""The target's paged KV caches as DDTree's compaction sees them: per-layer page views,
the target layers of each KV-cache group, and the compaction slots of a verify batch
(helpers of ``vllm_ddtree.draft.speculator.DDTreeSpeculator``, which re-exports them)."""

from __future__ import annotations

import torch

from vllm_ddtree.compact.reference import compaction_slots

__all__ = ["kv_page_views", "path_compaction_slots", "target_layers_by_group"]


def path_compaction_slots(
    slot_mapping: torch.Tensor, query_start_loc: torch.Tensor, kv_src_rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``compact.reference.compaction_slots`` on a slot mapping padded by ``L + 1`` entries.

    ``compaction_slots`` reads ``slot_mapping[start_r + k]`` for every depth column k,
    valid or not; for a short last request (a prefill chunk, a truncated tree) that
    index passes the end of the ``[num_tokens_padded]`` view (a device-side assert
    on CUDA). The padding entries are only ever read for masked columns.
    """
    pad = slot_mapping.new_full((kv_src_rows.shape[1] + 1,), -1)
    return compaction_slots(torch.cat([slot_mapping, pad]), query_start_loc, kv_src_rows)


def kv_page_views(kv_cache: torch.Tensor) -> list[torch.Tensor]:
    """``[num_blocks, page, *row]`` views of one layer's paged KV cache (no copies):
    slot ``s`` is row ``s % page`` of block ``s // page``; block strides are kept as
    they are, so pages that vLLM padded to the model's largest page (an MLA target
    beside a GQA drafter, ``kv_cache_utils.unify_kv_cache_spec_page_size``) work.

    Supported logical layouts (``backend.get_kv_cache_shape``):

    * MLA ``[num_blocks, block_size, head_size]`` -> itself;
    * FlashAttention ``[2, num_blocks, block_size, H, D]`` -> K and V
      ``[num_blocks, block_size, H, D]``;
    * vLLM Triton / DDTree GQA ``[num_blocks, H, block_size, 2 * D]`` (K and V side by
      side) -> ``[num_blocks, block_size, H, 2 * D]`` (a transpose).

    Raises ``NotImplementedError`` for other layouts.
    """
    if kv_cache.dim() == 3:
        return [kv_cache]
    if kv_cache.dim() == 5 and kv_cache.shape[0] == 2:
        return [kv_cache[0], kv_cache[1]]
    if kv_cache.dim() == 4:  # vLLM Triton / DDTree GQA: logical [nb, H, page, 2*D]
        return [kv_cache.transpose(1, 2)]
    raise NotImplementedError(
        f"DDTree KV compaction does not know the KV cache layout {tuple(kv_cache.shape)}"
    )


def target_layers_by_group(kv_cache_config, draft_layer_names) -> dict[int, list[str]]:
    """Target attention layers of each KV-cache group (the layers whose accepted-path KV
    DDTree compacts), ``{group id: [layer names]}``.

    A group's spec may be one ``AttentionSpec`` or a ``UniformTypeKVCacheSpecs`` (vLLM
    merges same-type layers of different shapes into one group, e.g. an MLA target with
    a GQA drafter's full-attention layers, ``kv_cache_interface.py:817``); drafter
    layers are skipped (the context precompute rewrites them). Raises
    ``NotImplementedError`` for a target layer without a slot-addressed KV cache
    (Mamba / linear attention): its state cannot be rolled back to the accepted path.
    """
    from vllm.v1.kv_cache_interface import AttentionSpec, UniformTypeKVCacheSpecs

    groups: dict[int, list[str]] = {}
    for gid, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        names = [n for n in group.layer_names if n not in draft_layer_names]
        for name in names:
            layer_spec = (
                spec.kv_cache_specs[name] if isinstance(spec, UniformTypeKVCacheSpecs) else spec
            )
            if not isinstance(layer_spec, AttentionSpec):
                raise NotImplementedError(
                    f"DDTree cannot compact target layer {name!r} with KV spec "
                    f"{type(layer_spec).__name__}: only attention layers are supported"
                )
        if names:
            groups[gid] = names
    return groups
