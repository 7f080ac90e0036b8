# SPDX-License-Identifier: Apache-2.0
"""VLLM_DDTREE_DIRECT_LAUNCH=1 on the GPU: the round kernels launched through their
cached CompiledKernel give what the JIT launches give, bit for bit, over changing
batch sizes and alignments, and a direct launch captured in a CUDA graph replays on
new inputs (vllm_ddtree/direct_launch.py; CPU side: tests/test_direct_launch.py)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a GPU", allow_module_level=True)
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("TRITON_INTERPRET=1: run tests/gpu in its own process", allow_module_level=True)

from vllm_ddtree.direct_launch import DIRECT_LAUNCH_ENV  # noqa: E402
from vllm_ddtree.draft.hidden_rows_kernel import _MOVE_PATH_ROWS_LAUNCH, move_path_rows_triton  # noqa: E402
from vllm_ddtree.tree.store_kernel import _STORE_TREES_LAUNCH, store_trees_triton  # noqa: E402
from vllm_ddtree.walk.walk_kernel import _VERIFY_WALK_LAUNCH, verify_walk_triton  # noqa: E402


def walk_inputs(num_reqs, budget=64, max_reqs=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    cu = torch.arange(num_reqs + 1, dtype=torch.int32) * (1 + budget)
    num_logits = int(cu[-1])
    parents = torch.full((max_reqs, budget), -1, dtype=torch.int64)
    for i in range(1, budget):
        parents[:, i] = torch.randint(-1, i, (max_reqs,), generator=gen)
    t = dict(input_ids=torch.randint(0, 3, (num_logits,), generator=gen, dtype=torch.int32),
             logits_indices=torch.arange(num_logits, dtype=torch.int32),
             drawn=torch.randint(0, 3, (num_logits,), generator=gen),
             cu=cu, idx=torch.randperm(max_reqs, generator=gen)[:num_reqs].int(),
             parents=parents, seq_lens=torch.full((num_reqs,), 100, dtype=torch.int32),
             prefill=torch.full((max_reqs,), 10, dtype=torch.int32))
    return {k: v.cuda() for k, v in t.items()}


def run_walk(t, walk_rows, counters):
    walk, sampled, num_sampled, num_rejected = verify_walk_triton(
        t["input_ids"], t["logits_indices"], t["drawn"], t["cu"], t["idx"], t["parents"], 15,
        64, walk_rows, t["seq_lens"], t["prefill"], None, counters)
    return [walk.kv_src_rows, walk.accepted_depth, sampled, num_sampled, num_rejected]


@pytest.mark.parametrize("sizes", [(1, 1, 3, 1, 8, 8, 2)])
def test_direct_launches_equal_jit_launches(monkeypatch, sizes):
    for num_reqs in sizes:
        t = walk_inputs(num_reqs, seed=num_reqs)
        outs = {}
        for mode in ("0", "1", "1"):
            monkeypatch.setenv(DIRECT_LAUNCH_ENV, mode)
            walk_rows = torch.full((8, 16), -7, dtype=torch.int64, device="cuda")
            counters = (torch.zeros(1, dtype=torch.int64, device="cuda"),
                        torch.zeros(1, dtype=torch.int64, device="cuda"))
            res = run_walk(t, walk_rows, counters) + [walk_rows, *counters]
            torch.cuda.synchronize()
            outs.setdefault(mode, []).append([r.cpu() for r in res])
        for direct in outs["1"]:
            for a, b in zip(outs["0"][0], direct, strict=True):
                assert torch.equal(a, b), num_reqs
    assert _VERIFY_WALK_LAUNCH.direct_launches >= len(sizes)

    monkeypatch.setenv(DIRECT_LAUNCH_ENV, "1")
    gen = torch.Generator(device="cuda").manual_seed(1)
    for offset in (0, 1, 0):  # a misaligned view needs its own compiled variant
        base = [torch.randn(40, 24, device="cuda", generator=gen).to(torch.bfloat16)
                for _ in range(3)]
        xs = [b[offset:offset + 32] for b in base]
        qsl = torch.tensor([0, 9, 18, 32], dtype=torch.int32, device="cuda")
        src = torch.tensor([[2, 5, -1], [1, 3, 8], [-1, -1, -1]], device="cuda")
        want = [x.clone() for x in xs]
        monkeypatch.setenv(DIRECT_LAUNCH_ENV, "0")
        assert move_path_rows_triton(want, qsl, src)
        monkeypatch.setenv(DIRECT_LAUNCH_ENV, "1")
        for _ in range(2):
            got = [x.clone() for x in xs]
            assert move_path_rows_triton(got, qsl, src)
            assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)), offset
    assert _MOVE_PATH_ROWS_LAUNCH.direct_launches >= 2


def test_a_captured_direct_launch_replays_on_new_inputs(monkeypatch):
    monkeypatch.setenv(DIRECT_LAUNCH_ENV, "1")
    idx = torch.tensor([3, 1], dtype=torch.int32, device="cuda")
    parents = torch.zeros(2, 64, dtype=torch.int64, device="cuda")
    depths = torch.zeros_like(parents)
    bits = torch.zeros(2, 65, 2, dtype=torch.int64, device="cuda")
    state = [torch.full((4, 64), -1, dtype=torch.int64, device="cuda"),
             torch.full((4, 64), -1, dtype=torch.int64, device="cuda"),
             torch.full((4, 65, 2), -1, dtype=torch.int64, device="cuda")]
    for _ in range(2):  # JIT, then direct (warm before capture)
        assert store_trees_triton(idx, parents, depths, bits, *state)
    before = _STORE_TREES_LAUNCH.direct_launches
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        assert store_trees_triton(idx, parents, depths, bits, *state)
    assert _STORE_TREES_LAUNCH.direct_launches == before + 1
    parents.copy_(torch.arange(128, device="cuda").view(2, 64))
    depths.fill_(5)
    bits.fill_(9)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(state[0][3], parents[0]) and torch.equal(state[0][1], parents[1])
    assert bool((state[1][[1, 3]] == 5).all()) and bool((state[2][[1, 3]] == 9).all())
    assert bool((state[0][[0, 2]] == -1).all())
