"""Verify-batch tensors for the vLLM integration, checked against per-row loops."""

import torch

from vllm_ddtree.compact.reference import compact_kv_cache_, compaction_slots
from vllm_ddtree.tree.draft_tree import build_ddtree, pack_ancestor_mask
from vllm_ddtree.verify.batch import sampled_rows_from_walk, tree_verify_positions_and_bits
from vllm_ddtree.walk.follow import follow_tree

GEN = torch.Generator().manual_seed(0)


def test_positions_and_bits_for_a_mixed_batch():
    budget, vocab = 70, 9  # 71 query tokens per tree request: two mask words
    trees = build_ddtree(torch.randn(2, 5, vocab, generator=GEN), budget)
    # batch: tree request, prefill chunk of 5, tree request, plain decode
    qlens = [1 + budget, 5, 1 + budget, 1]
    is_tree = torch.tensor([True, False, True, False])
    qsl = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32)
    computed = [100, 7, 3000, 40]
    linear = torch.cat([torch.arange(c, c + q) for c, q in zip(computed, qlens, strict=True)])
    depths = torch.zeros(4, budget, dtype=torch.int64)
    bits = torch.zeros(4, 1 + budget, 2, dtype=torch.int64)
    depths[[0, 2]] = trees.depths
    bits[[0, 2]] = trees.ancestor_bits()
    pos, got_bits = tree_verify_positions_and_bits(linear, qsl, is_tree, depths, bits, 2)

    mask = trees.ancestor_mask()
    want_pos, want_bits = [], []
    for r, (c, q) in enumerate(zip(computed, qlens, strict=True)):
        for i in range(q):
            if is_tree[r]:
                tree = [0, None, 1][r]
                want_pos.append(c + (0 if i == 0 else int(trees.depths[tree, i - 1])))
                row = torch.zeros(128, dtype=torch.bool)
                row[: 1 + budget] = mask[tree, i]
            else:
                want_pos.append(c + i)
                row = torch.arange(128) <= i
            want_bits.append(pack_ancestor_mask(row))
    assert pos.tolist() == want_pos
    assert torch.equal(got_bits, torch.stack(want_bits))


def test_sampled_rows_and_compaction_follow_the_walk():
    budget = 12
    tree = build_ddtree(torch.randn(3, 4, 6, generator=GEN), budget)
    target = torch.randint(0, 6, (3, 1 + budget), generator=GEN)
    # request 1 follows its deepest path exactly
    node = int(tree.depths[1].argmax())
    path = [node]
    while tree.parents[1, path[-1]] >= 0:
        path.append(int(tree.parents[1, path[-1]]))
    for parent, child in zip([-1] + path[::-1][:-1], path[::-1], strict=True):
        target[1, parent + 1] = tree.tokens[1, child]
    walk = follow_tree(tree, target, max_depth=4)
    sampled, num_sampled, num_rejected = sampled_rows_from_walk(
        walk.committed_tokens, walk.accepted_depth, budget)
    assert sampled.shape == (3, budget + 1)
    assert torch.equal(num_sampled + num_rejected, torch.full((3,), budget + 1, dtype=torch.int32))
    assert int(walk.accepted_depth[1]) == len(path)
    for r in range(3):
        a = int(walk.accepted_depth[r])
        assert sampled[r, : a + 1].tolist() == walk.committed_tokens[r, : a + 1].tolist()
        assert (sampled[r, a + 1 :] == -1).all()

    # slots: request r's rows live in blocks of 16 starting at 32 * (r + 1)
    qsl = torch.arange(0, 3 * (budget + 1) + 1, budget + 1, dtype=torch.int32)
    slots = torch.cat([32 * (r + 1) * 16 + torch.arange(budget + 1) for r in range(3)])
    src, dst = compaction_slots(slots, qsl, walk.kv_src_rows)
    cache = torch.randn(4096, 3, generator=GEN)
    before = cache.clone()
    compact_kv_cache_(cache.view(256, 16, 3), src, dst)  # pages of 16 slots
    for r in range(3):
        a = int(walk.accepted_depth[r])
        for k in range(a):
            moved = before[slots[r * (budget + 1) + int(walk.kv_src_rows[r, k])]]
            assert torch.equal(cache[slots[r * (budget + 1) + k + 1]], moved)
    untouched = torch.ones(4096, dtype=torch.bool)
    untouched[dst[dst >= 0]] = False
    assert torch.equal(cache[untouched], before[untouched])


def test_compaction_reads_sources_before_writing():
    cache = torch.arange(10.0)[:, None]
    # 3 -> 1 and 1 -> 2: slot 1 is both a destination and a source
    compact_kv_cache_(cache.unsqueeze(1), torch.tensor([3, 1, -1]), torch.tensor([1, 2, -1]))
    assert cache[:, 0].tolist() == [0, 3, 1, 3, 4, 5, 6, 7, 8, 9]
    nothing = torch.arange(10.0)[:, None]
    compact_kv_cache_(nothing.unsqueeze(1), torch.tensor([-1, -1]), torch.tensor([-1, -1]))
    assert nothing[:, 0].tolist() == list(range(10))


def test_compaction_slots_with_a_short_last_request():
    # request 0: a tree verify of 1+4 rows, accepted depth 2; request 1: one decode row
    slots = torch.arange(100, 106)
    qsl = torch.tensor([0, 5, 6], dtype=torch.int32)
    src_rows = torch.tensor([[3, 4, -1, -1], [-1, -1, -1, -1]])
    src, dst = compaction_slots(slots, qsl, src_rows)
    assert src.tolist() == [103, 104, -1, -1, -1, -1, -1, -1]
    assert dst.tolist() == [101, 102, -1, -1, -1, -1, -1, -1]
