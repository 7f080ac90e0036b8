# SPDX-License-Identifier: Apache-2.0
"""One-launch round inputs against their PyTorch paths, exactly:

* the verify inputs (``vllm_ddtree.verify.inputs_kernel``) against
  ``runtime_state.verify_inputs_``'s PyTorch ops: positions, ancestor bits and active
  rows of mixed batches (full and truncated trees, prefill chunks past 64 tokens, plain
  decode, CUDA-graph padding, garbage in every output buffer beforehand);
* ``propose``'s hidden-row index (``vllm_ddtree.draft.hidden_rows_kernel``) against
  ``runtime_state.hidden_row_gather_index``'s.

Without a GPU the kernel runs in Triton's interpreter (tests/conftest.py)."""

import textwrap
from types import SimpleNamespace as NS

import pytest
import torch

pytest.importorskip("triton")

from kernel_testing import (  # noqa: E402
    DEVICE,
    compiled_shared_memory,
    skip_unless_kernels_run_here,
)

from vllm_ddtree.attention_backends.tree_mask_state import ALL_ROWS_ACTIVE, TREE_MASK_STATE  # noqa: E402
from vllm_ddtree.runtime_state import verify_inputs_  # noqa: E402
from vllm_ddtree.tree.draft_tree import num_mask_words  # noqa: E402
from vllm_ddtree.verify import inputs_kernel as verify_inputs_kernel  # noqa: E402
from vllm_ddtree.verify.inputs_kernel import verify_inputs_triton  # noqa: E402

pytestmark = skip_unless_kernels_run_here(verify_inputs_kernel._verify_inputs_kernel)

BUDGET, MAX_REQS, GARBAGE = 7, 8, -12345
# Mask words of the output: 3 (past a 150-token chunk's) or 11 (more than one block of
# MAX_BLOCK_W words, a 700-token chunk using them all: fp32 runs size the mask so).
OUT_WORDS = (3, 11)


def mixed_batch(kinds, seed):
    """Batch rows of the given kinds (``tree``, ``cut`` = truncated tree, ``prefill``,
    ``decode``), the slot-indexed trees, and padded token counts (CPU tensors)."""
    gen = torch.Generator().manual_seed(seed)
    qlens = {"tree": 1 + BUDGET, "cut": 4, "prefill": 150, "long": 700, "decode": 1}
    logits = {"tree": 1 + BUDGET, "cut": 4, "prefill": 1, "long": 1, "decode": 1}
    q = [qlens[k] for k in kinds]
    qsl = torch.tensor([0, *torch.tensor(q).cumsum(0).tolist()], dtype=torch.int32)
    cu = torch.tensor([0, *torch.tensor([logits[k] for k in kinds]).cumsum(0).tolist()],
                      dtype=torch.int32)
    idx = torch.randperm(MAX_REQS, generator=gen)[: len(kinds)].int()
    computed = torch.randint(0, 5000, (len(kinds),), generator=gen)
    linear = torch.cat([c + torch.arange(n) for c, n in zip(computed.tolist(), q, strict=True)])
    num_tokens = int(qsl[-1])
    padded = num_tokens + 5
    linear = torch.cat([linear, torch.arange(padded - num_tokens) + 90000]).long()
    words = num_mask_words(1 + BUDGET)
    trees = NS(
        depths=torch.randint(1, BUDGET + 1, (MAX_REQS, BUDGET), generator=gen),
        ancestor_bits=torch.randint(-2**62, 2**62, (MAX_REQS, 1 + BUDGET, words),
                                    generator=gen),
        active_nodes=torch.randint(1, BUDGET + 1, (MAX_REQS,), generator=gen),
    )
    return dict(linear=linear, qsl=qsl, cu=cu, idx=idx, num_tokens=num_tokens,
                padded=padded), trees


def to_device(batch, trees):
    batch = {k: v.to(DEVICE) if torch.is_tensor(v) else v for k, v in batch.items()}
    return batch, NS(**{k: v.to(DEVICE) for k, v in vars(trees).items()})


def torch_path(batch, trees, adaptive, out_words):
    """``verify_inputs_`` on CPU tensors (its PyTorch ops), outputs pre-filled with
    garbage."""
    state = NS(positions=torch.full((batch["padded"] + 3,), GARBAGE, dtype=torch.int64),
               depths=trees.depths, ancestor_bits=trees.ancestor_bits, adaptive=adaptive,
               active_nodes=trees.active_nodes)
    saved = TREE_MASK_STATE.ancestor_bits, TREE_MASK_STATE.active_query_lens
    try:
        TREE_MASK_STATE.ancestor_bits = torch.full((batch["num_tokens"] + 3, out_words),
                                                   GARBAGE, dtype=torch.int64)
        TREE_MASK_STATE.active_query_lens = torch.full((MAX_REQS + 2,), GARBAGE,
                                                       dtype=torch.int32)
        positions = verify_inputs_(state, batch["linear"], batch["qsl"], batch["cu"],
                                   batch["idx"], batch["num_tokens"], batch["padded"])
        return (positions.clone(), TREE_MASK_STATE.ancestor_bits.clone(),
                TREE_MASK_STATE.active_query_lens.clone())
    finally:
        TREE_MASK_STATE.ancestor_bits, TREE_MASK_STATE.active_query_lens = saved


def triton_path(batch, trees, adaptive, out_words):
    batch, trees = to_device(batch, trees)
    positions = torch.full((batch["padded"] + 3,), GARBAGE, dtype=torch.int64, device=DEVICE)
    bits = torch.full((batch["num_tokens"] + 3, out_words), GARBAGE, dtype=torch.int64,
                      device=DEVICE)
    lens = torch.full((MAX_REQS + 2,), GARBAGE, dtype=torch.int32, device=DEVICE)
    verify_inputs_triton(batch["linear"], batch["qsl"], batch["cu"], batch["idx"],
                         trees.depths, trees.ancestor_bits, positions, bits,
                         batch["num_tokens"], batch["padded"],
                         active_nodes=trees.active_nodes if adaptive else None,
                         active_lens_out=lens if adaptive else None)
    return positions[: batch["padded"]].cpu(), bits.cpu(), lens.cpu()


@pytest.mark.parametrize("out_words", OUT_WORDS)
@pytest.mark.parametrize("adaptive", [False, True])
@pytest.mark.parametrize("kinds", [
    ("tree", "prefill", "decode", "cut", "tree"),
    ("decode",),
    ("prefill", "tree", "long"),
    ("tree",) * 6,
])
def test_kernel_equals_the_pytorch_path(kinds, adaptive, out_words):
    batch, trees = mixed_batch(kinds, seed=len(kinds) + adaptive)
    want_pos, want_bits, want_lens = torch_path(batch, trees, adaptive, out_words)
    got_pos, got_bits, got_lens = triton_path(batch, trees, adaptive, out_words)
    assert torch.equal(got_pos, want_pos)
    # Rows past the batch stay untouched on both paths.
    assert torch.equal(got_bits, want_bits)
    if adaptive:
        assert torch.equal(got_lens, want_lens)
        assert torch.all(got_lens[len(kinds):] == ALL_ROWS_ACTIVE)
    else:
        assert torch.all(got_lens == GARBAGE)


def test_tree_rows_are_what_the_tree_says():
    """Independent of the PyTorch path: a tree row's position is its bonus position +
    depth and its bits are its tree's; a prefill row past 64 has full causal words."""
    batch, trees = mixed_batch(("prefill", "tree"), seed=3)
    pos, bits, _ = triton_path(batch, trees, False, 3)
    slot, start, bonus = int(batch["idx"][1]), 150, int(batch["linear"][150])
    for i in range(1, 1 + BUDGET):
        assert int(pos[start + i]) == bonus + int(trees.depths[slot, i - 1])
        assert int(bits[start + i, 0]) == int(trees.ancestor_bits[slot, i, 0])
        assert int(bits[start + i, 1]) == 0
    assert torch.equal(pos[:150], batch["linear"][:150])
    assert int(bits[100, 0]) == -1 and int(bits[100, 1]) == (1 << 37) - 1
    assert int(bits[100, 2]) == 0
    assert torch.equal(pos[batch["num_tokens"]:], batch["linear"][batch["num_tokens"]:])


def test_host_side_has_no_sync(monkeypatch):
    """Everything but the launch under the host-sync detector: the wrapper reads
    shapes and strides only."""
    from vllm_ddtree.testing.sync_guard import HostSyncDetector

    batch, trees = to_device(*mixed_batch(("tree", "prefill", "decode"), seed=4))
    positions = torch.zeros(batch["padded"], dtype=torch.int64, device=DEVICE)
    bits = torch.zeros(batch["num_tokens"], 3, dtype=torch.int64, device=DEVICE)
    lens = torch.zeros(MAX_REQS, dtype=torch.int32, device=DEVICE)
    launches = []

    class Recorded:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append(grid)

    monkeypatch.setattr(verify_inputs_kernel, "_verify_inputs_kernel", Recorded())
    with HostSyncDetector() as detector:
        verify_inputs_triton(batch["linear"], batch["qsl"], batch["cu"], batch["idx"],
                             trees.depths, trees.ancestor_bits, positions, bits,
                             batch["num_tokens"], batch["padded"],
                             active_nodes=trees.active_nodes, active_lens_out=lens)
    assert launches == [(4,)]
    assert detector.count() == 0, detector.report()


_COMPILE_SCRIPT = textwrap.dedent(
    """
    import json, triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from vllm_ddtree.verify.inputs_kernel import _verify_inputs_kernel as fn

    pointers = {"qsl_ptr": "*i32", "cu_logits_ptr": "*i32", "idx_ptr": "*i32",
                "active_lens_ptr": "*i32"}
    result = []
    for arch in (90, 120):
        for adaptive, words, block_w in ((False, 3, 4), (True, 3, 4), (True, 256, 8)):
            consts = dict(NUM_NODES=64, TREE_WORDS=2, NUM_WORDS=words, BLOCK_T=64,
                          BLOCK_W=block_w, ADAPTIVE=adaptive, ALL_ACTIVE=2**31 - 1)
            sig = {n: "constexpr" if n in consts else pointers.get(n, "*i64")
                   if n.endswith("_ptr") else "i32" for n in fn.arg_names}
            k = triton.compile(ASTSource(fn, sig, constexprs=consts),
                               target=GPUTarget("cuda", arch, 32), options={"num_warps": 4})
            result.append(k.metadata.shared)
    from vllm_ddtree.draft.hidden_rows_kernel import _hidden_row_index_kernel as rows_fn

    for arch in (90, 120):
        sig = {n: "constexpr" if n == "BLOCK" else {"qsl_ptr": "*i32"}.get(n, "*i64")
               if n.endswith("_ptr") else "i32" for n in rows_fn.arg_names}
        k = triton.compile(ASTSource(rows_fn, sig, constexprs=dict(BLOCK=128)),
                           target=GPUTarget("cuda", arch, 32), options={"num_warps": 4})
        result.append(k.metadata.shared)
    from vllm_ddtree.draft.hidden_rows_kernel import _move_path_rows_kernel as move_fn

    for arch in (90, 120):
        consts = dict(NUM=4, BLOCK_L=32, BLOCK_H=128)
        sig = {n: "constexpr" if n in consts else {"qsl_ptr": "*i32", "src_ptr": "*i64"}.get(
               n, "*bf16") if n.endswith("_ptr") else "i32" for n in move_fn.arg_names}
        k = triton.compile(ASTSource(move_fn, sig, constexprs=consts),
                           target=GPUTarget("cuda", arch, 32), options={"num_warps": 4})
        result.append(k.metadata.shared)
    print(json.dumps(result))
    """
)


def test_kernel_compiles_for_sm90_and_sm120():
    """Compiled (no GPU needed) for Hopper and sm_120, plain, adaptive, and with the
    256 mask words of an fp32 run (16k-token batches)."""
    shared = compiled_shared_memory(_COMPILE_SCRIPT)
    assert len(shared) == 10 and max(shared) <= 99 * 1024, shared


@pytest.mark.parametrize("num_padding", [0, 7])
def test_hidden_row_index_kernel_equals_the_pytorch_index(num_padding):
    """``propose``'s hidden-row index (vllm_ddtree.draft.hidden_rows_kernel) against
    ``hidden_row_gather_index``'s PyTorch ops: full and truncated accepted paths,
    requests without drafts, a request longer than a block of rows, graph padding."""
    from vllm_ddtree.draft.hidden_rows_kernel import hidden_row_gather_index_triton
    from vllm_ddtree.runtime_state import hidden_row_gather_index

    gen = torch.Generator().manual_seed(num_padding)
    depth, qlens = 6, [1 + 9, 1, 1 + 9, 300, 1 + 4]
    accepted = [6, 0, 2, 0, 4]
    src = torch.full((len(qlens), depth), -1, dtype=torch.int64)
    for r, a in enumerate(accepted):
        nodes = torch.randperm(qlens[r] - 1, generator=gen)[:a].sort().values
        src[r, :a] = nodes + 1
    qsl = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)
    num_rows = int(qsl[-1]) + num_padding
    want = hidden_row_gather_index(qsl, src, num_rows)
    got = hidden_row_gather_index_triton(qsl.to(DEVICE), src.to(DEVICE), num_rows)
    assert torch.equal(got.cpu(), want)
    assert not torch.equal(want, torch.arange(num_rows))  # paths did move rows


@pytest.mark.parametrize("num_tensors,block_h", [(3, 4), (5, 128)])
def test_in_place_path_move_equals_the_gather(num_tensors, block_h):
    """move_path_rows_triton (in place, four tensors a launch) against ``x[index]`` with
    ``hidden_row_gather_index``: bit-equal rows for every tensor, chains where a
    destination row is a later move's source, short requests, CUDA-graph padding
    rows untouched; tensors of another layout are refused (the caller gathers)."""
    from vllm_ddtree.draft.hidden_rows_kernel import move_path_rows_triton
    from vllm_ddtree.runtime_state import hidden_row_gather_index

    gen = torch.Generator().manual_seed(num_tensors)
    depth, qlens = 6, [1 + 9, 1, 1 + 9, 3, 1 + 4]
    src = torch.full((len(qlens), depth), -1, dtype=torch.int64)
    src[0, :6] = torch.tensor([2, 3, 4, 5, 6, 7])  # rows k <- k + 1: chained moves
    src[2, :2] = torch.tensor([4, 9])
    src[3, :3] = torch.tensor([1, 2, 5])  # the last one points past the request: kept
    src[4, :4] = torch.tensor([1, 2, 3, 4])  # src == k: nothing moves
    qsl = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)
    num_rows, hidden = int(qsl[-1]) + 5, 10
    xs = [torch.randn(num_rows, hidden, generator=gen).to(torch.bfloat16)
          for _ in range(num_tensors)]
    safe = src.clone()
    safe[3, 2] = -1  # the gather's rule for a source past the request's rows
    index = hidden_row_gather_index(qsl, safe, num_rows)
    want = [x[index] for x in xs]
    got = [x.clone().to(DEVICE) for x in xs]
    assert move_path_rows_triton(got, qsl.to(DEVICE), src.to(DEVICE), block_h=block_h)
    for g, w, x in zip(got, want, xs, strict=True):
        assert torch.equal(g.cpu(), w)
        assert not torch.equal(g.cpu(), x)  # rows did move
    assert not move_path_rows_triton([got[0], got[0][:, :4]], qsl.to(DEVICE),
                                     src.to(DEVICE))
    assert not move_path_rows_triton([got[0], got[0]], qsl.to(DEVICE), src.to(DEVICE))


def test_greedy_draw_is_argmax_and_skips_the_seeded_draw():
    """DDTreeVerifier's greedy fast path: all requests at temperature 0 without top-k /
    top-p draw ``processed.argmax`` (no gumbel launch, no row positions, no history
    gather without penalties); one sampled request, or top-k, takes vLLM's draw."""
    import numpy as np

    from vllm_ddtree.runtime_state import DDTreeRuntimeState
    from vllm_ddtree.verify.verifier import DDTreeVerifier

    calls = []
    temperature = np.zeros(4, dtype=np.float32)
    top = [(None, None)]
    states = NS(temperature=NS(np=temperature), get_top_k_top_p=lambda *a: top[0])
    sampler = NS(sampling_states=states, logit_bias_state=NS(use_logit_bias=np.zeros(4, bool)),
                 apply_sampling_params=lambda logits, eim, idx, pos, rows, *a, **k:
                 calls.append(("params", pos, rows)) or logits)
    state = DDTreeRuntimeState()
    state.depths = torch.zeros(4, 3, dtype=torch.int64)
    vf = DDTreeVerifier(sampler, NS(num_speculative_tokens=3), "cpu", 2, state=state)
    vf._gumbel_draw = lambda *a: calls.append(("gumbel",)) or torch.zeros(5, dtype=torch.int64)
    vf.draw_fn = vf._gumbel_draw
    vf._row_positions = lambda batch: calls.append(("positions",)) or torch.arange(5)
    logits = torch.randn(5, 11, generator=torch.Generator().manual_seed(0))
    batch = NS(idx_mapping_np=np.array([2, 0]), expanded_idx_mapping=torch.tensor([0] * 5),
               input_ids=torch.arange(20), logits_indices=torch.arange(5),
               expanded_local_pos=torch.arange(5))
    drawn, _, pos = vf.draw_target_tokens(logits, batch, needs_history=False)
    assert torch.equal(drawn, logits.argmax(-1)) and pos is None
    assert calls == [("params", None, None)]
    calls.clear()
    vf.draw_target_tokens(logits, batch, needs_history=True)
    assert calls[0][0] == "params" and torch.equal(calls[0][2], torch.arange(5))
    for change in ("temperature", "top_k", "logit_bias"):
        calls.clear()
        if change == "temperature":
            temperature[0] = 0.7
        elif change == "top_k":
            temperature[0], top[0] = 0.0, (torch.tensor([5]), None)
        else:
            top[0] = (None, None)
            sampler.logit_bias_state.use_logit_bias[2] = True
        vf.draw_target_tokens(logits, batch, needs_history=False)
        names = [c[0] for c in calls]
        if change == "logit_bias":  # still greedy, but the bias reads positions
            assert names == ["positions", "params"], names
        else:
            assert names == ["positions", "params", "gumbel"], (change, names)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="vLLM's gumbel kernel needs CUDA")
def test_argmax_breaks_ties_as_vllms_greedy_gumbel_draw():
    """torch.argmax (the greedy fast path) picks vLLM's gumbel_sample token at
    temperature 0 on rows with exact ties inside one 1024-column block and across
    blocks (both take the first maximal index)."""
    from vllm.v1.worker.gpu.sample.gumbel import gumbel_sample

    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, vocab = 65, 163840
    logits = torch.randn(rows, vocab, device="cuda", generator=gen).to(torch.bfloat16)
    logits = logits.float()
    top = logits.max() + 1
    logits[0, [7, 9]] = top  # one block
    logits[1, [5000, 100000, 163839]] = top  # across blocks
    logits[2, [163839, 3]] = top
    logits[3] = 0.0  # all equal
    temperature = torch.zeros(4, device="cuda")
    seeds = torch.arange(4, device="cuda", dtype=torch.int64)
    idx = torch.zeros(rows, dtype=torch.int32, device="cuda")
    pos = torch.arange(rows, device="cuda", dtype=torch.int64)
    want = gumbel_sample(logits, idx, temperature, seeds, pos, apply_temperature=False)
    got = logits.argmax(dim=-1)
    assert want[:4].tolist() == [7, 5000, 3, 0]
    assert torch.equal(got, want)
