# SPDX-License-Identifier: Apache-2.0
"""The verifier's Triton round (vllm_ddtree.walk.walk_kernel.verify_walk_triton) vs the
PyTorch round it replaces (follow_tree and the finish), field by field and exactly.

Without a GPU the kernel runs in Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1 before triton's first import); with a GPU the same small cases run
compiled. The PyTorch round runs on CPU either way.
"""

import textwrap
from types import SimpleNamespace as NS

import pytest
import torch

triton = pytest.importorskip("triton")

from kernel_testing import DEVICE, compiled_shared_memory  # noqa: E402

from vllm_ddtree.budget.choice import mask_inactive_nodes  # noqa: E402
from vllm_ddtree.tree.draft_tree import DraftTree  # noqa: E402
from vllm_ddtree.verify import verifier  # noqa: E402
from vllm_ddtree.walk import walk_kernel as tree_walk_kernel  # noqa: E402
from vllm_ddtree.walk.follow import WalkResult, follow_tree  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

FIELDS = tuple(WalkResult.__dataclass_fields__)


def assert_same_walk(got: WalkResult, want: WalkResult, label: str = "") -> None:
    for name in FIELDS:
        g, w = getattr(got, name), getattr(want, name)
        assert g.dtype == w.dtype == torch.int64, (label, name, g.dtype, w.dtype)
        assert g.shape == w.shape, (label, name, g.shape, w.shape)
        assert torch.equal(g, w), f"{label} {name}:\n got {g}\nwant {w}"


def path_to(tree: DraftTree, r: int, node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = int(tree.parents[r, node])
    return path[::-1]


@pytest.mark.skipif(not tree_walk_kernel._interpreted(),
                    reason="the verifier scenario is on CPU tensors: needs Triton's interpreter")
@pytest.mark.parametrize("adaptive", [False, True])
def test_verifier_walk_with_the_kernel_matches_the_pytorch_walk(adaptive, monkeypatch):
    """DDTreeVerifier.__call__ with the round forced onto the fused kernel
    (verify_walk_triton) gives the outputs of the PyTorch round (the CPU default):
    sampled rows, counters, and the KV source rows kept for propose."""
    from test_ddtree_integration_units import BUDGET, DEPTHS, make_scenario

    sc = make_scenario(0.0)
    if adaptive:
        sc.state.enable_adaptive_(6, "cpu")
        # request 1 has 5 drafts: its budget of 7 counts as 5 verified nodes
        sc.state.active_nodes[sc.batch.idx_mapping.long()] = torch.tensor([11, 7, 2, 2])
        sc.state.enable_arm_counters_([1, 2, 4, 8, 16], "cpu")  # auto's step gate
    vf = verifier.DDTreeVerifier(sc.sampler, NS(num_speculative_tokens=BUDGET), "cpu",
                                 DEPTHS, state=sc.state, draw_fn=sc.sampler.draw_fn)
    drawn, _, _ = vf.draw_target_tokens(sc.logits.clone(), sc.batch)
    # request 0's targets follow its path to the deepest node
    deep = int(sc.trees.depths[0].argmax())
    start = int(sc.batch.cu_num_logits[0])
    prev = -1
    for node in path_to(sc.trees, 0, deep):
        drawn[start + prev + 1] = sc.trees.tokens[0, node]
        prev = node
    want = vf.walk(drawn, sc.batch)
    counters = ("accepted_sum", "num_drafts") + (
        ("active_nodes_sum", "arm_accepted_sum") if adaptive else ())
    before = {n: getattr(sc.state, n).clone() for n in counters}
    out_want = vf(sc.logits.clone(), sc.batch)
    state_want = {n: getattr(sc.state, n).clone() for n in counters}
    rows_want = sc.state.take_walk(sc.batch.num_reqs).clone()
    assert any(int(state_want[n].sum()) > int(before[n].sum()) for n in counters)
    if adaptive:  # counted (PyTorch round) and growing with the cut
        arms = state_want["arm_accepted_sum"]
        assert 0 <= int(arms[0]) < int(arms[-1]) <= int(state_want["accepted_sum"])
        assert bool((arms[1:] >= arms[:-1]).all())
    for n in counters:  # the forced run must count the same from the same start
        getattr(sc.state, n).copy_(before[n])
    sc.state.walk_kv_src_rows.fill_(-7)

    calls = []

    def forced(tensor):  # the kernels' path, for the CPU tensors of the scenario
        calls.append(1)
        return True

    monkeypatch.setattr(verifier, "use_triton", forced)
    assert int(want.accepted_depth[0]) >= (3 if not adaptive else 1)
    out_got = vf(sc.logits.clone(), sc.batch)
    assert len(calls) == 1  # __call__: the fused walk (verify_walk_triton)
    for name in ("sampled_token_ids", "num_sampled", "num_rejected"):
        assert torch.equal(getattr(out_got, name), getattr(out_want, name)), name
    for n in counters:
        assert torch.equal(getattr(sc.state, n), state_want[n]), n
    assert torch.equal(sc.state.take_walk(sc.batch.num_reqs), rows_want)


def _random_forest(gen, max_reqs: int, budget: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Slot-indexed parents (node i's parent < i) and depths of valid trees."""
    parents = torch.full((max_reqs, budget), -1, dtype=torch.int64)
    depths = torch.ones(max_reqs, budget, dtype=torch.int64)
    for slot in range(max_reqs):
        for i in range(1, budget):
            parent = int(torch.randint(-1, i, (1,), generator=gen))
            parents[slot, i] = parent
            depths[slot, i] = 1 if parent < 0 else int(depths[slot, parent]) + 1
    return parents, depths


@pytest.mark.parametrize("adaptive,count,block_b,walk_width",
                         [(False, True, None, 12), (True, True, 4, 8), (True, False, None, 8),
                          (False, False, 2, 16)])
def test_fused_verify_walk_equals_the_pytorch_round(adaptive, count, block_b, walk_width):
    """verify_walk_triton (one launch) against the PyTorch round it replaces:
    tree_inputs_from_rows + mask_inactive_nodes + follow_tree + sampled_rows_from_walk +
    the counters + num_sampled_and_rejected: full, truncated and draft-less requests, a
    chunked prefill, deep walks (targets forced along a path), multi-block scans."""
    from vllm_ddtree.verify.batch import sampled_rows_from_walk
    from vllm_ddtree.walk.walk_kernel import verify_walk_triton

    gen = torch.Generator().manual_seed(11 + 2 * adaptive + count)
    budget, max_reqs, max_depth = 9, 7, 6
    drafts = [9, 0, 4, 9, 1, 9]  # logit rows per request: 1 + drafts
    num_reqs = len(drafts)
    cu = torch.tensor([0, *torch.tensor([1 + d for d in drafts]).cumsum(0).tolist()],
                      dtype=torch.int32)
    num_logits = int(cu[-1])
    input_ids = torch.randint(0, 3, (num_logits + 20,), generator=gen, dtype=torch.int32)
    logits_indices = torch.randperm(num_logits + 20, generator=gen)[:num_logits]
    drawn = torch.randint(0, 3, (num_logits,), generator=gen)
    idx = torch.randperm(max_reqs, generator=gen)[:num_reqs].int()
    parents, depths = _random_forest(gen, max_reqs, budget)
    active = torch.randint(1, budget + 1, (max_reqs,), generator=gen) if adaptive else None
    rows_tokens = input_ids[logits_indices].long()
    # request 0 (and 3) draw along a path to their deepest node: deep walks
    for r in (0, 3):
        slot, start = int(idx[r]), int(cu[r])
        node = int(depths[slot].argmax())
        path = []
        while node >= 0:
            path.append(node)
            node = int(parents[slot, node])
        prev = -1
        for node in reversed(path):
            drawn[start + prev + 1] = rows_tokens[start + 1 + node]
            prev = node
    seq_lens = torch.full((num_reqs,), 100, dtype=torch.int32)
    prefill_len = torch.full((max_reqs,), 50, dtype=torch.int32)
    prefill_len[int(idx[4])] = 200  # request 4 is mid chunked prefill

    tokens, targets = verifier.tree_inputs_from_rows(rows_tokens, drawn, cu, budget)
    if adaptive:
        tokens = mask_inactive_nodes(tokens, active[idx.long()])
    tree = DraftTree(tokens=tokens, parents=parents[idx.long()], depths=depths[idx.long()],
                     scores=torch.zeros(num_reqs, budget))
    want = follow_tree(tree, targets, max_depth=max_depth)
    want_sampled, want_num, _ = sampled_rows_from_walk(
        want.committed_tokens, want.accepted_depth, budget)
    want_num, want_rejected = verifier.num_sampled_and_rejected_torch(
        want_num, seq_lens, cu, idx, prefill_len)
    has_tree = (cu[1:] - cu[:-1]) > 1
    assert int(want.accepted_depth.max()) >= 3 and int(want.accepted_depth.min()) == 0

    dev = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    walk_rows = dev(torch.full((max_reqs, walk_width), -7, dtype=torch.int64))
    counters = (dev(torch.tensor([5])), dev(torch.tensor([2]))) if count else None
    active_sum = dev(torch.tensor([3])) if adaptive else None
    arm_sizes = torch.tensor([1, 2, 3, 5, 9])
    arm_counters = (dev(arm_sizes), dev(torch.tensor([1, 0, 4, 0, 7]))) if count else None
    walk, sampled, num_sampled, num_rejected = verify_walk_triton(
        dev(input_ids), dev(logits_indices), dev(drawn), dev(cu), dev(idx), dev(parents),
        max_depth, budget, walk_rows, dev(seq_lens), dev(prefill_len), dev(active),
        counters, active_sum, arm_counters, block_b=block_b)
    assert_same_walk(WalkResult(**{n: getattr(walk, n).cpu() for n in FIELDS}), want)
    assert torch.equal(sampled.cpu(), want_sampled)
    assert num_sampled.dtype == num_rejected.dtype == torch.int32
    assert torch.equal(num_sampled.cpu(), want_num)
    assert torch.equal(num_rejected.cpu(), want_rejected)
    assert int(want_num[4]) == 0 and int(want_rejected[4]) == 0
    got_rows = walk_rows.cpu()
    want_rows = torch.full((num_reqs, walk_width), -1, dtype=torch.int64)
    want_rows[:, :max_depth] = want.kv_src_rows
    assert torch.equal(got_rows[:num_reqs], want_rows)
    assert bool((got_rows[num_reqs:] == -7).all())  # other slots untouched
    if count:
        assert int(counters[0]) == 5 + int(torch.where(has_tree, want.accepted_depth, 0).sum())
        assert int(counters[1]) == 2 + int(has_tree.sum())
        if adaptive:
            verified = torch.minimum(active[idx.long()], cu[1:] - cu[:-1] - 1)
            assert int(active_sum) == 3 + int(torch.where(has_tree, verified, 0).sum())
        # against walks of the trees actually cut to their first s nodes
        cut = []
        for size in arm_sizes.tolist():
            cut_tree = DraftTree(tokens=mask_inactive_nodes(tokens, torch.tensor(size)),
                                 parents=tree.parents, depths=tree.depths,
                                 scores=tree.scores)
            walked = follow_tree(cut_tree, targets, max_depth=max_depth)
            cut.append(int(torch.where(has_tree, walked.accepted_depth, 0).sum()))
        assert arm_counters[1].cpu().tolist() == [a + c for a, c in zip(
            [1, 0, 4, 0, 7], cut, strict=True)]
        assert cut[-1] == int(torch.where(has_tree, want.accepted_depth, 0).sum()) > cut[0]


_COMPILE_SCRIPT = textwrap.dedent(
    """
    import json, triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from vllm_ddtree.walk.walk_kernel import _verify_walk_kernel as fn

    result = []
    ptrs = {"cu_ptr": "*i32", "idx_ptr": "*i32", "num_sampled_ptr": "*i32",
            "num_rejected_ptr": "*i32", "seq_lens_ptr": "*i32", "prefill_len_ptr": "*i32",
            "input_ids_ptr": "*i32", "logits_indices_ptr": "*i32"}
    for arch in (90, 120):
        for count, adaptive, block_b, warps in ((False, False, 64, 1), (True, True, 512, 4)):
            consts = dict(ADAPTIVE=adaptive, COUNT=count, NUM_ARMS=7 if count else 0,
                          BLOCK_B=block_b, BLOCK_L=32, BLOCK_S=512, BLOCK_W=32, BLOCK_A=8)
            sig = {n: "constexpr" if n in consts else ptrs.get(n, "*i64")
                   if n.endswith("_ptr") else "i32" for n in fn.arg_names}
            k = triton.compile(ASTSource(fn, sig, constexprs=consts),
                               target=GPUTarget("cuda", arch, 32),
                               options={"num_warps": warps})
            result.append(k.metadata.shared)
    print(json.dumps(result))
    """
)


def test_kernel_compiles_for_sm90_and_sm120():
    """Compile (no GPU needed) for Hopper and Blackwell consumer parts."""
    shared = compiled_shared_memory(_COMPILE_SCRIPT)
    assert len(shared) == 4 and max(shared) < 4096


def test_fused_walk_host_side_has_no_sync(monkeypatch):
    """verify_walk_triton's host side (allocations, launch arguments) reads nothing
    back; the launch is stubbed (the interpreter copies tensors to the host)."""
    from vllm_ddtree.testing.sync_guard import assert_no_host_sync
    from vllm_ddtree.walk.walk_kernel import verify_walk_triton

    launches = []

    class FakeKernel:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append(grid)

    monkeypatch.setattr(tree_walk_kernel, "_verify_walk_kernel", FakeKernel())
    def dev(t):  # compiled Triton (a GPU run of this file) refuses host tensors
        return t.to(DEVICE) if isinstance(t, torch.Tensor) else t

    counters = (dev(torch.zeros(1, dtype=torch.int64)), dev(torch.zeros(1, dtype=torch.int64)))
    args = tuple(dev(a) for a in (
        torch.zeros(8, dtype=torch.int32), torch.arange(5), torch.zeros(5),
        torch.tensor([0, 4, 5], dtype=torch.int32), torch.tensor([1, 0], dtype=torch.int32),
        torch.zeros(3, 6, dtype=torch.int64), 4, 6,
        torch.full((3, 4), -1, dtype=torch.int64), torch.ones(2, dtype=torch.int32),
        torch.zeros(3, dtype=torch.int32), torch.full((3,), 6))) + (
        counters, dev(torch.zeros(1, dtype=torch.int64)))
    with assert_no_host_sync():
        walk, sampled, num_sampled, num_rejected = verify_walk_triton(*args)
    assert launches == [(2,)]
    assert sampled.shape == (2, 7) and num_sampled.shape == num_rejected.shape == (2,)
    assert walk.kv_src_rows.shape == (2, 4)
