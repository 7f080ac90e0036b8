"""Greedy tokens of the embedded target under vLLM, alone or with DDTree over a DFlash2
drafter (GPU, fp32), as JSON; and the DFlash2 test drafter itself (CPU).

    python evals/check_dflash2_vllm.py --make-drafter DIR
    python evals/check_dflash2_vllm.py --method ar|ddtree --drafter DIR --out tokens.json
        [--budget 16] [--top-k K] [--graphs] [--prompts 4] [--max-tokens 64]
        [--temperature 0.8]

``--make-drafter`` writes a DFlash2 checkpoint in the published layout for the embedded
target: the embedded DFlash drafter's tensors plus grouped convolutions near the identity
(first tap 1, small other taps and kernel deltas) and a random candidate selector
(``selector_top_k`` 8, rank 32), seeded, so its trees differ from the marginal ones.
The engine runs in this process (as ``check_ddtree_vllm.py``); ``ar`` uses the same V2
runner and CUSTOM attention backend as DDTree.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

SELECTOR_TOP_K, SELECTOR_RANK, CONV_TAPS, CONV_GROUP = 8, 32, 2, 16


def make_drafter(out: Path, seed: int = 0) -> Path:
    """The DFlash2 test drafter for the embedded target in ``out`` (config.json,
    model.safetensors); returns ``out``."""
    import torch
    from safetensors.torch import load_file, save_file

    from vllm_ddtree.demo.reference_engine import CHECKPOINTS

    source = CHECKPOINTS / "drafter"
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((source / "config.json").read_text())
    config["architectures"] = ["DFlash2DraftModel"]
    config["dflash_config"] = {**config["dflash_config"], "conv_kernel_size": CONV_TAPS,
                               "conv_group_size": CONV_GROUP, "selector_rank": SELECTOR_RANK,
                               "selector_top_k": SELECTOR_TOP_K}
    weights = load_file(source / "model.safetensors")
    dtype = weights["fc.weight"].dtype
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    groups = hidden // CONV_GROUP
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, std):
        return (torch.randn(*shape, generator=g) * std).to(dtype)

    for i in range(config["num_hidden_layers"]):
        for conv in ("attention_conv", "mlp_conv"):
            base = torch.randn(2, CONV_TAPS, hidden, generator=g) * 0.05
            base[:, 0] += 1.0
            weights[f"layers.{i}.{conv}.base_kernel"] = base.to(dtype)
            weights[f"layers.{i}.{conv}.kernel_projection.weight"] = rand(
                2 * CONV_TAPS * groups, hidden, std=0.02 / hidden**0.5)
    weights["candidate_selector.hidden_projection.weight"] = rand(
        SELECTOR_RANK, hidden, std=1.0 / hidden**0.5)
    weights["candidate_selector.predecessor_codebook"] = rand(vocab, SELECTOR_RANK, std=0.5)
    weights["candidate_selector.successor_codebook"] = rand(vocab, SELECTOR_RANK, std=0.5)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (source / name).exists():
            shutil.copy(source / name, out / name)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--make-drafter", default=None, help="write the test drafter here")
    parser.add_argument("--method", choices=["ar", "ddtree"], default="ddtree")
    parser.add_argument("--drafter", default=None)
    parser.add_argument("--out", default=None)
    parser.add_argument("--budget", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--graphs", action="store_true", help="CUDA graphs (default eager)")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sampling temperature (> 0: request i seeded with 1000 + i)")
    args = parser.parse_args()
    if args.make_drafter:
        make_drafter(Path(args.make_drafter))
        return
    if args.out is None or (args.method == "ddtree" and args.drafter is None):
        parser.error("--out (and --drafter with --method ddtree) are required")

    from check_ddtree_vllm import gpu_memory_args, record_rounds, spec_decode_metrics
    from check_pair_vllm import PROMPTS
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_ddtree.demo.reference_engine import CHECKPOINTS
    from vllm_ddtree.runtime_state import DDTREE_STATE
    from vllm_ddtree.testing.compare import vllm_top2_gaps

    target = CHECKPOINTS / "target"
    tokenizer = AutoTokenizer.from_pretrained(target)
    prompts = [tokenizer.encode(p) for p in PROMPTS[: args.prompts]]
    rounds_by_req = record_rounds() if args.method == "ddtree" else {}
    extra = {}
    spec = None
    if args.method == "ddtree":
        spec = {"method": "ddtree", "model": str(args.drafter),
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
