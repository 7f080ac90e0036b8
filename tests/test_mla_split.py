# SPDX-License-Identifier: Apache-2.0
"""Tree verify as context + tree tail merged by log-sum-exp (attention_backends/mla_tree/
split.py) against the one-softmax reference; the FlashMLA context runs in tests/gpu."""

import random
import textwrap

import pytest
import torch
from kernel_testing import compiled_shared_memory, random_tree
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("query_len", [1, 17, 65, 130])
def test_fused_tail_and_merge_kernel_matches_the_torch_split(query_len, dtype):
    """split_kernels.tree_tail_merge (Triton, interpreted on CPU) == the PyTorch tail +
    merge, at 3 heads with a 576-wide latent row split 512 / 64 like MLA's (9 key
    chunks, 8 value chunks), a context ending inside a page and an empty one."""
    rng = random.Random(query_len)
    specs = [(ctx, random_tree(query_len, rng)) for ctx in (0, 45)]
    batch = make_batch(specs, heads=3, kv_lora=512, rope=64, page_size=16, dtype=dtype,
                       seed=query_len)
    batch.pop("query_start_loc")
    want_out, want_lse = mla_tree_verify_split(query_len=query_len, **batch)
    got_out, got_lse = mla_tree_verify_split(query_len=query_len, fused_tail=True, **batch)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got_out.float(), want_out.float(), **tol)
    torch.testing.assert_close(got_lse, want_lse, atol=1e-4, rtol=1e-4)


def test_fused_tail_refuses_trees_past_its_tile():
    from attention_backends.mla_tree.split_kernels import MAX_TAIL_KEYS, tree_tail_merge

    q = torch.zeros(MAX_TAIL_KEYS + 1, 1, 64)
    with pytest.raises(ValueError, match="query_len"):
        tree_tail_merge(q, torch.zeros(8, 64, 64), torch.zeros(1, 8, dtype=torch.int32),
                        torch.tensor([300], dtype=torch.int32), MAX_TAIL_KEYS + 1,
                        torch.zeros(MAX_TAIL_KEYS + 1, 5, dtype=torch.int64), 1.0, 32,
                        torch.zeros(MAX_TAIL_KEYS + 1, 1, 32), torch.zeros(MAX_TAIL_KEYS + 1, 1))


_TAIL_COMPILE_SCRIPT = textwrap.dedent(
    """
    import json, triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from attention_backends.mla_tree import split_kernels

    fn = split_kernels._tail_merge_kernel
    ptrs = {"Q": "*bf16", "KV": "*bf16", "BlockTable": "*i32", "SeqLens": "*i32",
            "Bits": "*i64", "CtxOut": "*bf16", "CtxLse": "*fp32", "Out": "*bf16",
            "Lse": "*fp32"}
    result = []
    for query_len in (17, 65, 129, 256):
        block_m, block_n = split_kernels.tail_block_sizes(query_len)
        consts = dict(QUERY_LEN=query_len, NUM_HEADS=8, HEAD_DIM=576, V_DIM=512,
                      PAGE_SIZE=64, NUM_WORDS=-(-query_len // 64), BLOCK_M=block_m,
                      BLOCK_N=block_n, BLOCK_D=64, DOT_PRECISION="tf32", UPCAST=False)
        sig = {n: ptrs.get(n, "constexpr" if n in consts else
                           "fp32" if n == "scale" else "i32") for n in fn.arg_names}
        k = triton.compile(ASTSource(fn, sig, constexprs=consts),
                           target=GPUTarget("cuda", 120, 32), options={"num_warps": 4})
        result.append(k.metadata.shared)
    print(json.dumps(result))
    """
)


def test_fused_tail_kernel_fits_sm120_shared_memory():
    """Compiled for sm_120 (no GPU needed) at 17-256 tree keys: within the ~100 KB a
    block gets there."""
    from attention_backends.mla_tree import SM120_SHARED_MEMORY_BYTES

    for used in compiled_shared_memory(_TAIL_COMPILE_SCRIPT):
        assert 0 < used <= SM120_SHARED_MEMORY_BYTES, used


@pytest.mark.parametrize("fused_tail", [False, True])
def test_padding_request_sees_nothing_and_leaves_the_others(fused_tail):
    """A CUDA-graph padding request (``seq_len`` 0 < Q) gets out 0 / lse -inf and reads no
    slot out of range; the real request beside it is unchanged."""
    rng = random.Random(11)
    batch = make_batch([(30, random_tree(9, rng)), (30, random_tree(9, rng))], heads=2,
                       kv_lora=64, rope=64, page_size=16)
    batch.pop("query_start_loc")
    want, want_lse = mla_tree_verify_split(query_len=9, fused_tail=fused_tail, **batch)
    batch["seq_lens"] = torch.tensor([39, 0], dtype=torch.int32)
    got, got_lse = mla_tree_verify_split(query_len=9, fused_tail=fused_tail, **batch)
    torch.testing.assert_close(got[:9], want[:9])
    torch.testing.assert_close(got_lse[:9], want_lse[:9])
    assert torch.equal(got[9:], torch.zeros_like(got[9:]))
    assert torch.isinf(got_lse[9:]).all() and (got_lse[9:] < 0).all()
