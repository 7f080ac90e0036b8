# SPDX-License-Identifier: Apache-2.0
"""MLA tree-verify kernel vs its reference on CUDA at DeepSeek/Kimi shapes: bf16, the fp8
(e4m3) latent cache, and sm_120's tile configs forced on this GPU."""

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("TRITON_INTERPRET=1: run tests/gpu in its own process", allow_module_level=True)

from vllm_ddtree.attention_backends.mla_tree import (  # noqa: E402
    MLA_TILE_CONFIGS,
    MLATileConfig,
    ancestor_bits_from_parents,
    causal_ancestor_bits,
    kernels,
    mla_tree_verify,
    mla_tree_verify_reference,
    num_mask_words,
    quantize_query,
)
from vllm_ddtree.attention_backends.mla_tree.configs import (  # noqa: E402
    FP8_TRANSPOSED_TILE_CONFIGS,
)

if type(kernels._mla_tree_fwd_kernel).__name__ == "InterpretedFunction":
    pytest.skip("kernels were loaded in interpreter mode", allow_module_level=True)

KV_LORA, ROPE = 512, 64
HEAD_DIM = KV_LORA + ROPE
OUT_TOL = dict(atol=1e-2, rtol=5e-2)
LSE_TOL = dict(atol=2e-2, rtol=1e-3)


def tree_parents(n, rng):
    """A bushy random tree (parent < child), like a DDTree draft tree."""
    return [-1] + [rng.randrange(max(0, i - 8), i) for i in range(1, n)]


def make_batch(specs, *, heads, page_size, dtype=torch.bfloat16, seed=0):
    """``specs``: list of ``(context_len, kind, qlen)``, kind in decode/chain/tree."""
    rng = random.Random(seed)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    qlens = [q for _, _, q in specs]
    seq_lens = [c + q for c, _, q in specs]
    pages = [-(-s // page_size) for s in seq_lens]
    num_blocks = sum(pages) + 7
    perm = torch.randperm(num_blocks, device="cuda", generator=gen).to(torch.int32)
    block_table = torch.zeros(len(specs), max(pages) + 1, dtype=torch.int32, device="cuda")
    i = 0
    for r, n in enumerate(pages):
        block_table[r, :n] = perm[i : i + n]
        i += n
    words = num_mask_words(max(qlens))
    bits = []
    for _, kind, qlen in specs:
        if kind == "tree":
            bits.append(ancestor_bits_from_parents(tree_parents(qlen, rng), words))
        else:
            bits.append(causal_ancestor_bits(qlen, words))
    qsl = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32)
    return dict(
        q=torch.randn(sum(qlens), heads, HEAD_DIM, device="cuda", generator=gen).to(dtype),
        kv_cache=torch.randn(num_blocks, page_size, HEAD_DIM, device="cuda", generator=gen).to(
            dtype
        ),
        block_table=block_table,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
        query_start_loc=qsl.cuda(),
        ancestor_bits=torch.cat(bits).cuda(),
        scale=HEAD_DIM**-0.5,
        kv_lora_rank=KV_LORA,
    )


def check(batch, **kwargs):
    out, lse = mla_tree_verify(**batch, **kwargs)
    ref_out, ref_lse = mla_tree_verify_reference(**batch)
    torch.testing.assert_close(out.float(), ref_out.float(), **OUT_TOL)
    torch.testing.assert_close(lse, ref_lse, **LSE_TOL)
    return out, lse


REALISTIC_SHAPES = [
    (8, 1024, 1, 64, "decode"),
    (16, 8192, 16, 64, "tree"),
    (64, 4096, 65, 1, "tree"),
    (128, 2048, 16, 64, "chain"),
    (8, 32768, 65, 64, "tree"),
    (16, 32768, 16, 1, "chain"),
    (128, 32768, 1, 64, "decode"),
    (64, 32768, 65, 64, "tree"),
    # vLLM's default 16-token pages under 32/64-key tiles (one page-id lookup per page)
    (8, 8192, 16, 16, "tree"),
    (64, 32768, 65, 16, "tree"),
]


@pytest.mark.parametrize("heads,ctx,qlen,page_size,kind", REALISTIC_SHAPES)
def test_realistic_shapes(heads, ctx, qlen, page_size, kind):
    specs = [(ctx, kind, qlen), (ctx // 3 + 5, kind, qlen)]
    check(make_batch(specs, heads=heads, page_size=page_size))


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_mixed_batch(page_size):
    specs = [
        (5000, "decode", 1),
        (0, "chain", 7),
        (1200, "tree", 65),
        (31, "tree", 16),
        (20000, "chain", 16),
        (3, "decode", 1),
    ]
    check(make_batch(specs, heads=16, page_size=page_size, seed=page_size))


@pytest.mark.parametrize("num_kv_splits", [1, 4, 32])
def test_forced_splits(num_kv_splits):
    batch = make_batch([(9000, "tree", 65), (100, "decode", 1)], heads=8, page_size=64)
    check(batch, num_kv_splits=num_kv_splits)


# Outside the table (more than sm_120's 99 KB when lowered for Hopper), benchmarked
# by evals/bench_verify_attention.py --sweep-configs; shrunk where they do not fit.
EXTRA_CONFIGS = [
    MLATileConfig(block_m=16, block_n=64, num_warps=4, num_stages=2),
    MLATileConfig(block_m=64, block_n=16, num_warps=8, num_stages=2),
    MLATileConfig(block_m=64, block_n=32, num_warps=8, num_stages=2),
    MLATileConfig(block_m=64, block_n=64, num_warps=8, num_stages=2),
]


@pytest.mark.parametrize("config", list(MLA_TILE_CONFIGS) + EXTRA_CONFIGS, ids=str)
def test_every_config(config):
    batch = make_batch([(4000, "tree", 65), (70, "chain", 9)], heads=16, page_size=64)
    check(batch, config=config)


def test_fp16():
    batch = make_batch([(3000, "tree", 16)], heads=16, page_size=64, dtype=torch.float16)
    check(batch)


def check_graph_replay(launch) -> None:
    """``launch(**batch, **kwargs)`` captured in a CUDA graph and replayed on changed q
    gives exactly what an eager call on that q gives (and not the old result)."""
    batch = make_batch([(8000, "tree", 16), (100, "chain", 16)], heads=16, page_size=64)
    kwargs = dict(validate_values=False, max_query_len=16, max_seq_len=8016)
    expected, _ = launch(**batch, **kwargs)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, _ = launch(**batch, **kwargs)
    batch["q"].mul_(-1.0)
    graph.replay()
    torch.cuda.synchronize()
    ref, _ = launch(**batch, **kwargs)
    torch.testing.assert_close(out, ref, atol=0, rtol=0)
    assert not torch.equal(out, expected)


def check_runtime_splits_graph(launch) -> None:
    """The backend's CUDA-graph launch: a grid sized for 128k keys with the split count
    chosen per request at run time. Replays at the captured contexts and, after
    shortening one request in place, at another context match the fp32 reference."""
    batch = make_batch([(30000, "tree", 16), (100, "chain", 16)], heads=16, page_size=64)
    kwargs = dict(validate_values=False, max_query_len=16, max_seq_len=131072,
                  runtime_kv_splits=True)
    launch(**batch, **kwargs)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = launch(**batch, **kwargs)
    for seq_len in (None, 5016):
        if seq_len is not None:
            batch["seq_lens"][0] = seq_len  # the first 5000 keys stay its context
        graph.replay()
        torch.cuda.synchronize()
        ref_out, ref_lse = mla_tree_verify_reference(**batch)
        torch.testing.assert_close(out.float(), ref_out.float(), **OUT_TOL)
        torch.testing.assert_close(lse, ref_lse, **LSE_TOL)


def test_cuda_graph_capture():
    check_graph_replay(mla_tree_verify)


def test_cuda_graph_runtime_splits():
    check_runtime_splits_graph(mla_tree_verify)


@pytest.mark.parametrize("heads,page_size", [(8, 64), (64, 64), (16, 1), (64, 16)])
def test_active_rows_resplit_at_long_context(heads, page_size):
    """``ddtree_budget: "auto"`` at long context: a 65-token tree shape with a few active
    tokens per request re-splits their keys over the CTAs of the inactive rows (up to
    one split per 8 tiles). Active rows match the reference and the all-active launch,
    inactive rows are 0 / -inf, with the CUDA-graph style launch (no value checks)."""
    specs = [(30000, "tree", 65), (12000, "tree", 65), (40000, "decode", 1)]
    batch = make_batch(specs, heads=heads, page_size=page_size, seed=heads)
    active = torch.tensor([5, 1, 1], dtype=torch.int32, device="cuda")
    kwargs = dict(validate_values=False, max_query_len=65, max_seq_len=40001)
    out, lse = mla_tree_verify(**batch, **kwargs, active_query_lens=active)
    full_out, full_lse = mla_tree_verify(**batch, **kwargs)
    ref_out, ref_lse = mla_tree_verify_reference(**batch)
    rows = torch.zeros(131, dtype=torch.bool, device="cuda")
    rows[0:5], rows[65:66], rows[130:131] = True, True, True
    torch.testing.assert_close(out[rows].float(), ref_out[rows].float(), **OUT_TOL)
    torch.testing.assert_close(lse[rows], ref_lse[rows], **LSE_TOL)
    torch.testing.assert_close(out[rows].float(), full_out[rows].float(), **OUT_TOL)
    torch.testing.assert_close(lse[rows], full_lse[rows], **LSE_TOL)
    assert torch.all(out[~rows] == 0) and torch.all(lse[~rows] == float("-inf"))


# ---------------------------------------------------------------------------------------
# fp8 (e4m3) latent cache, vLLM's --kv-cache-dtype fp8 layout: rows fp8(x / k_scale), one
# fp32 scale per layer, and vLLM's e4m3 query (q / q_scale). Reference: fp32 on the
# dequantized cache and query.

FP8_SCALE = 0.02  # randn / 0.02 spans e4m3's range (|x| <= 448) without saturating much
FP8_Q_SCALE = 0.02


def to_fp8(batch, scale=FP8_SCALE):
    """``batch`` with its cache quantized as ``concat_and_cache_mla`` does (saturating)
    and its query as ``MLAAttention`` does (``quantize_query``); outputs in q's dtype."""
    kv_scale = torch.tensor([scale], dtype=torch.float32, device="cuda")
    q_scale = torch.tensor([FP8_Q_SCALE], dtype=torch.float32, device="cuda")
    cache = (batch["kv_cache"].float() / kv_scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    return {**batch, "kv_cache": cache, "kv_scale": kv_scale, "q_scale": q_scale,
            "q": quantize_query(batch["q"], q_scale), "out_dtype": batch["q"].dtype}


def fp8_reference(batch):
    deq = batch["kv_cache"].float() * batch["kv_scale"]
    q = batch["q"].float() * batch["q_scale"]
    out, lse = mla_tree_verify_reference(**{**batch, "kv_cache": deq, "q": q,
                                            "kv_scale": None, "q_scale": None})
    return out.to(batch["out_dtype"]), lse


def check_fp8(batch, **kwargs):
    out, lse = mla_tree_verify(**batch, **kwargs)
    ref_out, ref_lse = fp8_reference(batch)
    torch.testing.assert_close(out.float(), ref_out.float(), **OUT_TOL)
    torch.testing.assert_close(lse, ref_lse, **LSE_TOL)
    return out, lse


# The realistic shapes, plus an odd query length (33 rows at 32 heads) and a 129-row tree.
FP8_SHAPES = [*REALISTIC_SHAPES, (32, 8192, 33, 64, "tree"), (16, 4096, 129, 16, "tree")]


@pytest.mark.parametrize("heads,ctx,qlen,page_size,kind", FP8_SHAPES)
def test_fp8_realistic_shapes(heads, ctx, qlen, page_size, kind):
    specs = [(ctx, kind, qlen), (ctx // 3 + 5, kind, qlen)]
    check_fp8(to_fp8(make_batch(specs, heads=heads, page_size=page_size)))


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_fp8_mixed_batch(page_size):
    specs = [(5000, "decode", 1), (0, "chain", 7), (1200, "tree", 65), (31, "tree", 16),
             (20000, "chain", 16), (3, "decode", 1)]
    check_fp8(to_fp8(make_batch(specs, heads=16, page_size=page_size, seed=page_size)))


def test_fp8_fp16_outputs_and_forced_splits():
    batch = make_batch([(9000, "tree", 65), (100, "decode", 1)], heads=8, page_size=64,
                       dtype=torch.float16)
    for splits in (1, 32):
        check_fp8(to_fp8(batch), num_kv_splits=splits)


def test_fp8_cuda_graph_runtime_splits_and_scale_update():
    """The backend's graph launch on an fp8 cache: grid sized for 128k keys, run-time
    split counts; a replay after the scale tensor changes in place follows it."""
    batch = to_fp8(make_batch([(30000, "tree", 16), (100, "chain", 16)], heads=16,
                              page_size=64))
    kwargs = dict(validate_values=False, max_query_len=16, max_seq_len=131072,
                  runtime_kv_splits=True)
    mla_tree_verify(**batch, **kwargs)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = mla_tree_verify(**batch, **kwargs)
    for scale in (None, 2 * FP8_SCALE):
        if scale is not None:
            batch["kv_scale"].fill_(scale)
            batch["q_scale"].fill_(0.5 * FP8_Q_SCALE)
        graph.replay()
        torch.cuda.synchronize()
        ref_out, ref_lse = fp8_reference(batch)
        torch.testing.assert_close(out.float(), ref_out.float(), **OUT_TOL)
        torch.testing.assert_close(lse, ref_lse, **LSE_TOL)


def test_fp8_active_rows():
    specs = [(30000, "tree", 65), (12000, "tree", 65), (40000, "decode", 1)]
    batch = to_fp8(make_batch(specs, heads=64, page_size=64, seed=3))
    active = torch.tensor([5, 1, 1], dtype=torch.int32, device="cuda")
    out, lse = mla_tree_verify(**batch, validate_values=False, max_query_len=65,
                               max_seq_len=40001, active_query_lens=active)
    ref_out, ref_lse = fp8_reference(batch)
    rows = torch.zeros(131, dtype=torch.bool, device="cuda")
    rows[0:5], rows[65:66], rows[130:131] = True, True, True
    torch.testing.assert_close(out[rows].float(), ref_out[rows].float(), **OUT_TOL)
    torch.testing.assert_close(lse[rows], ref_lse[rows], **LSE_TOL)


# vLLM's e4m3 query at its edges (zero rows, subnormals, saturated rows), and a NaN entry,
# on the dispatched kernel (config None: the transposed-products tiles on sm_90) and the
# widening tiles of the table forced. Mirrors the CPU tests in tests/test_mla_fp8_kernel.py
# at DeepSeek's dims.


def e4m3_extremes(batch):
    """``batch`` (already ``to_fp8``) with q rows at e4m3's edges: a zero row, a row of
    subnormals (2^-9 .. 7 * 2^-9), a row saturated at +-448 (the rope part too)."""
    q = batch["q"].float()
    q[0, 0] = 0.0
    steps = torch.randint(1, 8, q[1, 1].shape, device="cuda")
    q[1, 1] = q[1, 1].sign() * 2.0**-9 * steps
    q[3, 2] = q[3, 2].sign() * 448.0
    assert q.to(torch.float8_e4m3fn).float().equal(q)
    return {**batch, "q": q.to(torch.float8_e4m3fn)}


@pytest.mark.parametrize("config", [None, *MLA_TILE_CONFIGS], ids=str)
def test_fp8_query_at_the_e4m3_extremes(config):
    batch = to_fp8(make_batch([(8192, "tree", 65), (700, "chain", 16)], heads=16,
                              page_size=64, seed=5))
    check_fp8(e4m3_extremes(batch), config=config)


def nan_query_entry(batch, token, head):
    """One e4m3 NaN byte (0x7F) in q (e4m3 has no inf: vLLM's quantization saturates)."""
    batch["q"].view(torch.uint8)[token, head, 100] = 0x7F


@pytest.mark.parametrize("config", [None, MLA_TILE_CONFIGS[0]], ids=str)
def test_fp8_non_finite_query_stays_in_its_row(config):
    """One q entry NaN: every other row (its tile's included) matches the reference; the
    bad row's result is undefined."""
    batch = to_fp8(make_batch([(8192, "tree", 65), (700, "chain", 16)], heads=16,
                              page_size=64, seed=9))
    token, head = 3, 5
    nan_query_entry(batch, token, head)
    out, lse = mla_tree_verify(**batch, config=config)
    ref_out, ref_lse = fp8_reference(batch)
    good = torch.ones(lse.shape, dtype=torch.bool, device="cuda")
    good[token, head] = False
    torch.testing.assert_close(out[good].float(), ref_out[good].float(), **OUT_TOL)
    torch.testing.assert_close(lse[good], ref_lse[good], **LSE_TOL)


def poison_unowned_slots(batch):
    """Cache slots no request owns (past each ``seq_len``, unused pages) set to e4m3 NaN
    bytes (0x7F), in place."""
    kv = batch["kv_cache"]
    page_size = kv.shape[1]
    owned = torch.zeros(kv.shape[:2], dtype=torch.bool, device="cuda")
    for r, seq_len in enumerate(batch["seq_lens"].tolist()):
        pos = torch.arange(seq_len, device="cuda")
        owned[batch["block_table"][r].long()[pos // page_size], pos % page_size] = True
    kv.view(torch.uint8)[~owned] = 0x7F


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_fp8_nan_bytes_past_the_keys_are_not_read(page_size):
    """The masked tiles (partial context tile, new tokens) load K and V (V a second time,
    for the PV MMA) with their keys' mask: NaN bytes in the slots past ``seq_len`` leave
    the results those of the reference (0 * NaN would be NaN in the PV MMA)."""
    specs = [(5001, "tree", 65), (37, "chain", 7), (1203, "tree", 16), (3, "decode", 1)]
    batch = to_fp8(make_batch(specs, heads=16, page_size=page_size, seed=page_size))
    poison_unowned_slots(batch)
    for splits in (1, 8):
        out, _ = check_fp8(batch, num_kv_splits=splits)
        assert torch.isfinite(out.float()).all()


# ---------------------------------------------------------------------------------------
# The fp8 kernel with transposed products (fp8_transposed.py: the widened tile as the wgmma
# A operand), launched by its tile configs: the fp8 checks above, compiled.

FP8T = {f"fp8t_m{c.block_m}": c for c in FP8_TRANSPOSED_TILE_CONFIGS}


@pytest.mark.parametrize("name", FP8T)
@pytest.mark.parametrize("heads,ctx,qlen,page_size,kind", FP8_SHAPES)
def test_fp8t_realistic_shapes(heads, ctx, qlen, page_size, kind, name):
    specs = [(ctx, kind, qlen), (ctx // 3 + 5, kind, qlen)]
    batch = to_fp8(make_batch(specs, heads=heads, page_size=page_size))
    check_fp8(batch, config=FP8T[name], kernel="triton")


@pytest.mark.parametrize("name", FP8T)
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_fp8t_nan_bytes_past_the_keys_are_not_read(page_size, name):
    specs = [(5001, "tree", 65), (37, "chain", 7), (1203, "tree", 16), (3, "decode", 1)]
    batch = to_fp8(make_batch(specs, heads=16, page_size=page_size, seed=page_size))
    poison_unowned_slots(batch)
    for splits in (1, 8):
        out, _ = check_fp8(batch, num_kv_splits=splits, config=FP8T[name])
        assert torch.isfinite(out.float()).all()


@pytest.mark.parametrize("name", FP8T)
def test_fp8t_query_extremes_and_fp16_outputs(name):
    batch = to_fp8(make_batch([(8192, "tree", 65), (700, "chain", 16)], heads=16,
                              page_size=64, seed=5))
    check_fp8(e4m3_extremes(batch), config=FP8T[name])
    half = make_batch([(9000, "tree", 65), (100, "decode", 1)], heads=8, page_size=64,
                      dtype=torch.float16)
    check_fp8(to_fp8(half), config=FP8T[name], num_kv_splits=32)


@pytest.mark.parametrize("name", FP8T)
def test_fp8t_non_finite_query_stays_in_its_row(name):
    batch = to_fp8(make_batch([(8192, "tree", 65), (700, "chain", 16)], heads=16,
                              page_size=64, seed=9))
    token, head = 3, 5
    nan_query_entry(batch, token, head)
    out, lse = mla_tree_verify(**batch, config=FP8T[name])
    ref_out, ref_lse = fp8_reference(batch)
    good = torch.ones(lse.shape, dtype=torch.bool, device="cuda")
    good[token, head] = False
    torch.testing.assert_close(out[good].float(), ref_out[good].float(), **OUT_TOL)
    torch.testing.assert_close(lse[good], ref_lse[good], **LSE_TOL)


@pytest.mark.parametrize("name", FP8T)
def test_fp8t_cuda_graph_runtime_splits_and_active_rows(name):
    batch = to_fp8(make_batch([(30000, "tree", 16), (100, "chain", 16)], heads=16,
                              page_size=64))
    kwargs = dict(validate_values=False, max_query_len=16, max_seq_len=131072,
                  runtime_kv_splits=True, config=FP8T[name])
    mla_tree_verify(**batch, **kwargs)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = mla_tree_verify(**batch, **kwargs)
    graph.replay()
    torch.cuda.synchronize()
    ref_out, ref_lse = fp8_reference(batch)
    torch.testing.assert_close(out.float(), ref_out.float(), **OUT_TOL)
    torch.testing.assert_close(lse, ref_lse, **LSE_TOL)
    active = torch.tensor([5, 1], dtype=torch.int32, device="cuda")
    out, lse = mla_tree_verify(**batch, validate_values=False, max_query_len=16,
                               max_seq_len=30016, active_query_lens=active,
                               config=FP8T[name])
    rows = torch.zeros(32, dtype=torch.bool, device="cuda")
    rows[0:5], rows[16:17] = True, True
    torch.testing.assert_close(out[rows].float(), ref_out[rows].float(), **OUT_TOL)
    torch.testing.assert_close(lse[rows], ref_lse[rows], **LSE_TOL)


# ---------------------------------------------------------------------------------------
# sm_120's tile choice (99 KB of shared memory per block, mma.sync) forced on this GPU:
# the configs select_config picks there, at every head count and row class, bf16 and fp8.


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("heads", [8, 16, 32, 64, 128])
@pytest.mark.parametrize("qlen", [1, 9, 33, 129])
def test_sm120_configs_forced(heads, qlen, fp8):
    from vllm_ddtree.attention_backends.mla_tree import SM120_SHARED_MEMORY_BYTES, select_config

    config = select_config(qlen * heads, HEAD_DIM, KV_LORA, torch.bfloat16,
                           SM120_SHARED_MEMORY_BYTES)
    assert config in MLA_TILE_CONFIGS
    specs = [(6000, "tree", qlen), (700, "chain", qlen)]
    batch = make_batch(specs, heads=heads, page_size=16 if heads % 16 else 64, seed=qlen)
    if fp8:
        check_fp8(to_fp8(batch), config=config)
    else:
        check(batch, config=config)
