"""Tiny random models with real (normal-init) weights for CPU tests, fp32."""

from __future__ import annotations

import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from vllm_ddtree.reference import DFlashDraftModel

VOCAB = 96
HIDDEN = 64


def tiny_target(kind: str, seed: int = 0, num_layers: int = 3, head_dim: int = 16):
    """A tiny ``Qwen3ForCausalLM`` (``kind="qwen3"``, ``head_dim`` per head) or MLA
    ``DeepseekV3ForCausalLM``."""
    torch.manual_seed(seed)
    common = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        max_position_embeddings=4096,
        initializer_range=0.2,
        tie_word_embeddings=False,
    )
    if kind == "qwen3":
        config = Qwen3Config(num_key_value_heads=2, head_dim=head_dim, **common)
        model = Qwen3ForCausalLM(config)
    elif kind == "deepseek_v3":
        config = DeepseekV3Config(
            num_key_value_heads=4,
            q_lora_rank=None,
            kv_lora_rank=32,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
            first_k_dense_replace=num_layers,
            n_routed_experts=4,
            moe_intermediate_size=32,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            **common,
        )
        model = DeepseekV3ForCausalLM(config)
    else:
        raise ValueError(kind)
    return model.eval()


def drafter_config(
    target_config,
    *,
    layer_types=("sliding_attention", "full_attention"),
    sliding_window: int = 6,
    block_size: int = 8,
    target_layer_ids=(0, 2),
    **overrides,
) -> Qwen3Config:
    config = Qwen3Config(
        vocab_size=target_config.vocab_size,
        hidden_size=target_config.hidden_size,
        intermediate_size=128,
        num_hidden_layers=len(layer_types),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        layer_types=list(layer_types),
        use_sliding_window=True,
        sliding_window=sliding_window,
        max_position_embeddings=4096,
        initializer_range=0.2,
        architectures=["DFlashDraftModel"],
    )
    config.block_size = block_size
    config.dflash_config = {
        "target_layer_ids": list(target_layer_ids),
        "mask_token_id": target_config.vocab_size - 1,
    }
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def tiny_drafter(target, seed: int = 0, **kwargs) -> DFlashDraftModel:
    torch.manual_seed(1000 + seed)
    return DFlashDraftModel(drafter_config(target.config, **kwargs)).eval()
