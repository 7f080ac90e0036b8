"""How vLLM 0.26 groups the KV caches of a target beside a DFlash drafter, and what each
grouping costs in KV bytes per context token (no model code: the pair's configs only).

vLLM's hybrid KV-cache manager (its default) gives every layer of an MLA target beside a
drafter with sliding-window layers its own KV-cache group, and every group costs
scheduler host time in every step. With ``disable_hybrid_kv_cache_manager`` one group
holds all layers, and the drafter's sliding layers keep KV for the whole context (the
window is still applied in the layer's attention). Which one stores more depends on the
pair: the hybrid manager gives every page the same bytes, padding or stretching the
smaller pages. This module builds the layers' ``KVCacheSpec``s as a DDTree engine does
and runs vLLM's own ``get_kv_cache_groups`` on them.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

# The block size the drafter's sliding-window layers choose for themselves: vLLM gives a
# sliding layer its backend's smallest kernel block (``Attention.get_kv_cache_spec``),
# 16 tokens for FlashAttention, whatever the engine's ``--block-size``.
DRAFTER_SLIDING_BLOCK = 16
# The layer types whose KV vLLM keeps for the whole context (no window, no state).
_FULL_LAYER_TYPES = ("full_attention", "attention")


@dataclass(frozen=True)
class KVPairShape:
    """The attention layers of a target + drafter pair as vLLM's KV specs see them, per
    tensor-parallel rank.

    Attributes:
        target_layers: the target's attention layers.
        target_mla: MLA layers (one latent "head" of ``target_head_size``) or GQA / MHA.
        target_kv_heads: KV heads per rank of a target layer (1 for MLA).
        target_head_size: 576 for a DeepSeek-V3 / Kimi-K2 MLA latent (512 + 64 rope).
        sliding_layers: the drafter's sliding-window layers.
        full_layers: the drafter's full-attention layers.
        drafter_kv_heads: KV heads per rank of a drafter layer.
        drafter_head_size: the drafter's head dim.
        window: the drafter's sliding window in tokens (None: no sliding layers).
        dtype: the KV cache's element type (``torch.uint8`` for an fp8 cache).
        drafter_dtype: the drafter layers' element type where it differs from ``dtype``
            (vLLM's speculative-config ``kv_cache_dtype``); None: ``dtype``.
    """

    target_layers: int
    target_mla: bool
    target_kv_heads: int
    target_head_size: int
    sliding_layers: int
    full_layers: int
    drafter_kv_heads: int
    drafter_head_size: int
    window: int | None
    dtype: torch.dtype = torch.bfloat16
    drafter_dtype: torch.dtype | None = None


def _text_config(config: Any) -> Any:
    get_text_config = getattr(config, "get_text_config", None)
    return get_text_config() if callable(get_text_config) else config


def _head_size(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def pair_kv_shape(target_config: Any, drafter_config: Any, *, tensor_parallel_size: int = 1,
                  dtype: torch.dtype = torch.bfloat16, target_mla: bool | None = None,
                  drafter_dtype: torch.dtype | None = None) -> KVPairShape:
    """The :class:`KVPairShape` of a target and a DFlash drafter (transformers configs).

    ``target_mla``: whether vLLM runs the target's attention as MLA (vLLM's
    ``ModelConfig.use_mla``); None: MLA when the config has a ``kv_lora_rank``.
    ``drafter_dtype``: the drafter's KV element type where it is not ``dtype``. KV heads
    are split over ``tensor_parallel_size`` ranks as vLLM does (at least one a rank);
    the drafter's sliding layers are the ones vLLM 0.26 gives a window
    (:func:`vllm_ddtree.drafter_config.resolve_layer_attention`).
    """
    from vllm_ddtree.drafter_config import resolve_layer_attention

    target = _text_config(target_config)
    if target_mla is None:
        target_mla = getattr(target, "kv_lora_rank", None) is not None
    if target_mla:
        target_kv_heads, target_head_size = 1, target.kv_lora_rank + target.qk_rope_head_dim
    else:
        heads = getattr(target, "num_key_value_heads", None) or target.num_attention_heads
        target_kv_heads = max(1, heads // tensor_parallel_size)
        target_head_size = _head_size(target)
    windows = [resolve_layer_attention(drafter_config, i)[0]
               for i in range(drafter_config.num_hidden_layers)]
    sliding = [w for w in windows if w is not None]
    drafter_heads = (getattr(drafter_config, "num_key_value_heads", None)
                     or drafter_config.num_attention_heads)
    return KVPairShape(
        target_layers=target.num_hidden_layers, target_mla=target_mla,
        target_kv_heads=target_kv_heads, target_head_size=target_head_size,
        sliding_layers=len(sliding), full_layers=len(windows) - len(sliding),
        drafter_kv_heads=max(1, drafter_heads // tensor_parallel_size),
        drafter_head_size=_head_size(drafter_config),
        window=max(sliding) if sliding else None, dtype=dtype, drafter_dtype=drafter_dtype)


def layer_kv_specs(shape: KVPairShape, page: int, sliding_page: int | None = None) -> dict:
    """Layer name -> ``KVCacheSpec`` as the pair's attention layers report them: target
    and drafter full layers on ``page``-token pages, the drafter's sliding layers on
    ``sliding_page`` (default ``page``). Every backend involved (the tree backends,
    FlashAttention) keeps blocks outermost, so vLLM may pad their pages
    (``indexes_kv_by_block_stride``)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec

    target_spec = MLAAttentionSpec if shape.target_mla else FullAttentionSpec
    specs = {f"model.layers.{i}.self_attn.attn": target_spec(
        block_size=page, num_kv_heads=shape.target_kv_heads, head_size=shape.target_head_size,
        dtype=shape.dtype, indexes_kv_by_block_stride=True) for i in range(shape.target_layers)}
    drafter_dtype = shape.dtype if shape.drafter_dtype is None else shape.drafter_dtype
    drafter = dict(block_size=page, num_kv_heads=shape.drafter_kv_heads,
                   head_size=shape.drafter_head_size, dtype=drafter_dtype,
                   indexes_kv_by_block_stride=True)
    for i in range(shape.sliding_layers):
        specs[f"draft.layers.{i}.self_attn.attn"] = SlidingWindowSpec(
            sliding_window=shape.window, **{**drafter, "block_size": sliding_page or page})
    for i in range(shape.sliding_layers, shape.sliding_layers + shape.full_layers):
        specs[f"draft.layers.{i}.self_attn.attn"] = FullAttentionSpec(**drafter)
    return specs


def vllm_kv_cache_groups(shape: KVPairShape, hybrid: bool, page: int = 64, *,
                         sliding_page: int | None = None, align: bool = True) -> list:
    """The ``KVCacheGroupSpec`` list vLLM's ``get_kv_cache_groups`` forms for ``shape``
    (:func:`layer_kv_specs`) with the hybrid manager on (``hybrid``) or off. ``align``:
    with the hybrid manager off, first give the sliding layers the full layers' block
    size, as ``vllm_ddtree.patches.unify_kv_block_size`` does in a DDTree engine.

    Raises:
        ValueError / NotImplementedError: vLLM's own, when it cannot form the groups.
    """
    from vllm.v1.core import kv_cache_utils

    from vllm_ddtree.patches.unify_kv_block_size import align_sliding_block_sizes

    specs = layer_kv_specs(shape, page, sliding_page)
    if align and not hybrid:
        align_sliding_block_sizes(specs)
    config = SimpleNamespace(scheduler_config=SimpleNamespace(
        disable_hybrid_kv_cache_manager=not hybrid))
    with _quiet(kv_cache_utils.__name__):
        return kv_cache_utils.get_kv_cache_groups(config, specs)


@contextlib.contextmanager
def _quiet(logger_name: str):
    """Without ``logger_name``'s warnings: vLLM warns that one group keeps the sliding
    layers' KV for the whole context each time it forms one; here only the engine's
    own grouping should say so."""
    vllm_logger = logging.getLogger(logger_name)
    level = vllm_logger.level
    vllm_logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        vllm_logger.setLevel(level)


def kv_bytes_per_token(shape: KVPairShape, hybrid: bool, page: int = 64) -> int:
    """KV bytes per context token the KV-cache manager allocates for ``shape`` (per rank),
    with the hybrid manager on (``hybrid``) or off, as a DDTree engine builds the specs:
    ``page``-token target and full-attention pages, the drafter's sliding layers on
    ``DRAFTER_SLIDING_BLOCK``-token blocks (aligned to ``page`` in one group). Counts
    what the pages really take: padded and stretched pages, and in the hybrid manager
    a block of every group spanning as many pages as its largest group has layers
    (``get_kv_cache_config_from_groups``: a smaller group's block pads the rest).
    Sliding layers in groups of their own hold a window whatever the context and are
    not counted.

    Raises:
        ValueError / NotImplementedError: vLLM's own, when it cannot form the groups.
    """
    from vllm.v1.kv_cache_interface import SlidingWindowSpec, UniformTypeKVCacheSpecs

    groups = vllm_kv_cache_groups(shape, hybrid, page, sliding_page=DRAFTER_SLIDING_BLOCK)
    layers_per_block = max(len(group.layer_names) for group in groups)
    per_token = 0
    for group in groups:
        spec = group.kv_cache_spec
        if isinstance(spec, UniformTypeKVCacheSpecs):  # one group, a tensor per layer
            per_token += sum(s.page_size_bytes // s.block_size
                             for s in spec.kv_cache_specs.values())
        elif not isinstance(spec, SlidingWindowSpec):
            per_token += spec.page_size_bytes // spec.block_size * layers_per_block
    return per_token


def target_has_own_windows(target_config: Any, is_hybrid: bool = False) -> str | None:
    """What in the target itself keeps KV other than for the whole context, as vLLM
    applies it, or None when every target layer is plain full attention: a
    ``sliding_window`` (vLLM applies it to every layer, or with ``layer_types`` to the
    ``sliding_attention`` ones; transformers' Qwen2 / Qwen3 configs already drop it
    without ``use_sliding_window``, and vLLM's ``--disable-sliding-window`` clears it),
    ``layer_types`` other than full attention (linear attention, Mamba), chunked local
    attention, or a model vLLM registers as hybrid (``is_hybrid``: Mamba / linear
    attention layers). Such a target needs the hybrid manager's groups of its own."""
    config = _text_config(target_config)
    if is_hybrid:
        return "Mamba / linear-attention layers (vLLM registers the model as hybrid)"
    layer_types = getattr(config, "layer_types", None) or []
    other = sorted({t for t in layer_types if t not in (*_FULL_LAYER_TYPES, "sliding_attention")})
    if other:
        return f"layer_types {other}"
    window = getattr(config, "sliding_window", None)
    if window:  # vLLM: on the sliding_attention layers, else on every layer (0: none)
        sliding = sum(t == "sliding_attention" for t in layer_types)
        return f"sliding_window={window} on " + (
            f"{sliding} sliding_attention layers" if sliding else "every layer")
    chunk = getattr(config, "attention_chunk_size", None)
    if chunk is not None:
        return f"chunked local attention (attention_chunk_size={chunk})"
    return None

