# SPDX-License-Identifier: Apache-2.0
"""Tests of vllm_ddtree.tree.draft_tree: tree construction, mask bits and the acceptance walk."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_ddtree.tree.draft_tree import (
    DraftTree,
    _sort_keys,
    build_ddtree,
    build_ddtree_reference,
    pack_ancestor_mask,
    unpack_ancestor_bits,
)
from vllm_ddtree.walk.follow import follow_tree, follow_tree_reference

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
LOGIT_KINDS = ("randn", "quantized", "uniform", "repeated", "peaked")


def make_logits(kind: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Draft logits; every kind but "randn" forces ties between tokens and/or prefixes."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "randn":
        return torch.randn(shape, generator=gen) * 2
    if kind == "quantized":  # few distinct values per row
        return torch.randint(0, 3, shape, generator=gen).float()
    if kind == "uniform":  # every prefix of a depth ties
        return torch.zeros(shape)
    if kind == "repeated":  # the same row at every depth: many equal prefix scores
        row = torch.randint(0, 4, (shape[0], 1, shape[2]), generator=gen).float()
        return row.expand(shape).contiguous()
    if kind == "peaked":  # log-probs of exactly 0 and -inf
        logits = torch.full(shape, float("-inf"))
        best = torch.randint(0, shape[2], shape[:2], generator=gen)
        logits.scatter_(2, best.unsqueeze(-1), 0.0)
        return logits
    raise AssertionError(kind)


def logprobs_fp32(logits: torch.Tensor) -> torch.Tensor:
    lp = torch.log_softmax(logits.float(), dim=-1)
    return torch.where(torch.isnan(lp), float("-inf"), lp)


def brute_force_scores(logprobs: torch.Tensor, top_k: int) -> torch.Tensor:
    """Scores (fp32, accumulated from depth 1 like the builders) of every prefix of
    one request whose token at each depth is among that depth's top_k log-probs,
    sorted descending. The top_k values are taken by value, so which of several tied
    tokens is kept does not change the multiset."""
    num_depths, vocab_size = logprobs.shape
    k = min(top_k, vocab_size)
    level = torch.zeros(1)
    all_scores = []
    for d in range(num_depths):
        values = torch.sort(logprobs[d], descending=True).values[:k]
        level = (level[:, None] + values[None, :]).reshape(-1)
        all_scores.append(level)
    return torch.sort(torch.cat(all_scores), descending=True).values


def path_of(tree: DraftTree, r: int, node: int) -> list[int]:
    parents = tree.parents[r].tolist()
    path = []
    while node != -1:
        path.append(node)
        node = parents[node]
    return path[::-1]


def check_tree_structure(tree: DraftTree, logits: torch.Tensor, top_k: int | None) -> None:
    num_requests, budget = tree.tokens.shape
    vocab_size = logits.shape[2]
    k = min(budget, vocab_size) if top_k is None else min(top_k, vocab_size)
    lp = logprobs_fp32(logits)
    assert tree.tokens.dtype == torch.int64 and tree.parents.dtype == torch.int64
    assert tree.depths.dtype == torch.int64 and tree.scores.dtype == torch.float32
    for r in range(num_requests):
        tokens = tree.tokens[r].tolist()
        parents = tree.parents[r].tolist()
        depths = tree.depths[r].tolist()
        scores = tree.scores[r].tolist()
        children: dict[int, list[int]] = {}
        for i in range(budget):
            p = parents[i]
            assert -1 <= p < i, "topological order"
            assert depths[i] == (1 if p == -1 else depths[p] + 1)
            children.setdefault(p, []).append(tokens[i])
            # Documented order: (-score, depth, parent) non-decreasing.
            if i:
                prev = (-scores[i - 1], depths[i - 1], parents[i - 1])
                assert prev <= (-scores[i], depths[i], p)
            # Score is the fp32 sum of the path's log-probs, from depth 1 down.
            expected = torch.zeros((), dtype=torch.float32)
            for n in path_of(tree, r, i):
                d = depths[n] - 1
                expected = expected + lp[r, d, tokens[n]]
                # The token is among the top_k of its depth (by value).
                kth = torch.sort(lp[r, d], descending=True).values[k - 1]
                assert lp[r, d, tokens[n]] >= kth
            assert expected.item() == scores[i]
        for siblings in children.values():
            assert len(siblings) == len(set(siblings)), "sibling tokens distinct"
            assert len(siblings) <= k, "top_k respected"


def assert_trees_equal(a: DraftTree, b: DraftTree) -> None:
    assert torch.equal(a.tokens, b.tokens)
    assert torch.equal(a.parents, b.parents)
    assert torch.equal(a.depths, b.depths)
    # Bitwise: same fp32 operations in the same order.
    assert torch.equal(a.scores.view(torch.int32), b.scores.view(torch.int32))


def num_prefixes(num_depths: int, vocab_size: int, top_k: int) -> int:
    k = min(top_k, vocab_size)
    return sum(k**d for d in range(1, num_depths + 1))


# --------------------------------------------------------------------------------
# build_ddtree
# --------------------------------------------------------------------------------


@SETTINGS
@given(
    num_requests=st.integers(1, 3),
    num_depths=st.integers(1, 4),
    vocab_size=st.integers(2, 5),
    kind=st.sampled_from(LOGIT_KINDS),
    seed=st.integers(0, 2**31 - 1),
    data=st.data(),
)
def test_build_is_optimal_and_matches_reference(
    num_requests, num_depths, vocab_size, kind, seed, data
):
    top_k = data.draw(st.one_of(st.none(), st.integers(1, vocab_size + 1)), label="top_k")
    limit = num_prefixes(num_depths, vocab_size, vocab_size if top_k is None else top_k)
    budget = data.draw(st.integers(1, limit), label="budget")
    logits = make_logits(kind, (num_requests, num_depths, vocab_size), seed)

    tree = build_ddtree(logits, budget, top_k=top_k)
    ref = build_ddtree_reference(logits, budget, top_k=top_k)
    assert_trees_equal(tree, ref)
    assert tree.tokens.shape == (num_requests, budget)
    check_tree_structure(tree, logits, top_k)

    k = min(budget, vocab_size) if top_k is None else top_k
    lp = logprobs_fp32(logits)
    for r in range(num_requests):
        best = brute_force_scores(lp[r], k)[:budget]
        got = torch.sort(tree.scores[r], descending=True).values
        assert torch.equal(got, best), (got, best)


@pytest.mark.parametrize("kind", LOGIT_KINDS)
@pytest.mark.parametrize(
    "shape,budget,top_k",
    [
        ((2, 15, 50), 512, None),
        ((3, 15, 7), 300, 3),
        ((1, 6, 2), 126, None),  # every prefix (2 + 4 + ... + 64)
        ((2, 15, 1000), 64, 8),
        ((4, 3, 30), 200, 100),
    ],
)
def test_build_matches_reference_large(kind, shape, budget, top_k):
    logits = make_logits(kind, shape, seed=sum(shape) + budget)
    tree = build_ddtree(logits, budget, top_k=top_k)
    assert_trees_equal(tree, build_ddtree_reference(logits, budget, top_k=top_k))
    check_tree_structure(tree, logits, top_k)


@pytest.mark.parametrize("budget_bytes", [1, 3 * 50 * 8 * 4])
def test_build_ranks_depths_in_batches(monkeypatch, budget_bytes):
    """Depths ranked in several batches (one depth each, or 4 of 15 per batch: a
    short last batch) build the same trees as all depths at once."""
    import vllm_ddtree.tree.draft_tree as tree_mod

    logits = make_logits("randn", (3, 15, 50), seed=9)
    whole = build_ddtree(logits, 200, top_k=6)
    monkeypatch.setattr(tree_mod, "_RANK_BATCH_BYTES", budget_bytes)
    assert_trees_equal(build_ddtree(logits, 200, top_k=6), whole)
    assert_trees_equal(whole, build_ddtree_reference(logits, 200, top_k=6))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_build_low_precision_inputs(dtype):
    logits = make_logits("randn", (2, 5, 40), seed=3).to(dtype)
    tree = build_ddtree(logits, 100)
    assert_trees_equal(tree, build_ddtree_reference(logits, 100))
    assert tree.scores.dtype == torch.float32
    assert_trees_equal(tree, build_ddtree(logits.float(), 100))


def test_build_known_tree():
    # Depth 1: p = (0.6, 0.3, 0.1); depth 2: p = (0.1, 0.2, 0.7).
    probs = torch.tensor([[[0.6, 0.3, 0.1], [0.1, 0.2, 0.7]]])
    tree = build_ddtree(probs.log(), 4)
    # 0.6 (t0), 0.6*0.7=0.42 (t0,t2), 0.3 (t1), 0.3*0.7=0.21 (t1,t2)
    assert tree.tokens.tolist() == [[0, 2, 1, 2]]
    assert tree.parents.tolist() == [[-1, 0, -1, 2]]
    assert tree.depths.tolist() == [[1, 2, 1, 2]]
    expected = torch.tensor([[0.6, 0.42, 0.3, 0.21]]).log()
    torch.testing.assert_close(tree.scores, expected)


def test_build_tie_order():
    # Uniform logits: all nodes of a depth tie, so the order is depth, then parent,
    # then token id (rank ties break by ascending token id).
    tree = build_ddtree(torch.zeros(1, 2, 3), 7)
    assert tree.depths.tolist() == [[1, 1, 1, 2, 2, 2, 2]]
    assert tree.tokens.tolist() == [[0, 1, 2, 0, 1, 2, 0]]
    assert tree.parents.tolist() == [[-1, -1, -1, 0, 0, 0, 1]]
    # A child with an exact-0 log-prob ties its parent's score: it still comes
    # after every shallower node of that score.
    logits = torch.tensor([[[0.0, 0.0], [0.0, float("-inf")]]])
    tree = build_ddtree(logits, 3)
    assert tree.tokens.tolist() == [[0, 1, 0]]
    assert tree.parents.tolist() == [[-1, -1, 0]]
    assert tree.scores[0, 0] == tree.scores[0, 1] == tree.scores[0, 2]


def test_sort_keys_match_float_order():
    # The batched builder ranks by integer keys; they must agree with float order
    # (ties by index), including -0.0 == +0.0, infinities and subnormals.
    values = [0.0, -0.0, -1.5, float("-inf"), 2.0, -1e-45, 1e-45, -0.0, -1.5, float("inf")]
    values += torch.randn(40, generator=torch.Generator().manual_seed(0)).round().tolist()
    keys = _sort_keys(torch.tensor(values))
    got = torch.sort(keys, descending=True).indices.tolist()
    assert got == sorted(range(len(values)), key=lambda i: (-values[i], i))


def test_build_on_cuda_matches_cpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    logits = make_logits("quantized", (3, 15, 300), seed=1)
    cpu = build_ddtree(logits, 256)
    gpu = build_ddtree(logits.cuda(), 256)
    assert_trees_equal(cpu, DraftTree(*(getattr(gpu, n).cpu()
                                        for n in ("tokens", "parents", "depths", "scores"))))


def test_build_errors():
    logits = torch.zeros(1, 3, 4)
    with pytest.raises(ValueError, match="budget must be >= 1"):
        build_ddtree(logits, 0)
    with pytest.raises(ValueError, match="budget must be >= 1"):
        build_ddtree_reference(logits, -3)
    with pytest.raises(ValueError, match=r"draft_logits must be \[R, L, V\]"):
        build_ddtree(torch.zeros(3, 4), 2)
    with pytest.raises(ValueError, match=r"draft_logits must be \[R, L, V\]"):
        build_ddtree(torch.zeros(1, 1, 3, 4), 2)
    with pytest.raises(ValueError, match="top_k must be >= 1"):
        build_ddtree(logits, 2, top_k=0)
    with pytest.raises(ValueError, match="floating-point"):
        build_ddtree(torch.zeros(1, 3, 4, dtype=torch.int64), 2)
    # 4 + 16 + 64 = 84 prefixes; with top_k=2: 2 + 4 + 8 = 14.
    assert build_ddtree(logits, 84).budget == 84
    with pytest.raises(ValueError, match="budget=85"):
        build_ddtree(logits, 85)
    assert build_ddtree(logits, 14, top_k=2).budget == 14
    with pytest.raises(ValueError, match="budget=15"):
        build_ddtree_reference(logits, 15, top_k=2)
    with pytest.raises(ValueError, match="budget=1"):
        build_ddtree(torch.zeros(2, 0, 4), 1)


# --------------------------------------------------------------------------------
# Mask bits
# --------------------------------------------------------------------------------


def brute_force_ancestor_words(tree: DraftTree) -> torch.Tensor:
    """Python-int packing of the parent-chain ancestor sets, as signed int64."""
    num_rows = 1 + tree.budget
    num_words = (num_rows + 63) // 64
    out = []
    for r in range(tree.num_requests):
        parents = tree.parents[r].tolist()
        rows = []
        for row in range(num_rows):
            visible = {0, row}
            node = row - 1
            while node != -1:
                visible.add(node + 1)
                node = parents[node]
            value = sum(1 << j for j in visible)
            words = [(value >> (64 * w)) & ((1 << 64) - 1) for w in range(num_words)]
            rows.append([w - (1 << 64) if w >= 1 << 63 else w for w in words])
        out.append(rows)
    return torch.tensor(out, dtype=torch.int64)


def random_tree(num_requests: int, budget: int, seed: int, chain_prob: float) -> DraftTree:
    """Arbitrary topological trees (deep chains included), built by hand."""
    gen = torch.Generator().manual_seed(seed)
    parents = torch.empty(num_requests, budget, dtype=torch.int64)
    depths = torch.empty_like(parents)
    for r in range(num_requests):
        for i in range(budget):
            if i and torch.rand((), generator=gen) < chain_prob:
                p = i - 1
            else:
                p = int(torch.randint(-1, i, (), generator=gen))
            parents[r, i] = p
            depths[r, i] = 1 if p == -1 else depths[r, p] + 1
    tokens = torch.randint(0, 10**6, (num_requests, budget), generator=gen)
    return DraftTree(tokens, parents, depths, torch.zeros(num_requests, budget))


@pytest.mark.parametrize("budget", [1, 2, 62, 63, 64, 65, 127, 128, 130, 200])
@pytest.mark.parametrize("chain_prob", [0.0, 0.5, 1.0])
def test_ancestor_bits_brute_force(budget, chain_prob):
    tree = random_tree(3, budget, seed=budget, chain_prob=chain_prob)
    bits = tree.ancestor_bits()
    assert bits.dtype == torch.int64
    assert bits.shape == (3, 1 + budget, (budget + 64) // 64)
    assert torch.equal(bits, brute_force_ancestor_words(tree))
    mask = tree.ancestor_mask()
    assert mask.shape == (3, 1 + budget, 1 + budget)
    assert torch.equal(mask, unpack_ancestor_bits(bits, 1 + budget))
    # Row 0 is the root only; every row sees the root and itself.
    assert mask[:, 0].sum().item() == 3
    assert mask[:, :, 0].all() and torch.diagonal(mask, dim1=1, dim2=2).all()


@pytest.mark.parametrize("budget", [63, 64, 150])
def test_ancestor_bits_of_built_tree(budget):
    tree = build_ddtree(make_logits("randn", (2, 15, 6), seed=budget), budget)
    assert torch.equal(tree.ancestor_bits(), brute_force_ancestor_words(tree))
    # Bit 63 is row/node 62's own bit: its word is negative.
    assert (tree.ancestor_bits()[:, 63, 0] < 0).all()


def test_positions_offsets():
    tree = random_tree(2, 20, seed=0, chain_prob=0.5)
    offsets = tree.positions_offsets()
    assert offsets.shape == (2, 21)
    assert offsets[:, 0].tolist() == [0, 0]
    assert torch.equal(offsets[:, 1:], tree.depths)


@pytest.mark.parametrize("n", [1, 7, 63, 64, 65, 128, 130, 192])
def test_pack_unpack_round_trip(n):
    gen = torch.Generator().manual_seed(n)
    mask = torch.rand(3, 5, n, generator=gen) < 0.5
    bits = pack_ancestor_mask(mask)
    assert bits.shape == (3, 5, (n + 63) // 64) and bits.dtype == torch.int64
    assert torch.equal(unpack_ancestor_bits(bits, n), mask)
    # The other way round, on words with arbitrary bits (sign bit included).
    words = torch.randint(-(2**63), 2**63 - 1, (4, (n + 63) // 64), generator=gen)
    words[:, -1] &= (1 << (n - 64 * (words.shape[1] - 1))) - 1 if n % 64 else -1
    assert torch.equal(pack_ancestor_mask(unpack_ancestor_bits(words, n)), words)


def test_pack_bit_layout():
    mask = torch.zeros(130, dtype=torch.bool)
    mask[[0, 63, 64, 129]] = True
    assert pack_ancestor_mask(mask).tolist() == [1 - 2**63, 1, 2]
    assert unpack_ancestor_bits(torch.tensor([-(2**63)]), 64).nonzero().tolist() == [[63]]
    with pytest.raises(ValueError):
        unpack_ancestor_bits(torch.tensor([1]), 65)


# --------------------------------------------------------------------------------
# follow_tree
# --------------------------------------------------------------------------------


def assert_walks_equal(a, b) -> None:
    for name in vars(a):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


@SETTINGS
@given(
    num_requests=st.integers(1, 4),
    num_depths=st.integers(1, 6),
    vocab_size=st.integers(2, 4),
    kind=st.sampled_from(LOGIT_KINDS[:4]),
    seed=st.integers(0, 2**31 - 1),
    data=st.data(),
)
def test_follow_tree_matches_reference(num_requests, num_depths, vocab_size, kind, seed, data):
    limit = num_prefixes(num_depths, vocab_size, vocab_size)
    budget = data.draw(st.integers(1, min(limit, 80)), label="budget")
    tree = build_ddtree(make_logits(kind, (num_requests, num_depths, vocab_size), seed), budget)
    gen = torch.Generator().manual_seed(seed + 1)
    # A small vocabulary makes long accepted paths likely.
    target = torch.randint(0, vocab_size, (num_requests, 1 + budget), generator=gen)
    walk = follow_tree(tree, target)
    assert_walks_equal(walk, follow_tree_reference(tree, target))

    max_depth = int(tree.depths.max())
    assert walk.accepted_nodes.shape == (num_requests, max_depth)
    assert walk.committed_tokens.shape == (num_requests, max_depth + 1)
    for r in range(num_requests):
        a = int(walk.accepted_depth[r])
        path = walk.accepted_nodes[r, :a].tolist()
        assert (walk.accepted_nodes[r, a:] == -1).all()
        # The path is a chain from the root that agrees with the target everywhere.
        assert path == (path_of(tree, r, path[-1]) if path else [])
        rows = [0] + [n + 1 for n in path]
        for row, n in zip(rows, path, strict=False):
            assert int(tree.tokens[r, n]) == int(target[r, row])
        # ...and it stops: no child of the last node has the target's token.
        last = path[-1] if path else -1
        children = (tree.parents[r] == last).nonzero().flatten().tolist()
        assert all(int(tree.tokens[r, c]) != int(target[r, rows[-1]]) for c in children)
        assert walk.bonus_tokens[r] == target[r, rows[-1]]
        assert walk.committed_tokens[r, : a + 1].tolist() == (
            [int(tree.tokens[r, n]) for n in path] + [int(target[r, rows[-1]])]
        )


@pytest.mark.parametrize("seed", range(5))
def test_follow_tree_along_chosen_path(seed):
    num_requests, budget, vocab_size = 3, 60, 4
    tree = build_ddtree(make_logits("randn", (num_requests, 8, vocab_size), seed), budget)
    gen = torch.Generator().manual_seed(seed)
    target = torch.randint(0, vocab_size, (num_requests, 1 + budget), generator=gen)
    chosen_paths = []
    for r in range(num_requests):
        node = int(torch.randint(0, budget, (), generator=gen))
        path = path_of(tree, r, node)
        rows = [0] + [n + 1 for n in path]
        for row, n in zip(rows, path, strict=False):
            target[r, row] = tree.tokens[r, n]
        target[r, rows[-1]] = vocab_size + 7  # never a draft token: the walk stops here
        chosen_paths.append(path)

    walk = follow_tree(tree, target, max_depth=8)
    assert_walks_equal(walk, follow_tree_reference(tree, target, max_depth=8))
    for r, path in enumerate(chosen_paths):
        a = len(path)
        pad = [-1] * (8 - a)
        assert walk.accepted_depth[r] == int(tree.depths[r, path[-1]]) == a
        assert walk.num_committed[r] == a + 1
        assert walk.accepted_nodes[r].tolist() == path + pad
        assert walk.kv_src_rows[r].tolist() == [n + 1 for n in path] + pad
        assert walk.committed_tokens[r].tolist() == (
            [int(tree.tokens[r, n]) for n in path] + [vocab_size + 7] + pad
        )
        assert walk.bonus_tokens[r] == vocab_size + 7


def test_follow_tree_rejects_at_root():
    tree = build_ddtree(torch.zeros(2, 3, 2), 5)
    target = torch.full((2, 6), 9)
    walk = follow_tree(tree, target)
    assert walk.accepted_depth.tolist() == [0, 0]
    assert walk.committed_tokens.tolist() == [[9, -1, -1], [9, -1, -1]]
    assert (walk.kv_src_rows == -1).all() and (walk.accepted_nodes == -1).all()


def test_follow_tree_errors():
    tree = build_ddtree(torch.zeros(2, 3, 2), 5)
    with pytest.raises(ValueError, match="target_tokens must be"):
        follow_tree(tree, torch.zeros(2, 5, dtype=torch.int64))
    with pytest.raises(ValueError, match="target_tokens must be"):
        follow_tree_reference(tree, torch.zeros(3, 6, dtype=torch.int64))


def test_draft_tree_shape_check():
    t = torch.zeros(2, 3, dtype=torch.int64)
    with pytest.raises(ValueError, match="parents must have the shape"):
        DraftTree(t, torch.zeros(2, 4, dtype=torch.int64), t, t.float())
    tree = DraftTree(t, t - 1, t + 1, t.float())
    assert tree.num_requests == 2 and tree.budget == 3


def test_brute_force_helper_sanity():
    # The optimality oracle itself: 2 depths, V=2, probabilities 0.75/0.25.
    lp = torch.tensor([[0.75, 0.25], [0.75, 0.25]]).log()
    got = brute_force_scores(lp, 2)
    want = torch.tensor([0.75, 0.75 * 0.75, 0.25, 0.75 * 0.25, 0.25 * 0.75, 0.25 * 0.25])
    torch.testing.assert_close(got, torch.sort(want.log(), descending=True).values)
