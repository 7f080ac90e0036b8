"""How much of an acceptance difference is the text, how much the precision (CPU).

Runs the reference engine free in fp32 and in bf16 on the greedy requests of
``check_ddtree_vllm.py --mixed``, then replays the fp32 engine along the bf16 text
(``vllm_ddtree.reference.replay``). Equal bf16 and replay figures mean drafting
precision does not change acceptance on a given text; a gap between the two free runs
is then the texts parting at bf16 ties, which is why the GPU test compares vLLM with
a replay on vLLM's own tokens instead of a free-running reference.

    .venv/bin/python evals/acceptance_text_sensitivity.py --budget 32
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from tqdm import tqdm


def mean(values: list[int]) -> float:
    return sum(values) / len(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=int, default=32)
    args = parser.parse_args()

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from check_ddtree_vllm import MIXED_SAMPLED_FROM, mixed_prompts
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_ddtree.demo.reference_engine import CHECKPOINTS
    from vllm_ddtree.reference import clip_rounds, generate, replay
    from vllm_ddtree.training.common import load_drafter

    prompts, max_tokens = mixed_prompts(AutoTokenizer.from_pretrained(CHECKPOINTS / "target"))
    models = {dtype: (AutoModelForCausalLM.from_pretrained(CHECKPOINTS / "target",
                                                           dtype=dtype).eval(),
                      load_drafter(CHECKPOINTS / "drafter", dtype=dtype))
              for dtype in (torch.float32, torch.bfloat16)}
    rounds = {"fp32 free": [], "bf16 free": [], "fp32 replay on the bf16 text": []}
    pairs = list(zip(prompts, max_tokens, strict=True))[:MIXED_SAMPLED_FROM]
    for prompt, n in tqdm(pairs, desc="greedy requests"):
        for dtype, name in ((torch.float32, "fp32 free"), (torch.bfloat16, "bf16 free")):
            out = generate(*models[dtype], prompt, n, "ddtree", budget=args.budget)
            rounds[name] += clip_rounds([s.committed for s in out.stats], len(out.tokens))
            if dtype == torch.bfloat16:
                rounds["fp32 replay on the bf16 text"] += replay(
                    *models[torch.float32], prompt, out.tokens, "ddtree", budget=args.budget)
    for name, values in rounds.items():
        print(f"B={args.budget} {name}: {mean(values):.3f} committed/round ({len(values)} rounds)")


if __name__ == "__main__":
    main()
