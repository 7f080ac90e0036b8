# SPDX-License-Identifier: Apache-2.0
"""The cascade (FlashMLA over the context, our kernel over the tree; sm_90) against the
fp32 reference: bf16 and fp8 caches, DeepSeek/Kimi head counts, odd tree sizes, requests
without context, and the backend's CUDA-graph launch replayed at other lengths.

fp8: FlashMLA's fp8 path takes fp8 queries, quantized by the cascade with one dynamic
scale; the reference is computed on the same quantization of q (made here, independently)
and on the dequantized cache, and the distance to the 16-bit-q reference is reported."""

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
    gather_request_kv,
    mla_tree_verify_reference,
    request_visibility,
)

if not cascade.flashmla_dense_available(torch.device("cuda")):
    pytest.skip("the cascade needs FlashMLA's dense decode (sm_90)", allow_module_level=True)


# fp8 against fp8_query_reference, which rounds q as the cascade does but keeps fp32
# elsewhere, while FlashMLA's fp8 kernel rounds its own intermediates (the softmax weights
# enter P.V at low precision). On an H100 one element of 147,456 was 0.017 from an older
# reference (e4m3 q for the tree keys too, itself up to 0.009 off on these shapes) at an
# output of 0.12, just past OUT_TOL; a wrong scale or a lost context is 10-100x larger.
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


def fp8_query_reference(batch):
    """The cascade's fp8 result in fp32, computed independently: the dequantized cache;
    the context keys scored with q as FlashMLA's fp8 path sees it (e4m3 at one scale,
    the largest |q| of the real tokens / 448), the tree keys with the 16-bit q (the
    tree kernel's). Rows past ``query_start_loc[-1]`` (graph padding) are left out."""
    num_real = int(batch["query_start_loc"][-1])
    q = batch["q"].float()
    # the kernel's scale: the largest |q| of the real tokens whose entries are all
    # finite, divided on the CPU (CUDA divides by a scalar as a product by its inverse)
    token_max = q[:num_real].abs().amax(dim=(1, 2)).cpu()
    scale = (token_max[token_max.isfinite()].max() / 448.0).to(q.device)
    q8 = (q / scale).to(torch.float8_e4m3fn).float() * scale
    kv_rank, sm_scale = batch["kv_lora_rank"], batch["scale"]
    out = torch.zeros(num_real, q.shape[1], kv_rank, device=q.device)
    lse = torch.full((num_real, q.shape[1]), float("-inf"), device=q.device)
    qsl = batch["query_start_loc"].tolist()
    for r, seq_len in enumerate(batch["seq_lens"].tolist()):
        start, end = qsl[r], qsl[r + 1]
        if end <= start:
            continue
        kv = gather_request_kv(batch["kv_cache"], batch["block_table"][r], seq_len).float()
        kv = kv * batch["kv_scale"].float().reshape(())
        ctx_len = seq_len - (end - start)
        visible = request_visibility(batch["ancestor_bits"][start:end], end - start, seq_len)
        scores = torch.cat([
            torch.einsum("thd,sd->ths", q8[start:end], kv[:ctx_len]),
            torch.einsum("thd,sd->ths", q[start:end], kv[ctx_len:])], dim=-1) * sm_scale
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        lse[start:end] = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - lse[start:end, :, None])
        out[start:end] = torch.einsum("ths,sd->thd", probs, kv[:, :kv_rank])
    return out, lse  # fp32


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
    err = (out.float() - ref_out.float()).abs().max().item()
    print(f"H{heads} ctx {ctx} qlen {qlen}: max |out - ref(16-bit q)| {err:.3g}, "
          f"lse {(lse - ref_lse).abs().max().item():.3g}")
    q8_out, q8_lse = fp8_query_reference(batch)
    torch.testing.assert_close(out.float(), q8_out.float(), **FP8_OUT_TOL)
    torch.testing.assert_close(lse, q8_lse, **LSE_TOL)


@pytest.mark.parametrize("fp8", [False, True])
def test_cuda_graph_replays_plan_at_other_lengths(fp8):
    """The backend's launch in a CUDA graph (one plan per step, planned inside the
    capture), replayed after the contexts shrink and the query changes: FlashMLA's
    schedule and the context lengths follow, the result matches the reference."""
    batch = make_batch([(30000, "tree", 17), (2000, "chain", 17)], heads=16, page_size=64)
    if fp8:
        batch = to_fp8(batch)
    reference = fp8_query_reference if fp8 else (lambda b: mla_tree_verify_reference(**b))
    lens = {**host_lens(batch), "max_seq_len": 131072}
    launch(batch, lens=lens)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        (out, lse), plan = launch(batch, lens=lens)
    assert (plan.fp8_meta if fp8 else plan.sched_meta) is not None  # the cascade ran
    for step in range(2):
        if step == 1:
            batch["seq_lens"][0] = 5017  # its first 5000 keys stay the context
            batch["q"].mul_(-0.5)
        graph.replay()
        torch.cuda.synchronize()
        ref_out, ref_lse = reference(batch)
        torch.testing.assert_close(out.float(), ref_out.float(),
                                   **(FP8_OUT_TOL if fp8 else OUT_TOL))
        torch.testing.assert_close(lse, ref_lse, **LSE_TOL)


@pytest.mark.parametrize("rows,heads", [(257, 64), (9, 8)])
def test_query_quantization_rounds_as_torch(rows, heads):
    """The quantization kernels against torch's e4m3 conversion of the same ratio
    (round to nearest even, saturating at 448 by construction): the general path's
    (257 rows at 64 heads) and the one-launch kernel of small queries (9 at 8)."""
    assert (rows * heads * 576 <= cascade.SMALL_QUERY_NUMEL) == (rows == 9)
    q = torch.randn(rows, heads, 576, device="cuda", dtype=torch.bfloat16) * 7
    qsl = torch.tensor([0, rows], dtype=torch.int32, device="cuda")
    q8, scale = cascade.quantize_query_fp8(q, qsl)
    # On the CPU: CUDA divides a tensor by a Python scalar as a product by its reciprocal.
    assert torch.equal(scale.cpu(), (q.float().abs().max().cpu() / 448.0).reshape(1))
    ref = (q.float() / scale).to(torch.float8_e4m3fn)
    assert torch.equal(q8.view(torch.uint8), ref.view(torch.uint8))


def test_fp8_tree_keys_see_the_16_bit_query():
    """The tree keys are scored with the 16-bit q (the tree kernel's), the context with
    e4m3 q (FlashMLA's): on a short context, where the tree holds much of the mass, the
    output is closer to that reference than to one scoring every key with e4m3 q."""
    batch = to_fp8(make_batch([(40, "tree", 33), (17, "tree", 33)], heads=16,
                              page_size=64, seed=5))
    (out, _), plan = launch(batch)
    assert plan.fp8_meta is not None
    exact, _ = fp8_query_reference(batch)
    q = batch["q"].float()
    scale = q.abs().max().cpu() / 448.0
    q8 = ((q / scale.to(q.device)).to(torch.float8_e4m3fn).float() * scale.to(q.device))
    every_key_e4m3, _ = fp8_reference({**batch, "q": q8})
    to_exact = (out.float() - exact.float()).abs().mean().item()
    to_e4m3 = (out.float() - every_key_e4m3.float()).abs().mean().item()
    print(f"mean |out - ref|: e4m3 q for the context only {to_exact:.3g}, "
          f"for every key {to_e4m3:.3g}")
    assert to_exact < to_e4m3


@pytest.mark.parametrize("heads,qlen", [(16, 9), (8, 2)])
@pytest.mark.parametrize("fp8", [False, True])
def test_graph_padding_rows_do_not_reach_real_requests(fp8, heads, qlen):
    """CUDA-graph padding as vLLM replays a uniform batch: a last request with no tokens
    and no keys whose q rows (past the real tokens) hold inf / NaN, as a previous layer
    can leave them. The real rows match the reference; with an fp8 cache the shared query
    scale ignores the padding rows (a NaN or inf there would otherwise spoil every
    request's context scores). 8 heads at 2 rows: fp8 queries take the one-launch
    quantization of small queries."""
    batch = make_batch([(6000, "tree", qlen), (900, "chain", qlen)], heads=heads,
                       page_size=64)
    ref = fp8_query_reference if fp8 else (lambda b: mla_tree_verify_reference(**b))
    if fp8:
        batch = to_fp8(batch)
    ref_out, ref_lse = ref(batch)
    padded = dict(batch)
    pad = torch.full((qlen, *batch["q"].shape[1:]), float("nan"), dtype=batch["q"].dtype,
                     device="cuda")
    pad[0, 0, 0] = float("inf")
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
    small = padded["q"].numel() <= cascade.SMALL_QUERY_NUMEL
    assert small == (heads == 8)
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
