# SPDX-License-Identifier: Apache-2.0
"""Tree verify as context + tree tail merged by log-sum-exp (attention_backends/mla_tree/
split.py) against the one-softmax reference; the FlashMLA context runs in tests/gpu."""

import random
import textwrap

import pytest
import torch
from kernel_testing import compiled_shared_memory, random_tree
from test_mla_tree_kernel import make_batch
from vllm_ddtree.attention_backends.mla_tree import mla_tree_verify_reference
from vllm_ddtree.attention_backends.mla_tree.split import (
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
    from vllm_ddtree.attention_backends.mla_tree.split_kernels import MAX_TAIL_KEYS, tree_tail_merge

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
    from vllm_ddtree.attention_backends.mla_tree import split_kernels

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
    from vllm_ddtree.attention_backends.mla_tree import SM120_SHARED_MEMORY_BYTES

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


def test_split_eligibility_names_each_reason():
    from vllm_ddtree.attention_backends.mla_tree.split import split_ineligible_reason

    q = torch.zeros(2 * 65, 8, 576, dtype=torch.bfloat16)
    kv = torch.zeros(4, 64, 576, dtype=torch.bfloat16)
    ok = dict(num_reqs=2, max_query_len=65, kv_lora_rank=512, active_query_lens=None,
              capability_major=9)
    assert split_ineligible_reason(q, kv, **ok) is None
    cases = [
        (dict(capability_major=12), "sm_90"),
        (dict(q=q.float(), kv=kv.float()), "bf16 / fp16"),
        (dict(kv=torch.zeros(4, 16, 576, dtype=torch.bfloat16)), "64-token pages"),
        (dict(kv_lora_rank=256), "dims"),
        (dict(active_query_lens=torch.ones(2, dtype=torch.int32)), "active query rows"),
        (dict(num_reqs=3), "query lengths differ"),
        (dict(q=torch.zeros(2 * 300, 8, 576, dtype=torch.bfloat16), max_query_len=300),
         "tree rows"),
    ]
    for change, reason in cases:
        args = dict(ok, q=q, kv=kv) | change
        got = split_ineligible_reason(args.pop("q"), args.pop("kv"), **args)
        assert got is not None and reason in got, (change, got)


def test_backend_takes_the_split_path_when_asked(monkeypatch):
    """``VLLM_DDTREE_MLA_KERNEL=split``: an eligible launch goes through
    ``mla_tree_verify_split`` (here with the PyTorch context standing in for FlashMLA)
    and equals the reference; an ineligible one (this CPU) falls back to the tree kernel
    with the same result and its reason logged once."""
    from types import SimpleNamespace as NS

    from vllm_ddtree.attention_backends.mla_tree import backend
    from vllm_ddtree.attention_backends.mla_tree.split import context_attention_reference

    rng = random.Random(2)
    batch = make_batch([(40, random_tree(9, rng)), (13, random_tree(9, rng))], heads=2,
                       kv_lora=64, rope=16, page_size=4)
    want, want_lse = mla_tree_verify_reference(**batch)
    decode = NS(block_table=batch["block_table"], seq_lens=batch["seq_lens"],
                query_start_loc=batch["query_start_loc"], ancestor_bits=batch["ancestor_bits"],
                max_query_len=9, max_seq_len=int(batch["seq_lens"].max()), max_model_len=64,
                active_query_lens=None)
    impl = backend.TreeMLAImpl.__new__(backend.TreeMLAImpl)
    impl.scale, impl.kv_lora_rank = batch["scale"], batch["kv_lora_rank"]
    impl.split_context_fn = staticmethod(context_attention_reference)
    monkeypatch.setenv("VLLM_DDTREE_MLA_KERNEL", "split")
    monkeypatch.setattr(backend, "SPLIT_LAUNCHES", {"split": 0, "fallback": 0})
    real_reason = backend.split_ineligible_reason
    monkeypatch.setattr(backend, "split_ineligible_reason", lambda *a, **k: None)
    out, lse = impl.forward_mqa(batch["q"], batch["kv_cache"], NS(decode=decode), None)
    assert backend.SPLIT_LAUNCHES == {"split": 1, "fallback": 0}
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)
    monkeypatch.setattr(backend, "split_ineligible_reason", real_reason)
    out, lse = impl.forward_mqa(batch["q"], batch["kv_cache"], NS(decode=decode), None)
    assert backend.SPLIT_LAUNCHES == {"split": 1, "fallback": 1}
    torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)
    assert any("sm_90" in r for r in backend._SPLIT_REASONS_LOGGED)
    monkeypatch.setenv("VLLM_DDTREE_MLA_KERNEL", "splitt")
    with pytest.raises(ValueError, match="VLLM_DDTREE_MLA_KERNEL"):
        impl.forward_mqa(batch["q"], batch["kv_cache"], NS(decode=decode), None)
