# SPDX-License-Identifier: Apache-2.0
"""The Gluon sm_90 MLA tree-verify kernel (``ops.mla_tree_fwd_gluon``, the warp-specialized
``gluon_kernel``) against the fp32 reference and the Triton kernel, and the ``auto``
dispatch of ``mla_tree_verify`` to it, on a Hopper GPU (bf16, kv_lora 512 + rope 64)."""

import os

import pytest
import torch

if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
    pytest.skip("needs a Hopper (sm_90) GPU", allow_module_level=True)
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("TRITON_INTERPRET=1: run tests/gpu in its own process", allow_module_level=True)

from test_mla_tree_kernel_gpu import (  # noqa: E402
    LSE_TOL,
    OUT_TOL,
    check_graph_replay,
    check_runtime_splits_graph,
    make_batch,
)

from vllm_ddtree.attention_backends.mla_tree import (  # noqa: E402
    mla_tree_verify,
    mla_tree_verify_reference,
)
from vllm_ddtree.attention_backends.mla_tree.gluon_kernel import gluon_supported  # noqa: E402
from vllm_ddtree.attention_backends.mla_tree.ops import mla_tree_fwd_gluon  # noqa: E402

MAX_ABS_ERR = 2e-2
# Same splits, both fp32 accumulation: only bf16 rounding of P and of the output apart.
TRITON_TOL = dict(atol=8e-3, rtol=1.6e-2)


def check(batch, **kwargs):
    """Gluon vs the fp32 reference (max abs err and OUT_TOL) and vs Triton."""
    assert gluon_supported(batch["q"], batch["kv_cache"], batch["kv_lora_rank"])
    out, lse = mla_tree_fwd_gluon(**batch, **kwargs)
    ref_out, ref_lse = mla_tree_verify_reference(**batch)
    err = (out.float() - ref_out.float()).abs().max().item()
    assert err <= MAX_ABS_ERR, err
    torch.testing.assert_close(out.float(), ref_out.float(), **OUT_TOL)
    torch.testing.assert_close(lse, ref_lse, **LSE_TOL)
    tri_out, tri_lse = mla_tree_verify(**batch, **kwargs, kernel="triton")
    torch.testing.assert_close(out.float(), tri_out.float(), **TRITON_TOL)
    torch.testing.assert_close(lse, tri_lse, atol=1e-3, rtol=1e-4)
    return out, lse


@pytest.mark.parametrize("page_size", [64, 16, 1])
@pytest.mark.parametrize(
    "heads,ctx,qlen,kind",
    [
        (8, 1000, 1, "decode"),
        (8, 4133, 16, "chain"),
        (8, 8191, 65, "tree"),
        (128, 2047, 1, "decode"),
        (128, 3001, 16, "tree"),
        (8, 0, 65, "tree"),
        (128, 0, 9, "chain"),
    ],
)
def test_shapes(page_size, heads, ctx, qlen, kind):
    specs = [(ctx, kind, qlen), (ctx // 3 + 5, kind, qlen)]
    check(make_batch(specs, heads=heads, page_size=page_size, seed=ctx + qlen))


@pytest.mark.parametrize("page_size", [64, 16, 1])
@pytest.mark.parametrize("heads", [8, 128])
def test_mixed_batch(page_size, heads):
    specs = [
        (5000, "decode", 1),
        (0, "chain", 7),
        (1200, "tree", 65),
        (31, "tree", 16),
        (20000, "chain", 16),
        (3, "decode", 1),
        (64, "tree", 64),
    ]
    check(make_batch(specs, heads=heads, page_size=page_size, seed=page_size + heads))


@pytest.mark.parametrize("num_kv_splits", [1, 2, 3, 8, 32])
def test_forced_splits(num_kv_splits):
    batch = make_batch([(9000, "tree", 65), (100, "decode", 1), (0, "chain", 3)], heads=8,
                       page_size=64)
    check(batch, num_kv_splits=num_kv_splits)


def test_long_context():
    batch = make_batch([(131072 - 65, "tree", 65)], heads=8, page_size=64, seed=7)
    check(batch)


def test_fp16():
    batch = make_batch([(3000, "tree", 16)], heads=16, page_size=64, dtype=torch.float16)
    check(batch)


def test_cuda_graph_capture():
    check_graph_replay(mla_tree_fwd_gluon)


def test_cuda_graph_runtime_splits():
    check_runtime_splits_graph(mla_tree_fwd_gluon)


def test_unsupported_launches_fall_back():
    batch = make_batch([(100, "tree", 8)], heads=8, page_size=64)
    q, kv = batch["q"], batch["kv_cache"]
    assert not gluon_supported(q.float(), kv.float(), 512)
    assert not gluon_supported(q, kv, 448)
    with pytest.raises(ValueError):
        mla_tree_fwd_gluon(**{**batch, "q": q[..., :512].contiguous(),
                              "kv_cache": kv[..., :512].contiguous(), "kv_lora_rank": 448})


def test_auto_dispatch(monkeypatch):
    """``kernel="auto"`` runs the Gluon kernel (bitwise its output) unless
    ``VLLM_DDTREE_MLA_KERNEL=triton``; with active rows and ``mostly_active`` the Gluon
    kernel runs every row (its output without them); otherwise the Triton kernel runs and
    zeroes the inactive rows."""
    monkeypatch.delenv("VLLM_DDTREE_MLA_KERNEL", raising=False)
    batch = make_batch([(3000, "tree", 16), (700, "chain", 9)], heads=8, page_size=64)
    gluon_out, gluon_lse = mla_tree_fwd_gluon(**batch)
    auto_out, auto_lse = mla_tree_verify(**batch)
    assert torch.equal(auto_out, gluon_out) and torch.equal(auto_lse, gluon_lse)
    triton_out, _ = mla_tree_verify(**batch, kernel="triton")
    monkeypatch.setenv("VLLM_DDTREE_MLA_KERNEL", "triton")
    assert torch.equal(mla_tree_verify(**batch)[0], triton_out)
    monkeypatch.delenv("VLLM_DDTREE_MLA_KERNEL")
    active = torch.tensor([5, 9], dtype=torch.int32, device="cuda")
    out, lse = mla_tree_verify(**batch, active_query_lens=active, mostly_active=True)
    assert torch.equal(out, gluon_out) and torch.equal(lse, gluon_lse)
    out, lse = mla_tree_verify(**batch, active_query_lens=active)
    assert bool((out[5:16] == 0).all()) and bool(torch.isneginf(lse[5:16]).all())
    torch.testing.assert_close(out[:5].float(), triton_out[:5].float(), **TRITON_TOL)
