"""vLLM attention backend for MLA targets whose decode/verify path is the tree kernel.

Registered as ``AttentionBackendEnum.CUSTOM`` by the plugin. Decode and verify
tokens (requests with up to ``reorder_batch_threshold`` new tokens, any mix of
lengths) go through ``mla_tree_verify``, which reads each request's latent context
once for all its query tokens and heads. Prefill chunks keep vLLM's MLA prefill
path (in fp32, which vLLM's MLA prefill backends lack, every token takes the tree
kernel). Without a DDTree tree the mask is causal, so the backend is a plain MLA
backend usable with ``--attention-backend CUSTOM``. With an adaptive tree budget the
kernel also gets the speculator's per-request active query rows
(``vllm_ddtree.attention_backends.tree_mask_state``): the Triton kernel skips the inactive
ones; with adaptive verify shapes (most rows active) the Gluon kernel computes them instead
(faster on sm_90; nothing reads them). ``--kv-cache-dtype fp8`` (``fp8_e4m3``): vLLM's
e4m3 latent cache with the layer's ``_k_scale``, and the e4m3 query ``MLAAttention``
quantizes with its ``_q_scale`` (as for FLASHMLA; the Gluon kernel is 16-bit only). On
sm_90, where the measured dispatch table says so and every request has the same number
of new tokens, the context goes through FlashMLA and only the tree through our kernel
(``mla_tree/cascade.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.config import get_current_vllm_config
from vllm.model_executor.layers.attention.mla_attention import (
    MLACommonBackend,
    MLACommonDecodeMetadata,
    MLACommonImpl,
    MLACommonMetadata,
    MLACommonMetadataBuilder,
    QueryLenSupport,
)
from vllm.v1.attention.backend import AttentionCGSupport, AttentionLayer, AttentionType

from vllm_ddtree.attention_backends.mla_tree.cascade import CascadePlan
from vllm_ddtree.attention_backends.mla_tree.ops import MAX_ROPE_DIM, mla_tree_verify
from vllm_ddtree.attention_backends.tree_mask_state import (
    TREE_MASK_STATE,
    causal_bits_,
    decode_query_limit,
)

PREFERRED_BLOCK_SIZE = 64
# vLLM's per-tensor-scaled e4m3 MLA cache ([num_blocks, page, 576] uint8, one fp32 scale
# per layer); not FlashMLA's packed "fp8_ds_mla" (656-byte rows with per-tile scales).
FP8_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3")


@dataclass
class TreeMLADecodeMetadata(MLACommonDecodeMetadata):
    query_start_loc: torch.Tensor  # int32 [num_decodes + 1]
    ancestor_bits: torch.Tensor  # int64 [num_decode_tokens, W]
    max_query_len: int
    max_seq_len: int
    # Longest context a CUDA-graph replay of this launch may see (max_model_len).
    max_model_len: int
    # int32 [num_decodes], a view of TREE_MASK_STATE.active_query_lens (adaptive
    # budget), or None: every query row is active.
    active_query_lens: torch.Tensor | None = None
    # The cascade's per-step state (FlashMLA over the context), shared by the layers;
    # None unless every request has max_query_len new tokens (FlashMLA's q layout).
    cascade_plan: CascadePlan | None = None


@dataclass
class TreeMLAMetadata(MLACommonMetadata[TreeMLADecodeMetadata]):
    pass


class TreeMLAMetadataBuilder(MLACommonMetadataBuilder[TreeMLAMetadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH
    query_len_support: ClassVar[QueryLenSupport] = QueryLenSupport.VARLEN

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device, TreeMLAMetadata)
        TREE_MASK_STATE.clear_unless_ddtree(vllm_config)
        max_tokens = vllm_config.scheduler_config.max_num_batched_tokens
        self._max_model_len = vllm_config.model_config.max_model_len
        self.reorder_batch_threshold = decode_query_limit(vllm_config,
                                                          self.reorder_batch_threshold)
        # Causal bits live in our own persistent buffer (stable address under
        # FULL CUDA graphs); the DDTree speculator provides the tree's.
        self._causal_bits = torch.zeros(
            max_tokens,
            max(1, -(-self.reorder_batch_threshold // 64)),
            dtype=torch.int64,
            device=device,
        )

    def _build_decode(
        self,
        block_table_tensor: torch.Tensor,
        seq_lens_device: torch.Tensor,
        max_seq_len: int,
        query_start_loc_cpu: torch.Tensor,
        query_start_loc_device: torch.Tensor,
        num_decode_tokens: int,
        dcp_tot_seq_lens_device: torch.Tensor | None,
    ) -> TreeMLADecodeMetadata:
        # NumPy on the host copy: this runs once per KV-cache group and step (vLLM 0.26
        # gives each MLA layer beside a DFlash drafter its own group), three torch CPU
        # ops cost several times more.
        starts = query_start_loc_cpu.numpy()
        query_lens = starts[1:] - starts[:-1]
        max_query_len = int(query_lens.max()) if query_lens.shape[0] else 0
        uniform = max_query_len > 0 and bool((query_lens == max_query_len).all())
        if TREE_MASK_STATE.active and TREE_MASK_STATE.ancestor_bits is not None:
            bits = TREE_MASK_STATE.ancestor_bits[:num_decode_tokens]
        else:
            bits = causal_bits_(self._causal_bits, query_start_loc_device, num_decode_tokens)
        return TreeMLADecodeMetadata(
            block_table=block_table_tensor,
            seq_lens=seq_lens_device,
            dcp_tot_seq_lens=dcp_tot_seq_lens_device,
            query_start_loc=query_start_loc_device,
            ancestor_bits=bits,
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            max_model_len=self._max_model_len,
            active_query_lens=TREE_MASK_STATE.decode_active_query_lens(seq_lens_device.shape[0]),
            cascade_plan=CascadePlan() if uniform else None,
        )


def _check_fp8_capability(kv_cache_dtype: str) -> None:
    """The kernel widens e4m3 tiles (Triton's fp8e4nv), which needs sm_89 or newer: refuse
    an fp8 cache on older GPUs here, as TRITON_MLA does, rather than fail in the first
    launch's compile."""
    from vllm.platforms import current_platform

    if current_platform.is_cuda() and not current_platform.has_device_capability(89):
        cap = current_platform.get_device_capability()
        cap_str = cap.as_version_str() if cap is not None else "unknown"
        raise NotImplementedError(
            f"the DDTree MLA backend's {kv_cache_dtype!r} KV cache needs compute capability "
            f"8.9 or newer (native e4m3), this GPU has {cap_str}; use --kv-cache-dtype auto")


class TreeMLAImpl(MLACommonImpl[TreeMLAMetadata]):
    can_return_lse_for_decode: bool = True
    _fp8_cache: bool = False  # set from kv_cache_dtype in __init__

    def __init__(
        self,
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
        **mla_args,
    ) -> None:
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
            **mla_args,
        )
        if any([alibi_slopes, sliding_window, logits_soft_cap]):
            raise NotImplementedError(
                "the DDTree MLA backend does not support alibi_slopes, sliding_window or "
                "logits_soft_cap; pick another --attention-backend for this model"
            )
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError("the DDTree MLA backend supports decoder attention only")
        # What the kernels take (ops._check_mla_inputs), checked as the model is built
        # rather than at its first launch (under --enforce-eager: the first request).
        lora, rope = self.kv_lora_rank, self.qk_rope_head_dim
        if lora < 16 or lora % 16 or not 0 <= rope <= MAX_ROPE_DIM:
            raise NotImplementedError(
                f"the DDTree MLA backend takes kv_lora_rank a multiple of 16 and a rope dim "
                f"in [0, {MAX_ROPE_DIM}], this model has kv_lora_rank={lora} and "
                f"qk_rope_head_dim={rope}; pick another --attention-backend for it")
        if kv_cache_dtype not in TreeMLABackend.supported_kv_cache_dtypes:
            raise NotImplementedError(
                f"the DDTree MLA backend has no {kv_cache_dtype!r} KV cache; "
                f"--kv-cache-dtype must be one of {TreeMLABackend.supported_kv_cache_dtypes}"
            )
        self._fp8_cache = kv_cache_dtype in FP8_KV_CACHE_DTYPES
        if self._fp8_cache:
            _check_fp8_capability(kv_cache_dtype)
            # MLACommonImpl's supports_quant_query_input stays True: MLAAttention hands
            # forward_mqa the e4m3 query (q / layer._q_scale), as FLASHMLA gets it, so
            # every kernel (the cascade's FlashMLA part included) scores keys with the
            # same query whatever the batch; the output takes the model's dtype.
            model_config = get_current_vllm_config().model_config
            self._out_dtype = model_config.dtype if model_config is not None else None

    def forward_mqa(
        self,
        q: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        kv_c_and_k_pe_cache: torch.Tensor,
        attn_metadata: TreeMLAMetadata,
        layer: AttentionLayer,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Decode/verify attention: ``q [T, H, kv_lora_rank + rope]`` (or its two
        parts) -> ``out [T, H, kv_lora_rank]``, ``lse [T, H]`` (natural log)."""
        decode = attn_metadata.decode
        assert decode is not None
        if isinstance(q, tuple):
            q = torch.cat(q, dim=-1)
        max_seq_len = decode.max_seq_len
        capturing = q.is_cuda and torch.cuda.is_current_stream_capturing()
        if capturing:
            # The grid is frozen into the graph and replayed for any context up to
            # max_model_len: size it for the longest, and let each request pick its own
            # split count at run time (a 16k context in a grid sized for 160k would
            # otherwise run in 4x the waves of 4x shorter splits).
            max_seq_len = max(max_seq_len, decode.max_model_len)
        return mla_tree_verify(
            q,
            kv_c_and_k_pe_cache,
            decode.block_table,
            decode.seq_lens,
            decode.query_start_loc,
            decode.ancestor_bits,
            self.scale,
            self.kv_lora_rank,
            max_query_len=decode.max_query_len,
            max_seq_len=max_seq_len,
            validate_values=False,
            active_query_lens=decode.active_query_lens,
            mostly_active=TREE_MASK_STATE.mostly_active,
            runtime_kv_splits=capturing,
            # MLAAttention.forward_impl hands us the uint8 cache viewed as e4m3; rows are
            # fp8(x / layer._k_scale) (concat_and_cache_mla).
            kv_scale=layer._k_scale if self._fp8_cache else None,
            q_scale=layer._q_scale if self._fp8_cache else None,
            out_dtype=self._out_dtype if self._fp8_cache else None,
            cascade_plan=decode.cascade_plan,
        )


class TreeMLABackend(MLACommonBackend):
    # fp32: exactness checks only; every token takes the tree kernel (builder above).
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16,
                                                     torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto", "float16", "bfloat16",
                                                      *FP8_KV_CACHE_DTYPES]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_builder_cls() -> type[TreeMLAMetadataBuilder]:
        return TreeMLAMetadataBuilder

    @staticmethod
    def get_impl_cls() -> type[TreeMLAImpl]:
        return TreeMLAImpl

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []

    @staticmethod
    def get_kv_cache_stride_order(include_num_layers_dimension: bool = False) -> tuple[int, ...]:
        """Blocks outermost, as FLASH_ATTN_MLA / TRITON_MLA: ``indexes_kv_by_block_stride``
        is then True, so vLLM may pad our pages to a larger drafter page
        (``kv_cache_utils.unify_kv_cache_spec_page_size``; without it an MLA target
        beside a GQA DFlash drafter of a non-multiple page size cannot start). The
        kernel and the KV compaction address blocks by ``kv_cache.stride(0)``."""
        return (1, 0, 2, 3) if include_num_layers_dimension else (0, 1, 2)

    @classmethod
    def supports_block_size(cls, block_size: int | None) -> bool:
        return True

    @classmethod
    def get_preferred_block_size(cls, default_block_size: int) -> int:
        """64-token pages unless the user sets ``--block-size`` (vLLM then skips this:
        ``Platform.update_block_size_for_backend``). vLLM's default is 16, which every
        backend accepting any size keeps. Measured on the H200 (Kimi-shaped target, 8
        heads, DDTree B=64, 128k context): 7.47 ms per step with 64-token pages against
        9.02 ms with 16 (verify 3.59 against 4.83 ms); FlashMLA needs 64, and vLLM's
        FA-MLA chain verified 2x faster at 128k with 64 than with 16."""
        return PREFERRED_BLOCK_SIZE

    @classmethod
    def supports_compute_capability(cls, capability) -> bool:
        return capability.major >= 8
