"""Greedy tokens of a GQA model under one vLLM attention backend (GPU), as JSON.

    python evals/check_gqa_backend.py MODEL_DIR --backend CUSTOM --out tokens.json \
        [--graphs] [--tree-threshold 64] [--runner v2]

``CUSTOM`` runs with ``VLLM_DDTREE_TREE_BACKEND=gqa`` (the plugin's ``register()``
then puts the GQA tree backend in the CUSTOM slot in every vLLM process).
``--tree-threshold N`` also sends prompts of up to N tokens through the tree kernel
(causal bits), as DDTree's 1 + 2B threshold does: it sets
``TreeGQAMetadataBuilder.min_tree_query_len`` in this process and runs the engine here
too (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), and records the longest query the tree
kernel saw (``max_tree_query_len``). ``--runner v2`` forces vLLM's V2 model runner
(DDTree's). Used by tests/gpu/test_gqa_backend_vllm.py to compare CUSTOM with FLASH_ATTN.
"""

from __future__ import annotations

import argparse
import json
import os

from check_mla_backend import exit_now

from vllm_ddtree import settings

# Longer than the test models' sliding window (64), so the window matters.
PROMPT_LENGTHS = (5, 17, 64, 130, 200, 700)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--backend", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--graphs", action="store_true", help="CUDA graphs (default eager)")
    parser.add_argument("--tree-threshold", type=int, default=0)
    parser.add_argument("--runner", choices=["auto", "v1", "v2"], default="auto")
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()

    if args.backend == "CUSTOM":
        settings.set_for_children("VLLM_DDTREE_TREE_BACKEND", "gqa")
    if args.runner != "auto":
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if args.runner == "v2" else "0"
    tree_query_lens: list[int] = []
    if args.tree_threshold:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the builder below is this one
        from vllm_ddtree.attention_backends.gqa_tree import backend as gqa_backend

        gqa_backend.TreeGQAMetadataBuilder.min_tree_query_len = args.tree_threshold
        tree_verify = gqa_backend.gqa_tree_verify

        def recording_tree_verify(*call_args, **kwargs):
            tree_query_lens.append(kwargs["max_query_len"])
            return tree_verify(*call_args, **kwargs)

        gqa_backend.gqa_tree_verify = recording_tree_verify

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_ddtree.testing.compare import vllm_top2_gaps

    llm = LLM(model=args.model, skip_tokenizer_init=True, attention_backend=args.backend,
              enforce_eager=not args.graphs, gpu_memory_utilization=0.3, max_model_len=4096,
              dtype="bfloat16", max_num_seqs=8, seed=0)
    prompts = [[3 + (7 * i) % 4000 for i in range(n)] for n in PROMPT_LENGTHS]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, logprobs=2,
                            detokenize=False, ignore_eos=True)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
    result = []
    for out in outputs:
        completion = out.outputs[0]
        gaps = vllm_top2_gaps(completion.logprobs)
        result.append({"tokens": list(completion.token_ids), "top2_gap": gaps})
    backend_cls = None
    if args.backend == "CUSTOM":
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        backend_cls = AttentionBackendEnum.CUSTOM.get_path()
    with open(args.out, "w") as f:
        json.dump({"backend": args.backend, "backend_class": backend_cls, "graphs": args.graphs,
                   "tree_threshold": args.tree_threshold, "runner": args.runner,
                   "max_tree_query_len": max(tree_query_lens, default=0),
                   "outputs": result}, f)
    exit_now()


if __name__ == "__main__":
    main()
