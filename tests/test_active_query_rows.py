# SPDX-License-Identifier: Apache-2.0
"""Per-request active query rows (adaptive tree budget) in the tree-verify kernels.

Only the first ``active_query_lens[r]`` query rows of request ``r`` are real tree nodes;
the kernels skip the others (no KV loads for a tile of inactive rows) and write
``out = 0, lse = -inf`` for them, while the active rows keep their exact results.
Covers the MLA and GQA kernels (one and several KV splits, i.e. the merge kernel), their
references, argument validation, ``TreeMaskState`` and the two backends' wiring.

Without a GPU the Triton kernels run in the interpreter (tests/conftest.py).
"""

import random
from types import SimpleNamespace as NS

import pytest
import torch

triton = pytest.importorskip("triton")

from kernel_testing import (  # noqa: E402
    DEVICE,
    TOLS,
    chain,
    kernels_run_here,
    random_tree,
    skip_unless_kernels_run_here,
)

from vllm_ddtree.attention_backends.gqa_tree import (  # noqa: E402
    GQATileConfig,
    gqa_tree_verify,
    gqa_tree_verify_reference,
)
from vllm_ddtree.attention_backends.gqa_tree import kernels as gqa_kernels  # noqa: E402
from vllm_ddtree.attention_backends.mla_tree import (  # noqa: E402
    MLATileConfig,
    ancestor_bits_from_parents,
    mla_tree_verify,
    mla_tree_verify_reference,
    num_mask_words,
)
from vllm_ddtree.attention_backends.mla_tree import kernels as mla_kernels  # noqa: E402
from vllm_ddtree.attention_backends.tree_mask_state import (  # noqa: E402
    ALL_ROWS_ACTIVE,
    TREE_MASK_STATE,
    TreeMaskState,
)

pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    # The default merge kernel weighs the unwritten partials of keyless splits by 0
    # before dropping them; the interpreter warns when that memory holds inf/NaN.
    pytest.mark.filterwarnings("ignore:invalid value encountered in multiply:RuntimeWarning"),
]

INTERPRETED = DEVICE == "cpu" and kernels_run_here(
    mla_kernels._mla_tree_fwd_kernel, gqa_kernels._gqa_tree_fwd_kernel
)
needs_kernels = skip_unless_kernels_run_here(
    triton.language.max, mla_kernels._mla_tree_fwd_kernel, gqa_kernels._gqa_tree_fwd_kernel
)

_rng = random.Random(5)
# (context_len, parents, active rows): contexts 0 and not multiples of the page size;
# active == query_len (all), == 1, a request with every row active next to one with
# few, a plain decode.
SPECS = [
    (0, chain(6), 6),
    (37, [-1, 0, 0, 1, 1, 2, 0, 6, 3], 1),
    (21, random_tree(11, _rng), 11),
    (70, random_tree(12, _rng), 5),
    (13, [-1], 1),
]


def paged_metadata(specs, page_size, gen):
    """Block table, seq_lens, query_start_loc, ancestor bits and active lens (CPU)."""
    qlens = [len(p) for _, p, _ in specs]
    seq_lens = [c + n for (c, _, _), n in zip(specs, qlens, strict=True)]
    pages = [-(-s // page_size) for s in seq_lens]
    num_blocks = sum(pages) + 3
    perm = torch.randperm(num_blocks, generator=gen)
    block_table = torch.full((len(specs), max(pages) + 1), -1, dtype=torch.int32)
    i = 0
    for r, n in enumerate(pages):
        block_table[r, :n] = perm[i : i + n].int()
        i += n
    words = num_mask_words(max(qlens))
    return num_blocks, dict(
        block_table=block_table,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()],
                                     dtype=torch.int32),
        ancestor_bits=torch.cat([ancestor_bits_from_parents(p, words) for _, p, _ in specs]),
    ), torch.tensor([a for _, _, a in specs], dtype=torch.int32)  # fmt: skip


def mla_batch(specs, *, page_size, heads=3, kv_lora=32, rope=16, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    num_blocks, meta, active = paged_metadata(specs, page_size, gen)
    dim = kv_lora + rope
    num_tokens = int(meta["query_start_loc"][-1])
    batch = dict(
        q=torch.randn(num_tokens, heads, dim, generator=gen).to(dtype),
        kv_cache=torch.randn(num_blocks, page_size, dim, generator=gen).to(dtype),
        **meta,
        scale=dim**-0.5,
        kv_lora_rank=kv_lora,
    )
    return {k: v.to(DEVICE) if torch.is_tensor(v) else v for k, v in batch.items()}, active.to(
        DEVICE
    )


def gqa_batch(specs, *, page_size, q_heads=6, kv_heads=2, dim=32, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    num_blocks, meta, active = paged_metadata(specs, page_size, gen)
    num_tokens = int(meta["query_start_loc"][-1])
    shape = (num_blocks, page_size, kv_heads, dim)
    batch = dict(
        q=torch.randn(num_tokens, q_heads, dim, generator=gen).to(dtype),
        k_cache=torch.randn(shape, generator=gen).to(dtype),
        v_cache=torch.randn(shape, generator=gen).to(dtype),
        **meta,
        scale=dim**-0.5,
    )
    return {k: v.to(DEVICE) if torch.is_tensor(v) else v for k, v in batch.items()}, active.to(
        DEVICE
    )


def active_row_mask(query_start_loc, active):
    """Bool ``[T]``: which query rows are active."""
    qsl = query_start_loc.tolist()
    mask = torch.zeros(qsl[-1], dtype=torch.bool)
    for r, a in enumerate(active.tolist()):
        mask[qsl[r] : qsl[r] + a] = True
    return mask.to(query_start_loc.device)


def nan_out(batch, width):
    """An output buffer full of NaN: inactive rows must be overwritten."""
    q = batch["q"]
    return torch.full((q.shape[0], q.shape[1], width), float("nan"), dtype=q.dtype,
                      device=q.device)  # fmt: skip


def mla_three_ways(batch, active, **kwargs):
    """The active-row launch (into a NaN buffer: inactive rows must be written), the fp32
    reference with the same active rows, the all-active launch, and the active-row mask:
    ``(out, lse, ref_out, ref_lse, full_out, full_lse, rows)``."""
    out, lse = mla_tree_verify(**batch, **kwargs, active_query_lens=active,
                               out=nan_out(batch, batch["kv_lora_rank"]))  # fmt: skip
    ref_out, ref_lse = mla_tree_verify_reference(**batch, active_query_lens=active)
    full_out, full_lse = mla_tree_verify(**batch, **kwargs)
    rows = active_row_mask(batch["query_start_loc"], active)
    return out, lse, ref_out, ref_lse, full_out, full_lse, rows


def gqa_three_ways(batch, active, **kwargs):
    """As :func:`mla_three_ways` for the GQA kernel: ``(out, ref, full, rows)``."""
    out = gqa_tree_verify(**batch, **kwargs, active_query_lens=active,
                          out=nan_out(batch, batch["q"].shape[2]))  # fmt: skip
    ref = gqa_tree_verify_reference(**batch, sliding_window=kwargs.get("sliding_window"),
                                    active_query_lens=active)
    full = gqa_tree_verify(**batch, **kwargs)
    return out, ref, full, active_row_mask(batch["query_start_loc"], active)


# ---------------------------------------------------------------------------------------
# MLA kernel


@needs_kernels
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("splits", [1, 3])
def test_mla_active_rows(page_size, splits):
    batch, active = mla_batch(SPECS, page_size=page_size, seed=page_size + splits)
    out, lse, ref_out, ref_lse, full_out, full_lse, rows = mla_three_ways(
        batch, active, num_kv_splits=splits)
    assert 0 < int(rows.sum()) < rows.numel()
    tol = TOLS[torch.float32]
    torch.testing.assert_close(out[rows], ref_out[rows], **tol)
    torch.testing.assert_close(lse[rows], ref_lse[rows], **tol)
    # The skip does not change the real rows beyond rounding (the active launch merges
    # its splits online, over a re-split when the context is long).
    torch.testing.assert_close(out[rows], full_out[rows], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse[rows], full_lse[rows], atol=1e-6, rtol=1e-6)
    assert torch.all(out[~rows] == 0)
    assert torch.all(lse[~rows] == float("-inf"))
    assert not full_out[~rows].eq(0).all()  # inactive rows do see keys without the lens


@needs_kernels
def test_mla_active_rows_bf16_large_pages_and_merge():
    rng = random.Random(3)
    specs = [(0, random_tree(20, rng), 7), (130, chain(3), 3), (66, random_tree(20, rng), 18)]
    batch, active = mla_batch(specs, page_size=64, heads=2, dtype=torch.bfloat16)
    out, lse, ref_out, ref_lse, full_out, full_lse, rows = mla_three_ways(
        batch, active, num_kv_splits=2)
    tol = TOLS[torch.bfloat16]
    torch.testing.assert_close(out.float(), ref_out.float(), **tol)
    torch.testing.assert_close(lse[rows], ref_lse[rows], **tol)
    torch.testing.assert_close(out[rows].float(), full_out[rows].float(), atol=8e-3, rtol=8e-3)
    torch.testing.assert_close(lse[rows], full_lse[rows], atol=1e-5, rtol=1e-6)
    assert torch.all(out[~rows] == 0) and torch.all(lse[~rows] == float("-inf"))


class _RecordedLaunch:
    """Wraps a jit kernel: ``kernel[grid](*args)`` runs it and keeps the arguments."""

    def __init__(self, kernel):
        self.kernel, self.calls = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls.append(args)
            return self.kernel[grid](*args, **kwargs)

        return launch


@needs_kernels
def test_mla_active_rows_resplit_keys_over_idle_ctas(monkeypatch):
    """Few active rows take over the CTAs of the inactive ones: their keys are split
    S_eff = (grid row blocks // active blocks) * S ways (capped at one split per 8 tiles), so
    a small budget inside a large tree shape is faster at long context, not only less
    work. Results match the reference and the all-active launch; MergeCount (read back
    from the merge launch) holds each row's split count, 0 for inactive rows."""
    rng = random.Random(11)
    # (context, tree, active). 8 tokens a CTA (2 heads, BLOCK_M 16), S = 2; the grid has
    # 6 row blocks (the 48-token tree), so a request has 12 CTAs. Splits: 12 // active
    # blocks, at most one per 8 key tiles of 16, at least S.
    specs = [(1000, random_tree(24, rng), 3),  # 1 active block: 12, cap 64 // 8 -> 8
             (650, chain(24), 24),  # 3 active blocks (all): 4 (cap 5)
             (600, random_tree(24, rng), 1),  # 1 active block: cap 39 // 8 -> 4
             (1000, random_tree(48, rng), 12)]  # 2 active blocks: 6; block 1 too
    batch, active = mla_batch(specs, page_size=16, heads=2)
    config = MLATileConfig(block_m=16, block_n=16, num_warps=4, num_stages=2)
    merge = _RecordedLaunch(mla_kernels._mla_tree_merge_kernel)
    monkeypatch.setattr(mla_kernels, "_mla_tree_merge_kernel", merge)
    out, lse, ref_out, ref_lse, full_out, full_lse, rows = mla_three_ways(
        batch, active, num_kv_splits=2, config=config)
    tol = TOLS[torch.float32]
    torch.testing.assert_close(out[rows], ref_out[rows], **tol)
    torch.testing.assert_close(lse[rows], ref_lse[rows], **tol)
    torch.testing.assert_close(out[rows], full_out[rows], **tol)
    assert torch.all(out[~rows] == 0) and torch.all(lse[~rows] == float("-inf"))

    merge_count = merge.calls[0][16].cpu()  # the active launch's MergeCount [T, H]
    want = torch.zeros(120, 2, dtype=torch.int32)
    want[0:3], want[24:48], want[48:49], want[72:84] = 8, 4, 4, 6
    assert torch.equal(merge_count, want), merge_count[:, 0].tolist()


def _count_calls(monkeypatch, module, name):
    """Count the calls of the jit helper ``module.name`` from interpreted kernels."""
    original = getattr(module, name)
    calls = []

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counting)
    return calls


def _expected_kv_tiles(ctx, qlen, active, tokens_per_cta, block_n):
    """KV tiles that the CTAs of one request load: a CTA runs iff its first token is
    active, up to the keys its last active token may see."""
    tiles = 0
    for first in range(0, qlen, tokens_per_cta):
        if first < active:
            last = min(first + tokens_per_cta, active)
            tiles += -(-(ctx + last) // block_n)
    return tiles


@pytest.mark.skipif(not INTERPRETED, reason="counts KV tile loads in Triton's interpreter")
def test_mla_skipped_tiles_load_no_kv(monkeypatch):
    """A CTA whose rows are all inactive loads no KV: the work is proportional to the
    active rows (3 CTAs of 8 tokens here)."""
    ctx, qlen = 40, 24
    batch, _ = mla_batch([(ctx, chain(qlen), qlen)], page_size=16, heads=2)
    config = MLATileConfig(block_m=16, block_n=16, num_warps=4, num_stages=2)
    calls = _count_calls(monkeypatch, mla_kernels, "_load_kv_tile")
    for active in (None, qlen, 9, 8, 1):
        lens = None if active is None else torch.tensor([active], dtype=torch.int32)
        calls.clear()
        mla_tree_verify(**batch, num_kv_splits=1, config=config, active_query_lens=lens)
        want = _expected_kv_tiles(ctx, qlen, active or qlen, 8, 16)
        assert len(calls) == want, (active, len(calls), want)
    # 3 + 4 + 4 tiles for all rows, 3 for the first token only
    assert _expected_kv_tiles(ctx, qlen, qlen, 8, 16) == 11
    assert _expected_kv_tiles(ctx, qlen, 1, 8, 16) == 3


# ---------------------------------------------------------------------------------------
# GQA kernel


@needs_kernels
@pytest.mark.parametrize(
    ("page_size", "splits", "window"), [(1, 1, None), (16, 3, None), (16, 1, 5), (64, 2, 9)]
)
def test_gqa_active_rows(page_size, splits, window):
    batch, active = gqa_batch(SPECS, page_size=page_size, seed=page_size + splits)
    out, ref, full, rows = gqa_three_ways(batch, active, sliding_window=window,
                                          num_kv_splits=splits)
    torch.testing.assert_close(out, ref, **TOLS[torch.float32])
    torch.testing.assert_close(out[rows], full[rows], atol=1e-6, rtol=1e-6)
    assert torch.all(out[~rows] == 0)
    assert not full[~rows].eq(0).all()


@needs_kernels
def test_gqa_active_rows_bf16():
    batch, active = gqa_batch(SPECS, page_size=16, q_heads=8, kv_heads=2,
                              dtype=torch.bfloat16)  # fmt: skip
    out, ref, full, rows = gqa_three_ways(batch, active, num_kv_splits=2)
    torch.testing.assert_close(out.float(), ref.float(), **TOLS[torch.bfloat16])
    torch.testing.assert_close(out[rows].float(), full[rows].float(), atol=8e-3, rtol=8e-3)
    assert torch.all(out[~rows] == 0)


@needs_kernels
@pytest.mark.parametrize("window", [None, 100])
def test_gqa_active_rows_resplit_keys_over_idle_ctas(monkeypatch, window):
    """The GQA kernel re-splits like the MLA one, per (request, KV head): 3 query heads
    a KV head, BLOCK_M 16 (5 1/3 tokens), 9 row blocks (the 48-token tree), S = 2. A
    sliding window caps the splits by the keys it can see (100 + query length)."""
    rng = random.Random(12)
    specs = [(1000, random_tree(24, rng), 3), (650, chain(24), 24),
             (600, random_tree(24, rng), 1), (1000, random_tree(48, rng), 12)]
    batch, active = gqa_batch(specs, page_size=16)
    config = GQATileConfig(block_m=16, block_n=16, num_warps=4, num_stages=2, min_rows=0)
    merge = _RecordedLaunch(mla_kernels._mla_tree_merge_kernel)
    monkeypatch.setattr(mla_kernels, "_mla_tree_merge_kernel", merge)
    out, ref, full, rows = gqa_three_ways(batch, active, sliding_window=window,
                                          num_kv_splits=2, config=config)
    torch.testing.assert_close(out, ref, **TOLS[torch.float32])
    torch.testing.assert_close(out[rows], full[rows], **TOLS[torch.float32])
    assert torch.all(out[~rows] == 0)

    merge_count = merge.calls[0][16].cpu()  # [T, Hq] of the active launch
    want = torch.zeros(120, 6, dtype=torch.int32)
    # splits: 18 // active blocks x ..., capped at key tiles // 8 (at least S = 2)
    counts = (8, 2, 4, 6) if window is None else (2, 2, 2, 2)
    for (lo, hi), n in zip([(0, 3), (24, 48), (48, 49), (72, 84)], counts, strict=True):
        want[lo:hi] = n
    assert torch.equal(merge_count, want), merge_count[:, 0].tolist()


@pytest.mark.skipif(not INTERPRETED, reason="counts K/V tile loads in Triton's interpreter")
def test_gqa_skipped_tiles_load_no_kv(monkeypatch):
    ctx, qlen = 40, 24
    batch, _ = gqa_batch([(ctx, chain(qlen), qlen)], page_size=16, q_heads=4, kv_heads=2)
    config = GQATileConfig(block_m=16, block_n=16, num_warps=4, num_stages=2)
    calls = _count_calls(monkeypatch, gqa_kernels, "_load_kv")
    for active in (qlen, 9, 1):
        calls.clear()
        lens = torch.tensor([active], dtype=torch.int32)
        gqa_tree_verify(**batch, num_kv_splits=1, config=config, active_query_lens=lens)
        # K and V tiles, for each of the 2 KV heads; 8 tokens (group 2) per CTA
        assert len(calls) == 2 * 2 * _expected_kv_tiles(ctx, qlen, active, 8, 16), active


# ---------------------------------------------------------------------------------------
# References: the active rows are a prefix-closed tree, so they do not change.


@pytest.mark.parametrize("seed", range(3))
def test_references_active_rows_equal_full_rows(seed):
    rng = random.Random(seed)
    specs = []
    for _ in range(4):
        n = rng.randrange(1, 14)
        specs.append((rng.randrange(0, 40), random_tree(n, rng), rng.randrange(1, n + 1)))
    mla, active = mla_batch(specs, page_size=4, seed=seed)
    rows = active_row_mask(mla["query_start_loc"], active)
    out, lse = mla_tree_verify_reference(**mla, active_query_lens=active)
    full_out, full_lse = mla_tree_verify_reference(**mla)
    torch.testing.assert_close(out[rows], full_out[rows], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse[rows], full_lse[rows], atol=1e-6, rtol=1e-6)
    assert torch.all(out[~rows] == 0) and torch.all(lse[~rows] == float("-inf"))

    gqa, _ = gqa_batch(specs, page_size=4, seed=seed)
    for window in (None, 3):
        out = gqa_tree_verify_reference(**gqa, sliding_window=window, active_query_lens=active)
        full = gqa_tree_verify_reference(**gqa, sliding_window=window)
        torch.testing.assert_close(out[rows], full[rows], atol=1e-6, rtol=1e-6)
        assert torch.all(out[~rows] == 0)


# ---------------------------------------------------------------------------------------
# Validation


@pytest.mark.parametrize("kind", ["mla", "gqa"])
def test_active_query_lens_validation(kind):
    if kind == "mla":
        batch, active = mla_batch(SPECS, page_size=4)
        fn = mla_tree_verify
    else:
        batch, active = gqa_batch(SPECS, page_size=4)
        fn = gqa_tree_verify
    qlens = [len(p) for _, p, _ in SPECS]
    zero, too_long = active.clone(), active.clone()
    zero[2] = 0
    too_long[3] = qlens[3] + 1
    cases = [
        (active.long(), "active_query_lens must be torch.int32"),
        (active[:-1], "active_query_lens must have shape \\[5\\]"),
        (active[None], "active_query_lens must have shape"),
        (active.tolist(), "active_query_lens must be a torch.Tensor"),
        (zero, "active_query_lens\\[2\\]=0 must be in \\[1, 11\\]"),
        (too_long, f"active_query_lens\\[3\\]={qlens[3] + 1} must be in \\[1, {qlens[3]}\\]"),
    ]
    for value, message in cases:
        with pytest.raises(ValueError, match=message):
            fn(**batch, active_query_lens=value)


# ---------------------------------------------------------------------------------------
# TreeMaskState and the backends


@pytest.fixture
def tree_state():
    """``TREE_MASK_STATE`` for one test, restored afterwards."""
    names = ("ancestor_bits", "active", "active_query_lens", "adaptive")
    saved = {n: getattr(TREE_MASK_STATE, n) for n in names}
    yield TREE_MASK_STATE
    for n, v in saved.items():
        setattr(TREE_MASK_STATE, n, v)


def test_tree_mask_state_active_buffer():
    state = TreeMaskState()
    assert not state.adaptive and state.active_query_lens is None
    assert state.decode_active_query_lens(3) is None
    buf = state.allocate_active(8, DEVICE)
    assert buf.dtype == torch.int32 and buf.shape == (8,)
    assert torch.all(buf == ALL_ROWS_ACTIVE)  # unfilled: every row computed
    assert state.allocate_active(4, DEVICE) is buf  # persistent (CUDA graphs)
    state.active = True
    assert state.decode_active_query_lens(3) is None  # not adaptive
    state.adaptive = True
    view = state.decode_active_query_lens(3)
    assert view.shape == (3,) and view.data_ptr() == buf.data_ptr()
    state.active = False
    assert state.decode_active_query_lens(3) is None  # no tree this step


def _decode_specs():
    rng = random.Random(9)
    return [(ctx, random_tree(9, rng), a) for ctx, a in ((3, 2), (50, 9), (17, 1))]


def arm_tree_state(tree_state, ancestor_bits, active, adaptive):
    """A verify step with a tree: its bits, and the active rows of the first requests.
    Returns the persistent active-rows buffer."""
    tree_state.ancestor_bits = ancestor_bits.clone()
    tree_state.active = True
    tree_state.adaptive = adaptive
    tree_state.active_query_lens = None
    buf = tree_state.allocate_active(8, DEVICE)
    buf[: active.shape[0]] = active
    return buf


@needs_kernels
@pytest.mark.parametrize("adaptive", [True, False])
def test_mla_backend_passes_active_lens(adaptive, tree_state):
    from vllm_ddtree.attention_backends.mla_tree.backend import TreeMLAImpl, TreeMLAMetadataBuilder

    batch, active = mla_batch(_decode_specs(), page_size=16, heads=2)
    qsl = batch["query_start_loc"]
    buf = arm_tree_state(tree_state, batch["ancestor_bits"], active, adaptive)
    builder = TreeMLAMetadataBuilder.__new__(TreeMLAMetadataBuilder)  # only _build_decode
    builder._causal_bits = torch.zeros(64, 1, dtype=torch.int64, device=DEVICE)
    builder._max_model_len = 4096
    decode = builder._build_decode(
        block_table_tensor=batch["block_table"],
        seq_lens_device=batch["seq_lens"],
        max_seq_len=int(batch["seq_lens"].max()),
        query_start_loc_cpu=qsl.cpu(),
        query_start_loc_device=qsl,
        num_decode_tokens=int(qsl[-1]),
        dcp_tot_seq_lens_device=None,
    )
    impl = TreeMLAImpl.__new__(TreeMLAImpl)  # forward_mqa needs scale and kv_lora_rank
    impl.scale, impl.kv_lora_rank = batch["scale"], batch["kv_lora_rank"]
    out, lse = impl.forward_mqa(batch["q"], batch["kv_cache"], NS(decode=decode), None)
    rows = active_row_mask(qsl, active)
    want, want_lse = mla_tree_verify_reference(
        **batch, active_query_lens=active if adaptive else None
    )
    torch.testing.assert_close(out, want, **TOLS[torch.float32])
    torch.testing.assert_close(lse, want_lse, **TOLS[torch.float32])
    if adaptive:
        assert decode.active_query_lens.data_ptr() == buf.data_ptr()
        assert decode.active_query_lens.shape == (3,)
        assert torch.all(out[~rows] == 0)
    else:
        assert decode.active_query_lens is None
        assert not out[~rows].eq(0).all()


HQ, HKV, DIM, PAGE = 4, 2, 32, 16


def _fake_vllm_config():
    from vllm.config import CUDAGraphMode

    model = NS(
        get_num_attention_heads=lambda parallel: HQ,
        get_num_kv_heads=lambda parallel: HKV,
        get_head_size=lambda: DIM,
        rswa_window=None,
    )
    return NS(
        model_config=model,
        parallel_config=NS(decode_context_parallel_size=1),
        compilation_config=NS(cudagraph_mode=CUDAGraphMode.NONE, static_forward_context={}),
        scheduler_config=NS(max_num_seqs=8, max_num_batched_tokens=64),
        speculative_config=NS(num_speculative_tokens=4, parallel_drafting=True,
                              ddtree={"budget": 4}),
    )


@needs_kernels
@pytest.mark.parametrize("adaptive", [True, False])
def test_gqa_backend_passes_active_lens(adaptive, tree_state):
    """A verify-only batch (no prefill part, no KV write: the cache is random)."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    from vllm_ddtree.attention_backends.gqa_tree.backend import (
        TreeGQABackend,
        TreeGQAImpl,
        TreeGQAMetadataBuilder,
    )

    specs = _decode_specs()
    gen = torch.Generator().manual_seed(4)
    num_blocks, meta, active = paged_metadata(specs, PAGE, gen)
    meta = {k: v.to(DEVICE) for k, v in meta.items()}
    active = active.to(DEVICE)
    num_tokens = int(meta["query_start_loc"][-1])
    shape = TreeGQABackend.get_kv_cache_shape(num_blocks, PAGE, HKV, DIM)
    kv_cache = torch.randn(shape, generator=gen).to(DEVICE)
    query = torch.randn(num_tokens, HQ, DIM, generator=gen).to(DEVICE)

    buf = arm_tree_state(tree_state, meta["ancestor_bits"], active, adaptive)
    builder = TreeGQAMetadataBuilder(NS(block_size=PAGE), ["layer.0"], _fake_vllm_config(),
                                     DEVICE)  # fmt: skip
    seq_lens = meta["seq_lens"]
    cm = CommonAttentionMetadata(
        query_start_loc=meta["query_start_loc"],
        query_start_loc_cpu=meta["query_start_loc"].cpu(),
        seq_lens=seq_lens,
        num_reqs=len(specs),
        num_actual_tokens=num_tokens,
        max_query_len=9,
        max_seq_len=int(seq_lens.max()),
        block_table_tensor=meta["block_table"],
        slot_mapping=torch.zeros(num_tokens, dtype=torch.int64, device=DEVICE),
    )
    attn = builder.build(0, cm)
    assert attn.prefill is None and attn.decode is not None
    impl = TreeGQAImpl(HQ, DIM, DIM**-0.5, HKV, None, None, "auto")
    out = torch.full_like(query, float("nan"))
    impl.forward(None, query, None, None, kv_cache, attn, out)

    k_cache, v_cache = kv_cache.transpose(1, 2).split(DIM, dim=-1)
    want = gqa_tree_verify_reference(
        query, k_cache, v_cache, meta["block_table"], seq_lens, meta["query_start_loc"],
        meta["ancestor_bits"], DIM**-0.5, active_query_lens=active if adaptive else None,
    )  # fmt: skip
    torch.testing.assert_close(out, want, **TOLS[torch.float32])
    rows = active_row_mask(meta["query_start_loc"], active)
    if adaptive:
        assert attn.decode.active_query_lens.data_ptr() == buf.data_ptr()
        assert torch.all(out[~rows] == 0)
    else:
        assert attn.decode.active_query_lens is None
        assert not out[~rows].eq(0).all()
