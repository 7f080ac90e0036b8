"""The fp32 arbiter of fp8-cache flips (vllm_ddtree.testing.fp8_mla_reference): the
absorbed MLA form equals the Hugging Face model, the e4m3 rounding is vLLM's, and only
decode rows see the quantized query and cache."""

import pytest
import torch

from vllm_ddtree.demo.reference_engine import random_tiny_pair
from vllm_ddtree.testing.fp8_mla_reference import E4M3_MAX, e4m3, fp8_cache_logits


@pytest.fixture(scope="module")
def target():
    return random_tiny_pair().target.float()


def test_e4m3_rounds_to_nearest_and_saturates():
    x = torch.tensor([1.0, 1.0625, 1.07, 1.2, -3.3, 1000.0, -1e6, 0.0])
    # e4m3 keeps 3 mantissa bits: steps of 0.125 in [1, 2) (a tie to even), 0.25 in [2, 4)
    assert e4m3(x, 1.0).tolist() == [1.0, 1.0, 1.125, 1.25, -3.25, E4M3_MAX, -E4M3_MAX, 0.0]
    assert e4m3(x[:2], 2.0).tolist() == [1.0, 1.0]  # (x / 2) rounded, times 2
    assert e4m3(torch.tensor([1.2]), 0.5).tolist() == [1.25]


def test_exact_absorbed_form_equals_the_hugging_face_model(target):
    prompt, generated = [3 + (7 * i) % 400 for i in range(30)], [5, 9, 11, 300, 7]
    ids = torch.tensor([prompt + generated])
    with torch.no_grad():
        want = target(input_ids=ids).logits[0, len(prompt) - 1:]
    got = fp8_cache_logits(target, prompt, generated, kv_scale=None, q_scale=None)
    assert got.shape == (len(generated) + 1, target.config.vocab_size)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_only_decode_rows_see_the_quantized_query_and_cache(target):
    prompt, generated = [3 + (7 * i) % 400 for i in range(30)], [5, 9, 11, 300, 7]
    exact = fp8_cache_logits(target, prompt, generated, kv_scale=None, q_scale=None)
    fp8 = fp8_cache_logits(target, prompt, generated)
    torch.testing.assert_close(fp8[0], exact[0], atol=1e-5, rtol=1e-5)  # the prefill row
    moved = (fp8[1:] - exact[1:]).abs().amax(-1)
    assert (moved > 1e-3).all(), moved  # each decode row reads the e4m3 query and cache
    # each quantization alone moves them too, and a finer scale (more of e4m3's range
    # used) brings them nearer the exact result
    for kv_scale, q_scale in ((1.0, None), (None, 1.0)):
        alone = fp8_cache_logits(target, prompt, generated, kv_scale, q_scale)
        assert ((alone[1:] - exact[1:]).abs().amax(-1) > 1e-4).all()
    with pytest.raises(ValueError, match="one sequence"):
        fp8_cache_logits(target, [prompt, prompt], generated)


def test_a_quantized_prompt_moves_the_prefill_row_too(target):
    """``quantized_prompt``: every row attends on the e4m3 query and cache, as the tree
    backend computes an fp32 model's prefill; the same as decoding the prompt's last
    token on the cache (its row then equals a decode row's: one more generated token
    scored from a prompt one shorter)."""
    prompt, generated = [3 + (7 * i) % 400 for i in range(30)], [5, 9, 11]
    exact_prompt = fp8_cache_logits(target, prompt, generated)
    quantized = fp8_cache_logits(target, prompt, generated, quantized_prompt=True)
    assert (quantized[0] - exact_prompt[0]).abs().amax() > 1e-3
    # a prompt one shorter, its last token decoded: that row is quantized either way
    shorter = fp8_cache_logits(target, prompt[:-1], [prompt[-1], *generated],
                               quantized_prompt=True)
    torch.testing.assert_close(shorter[1:], quantized, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def embedded_target():
    from vllm_ddtree.demo.reference_engine import load_embedded_pair

    return load_embedded_pair().target.float().eval()


def as_run(model, prompt: list[int], tokens: list[int], **reference) -> dict:
    """What check_mla_backend records for a run whose logits are ``fp8_cache_logits``
    with ``reference``'s arguments: the drawn token's and the top 2's log-probs."""
    logprobs = fp8_cache_logits(model, prompt, tokens, **reference)[:-1].log_softmax(-1)
    seen = []
    for j, token in enumerate(tokens):
        top = logprobs[j].topk(2).indices.tolist()
        seen.append({str(t): logprobs[j, t].item() for t in {token, *top}})
    return {"prompt": prompt, "tokens": tokens, "top_logprobs": seen}


@pytest.fixture(scope="module")
def decoded(embedded_target):
    """check_mla_backend's 17-token prompt and 16 greedy tokens of the embedded target as
    the tree backend decodes an fp32 model on the fp8 cache (the prompt quantized too)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "evals"))
    from check_mla_backend import prompts

    prompt, tokens = prompts()[1], []
    for _ in range(16):
        logits = fp8_cache_logits(embedded_target, prompt, tokens, quantized_prompt=True)
        tokens.append(int(logits[-1].argmax()))
    return prompt, tokens


def test_fp32_bars_pass_rounding_noise_and_fail_a_systematic_error(embedded_target, decoded):
    """The bars of the GPU fp32 test (``FP32_LOGPROB_*_BAR``) hold for a run whose only
    error is relative noise of 1e-4 in every row's attention output (the tree kernel's
    measured fp32 error, amplified by the e4m3 query codes it moves) and fail for a run
    that leaves the query unquantized or prefills the prompt exactly."""
    import numpy as np

    from vllm_ddtree.testing.fp8_mla_reference import (
        FP32_LOGPROB_MEDIAN_BAR,
        FP32_LOGPROB_P95_BAR,
        logprob_deviations,
    )

    prompt, tokens = decoded
    model = embedded_target

    def within_bars(run: dict) -> bool:
        deviations = logprob_deviations(model, [run], quantized_prompt=True)
        median, p95 = np.percentile(deviations, [50, 95])
        return median < FP32_LOGPROB_MEDIAN_BAR and p95 < FP32_LOGPROB_P95_BAR

    exact = as_run(model, prompt, tokens, quantized_prompt=True)
    assert logprob_deviations(model, [exact], quantized_prompt=True) == pytest.approx(
        [0.0] * sum(len(s) for s in exact["top_logprobs"]), abs=1e-5)
    layers = [m for m in model.modules() if type(m).__name__ == "DeepseekV3Attention"]
    rng = torch.Generator().manual_seed(0)

    def noise(module, args):
        (x,) = args
        return (x * (1 + 1e-4 * torch.randn(x.shape, generator=rng)),)

    hooks = [layer.o_proj.register_forward_pre_hook(noise) for layer in layers]
    try:
        noisy = as_run(model, prompt, tokens, quantized_prompt=True)
    finally:
        for hook in hooks:
            hook.remove()
    assert within_bars(noisy)
    assert not within_bars(as_run(model, prompt, tokens, q_scale=None, quantized_prompt=True))
    assert not within_bars(as_run(model, prompt, tokens))  # the prompt prefilled exactly
    with pytest.raises(ValueError, match="top_logprobs has 15 positions for 16 tokens"):
        logprob_deviations(model, [{**exact, "top_logprobs": exact["top_logprobs"][1:]}])


def test_exact_fp8_arbiter_gives_the_margin_of_the_first_runs_token(target, capsys):
    """Where two runs part at ``pos``, the arbiter scores the shared prefix exactly on
    the fp8 cache: positive where the exact result sides with the first run's token."""
    from vllm_ddtree.testing.fp8_mla_reference import exact_fp8_arbiter

    prompt, tokens = [3 + (7 * i) % 400 for i in range(30)], [5, 9, 11, 300]
    logits = fp8_cache_logits(target, prompt, tokens[:2])[-1]
    best, other = logits.topk(2).indices.tolist()
    arbiter = exact_fp8_arbiter(target, [{"prompt": prompt, "tokens": tokens}], ("a", "b"))
    margin = arbiter(0, 2, best, other)
    assert margin == pytest.approx((logits[best] - logits[other]).item()) and margin > 0
    assert arbiter(0, 2, other, best) == pytest.approx(-margin)
    assert "exact fp8 result, output 0 pos 2: a " in capsys.readouterr().out
