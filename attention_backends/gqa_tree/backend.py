"""vLLM attention backend for GQA/MHA targets whose decode/verify path is the tree kernel.

Registered as ``AttentionBackendEnum.CUSTOM`` (``vllm_ddtree.attention_backends.registration``,
kind ``gqa``). It is vLLM's Triton attention backend (KV-cache layout, KV writes,
prefill kernel) with one change in the forward: the tokens of requests with at most
``reorder_batch_threshold`` new tokens (decodes and DDTree verify requests, 1 + 2B for
DFlash's parallel drafting) go through ``gqa_tree_verify`` with per-token ancestor
bits, and the rest of the batch (prefill chunks) through vLLM's ``unified_attention``
with its causal mask. vLLM puts such requests first (``sort_batch_req_ids`` in the V2
runner, ``reorder_batch`` in V1), so the batch splits into two contiguous parts.

One kernel for the whole batch was not chosen: a prefill chunk would need
``ceil(chunk / 64)`` mask words per token in the persistent tree-mask buffer and the
tree kernel's grid is sized by the longest request, while vLLM's prefill kernel is
already tuned for long causal chunks.

Without a DDTree tree the bits are causal, so the backend is a plain causal backend
usable with ``--attention-backend CUSTOM``. With an adaptive tree budget the tree
kernel also gets the speculator's per-request active query rows
(``vllm_ddtree.attention_backends.tree_mask_state``) and skips the inactive ones.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import torch
from vllm.v1.attention.backend import (
    AttentionCGSupport,
    AttentionType,
    CommonAttentionMetadata,
)
from vllm.v1.attention.backends.triton_attn import (
    TritonAttentionBackend,
    TritonAttentionImpl,
    TritonAttentionMetadata,
    TritonAttentionMetadataBuilder,
)
from vllm.v1.attention.backends.utils import split_decodes_and_prefills

from vllm_ddtree.attention_backends.gqa_tree.ops import gqa_tree_verify
from vllm_ddtree.attention_backends.mla_tree.tree_mask import num_mask_words
from vllm_ddtree.attention_backends.tree_mask_state import TREE_MASK_STATE, causal_bits_


@dataclass
class TreeGQADecodeMetadata:
    """The tree-kernel part of the batch: its first ``num_decodes`` requests."""

    num_decode_tokens: int
    query_start_loc: torch.Tensor  # int32 [num_decodes + 1]
    seq_lens: torch.Tensor  # int32 [num_decodes], context + new tokens
    block_table: torch.Tensor  # int32 [num_decodes, max_blocks]
    ancestor_bits: torch.Tensor  # int64 [num_decode_tokens, W]
    max_query_len: int
    max_seq_len: int
    # int32 [num_decodes], a view of TREE_MASK_STATE.active_query_lens (adaptive
    # budget), or None: every query row is active.
    active_query_lens: torch.Tensor | None = None


@dataclass
class TreeGQAMetadata(TritonAttentionMetadata):
    """vLLM's Triton metadata of the whole batch plus its two parts.

    ``decode`` covers tokens ``[0, num_decode_tokens)``; ``prefill`` (Triton metadata
    with request and token indices rebased to 0) covers the remaining tokens.
    """

    num_decode_tokens: int = 0
    decode: TreeGQADecodeMetadata | None = None
    prefill: TritonAttentionMetadata | None = None


class TreeGQAMetadataBuilder(TritonAttentionMetadataBuilder):
    # Mixed decode/prefill batches split on the host, so FULL graphs only for
    # uniform decode/verify batches.
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH
    # Raises the query length up to which requests take the tree kernel (never lowers
    # it). 0 in a served model; a test sets it in-process so that a plain vLLM run (no
    # speculation) pushes short prompts through the tree kernel with causal bits, as
    # DDTree's 1 + 2B threshold does (evals/check_gqa_backend.py --tree-threshold).
    min_tree_query_len: ClassVar[int] = 0

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        TREE_MASK_STATE.clear_unless_ddtree(vllm_config)
        if self.rswa_window is not None:
            raise NotImplementedError(
                "the DDTree GQA backend does not support R-SWA models (rswa_window); "
                "pick another --attention-backend for this model"
            )
        if vllm_config.parallel_config.decode_context_parallel_size > 1:
            raise NotImplementedError(
                "the DDTree GQA backend does not support decode context parallelism "
                "(--decode-context-parallel-size > 1)"
            )
        self._init_reorder_batch_threshold(1, supports_spec_as_decode=True)
        self.reorder_batch_threshold = max(self.reorder_batch_threshold,
                                           self.min_tree_query_len)
        # Causal bits live in our own persistent buffer (stable address under FULL
        # CUDA graphs); the DDTree speculator provides the tree's.
        self._causal_bits = torch.zeros(
            vllm_config.scheduler_config.max_num_batched_tokens,
            num_mask_words(self.reorder_batch_threshold),
            dtype=torch.int64,
            device=device,
        )

    def build_for_cudagraph_capture(
        self, common_attn_metadata: CommonAttentionMetadata
    ) -> TreeGQAMetadata:
        """Capture-time metadata with empty contexts (``seq_lens = query lens``).

        The Triton builder sets ``seq_lens`` to 1, shorter than a verify request's
        query; the tree kernel's mask assumes ``seq_len >= query_len``.
        """
        meta = self.build(0, common_attn_metadata)
        qsl = common_attn_metadata.query_start_loc
        meta.seq_lens.copy_(qsl[1:] - qsl[:-1])
        return meta

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> TreeGQAMetadata:
        """Triton metadata of the batch, split into tree-kernel and prefill parts.

        Host work only reads CPU tensors (``query_start_loc_cpu``); the device ops are
        slicing and, without an active tree, the causal bits of the decode rows.
        """
        cm = common_attn_metadata
        base = super().build(common_prefix_len, cm, fast_build)
        meta = TreeGQAMetadata(**base.__dict__)
        if cm.causal is not True:  # non-causal or per-request causality: vLLM's path
            meta.prefill = base
            return meta
        num_decodes, num_prefills, num_decode_tokens, _ = split_decodes_and_prefills(
            cm, decode_threshold=self.reorder_batch_threshold
        )
        meta.num_decode_tokens = num_decode_tokens
        if num_decodes > 0:
            meta.decode = self._build_decode(cm, num_decodes, num_prefills, num_decode_tokens)
        if num_prefills > 0:
            meta.prefill = base if num_decodes == 0 else self._slice_prefill(
                base, cm, num_decodes, num_decode_tokens
            )
        return meta

    def _build_decode(
        self,
        cm: CommonAttentionMetadata,
        num_decodes: int,
        num_prefills: int,
        num_decode_tokens: int,
    ) -> TreeGQADecodeMetadata:
        qsl = cm.query_start_loc[: num_decodes + 1]
        if num_prefills == 0:
            max_query_len = cm.max_query_len
        else:
            qsl_cpu = cm.query_start_loc_cpu[: num_decodes + 1]
            max_query_len = int((qsl_cpu[1:] - qsl_cpu[:-1]).max())
        if TREE_MASK_STATE.active and TREE_MASK_STATE.ancestor_bits is not None:
            bits = TREE_MASK_STATE.ancestor_bits[:num_decode_tokens]
        else:
            bits = causal_bits_(self._causal_bits, qsl, num_decode_tokens)
        return TreeGQADecodeMetadata(
            num_decode_tokens=num_decode_tokens,
            query_start_loc=qsl,
            seq_lens=cm.seq_lens[:num_decodes],
            block_table=cm.block_table_tensor[:num_decodes],
            ancestor_bits=bits,
            max_query_len=max_query_len,
            max_seq_len=cm.max_seq_len,
            active_query_lens=TREE_MASK_STATE.decode_active_query_lens(num_decodes),
        )

    @staticmethod
    def _slice_prefill(
        base: TritonAttentionMetadata,
        cm: CommonAttentionMetadata,
        num_decodes: int,
        num_decode_tokens: int,
    ) -> TritonAttentionMetadata:
        mm_ranges = base.mm_prefix_range_tensor
        rswa = base.rswa_prefix_lens
        return replace(
            base,
            num_actual_tokens=cm.num_actual_tokens - num_decode_tokens,
            query_start_loc=cm.query_start_loc[num_decodes:] - num_decode_tokens,
            seq_lens=cm.seq_lens[num_decodes:],
            block_table=cm.block_table_tensor[num_decodes:],
            slot_mapping=cm.slot_mapping[num_decode_tokens:],
            mm_prefix_range=None,
            mm_prefix_range_tensor=None if mm_ranges is None else mm_ranges[num_decodes:],
            rswa_prefix_lens=None if rswa is None else rswa[num_decodes:],
        )


class TreeGQAImpl(TritonAttentionImpl):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes: list[float] | None,
        sliding_window: int | None,
        kv_cache_dtype: str,
        logits_soft_cap: float | None = None,
        attn_type: AttentionType = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks: torch.Tensor | None = None,
        use_alibi_sqrt: bool = False,
        chunk_lookback: int = -1,
    ) -> None:
        if kv_cache_dtype != "auto":
            raise NotImplementedError(
                f"the DDTree GQA backend has no {kv_cache_dtype!r} KV cache; "
                "use --kv-cache-dtype auto"
            )
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError("the DDTree GQA backend supports decoder attention only")
        unsupported = {
            "alibi_slopes": alibi_slopes is not None,
            "logits_soft_cap": bool(logits_soft_cap),
            "sinks": sinks is not None,
            "use_alibi_sqrt": use_alibi_sqrt,
            "chunk_lookback": chunk_lookback != -1,
        }
        if any(unsupported.values()):
            names = ", ".join(k for k, v in unsupported.items() if v)
            raise NotImplementedError(
                f"the DDTree GQA backend does not support {names}; "
                "pick another --attention-backend for this model"
            )
        super().__init__(
            num_heads,
            head_size,
            scale,
            num_kv_heads,
            alibi_slopes,
            sliding_window,
            kv_cache_dtype,
            logits_soft_cap,
            attn_type,
            kv_sharing_target_layer_name,
            sinks,
            use_alibi_sqrt,
            chunk_lookback,
        )
        self.window = sliding_window  # keys at positions > p - window are visible

    def fused_output_quant_supported(self, quant_key) -> bool:
        return False

    def forward(
        self,
        layer: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: TreeGQAMetadata,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of one layer over the batch (K/V already written to the cache).

        Args:
            query: ``[T, Hq, D]``; key, value: ``[T, Hkv, D]`` (unused: read from cache).
            kv_cache: vLLM's Triton layout, logical ``[num_blocks, Hkv, page, 2 * D]``.
            attn_metadata: from :class:`TreeGQAMetadataBuilder`; None in profiling runs.
            output: ``[T, Hq, D]``, written in place and returned.
        """
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("the DDTree GQA backend has no fused output quantization")
        if attn_metadata is None:
            return output.fill_(0)
        decode = attn_metadata.decode
        if decode is not None:
            # [num_blocks, page, Hkv, D] views of K and V (what Triton's forward uses).
            key_cache, value_cache = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)
            num = decode.num_decode_tokens
            gqa_tree_verify(
                query[:num],
                key_cache,
                value_cache,
                decode.block_table,
                decode.seq_lens,
                decode.query_start_loc,
                decode.ancestor_bits,
                self.scale,
                sliding_window=self.window,
                max_query_len=decode.max_query_len,
                max_seq_len=decode.max_seq_len,
                validate_values=False,
                out=output[:num],
                active_query_lens=decode.active_query_lens,
            )
        prefill = attn_metadata.prefill
        if prefill is not None:
            num = attn_metadata.num_decode_tokens
            super().forward(layer, query[num:], key, value, kv_cache, prefill, output[num:])
        return output


class TreeGQABackend(TritonAttentionBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_builder_cls() -> type[TreeGQAMetadataBuilder]:
        return TreeGQAMetadataBuilder

    @staticmethod
    def get_impl_cls() -> type[TreeGQAImpl]:
        return TreeGQAImpl

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        return 32 <= head_size <= 256

    @classmethod
    def supports_non_causal(cls) -> bool:
        return False

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_mm_prefix(cls) -> bool:
        return False

    @classmethod
    def supports_sink(cls) -> bool:
        return False

    @classmethod
    def supports_alibi_sqrt(cls) -> bool:
        return False

    @classmethod
    def supports_batch_invariance(cls) -> bool:
        return False

    @classmethod
    def supports_compute_capability(cls, capability) -> bool:
        return capability.major >= 8
