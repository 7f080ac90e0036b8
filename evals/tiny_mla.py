"""Tiny DeepSeek-V3 (MLA) checkpoints with real random weights, for vLLM runs on the GPU.

vLLM's ``load_format="dummy"`` makes logits near-ties; these carry normal-init
weights saved with ``save_pretrained`` so greedy tokens are well separated.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch


def make_tiny_deepseek(out: Path, *, hidden: int = 256, layers: int = 2, heads: int = 8,
                       vocab: int = 1024, seed: int = 0) -> Path:
    """Save a dense ``DeepseekV3ForCausalLM`` (kv_lora_rank 512, rope 64) to ``out``."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    config = DeepseekV3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
        q_lora_rank=None, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
        v_head_dim=128, first_k_dense_replace=layers, n_routed_experts=4,
        moe_intermediate_size=64, num_experts_per_tok=2, n_group=1, topk_group=1,
        max_position_embeddings=8192, initializer_range=0.1, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2,
    )
    model = DeepseekV3ForCausalLM(config).to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    print(make_tiny_deepseek(args.out))
