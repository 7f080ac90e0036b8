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
                                             dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    cascade.tree_suffix(
        q, batch["kv_cache"], batch["block_table"], batch["seq_lens"],
        batch["query_start_loc"], batch["ancestor_bits"], batch["scale"],
        batch["kv_lora_rank"], ctx_out, ctx_lse, out, lse, QLEN, batch.get("kv_scale"))
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
    """An fp8 cache (vLLM's layout, one scale): the tree keys widened as in the main
    kernel, against the reference on the dequantized cache."""
    batch = fp8_batch(uniform_specs([37, 64, 3]), page_size=16)
    ctx_out, ctx_lse = context_partial(batch)
    out, lse = run_suffix(batch, ctx_out.to(torch.bfloat16), ctx_lse)
    ref_out, ref_lse = mla_tree_verify_reference(**dequantized(batch))
    torch.testing.assert_close(out.float(), ref_out.float(), **TOLS[torch.bfloat16])
    torch.testing.assert_close(lse, ref_lse, **TOLS[torch.bfloat16])


def test_context_lens_and_query_quantization():
    seq_lens = torch.tensor([40, 9, 0], dtype=torch.int32)
    qsl = torch.tensor([0, 9, 18, 27], dtype=torch.int32)
    lens = cascade.context_lens(seq_lens, qsl)
    assert lens.dtype == torch.int32 and lens.tolist() == [31, 1, 1]
    q = torch.randn(5, 3, 576, dtype=torch.bfloat16) * 7
    q8, scale = cascade.quantize_query_fp8(q, torch.tensor([0, 5], dtype=torch.int32))
    assert q8.dtype == torch.float8_e4m3fn and scale.shape == (1,)
    assert q8.float().abs().max() == 448.0
    # e4m3 keeps 3 mantissa bits: relative error at most 2^-4 above its normal range.
    back = q8.float() * scale
    big = q.float().abs() > scale * 2**-6
    assert ((back - q.float()).abs()[big] <= q.float().abs()[big] * 2**-4 + 1e-6).all()


def query_scale_case():
    """Two requests of 3 tokens and a CUDA-graph padding request: 9 rows, the last 3
    (padding) holding a huge value, inf and NaN."""
    q = torch.randn(9, 2, 576, dtype=torch.bfloat16)
    q[6, 0, 9], q[7, 0, 0], q[8, 1, 5] = 1e30, float("inf"), float("nan")
    q[4, 1, 3] = -13.0  # the real maximum
    return q, torch.tensor([0, 3, 6, 6], dtype=torch.int32)


def test_query_scale_ignores_padding_rows():
    """One scale for the batch from its real tokens only: padding rows (past the last
    request's tokens) may hold anything after a graph replay; a NaN or inf there must
    not reach the real requests' scale (the CUDA kernel below computes the same)."""
    q, qsl = query_scale_case()
    want = (torch.tensor([13.0]) / 448.0).tolist()  # in fp32
    assert cascade.query_scale(q, qsl).tolist() == want
    q[2, 0, 0] = float("nan")  # a real row's NaN is ignored too: its own output is NaN
    assert cascade.query_scale(q, qsl).tolist() == want


def test_query_scale_kernel():
    """``cascade_kernel._query_scale_kernel`` (the CUDA path of ``query_scale``) in the
    interpreter: the same scale, bit for bit, with padding rows of inf / NaN / 1e30."""
    q, qsl = query_scale_case()
    token_amax = torch.linalg.vector_norm(q.reshape(9, -1), ord=float("inf"), dim=1)
    scale = torch.empty(1)
    cascade_kernel._query_scale_kernel[(1,)](token_amax, qsl, 3, 9, scale, E4M3_MAX=448.0,
                                             BLOCK=4)
    want = (torch.tensor([13.0]) / 448.0).tolist()  # in fp32
    assert scale.tolist() == want == cascade.query_scale(q, qsl).tolist()


@pytest.mark.parametrize("block", [4096, 512])
def test_small_query_kernel(block):
    """``cascade_kernel._quantize_query_small_kernel`` (one launch for small queries) in
    the interpreter, with an fp32 output: every program's scale is the general path's,
    bit for bit, with padding rows of inf / NaN / 1e30 and a real token holding a NaN
    (left out whole, as ``torch.linalg.vector_norm``'s per-token max leaves it); its
    quotients are torch's (the e4m3 cast itself is checked on the GPU). ``block`` 512:
    tokens of 1,152 entries span three blocks, and the grid has 21 programs."""
    q, qsl = query_scale_case()
    q[2, 1, 7] = float("nan")
    q[2, 0, 0] = 20.0  # in the NaN token: not the maximum
    want = cascade.query_scale(q, qsl)
    assert want.tolist() == (torch.tensor([13.0]) / 448.0).tolist()
    scale, out = torch.empty(1), torch.empty(q.shape)
    grid = (triton.cdiv(q.numel(), block),)
    cascade_kernel._quantize_query_small_kernel[grid](
        q, qsl, 3, 9, q[0].numel(), q.numel(), scale, out, E4M3_MAX=448.0, BLOCK=block)
    assert torch.equal(scale, want)
    # query_start_loc past the rows (a corrupt plan) reads no row beyond them
    beyond = torch.tensor([0, 3, 6, 50], dtype=torch.int32)
    q[6:] = 0.5
    cascade_kernel._quantize_query_small_kernel[grid](
        q, beyond, 3, 9, q[0].numel(), q.numel(), scale, out, E4M3_MAX=448.0, BLOCK=block)
    assert torch.equal(scale, want)
    real = slice(0, 6)
    torch.testing.assert_close(out[real], q[real].float() / want, rtol=0, atol=0,
                               equal_nan=True)


QUANTIZE_KERNELS = ("_quantize_query_small_kernel", "_query_scale_kernel",
                    "_quantize_e4m3_kernel")


class LaunchRecorder:
    """Stands in for a Triton kernel: ``kernel[grid](...)`` records its name."""

    def __init__(self, name: str, calls: list[str]):
        self.name, self.calls = name, calls

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append(self.name)


@pytest.mark.parametrize("rows", [14, 15])
def test_small_queries_take_one_launch(rows, monkeypatch):
    """``quantize_query_fp8`` on CUDA launches the one-launch kernel up to
    ``SMALL_QUERY_NUMEL`` entries (8 heads: 14 rows) and the general path's two kernels
    above (meta tensors taken for CUDA ones; launches recorded, not run)."""
    calls: list[str] = []
    for name in QUANTIZE_KERNELS:
        monkeypatch.setattr(cascade_kernel, name, LaunchRecorder(name, calls))
    meta = torch.device("meta")
    q = torch.empty(rows, 8, 576, dtype=torch.bfloat16, device=meta)
    qsl = torch.tensor([0, rows], dtype=torch.int32).to(meta)
    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
        q8, scale = cascade.quantize_query_fp8(q, qsl)
    assert q8.shape == q.shape and q8.dtype == torch.float8_e4m3fn and scale.shape == (1,)
    small = rows == 14
    assert (q.numel() <= cascade.SMALL_QUERY_NUMEL) == small
    assert calls == (["_quantize_query_small_kernel"] if small
                     else ["_query_scale_kernel", "_quantize_e4m3_kernel"])


def test_cascade_supported_shapes(monkeypatch):
    """Where FlashMLA runs (stubbed here), the launch shapes it takes: bf16 q of
    ``R * qlen`` rows, a bf16 or fp8 cache of 64-token pages, kv_lora_rank 512 + rope 64;
    and never without FlashMLA."""
    q = torch.zeros(18, 8, 576, dtype=torch.bfloat16, device=DEVICE)
    kv = torch.zeros(4, 64, 576, dtype=torch.bfloat16, device=DEVICE)
    on_hopper = DEVICE == "cuda" and torch.cuda.get_device_capability()[0] == 9
    assert cascade.cascade_supported(q, kv, 512, 2, 9) == (
        on_hopper and cascade.flashmla_dense_available(q.device))
    monkeypatch.setattr(cascade, "flashmla_dense_available", lambda device: True)
    assert cascade.cascade_supported(q, kv, 512, num_reqs=2, max_query_len=9)
    assert cascade.cascade_supported(q, kv.to(torch.float8_e4m3fn), 512, 2, 9)
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

    def fake_context(q, kv_cache, block_table, query_start_loc, scale, query_len, plan,
                     kv_scale):
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
    monkeypatch.setattr(ops, "mla_tree_fwd_gluon", fake_gluon)
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


def test_quantize_kernel_quotients():
    """The fused quantization kernel (CUDA path of ``quantize_query_fp8``) with an fp32
    output: its quotients are torch's, bit for bit (the e4m3 cast itself is checked on the
    GPU: the interpreter rounds it wrongly)."""
    q = torch.randn(5, 3, 576, dtype=torch.bfloat16) * 7
    scale = torch.tensor([0.0517])
    out = torch.empty(q.shape)
    cascade_kernel._quantize_e4m3_kernel[(3,)](q, scale, out, q.numel(), BLOCK=4096)
    assert torch.equal(out, q.float() / scale)


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
    for rows in (16, 40, 72, 8224):
        cfg = cascade.suffix_config(rows, fp8)
        consts = dict(NUM_HEADS=8, KV_LORA=512, ROPE=64, BLOCK_L=512, BLOCK_R=64,
                      PAGE_SIZE=64, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                      DOT_PRECISION="tf32", DOT_UPCAST=False, KV_FP8=fp8)
        ptrs = {"Q": "*bf16", "KV": "*fp8e4nv" if fp8 else "*bf16", "BlockTable": "*i32",
                "SeqLens": "*i32", "QueryStartLoc": "*i32", "AncestorBits": "*i64",
                "Out": "*bf16", "Lse": "*fp32", "CtxOut": "*bf16", "CtxLse": "*fp32",
                "KVScale": "*fp32"}
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
    assert len(results) == 8
    for spilled, shared in results:
        assert spilled == 0 and shared <= 227 * 1024, (spilled, shared)
