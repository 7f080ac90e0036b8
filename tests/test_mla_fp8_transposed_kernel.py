# SPDX-License-Identifier: Apache-2.0
"""The fp8-cache MLA tree-verify kernel with transposed products (``KV_FP8_TRANSPOSED``,
``configs.FP8_TRANSPOSED_TILE_CONFIGS``) against the fp32 reference on the dequantized
cache, with the tolerances of the fp8 kernel's tests (tests/test_mla_fp8_kernel.py).

Without a GPU the kernel runs in Triton's interpreter (tests/conftest.py): DeepSeek's
dims (512 + 64: four 128-column chunks) at small head counts, smaller latent dims where
many heads and rows make the interpreter slow. The compile tests check, for sm_90a and
sm_120a without a GPU, what the transposition is for (evals/kernel_structure.py).
"""

import random
import textwrap

import pytest
import torch

triton = pytest.importorskip("triton")

from kernel_testing import (  # noqa: E402
    DEVICE,
    TOLS,
    chain,
    compiled_shared_memory,
    random_tree,
    skip_unless_kernels_run_here,
)
from mla_testing import MLA_COMPILE_PRELUDE  # noqa: E402
from test_mla_fp8_kernel import FP8, dequantized, fp8_batch  # noqa: E402
from test_mla_tree_kernel import MIXED, make_batch  # noqa: E402

from vllm_ddtree.attention_backends.mla_tree import (  # noqa: E402
    kernels,
    mla_tree_verify,
    mla_tree_verify_reference,
    ops,
)
from vllm_ddtree.attention_backends.mla_tree.configs import (  # noqa: E402
    FP8_TRANSPOSED_TILE_CONFIGS,
    SM120_SHARED_MEMORY_BYTES,
    estimate_shared_memory_bytes,
    select_config,
)

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning")]
needs_kernels = skip_unless_kernels_run_here(kernels._mla_tree_fwd_kernel)

M16, M32 = FP8_TRANSPOSED_TILE_CONFIGS
DEEPSEEK = dict(kv_lora=512, rope=64)
HOPPER_SHARED_MEMORY_BYTES = 227 * 1024


@pytest.fixture(autouse=True)
def hopper_shared_memory(monkeypatch):
    """The launcher's shared-memory budget is Hopper's, the configs' target: off CUDA it
    is sm_120's 99 KB, where ``fit_config`` would shrink the 32-row tile (111 KB at
    DeepSeek's dims) to 32 keys and the tests would not run it as launched on sm_90."""
    monkeypatch.setattr(ops, "_max_shared_memory", lambda device: HOPPER_SHARED_MEMORY_BYTES)


def check(batch, config, rows=None, **kwargs):
    """The transposed kernel's ``(out, lse)`` against the reference on the dequantized
    cache (only ``rows``, a bool ``[T, H]`` mask, when given)."""
    out, lse = mla_tree_verify(**batch, config=config, kernel="triton", **kwargs)
    ref_out, ref_lse = mla_tree_verify_reference(
        **dequantized(batch), active_query_lens=kwargs.get("active_query_lens"))
    if rows is not None:
        out, lse, ref_out, ref_lse = out[rows], lse[rows], ref_out[rows], ref_lse[rows]
    # fp16 MMAs (p in fp16) whatever the output's dtype
    tol = TOLS[torch.float16 if batch["out_dtype"] == torch.float32 else batch["out_dtype"]]
    torch.testing.assert_close(out.float(), ref_out.float(), **tol)
    torch.testing.assert_close(lse, ref_lse, **tol)
    return out, lse


@needs_kernels
@pytest.mark.parametrize("config", [M16, M32], ids=["m16", "m32"])
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_deepseek_dims_pages_and_masked_tails(config, page_size):
    """kv_lora_rank 512 + rope 64 (four 128-column chunks, the permuted column orders)
    at pages of 1 / 16 / 64 keys. Contexts end inside a 64-key tile (masked tails), new
    tokens straddle tile ends, one request has no context; one and several splits."""
    specs = [(130, [-1, 0, 0, 1, 1, 2, 0, 6, 3]), (0, chain(5)), (63, chain(3)), (200, [-1])]
    batch = fp8_batch(specs, page_size=page_size, heads=8, seed=page_size, **DEEPSEEK)
    check(batch, config, num_kv_splits=1)
    check(batch, config, num_kv_splits=3)


@needs_kernels
@pytest.mark.parametrize("heads,qlen", [(8, 129), (16, 33), (64, 9), (128, 2)])
def test_heads_and_query_rows(heads, qlen):
    """8 to 128 heads, 2 to 129 query rows (129 new tokens: the tree mask's second and
    third 64-bit words), each with the tile config the rows suit; a 64-column latent
    (one chunk) keeps the interpreter quick."""
    rng = random.Random(heads)
    config = M16 if heads * qlen <= 32 else M32
    specs = [(70, random_tree(qlen, rng)), (5, chain(min(qlen, 4)))]
    batch = fp8_batch(specs, page_size=16, heads=heads, seed=qlen, kv_lora=64, rope=16)
    check(batch, config, num_kv_splits=2)


@needs_kernels
@pytest.mark.parametrize("dims", [(256, 64), (48, 8), (32, 0), (128, 16), (320, 40)])
def test_other_latent_widths(dims):
    """Two 128-column chunks, a padded 64-column one, no rope, one whole chunk, and four
    chunks of which the third is half padding and the fourth all (a padded rope part)."""
    kv_lora, rope = dims
    batch = fp8_batch(MIXED, page_size=4, heads=3, seed=kv_lora, kv_lora=kv_lora, rope=rope)
    check(batch, M16, num_kv_splits=2)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fp32_and_fp16_outputs(dtype):
    batch = fp8_batch(MIXED[:3], out_dtype=dtype, page_size=16, heads=2, **DEEPSEEK)
    check(batch, M16, num_kv_splits=2)


@needs_kernels
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy on inf / NaN
def test_non_finite_query_stays_in_its_row():
    """One q entry NaN (e4m3 has no inf): the other rows of its tile (the same CTA: the
    query rows are the columns of the transposed products) still match the reference."""
    batch = fp8_batch(MIXED[2:4], page_size=16, heads=2, seed=11, **DEEPSEEK)
    token, head = 3, 1
    batch["q"].view(torch.uint8)[token, head, 5] = 0x7F  # e4m3 NaN
    good = torch.ones(batch["q"].shape[:2], dtype=torch.bool, device=DEVICE)
    good[token, head] = False
    check(batch, M16, rows=good, num_kv_splits=2)


@needs_kernels
def test_rows_at_the_e4m3_extremes():
    """Rows of one tile at e4m3's edges: zero, subnormals only (2^-9 .. 2^-7), every
    entry saturated (+-448, the rope part too): widened to fp16 exactly, one scale for
    every column of the transposed scores."""
    batch = fp8_batch(MIXED[2:4], page_size=16, heads=2, seed=17, **DEEPSEEK)
    q = batch["q"].float()
    q[0, 0] = 0.0
    q[1, 1] = q[1, 1].sign() * 2.0**-9 * torch.randint(1, 8, q[1, 1].shape, device=DEVICE)
    q[3, 1] = q[3, 1].sign() * 448.0
    batch["q"] = q.to(torch.float8_e4m3fn)
    assert batch["q"].float().equal(q)
    batch["scale"] = 2e-3
    check(batch, M16, num_kv_splits=1)
    check(batch, M32, num_kv_splits=3)


@needs_kernels
def test_active_rows_and_runtime_splits():
    """The adaptive budget's active rows (re-split over idle CTAs) and the CUDA-graph
    launch (grid sized for a longer context, split count per request)."""
    specs = [(150, random_tree(9, random.Random(3))), (20, chain(9))]
    batch = fp8_batch(specs, page_size=16, seed=5, **DEEPSEEK)
    active = torch.tensor([4, 1], dtype=torch.int32, device=DEVICE)
    rows = torch.zeros(batch["q"].shape[:2], dtype=torch.bool, device=DEVICE)
    rows[[0, 1, 2, 3, 9]] = True
    check(batch, M16, rows=rows, active_query_lens=active)
    check(batch, M16, validate_values=False, max_query_len=9, max_seq_len=4096,
          num_kv_splits=8, runtime_kv_splits=True)


@needs_kernels
def test_bits_above_the_diagonal_are_ignored():
    """Every ancestor bit set, those of later tokens too (outside the mask contract, which
    the kernels ignore: a token sees new tokens ``j <= t`` only), as in the reference."""
    specs = [(70, chain(70)), (3, [-1, 0, 0, 1])]
    batch = fp8_batch(specs, page_size=16, heads=2, seed=4, kv_lora=64, rope=16)
    batch["ancestor_bits"] = torch.full_like(batch["ancestor_bits"], -1)
    check(batch, M16, num_kv_splits=2)
    check(batch, M32, num_kv_splits=1)


# The FLASHMLA comparison's flip (tests/gpu/test_fp8_kv_vllm.py): prompt 3 and the 20
# tokens both backends gave before parting (evals/check_mla_backend.py's prompts).
FLIP_PROMPT = [3 + (7 * i) % 900 for i in range(130)]
FLIP_PREFIX = [84, 269, 360, 269, 337, 478, 596, 527, 275, 13, 437, 13, 479, 13, 3139, 84, 13,
               3139, 84, 13]


@needs_kernels
def test_real_decode_rows_within_bf16_rounding_of_the_exact_attention(monkeypatch):
    """On the embedded target's own queries and cache where our backend and FLASHMLA
    parted (every layer; the 20 decode rows of the shared prefix, which decide tokens
    1-20, verified as one chain over the prompt; e4m3 query and cache as vLLM writes
    them), row by row: the transposed kernel's fp32 output is within 5e-4 of the exact
    attention (relative; under a third of bf16's rounding, 1.2-2.0e-3 here), and its
    bf16 output is that result rounded once, so nothing in the kernel moves a row more
    than the output's rounding. (Triton's interpreter casts fp32 to bf16 by truncation,
    twice round-to-nearest's error: 3.1-4.5e-3 here, which an earlier bound of 2.5x the
    rounding read as the kernel's own; a GPU rounds to nearest. FlashMLA's fp8 PV
    product, P rounded to e4m3, is 1.8e-3 to 1.1e-2 from the exact attention on these
    rows.) Compiled on a GPU too (sm_90's fp8 rule picks this kernel for the embedded
    target's short contexts)."""
    from vllm_ddtree.demo.reference_engine import CHECKPOINTS, load_embedded_pair
    from vllm_ddtree.testing import fp8_mla_reference

    if not (CHECKPOINTS / "target" / "config.json").exists():
        pytest.skip("the embedded pair is not trained here")
    target = load_embedded_pair().target.float()
    captured = []
    quantize = fp8_mla_reference.e4m3
    monkeypatch.setattr(fp8_mla_reference, "e4m3",
                        lambda x, scale: captured.append(x.float()) or quantize(x, scale))
    fp8_mla_reference.fp8_cache_logits(target, FLIP_PROMPT, FLIP_PREFIX)
    scale = target.model.layers[0].self_attn.scaling
    one = torch.ones(1, device=DEVICE)
    context, rows = len(FLIP_PROMPT), len(FLIP_PREFIX)
    for q_rows, latents in zip(captured[::2], captured[1::2], strict=True):
        q = q_rows.clamp(-448, 448).to(FP8).transpose(0, 1)  # [rows, H, 576]
        k = latents.clamp(-448, 448).to(FP8)  # [S, 576]
        assert q.shape[0] == rows and k.shape[0] == context + rows
        batch = make_batch([(context, chain(rows))], heads=q.shape[1], kv_lora=512, rope=64,
                           page_size=16)
        cache = batch["kv_cache"].clone()
        for i in range(k.shape[0]):
            cache[batch["block_table"][0, i // 16], i % 16] = k[i].float()
        batch.update(q=q.to(DEVICE), kv_cache=cache.to(FP8), kv_scale=one, q_scale=one,
                     scale=scale, out_dtype=torch.bfloat16)
        out, _ = mla_tree_verify(**batch, config=M16, kernel="triton")
        wide, _ = mla_tree_verify(**{**batch, "out_dtype": torch.float32}, config=M16,
                                  kernel="triton")
        exact = mla_tree_verify_reference(**dequantized(batch))[0].float().cpu()

        ours_fp32 = relative_row_error(wide, exact)
        assert (ours_fp32 < 5e-4).all(), ours_fp32
        # the bf16 output is that result rounded once (at most a bf16 step from it)
        torch.testing.assert_close(out.float(), wide.to(torch.bfloat16).float(), atol=0,
                                   rtol=2.0**-7)


def relative_row_error(x: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """fp32 ``[rows]``: ``||x - exact|| / ||exact||`` per query row of ``[rows, ...]``."""
    diff = (x.float().cpu() - exact).flatten(1).norm(dim=1)
    return diff / exact.flatten(1).norm(dim=1)


def test_refused_on_a_16_bit_cache():
    batch = fp8_batch(MIXED[:2], page_size=4)
    batch["kv_cache"] = batch["kv_cache"].float().to(torch.bfloat16)
    batch["q"] = batch["q"].float().to(torch.bfloat16)
    for name in ("kv_scale", "q_scale", "out_dtype"):
        del batch[name]
    with pytest.raises(ValueError, match="config.fp8_transposed applies to an "
                                         "torch.float8_e4m3fn kv_cache only"):
        mla_tree_verify(**batch, config=M16)


def test_refused_past_its_widest_latent():
    """Eight 128-column chunks at most: a wider kv_lora_rank is refused by name, not
    left to the kernel's compile-time assertion."""
    batch = fp8_batch(MIXED[:1], page_size=4, heads=1, kv_lora=1536, rope=0)
    with pytest.raises(ValueError, match="config.fp8_transposed takes kv_lora_rank up to "
                                         "1024, got 1536"):
        mla_tree_verify(**batch, config=M16)


def test_chosen_by_sm_90s_fp8_rule_only():
    """sm_90's dispatch rule picks it for an fp8 cache (16-row tile below 32 rows);
    ``select_config`` (every other architecture, 16-bit caches) never does."""
    from vllm_ddtree.attention_backends.mla_tree import dispatch

    for heads, rows, method in ((8, 1, "fp8t_m16"), (8, 3, "fp8t_m16"), (16, 2, "fp8t_m32"),
                                (128, 257, "fp8t_m32")):
        assert dispatch.rule_method("sm_90", "fp8", heads, rows) == method
        assert dispatch.TRITON_CONFIGS[method].fp8_transposed
        assert not dispatch.TRITON_CONFIGS[dispatch.rule_method("sm_120", "fp8", heads,
                                                                rows)].fp8_transposed
    for rows in (1, 16, 64, 520, 8192):
        for budget in (SM120_SHARED_MEMORY_BYTES, 227 * 1024):
            assert not select_config(rows, 576, 512, torch.bfloat16, budget).fp8_transposed


_COMPILE_TRANSPOSED = MLA_COMPILE_PRELUDE + textwrap.dedent(
    """
    import sys
    sys.path.insert(0, "evals")
    from kernel_structure import SASS_BRANCH, ptx_byte_loads, sass_counts, ttgir_facts
    from kernel_spills import ptxas_report, sass_loops, sass_of
    from vllm_ddtree.attention_backends.mla_tree.configs import FP8_TRANSPOSED_TILE_CONFIGS

    m16, m32 = FP8_TRANSPOSED_TILE_CONFIGS
    variants = [(90, m16, dict(page=64)), (90, m32, dict(page=64)),
                (90, m16, dict(page=16, runtime=True)), (90, m16, dict(page=1, has_active=True)),
                (120, m16, dict(page=64)), (120, m16, dict(page=16, runtime=True))]
    rows = []
    for arch, cfg, kw in variants:
        k = compiled(cfg, arch, kv_fp8=True, **kw)
        sass = sass_of(k.asm["cubin"])
        loops = sass_loops(sass, SASS_BRANCH) if sass else []
        facts = ttgir_facts(k.asm["ttgir"])
        rows.append(dict(arch=arch, block_m=cfg.block_m, shared=k.metadata.shared,
                         byte_loads=ptx_byte_loads(k.asm["ptx"]), ptxas=ptxas_report(
                             k.asm["ptx"], arch), sass=sass_counts(sass, cfg.block_n),
                         loop_spills=[sum(" STL" in x or " LDL" in x for x in body)
                                      for body in loops], **facts))
    print(json.dumps(rows))
    """
)


def test_compiled_structure_sm90_and_sm120():
    """Compiled offline (pages 64 / 16 / 1, the graph's run-time splits, active rows):

    - sm_90a: every product of the unmasked KV loop is a wgmma taking A (the widened
      fp8 tile) from registers; no widened tile is written to shared memory (only the
      fp16 probabilities), no byte loads from it; the K and V tiles arrive by cp.async
      (none loaded to registers); the unmasked KV loop (nearly all the time at long
      context) holds no spill instruction in the 16-row tile, at most 8 in the 32-row
      one (reloads of loop-invariant scalars: the loop bound, shared addresses, the
      block-table pointer), the 16-row tile's masked loop at most 4;
    - shared memory within the estimate the configs are chosen by, within Hopper's
      227 KB, and for the 16-row tile within sm_120's 99 KB there."""
    rows = compiled_shared_memory(_COMPILE_TRANSPOSED)
    for r in rows:
        config = M16 if r["block_m"] == 16 else M32
        assert r["shared"] <= estimate_shared_memory_bytes(config, 576, 512, torch.bfloat16), r
        assert r["async_copies"] >= 2 and r["tile_loads"] == 0, r
        assert r["widened_to_smem"] == 0 and r["byte_loads"] == 0, r
        if r["arch"] == 120:
            assert r["shared"] <= SM120_SHARED_MEMORY_BYTES, r
            continue
        assert r["shared"] <= 227 * 1024, r
        assert r["wgmma_a_regs"] >= 2 and r["wgmma_a_smem"] == 0, r
        assert r["probs_to_smem"] == 64 * config.block_m * 2, r
        unmasked, masked = r["loop_spills"]
        if config is M16:
            assert unmasked == 0 and masked <= 4, r
        else:
            assert unmasked <= 8, r
