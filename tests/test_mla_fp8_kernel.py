# SPDX-License-Identifier: Apache-2.0
"""MLA tree-verify kernel on an fp8 (e4m3) latent cache, vLLM's ``--kv-cache-dtype fp8``
layout: rows ``x / k_scale`` in ``[num_blocks, page_size, kv_lora_rank + rope]``, one fp32
scale per layer. Checked against the fp32 reference on the dequantized cache (``kv_scale
* row``), which is independent of the kernel's folding of the scale into the softmax
scale and the output.

Without a GPU the kernel runs in Triton's interpreter (tests/conftest.py); small shapes.
"""

import random
import textwrap

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from kernel_testing import (  # noqa: E402
    DEVICE,
    TOLS,
    chain,
    compiled_shared_memory,
    random_tree,
    skip_unless_kernels_run_here,
)
from mla_testing import MLA_COMPILE_PRELUDE  # noqa: E402
from test_mla_tree_kernel import MIXED, make_batch  # noqa: E402

from vllm_ddtree.attention_backends.mla_tree import (  # noqa: E402
    kernels,
    mla_tree_verify,
    mla_tree_verify_reference,
)

pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    skip_unless_kernels_run_here(kernels._mla_tree_fwd_kernel),
]

FP8 = torch.float8_e4m3fn


def fp8_batch(specs, *, scale_value=0.05, dtype=torch.bfloat16, **kwargs):
    """``make_batch`` with its cache quantized as vLLM's ``concat_and_cache_mla`` does
    (``fp8(x / k_scale)``), the scale as a one-element fp32 device tensor."""
    batch = make_batch(specs, dtype=torch.float32, **kwargs)
    kv_scale = torch.tensor([scale_value], dtype=torch.float32, device=DEVICE)
    cache = batch["kv_cache"] * 3.0  # values spread over e4m3's range after / scale
    # Saturating, as vLLM's CUDA conversion (__NV_SATFINITE); torch's gives NaN instead.
    batch["kv_cache"] = (cache / kv_scale).clamp(-448, 448).to(FP8)
    batch["q"] = batch["q"].to(dtype)
    batch["kv_scale"] = kv_scale
    return batch


def dequantized(batch):
    """The same batch with the cache dequantized to fp32 (``kv_scale * row``)."""
    kv = batch["kv_cache"].float() * batch["kv_scale"]
    return {**batch, "kv_cache": kv, "q": batch["q"].float(), "kv_scale": None}


def check(batch, **kwargs):
    out, lse = mla_tree_verify(**batch, **kwargs)
    ref_out, ref_lse = mla_tree_verify_reference(**dequantized(batch))
    tol = TOLS[batch["q"].dtype]
    torch.testing.assert_close(out.float(), ref_out.float(), **tol)
    torch.testing.assert_close(lse, ref_lse, **tol)
    return out, lse


def test_fixture_cache_uses_e4m3_range():
    """The premise: the quantized rows are not all tiny (the scale matters) and the
    reference's dequantization differs from ignoring the scale."""
    batch = fp8_batch(MIXED[:2], page_size=4)
    raw = batch["kv_cache"].float()
    assert raw.abs().max() > 100 and raw.abs().max() <= 448
    ref, _ = mla_tree_verify_reference(**dequantized(batch))
    unscaled, _ = mla_tree_verify_reference(**{**dequantized(batch), "kv_cache": raw})
    assert not torch.allclose(ref, unscaled, atol=1e-2)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_mixed_batch_bf16_queries(page_size):
    batch = fp8_batch(MIXED, page_size=page_size, seed=page_size)
    check(batch, num_kv_splits=1)
    check(batch)  # automatic split count


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fp32_and_fp16_queries(dtype):
    batch = fp8_batch(MIXED[:3], dtype=dtype, page_size=4, heads=3)
    check(batch, num_kv_splits=2)


@pytest.mark.parametrize("seed", range(2))
def test_random_trees_and_splits(seed):
    rng = random.Random(seed)
    specs = [(rng.randrange(0, 71), random_tree(rng.randrange(1, 12), rng)) for _ in range(3)]
    batch = fp8_batch(specs, heads=rng.choice([2, 4]), page_size=rng.choice([1, 4, 16]),
                      seed=seed, scale_value=rng.choice([0.02, 1.0]))
    check(batch, num_kv_splits=rng.choice([1, 3]))


def test_no_rope_and_odd_dims():
    check(fp8_batch(MIXED[:3], kv_lora=48, rope=8, page_size=4), num_kv_splits=2)
    check(fp8_batch(MIXED[:2], kv_lora=32, rope=0, page_size=4))


def test_active_rows_and_runtime_splits():
    """The adaptive budget's active rows (re-split) and the CUDA-graph launch (grid
    sized for a longer context, split count chosen per request) on the fp8 cache."""
    specs = [(60, random_tree(9, random.Random(3))), (20, chain(9))]
    batch = fp8_batch(specs, page_size=4, seed=5)
    active = torch.tensor([4, 1], dtype=torch.int32, device=DEVICE)
    out, lse = mla_tree_verify(**batch, active_query_lens=active, kernel="triton")
    ref_out, ref_lse = mla_tree_verify_reference(**dequantized(batch),
                                                 active_query_lens=active)
    rows = torch.tensor([0, 1, 2, 3, 9])
    tol = TOLS[torch.bfloat16]
    torch.testing.assert_close(out[rows].float(), ref_out[rows].float(), **tol)
    torch.testing.assert_close(lse[rows], ref_lse[rows], **tol)
    out, lse = mla_tree_verify(**batch, validate_values=False, max_query_len=9,
                               max_seq_len=4096, num_kv_splits=8, runtime_kv_splits=True)
    full_out, full_lse = mla_tree_verify_reference(**dequantized(batch))
    torch.testing.assert_close(out.float(), full_out.float(), **tol)
    torch.testing.assert_close(lse, full_lse, **tol)


def test_scale_is_read_on_the_device():
    """A CUDA graph replays the launch: the scale must come from the tensor at run
    time, not be baked in at launch (calc_kv_scales may update it)."""
    batch = fp8_batch(MIXED[:2], page_size=4)
    first, _ = mla_tree_verify(**batch)
    batch["kv_scale"].mul_(2.0)
    second, _ = check(batch)
    assert not torch.allclose(first.float(), second.float(), atol=1e-2)


@pytest.mark.parametrize("magnitude", [3e5, 1e-6, 1e20, 1e-20])
def test_query_magnitudes_outside_fp16(magnitude):
    """The kernel multiplies in fp16, whose range a bf16 q may leave (above 65504, or
    below its subnormals): q at ``magnitude`` times its usual size, the softmax scale
    divided by it (the same well-conditioned attention), matches the fp32 reference."""
    batch = fp8_batch(MIXED[:4], page_size=4, seed=7)
    batch["q"] = (batch["q"].float() * magnitude).to(torch.bfloat16)
    batch["scale"] = batch["scale"] / magnitude
    check(batch, num_kv_splits=2)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy on inf / NaN
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_non_finite_query_stays_in_its_row(bad):
    """One q entry inf / NaN: every other row of its tile (the same request, the same
    CTA) still matches the reference; only the bad row's result is undefined."""
    batch = fp8_batch(MIXED[2:4], page_size=4, heads=2, seed=11)
    token, head = 3, 1  # request 0 (9 tokens x 2 heads: one 16- or 32-row tile)
    batch["q"][token, head, 5] = bad
    out, lse = mla_tree_verify(**batch, num_kv_splits=2)
    ref_out, ref_lse = mla_tree_verify_reference(**dequantized(batch))
    good = torch.ones(lse.shape, dtype=torch.bool, device=lse.device)
    good[token, head] = False
    tol = TOLS[torch.bfloat16]
    torch.testing.assert_close(out[good].float(), ref_out[good].float(), **tol)
    torch.testing.assert_close(lse[good], ref_lse[good], **tol)


def test_garbage_past_the_keys_is_not_read():
    """Cache slots no request owns hold e4m3 NaN bytes (0x7F): the masked tiles (a
    partial context tile, the new tokens) load K and V with their keys' mask, so the
    results stay those of the reference. On a GPU this checks the masked V load (0 * NaN
    is NaN in the PV MMA); Triton's interpreter decodes 0x7F as 480, not NaN, so on the
    CPU only the K side can fail."""
    batch = fp8_batch(MIXED, page_size=4, seed=13)
    owned = torch.zeros(batch["kv_cache"].shape[:2], dtype=torch.bool)
    for r, seq_len in enumerate(batch["seq_lens"].tolist()):
        pos = torch.arange(seq_len)
        owned[batch["block_table"][r].cpu().long()[pos // 4], pos % 4] = True
    batch["kv_cache"].view(torch.uint8)[~owned.to(DEVICE)] = 0x7F
    out, lse = check(batch, num_kv_splits=2)
    assert torch.isfinite(out.float()).all()


def test_fp8_never_takes_the_gluon_kernel(monkeypatch):
    from vllm_ddtree.attention_backends.mla_tree import gluon_kernel, ops

    calls = []
    monkeypatch.setattr(ops, "mla_tree_fwd_gluon", lambda *a, **k: calls.append(1))
    monkeypatch.setattr(gluon_kernel, "gluon_supported", lambda q, kv, rank: kv.dtype == q.dtype)
    check(fp8_batch(MIXED[:2], page_size=4))
    assert not calls


def test_gluon_launcher_names_the_fp8_cache():
    from vllm_ddtree.attention_backends.mla_tree.ops import mla_tree_fwd_gluon

    batch = fp8_batch(MIXED[:2], page_size=4)
    del batch["kv_scale"]
    with pytest.raises(ValueError, match="16-bit caches only"):
        mla_tree_fwd_gluon(**batch)


def test_bad_scales_name_the_field():
    batch = fp8_batch(MIXED[:2], page_size=4)
    cases = [
        (dict(kv_scale=None), "kv_scale must be a one-element float32"),
        (dict(kv_scale=batch["kv_scale"].double()), "kv_scale must be a one-element float32"),
        (dict(kv_scale=torch.ones(2, device=DEVICE)), "kv_scale must be a one-element float32"),
        (dict(kv_scale=1.0), "kv_scale must be a one-element float32"),
        (dict(kv_cache=batch["kv_cache"].float().to(batch["q"].dtype)),
         "kv_scale applies to an torch.float8_e4m3fn kv_cache only"),
        (dict(kv_cache=batch["kv_cache"].view(torch.uint8)), "kv_cache dtype torch.uint8"),
    ]
    for override, message in cases:
        with pytest.raises(ValueError, match=message):
            mla_tree_verify(**{**batch, **override})


_COMPILE_FP8 = MLA_COMPILE_PRELUDE + textwrap.dedent(
    """
    import re


    def conversions_and_mmas(kernel):
        return set(re.findall(r"\\b(?:cvt|mma\\.sync|wgmma\\.mma_async)\\.[\\w.]+",
                              kernel.asm["ptx"]))


    # sm_120: pages 1 / 16 / 64 (one page-id lookup per key, per page, per tile) with
    # the run-time splits of a CUDA graph, and the active-row re-split; sm_90: the
    # 64-row tile (wgmma).
    variants = {120: [dict(page=16, runtime=True), dict(page=1, runtime=True),
                      dict(page=64, runtime=True), dict(page=1, has_active=True),
                      dict(page=64, has_active=True)],
                90: [dict(page=16, runtime=True)]}
    rows = []
    for arch, configs in ((120, MLA_TILE_CONFIGS), (90, LARGE_SMEM_TILE_CONFIGS)):
        for cfg in configs:
            kernels_ = [compiled(cfg, arch, kv_fp8=True, **v) for v in variants[arch]]
            ops = set().union(*map(conversions_and_mmas, kernels_))
            rows.append([arch, max(k.metadata.shared for k in kernels_), sorted(ops)])
    print(json.dumps(rows))
    """
)


def test_fp8_variant_compiles_to_fp16_mmas_within_the_16_bit_estimate():
    """The fp8 variant compiled for sm_120 (every table config, pages 1 / 16 / 64, the
    graph's run-time splits and the active-row re-split) and sm_90 (the 64-row tile):

    - its MMAs take fp16 operands, the tiles are widened by e4m3x2 -> f16x2 conversions
      and nothing is converted to bf16 (the bf16 q becomes fp16 through fp32);
    - its shared memory (K and V staged as fp8) stays within the bf16 estimate the
      configs are chosen by on sm_120 (measured: 54.5 / 74 KB against 56.5 / 76 KB in
      bf16) and within Hopper's 227 KB for the 64-row tile (218 against 222 KB)."""
    from vllm_ddtree.attention_backends.mla_tree import (
        MLA_TILE_CONFIGS,
        SM120_SHARED_MEMORY_BYTES,
        estimate_shared_memory_bytes,
    )
    from vllm_ddtree.attention_backends.mla_tree.configs import LARGE_SMEM_TILE_CONFIGS

    compiled = compiled_shared_memory(_COMPILE_FP8)
    configs = list(MLA_TILE_CONFIGS) + list(LARGE_SMEM_TILE_CONFIGS)
    for config, (arch, used, ops) in zip(configs, compiled, strict=True):
        mmas = [op for op in ops if "mma" in op]
        assert mmas and all(".f16.f16" in op for op in mmas), (config, mmas)
        assert "cvt.rn.f16x2.e4m3x2" in ops, (config, ops)
        assert not [op for op in ops if op.startswith(("cvt.bf16", "cvt.rn.bf16"))], ops
        if arch == 120:
            assert used <= SM120_SHARED_MEMORY_BYTES, (config, used)
            assert used <= estimate_shared_memory_bytes(config, 576, 512, torch.bfloat16)
        else:  # wgmma keeps num_stages tiles, outside the (mma.sync) estimate
            assert used <= 227 * 1024, (config, used)


# ---------------------------------------------------------------------------------------
# The vLLM backend: accepts vLLM's fp8 MLA cache and hands the layer's scale to the kernel.


def _impl(kv_cache_dtype, kv_lora_rank=64, rope=16):
    from vllm.config import VllmConfig, set_current_vllm_config

    from vllm_ddtree.attention_backends.mla_tree.backend import TreeMLAImpl

    with set_current_vllm_config(VllmConfig()):
        return TreeMLAImpl(2, kv_lora_rank + rope, 0.1, 1, None, None, kv_cache_dtype, None,
                           "decoder", None, q_lora_rank=None, kv_lora_rank=kv_lora_rank,
                           qk_nope_head_dim=16, qk_rope_head_dim=rope, qk_head_dim=16 + rope,
                           v_head_dim=16, kv_b_proj=None, indexer=None)


@pytest.mark.parametrize("kv_lora_rank, rope", [(64, 128), (72, 16), (8, 8)])
def test_backend_refuses_mla_shapes_its_kernels_cannot_take_as_the_model_is_built(
        kv_lora_rank, rope):
    """A rope dim past 64 or a latent not a multiple of 16: refused when vLLM builds the
    attention layer, not at the first launch (under --enforce-eager, the first request)."""
    with pytest.raises(NotImplementedError,
                       match=f"kv_lora_rank={kv_lora_rank} and qk_rope_head_dim={rope}"):
        _impl("auto", kv_lora_rank, rope)
    _impl("auto", 128, 64)  # a small model's latent with DeepSeek's rope dim


def test_backend_accepts_vllm_fp8_cache_and_keeps_q_unquantized():
    from vllm_ddtree.attention_backends.mla_tree.backend import TreeMLABackend

    for name in ("fp8", "fp8_e4m3"):
        assert name in TreeMLABackend.supported_kv_cache_dtypes
        impl = _impl(name)
        # MLACommonImpl would quantize q to fp8 before forward_mqa otherwise.
        assert impl._fp8_cache and not impl.supports_quant_query_input
    assert not _impl("auto")._fp8_cache and _impl("auto").supports_quant_query_input
    for name in ("fp8_e5m2", "fp8_ds_mla"):
        with pytest.raises(NotImplementedError, match=f"no '{name}' KV cache.*'fp8_e4m3'"):
            _impl(name)


def test_backend_forward_reads_the_layer_scale():
    """``forward_mqa`` on the e4m3 view vLLM hands it, with ``layer._k_scale``: the
    fp32 reference on the dequantized cache."""
    from types import SimpleNamespace as NS

    from vllm_ddtree.attention_backends.mla_tree.backend import TreeMLADecodeMetadata

    batch = fp8_batch(MIXED, page_size=4, scale_value=0.03)
    impl = _impl("fp8")
    impl.scale = batch["scale"]
    decode = TreeMLADecodeMetadata(
        block_table=batch["block_table"], seq_lens=batch["seq_lens"], dcp_tot_seq_lens=None,
        query_start_loc=batch["query_start_loc"], ancestor_bits=batch["ancestor_bits"],
        max_query_len=9, max_seq_len=int(batch["seq_lens"].max()), max_model_len=4096)
    layer = NS(_k_scale=batch["kv_scale"].reshape(()))  # vLLM's: a 0-d fp32 buffer
    out, lse = impl.forward_mqa(batch["q"], batch["kv_cache"], NS(decode=decode), layer)
    ref_out, ref_lse = mla_tree_verify_reference(**dequantized(batch))
    torch.testing.assert_close(out.float(), ref_out.float(), **TOLS[torch.bfloat16])
    torch.testing.assert_close(lse, ref_lse, **TOLS[torch.bfloat16])


def test_backend_refuses_fp8_before_sm89(monkeypatch):
    """Triton has no e4m3 (fp8e4nv) before sm_89: the backend names the capability at
    start-up (as TRITON_MLA) instead of failing in the kernel's first compile."""
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability

    monkeypatch.setattr(current_platform, "is_cuda", lambda: True)
    monkeypatch.setattr(current_platform, "get_device_capability",
                        lambda device_id=0: DeviceCapability(8, 0))
    monkeypatch.setattr(current_platform, "has_device_capability",
                        lambda capability, device_id=0: capability <= 80)
    for name in ("fp8", "fp8_e4m3"):
        with pytest.raises(NotImplementedError, match=f"'{name}' KV cache needs compute "
                                                      "capability 8.9.*has 8.0"):
            _impl(name)
    assert not _impl("auto")._fp8_cache
    monkeypatch.setattr(current_platform, "has_device_capability",
                        lambda capability, device_id=0: capability <= 90)
    assert _impl("fp8")._fp8_cache


# ---------------------------------------------------------------------------------------
# _fp16_query_rows alone, at the edges of its fp32 exponent arithmetic.


@triton.jit
def _query_rows_probe(Q, Scaled, Unscale, BLOCK_M: tl.constexpr, BLOCK_L: tl.constexpr,
                      BLOCK_R: tl.constexpr, ROPE: tl.constexpr):
    rows = tl.arange(0, BLOCK_M)[:, None]
    offs_l = tl.arange(0, BLOCK_L)[None, :]
    offs_r = tl.arange(0, BLOCK_R)[None, :]
    width = BLOCK_L + BLOCK_R
    q_nope = tl.load(Q + rows * width + offs_l)
    q_rope = tl.load(Q + rows * width + BLOCK_L + offs_r)
    q_nope, q_rope, unscale = kernels._fp16_query_rows(q_nope, q_rope, ROPE)
    tl.store(Scaled + rows * width + offs_l, q_nope)
    if ROPE > 0:
        tl.store(Scaled + rows * width + BLOCK_L + offs_r, q_rope)
    tl.store(Unscale + rows, unscale)


def _bf16_rows(rows):
    """bf16 ``[len(rows), 16 + 16]`` (nope, rope) from lists of values, zero-padded;
    the values must be bf16 values."""
    q = torch.zeros(len(rows), 32, dtype=torch.float64)
    for i, values in enumerate(rows):
        q[i, : len(values)] = torch.tensor(values, dtype=torch.float64)
    out = q.to(torch.bfloat16)
    torch.testing.assert_close(out.double(), q, rtol=0, atol=0, equal_nan=True)
    return out


BF16_MAX = torch.finfo(torch.bfloat16).max
EDGE_ROWS = [
    [0.0],  # all zero (a masked row)
    [2.0**-126, -(2.0**-125)],  # the smallest normals: e capped at 126
    [2.0**-112 * 1.5, 2.0**-120],  # e = 126 exactly at the cap's edge
    [1.0, -0.5, 0.25, 2.0**-20],  # the largest entry exactly a power of two
    [-(2.0**15), 3.0, -(2.0**-10)],  # a negative largest entry, fp16's own scale
    [2.0**16, -1.5 * 2.0**16, -1.0],  # beyond fp16's range
    [BF16_MAX, -BF16_MAX, 2.0**100],  # bf16's (and fp32's) largest finite exponent
    [1.9921875 * 2.0**20, -1.0],  # largest entry just below a power of two
    [float("nan"), 3.0, -7.0],  # NaN: only finite entries choose e
    [float("inf"), -2.0**-20, float("-inf"), 5.0],
    [float("nan")] * 4,  # no finite entry at all
]
# bf16 subnormals (fp32 subnormals after the widening): on the GPU only, as Triton's
# interpreter widens a subnormal bf16 wrongly (its _convert_float renormalizes the
# significand, then clamps the exponent). A GPU flushing them to zero (ftz) is allowed.
SUBNORMAL_ROWS = [
    [-0.0, 2.0**-133, -(2.0**-130), 3 * 2.0**-133],  # subnormals only: e = 126
    [2.0**-120, -(2.0**-130), 2.0**-133],  # a normal largest entry, capped e
]
ROPE_ROWS = [
    # The largest entry in the rope part (columns 16..): it chooses e for the row.
    [0.5] * 4 + [0.0] * 12 + [-(2.0**20), 1.0],
    [2.0**-100] + [0.0] * 15 + [2.0**-90, -(2.0**-95)],
    [3.0] + [0.0] * 15 + [float("-inf"), 2.0**-5],  # inf in the rope part
]


def _expected_exponent(row: torch.Tensor) -> tuple[int, bool]:
    """``(e, capped)`` of the docstring, from the row's largest finite ``|q|`` in
    float64: its floor(log2) ``E`` (fp32 subnormals and 0 count as ``E = -127``),
    ``e = min(14 - E, 126)``."""
    values = row.double()
    finite = values.abs()[torch.isfinite(values)]
    largest = float(finite.max()) if finite.numel() else 0.0
    exponent = -127 if largest < 2.0**-126 else int(torch.tensor(largest).log2().floor())
    return min(14 - exponent, 126), 14 - exponent > 126


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy on inf / NaN
@pytest.mark.parametrize("rope", [16, 0])
def test_fp16_query_rows_at_the_fp32_exponent_edges(rope):
    """Each row times ``2^e`` (``e = 14 - floor(log2 max finite |q|)``, at most 126),
    checked against a float64 reference: the scale is exact (every finite entry comes
    back bit for bit times ``2^-e``; none overflows fp16), the largest finite entry lands
    in ``[2^14, 2^15)`` wherever ``e`` is not capped, ``2^-e`` is a normal fp32, the sign
    and zeros are kept, inf / NaN stay in their entries. ``rope = 0``: the rope columns
    are neither read for ``e`` nor written."""
    rows = EDGE_ROWS + (ROPE_ROWS if rope else []) + (SUBNORMAL_ROWS if DEVICE == "cuda" else [])
    block_m = triton.next_power_of_2(len(rows))
    q = torch.zeros(block_m, 32, dtype=torch.bfloat16)
    q[: len(rows)] = _bf16_rows(rows)
    scaled = torch.full((block_m, 32), 7.0, dtype=torch.float16, device=DEVICE)
    unscale = torch.zeros(block_m, dtype=torch.float32, device=DEVICE)
    _query_rows_probe[(1,)](q.to(DEVICE), scaled, unscale, BLOCK_M=block_m, BLOCK_L=16,
                            BLOCK_R=16, ROPE=rope)
    scaled, unscale = scaled.cpu(), unscale.cpu()
    width = 32 if rope else 16
    assert bool((scaled[:, width:] == 7.0).all())  # rope = 0: nothing stored there
    for i, row in enumerate(q[: len(rows), :width]):
        e, capped = _expected_exponent(row)
        assert float(unscale[i]) == 2.0**-e, (i, rows[i], float(unscale[i]), e)
        got, want = scaled[i, :width].double(), row.double()
        finite = torch.isfinite(want)
        if rows[i] in SUBNORMAL_ROWS and not bool(got.ne(0).any()):
            continue  # flushed to zero (ftz): the row attends uniformly, as it nearly does
        torch.testing.assert_close(got[finite] * 2.0**-e, want[finite], rtol=0, atol=0)
        assert bool(torch.isfinite(got[finite]).all()), (i, rows[i])
        assert torch.equal(torch.signbit(got[finite]), torch.signbit(want[finite])), i
        assert torch.equal(got[~finite].isnan(), want[~finite].isnan()), i
        assert torch.equal(got[want.isinf()], want[want.isinf()]), i
        largest = float(got[finite].abs().max()) if bool(finite.any()) else 0.0
        if capped:
            assert largest < 2.0**14, (i, rows[i], largest)
        else:
            assert 2.0**14 <= largest < 2.0**15, (i, rows[i], largest)


def test_rows_of_one_tile_scaled_apart():
    """Rows of one CTA tile whose largest entries sit far apart (a zero row, 2^-100,
    exactly 1, exactly 2^16 past fp16's range, 3e5): each row takes its own power of two
    (the softmax scale becomes a ``[BLOCK_M, 1]`` column, used in both phases and the
    LSE), and every row matches the fp32 reference, with one and several splits."""
    batch = fp8_batch(MIXED[2:4], page_size=4, heads=2, seed=17)
    q = batch["q"].float()
    q[0, 0] = 0.0
    q[1, 1] *= 2.0**-100
    q[2, 0] = q[2, 0].clamp(-0.9, 0.9)
    q[2, 0, 7] = 1.0  # the largest entry exactly a power of two
    q[3, 1] = q[3, 1].clamp(-0.9, 0.9) * 100.0
    q[3, 1, -1] = -(2.0**16)  # in the rope part, beyond fp16
    q[5, 0] *= 3e5 / q[5, 0].abs().max()
    batch["q"] = q.to(torch.bfloat16)
    batch["scale"] = 2e-3  # logits of the large rows stay well conditioned
    for splits in (1, 3):
        check(batch, num_kv_splits=splits)
