# SPDX-License-Identifier: Apache-2.0
"""GQA tree-verify kernel vs its reference on CUDA at Qwen3/Llama shapes (bf16)."""

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("TRITON_INTERPRET=1: run tests/gpu in its own process", allow_module_level=True)

from vllm_ddtree.attention_backends.gqa_tree import (  # noqa: E402
    GQA_TILE_CONFIGS,
    gqa_tree_verify,
    gqa_tree_verify_reference,
    kernels,
)
from vllm_ddtree.attention_backends.mla_tree import (  # noqa: E402
    ancestor_bits_from_parents,
    causal_ancestor_bits,
    num_mask_words,
)

if type(kernels._gqa_tree_fwd_kernel).__name__ == "InterpretedFunction":
    pytest.skip("kernels were loaded in interpreter mode", allow_module_level=True)

TOL = dict(atol=1e-2, rtol=5e-2)


def make_batch(specs, *, q_heads, kv_heads, head_dim, page_size, dtype=torch.bfloat16, seed=0):
    """``specs``: list of ``(context_len, kind, qlen)``, kind in decode/chain/tree."""
    rng = random.Random(seed)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    qlens = [q for _, _, q in specs]
    seq_lens = [c + q for c, _, q in specs]
    pages = [-(-s // page_size) for s in seq_lens]
    num_blocks = sum(pages) + 5
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
            parents = [-1] + [rng.randrange(max(0, i - 8), i) for i in range(1, qlen)]
            bits.append(ancestor_bits_from_parents(parents, words))
        else:
            bits.append(causal_ancestor_bits(qlen, words))
    qsl = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32)
    shape = (num_blocks, page_size, kv_heads, head_dim)
    return dict(
        q=torch.randn(sum(qlens), q_heads, head_dim, device="cuda", generator=gen).to(dtype),
        k_cache=torch.randn(shape, device="cuda", generator=gen).to(dtype),
        v_cache=torch.randn(shape, device="cuda", generator=gen).to(dtype),
        block_table=block_table,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
        query_start_loc=qsl.cuda(),
        ancestor_bits=torch.cat(bits).cuda(),
        scale=head_dim**-0.5,
    )


def check(batch, **kwargs):
    out = gqa_tree_verify(**batch, **kwargs)
    ref = gqa_tree_verify_reference(**batch, **kwargs)
    torch.testing.assert_close(out.float(), ref.float(), **TOL)


@pytest.mark.parametrize(
    "q_heads,kv_heads,head_dim,ctx,qlen,page_size,kind",
    [
        (32, 8, 128, 4096, 1, 16, "decode"),
        (32, 8, 128, 8192, 16, 16, "tree"),
        (64, 8, 128, 32768, 65, 16, "tree"),
        (16, 2, 128, 32768, 16, 1, "chain"),
        (32, 4, 64, 2048, 65, 16, "chain"),
        (8, 8, 64, 1000, 16, 64, "tree"),
    ],
)
def test_realistic_shapes(q_heads, kv_heads, head_dim, ctx, qlen, page_size, kind):
    specs = [(ctx, kind, qlen), (ctx // 3 + 5, kind, qlen), (0, kind, qlen)]
    batch = make_batch(
        specs, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, page_size=page_size
    )
    check(batch)


@pytest.mark.parametrize("window", [128, 4096])
def test_sliding_window(window):
    specs = [(10000, "tree", 65), (3000, "chain", 16), (50, "decode", 1)]
    batch = make_batch(specs, q_heads=32, kv_heads=8, head_dim=128, page_size=16)
    check(batch, sliding_window=window)


@pytest.mark.parametrize("num_kv_splits", [1, 4, 32])
def test_forced_splits(num_kv_splits):
    specs = [(20000, "tree", 65), (100, "decode", 1)]
    batch = make_batch(specs, q_heads=32, kv_heads=8, head_dim=128, page_size=16)
    check(batch, num_kv_splits=num_kv_splits)


@pytest.mark.parametrize("config", GQA_TILE_CONFIGS, ids=str)
def test_every_config(config):
    specs = [(3000, "tree", 65), (17, "chain", 9), (700, "decode", 1)]
    batch = make_batch(specs, q_heads=32, kv_heads=8, head_dim=128, page_size=16)
    check(batch, config=config)
