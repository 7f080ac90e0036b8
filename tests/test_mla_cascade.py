# SPDX-License-Identifier: Apache-2.0
"""The cascade's tree part (``cascade.tree_suffix``) against the fp32 reference.

FlashMLA (the cascade's context part) runs on sm_90 only (tests/gpu/test_mla_cascade_gpu.py);
here an independent PyTorch computation stands in for it: dense attention of every query
row over its request's context keys, as ``(out, lse)`` in FlashMLA's layouts. The kernel
must fold it into the new tokens' attention and give the full tree-verify result.
"""

import random

import pytest
import torch

triton = pytest.importorskip("triton")

from kernel_testing import DEVICE, TOLS, chain, random_tree, skip_unless_kernels_run_here  # noqa: E402
from test_mla_fp8_kernel import dequantized, fp8_batch  # noqa: E402
from test_mla_tree_kernel import make_batch  # noqa: E402

from vllm_ddtree.attention_backends.mla_tree import cascade, cascade_kernel  # noqa: E402
from vllm_ddtree.attention_backends.mla_tree.reference import (  # noqa: E402
    gather_request_kv,
    mla_tree_verify_reference,
)

pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    skip_unless_kernels_run_here(cascade_kernel._mla_tree_suffix_kernel),
]

QLEN = 9


def uniform_specs(contexts, seed=0):
    """Requests of ``QLEN`` new tokens each (random trees, one chain) after ``contexts``."""
    rng = random.Random(seed)
    return [(c, chain(QLEN) if i == 1 else random_tree(QLEN, rng))
            for i, c in enumerate(contexts)]


def context_partial(batch):
    """FlashMLA's part, independently: each row's softmax over its request's context
    keys only. Returns ``out [T, H, L]`` (fp32) and ``lse [R, H, QLEN]`` (FlashMLA's
    layout); a request without context gets NaN rows and +inf (what must not be read)."""
    q = batch["q"].float()
    if batch.get("q_scale") is not None:  # vLLM's e4m3 query, as FlashMLA takes it
        q = q * batch["q_scale"]
    kv_scale = batch.get("kv_scale")
    num_reqs = batch["seq_lens"].shape[0]
    lora = batch["kv_lora_rank"]
    out = torch.full((q.shape[0], q.shape[1], lora), float("nan"), device=q.device)
    lse = torch.full((num_reqs, q.shape[1], QLEN), float("inf"), device=q.device)
    for r in range(num_reqs):
        ctx = int(batch["seq_lens"][r]) - QLEN
        if ctx == 0:
            continue
        kv = gather_request_kv(batch["kv_cache"], batch["block_table"][r], ctx).float()
        if kv_scale is not None:
            kv = kv * kv_scale
        rows = slice(r * QLEN, (r + 1) * QLEN)
        scores = torch.einsum("thd,sd->ths", q[rows], kv) * batch["scale"]
        row_lse = torch.logsumexp(scores, -1)
        out[rows] = torch.einsum("ths,sd->thd", torch.exp(scores - row_lse[..., None]),
                                 kv[:, :lora])
        lse[r] = row_lse.transpose(0, 1)
    return out, lse


def run_suffix(batch, ctx_out, ctx_lse, alias=False):
    q = batch["q"]
    out = ctx_out if alias else torch.empty(*q.shape[:2], batch["kv_lora_rank"],
                                             dtype=ctx_out.dtype, device=q.device)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    cascade.tree_suffix(
        q, batch["kv_cache"], batch["block_table"], batch["seq_lens"],
        batch["query_start_loc"], batch["ancestor_bits"], batch["scale"],
        batch["kv_lora_rank"], ctx_out, ctx_lse, out, lse, QLEN, batch.get("kv_scale"),
        batch.get("q_scale"))
    return out, lse


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [4, 16])
def test_suffix_folds_context_into_tree_attention(dtype, page_size):
    """Contexts 0 (nothing to fold: NaN partial ignored), shorter and longer than a
    tile, and not tile-aligned; the context partial's out in q's dtype and aliased to
    the output buffer, as on the bf16 path."""
    batch = make_batch(uniform_specs([37, 0, 70, 5]), page_size=page_size, dtype=dtype)
    ctx_out, ctx_lse = context_partial(batch)
    out, lse = run_suffix(batch, ctx_out.to(dtype), ctx_lse, alias=True)
    ref_out, ref_lse = mla_tree_verify_reference(**batch)
    torch.testing.assert_close(out.float(), ref_out.float(), **TOLS[dtype])
    torch.testing.assert_close(lse, ref_lse, **TOLS[dtype])


def test_suffix_without_context_partial_is_wrong():
    """The premise: folding matters; a zero-weight context (lse -inf) gives the
    tree-only attention, far from the reference."""
    batch = make_batch(uniform_specs([37, 20]), page_size=4)
    ctx_out, ctx_lse = context_partial(batch)
    out, _ = run_suffix(batch, ctx_out, torch.full_like(ctx_lse, float("-inf")))
    ref_out, _ = mla_tree_verify_reference(**batch)
    assert (out - ref_out).abs().max() > 0.05


def test_suffix_on_fp8_cache():
    """An fp8 cache (vLLM's layout, one scale) and vLLM's e4m3 query: the tree keys
    widened as in the main kernel and scored with the same e4m3 query as the context,
    against the reference on the dequantized cache and query."""
    batch = fp8_batch(uniform_specs([37, 64, 3]), page_size=16)
    ctx_out, ctx_lse = context_partial(batch)
    out, lse = run_suffix(batch, ctx_out.to(torch.bfloat16), ctx_lse)
    ref_out, ref_lse = mla_tree_verify_reference(**dequantized(batch))
    torch.testing.assert_close(out.float(), ref_out.float(), **TOLS[torch.bfloat16])
    torch.testing.assert_close(lse, ref_lse, **TOLS[torch.bfloat16])


SHIPPED_SUFFIX_TILES = sorted({(fp8, cascade.suffix_config(rows, fp8))
                               for fp8 in (False, True) for rows in (16, 40, 2056, 8224)},
                              key=str)


@pytest.mark.parametrize(("fp8", "config"), SHIPPED_SUFFIX_TILES, ids=str)
def test_every_shipped_suffix_tile_against_the_reference(fp8, config, monkeypatch):
    """Each tile ``suffix_config`` ships for sm_90 (the CPU path picks ``select_config``'s
    otherwise), forced here: row tiles that split the heads' rows mid-request, key tiles
    past the tree's keys (the interpreter ignores warps and stages)."""
    chosen = []
    monkeypatch.setattr(cascade, "select_config",
                        lambda *args, **kwargs: chosen.append(config) or config)
    specs = uniform_specs([37, 0, 70])
    batch = fp8_batch(specs, page_size=16) if fp8 else make_batch(specs, page_size=16,
                                                                  dtype=torch.bfloat16)
    ctx_out, ctx_lse = context_partial(batch)
    out, lse = run_suffix(batch, ctx_out.to(torch.bfloat16), ctx_lse)
    ref_out, ref_lse = mla_tree_verify_reference(**(dequantized(batch) if fp8 else batch))
    assert chosen == [config]
    torch.testing.assert_close(out.float(), ref_out.float(), **TOLS[torch.bfloat16])
    torch.testing.assert_close(lse, ref_lse, **TOLS[torch.bfloat16])


def test_context_lens():
    seq_lens = torch.tensor([40, 9, 0], dtype=torch.int32)
    qsl = torch.tensor([0, 9, 18, 27], dtype=torch.int32)
    lens = cascade.context_lens(seq_lens, qsl)
    assert lens.dtype == torch.int32 and lens.tolist() == [31, 1, 1]


def test_suffix_equals_the_triton_kernel_on_fp8():
    """The cascade's tree part and the Triton kernel score the keys with the same e4m3
    query: fed the context partial of that query, the cascade's softmax denominators
    are the Triton kernel's up to summation order (1e-5 in fp32; the outputs differ by
    the kernel's fp16 probabilities). Plain decoding and a tree verify may
    take different kernels for the same token's keys; a 16-bit query for the tree keys
    (the cascade's former rule) moved its scores by e4m3's rounding of the query."""
    from vllm_ddtree.attention_backends.mla_tree import mla_tree_verify

    batch = fp8_batch(uniform_specs([37, 64, 3]), page_size=16, out_dtype=torch.float32)
    ctx_out, ctx_lse = context_partial(batch)
    out, lse = run_suffix(batch, ctx_out, ctx_lse)
    triton_out, triton_lse = mla_tree_verify(**batch, kernel="triton", num_kv_splits=1)
    torch.testing.assert_close(lse, triton_lse, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, triton_out, **TOLS[torch.float16])  # P in fp16


def test_cascade_supported_shapes(monkeypatch):
    """Where FlashMLA runs (stubbed here), the launch shapes it takes: q of ``R * qlen``
    rows, bf16 with a bf16 cache or e4m3 with an fp8 one, 64-token pages, kv_lora_rank
    512 + rope 64; and never without FlashMLA."""
    q = torch.zeros(18, 8, 576, dtype=torch.bfloat16, device=DEVICE)
    kv = torch.zeros(4, 64, 576, dtype=torch.bfloat16, device=DEVICE)
    on_hopper = DEVICE == "cuda" and torch.cuda.get_device_capability()[0] == 9
    assert cascade.cascade_supported(q, kv, 512, 2, 9) == (
        on_hopper and cascade.flashmla_dense_available(q.device))
    monkeypatch.setattr(cascade, "flashmla_dense_available", lambda device: True)
    assert cascade.cascade_supported(q, kv, 512, num_reqs=2, max_query_len=9)
    fp8 = torch.float8_e4m3fn
    assert cascade.cascade_supported(q.to(fp8), kv.to(fp8), 512, 2, 9)
    assert not cascade.cascade_supported(q, kv.to(fp8), 512, 2, 9)
    assert not cascade.cascade_supported(q.to(fp8), kv, 512, 2, 9)
    # Not with unequal query lengths, another page size, kv_lora_rank, q dtype or layout.
    assert not cascade.cascade_supported(q, kv, 512, num_reqs=3, max_query_len=9)
    assert not cascade.cascade_supported(q, kv, 512, num_reqs=2, max_query_len=None)
    assert not cascade.cascade_supported(q, kv[:, :16], 512, num_reqs=2, max_query_len=9)
    assert not cascade.cascade_supported(q, kv, 256, num_reqs=2, max_query_len=9)
    assert not cascade.cascade_supported(q.half(), kv.half(), 512, 2, 9)
    assert not cascade.cascade_supported(q.transpose(0, 1).contiguous().transpose(0, 1),
                                         kv, 512, 2, 9)


@pytest.fixture
def cascade_entry(monkeypatch):
    """sm_90 with a table entry "cascade" for 2 heads, 9 rows, 8k; FlashMLA's context part
    replaced by :func:`context_partial`; records the cascade's launches."""
    from vllm_ddtree.attention_backends.mla_tree import dispatch, gluon_kernel, ops

    record = dict(cascade=0, gluon=0)

    def fake_context(q, kv_cache, block_table, scale, query_len, plan, kv_scale, q_scale):
        record["cascade"] += 1
        assert plan.ctx_lens.tolist() == [max(1, s - query_len) for s in record["seq_lens"]]
        return context_partial(record["batch"])

    def fake_gluon(q, *args, **kwargs):
        record["gluon"] += 1
        return torch.zeros(q.shape[:2] + (args[6],)), torch.zeros(q.shape[:2])

    monkeypatch.setattr(dispatch, "TABLE", {"sm_90": {"bf16": {(2, 9, 8192): "cascade"}}})
    monkeypatch.setattr(dispatch, "device_arch", lambda device: "sm_90")
    monkeypatch.setattr(cascade, "cascade_supported", lambda *args: True)
    monkeypatch.setattr(cascade, "flashmla_context", fake_context)
    monkeypatch.setattr(gluon_kernel, "gluon_supported", lambda q, kv, rank: True)
    monkeypatch.setattr(ops, "_launch_gluon", fake_gluon)
    monkeypatch.delenv("VLLM_DDTREE_MLA_KERNEL", raising=False)
    return record


def test_dispatch_takes_the_cascade_only_with_a_plan(cascade_entry):
    """A "cascade" entry runs it when the caller passes a plan (uniform query lengths)
    and matches the reference; without a plan, or with mostly inactive rows, the rule
    (Gluon) runs instead."""
    from vllm_ddtree.attention_backends.mla_tree import mla_tree_verify

    batch = make_batch(uniform_specs([37, 12]), page_size=4)
    cascade_entry.update(batch=batch, seq_lens=batch["seq_lens"].tolist())
    lens = dict(max_query_len=QLEN, max_seq_len=8000, validate_values=False)
    out, lse = mla_tree_verify(**batch, **lens, cascade_plan=cascade.CascadePlan())
    assert cascade_entry == {**cascade_entry, "cascade": 1, "gluon": 0}
    ref_out, ref_lse = mla_tree_verify_reference(**batch)
    torch.testing.assert_close(out, ref_out, **TOLS[torch.float32])
    torch.testing.assert_close(lse, ref_lse, **TOLS[torch.float32])
    mla_tree_verify(**batch, **lens)
    assert cascade_entry["cascade"] == 1 and cascade_entry["gluon"] == 1
    active = torch.full_like(batch["seq_lens"], 2)
    mla_tree_verify(**batch, **lens, cascade_plan=cascade.CascadePlan(),
                    active_query_lens=active)
    assert cascade_entry["cascade"] == 1


def test_env_cascade_forces_it_without_an_entry(cascade_entry, monkeypatch):
    """``VLLM_DDTREE_MLA_KERNEL=cascade`` takes the cascade at a launch the table does not
    list (4 heads), and the rule where it cannot run (no plan)."""
    from vllm_ddtree.attention_backends.mla_tree import mla_tree_verify

    monkeypatch.setenv("VLLM_DDTREE_MLA_KERNEL", "cascade")
    batch = make_batch(uniform_specs([20, 3]), page_size=4, heads=4)
    cascade_entry.update(batch=batch, seq_lens=batch["seq_lens"].tolist())
    lens = dict(max_query_len=QLEN, max_seq_len=100, validate_values=False)
    out, _ = mla_tree_verify(**batch, **lens, cascade_plan=cascade.CascadePlan())
    assert cascade_entry["cascade"] == 1
    torch.testing.assert_close(out, mla_tree_verify_reference(**batch)[0], **TOLS[torch.float32])
    mla_tree_verify(**batch, **lens)
    assert cascade_entry["cascade"] == 1 and cascade_entry["gluon"] == 1


_SUFFIX_SPILLS_SCRIPT = """
import json, sys
sys.path.insert(0, "evals")
from kernel_spills import launch_signature, ptxas_report, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from vllm_ddtree.attention_backends.mla_tree import cascade, cascade_kernel

fn = cascade_kernel._mla_tree_suffix_kernel
out = []
for fp8 in (False, True):
    for rows in (16, 40, 2056, 4096, 8224):
        cfg = cascade.suffix_config(rows, fp8)
        consts = dict(NUM_HEADS=8, KV_LORA=512, ROPE=64, BLOCK_L=512, BLOCK_R=64,
                      PAGE_SIZE=64, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                      DOT_PRECISION="tf32", DOT_UPCAST=False, KV_FP8=fp8)
        elem = "*fp8e4nv" if fp8 else "*bf16"  # an fp8 cache takes vLLM's e4m3 query
        ptrs = {"Q": elem, "KV": elem, "BlockTable": "*i32",
                "SeqLens": "*i32", "QueryStartLoc": "*i32", "AncestorBits": "*i64",
                "Out": "*bf16", "Lse": "*fp32", "CtxOut": "*bf16", "CtxLse": "*fp32",
                "KVScale": "*fp32", "QScale": "*fp32"}
        sig, attrs = launch_signature(fn, consts, ptrs, ("stride_qt", "stride_qh", "stride_kvb",
                                                         "stride_kvp", "stride_ot", "stride_cot"))
        k = triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs),
                           target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
        report = ptxas_report(k.asm["ptx"], 90)
        out.append([report["spill_stores"] + report["spill_loads"], k.metadata.shared])
print(json.dumps(out))
"""


def test_suffix_tiles_do_not_spill_on_sm90():
    """The tree part's tiles (``cascade.suffix_config``) compiled for sm_90a offline
    (Triton's ptxas, no GPU): no register spills, shared memory within Hopper's 227 KB.
    The tiles ``select_config`` gives the main kernel spilled here (up to 1 KB a thread
    with an fp8 cache)."""
    from kernel_testing import compiled_shared_memory

    results = compiled_shared_memory(_SUFFIX_SPILLS_SCRIPT)
    assert len(results) == 10
    for spilled, shared in results:
        assert spilled == 0 and shared <= 227 * 1024, (spilled, shared)
