# SPDX-License-Identifier: Apache-2.0
"""The Triton acceptance walk (vllm_ddtree.walk.walk_kernel) vs follow_tree and its
per-request oracle follow_tree_reference, field by field and exactly.

Without a GPU the kernel runs in Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1 before triton's first import); with a GPU the same small cases run
compiled. The oracles run on CPU either way.
"""

import textwrap
from types import SimpleNamespace as NS

import pytest
import torch

triton = pytest.importorskip("triton")

from kernel_testing import DEVICE, compiled_shared_memory, kernels_run_here  # noqa: E402

from vllm_ddtree.budget.choice import mask_inactive_nodes  # noqa: E402
from vllm_ddtree.tree.draft_tree import DraftTree, build_ddtree  # noqa: E402
from vllm_ddtree.verify import verifier  # noqa: E402
from vllm_ddtree.walk import walk_kernel as tree_walk_kernel  # noqa: E402
from vllm_ddtree.walk.follow import WalkResult, follow_tree, follow_tree_reference  # noqa: E402
from vllm_ddtree.walk.walk_kernel import follow_tree_triton  # noqa: E402

needs_kernels = pytest.mark.skipif(
    not kernels_run_here(tree_walk_kernel._follow_tree_kernel),
    reason="triton was imported before TRITON_INTERPRET was set (see tests/conftest.py)",
)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

FIELDS = tuple(WalkResult.__dataclass_fields__)
VOCAB = 6


def on(tree: DraftTree, device) -> DraftTree:
    return DraftTree(*(getattr(tree, n).to(device) for n in ("tokens", "parents", "depths",
                                                              "scores")))


def kernel_walk(tree: DraftTree, targets: torch.Tensor, max_depth: int, **kwargs) -> WalkResult:
    """follow_tree_triton on DEVICE, results back on the CPU."""
    out = follow_tree_triton(on(tree, DEVICE), targets.to(DEVICE), max_depth, **kwargs)
    return WalkResult(**{n: getattr(out, n).cpu() for n in FIELDS})


def assert_same_walk(got: WalkResult, want: WalkResult, label: str = "") -> None:
    for name in FIELDS:
        g, w = getattr(got, name), getattr(want, name)
        assert g.dtype == w.dtype == torch.int64, (label, name, g.dtype, w.dtype)
        assert g.shape == w.shape, (label, name, g.shape, w.shape)
        assert torch.equal(g, w), f"{label} {name}:\n got {g}\nwant {w}"


def check(tree, targets, max_depth, block_sizes=(None,), reference=True, label=""):
    """The kernel (at each block size) equals follow_tree, and the reference when
    ``reference`` (it pads to max_depth but cannot cut a deeper path)."""
    want = follow_tree(tree, targets, max_depth=max_depth)
    if reference:
        assert_same_walk(follow_tree_reference(tree, targets, max_depth), want, "oracles")
    for block_b in block_sizes:
        got = kernel_walk(tree, targets, max_depth, block_b=block_b)
        assert_same_walk(got, want, f"{label} block_b={block_b}")
    return want


def peaked_logits(num_requests, depths, gen):
    """Logits with one dominant token per depth: best-first trees grow a deep spine."""
    logits = torch.randn(num_requests, depths, VOCAB, generator=gen)
    best = torch.randint(0, VOCAB, (num_requests, depths, 1), generator=gen)
    return logits.scatter_add(2, best, torch.full(best.shape, 6.0))


def path_to(tree: DraftTree, r: int, node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = int(tree.parents[r, node])
    return path[::-1]


def path_targets(tree: DraftTree, gen) -> tuple[torch.Tensor, list[int]]:
    """Targets ``[R, 1 + B]`` that follow each request's path to its deepest node
    (random tokens elsewhere); returns them and the path lengths."""
    targets = torch.randint(0, VOCAB, (tree.num_requests, 1 + tree.budget), generator=gen)
    lengths = []
    for r in range(tree.num_requests):
        path = path_to(tree, r, int(tree.depths[r].argmax()))
        prev = -1
        for node in path:
            targets[r, prev + 1] = tree.tokens[r, node]
            prev = node
        lengths.append(len(path))
    return targets, lengths


# (R, B, L, top_k, block sizes): B = 130 also runs in 32-node blocks (5 blocks, last partial)
CONFIGS = [
    (3, 1, 3, None, (None,)),
    (2, 7, 4, 2, (None, 4)),
    (4, 32, 15, None, (None,)),
    (2, 32, 6, 2, (None, 8)),
    (2, 130, 8, 2, (None, 32)),
]


@needs_kernels
@pytest.mark.parametrize("num_requests,budget,depths,top_k,block_sizes", CONFIGS)
def test_random_trees_match_follow_tree(num_requests, budget, depths, top_k, block_sizes):
    gen = torch.Generator().manual_seed(budget * 100 + depths)
    for kind in ("randn", "peaked"):
        logits = (torch.randn(num_requests, depths, VOCAB, generator=gen) * 2 if kind == "randn"
                  else peaked_logits(num_requests, depths, gen))
        tree = build_ddtree(logits, budget, top_k)
        label = f"{kind} R={num_requests} B={budget} L={depths} top_k={top_k}"

        # (a) random target tokens
        targets = torch.randint(0, VOCAB, (num_requests, 1 + budget), generator=gen)
        check(tree, targets, depths, block_sizes, label=label + " random")

        # (b) targets along each request's path to its deepest node
        targets, lengths = path_targets(tree, gen)
        walk = check(tree, targets, depths, block_sizes, label=label + " path")
        assert all(a >= n for a, n in zip(walk.accepted_depth.tolist(), lengths, strict=True))
        if kind == "peaked" and budget >= 7:
            assert min(walk.accepted_depth.tolist()) >= 3, walk.accepted_depth

        # (c) nodes past an active budget b masked to -1, and the verifier's padding
        # past n drafts (tokens and targets -1), with the path targets of (b)
        active = torch.randint(0, budget + 1, (num_requests,), generator=gen)
        masked = DraftTree(mask_inactive_nodes(tree.tokens, active), tree.parents,
                           tree.depths, tree.scores)
        walk = check(masked, targets, depths, block_sizes, label=label + " masked")
        for r, b in enumerate(active.tolist()):
            small = DraftTree(tree.tokens[r : r + 1, :b], tree.parents[r : r + 1, :b],
                              tree.depths[r : r + 1, :b], tree.scores[r : r + 1, :b])
            ref = follow_tree_reference(small, targets[r : r + 1, : 1 + b], depths)
            assert torch.equal(walk.committed_tokens[r], ref.committed_tokens[0])
        num_drafts = torch.randint(0, budget + 1, (num_requests, 1), generator=gen)
        cols = torch.arange(1 + budget)[None, :]
        padded = DraftTree(torch.where(cols[:, 1:] <= num_drafts, masked.tokens, -1),
                           tree.parents, tree.depths, tree.scores)
        check(padded, torch.where(cols <= num_drafts, targets, -1), depths, block_sizes,
              label=label + " padded")


def chain_tree(tokens: list[int]) -> DraftTree:
    n = len(tokens)
    return DraftTree(torch.tensor([tokens]), torch.arange(-1, n - 1)[None],
                     torch.arange(1, n + 1)[None], torch.zeros(1, n))


@needs_kernels
def test_duplicate_child_tokens_take_the_lowest_index():
    # node:      0   1   2   3   4   5   6
    parents = [-1, -1, 0, 1, 1, 2, 2]
    tokens = [5, 5, 3, 4, 3, 3, 3]
    tree = DraftTree(torch.tensor([tokens] * 2), torch.tensor([parents] * 2),
                     torch.tensor([[1, 1, 2, 2, 2, 3, 3]] * 2), torch.zeros(2, 7))
    # request 0: 5 -> node 0 (not 1), 3 -> node 2, 3 -> node 5 (not 6)
    # request 1: the root's target 4 has no child; the walk stops at once
    targets = torch.tensor([[5, 3, 0, 3, 0, 0, 1, 2], [4, 3, 0, 3, 0, 0, 1, 2]])
    walk = check(tree, targets, 3, block_sizes=(None, 1, 2, 4))
    assert walk.accepted_nodes.tolist() == [[0, 2, 5], [-1, -1, -1]]
    assert walk.committed_tokens.tolist() == [[5, 3, 3, 1], [4, -1, -1, -1]]

    # across blocks: the root's children 3 and 37 share a token; only 37's subtree
    # continues, yet 3 wins (lowest index, in an earlier block)
    budget = 40
    parents = [-1] * budget
    parents[39] = 37
    tokens = list(range(100, 100 + budget))
    tokens[37] = tokens[3]
    tree = DraftTree(torch.tensor([tokens]), torch.tensor([parents]),
                     torch.tensor([[2 if p >= 0 else 1 for p in parents]]),
                     torch.zeros(1, budget))
    targets = torch.full((1, 1 + budget), 7)
    targets[0, 0] = tokens[3]
    targets[0, 1 + 37] = tokens[39]
    walk = check(tree, targets, 2, block_sizes=(None, 8, 16))
    assert walk.accepted_nodes.tolist() == [[3, -1]]
    # a match only in a later block, and a malformed (non-topological) parent order
    parents = [3, -1, 0, 1] + [-1] * 36
    tokens = [7, 1, 8, 2] + list(range(200, 236))
    tokens[33] = 9
    parents[33] = 2
    tree = DraftTree(torch.tensor([tokens]), torch.tensor([parents]),
                     torch.ones(1, budget, dtype=torch.int64), torch.zeros(1, budget))
    targets = torch.zeros(1, 1 + budget, dtype=torch.int64)
    targets[0, [0, 1 + 1, 1 + 3, 1 + 0, 1 + 2]] = torch.tensor([1, 2, 7, 8, 9])
    walk = check(tree, targets, 6, block_sizes=(None, 8))
    assert walk.accepted_nodes.tolist() == [[1, 3, 0, 2, 33, -1]]


@needs_kernels
def test_masked_nodes_never_match():
    tree = chain_tree([4, -1, 2])
    walk = check(tree, torch.tensor([[4, 3, 2, 0]]), 3)
    assert walk.accepted_nodes.tolist() == [[0, -1, -1]]
    assert walk.bonus_tokens.tolist() == [3]


@needs_kernels
@pytest.mark.parametrize("max_depth", [0, 1, 2, 5, 9])
def test_max_depth_cuts_and_pads_the_walk(max_depth):
    """A 5-deep chain, fully accepted: max_depth < 5 stops the walk early (as
    follow_tree does; the reference has no cut), max_depth > 5 pads."""
    tree = chain_tree([3, 1, 4, 1, 5])
    tree = DraftTree(torch.cat([tree.tokens, torch.tensor([[3, 1, 0, 0, 0]])]),
                     tree.parents.repeat(2, 1), tree.depths.repeat(2, 1),
                     tree.scores.repeat(2, 1))
    targets = torch.tensor([[3, 1, 4, 1, 5, 9]] * 2)
    walk = check(tree, targets, max_depth, reference=max_depth >= 5, block_sizes=(None, 2))
    assert walk.accepted_depth.tolist() == [min(5, max_depth), min(2, max_depth)]
    assert walk.committed_tokens.shape == (2, max_depth + 1)


@needs_kernels
def test_empty_batch_and_empty_trees():
    """R = 0 (no launch) and B = 0 (the walk stops at the root). follow_tree fails on
    B = 0 with R > 0 (a gather from an empty dim), so that case checks the reference."""
    for num_requests, budget in ((0, 5), (0, 0), (3, 0)):
        tree = DraftTree(*(torch.zeros(num_requests, budget, dtype=torch.int64)
                           for _ in range(3)), torch.zeros(num_requests, budget))
        targets = torch.arange(num_requests * (1 + budget)).view(num_requests, 1 + budget)
        if num_requests and not budget:
            walk = follow_tree_reference(tree, targets, 4)
            assert_same_walk(kernel_walk(tree, targets, 4), walk, "B=0")
        else:
            walk = check(tree, targets, 4)
        assert walk.bonus_tokens.tolist() == targets[:, 0].tolist()
        assert walk.accepted_nodes.shape == (num_requests, 4)


@needs_kernels
def test_int32_and_strided_inputs():
    gen = torch.Generator().manual_seed(3)
    tree = build_ddtree(peaked_logits(3, 5, gen), 12, 3)
    targets, _ = path_targets(tree, gen)
    want = follow_tree(tree, targets, max_depth=5)
    narrow = DraftTree(tree.tokens.int(), tree.parents.int(), tree.depths, tree.scores)
    assert_same_walk(kernel_walk(narrow, targets.int(), 5), want, "int32")
    assert_same_walk(kernel_walk(tree, targets.int(), 5), want, "mixed")
    # strided: tokens / parents as transposed views, targets every other column
    strided = DraftTree(tree.tokens.t().contiguous().t(), tree.parents.t().contiguous().t(),
                        tree.depths, tree.scores)
    wide = torch.stack([targets, -targets], dim=2).flatten(1)[:, ::2]
    assert not strided.tokens.is_contiguous() and not wide.is_contiguous()
    assert_same_walk(kernel_walk(strided, wide, 5, block_b=4), want, "strided")


def test_validation():
    tree = chain_tree([1, 2])
    targets = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match="target_tokens"):
        follow_tree_triton(tree, targets[:, :2], 2)
    for bad in (-1, 2.0, None, True):
        with pytest.raises(ValueError, match="max_depth"):
            follow_tree_triton(tree, targets, bad)
    with pytest.raises(ValueError, match="block_b"):
        follow_tree_triton(tree, targets, 2, block_b=3)


def test_launch_wrapper_has_no_host_sync(monkeypatch):
    """Everything around the launch (checks, output allocation) stays off the device
    data; the launch itself (a Python call) is stubbed: the detector cannot see into
    Triton, and the interpreter copies tensors to the host."""
    from vllm_ddtree.testing.sync_guard import assert_no_host_sync

    launches = []

    class FakeKernel:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((grid, kwargs))

    monkeypatch.setattr(tree_walk_kernel, "_follow_tree_kernel", FakeKernel())
    monkeypatch.setattr(tree_walk_kernel, "_interpreted", lambda: True)
    tree = build_ddtree(torch.randn(3, 15, VOCAB), 32)
    targets = torch.randint(0, VOCAB, (3, 33))
    with assert_no_host_sync():
        walk = follow_tree_triton(tree, targets, 15)
    assert [(grid, kw["BLOCK_B"], kw["BLOCK_L"]) for grid, kw in launches] == [((3,), 32, 16)]
    assert walk.committed_tokens.shape == (3, 16) and walk.accepted_depth.shape == (3,)


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
    counters = ("accepted_sum", "num_drafts") + (("active_nodes_sum",) if adaptive else ())
    before = {n: getattr(sc.state, n).clone() for n in counters}
    out_want = vf(sc.logits.clone(), sc.batch)
    state_want = {n: getattr(sc.state, n).clone() for n in counters}
    rows_want = sc.state.take_walk(sc.batch.num_reqs).clone()
    assert any(int(state_want[n]) > int(before[n]) for n in counters)
    for n in counters:  # the forced run must count the same from the same start
        getattr(sc.state, n).copy_(before[n])
    sc.state.walk_kv_src_rows.fill_(-7)

    calls = []

    def forced(tensor):  # the kernels' switch, for the CPU tensors of the scenario
        calls.append(1)
        return True

    monkeypatch.setattr(verifier, "use_triton_round_kernels", forced)
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
    walk, sampled, num_sampled, num_rejected = verify_walk_triton(
        dev(input_ids), dev(logits_indices), dev(drawn), dev(cu), dev(idx), dev(parents),
        max_depth, budget, walk_rows, dev(seq_lens), dev(prefill_len), dev(active),
        counters, active_sum, block_b=block_b)
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


_COMPILE_SCRIPT = textwrap.dedent(
    """
    import json, triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from vllm_ddtree.walk.walk_kernel import _follow_tree_kernel as fn

    result = []
    for arch in (90, 120):
        for dtype in ("i32", "i64"):
            for block_b, num_warps in ((32, 1), (512, 4)):
                consts = dict(BLOCK_B=block_b, BLOCK_L=16)
                sig = {n: "constexpr" if n in consts else
                       ("*" + dtype if n in ("tokens_ptr", "parents_ptr", "targets_ptr")
                        else "*i64") if n.endswith("_ptr") else "i32"
                       for n in fn.arg_names}
                k = triton.compile(ASTSource(fn, sig, constexprs=consts),
                                   target=GPUTarget("cuda", arch, 32),
                                   options={"num_warps": num_warps})
                result.append(k.metadata.shared)
    from vllm_ddtree.walk.walk_kernel import _verify_walk_kernel as fused_fn

    ptrs = {"cu_ptr": "*i32", "idx_ptr": "*i32", "num_sampled_ptr": "*i32",
            "num_rejected_ptr": "*i32", "seq_lens_ptr": "*i32", "prefill_len_ptr": "*i32",
            "input_ids_ptr": "*i32", "logits_indices_ptr": "*i32"}
    for arch in (90, 120):
        for count, adaptive, block_b, warps in ((False, False, 64, 1), (True, True, 512, 4)):
            consts = dict(ADAPTIVE=adaptive, COUNT=count, BLOCK_B=block_b, BLOCK_L=32,
                          BLOCK_S=512, BLOCK_W=32)
            sig = {n: "constexpr" if n in consts else ptrs.get(n, "*i64")
                   if n.endswith("_ptr") else "i32" for n in fused_fn.arg_names}
            k = triton.compile(ASTSource(fused_fn, sig, constexprs=consts),
                               target=GPUTarget("cuda", arch, 32),
                               options={"num_warps": warps})
            result.append(k.metadata.shared)
    print(json.dumps(result))
    """
)


def test_kernel_compiles_for_sm90_and_sm120():
    """Compile (no GPU needed) for Hopper and Blackwell consumer parts: the walk and
    the fused verify walk."""
    shared = compiled_shared_memory(_COMPILE_SCRIPT)
    assert len(shared) == 12 and max(shared) < 4096


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
