"""Tokens of the embedded pair under vLLM with ``method: ddtree`` (GPU), as JSON.

    python evals/check_ddtree_vllm.py --out tokens.json [--budget 32] [--graphs]
        [--temperature 0.8] [--method ar]

``--method ar`` runs the target alone on the same runner (V2: its Sampler keys Gumbel
noise by (request seed, position); V1's per-request generators do not) and the same
attention backend (CUSTOM), the reference for sampled runs.

Runs the engine in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, one GPU:
uni-process executor) so that the DDTree patches still pending GPU validation
(``patches.PENDING_GPU_VALIDATION``) are applied where the scheduler and the model
runner live. Same prompts as ``check_pair_vllm.py``; records the mean acceptance
length from DDTree's own counters and from vLLM's spec-decode metrics.
"""

from __future__ import annotations

import argparse
import json
import os

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def spec_decode_metrics(llm) -> dict:
    """vLLM's counters (``vllm:spec_decode_*``); mean acceptance length is
    ``1 + accepted / drafts`` (``v1/spec_decode/metrics.py:113-114``)."""
    values: dict = {}
    try:
        metrics = llm.get_metrics()
    except Exception as e:  # metrics are a cross-check only; DDTree's counters decide
        return {"error": repr(e), "mean_acceptance_length": None}
    for metric in metrics:
        if metric.name in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens",
                           "vllm:spec_decode_num_draft_tokens"):
            values[metric.name] = getattr(metric, "value", None)
    drafts = values.get("vllm:spec_decode_num_drafts") or 0
    accepted = values.get("vllm:spec_decode_num_accepted_tokens") or 0
    values["mean_acceptance_length"] = 1 + accepted / drafts if drafts else None
    return values


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--budget", type=int, default=32, help="tree nodes B")
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--graphs", action="store_true", help="CUDA graphs (default eager)")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--method", choices=["ddtree", "ar"], default="ddtree")
    args = parser.parse_args()

    import vllm_ddtree
    from patches import apply_pending_gpu_validation

    vllm_ddtree.register()
    applied = apply_pending_gpu_validation()

    from check_pair_vllm import PROMPTS
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_ddtree.demo import CHECKPOINTS
    from vllm_ddtree.runtime_state import DDTREE_STATE

    target, drafter = CHECKPOINTS / "target", CHECKPOINTS / "drafter"
    tokenizer = AutoTokenizer.from_pretrained(target)
    prompts = [tokenizer.encode(p) for p in PROMPTS[: args.prompts]]
    spec = {"method": "ddtree", "model": str(drafter), "num_speculative_tokens": args.budget}
    if args.top_k is not None:
        spec["ddtree_top_k"] = args.top_k
    extra = {}
    if args.method == "ar":
        spec = None
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
        extra["attention_backend"] = "CUSTOM"
    llm = LLM(model=str(target), speculative_config=spec, enforce_eager=not args.graphs,
              dtype="bfloat16", gpu_memory_utilization=0.3, max_model_len=4096,
              max_num_seqs=8, seed=0, disable_log_stats=False, **extra)
    params = SamplingParams(temperature=args.temperature, seed=0 if args.temperature else None,
                            max_tokens=args.max_tokens, logprobs=2, ignore_eos=True)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
    result = []
    for prompt, out in zip(prompts, outputs, strict=True):
        completion = out.outputs[0]
        result.append({"prompt": prompt, "tokens": list(completion.token_ids),
                       "text": completion.text,
                       "logprobs_len": len(completion.logprobs or [])})
    with open(args.out, "w") as f:
        json.dump({"mode": args.method, "budget": args.budget, "graphs": args.graphs,
                   "patches": applied, "outputs": result,
                   "ddtree_mean_acceptance_length": (
                       DDTREE_STATE.mean_acceptance_length() if DDTREE_STATE.enabled else None),
                   "vllm_metrics": spec_decode_metrics(llm)}, f)
    from check_mla_backend import exit_now

    exit_now()


if __name__ == "__main__":
    main()
