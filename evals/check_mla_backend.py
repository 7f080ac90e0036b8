"""Greedy tokens of a model under one vLLM attention backend (GPU), as JSON.

    python evals/check_mla_backend.py MODEL_DIR --backend CUSTOM --out tokens.json [--graphs]
        [--kv-cache-dtype fp8]

Used by tests/gpu/test_mla_backend_vllm.py and tests/gpu/test_fp8_kv_vllm.py to compare
our backend (CUSTOM) with vLLM's own MLA backends on the same prompts.
"""

from __future__ import annotations

import argparse
import json
import os

# The prompts' lengths; prompt n's tokens: 3 + (7 * i) % 900 for i < n.
PROMPT_LENGTHS = (5, 17, 64, 130, 700)
# A second round after the first has finished: longer prompts of the same tokens, so the
# first round's full pages come from the prefix cache and the rest is an extend with
# context (CUSTOM takes it down vLLM's MLA prefill path, FLASH_ATTN_MLA one of up to 512
# new tokens through its decode kernel).
EXTEND_LENGTHS = (230, 850)


def prompts(lengths: tuple[int, ...] = PROMPT_LENGTHS) -> list[list[int]]:
    """The token ids of every prompt (the same on every backend)."""
    return [[3 + (7 * i) % 900 for i in range(n)] for n in lengths]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--backend", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--graphs", action="store_true", help="CUDA graphs (default eager)")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--max-num-seqs", type=int, default=8,
                        help="vLLM's max_num_seqs (1: each prompt alone, a witness run)")
    parser.add_argument("--kv-cache-dtype", default="auto",
                        help="vLLM's --kv-cache-dtype (fp8: e4m3 latent cache, scale 1.0)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                        help="the model's dtype (float32: CUSTOM only, an exactness check)")
    args = parser.parse_args()

    from check_ddtree_vllm import gpu_memory_args  # VLLM_DDTREE_TEST_KV_GIB: fixed KV
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_ddtree.testing.compare import vllm_top2_gaps, vllm_top_logprobs

    llm = LLM(model=args.model, skip_tokenizer_init=True, attention_backend=args.backend,
              enforce_eager=not args.graphs, **gpu_memory_args(), max_model_len=4096,
              dtype=args.dtype, max_num_seqs=args.max_num_seqs, seed=0,
              kv_cache_dtype=args.kv_cache_dtype, enable_prefix_caching=True)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, logprobs=2,
                            detokenize=False, ignore_eos=True)
    rounds = (prompts(), prompts(EXTEND_LENGTHS))
    outputs = [out for batch in rounds for out in llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in batch], params, use_tqdm=False)]
    result = []
    for prompt, out in zip(rounds[0] + rounds[1], outputs, strict=True):
        completion = out.outputs[0]
        gaps = vllm_top2_gaps(completion.logprobs)
        result.append({"prompt": prompt, "tokens": list(completion.token_ids),
                       "top2_gap": gaps,
                       "top_logprobs": vllm_top_logprobs(completion.logprobs)})
    with open(args.out, "w") as f:
        json.dump({"backend": args.backend, "graphs": args.graphs, "dtype": args.dtype,
                   "kv_cache_dtype": args.kv_cache_dtype, "outputs": result}, f)
    exit_now()


def exit_now() -> None:
    """Kill vLLM's engine-core children (they keep GPU memory otherwise), then exit
    without the interpreter's shutdown, where vLLM was seen to hang."""
    import psutil

    for child in psutil.Process().children(recursive=True):
        child.kill()
    os._exit(0)


if __name__ == "__main__":
    main()
