# SPDX-License-Identifier: Apache-2.0
"""Tree verify as context + tree tail merged by log-sum-exp (attention_backends/mla_tree/
split.py) against the one-softmax reference; the FlashMLA context runs in tests/gpu."""

import random

import pytest
import torch
from kernel_testing import random_tree
from test_mla_tree_kernel import make_batch

from attention_backends.mla_tree import mla_tree_verify_reference
from attention_backends.mla_tree.split import (
    merge_partial_attention,
    mla_tree_verify_split,
    tree_tail_attention,
)


@pytest.mark.parametrize("page_size", [1, 4, 16, 64])
@pytest.mark.parametrize("query_len", [1, 9, 65, 130])
def test_split_equals_one_softmax(page_size, query_len):
    """Random trees (two mask words at 130 rows), contexts that end inside a page,
    one of them empty: context + tail merged == the reference's one softmax."""
    rng = random.Random(query_len * 7 + page_size)
    specs = [(ctx, random_tree(query_len, rng)) for ctx in (0, 37, 200)]
    batch = make_batch(specs, heads=3, page_size=page_size, seed=page_size + query_len)
    batch.pop("query_start_loc")
    ref_out, ref_lse = mla_tree_verify_reference(
        query_start_loc=torch.arange(0, 3 * query_len + 1, query_len, dtype=torch.int32),
        **batch)
    out, lse = mla_tree_verify_split(query_len=query_len, **batch)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


def test_tail_alone_is_the_reference_without_context():
    """With no context the tail is the whole attention; a wrong ancestor mask (all ones)
    gives another answer, so the mask is exercised."""
    rng = random.Random(3)
    specs = [(0, random_tree(20, rng)), (0, random_tree(20, rng))]
    batch = make_batch(specs, heads=2, page_size=4, seed=5)
    qsl = batch.pop("query_start_loc")
    ref_out, ref_lse = mla_tree_verify_reference(query_start_loc=qsl, **batch)
    out, lse = tree_tail_attention(query_len=20, **batch)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    full = dict(batch, ancestor_bits=torch.full_like(batch["ancestor_bits"], -1))
    wrong, _ = tree_tail_attention(query_len=20, **full)
    assert not torch.allclose(wrong, ref_out, atol=1e-3)


def test_merge_of_an_empty_half_and_of_two_empty_halves():
    out = torch.randn(2, 1, 4)
    lse = torch.tensor([[0.3], [float("-inf")]])
    empty = torch.full_like(lse, float("-inf"))
    merged, merged_lse = merge_partial_attention(out, lse, torch.randn(2, 1, 4), empty)
    torch.testing.assert_close(merged[0], out[0])
    torch.testing.assert_close(merged_lse[0], lse[0])
    assert torch.equal(merged[1], torch.zeros(1, 4)) and merged_lse[1].item() == float("-inf")


def test_split_refuses_non_uniform_rows():
    batch = make_batch([(5, [-1, 0]), (3, [-1, 0, 1])], page_size=4)
    batch.pop("query_start_loc")
    with pytest.raises(ValueError, match="uniform tree rows"):
        mla_tree_verify_split(query_len=2, **batch)
