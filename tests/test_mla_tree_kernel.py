# SPDX-License-Identifier: Apache-2.0
"""MLA tree-verify kernel vs its PyTorch reference, and the reference vs SDPA.

Without a GPU the Triton kernels run in the interpreter (tests/conftest.py sets
TRITON_INTERPRET=1 before triton's first import); with a GPU the same small cases run
compiled.
"""

import random
import textwrap

import pytest  # noqa: E402
import torch

triton = pytest.importorskip("triton")
tl = triton.language

from kernel_testing import (  # noqa: E402
    DEVICE,
    TOLS,
    chain,
    compiled_shared_memory,
    random_tree,
    skip_unless_kernels_run_here,
)
from mla_testing import MLA_COMPILE_PRELUDE  # noqa: E402

from vllm_ddtree.attention_backends.mla_tree import (  # noqa: E402
    MLA_TILE_CONFIGS,
    SM120_SHARED_MEMORY_BYTES,
    ancestor_bits_from_parents,
    estimate_shared_memory_bytes,
    kernels,
    mla_tree_verify,
    mla_tree_verify_reference,
    num_mask_words,
    select_config,
)
from vllm_ddtree.attention_backends.mla_tree.configs import fit_config  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

needs_kernels = skip_unless_kernels_run_here(triton.language.max, kernels._page_ids)


def make_batch(
    specs,
    *,
    heads=2,
    kv_lora=64,
    rope=16,
    page_size=4,
    dtype=torch.float32,
    seed=0,
    num_words=None,
):
    """A verify batch. ``specs``: list of ``(context_len, parents)`` per request."""
    gen = torch.Generator().manual_seed(seed)
    head_dim = kv_lora + rope
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
    num_words = num_words or num_mask_words(max(qlens))
    bits = torch.cat([ancestor_bits_from_parents(p, num_words) for _, p in specs])
    qsl = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(sum(qlens), heads, head_dim, generator=gen)
    kv = torch.randn(num_blocks, page_size, head_dim, generator=gen)
    return dict(
        q=q.to(dtype).to(DEVICE),
        kv_cache=kv.to(dtype).to(DEVICE),
        block_table=block_table.to(DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        query_start_loc=qsl.to(DEVICE),
        ancestor_bits=bits.to(DEVICE),
        scale=head_dim**-0.5,
        kv_lora_rank=kv_lora,
    )


def assert_matches_reference(batch, **kwargs):
    out, lse = mla_tree_verify(**batch, **kwargs)
    ref_out, ref_lse = mla_tree_verify_reference(**batch)
    tol = TOLS[batch["q"].dtype]
    torch.testing.assert_close(out.float(), ref_out.float(), **tol)
    torch.testing.assert_close(lse, ref_lse, **tol)
    return out, lse


MIXED = [
    (10, [-1]),  # plain decode
    (0, chain(5)),  # chain, no context
    (37, [-1, 0, 0, 1, 1, 2, 0, 6, 3]),  # tree
    (70, chain(3)),  # chain, long context
    (5, [-1]),
]


@needs_kernels
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_batch_matches_reference(page_size, dtype):
    batch = make_batch(MIXED, page_size=page_size, dtype=dtype, seed=page_size)
    assert_matches_reference(batch, num_kv_splits=1)
    assert_matches_reference(batch)  # automatic split count


@needs_kernels
def test_padded_pages():
    """vLLM pads an MLA layer's page to the model's largest page (a GQA drafter beside
    the target, ``unify_kv_cache_spec_page_size``) when the backend indexes pages by
    the block stride, as ``TreeMLABackend`` declares: blocks sit further apart than
    ``page_size * head_dim`` elements, by an amount that is not a whole row."""
    batch = make_batch(MIXED, page_size=4, seed=11)
    kv = batch["kv_cache"]
    num_blocks, page, dim = kv.shape
    storage = torch.full((num_blocks, page * dim + 40), float("nan"), device=DEVICE)
    padded = storage[:, : page * dim].view(num_blocks, page, dim)
    padded.copy_(kv)
    assert padded.stride(0) == page * dim + 40
    out, lse = assert_matches_reference({**batch, "kv_cache": padded})
    want_out, want_lse = mla_tree_verify(**batch)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)


def test_backend_lets_vllm_pad_its_pages():
    """A Kimi-K2-shaped MLA target (576-wide latent rows) beside a Kimi-K2.6-shaped
    DFlash drafter (8 KV heads x 128): the pages (18 KiB, 64 KiB at block 16) do not
    divide, so vLLM must pad the target's; before the stride order it refused to
    start ("page size is not divisible by the maximum page size")."""
    from vllm.v1.core.kv_cache_utils import unify_kv_cache_spec_page_size
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    from vllm_ddtree.attention_backends.mla_tree.backend import TreeMLABackend

    assert TreeMLABackend.indexes_kv_by_block_stride()
    target = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576,
                              dtype=torch.bfloat16, indexes_kv_by_block_stride=True)
    drafter = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128,
                                dtype=torch.bfloat16)
    assert drafter.page_size_bytes % target.page_size_bytes
    unified = unify_kv_cache_spec_page_size({"target": target, "drafter": drafter})
    assert unified["target"].page_size_bytes == drafter.page_size_bytes
    assert unified["target"].block_size == 16  # padded, not a larger block


@needs_kernels
@pytest.mark.parametrize("seed", range(4))
def test_random_trees(seed):
    rng = random.Random(seed)
    specs = [(rng.randrange(0, 71), random_tree(rng.randrange(1, 12), rng)) for _ in range(3)]
    batch = make_batch(specs, heads=rng.choice([2, 3, 4]), page_size=rng.choice([1, 4, 16]))
    assert_matches_reference(batch, num_kv_splits=rng.choice([1, 2, 5]))


@needs_kernels
def test_multi_split_equals_single_split():
    batch = make_batch([(70, random_tree(9, random.Random(1))), (45, chain(4))], page_size=4)
    one, lse_one = mla_tree_verify(**batch, num_kv_splits=1)
    for splits in (2, 3, 8):
        out, lse = mla_tree_verify(**batch, num_kv_splits=splits)
        torch.testing.assert_close(out, one, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse, lse_one, atol=1e-5, rtol=1e-5)


@needs_kernels
def test_more_than_64_new_tokens_uses_second_mask_word():
    rng = random.Random(7)
    batch = make_batch([(20, random_tree(70, rng)), (3, [-1])], heads=2, page_size=16)
    assert batch["ancestor_bits"].shape[1] == 2
    assert_matches_reference(batch, num_kv_splits=2)


@needs_kernels
def test_non_power_of_two_dims():
    batch = make_batch(MIXED[:3], kv_lora=48, rope=8, page_size=4)
    assert_matches_reference(batch, num_kv_splits=2)


@needs_kernels
def test_no_rope_dims():
    batch = make_batch(MIXED[:3], kv_lora=32, rope=0, page_size=4)
    assert_matches_reference(batch)


@needs_kernels
def test_fp16_and_many_heads():
    batch = make_batch(MIXED[:3], heads=16, dtype=torch.float16, page_size=16)
    assert_matches_reference(batch, num_kv_splits=2)


@needs_kernels
def test_tree_mask_matters():
    parents = [-1, 0, 0, 1, 2]
    batch = make_batch([(6, parents)], page_size=4)
    out, _ = mla_tree_verify(**batch)
    bits = batch["ancestor_bits"].clone()
    bits[3, 0] &= ~(1 << 1)  # token 3 no longer sees its parent 1
    out2, _ = mla_tree_verify(**{**batch, "ancestor_bits": bits})
    changed = (out2 - out).abs().amax(dim=(1, 2))
    assert changed[3] > 1e-3
    assert torch.all(changed[[0, 1, 2, 4]] == 0)
    ref_out, _ = mla_tree_verify_reference(**{**batch, "ancestor_bits": bits})
    torch.testing.assert_close(out2, ref_out, **TOLS[torch.float32])


@needs_kernels
def test_row_without_visible_keys():
    batch = make_batch([(0, [-1, 0])], page_size=4)
    batch["ancestor_bits"][1] = 0  # token 1 sees nothing (outside the contract)
    out, lse = assert_matches_reference(batch)
    assert torch.all(out[1] == 0) and torch.all(lse[1] == float("-inf"))


@needs_kernels
def test_no_sync_mode_matches():
    batch = make_batch(MIXED, page_size=4)
    ref, _ = mla_tree_verify(**batch)
    out, _ = mla_tree_verify(**batch, validate_values=False, max_query_len=9, max_seq_len=73)
    torch.testing.assert_close(out, ref, atol=0, rtol=0)


@needs_kernels
def test_graph_sized_launch_matches():
    """Under FULL CUDA graphs the backend sizes the KV split for max_model_len, far
    above the batch's contexts: most splits are empty and must not change the result."""
    batch = make_batch(MIXED, page_size=4)
    out, lse = mla_tree_verify(**batch, validate_values=False, max_query_len=9,
                               max_seq_len=4096, num_kv_splits=16)
    assert_matches_reference(batch)
    ref, ref_lse = mla_tree_verify(**batch)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse, ref_lse, atol=2e-5, rtol=2e-5)


@triton.jit
def _runtime_splits_probe(KeyTiles, BaseCtas, Slots, GridSplits, Out,
                          MIN_TILES: tl.constexpr, MAX_SPLITS: tl.constexpr):
    i = tl.program_id(0)
    choice = kernels._runtime_num_splits(
        tl.load(KeyTiles + i), tl.load(BaseCtas + i), tl.load(Slots + i),
        tl.load(GridSplits + i), MIN_TILES, MAX_SPLITS)
    tl.store(Out + i, choice)


@needs_kernels
def test_runtime_split_choice_is_the_host_choice():
    """The device's split choice (CUDA graphs) equals ``select_num_kv_splits`` for the
    request's own length, capped by the grid's splits, ties to the fewest splits."""
    from vllm_ddtree.attention_backends.mla_tree.configs import (
        MAX_KV_SPLITS,
        MIN_TILES_PER_SPLIT,
        select_num_kv_splits,
    )

    rng = random.Random(0)
    cases = [(0, 1, 132, 31), (1, 17, 132, 31), (256, 17, 132, 31), (2048, 17, 132, 31),
             (256, 9, 264, 29), (2560, 3, 264, 128), (4096, 600, 132, 128)]
    cases += [(rng.randrange(0, 5000), rng.randrange(1, 700), rng.choice([16, 132, 264, 188]),
               rng.randrange(1, 129)) for _ in range(200)]
    cols = [torch.tensor(c, dtype=torch.int32, device=DEVICE) for c in zip(*cases, strict=True)]
    out = torch.empty(len(cases), dtype=torch.int32, device=DEVICE)
    _runtime_splits_probe[(len(cases),)](*cols, out, MIN_TILES=MIN_TILES_PER_SPLIT,
                                         MAX_SPLITS=MAX_KV_SPLITS)
    expected = [
        select_num_kv_splits(num_requests=1, row_blocks=base, max_seq_len=max(tiles, 1) * 64,
                             block_n=64, num_sms=slots, ctas_per_sm=1,
                             max_splits=min(grid, MAX_KV_SPLITS))
        for tiles, base, slots, grid in cases
    ]
    assert out.tolist() == expected
    assert len(set(expected)) > 10  # the cases span many choices, not 1 everywhere


@pytest.mark.parametrize("num_requests,row_blocks,slots", [(1, 17, 132), (8, 18, 132),
                                                             (1, 9, 132), (3, 1, 16)])
def test_runtime_grid_fits_every_length(num_requests, row_blocks, slots):
    """The grid of a run-time-split launch is the most splits any length up to
    ``max_seq_len`` would take (brute force over every length), not the choice at
    ``max_seq_len``: 1 request x 9 row blocks takes 44 splits at 85k but 29 at 160k."""
    from vllm_ddtree.attention_backends.mla_tree.configs import (
        max_num_kv_splits,
        select_num_kv_splits,
    )

    kw = dict(num_requests=num_requests, row_blocks=row_blocks, block_n=64, num_sms=slots,
              ctas_per_sm=1)
    for max_seq_len in (1, 700, 20000, 163840):
        brute = max(select_num_kv_splits(max_seq_len=tiles * 64, **kw)
                    for tiles in range(1, -(-max_seq_len // 64) + 1))
        assert max_num_kv_splits(max_seq_len=max_seq_len, **kw) == brute
    if (num_requests, row_blocks, slots) == (1, 9, 132):  # the example above
        assert max_num_kv_splits(max_seq_len=163840, **kw) == 44
        assert select_num_kv_splits(max_seq_len=163840, **kw) == 29


@needs_kernels
def test_runtime_splits_launch_matches():
    """A graph-sized grid (16 splits for 8k keys) with run-time split counts: the long
    request takes fewer splits than the grid, the short one one; same result."""
    from vllm_ddtree.attention_backends.mla_tree.configs import select_num_kv_splits

    specs = [(2000, chain(3)), (300, [-1, 0, 0])]
    batch = make_batch(specs, page_size=16, seed=3)
    config = select_config(3 * 2, 80, 64, torch.float32)
    own = [select_num_kv_splits(num_requests=2, row_blocks=1, max_seq_len=c + 3,
                                block_n=config.block_n, num_sms=8,
                                ctas_per_sm=config.ctas_per_sm) for c, _ in specs]
    assert 1 < own[0] < 16 and own[1] == 1  # the premise: run-time counts differ from 16
    out, lse = mla_tree_verify(**batch, validate_values=False, max_query_len=3,
                               max_seq_len=8192, num_kv_splits=16, runtime_kv_splits=True)
    ref_out, ref_lse = mla_tree_verify_reference(**batch)
    torch.testing.assert_close(out.float(), ref_out.float(), **TOLS[torch.float32])
    torch.testing.assert_close(lse, ref_lse, **TOLS[torch.float32])


# ---------------------------------------------------------------------------------------
# The reference itself, against a brute-force dense computation.


def brute_force(batch, specs):
    """Dense K/V per request, mask from the parent lists, torch SDPA."""
    q, kv = batch["q"].float().cpu(), batch["kv_cache"].float().cpu()
    bt, lora = batch["block_table"].cpu(), batch["kv_lora_rank"]
    page = kv.shape[1]
    outs, lses, start = [], [], 0
    for r, (ctx, parents) in enumerate(specs):
        n = len(parents)
        seq = ctx + n
        keys = torch.stack([kv[bt[r, p // page], p % page] for p in range(seq)])
        mask = torch.zeros(n, seq, dtype=torch.bool)
        mask[:, :ctx] = True
        for t in range(n):
            a = t
            while a >= 0:
                mask[t, ctx + a] = True
                a = parents[a]
        qr = q[start : start + n].transpose(0, 1)  # [H, n, D]
        out = torch.nn.functional.scaled_dot_product_attention(
            qr[None],
            keys[None, None].expand(1, qr.shape[0], seq, -1),
            keys[None, None, :, :lora].expand(1, qr.shape[0], seq, -1),
            attn_mask=mask,
            scale=batch["scale"],
        )[0]
        scores = (qr.double() @ keys.double().T) * batch["scale"]
        lse = torch.logsumexp(scores.masked_fill(~mask, float("-inf")), dim=-1)
        outs.append(out.transpose(0, 1))
        lses.append(lse.T.float())
        start += n
    return torch.cat(outs), torch.cat(lses)


@pytest.mark.parametrize("page_size", [1, 4])
def test_reference_matches_sdpa(page_size):
    rng = random.Random(page_size)
    specs = MIXED + [(rng.randrange(30), random_tree(8, rng)) for _ in range(3)]
    batch = make_batch(specs, heads=3, page_size=page_size)
    ref_out, ref_lse = mla_tree_verify_reference(**batch)
    bf_out, bf_lse = brute_force(batch, specs)
    torch.testing.assert_close(ref_out.cpu(), bf_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ref_lse.cpu(), bf_lse, atol=1e-5, rtol=1e-5)


def test_ancestor_bits_from_parents():
    bits = ancestor_bits_from_parents([-1, 0, 1, 0], num_words=1)
    assert bits[:, 0].tolist() == [0b1, 0b11, 0b111, 0b1001]
    deep = ancestor_bits_from_parents(chain(66))
    assert deep.shape == (66, 2)
    assert deep[63, 0].item() == -1  # all 64 bits set
    assert deep[65].tolist() == [-1, 0b11]
    with pytest.raises(ValueError, match="topological"):
        ancestor_bits_from_parents([-1, 2, 0])


# ---------------------------------------------------------------------------------------
# Input validation.


def test_validation_errors():
    batch = make_batch(MIXED, page_size=4)
    cases = [
        (dict(q=batch["q"][0]), "q must be a 3-D"),
        (dict(q=batch["q"].to(torch.int32)), "q must be bf16"),
        (dict(kv_cache=batch["kv_cache"].to(torch.float16)), "kv_cache dtype"),
        (dict(kv_cache=batch["kv_cache"][..., :-1]), "kv_cache last dim"),
        (dict(kv_lora_rank=40), "multiple of 16"),
        (dict(kv_lora_rank=96), "rope dim"),
        (dict(block_table=batch["block_table"].long()), "block_table must be torch.int32"),
        (dict(block_table=batch["block_table"][:, :2]), "block_table has 2 columns"),
        (dict(seq_lens=batch["seq_lens"][:-1]), "query_start_loc must have"),
        (dict(seq_lens=batch["seq_lens"] * 0), "seq_lens\\[0\\]"),
        (dict(ancestor_bits=batch["ancestor_bits"].int()), "ancestor_bits must be torch.int64"),
        (dict(ancestor_bits=batch["ancestor_bits"][:-1]), "one row per query token"),
        (dict(ancestor_bits=batch["ancestor_bits"][:, :0]), "at least one int64 word"),
        (dict(scale=float("nan")), "scale"),
    ]
    for override, message in cases:
        with pytest.raises(ValueError, match=message):
            mla_tree_verify(**{**batch, **override})
    with pytest.raises(ValueError, match="num_kv_splits"):
        mla_tree_verify(**batch, num_kv_splits=0)
    with pytest.raises(ValueError, match="max_query_len and max_seq_len are required"):
        mla_tree_verify(**batch, validate_values=False)
    bad_pages = batch["block_table"].clone()
    bad_pages[0, 0] = 10_000
    with pytest.raises(ValueError, match="outside the cache"):
        mla_tree_verify(**{**batch, "block_table": bad_pages})


def test_w_too_small_for_query_len():
    batch = make_batch([(3, chain(70))], page_size=4)
    with pytest.raises(ValueError, match="W=1 words per row"):
        mla_tree_verify(**{**batch, "ancestor_bits": batch["ancestor_bits"][:, :1]})
    with pytest.raises(ValueError, match="W=1 words per row"):
        mla_tree_verify(
            **{**batch, "ancestor_bits": batch["ancestor_bits"][:, :1]},
            validate_values=False,
            max_query_len=70,
            max_seq_len=73,
        )


# ---------------------------------------------------------------------------------------
# Tile configs and shared memory (sm_120: 99 KiB per block).


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_config_fits_sm120_shared_memory(dtype):
    for config in MLA_TILE_CONFIGS:
        used = estimate_shared_memory_bytes(config, 576, 512, dtype)
        assert used <= SM120_SHARED_MEMORY_BYTES, (config, used)
        assert config.block_n <= 64


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dims", [(576, 512), (80, 64), (288, 256)])
def test_selected_config_fits(dtype, dims):
    for rows in (1, 16, 64, 520, 8192):
        config = select_config(rows, *dims, dtype)
        assert estimate_shared_memory_bytes(config, *dims, dtype) <= 99 * 1024
    assert fit_config(MLA_TILE_CONFIGS[0], 576, 512, torch.bfloat16) == MLA_TILE_CONFIGS[0]


_COMPILE_SCRIPT = MLA_COMPILE_PRELUDE + textwrap.dedent(
    """
    # the active-row variant (re-split) compiles too; page 16 (vLLM's default block
    # size) takes the multi-page tile path; CUDA graphs capture the run-time splits
    variants = ((False, 64, False), (True, 64, False), (False, 16, False), (False, 64, True))
    print(json.dumps([max(shared_bytes(cfg, page=page, has_active=has_active, runtime=runtime)
                          for has_active, page, runtime in variants)
                      for cfg in MLA_TILE_CONFIGS]))
    """
)


def test_compiled_sm120_shared_memory_within_estimate():
    """Compile each config for sm_120 (no GPU needed) and compare with the estimate."""
    shared = compiled_shared_memory(_COMPILE_SCRIPT)
    for config, used in zip(MLA_TILE_CONFIGS, shared, strict=True):
        assert used <= SM120_SHARED_MEMORY_BYTES, (config, used)
        assert used <= estimate_shared_memory_bytes(config, 576, 512, torch.bfloat16)


def test_large_tiles_only_where_shared_memory_allows():
    import torch

    from vllm_ddtree.attention_backends.mla_tree.configs import (
        LARGE_SMEM_TILE_CONFIGS,
        MLA_TILE_CONFIGS,
        SM120_SHARED_MEMORY_BYTES,
        estimate_shared_memory_bytes,
        select_config,
    )

    for rows in (1, 16, 64, 520, 8192):
        cfg = select_config(rows, 576, 512, torch.bfloat16, SM120_SHARED_MEMORY_BYTES)
        assert cfg in MLA_TILE_CONFIGS
        assert estimate_shared_memory_bytes(cfg, 576, 512, torch.bfloat16) <= 99 * 1024
    hopper = 227 * 1024
    assert select_config(520, 576, 512, torch.bfloat16, hopper) == LARGE_SMEM_TILE_CONFIGS[0]
    assert select_config(16, 576, 512, torch.bfloat16, hopper) in MLA_TILE_CONFIGS
