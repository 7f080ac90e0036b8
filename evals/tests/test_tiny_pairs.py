"""The tiny random pairs the GPU tests give vLLM (evals/tiny_pairs.py): they load in
transformers and the reference engine, pass the drafter/target checks, and have
well-separated greedy logits (unlike vLLM's dummy weights)."""

import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from vllm_ddtree.config import check_drafter_for_target
from vllm_ddtree.reference import DFlashDraftModel, generate

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "evals"))
from tiny_pairs import make_tiny_pair, random_prompts  # noqa: E402


@pytest.mark.parametrize("kind", ["qwen3", "deepseek_v3"])
def test_tiny_pair_loads_and_ddtree_equals_ar(kind, tmp_path):
    target_dir, drafter_dir = make_tiny_pair(kind, tmp_path)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    check_drafter_for_target(str(drafter_dir), target.config)
    drafter = DFlashDraftModel.from_pretrained(drafter_dir, dtype=torch.float32).eval()
    assert drafter.config.layer_types == ["sliding_attention", "full_attention",
                                          "sliding_attention"]
    prompt = random_prompts([40])[0]
    with torch.no_grad():
        top2 = target(torch.tensor([prompt])).logits[0, -1].topk(2).values
    assert float(top2[0] - top2[1]) > 0.05  # no dummy-weight near-ties
    ar = generate(target, drafter, prompt, 16, "ar").tokens
    assert generate(target, drafter, prompt, 16, "ddtree", budget=16).tokens == ar
