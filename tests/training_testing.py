"""Shared helpers of the training tests: the tiny embedded-pair architecture (fp32, CPU),
a tiny corpus, and the reference drafter's context per training anchor."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from transformers import DeepseekV3ForCausalLM

from vllm_ddtree.reference import DFlashDraftModel
from vllm_ddtree.training import configs, corpus

VOCAB = 96
MASK_ID = 1


def tiny_target(seed=0, std=0.2):
    torch.manual_seed(seed)
    cfg = configs.target_config(VOCAB, 0, tiny=True)
    cfg.initializer_range = std  # larger than default: non-degenerate greedy text
    return DeepseekV3ForCausalLM(cfg).eval()


def tiny_drafter(target, seed=0, std=0.2, **overrides):
    cfg = configs.drafter_config(target.config, MASK_ID, tiny=True)
    cfg.initializer_range = std
    for key, value in overrides.items():
        if key in ("causal", "swa_window_size"):
            cfg.dflash_config[key] = value
        else:
            setattr(cfg, key, value)
    torch.manual_seed(1000 + seed)
    return DFlashDraftModel(cfg).eval()


def tiny_corpus(data: Path) -> dict:
    """A corpus of 30 stdlib files with a ``4 * VOCAB`` tokenizer in ``data``; returns
    its manifest."""
    return corpus.build_corpus(data, vocab_size=VOCAB * 4, heldout_fraction=0.3,
                               max_files=30, valid_fraction=0.3)


def anchor_contexts(drafter, aux: torch.Tensor, anchors: torch.Tensor) -> Iterator[tuple]:
    """``(b, n, a, ctx)`` per training anchor: row ``b``, anchor ``n`` at position ``a``,
    and the reference drafter's context cache holding ``aux[b, :a]`` (positions
    ``0..a-1``). ``aux``: [batch, seq_len, len(target_layer_ids) * hidden] fp32 target
    hidden states; ``anchors``: [batch, anchors_per_seq] int64 positions."""
    for b in range(anchors.shape[0]):
        for n in range(anchors.shape[1]):
            a = int(anchors[b, n])
            ctx = drafter.new_context_cache()
            ctx.append(aux[b, :a], torch.arange(a))
            yield b, n, a, ctx
