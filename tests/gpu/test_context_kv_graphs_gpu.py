# SPDX-License-Identifier: Apache-2.0
"""vllm_ddtree.draft.context_kv_graphs on the GPU: a precompute captured per context length
reads the states, positions and per-layer slot rows written before each replay and
writes what the eager call writes; the capture's warm-up (every slot -1) writes
nothing (CPU side: tests/test_context_kv_graphs.py; the drafter's real precompute runs
in the ddtree suite with CUDA graphs)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a GPU", allow_module_level=True)
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("TRITON_INTERPRET=1: run tests/gpu in its own process", allow_module_level=True)

from vllm_ddtree.draft.context_kv_graphs import ContextKVGraphs  # noqa: E402

MAX_TOKENS, HIDDEN, HEAD, NUM_SLOTS = 64, 32, 16, 200


def _precompute_into(caches, weight):
    """A stand-in for the drafter's precompute: per layer, K = states @ W + position,
    rows written at the layer's slots; negative slots write nothing (vLLM's cache
    writes skip them)."""

    def precompute(states, positions, slots):
        k = states.float() @ weight + positions[:, None].float()
        for layer, cache in enumerate(caches):
            s = slots[layer]
            dump = torch.full_like(s, NUM_SLOTS)  # the extra last row takes the skips
            cache.index_copy_(0, torch.where(s >= 0, s, dump), k + layer)

    return precompute


def _fill(states, positions, slot_rows, gen):
    states.copy_(torch.randn(states.shape, generator=gen, device="cuda"))
    positions.copy_(torch.randint(0, 1000, positions.shape, generator=gen, device="cuda"))
    for row in slot_rows:  # distinct slots per row, some -1
        row.copy_(torch.randperm(NUM_SLOTS, generator=gen, device="cuda")[:MAX_TOKENS])
        row[::7] = -1


def test_replays_follow_the_buffers_and_match_the_eager_call():
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)
    states = torch.zeros(MAX_TOKENS, HIDDEN, device=dev)
    positions = torch.zeros(MAX_TOKENS, dtype=torch.int64, device=dev)
    slot_rows = torch.full((2, MAX_TOKENS), 5, dtype=torch.int64, device=dev)
    weight = torch.randn(HIDDEN, HEAD, generator=gen, device=dev)
    layer_group_idx = [0, 1, 0]
    caches = [torch.zeros(NUM_SLOTS + 1, HEAD, device=dev) for _ in layer_group_idx]
    graphs = ContextKVGraphs(_precompute_into(caches, weight), states, positions,
                             slot_rows, layer_group_idx)
    graphs.capture([40, 13])
    torch.cuda.synchronize()
    assert sorted(graphs.graphs) == [13, 40]
    assert all(bool((c[:NUM_SLOTS] == 0).all()) for c in caches), "warm-up wrote rows"

    reference = [c.clone() for c in caches]
    eager = _precompute_into(reference, weight)
    for n in (40, 13, 40):  # new values before every replay
        _fill(states, positions, slot_rows, gen)
        assert graphs.replay(states[:n], positions[:n], graphs.slots(n))
        eager(states[:n], positions[:n], graphs.slots(n))
        torch.cuda.synchronize()
        for got, want in zip(caches, reference, strict=True):
            torch.testing.assert_close(got[:NUM_SLOTS], want[:NUM_SLOTS], rtol=0, atol=0)
    assert not graphs.replay(states[:20], positions[:20], graphs.slots(20))
