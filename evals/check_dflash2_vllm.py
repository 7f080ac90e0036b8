"""Tokens of the embedded target under vLLM, alone or with DDTree over a DFlash2 drafter
(GPU, fp32), as JSON.

    python evals/check_dflash2_vllm.py --method ar|ddtree --out tokens.json
        [--drafter DIR] [--budget 16] [--top-k K] [--graphs] [--prompts 4]
        [--max-tokens 64] [--temperature 0.8]

``--drafter`` defaults to the DFlash2 drafter shipped for the embedded target
(``vllm_ddtree/checkpoints/dflash2_drafter``, the published layout, trained). The
engine runs in this process (as ``check_ddtree_vllm.py``); ``ar`` uses the same V2
runner and CUSTOM attention backend as DDTree.
"""

from __future__ import annotations

import argparse
import json
import os

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--method", choices=["ar", "ddtree"], default="ddtree")
    parser.add_argument("--drafter", default=None,
                        help="DFlash2 drafter directory (default: the shipped one)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--budget", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--graphs", action="store_true", help="CUDA graphs (default eager)")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sampling temperature (> 0: request i seeded with 1000 + i)")
    args = parser.parse_args()
    if args.out is None:
        parser.error("--out is required")

    from check_ddtree_vllm import gpu_memory_args, record_rounds, spec_decode_metrics
    from check_pair_vllm import PROMPTS
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_ddtree.demo.reference_engine import CHECKPOINTS
    from vllm_ddtree.runtime_state import DDTREE_STATE
    from vllm_ddtree.testing.compare import vllm_top2_gaps

    target = CHECKPOINTS / "target"
    drafter = args.drafter or CHECKPOINTS / "dflash2_drafter"
    tokenizer = AutoTokenizer.from_pretrained(target)
    prompts = [tokenizer.encode(p) for p in PROMPTS[: args.prompts]]
    rounds_by_req = record_rounds() if args.method == "ddtree" else {}
    extra = {}
    spec = None
    if args.method == "ddtree":
        spec = {"method": "ddtree", "model": str(drafter),
                "num_speculative_tokens": args.budget}
        if args.top_k is not None:
            spec["ddtree_top_k"] = args.top_k
    else:
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
        extra["attention_backend"] = "CUSTOM"
    llm = LLM(model=str(target), speculative_config=spec, enforce_eager=not args.graphs,
              dtype="float32", max_model_len=2048, **gpu_memory_args(), max_num_seqs=4,
              seed=0, disable_log_stats=False, **extra)
    params = [SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens,
                             ignore_eos=True, logprobs=2,
                             seed=1000 + i if args.temperature > 0 else None)
              for i in range(len(prompts))]
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
    result = []
    for prompt, out in zip(prompts, outputs, strict=True):
        committed = [n for rid, rounds in rounds_by_req.items()
                     if rid.rsplit("-", 1)[0] == out.request_id for n in rounds]
        result.append({"prompt": prompt, "tokens": list(out.outputs[0].token_ids),
                       "top2_gap": vllm_top2_gaps(out.outputs[0].logprobs),
                       "committed_per_round": committed})
    with open(args.out, "w") as f:
        json.dump({"method": args.method, "budget": args.budget, "top_k": args.top_k,
                   "graphs": args.graphs, "temperature": args.temperature, "outputs": result,
                   "ddtree_mean_acceptance_length": (
                       DDTREE_STATE.mean_acceptance_length() if DDTREE_STATE.enabled
                       else None),
                   "vllm_metrics": spec_decode_metrics(llm)}, f)
    from check_mla_backend import exit_now

    exit_now()


if __name__ == "__main__":
    main()
