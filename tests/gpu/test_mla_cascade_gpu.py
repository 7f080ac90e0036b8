# SPDX-License-Identifier: Apache-2.0
"""The cascade (FlashMLA over the context, our kernel over the tree; sm_90) against the
fp32 reference: bf16 and fp8 caches, DeepSeek/Kimi head counts, odd tree sizes, requests
without context, and the backend's CUDA-graph launch replayed at other lengths.

fp8: both parts take vLLM's e4m3 query (``q / q_scale``, one static scale per layer, as
MLAAttention quantizes it for FLASHMLA); the reference is fp32 on the dequantized query
and cache, and the cascade must score keys as the Triton fp8 kernel does (the one plain
decoding or another batch shape may take for the same token)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("TRITON_INTERPRET=1: run tests/gpu in its own process", allow_module_level=True)

from test_mla_tree_kernel_gpu import (  # noqa: E402
    LSE_TOL,
    OUT_TOL,
    fp8_reference,
    make_batch,
    to_fp8,
)

from vllm_ddtree.attention_backends.mla_tree import cascade, mla_tree_verify  # noqa: E402
from vllm_ddtree.attention_backends.mla_tree.reference import (  # noqa: E402
    mla_tree_verify_reference,
)

if not cascade.flashmla_dense_available(torch.device("cuda")):
    pytest.skip("the cascade needs FlashMLA's dense decode (sm_90)", allow_module_level=True)


# fp8 against the fp32 reference on the dequantized query and cache, while FlashMLA's fp8
# kernel rounds its own intermediates (the softmax weights enter P.V at low precision):
# on an H100 one element of 147,456 was 0.017 from the reference at an output of 0.12,
# just past OUT_TOL; a wrong scale or a lost context is 10-100x larger.
FP8_OUT_TOL = dict(atol=2.5e-2, rtol=5e-2)


@pytest.fixture(autouse=True)
def force_cascade(monkeypatch):
    monkeypatch.setenv("VLLM_DDTREE_MLA_KERNEL", "cascade")


def host_lens(batch) -> dict:
    """The host-side maxima the backend passes (a sync: outside any capture)."""
    qlens = batch["query_start_loc"].diff()
    max_query_len = int(qlens.max())
    assert bool((qlens == max_query_len).all())
    return dict(validate_values=False, max_query_len=max_query_len,
                max_seq_len=int(batch["seq_lens"].max()))


def launch(batch, plan=None, lens=None, **kwargs):
    plan = plan if plan is not None else cascade.CascadePlan()
    lens = {**(lens or host_lens(batch)), **kwargs}
    return mla_tree_verify(**batch, **lens, cascade_plan=plan), plan


SHAPES = [  # heads, context, new tokens per request, kind
    (8, 9000, 2, "tree"),
    (16, 5000, 17, "tree"),
    (16, 33000, 33, "chain"),
    (64, 3000, 65, "tree"),
    (128, 2000, 9, "tree"),
    (8, 1000, 129, "tree"),
    (128, 70, 5, "tree"),
]


@pytest.mark.parametrize("heads,ctx,qlen,kind", SHAPES)
def test_bf16_matches_reference(heads, ctx, qlen, kind):
    batch = make_batch([(ctx, kind, qlen), (ctx // 3 + 7, kind, qlen), (1, kind, qlen)],
                       heads=heads, page_size=64, seed=heads + qlen)
    (out, lse), plan = launch(batch)
    assert plan.ctx_lens is not None  # the cascade ran
    ref_out, ref_lse = mla_tree_verify_reference(**batch)
    torch.testing.assert_close(out.float(), ref_out.float(), **OUT_TOL)
    torch.testing.assert_close(lse, ref_lse, **LSE_TOL)


@pytest.mark.parametrize("heads,ctx,qlen,kind", SHAPES[:5])
def test_fp8_matches_reference(heads, ctx, qlen, kind):
    batch = to_fp8(make_batch([(ctx, kind, qlen), (ctx // 3 + 7, kind, qlen)], heads=heads,
                              page_size=64, seed=heads))
    (out, lse), plan = launch(batch)
    assert plan.fp8_meta is not None  # the cascade's fp8 path ran
    ref_out, ref_lse = fp8_reference(batch)
    torch.testing.assert_close(out.float(), ref_out.float(), **FP8_OUT_TOL)
    torch.testing.assert_close(lse, ref_lse, **LSE_TOL)
    # The Triton fp8 kernel (plain decoding's, or another batch shape's) on the same
    # launch: the same scores up to summation order.
    tri_out, tri_lse = mla_tree_verify(**batch, **host_lens(batch), kernel="triton")
    lse_gap = (lse - tri_lse).abs().max().item()
    print(f"H{heads} ctx {ctx} qlen {qlen}: max |lse cascade - triton| {lse_gap:.3g}, "
          f"|out| {(out.float() - tri_out.float()).abs().max().item():.3g}")
    torch.testing.assert_close(lse, tri_lse, atol=2e-3, rtol=0)
    torch.testing.assert_close(out.float(), tri_out.float(), **FP8_OUT_TOL)


@pytest.mark.parametrize("fp8", [False, True])
def test_cuda_graph_replays_plan_at_other_lengths(fp8):
    """The backend's launch in a CUDA graph (one plan per step, planned inside the
    capture), replayed after the contexts shrink and the query changes: FlashMLA's
    schedule and the context lengths follow, the result matches the reference."""
    batch = make_batch([(30000, "tree", 17), (2000, "chain", 17)], heads=16, page_size=64)
    if fp8:
        batch = to_fp8(batch)
    reference = fp8_reference if fp8 else (lambda b: mla_tree_verify_reference(**b))
    lens = {**host_lens(batch), "max_seq_len": 131072}
    launch(batch, lens=lens)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        (out, lse), plan = launch(batch, lens=lens)
    assert (plan.fp8_meta if fp8 else plan.sched_meta) is not None  # the cascade ran
    for step in range(2):
        if step == 1:
            batch["seq_lens"][0] = 5017  # its first 5000 keys stay the context
            batch["q"].copy_((batch["q"].float() * -0.5).to(batch["q"].dtype))
        graph.replay()
        torch.cuda.synchronize()
        ref_out, ref_lse = reference(batch)
        torch.testing.assert_close(out.float(), ref_out.float(),
                                   **(FP8_OUT_TOL if fp8 else OUT_TOL))
        torch.testing.assert_close(lse, ref_lse, **LSE_TOL)


@pytest.mark.parametrize("heads,qlen", [(16, 9), (8, 2)])
@pytest.mark.parametrize("fp8", [False, True])
def test_graph_padding_rows_do_not_reach_real_requests(fp8, heads, qlen):
    """CUDA-graph padding as vLLM replays a uniform batch: a last request with no tokens
    and no keys whose q rows (past the real tokens) hold inf / NaN, as a previous layer
    can leave them (e4m3: NaN and +-448, its largest). The real rows match the
    reference."""
    batch = make_batch([(6000, "tree", qlen), (900, "chain", qlen)], heads=heads,
                       page_size=64)
    ref = fp8_reference if fp8 else (lambda b: mla_tree_verify_reference(**b))
    if fp8:
        batch = to_fp8(batch)
    ref_out, ref_lse = ref(batch)
    padded = dict(batch)
    pad = torch.full((qlen, *batch["q"].shape[1:]), float("nan"), device="cuda")
    pad[0, 0, 0] = 448.0 if fp8 else float("inf")
    pad = pad.to(batch["q"].dtype)
    padded["q"] = torch.cat([batch["q"], pad])
    padded["seq_lens"] = torch.cat([batch["seq_lens"], batch["seq_lens"].new_zeros(1)])
    padded["query_start_loc"] = torch.cat([batch["query_start_loc"],
                                           batch["query_start_loc"][-1:]])
    padded["block_table"] = torch.cat([batch["block_table"], batch["block_table"][:1]])
    padded["ancestor_bits"] = torch.cat([batch["ancestor_bits"],
                                         batch["ancestor_bits"][:qlen]])
    lens = dict(validate_values=False, max_query_len=qlen, max_seq_len=6000 + qlen)
    (out, lse), plan = launch(padded, lens=lens)
    assert plan.ctx_lens is not None  # the cascade ran (3 requests x qlen rows)
    real = 2 * qlen
    torch.testing.assert_close(out[:real].float(), ref_out.float(),
                               **(FP8_OUT_TOL if fp8 else OUT_TOL))
    torch.testing.assert_close(lse[:real], ref_lse, **LSE_TOL)


def test_request_without_context_is_the_tree_alone():
    """A request with no context keys (FlashMLA sees length 0) beside others. Last in
    the file: a fault here would poison the CUDA context of every later test."""
    batch = make_batch([(4000, "tree", 9), (0, "chain", 9), (64, "tree", 9)], heads=16,
                       page_size=64)
    (out, lse), plan = launch(batch)
    assert plan.sched_meta is not None  # the cascade ran
    ref_out, ref_lse = mla_tree_verify_reference(**batch)
    torch.testing.assert_close(out.float(), ref_out.float(), **OUT_TOL)
    torch.testing.assert_close(lse, ref_lse, **LSE_TOL)
