"""Tiny target + DFlash drafter pairs with real random weights, for vLLM runs on the GPU.

    python evals/tiny_pairs.py qwen3 /tmp/pair        # -> /tmp/pair/target, /tmp/pair/drafter

Targets: ``qwen3`` (GQA, ``Qwen3ForCausalLM``) or ``deepseek_v3`` (MLA, kv_lora_rank 512,
rope 64). The drafter is a 3-layer DFlash model (sliding / full / sliding, window 64,
block size 16) reading target layers 1..3. Normal-init weights (vLLM's dummy loader
makes near-tied logits) saved with ``save_pretrained``; no tokenizer, so vLLM runs
take token-id prompts with ``skip_tokenizer_init=True``. The drafter is untrained:
trees are rarely accepted, which tests verification and compaction of rejected nodes
(the oracle test drives deep acceptance).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

VOCAB = 2048
HIDDEN = 256
TARGET_LAYERS = 4


def make_target(kind: str, out: Path, seed: int = 0) -> Path:
    """Save a tiny ``kind`` target (bf16 safetensors + config.json) to ``out``."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if kind == "deepseek_v3":
        from tiny_mla import make_tiny_deepseek

        return make_tiny_deepseek(out, hidden=HIDDEN, layers=TARGET_LAYERS, heads=8,
                                  vocab=VOCAB, seed=seed)
    if kind != "qwen3":
        raise ValueError(f"unknown target kind {kind!r}: qwen3 or deepseek_v3")
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
        num_hidden_layers=TARGET_LAYERS, num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, max_position_embeddings=8192, initializer_range=0.1,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    )
    model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    return out


def make_drafter(out: Path, seed: int = 1) -> Path:
    """Save a tiny DFlash drafter (mixed sliding/full layers) for a ``make_target`` target."""
    from transformers import Qwen3Config

    from vllm_ddtree.reference import DFlashDraftModel

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        use_sliding_window=True, sliding_window=64, max_position_embeddings=8192,
        initializer_range=0.1, architectures=["DFlashDraftModel"],
    )
    config.block_size = 16
    config.dflash_config = {"target_layer_ids": [1, 2, 3], "mask_token_id": VOCAB - 1}
    model = DFlashDraftModel(config).to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    return out


def make_tiny_pair(kind: str, out: Path) -> tuple[Path, Path]:
    """``(target_dir, drafter_dir)`` under ``out``."""
    return make_target(kind, out / "target"), make_drafter(out / "drafter")


def random_prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    """Token-id prompts of the given lengths (ids 3..VOCAB-2: no bos/eos/mask)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB - 1, (n,), generator=gen).tolist() for n in lengths]


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("kind", choices=["qwen3", "deepseek_v3"])
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    print(*make_tiny_pair(args.kind, args.out))
