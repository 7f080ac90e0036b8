"""Configs of the embedded pair: an MLA target and its DFlash drafter.

Target: ``DeepseekV3ForCausalLM`` with MLA (``kv_lora_rank`` 512, ``qk_rope_head_dim``
64, no q-LoRA) so vLLM's MLA kernels run on it, all layers dense
(``first_k_dense_replace == num_hidden_layers``; the MoE fields are set to valid
values that no layer uses). Drafter: DFlash (``DFlashDraftModel``) with Qwen3
layers, hidden size equal to the target's (embeddings and LM head are the target's).

``tiny=True`` gives the small shapes used by the CPU tests and ``--tiny`` runs.
"""

from __future__ import annotations

from transformers import DeepseekV3Config, Qwen3Config

DEFAULT_TARGET_LAYER_IDS = (1, 2, 3)
TINY_TARGET_LAYER_IDS = (0, 1)


def target_config(
    vocab_size: int, eos_token_id: int, *, tiny: bool = False, max_position_embeddings: int = 4096
) -> DeepseekV3Config:
    """The target's ``DeepseekV3Config`` (dense MLA, untied LM head).

    Full size: hidden 256, 4 layers, 4 heads, ``qk_nope_head_dim`` 128,
    ``v_head_dim`` 128, intermediate 768 (about 8.5 M parameters at vocab 4096).
    The head dims are DeepSeek-V3's own: vLLM 0.26's MLA prefill backends accept only
    (nope 128 + rope 64, v 128), so smaller heads would not load in vLLM.
    """
    if tiny:
        shape = dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            kv_lora_rank=32,
            qk_rope_head_dim=16,
            qk_nope_head_dim=16,
            v_head_dim=16,
        )
    else:
        shape = dict(
            hidden_size=256,
            intermediate_size=768,
            num_hidden_layers=4,
            num_attention_heads=4,
            kv_lora_rank=512,
            qk_rope_head_dim=64,
            qk_nope_head_dim=128,
            v_head_dim=128,
        )
    layers = shape["num_hidden_layers"]
    return DeepseekV3Config(
        vocab_size=vocab_size,
        num_key_value_heads=shape["num_attention_heads"],
        q_lora_rank=None,
        first_k_dense_replace=layers,  # every layer dense
        n_routed_experts=8,  # unused (no MoE layer) but must be valid
        n_shared_experts=1,
        moe_intermediate_size=shape["intermediate_size"] // 4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        num_mtp_layers=0,
        max_position_embeddings=max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        bos_token_id=eos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=None,  # a padding_idx would freeze that embedding row
        initializer_range=0.02,
        architectures=["DeepseekV3ForCausalLM"],
        **shape,
    )


def drafter_config(
    target: DeepseekV3Config,
    mask_token_id: int,
    *,
    tiny: bool = False,
    target_layer_ids: tuple[int, ...] | None = None,
    block_size: int | None = None,
) -> Qwen3Config:
    """The DFlash drafter's ``Qwen3Config`` for ``target``.

    Full size: 3 layers (sliding, full, sliding; window 256), 4 heads / 2 KV heads,
    head_dim 64, intermediate 768, block 16, ``target_layer_ids`` (1, 2, 3).
    Tiny: 3 layers of hidden ``target.hidden_size``, window 12, block 8.
    """
    if tiny:
        shape = dict(
            intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16
        )
        window, default_block = 12, 8
        default_ids = TINY_TARGET_LAYER_IDS
    else:
        shape = dict(
            intermediate_size=768, num_attention_heads=4, num_key_value_heads=2, head_dim=64
        )
        window, default_block = 256, 16
        default_ids = DEFAULT_TARGET_LAYER_IDS
    ids = sorted(int(i) for i in (target_layer_ids or default_ids))
    if any(not 0 <= i < target.num_hidden_layers for i in ids):
        raise ValueError(f"target_layer_ids {ids} outside 0..{target.num_hidden_layers - 1}")
    layer_types = ["sliding_attention", "full_attention", "sliding_attention"]
    config = Qwen3Config(
        vocab_size=target.vocab_size,
        hidden_size=target.hidden_size,
        num_hidden_layers=len(layer_types),
        layer_types=layer_types,
        use_sliding_window=True,  # Qwen3Config drops sliding_window otherwise
        sliding_window=window,
        max_window_layers=len(layer_types),
        max_position_embeddings=target.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        initializer_range=0.02,
        bos_token_id=target.bos_token_id,
        eos_token_id=target.eos_token_id,
        architectures=["DFlashDraftModel"],
        **shape,
    )
    config.block_size = int(block_size or default_block)
    config.target_hidden_size = target.hidden_size
    config.dflash_config = {"target_layer_ids": ids, "mask_token_id": int(mask_token_id)}
    return config
