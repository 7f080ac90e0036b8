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
