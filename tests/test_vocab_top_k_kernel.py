# SPDX-License-Identifier: Apache-2.0
"""The two-launch vocabulary ranking (vllm_ddtree.tree.vocab_top_k_kernel) against the
PyTorch ranking it replaces (``tree._ranked_top_k_by_depth``): the same tokens in the
same order and the same fp32 bits, on tie-heavy logits and on rows with NaN / +-inf.

Without a GPU the kernels run in Triton's interpreter (tests/conftest.py); the chunk
is shrunk so that small vocabularies still take several chunks and the merge.
"""

import pytest
import torch

triton = pytest.importorskip("triton")

from kernel_testing import DEVICE, skip_unless_kernels_run_here  # noqa: E402
from test_tree import make_logits  # noqa: E402

from vllm_ddtree.tree import vocab_top_k_kernel  # noqa: E402
from vllm_ddtree.tree.draft_tree import _ranked_top_k, _ranked_top_k_by_depth  # noqa: E402
from vllm_ddtree.tree.vocab_top_k_kernel import ranked_top_k_triton  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    skip_unless_kernels_run_here(vocab_top_k_kernel._chunk_top_k_kernel),
]


def assert_same_ranking(got, want):
    assert got[1].dtype == torch.int64 and got[0].dtype == torch.float32
    assert torch.equal(got[1].cpu(), want[1].cpu()), (got[1], want[1])
    assert torch.equal(got[0].cpu().view(torch.int32), want[0].cpu().view(torch.int32))


def rank_both(logits, k):
    logits = logits.to(DEVICE)
    got = ranked_top_k_triton(torch.log_softmax(logits.float(), dim=-1), k)
    return got, _ranked_top_k_by_depth(logits, k)


@pytest.mark.parametrize("chunk", [16, 4096])
@pytest.mark.parametrize("kind", ["randn", "quantized", "uniform", "repeated", "peaked"])
@pytest.mark.parametrize("shape,k", [((2, 5, 100), 7), ((1, 3, 37), 16), ((2, 2, 9), 9),
                                     ((1, 4, 50), 1)])
def test_equals_the_pytorch_ranking(monkeypatch, chunk, kind, shape, k):
    monkeypatch.setattr(vocab_top_k_kernel, "_CHUNK", chunk)
    logits = make_logits(kind, shape, seed=sum(shape) + k)
    assert_same_ranking(*rank_both(logits, k))


def test_non_finite_rows(monkeypatch):
    """A NaN row, an all -inf row and a row with +inf rank by token id with -inf
    log-probs, as ``tree._draft_logprobs`` makes them."""
    monkeypatch.setattr(vocab_top_k_kernel, "_CHUNK", 16)
    logits = torch.randn(2, 4, 50)
    logits[0, 1, 7] = float("nan")
    logits[1, 2] = float("-inf")
    logits[1, 3, 5] = float("inf")
    logits[0, 3, :10] = float("-inf")
    got, want = rank_both(logits, 12)
    assert_same_ranking(got, want)
    assert torch.equal(got[1][1, 2].cpu(), torch.arange(12))


def test_low_precision_input_and_strided_rows():
    logits = make_logits("randn", (2, 6, 64), seed=4).to(torch.bfloat16)
    assert_same_ranking(*rank_both(logits, 8))
    wide = make_logits("randn", (2, 6, 80), seed=5).to(DEVICE)
    logprobs = torch.log_softmax(wide, dim=-1)[..., :64]  # rows with stride 80
    assert logprobs.stride(1) == 80
    assert_same_ranking(ranked_top_k_triton(logprobs, 8), _ranked_top_k(logprobs, 8))


def test_plan_and_errors():
    assert vocab_top_k_kernel._plan(163840, 64) == (4096, 40, 64, 4096)
    assert vocab_top_k_kernel._plan(163840, 128) == (4096, 40, 128, 8192)
    assert vocab_top_k_kernel._plan(163840, 256) is None  # past the merge block
    assert vocab_top_k_kernel._plan(30, 1) == (32, 1, 2, 2)
    assert ranked_top_k_triton(torch.zeros(1, 2, 200000, device=DEVICE), 256) is None
    empty = ranked_top_k_triton(torch.zeros(0, 3, 10, device=DEVICE), 4)
    assert empty[0].shape == (0, 3, 4) and empty[1].shape == (0, 3, 4)
    with pytest.raises(ValueError, match="fp32"):
        ranked_top_k_triton(torch.zeros(1, 2, 10, dtype=torch.float64), 2)
    with pytest.raises(ValueError, match="k must be"):
        ranked_top_k_triton(torch.zeros(1, 2, 10), 11)


@pytest.mark.skipif(DEVICE == "cpu", reason="full vocabularies: compiled kernels only")
@pytest.mark.parametrize("vocab", [151936, 163840])
@pytest.mark.parametrize("k", [16, 64, 128])
def test_full_vocabulary_on_the_gpu(vocab, k):
    """The drafters' vocabularies (Qwen3, Kimi-K2), 40 chunks and the merge, with bf16
    logits that tie (quantized) and that do not."""
    gen = torch.Generator().manual_seed(vocab + k)
    for logits in (torch.randn(2, 7, vocab, generator=gen) * 3,
                   torch.randint(0, 5, (2, 7, vocab), generator=gen).float()):
        assert_same_ranking(*rank_both(logits.to(torch.bfloat16), k))
