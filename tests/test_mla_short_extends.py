# SPDX-License-Identifier: Apache-2.0
"""Short extends on the MLA tree backend (``mla_tree/short_extends.py``): which requests
still prefilling take the decode kernel in a step, the mask words sized for them, the
builder's per-step threshold, and the kernel on such a batch against the reference
(CPU; the kernel in ``TRITON_INTERPRET=1``)."""

from types import SimpleNamespace as NS

import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton")

from kernel_testing import chain, random_tree, skip_unless_kernels_run_here  # noqa: E402
from test_mla_tree_kernel import assert_matches_reference, make_batch  # noqa: E402

from vllm_ddtree.attention_backends.mla_tree import kernels  # noqa: E402
from vllm_ddtree.attention_backends.mla_tree.short_extends import (  # noqa: E402
    EXTRA_FLOPS_PER_LAYER,
    decode_limit,
    extra_decode_flops,
)
from vllm_ddtree.attention_backends.tree_mask_state import (  # noqa: E402
    MLA_MAX_EXTEND_TOKENS,
    decode_query_limit,
)

# DeepSeek-V2-Lite's MLA: 16 heads, kv_lora 512, rope 64, nope 128, value 128.
V2LITE = dict(num_heads=16, kv_lora_rank=512, rope_dim=64, nope_dim=128, v_dim=128)


def limit(query_lens, context_lens, floor=129, ceiling=512, **dims):
    """``decode_limit`` of a batch given as query and context lengths."""
    loc = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    seq = None if context_lens is None else (np.asarray(context_lens)
                                             + np.asarray(query_lens)).astype(np.int32)
    return decode_limit(loc, seq, floor, ceiling, **(dims or V2LITE))


def test_extra_flops_follow_the_two_paths_cost():
    """Absorbed: 2q(2L + R) a head and cached token; prefill path: up-projection
    2L(N + V) plus FlashAttention 2q(N + R + V). Break-even near q = 170 at V2-Lite's
    dims; at 512 the decode path does 2x the prefill path's work."""
    q, c = np.array([100, 170, 171, 512]), np.array([1000, 1000, 1000, 1000])
    extra = extra_decode_flops(q, c, **V2LITE)
    by_hand = [16 * 1000 * (2 * n * (2 * 512 + 64) - (2 * 512 * 256 + 2 * n * 320))
               for n in q]
    assert extra.tolist() == pytest.approx(by_hand)
    assert extra[1] < 0 < extra[2]
    absorbed = 2 * 512 * (2 * 512 + 64)
    prefill = 2 * 512 * 256 + 2 * 512 * 320
    assert absorbed / prefill == pytest.approx(2.0, rel=0.1)


def test_short_context_extends_take_the_decode_kernel_up_to_the_ceiling():
    # Decodes (65 verify rows, 5-row trees) then refills of 128 and 256 new tokens
    # after 1k-token cached prefixes: all in the decode kernel.
    assert limit([65, 65, 5, 5, 128, 256], [900, 901, 902, 903, 896, 768]) == 256
    # Nothing beyond the floor: any limit >= the longest query splits alike.
    assert limit([65, 5, 129], [10, 10, 10]) == 512
    # Past the ceiling: a prefill (and its shorter neighbours keep the kernel).
    assert limit([65, 300, 600], [100, 100, 0]) == 300
    # Without exact host context lengths nothing past the floor is taken.
    assert limit([65, 300], None) == 129


def test_long_context_extends_keep_the_prefill_path():
    # 32k cached tokens (B = 16: floor 33): below break-even (100) still cheaper
    # absorbed, 300 is not.
    assert limit([17, 100, 300], [32000, 32000, 32000], floor=33) == 100
    assert limit([65, 100, 300], [32000, 32000, 32000]) == 129
    # The extra work bound: the longest context a 512-token extend may have.
    per_token = extra_decode_flops(np.array([512]), np.array([1]), **V2LITE)[0]
    longest = int(EXTRA_FLOPS_PER_LAYER // per_token)
    assert limit([65, 512], [20, longest]) == 512
    assert limit([65, 512], [20, longest + 1]) == 129
    # More heads (Kimi-K2: 64) shorten it 4x.
    kimi = dict(V2LITE, num_heads=64)
    assert limit([65, 512], [20, longest // 4 + 1], **kimi) == 129


def test_a_query_as_long_as_a_failing_one_is_not_taken():
    """vLLM takes every query up to the threshold as a decode: a failing extend keeps
    the threshold below its own length even where a taken one had the same length."""
    assert limit([65, 300, 300], [1000, 1000, 32000]) == 299
    assert limit([65, 300, 301], [1000, 1000, 32000]) == 300


def config(dtype=torch.bfloat16, use_mla=True, dcp=1, tokens=16384):
    return NS(model_config=NS(dtype=dtype, use_mla=use_mla),
              scheduler_config=NS(max_num_batched_tokens=tokens),
              parallel_config=NS(decode_context_parallel_size=dcp))


def test_mask_words_are_sized_for_the_longest_extend():
    assert decode_query_limit(config(), 129) == MLA_MAX_EXTEND_TOKENS == 512
    assert decode_query_limit(config(), 1025) == 1025  # B = 512: the verify rows
    assert decode_query_limit(config(use_mla=False), 129) == 129  # GQA: no MLA prefill path
    assert decode_query_limit(config(dcp=2), 1) == 1  # vLLM's DCP limit kept
    assert decode_query_limit(config(torch.float32), 129) == 16384


def test_builder_builds_with_the_steps_threshold(monkeypatch):
    """``TreeMLAMetadataBuilder.build`` hands vLLM's build this step's limit and
    restores its own (the mask sizing) after; in fp32 it does not route."""
    from vllm.model_executor.layers.attention.mla_attention import MLACommonMetadataBuilder

    from vllm_ddtree.attention_backends.mla_tree.backend import TreeMLAMetadataBuilder

    seen = []
    monkeypatch.setattr(MLACommonMetadataBuilder, "build",
                        lambda self, prefix, cm, fast=False: seen.append(
                            self.reorder_batch_threshold))
    builder = TreeMLAMetadataBuilder.__new__(TreeMLAMetadataBuilder)
    builder.reorder_batch_threshold, builder._decode_floor = 512, 129
    builder._route_extends, builder.num_heads = True, 16
    builder.mla_dims = NS(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
                          v_head_dim=128)
    qlens, ctx = [65, 5, 200, 400], [900, 900, 800, 40000]
    loc = torch.tensor(np.concatenate([[0], np.cumsum(qlens)]), dtype=torch.int32)
    cm = NS(num_reqs=4, query_start_loc_cpu=torch.cat([loc, loc[-1:]]),  # padded entry
            seq_lens_cpu_upper_bound=torch.tensor(ctx) + torch.tensor(qlens),
            max_query_len=400)
    builder.build(0, cm)
    assert seen == [200] and builder.reorder_batch_threshold == 512
    builder._route_extends = False
    builder.build(0, cm)
    assert seen == [200, 512]
    builder._route_extends = True  # nothing past the floor: vLLM's build as it is
    builder.build(0, NS(**{**vars(cm), "max_query_len": 129, "query_start_loc_cpu": None}))
    assert seen == [200, 512, 512]


@skip_unless_kernels_run_here(triton.language.max, kernels._page_ids)
def test_kernel_computes_an_extend_beside_trees_with_the_extends_mask_words():
    """A 150-token extend (causal, third mask word) after a cached context, beside a
    tree and a decode, with the mask words sized for ``MLA_MAX_EXTEND_TOKENS``."""
    import random

    words = -(-MLA_MAX_EXTEND_TOKENS // 64)
    batch = make_batch([(40, random_tree(9, random.Random(3))), (30, chain(150)), (7, [-1])],
                       heads=2, page_size=16, dtype=torch.bfloat16, num_words=words, seed=5)
    assert batch["ancestor_bits"].shape[1] == 8
    assert_matches_reference(batch, num_kv_splits=2)
