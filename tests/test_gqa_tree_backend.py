"""The GQA tree backend (vLLM Triton backend + tree kernel) vs the fp32 reference.

The metadata comes from the real builder with a minimal fake VllmConfig; K/V are
written with the backend's own ``do_kv_cache_update`` into vLLM's Triton KV layout.
Without a GPU, Triton kernels (ours and vLLM's) run in the interpreter, where vLLM's
prefill kernel is wrong in bf16 (numpy has no bf16): mixed batches use fp16/fp32 there.
"""

import random
from types import SimpleNamespace as NS

import pytest
import torch

triton = pytest.importorskip("triton")

import vllm.triton_utils  # noqa: E402
import vllm.v1.attention.backends.triton_attn as triton_attn  # noqa: E402
from kernel_testing import (  # noqa: E402
    DEVICE,
    TOLS,
    chain,
    interpreted_vllm_triton_ops,
    random_tree,
    skip_unless_kernels_run_here,
)
from vllm.config import CUDAGraphMode  # noqa: E402
from vllm.v1.attention.backend import AttentionCGSupport, CommonAttentionMetadata  # noqa: E402

from vllm_ddtree.attention_backends.gqa_tree import gqa_tree_verify_reference, kernels  # noqa: E402
from vllm_ddtree.attention_backends.gqa_tree.backend import (  # noqa: E402
    TreeGQABackend,
    TreeGQAImpl,
    TreeGQAMetadataBuilder,
)
from vllm_ddtree.attention_backends.mla_tree import ancestor_bits_from_parents  # noqa: E402
from vllm_ddtree.attention_backends.tree_mask_state import TREE_MASK_STATE  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    # vLLM's prefill kernel divides masked-out rows by zero (discarded) in the interpreter
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
    skip_unless_kernels_run_here(kernels._gqa_tree_fwd_kernel),
]

HQ, HKV, DIM, PAGE = 4, 2, 32, 16
# vLLM's prefill kernel in Triton's interpreter gives garbage in bf16.
PREFILL_DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float16
# TritonAttentionBackend.get_kv_cache_stride_order() per vLLM KV-cache layout.
STRIDE_ORDER = {"NHD": (0, 2, 1, 3), "HND": (0, 1, 2, 3)}
SPEC_TOKENS = 4  # DFlash-style threshold 1 + 2 * 4 = 9
# (context_len, parents of the new tokens): a decode, a chain, a tree, a prefill chunk.
# Contexts are not multiples of the page size.
BATCH = [
    (37, [-1]),
    (20, chain(5)),
    (50, [-1, 0, 0, 1, 2, 1, 3, 0, 7]),
    (19, chain(40)),
]


def fake_vllm_config(max_tokens=256):
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
        scheduler_config=NS(max_num_seqs=8, max_num_batched_tokens=max_tokens),
        speculative_config=NS(num_speculative_tokens=SPEC_TOKENS, parallel_drafting=True,
                              ddtree={"budget": SPEC_TOKENS}),
    )


def make_builder():
    return TreeGQAMetadataBuilder(NS(block_size=PAGE), ["layer.0"], fake_vllm_config(), DEVICE)


@pytest.fixture(autouse=True)
def vllm_triton_kernels(monkeypatch):
    """vLLM's Triton prefill and KV-write kernels, runnable on CPU (interpreter)."""
    if vllm.triton_utils.HAS_TRITON:
        return
    ops = interpreted_vllm_triton_ops()
    # the KV-write launcher sizes its tiles from the (absent) GPU's capability
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *args: (9, 0))
    monkeypatch.setattr(
        triton_attn, "unified_attention", ops["triton_unified_attention"].unified_attention
    )
    monkeypatch.setattr(
        triton_attn,
        "triton_reshape_and_cache_flash",
        ops["triton_reshape_and_cache_flash"].triton_reshape_and_cache_flash,
    )


class Batch:
    """A paged batch in vLLM's Triton KV layout, with its metadata and tree bits."""

    def __init__(self, specs, dtype, seed=0, layout="NHD"):
        gen = torch.Generator().manual_seed(seed)
        self.specs = specs
        qlens = [len(p) for _, p in specs]
        self.seq_lens = [c + n for (c, _), n in zip(specs, qlens, strict=True)]
        pages = [-(-s // PAGE) for s in self.seq_lens]
        num_blocks = sum(pages) + 2
        perm = torch.randperm(num_blocks, generator=gen)
        self.block_table = torch.zeros(len(specs), max(pages) + 1, dtype=torch.int32)
        i = 0
        for r, n in enumerate(pages):
            self.block_table[r, :n] = perm[i : i + n].int()
            i += n
        self.qsl = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32)
        self.num_tokens = int(self.qsl[-1])
        self.qlens = qlens
        slots = []
        for r, ((ctx, _), n) in enumerate(zip(specs, qlens, strict=True)):
            pos = torch.arange(ctx, ctx + n)
            slots.append(self.block_table[r, pos // PAGE].long() * PAGE + pos % PAGE)
        self.slot_mapping = torch.cat(slots).to(DEVICE)
        self.bits = torch.cat([ancestor_bits_from_parents(p, 1) for _, p in specs]).to(DEVICE)
        self.causal_bits = torch.cat(
            [ancestor_bits_from_parents(chain(n), 1) for n in qlens]
        ).to(DEVICE)

        shape = TreeGQABackend.get_kv_cache_shape(num_blocks, PAGE, HKV, DIM)
        order = STRIDE_ORDER[layout]
        physical = torch.randn([shape[i] for i in order], generator=gen).to(dtype).to(DEVICE)
        self.kv_cache = physical.permute([order.index(i) for i in range(4)])
        assert tuple(self.kv_cache.shape) == shape
        self.query, self.key, self.value = (
            torch.randn(self.num_tokens, heads, DIM, generator=gen).to(dtype).to(DEVICE)
            for heads in (HQ, HKV, HKV)
        )
        self.block_table = self.block_table.to(DEVICE)

    def common_metadata(self):
        return CommonAttentionMetadata(
            query_start_loc=self.qsl.to(DEVICE),
            query_start_loc_cpu=self.qsl.clone(),
            seq_lens=torch.tensor(self.seq_lens, dtype=torch.int32, device=DEVICE),
            num_reqs=len(self.specs),
            num_actual_tokens=self.num_tokens,
            max_query_len=max(self.qlens),
            max_seq_len=max(self.seq_lens),
            block_table_tensor=self.block_table,
            slot_mapping=self.slot_mapping,
        )

    def kv_views(self):
        """``[num_blocks, page, Hkv, D]`` K and V views of the Triton cache."""
        return self.kv_cache.transpose(1, 2).split(DIM, dim=-1)

    def reference(self, bits, window):
        k_cache, v_cache = self.kv_views()
        return gqa_tree_verify_reference(
            self.query, k_cache, v_cache, self.block_table,
            torch.tensor(self.seq_lens, dtype=torch.int32, device=DEVICE), self.qsl.to(DEVICE),
            bits, DIM**-0.5,
            sliding_window=window,
        )  # fmt: skip


LAYER = NS(**{f"_{n}_scale": torch.ones(1, device=DEVICE) for n in "qkv"})


def make_impl(window, cls=TreeGQAImpl):
    return cls(HQ, DIM, DIM**-0.5, HKV, None, window, "auto")


def run_backend(batch, impl, meta):
    impl.do_kv_cache_update(LAYER, batch.key, batch.value, batch.kv_cache, batch.slot_mapping)
    out = torch.full_like(batch.query, float("nan"))
    impl.forward(LAYER, batch.query, batch.key, batch.value, batch.kv_cache, meta, out)
    return out


@pytest.fixture
def tree_state():
    """Activate ``TREE_MASK_STATE`` for a test and restore it afterwards."""
    saved = TREE_MASK_STATE.ancestor_bits, TREE_MASK_STATE.active
    yield TREE_MASK_STATE
    TREE_MASK_STATE.ancestor_bits, TREE_MASK_STATE.active = saved


@pytest.mark.parametrize(
    ("dtype", "window"), [(PREFILL_DTYPE, None), (PREFILL_DTYPE, 12), (torch.float32, 30)]
)
def test_mixed_batch_matches_reference(dtype, window, tree_state):
    """Decode + chain + tree requests (tree kernel, DDTree's bits) and a prefill chunk
    (vLLM's kernel), with and without a sliding window."""
    batch = Batch(BATCH, dtype, seed=3 if window is None else window)
    builder = make_builder()
    assert builder.reorder_batch_threshold == 1 + 2 * SPEC_TOKENS
    tree_state.ancestor_bits = torch.zeros(64, 1, dtype=torch.int64, device=DEVICE)
    tree_state.ancestor_bits[: batch.num_tokens] = batch.bits
    tree_state.active = True
    meta = builder.build(0, batch.common_metadata())
    assert meta.num_decode_tokens == 15 and meta.prefill.num_actual_tokens == 40
    out = run_backend(batch, make_impl(window), meta)
    want = batch.reference(batch.bits, window)
    torch.testing.assert_close(out.float(), want.float(), **TOLS[dtype])


def test_without_tree_it_is_the_triton_backend(tree_state):
    """Inactive tree: causal bits, same output as vLLM's Triton impl on the same batch."""
    tree_state.active = False
    batch = Batch(BATCH, PREFILL_DTYPE, seed=5)
    meta = make_builder().build(0, batch.common_metadata())
    out = run_backend(batch, make_impl(16), meta)
    plain = torch.full_like(batch.query, float("nan"))
    make_impl(16, triton_attn.TritonAttentionImpl).forward(
        LAYER, batch.query, batch.key, batch.value, batch.kv_cache, meta, plain
    )
    torch.testing.assert_close(out.float(), plain.float(), **TOLS[PREFILL_DTYPE])
    want = batch.reference(batch.causal_bits, 16)
    torch.testing.assert_close(out.float(), want.float(), **TOLS[PREFILL_DTYPE])


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_uniform_verify_batch_and_capture_metadata(layout, tree_state):
    """All requests at the threshold (bf16): one tree-kernel call, no prefill part;
    the capture-time metadata has seq_lens equal to the query lengths."""
    rng = random.Random(0)
    specs = [(ctx, random_tree(9, rng)) for ctx in (3, 70, 17)]
    batch = Batch(specs, torch.bfloat16, seed=1, layout=layout)
    tree_state.ancestor_bits = batch.bits.clone()
    tree_state.active = True
    builder = make_builder()
    meta = builder.build(0, batch.common_metadata())
    assert meta.prefill is None and meta.decode.max_query_len == 9
    assert meta.decode.ancestor_bits.data_ptr() == tree_state.ancestor_bits.data_ptr()
    out = run_backend(batch, make_impl(None), meta)
    torch.testing.assert_close(
        out.float(), batch.reference(batch.bits, None).float(), **TOLS[torch.bfloat16]
    )
    capture = builder.build_for_cudagraph_capture(batch.common_metadata())
    assert capture.decode.seq_lens.tolist() == [9, 9, 9]


def test_all_prefill_and_threshold_override(monkeypatch, tree_state):
    tree_state.active = False
    batch = Batch([(0, chain(20)), (5, chain(33))], PREFILL_DTYPE, seed=2)
    meta = make_builder().build(0, batch.common_metadata())
    assert meta.decode is None and meta.prefill.num_actual_tokens == 53
    monkeypatch.setattr(TreeGQAMetadataBuilder, "min_tree_query_len", 24)
    builder = make_builder()
    assert builder.reorder_batch_threshold == 24
    meta = builder.build(0, batch.common_metadata())
    assert meta.num_decode_tokens == 20 and meta.prefill.query_start_loc.tolist() == [0, 33]
    out = run_backend(batch, make_impl(None), meta)
    want = batch.reference(batch.causal_bits, None)
    torch.testing.assert_close(out.float(), want.float(), **TOLS[PREFILL_DTYPE])
    # It only raises the threshold: below DDTree's 1 + 2B it changes nothing.
    monkeypatch.setattr(TreeGQAMetadataBuilder, "min_tree_query_len", 3)
    assert make_builder().reorder_batch_threshold == 1 + 2 * SPEC_TOKENS


def test_backend_declarations_and_refusals():
    assert TreeGQABackend.get_name() == "CUSTOM" and not TreeGQABackend.is_mla()
    assert TreeGQABackend.get_builder_cls()._cudagraph_support == AttentionCGSupport.UNIFORM_BATCH
    assert not TreeGQABackend.supports_non_causal()
    with pytest.raises(NotImplementedError, match="--kv-cache-dtype auto"):
        TreeGQAImpl(HQ, DIM, 1.0, HKV, None, None, "fp8")
    with pytest.raises(NotImplementedError, match="logits_soft_cap"):
        TreeGQAImpl(HQ, DIM, 1.0, HKV, None, None, "auto", logits_soft_cap=30.0)
    with pytest.raises(NotImplementedError, match="sinks"):
        TreeGQAImpl(HQ, DIM, 1.0, HKV, None, None, "auto", sinks=torch.zeros(HQ))
