# SPDX-License-Identifier: Apache-2.0
"""MLA tree-verify kernel on an fp8 (e4m3) latent cache, vLLM's ``--kv-cache-dtype fp8``
layout: rows ``x / k_scale`` in ``[num_blocks, page_size, kv_lora_rank + rope]``, one fp32
scale per layer, and vLLM's e4m3 query (``q / q_scale``). Checked against the fp32
reference on the dequantized cache and query (``kv_scale * row``, ``q_scale * q``), which
is independent of the kernel's folding of the scales into the softmax scale and the
output.

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
    quantize_query,
)

pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    skip_unless_kernels_run_here(kernels._mla_tree_fwd_kernel),
]

FP8 = torch.float8_e4m3fn


def fp8_batch(specs, *, scale_value=0.05, q_scale_value=0.01, out_dtype=torch.bfloat16,
              **kwargs):
    """``make_batch`` with its cache quantized as vLLM's ``concat_and_cache_mla`` does
    (``fp8(x / k_scale)``) and its query as ``MLAAttention`` does (``quantize_query``),
    the scales as one-element fp32 device tensors; outputs in ``out_dtype``."""
    batch = make_batch(specs, dtype=torch.float32, **kwargs)
    kv_scale = torch.tensor([scale_value], dtype=torch.float32, device=DEVICE)
    q_scale = torch.tensor([q_scale_value], dtype=torch.float32, device=DEVICE)
    cache = batch["kv_cache"] * 3.0  # values spread over e4m3's range after / scale
    # Saturating, as vLLM's CUDA conversion (__NV_SATFINITE); torch's gives NaN instead.
    batch["kv_cache"] = (cache / kv_scale).clamp(-448, 448).to(FP8)
    batch["q"] = quantize_query(batch["q"], q_scale)
    batch.update(kv_scale=kv_scale, q_scale=q_scale, out_dtype=out_dtype)
    return batch


def dequantized(batch):
    """The same batch with the cache and query dequantized to fp32 (``kv_scale * row``,
    ``q_scale * q``)."""
    kv = batch["kv_cache"].float() * batch["kv_scale"]
    q = batch["q"].float() * batch["q_scale"]
    return {**batch, "kv_cache": kv, "q": q, "kv_scale": None, "q_scale": None,
            "out_dtype": None}


def check(batch, **kwargs):
    out, lse = mla_tree_verify(**batch, **kwargs)
    assert out.dtype == batch["out_dtype"]
    ref_out, ref_lse = mla_tree_verify_reference(**dequantized(batch))
    # fp16 MMAs (p in fp16) whatever the output's dtype
    tol = TOLS[torch.float16 if batch["out_dtype"] == torch.float32 else batch["out_dtype"]]
    torch.testing.assert_close(out.float(), ref_out.float(), **tol)
    torch.testing.assert_close(lse, ref_lse, **tol)
    return out, lse


def test_fixture_cache_uses_e4m3_range():
    """The premise: the quantized rows are not all tiny (the scale matters) and the
    reference's dequantization differs from ignoring the scale."""
    batch = fp8_batch(MIXED[:2], page_size=4)
    raw = batch["kv_cache"].float()
    assert raw.abs().max() > 100 and raw.abs().max() <= 448
    q = batch["q"].float()
    assert q.abs().max() > 100 and q.abs().max() <= 448
    ref, _ = mla_tree_verify_reference(**dequantized(batch))
    unscaled, _ = mla_tree_verify_reference(**{**dequantized(batch), "kv_cache": raw})
    assert not torch.allclose(ref, unscaled, atol=1e-2)


def test_query_quantization_saturates_as_vllm():
    """``quantize_query``: ``q / q_scale`` rounded to e4m3 as torch rounds it, clamped to
    +-448 (vLLM's static quantization saturates; torch's cast alone gives NaN), NaN kept."""
    q = torch.tensor([[[0.0, 1.0, -3.3, 5.0, -5.0, 1e9, float("nan"), 2.2e-3]]])
    scale = torch.tensor(0.01)
    got = quantize_query(q, scale)
    assert got.dtype == FP8
    want = torch.tensor([0.0, 100.0, -330.0, 448.0, -448.0, 448.0, 0.0, 0.22]).to(FP8)
    assert got.float()[0, 0, :6].tolist() == want.float()[:6].tolist()
    assert got.float()[0, 0, 6].isnan()
    assert got.float()[0, 0, 7] == torch.tensor(0.22).to(FP8).float()


def test_query_quantization_is_vllms_bit_for_bit():
    """``quantize_query`` against vLLM's own static per-tensor ``QuantFP8`` (what
    ``MLAAttention``'s decode concatenation quantizes the query with): the same bytes,
    saturated entries included."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape

    with set_current_vllm_config(VllmConfig()):
        op = QuantFP8(static=True, group_shape=GroupShape.PER_TENSOR)
    q = torch.randn(7, 4, 80, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(3))
    q[0, 0, :3] = torch.tensor([1e4, -1e4, 0.0])
    scale = torch.tensor(0.037)
    want, _ = op.forward_native(q.reshape(-1, 80) * 30, scale)
    got = quantize_query(q * 30, scale)
    assert torch.equal(got.reshape(-1, 80).view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_mixed_batch(page_size):
    batch = fp8_batch(MIXED, page_size=page_size, seed=page_size)
    check(batch, num_kv_splits=1)
    check(batch)  # automatic split count


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fp32_and_fp16_outputs(dtype):
    batch = fp8_batch(MIXED[:3], out_dtype=dtype, page_size=4, heads=3)
    check(batch, num_kv_splits=2)


def test_a_request_does_not_see_the_other_queries():
    """A request's result is bit for bit the same alone and beside a request whose
    queries are 100x larger (same length, so the same tile and split count): the query's
    scale is the layer's, not the batch's, so its rounding cannot move with the batch
    (a per-launch scale did; plain decoding and a tree verify then scored the same keys
    with differently rounded queries)."""
    pair = fp8_batch([MIXED[2], MIXED[2]], page_size=4, seed=21)
    tokens = int(pair["query_start_loc"][1])
    big = pair["q"].float()
    big[tokens:] = (big[tokens:] * 100.0).clamp(-448, 448)
    loud = {**pair, "q": big.to(FP8)}
    alone = {**pair, "q": pair["q"][:tokens], "seq_lens": pair["seq_lens"][:1],
             "query_start_loc": pair["query_start_loc"][:2],
             "block_table": pair["block_table"][:1],
             "ancestor_bits": pair["ancestor_bits"][:tokens]}
    results = [mla_tree_verify(**batch, num_kv_splits=1, kernel="triton")
               for batch in (alone, loud)]
    assert torch.equal(results[0][0], results[1][0][:tokens])
    assert torch.equal(results[0][1], results[1][1][:tokens])


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
    batch["q_scale"].mul_(0.5)
    third, _ = check(batch)
    assert not torch.allclose(second.float(), third.float(), atol=1e-2)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy on inf / NaN
def test_non_finite_query_stays_in_its_row():
    """One q entry NaN (e4m3 has no inf: vLLM's quantization saturates it): every other
    row of its tile (the same request, the same CTA) still matches the reference; only
    the bad row's result is undefined."""
    batch = fp8_batch(MIXED[2:4], page_size=4, heads=2, seed=11)
    token, head = 3, 1  # request 0 (9 tokens x 2 heads: one 16- or 32-row tile)
    batch["q"].view(torch.uint8)[token, head, 5] = 0x7F  # e4m3 NaN
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
    monkeypatch.setattr(ops, "_launch_gluon", lambda *a, **k: calls.append(1))
    monkeypatch.setattr(gluon_kernel, "gluon_supported", lambda q, kv, rank: True)
    check(fp8_batch(MIXED[:2], page_size=4))
    assert not calls


def test_gluon_launcher_names_the_fp8_cache():
    from vllm_ddtree.attention_backends.mla_tree.ops import mla_tree_fwd_gluon

    batch = fp8_batch(MIXED[:2], page_size=4)
    for name in ("kv_scale", "q_scale", "out_dtype"):
        del batch[name]
    with pytest.raises(ValueError, match="16-bit caches only"):
        mla_tree_fwd_gluon(**batch)


def test_bad_scales_name_the_field():
    batch = fp8_batch(MIXED[:2], page_size=4)
    cases = [
        (dict(q_scale=None), "q_scale must be a one-element float32.*layer._q_scale"),
        (dict(q=batch["q"].float().to(torch.bfloat16)),
         "q must be torch.float8_e4m3fn with an torch.float8_e4m3fn kv_cache"),
        (dict(out_dtype=torch.int8), "out_dtype must be bf16, fp16 or fp32"),
        (dict(kv_scale=None), "kv_scale must be a one-element float32"),
        (dict(kv_scale=batch["kv_scale"].double()), "kv_scale must be a one-element float32"),
        (dict(kv_scale=torch.ones(2, device=DEVICE)), "kv_scale must be a one-element float32"),
        (dict(kv_scale=1.0), "kv_scale must be a one-element float32"),
        (dict(kv_cache=batch["kv_cache"].float().to(torch.bfloat16),
              q=batch["q"].float().to(torch.bfloat16)),
         "kv_scale applies to an torch.float8_e4m3fn kv_cache only"),
        (dict(kv_cache=batch["kv_cache"].float().to(torch.bfloat16),
              q=batch["q"].float().to(torch.bfloat16), kv_scale=None),
         "q_scale applies to an torch.float8_e4m3fn kv_cache only"),
        (dict(kv_cache=batch["kv_cache"].view(torch.uint8),
              q=batch["q"].float().to(torch.bfloat16), kv_scale=None, q_scale=None,
              out_dtype=None), "kv_cache dtype torch.uint8"),
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

    - its MMAs take fp16 operands, the tiles and the e4m3 query are widened by e4m3x2 ->
      f16x2 conversions and nothing is converted to bf16;
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


def test_backend_accepts_vllm_fp8_cache_and_takes_the_quantized_query():
    from vllm_ddtree.attention_backends.mla_tree.backend import TreeMLABackend

    for name in ("fp8", "fp8_e4m3"):
        assert name in TreeMLABackend.supported_kv_cache_dtypes
        impl = _impl(name)
        # MLAAttention hands forward_mqa the e4m3 query (q / layer._q_scale), as FLASHMLA.
        assert impl._fp8_cache and impl.supports_quant_query_input
    assert not _impl("auto")._fp8_cache
    for name in ("fp8_e5m2", "fp8_ds_mla"):
        with pytest.raises(NotImplementedError, match=f"no '{name}' KV cache.*'fp8_e4m3'"):
            _impl(name)


def test_backend_forward_reads_the_layer_scale():
    """``forward_mqa`` on the e4m3 cache view and the e4m3 query vLLM hands it, with
    ``layer._k_scale`` and ``layer._q_scale``: the fp32 reference on the dequantized
    cache and query; the output in the model's dtype (bf16 here)."""
    from types import SimpleNamespace as NS

    from vllm_ddtree.attention_backends.mla_tree.backend import TreeMLADecodeMetadata

    batch = fp8_batch(MIXED, page_size=4, scale_value=0.03)
    impl = _impl("fp8")
    impl.scale = batch["scale"]
    decode = TreeMLADecodeMetadata(
        block_table=batch["block_table"], seq_lens=batch["seq_lens"], dcp_tot_seq_lens=None,
        query_start_loc=batch["query_start_loc"], ancestor_bits=batch["ancestor_bits"],
        max_query_len=9, max_seq_len=int(batch["seq_lens"].max()), max_model_len=4096)
    layer = NS(_k_scale=batch["kv_scale"].reshape(()),  # vLLM's: 0-d fp32 buffers
               _q_scale=batch["q_scale"].reshape(()))
    impl._out_dtype = torch.bfloat16
    out, lse = impl.forward_mqa(batch["q"], batch["kv_cache"], NS(decode=decode), layer)
    assert out.dtype == torch.bfloat16
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
