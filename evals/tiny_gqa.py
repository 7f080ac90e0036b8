"""Tiny GQA checkpoints with real random weights and sliding windows, for vLLM GPU runs.

vLLM's ``load_format="dummy"`` makes logits near-ties; these carry normal-init
weights saved with ``save_pretrained`` so greedy tokens are well separated.

Two models, because vLLM 0.26 builds sliding windows differently per architecture:
``Qwen3ForCausalLM`` applies one model-wide window (it asserts on interleaved
``layer_types``), so the Qwen3 model has a window on every layer; ``LlamaForCausalLM``
reads ``layer_types`` per layer, so the Llama model mixes sliding and full layers
(two KV-cache groups, two metadata builders).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

COMMON = dict(
    vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
    initializer_range=0.1, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
)  # fmt: skip


def make_tiny_gqa(out: Path, arch: str, *, window: int = 64, seed: int = 0) -> Path:
    """Save a tiny bf16 ``arch`` model (``"qwen3"``: every layer sliding, ``"llama"``:
    sliding/full alternating) with sliding window ``window`` to ``out``."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    if arch == "qwen3":
        config = Qwen3Config(
            use_sliding_window=True, sliding_window=window, max_window_layers=0, **COMMON
        )
        model = Qwen3ForCausalLM(config)
    elif arch == "llama":
        layers = COMMON["num_hidden_layers"]
        config = LlamaConfig(
            sliding_window=window,
            layer_types=["sliding_attention", "full_attention"] * (layers // 2),
            **COMMON,
        )
        model = LlamaForCausalLM(config)
    else:
        raise ValueError(f"arch must be 'qwen3' or 'llama', got {arch!r}")
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out)
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--arch", choices=["qwen3", "llama"], default="qwen3")
    args = parser.parse_args()
    print(make_tiny_gqa(args.out, args.arch))
