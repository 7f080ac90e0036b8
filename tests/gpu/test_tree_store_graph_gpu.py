# SPDX-License-Identifier: Apache-2.0
"""The in-graph tree store on the GPU: the tree store captured in a CUDA graph
(as inside the drafter's graph) reads each request's state row from a strided
``sample_idx_mapping`` at replay, so rows that change between replays, and -1 padding
rows, are honoured (CPU side: tests/test_tree_store_kernel.py and
tests/test_ddtree_integration_units.py)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a GPU", allow_module_level=True)
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("TRITON_INTERPRET=1: run tests/gpu in its own process", allow_module_level=True)

from vllm_ddtree.tree.store_kernel import store_trees_triton  # noqa: E402

DEPTHS, BUDGET, WORDS, MAX_REQS, CAPTURED = 15, 64, 2, 8, 4


def test_store_captured_in_a_graph_follows_the_rows_written_before_each_replay():
    dev = "cuda"
    sample_idx_mapping = torch.full((MAX_REQS * DEPTHS,), -1, dtype=torch.int32, device=dev)
    parents = torch.zeros(MAX_REQS, BUDGET, dtype=torch.int64, device=dev)
    depths = torch.zeros_like(parents)
    bits = torch.zeros(MAX_REQS, 1 + BUDGET, WORDS, dtype=torch.int64, device=dev)
    state = [torch.full((MAX_REQS, BUDGET), -5, dtype=torch.int64, device=dev),
             torch.full((MAX_REQS, BUDGET), -5, dtype=torch.int64, device=dev),
             torch.full((MAX_REQS, 1 + BUDGET, WORDS), -5, dtype=torch.int64, device=dev)]

    def store():
        assert store_trees_triton(sample_idx_mapping, parents[:CAPTURED], depths[:CAPTURED],
                                  bits[:CAPTURED], *state, idx_stride=DEPTHS)

    store()  # compile before capture (all rows -1: writes nothing)
    torch.cuda.synchronize()
    assert all(bool((t == -5).all()) for t in state)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        store()
    for replay, rows in enumerate(([6, 1, -1, -1], [2, 6, 0, -1])):
        # what prepare_dflash_inputs and the tree build write before each replay
        sample_idx_mapping.fill_(-1)
        for r, row in enumerate(rows):
            sample_idx_mapping[r * DEPTHS:(r + 1) * DEPTHS] = row
        parents.copy_(torch.arange(MAX_REQS * BUDGET, device=dev).view(MAX_REQS, BUDGET)
                      + 1000 * replay)
        depths.copy_(parents + 1)
        bits.copy_((parents[:, :1] * 7).expand(-1, (1 + BUDGET) * WORDS)
                   .reshape(MAX_REQS, 1 + BUDGET, WORDS))
        before = [t.clone() for t in state]
        graph.replay()
        torch.cuda.synchronize()
        live = {row: r for r, row in enumerate(rows) if row >= 0}
        for row in range(MAX_REQS):
            for got, was, src in zip(state, before, (parents, depths, bits), strict=True):
                want = src[live[row]] if row in live else was[row]
                assert torch.equal(got[row], want), (replay, row)
