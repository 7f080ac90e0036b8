"""``--kv-cache-dtype fp8`` in vLLM (GPU): vLLM's e4m3 MLA latent cache with the per-layer
scale (1.0 here: the checkpoint carries no KV scales).

1. Our MLA backend (CUSTOM) gives the greedy tokens of vLLM's FLASHMLA on the same fp8
   cache (sm_90): both take the e4m3 query MLAAttention quantizes with the layer's
   static ``_q_scale`` (TRITON_MLA keeps a bf16 query; FLASH_ATTN_MLA has no fp8 cache),
   eager and with CUDA graphs. Target: the embedded DeepSeek-V3-architecture target
   (trained weights, 4 heads, kv_lora_rank 512 + rope 64). Past bf16's tie gap on an
   fp8 cache (``compare.FP8_CACHE_BF16_TIE_GAP``, 0.5 nats: the e4m3 query amplifies
   rounding) a difference is excused only within vLLM's own spread: FLASHMLA with one prompt a step
   and TRITON_MLA on the same fp8 cache part from FLASHMLA on some outputs at some
   reference gaps; ours may part on no more outputs, at no wider gap
   (``compare.mismatch_problems``' witnesses; FLASHMLA's fp8 kernel rounds P to e4m3).
   Past that, a flip is cleared only where the exact result sides with ours: the target
   in fp32 on CPU, the shared prefix forced, with vLLM's e4m3 query and cache
   (``vllm_ddtree.testing.fp8_mla_reference``).
2. DDTree with the fp8 cache and CUDA graphs gives plain decoding's tokens (AR on the same
   fp8 cache and backend, eager) on the embedded pair's mixed batch, its verify steps in FULL
   graphs. A mismatch is allowed only at a tie (``vllm_ddtree.testing.compare``) or
   within the spread of AR with one request a step against AR.
3. The same in fp32 (model dtype; the cache fp8): every token equal, greedy and seeded.
   In bf16 the e4m3 query amplifies the batch shape's rounding of q (an entry near an
   e4m3 rounding boundary flips by a whole e4m3 step), so bf16 ties are a loose check;
   fp32 leaves no such flips, so the cache's and query's quantization are shown to
   score every key alike in a tree verify and in plain decoding.
"""

import pytest
import torch
from test_ddtree_vllm import first_mismatches, run_mixed_vs_ar, run_script
from test_mla_backend_vllm import compare, fp32_target, run_backend

from vllm_ddtree.demo.reference_engine import CHECKPOINTS
from vllm_ddtree.testing.compare import (
    first_mismatch,
    mismatch_problems,
    tie_gap_of,
    witness_spread,
)

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(not (CHECKPOINTS / "target" / "config.json").exists(),
                       reason="embedded pair not trained yet"),
]
FP8 = ["--kv-cache-dtype", "fp8"]


def deviation_summary(deviations: list[float]) -> tuple[float, float]:
    import numpy as np

    median, p95 = np.percentile(deviations, [50, 95])
    return float(median), float(p95)


def test_custom_backend_fp8_matches_flashmla_fp8(tmp_path):
    """Greedy tokens against FLASHMLA on the same fp8 cache (ties: bf16's gap on an fp8
    cache, ``compare.FP8_CACHE_BF16_TIE_GAP``; flips past it excused only within the
    witnesses' spread or where the exact fp8 result sides with ours), and our log-probs
    no further from the exact fp8 result than FLASHMLA's (median and 95th percentile of
    |difference| within 1.25x: a systematic error of our fp8 path would show there,
    whatever a single flip's cause). On the H100: 0.023 / 0.13 nats for ours, 0.027 /
    0.14 for FLASHMLA, where bf16 arithmetic emulated on the exact result gives 0.022 /
    0.12 (``evals/fp8_margin_noise.py --bf16``); the one flip (prompt 3, token 20,
    FLASHMLA's gap 0.31, the exact result's 0.25 its way) is within that tie gap."""
    from vllm_ddtree.attention_backends.mla_tree.cascade import flashmla_dense_available
    from vllm_ddtree.testing.fp8_mla_reference import exact_fp8_arbiter, logprob_deviations

    if not flashmla_dense_available(torch.device("cuda")):
        pytest.skip("FLASHMLA (vLLM's backend with the quantized fp8 query) runs on sm_90")
    target = CHECKPOINTS / "target"
    ours = run_backend(target, "CUSTOM", tmp_path, kv_cache_dtype="fp8")
    ref = run_backend(target, "FLASHMLA", tmp_path, kv_cache_dtype="fp8")
    witnesses = (run_backend(target, "FLASHMLA", tmp_path, kv_cache_dtype="fp8",
                             max_num_seqs=1),
                 run_backend(target, "TRITON_MLA", tmp_path, kv_cache_dtype="fp8"))
    graphs = run_backend(target, "CUSTOM", tmp_path, graphs=True, kv_cache_dtype="fp8")
    moved = [[first_mismatch(a["tokens"], b["tokens"])
              for a, b in zip(w["outputs"], ref["outputs"], strict=True)] for w in witnesses]
    spread = witness_spread(ref["outputs"], [w["outputs"] for w in witnesses])
    print(f"FLASHMLA fp8 one prompt a step, TRITON_MLA fp8 vs FLASHMLA fp8: {moved}; "
          f"(outputs, widest reference gap): {spread}", flush=True)
    model = fp32_target(target)
    arbiter = exact_fp8_arbiter(model, ours["outputs"], ("ours", "FLASHMLA"))
    tie_gap = tie_gap_of("bfloat16", "fp8")
    problems = {"CUSTOM fp8 vs FLASHMLA fp8": compare(ours, ref, witnesses, arbiter, tie_gap),
                "CUSTOM fp8 graphs vs eager": compare(graphs, ours)}
    for name, found in problems.items():  # printed at once: a time limit may cut pytest
        print(f"{name}: {found or 'equal up to ties'}", flush=True)
    distance = {name: deviation_summary(logprob_deviations(model, run["outputs"]))
                for name, run in (("CUSTOM", ours), ("FLASHMLA", ref))}
    print("|log-prob - exact fp8 result's| (median, 95th percentile): "
          + ", ".join(f"{name} {m:.2e} / {p:.2e}" for name, (m, p) in distance.items()),
          flush=True)
    (m_ours, p_ours), (m_ref, p_ref) = distance["CUSTOM"], distance["FLASHMLA"]
    problems["CUSTOM further from the exact fp8 result than FLASHMLA"] = (
        [] if m_ours <= 1.25 * m_ref and p_ours <= 1.25 * p_ref else [distance])
    assert not any(problems.values()), problems


def test_custom_backend_fp8_in_fp32_equals_the_exact_fp8_reference(tmp_path):
    """Our backend alone against the independent reference, without bf16: the embedded
    target in fp32 on the fp8 cache (every token a decode of the tree kernel, the prompt
    included: ``quantized_prompt``) scores each generated token as the exact fp8 result
    does. The log-probs vLLM returned (the drawn token and the top 2) lie within
    ``FP32_LOGPROB_MEDIAN_BAR`` / ``FP32_LOGPROB_P95_BAR`` of the reference's (median /
    95th percentile): fp32 rounding alone moves e4m3 query codes at their boundaries by
    that much, a systematic error of the fp8 path by more (the bars' calibration:
    ``vllm_ddtree.testing.fp8_mla_reference``); a token differs only where the
    reference's top-2 gap is under 0.1 nats."""
    from vllm_ddtree.testing.fp8_mla_reference import (
        FP32_LOGPROB_MEDIAN_BAR,
        FP32_LOGPROB_P95_BAR,
        deviations_from,
        fp8_cache_logits,
    )

    target = CHECKPOINTS / "target"
    ours = run_backend(target, "CUSTOM", tmp_path, kv_cache_dtype="fp8", dtype="float32")
    model = fp32_target(target)
    problems, deviations = [], []
    for i, output in enumerate(ours["outputs"]):
        logprobs = fp8_cache_logits(model, output["prompt"], output["tokens"],
                                    quantized_prompt=True)[:-1].log_softmax(-1)
        deviations += deviations_from(logprobs, output["top_logprobs"])
        top2 = logprobs.topk(2, dim=-1)
        for j, token in enumerate(output["tokens"]):
            gap = (top2.values[j, 0] - top2.values[j, 1]).item()
            if token != int(top2.indices[j, 0]):
                if gap >= 0.1:
                    problems.append(f"prompt {i} pos {j}: {token} vs the reference's "
                                    f"{int(top2.indices[j, 0])} (its top-2 gap {gap:.3f})")
                break
    median, p95 = deviation_summary(deviations)
    print(f"CUSTOM fp8 fp32 vs the exact fp8 reference: |log-prob difference| median "
          f"{median:.2e}, 95th percentile {p95:.2e}, max {max(deviations):.2e} over "
          f"{len(deviations)}; {problems or 'tokens equal up to gaps under 0.1'}", flush=True)
    assert median < FP32_LOGPROB_MEDIAN_BAR and p95 < FP32_LOGPROB_P95_BAR and not problems, (
        median, p95, problems)


def test_ddtree_fp8_cache_with_cuda_graphs_equals_ar(tmp_path):
    ar = run_script("check_ddtree_vllm.py", ["--mixed", "--method", "ar", *FP8],
                    tmp_path / "ar.json")
    ar1 = run_script("check_ddtree_vllm.py", ["--mixed", "--method", "ar", "--max-num-seqs",
                                              "1", *FP8], tmp_path / "ar1.json")
    print(f"AR one request a step vs AR: {first_mismatches(ar1, ar)}", flush=True)
    got = run_mixed_vs_ar(ar, ["--mixed", "--budget", "32", "--graphs", *FP8],
                          tmp_path / "ddtree.json", "graphs B=32, fp8 KV cache",
                          ar_witness=ar1)
    # Trees are accepted beyond the root (bf16 eager B=32 on this batch: 1.93 per round).
    assert got["ddtree_mean_acceptance_length"] > 1.5


def test_ddtree_fp8_cache_fp32_equals_ar_token_for_token(tmp_path):
    fp32 = ["--dtype", "float32", *FP8]
    ar = run_script("check_ddtree_vllm.py", ["--mixed", "--method", "ar", *fp32],
                    tmp_path / "ar32.json")
    got = run_script("check_ddtree_vllm.py", ["--mixed", "--budget", "32", *fp32],
                     tmp_path / "ddtree32.json")
    print(f"fp32, fp8 KV cache: first mismatch per request {first_mismatches(got, ar)}; "
          f"mean acceptance length {got['ddtree_mean_acceptance_length']:.3f}")
    problems = mismatch_problems(got["outputs"], ar["outputs"], tie_gap_of("float32"))
    assert not problems, "\n".join(problems)
    assert got["ddtree_mean_acceptance_length"] > 1.5
