# SPDX-License-Identifier: Apache-2.0
"""GQA tree-verify kernel vs its PyTorch reference, and the reference vs SDPA.

Without a GPU the Triton kernel runs in the interpreter (see test_mla_tree_kernel.py for
how TRITON_INTERPRET is handled); with a GPU the same small cases run compiled.
"""

import random
import textwrap

import pytest  # noqa: E402
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

from vllm_ddtree.attention_backends.gqa_tree import (  # noqa: E402
    GQA_TILE_CONFIGS,
    estimate_shared_memory_bytes,
    gqa_tree_verify,
    gqa_tree_verify_reference,
    kernels,
    select_config,
)
from vllm_ddtree.attention_backends.mla_tree import (  # noqa: E402
    SM120_SHARED_MEMORY_BYTES,
    ancestor_bits_from_parents,
    num_mask_words,
)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

needs_kernels = skip_unless_kernels_run_here(
    triton.language.max, kernels._gqa_tree_fwd_kernel, kernels._dot
)


def make_batch(
    specs, *, q_heads=4, kv_heads=2, head_dim=32, page_size=4, dtype=torch.float32, seed=0
):
    """A verify batch. ``specs``: list of ``(context_len, parents)`` per request."""
    gen = torch.Generator().manual_seed(seed)
    qlens = [len(p) for _, p in specs]
    seq_lens = [c + n for (c, _), n in zip(specs, qlens, strict=True)]
    pages_per_req = [-(-s // page_size) for s in seq_lens]
    num_blocks = sum(pages_per_req) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    block_table = torch.full((len(specs), max(pages_per_req) + 2), -1, dtype=torch.int32)
    i = 0
    for r, n in enumerate(pages_per_req):
        block_table[r, :n] = torch.tensor(perm[i : i + n], dtype=torch.int32)
        i += n
    num_words = num_mask_words(max(qlens))
    bits = torch.cat([ancestor_bits_from_parents(p, num_words) for _, p in specs])
    qsl = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32)
    shape = (num_blocks, page_size, kv_heads, head_dim)
    return dict(
        q=torch.randn(sum(qlens), q_heads, head_dim, generator=gen).to(dtype).to(DEVICE),
        k_cache=torch.randn(shape, generator=gen).to(dtype).to(DEVICE),
        v_cache=torch.randn(shape, generator=gen).to(dtype).to(DEVICE),
        block_table=block_table.to(DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        query_start_loc=qsl.to(DEVICE),
        ancestor_bits=bits.to(DEVICE),
        scale=head_dim**-0.5,
    )


def assert_matches_reference(batch, **kwargs):
    out = gqa_tree_verify(**batch, **kwargs)
    ref = gqa_tree_verify_reference(**batch, **kwargs)
    torch.testing.assert_close(out.float(), ref.float(), **TOLS[batch["q"].dtype])
    return out


MIXED = [
    (10, [-1]),
    (0, chain(5)),
    (37, [-1, 0, 0, 1, 1, 2, 0, 6, 3]),
    (70, chain(3)),
]


@needs_kernels
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_batch_matches_reference(page_size, dtype):
    batch = make_batch(MIXED, page_size=page_size, dtype=dtype, seed=page_size)
    assert_matches_reference(batch)


@needs_kernels
@pytest.mark.parametrize("heads", [(2, 2), (8, 1), (6, 2)])
def test_group_sizes(heads):
    batch = make_batch(MIXED, q_heads=heads[0], kv_heads=heads[1], page_size=4)
    assert_matches_reference(batch)


@needs_kernels
@pytest.mark.parametrize("seed", range(3))
def test_random_trees(seed):
    rng = random.Random(seed)
    specs = [(rng.randrange(0, 71), random_tree(rng.randrange(1, 12), rng)) for _ in range(3)]
    batch = make_batch(specs, page_size=rng.choice([1, 4, 16]), seed=seed)
    assert_matches_reference(batch)


@needs_kernels
def test_more_than_64_new_tokens():
    batch = make_batch([(9, random_tree(70, random.Random(3))), (2, [-1])], page_size=16)
    assert batch["ancestor_bits"].shape[1] == 2
    assert_matches_reference(batch)


@needs_kernels
@pytest.mark.parametrize("window", [1, 3, 20])
def test_sliding_window(window):
    rng = random.Random(window)
    specs = MIXED + [(40, random_tree(10, rng)), (5, chain(12))]
    batch = make_batch(specs, page_size=4)
    assert_matches_reference(batch, sliding_window=window)


@needs_kernels
@pytest.mark.parametrize("window", [None, 9])
def test_multi_split_equals_single_split(window):
    batch = make_batch([(70, random_tree(9, random.Random(1))), (45, chain(4))], page_size=4)
    one = gqa_tree_verify(**batch, sliding_window=window, num_kv_splits=1)
    for splits in (2, 3, 8):
        out = gqa_tree_verify(**batch, sliding_window=window, num_kv_splits=splits)
        torch.testing.assert_close(out, one, atol=1e-5, rtol=1e-5)
    assert_matches_reference(batch, sliding_window=window)


@needs_kernels
def test_odd_head_dim_and_fp16():
    batch = make_batch(MIXED, head_dim=24, dtype=torch.float16, page_size=4)
    assert_matches_reference(batch)


@needs_kernels
def test_tree_mask_matters():
    batch = make_batch([(6, [-1, 0, 0, 1, 2])], page_size=4)
    out = gqa_tree_verify(**batch)
    bits = batch["ancestor_bits"].clone()
    bits[3, 0] &= ~(1 << 1)
    out2 = gqa_tree_verify(**{**batch, "ancestor_bits": bits})
    changed = (out2 - out).abs().amax(dim=(1, 2))
    assert changed[3] > 1e-3 and torch.all(changed[[0, 1, 2, 4]] == 0)


# ---------------------------------------------------------------------------------------
# The reference itself, against SDPA with masks built from the parent lists.


def brute_force(batch, specs, window=None):
    q, kc, vc = (batch[k].float().cpu() for k in ("q", "k_cache", "v_cache"))
    bt = batch["block_table"].cpu()
    page, group = kc.shape[1], q.shape[1] // kc.shape[2]
    outs, start = [], 0
    for r, (ctx, parents) in enumerate(specs):
        n, seq = len(parents), ctx + len(parents)
        keys = torch.stack([kc[bt[r, p // page], p % page] for p in range(seq)])
        values = torch.stack([vc[bt[r, p // page], p % page] for p in range(seq)])
        depth = [0] * n
        for t in range(1, n):
            depth[t] = depth[parents[t]] + 1 if parents[t] >= 0 else 0
        key_pos = list(range(ctx)) + [ctx + d for d in depth]
        mask = torch.zeros(n, seq, dtype=torch.bool)
        for t in range(n):
            mask[t, :ctx] = True
            a = t
            while a >= 0:
                mask[t, ctx + a] = True
                a = parents[a]
            if window is not None:
                for k in range(seq):
                    mask[t, k] &= key_pos[k] > ctx + depth[t] - window
        out = torch.nn.functional.scaled_dot_product_attention(
            q[start : start + n].transpose(0, 1)[None],
            keys.repeat_interleave(group, dim=1).transpose(0, 1)[None],
            values.repeat_interleave(group, dim=1).transpose(0, 1)[None],
            attn_mask=mask,
            scale=batch["scale"],
        )[0]
        outs.append(out.transpose(0, 1))
        start += n
    return torch.cat(outs)


@pytest.mark.parametrize("window", [None, 4])
def test_reference_matches_sdpa(window):
    rng = random.Random(11)
    specs = MIXED + [(rng.randrange(30), random_tree(8, rng)) for _ in range(3)]
    batch = make_batch(specs, q_heads=6, kv_heads=3, page_size=4)
    ref = gqa_tree_verify_reference(**batch, sliding_window=window)
    torch.testing.assert_close(ref.cpu(), brute_force(batch, specs, window), atol=1e-5, rtol=1e-5)


def test_validation_errors():
    batch = make_batch(MIXED, page_size=4)
    cases = [
        (dict(q=batch["q"][0]), "q must be a 3-D"),
        (dict(k_cache=batch["k_cache"][0]), "k_cache must be a 4-D"),
        (dict(v_cache=batch["v_cache"].half()), "v_cache dtype"),
        (dict(q=batch["q"][:, :3]), "multiple of the caches"),
        (dict(q=batch["q"][..., :16]), "head dim"),
        (dict(ancestor_bits=batch["ancestor_bits"][:-1]), "one row per query token"),
        (dict(seq_lens=batch["seq_lens"] - 80), "seq_lens\\[0\\]"),
        (dict(scale=float("inf")), "scale"),
    ]
    for override, message in cases:
        with pytest.raises(ValueError, match=message):
            gqa_tree_verify(**{**batch, **override})
    with pytest.raises(ValueError, match="sliding_window"):
        gqa_tree_verify(**batch, sliding_window=0)
    with pytest.raises(ValueError, match="num_kv_splits"):
        gqa_tree_verify(**batch, num_kv_splits=0)


def test_every_config_fits_sm120_shared_memory():
    for config in GQA_TILE_CONFIGS:
        for head_dim in (64, 128):
            used = estimate_shared_memory_bytes(config, head_dim, torch.bfloat16)
            assert used <= SM120_SHARED_MEMORY_BYTES, (config, head_dim, used)
    for head_dim in (24, 64, 128, 256):
        for dtype in (torch.float32, torch.bfloat16):
            for rows in (1, 64, 4096):
                config = select_config(rows, head_dim, dtype)
                assert estimate_shared_memory_bytes(config, head_dim, dtype) <= 99 * 1024


_COMPILE_SCRIPT = textwrap.dedent(
    """
    import json, triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from vllm_ddtree.attention_backends.gqa_tree import GQA_TILE_CONFIGS, kernels

    fn = kernels._gqa_tree_fwd_kernel
    ptrs = {n: "*bf16" for n in ("Q", "KCache", "VCache", "Out")}
    ptrs.update({"BlockTable": "*i32", "SeqLens": "*i32", "QueryStartLoc": "*i32",
                 "AncestorBits": "*i64", "Lse": "*fp32", "ActiveQueryLens": "*i32",
                 "MergeBase": "*i32", "MergeCount": "*i32"})
    result = []
    for cfg in GQA_TILE_CONFIGS:
        used = 0
        for has_active in (False, True):  # the active-row variant (re-split) compiles too
            consts = dict(GROUP=8, HEAD_DIM=128, BLOCK_D=128, PAGE_SIZE=16,
                          BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, HAS_WINDOW=False,
                          DOT_PRECISION="tf32", DOT_UPCAST=False, HAS_ACTIVE=has_active,
                          MIN_TILES=8, MAX_SPLITS=128)
            sig = {n: ptrs.get(n, "constexpr" if n in consts else
                               "fp32" if n == "qk_scale" else "i32") for n in fn.arg_names}
            attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
                     if n in ptrs or n[:8] in ("stride_k", "stride_v") or n == "stride_qt"}
            k = triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs),
                               target=GPUTarget("cuda", 120, 32),
                               options={"num_warps": cfg.num_warps,
                                        "num_stages": cfg.num_stages})
            used = max(used, k.metadata.shared)
        result.append(used)
    print(json.dumps(result))
    """
)


def test_compiled_sm120_shared_memory_within_estimate():
    shared = compiled_shared_memory(_COMPILE_SCRIPT)
    for config, used in zip(GQA_TILE_CONFIGS, shared, strict=True):
        assert used <= SM120_SHARED_MEMORY_BYTES, (config, used)
        assert used <= estimate_shared_memory_bytes(config, 128, torch.bfloat16)
