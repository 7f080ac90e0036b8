"""The lossy verifier of vllm_ddtree.testing.lossy_verifier (fault injection for tests and
evals): the rule on hand-made trees, the reference engine under it, and the vLLM hook
on a stand-in verifier batch."""

from types import SimpleNamespace

import pytest
import torch
from tiny_models import tiny_drafter, tiny_target

from vllm_ddtree.reference import generate
from vllm_ddtree.testing.lossy_verifier import (
    apply_lossy_verifier,
    check_rate,
    corrupt_targets,
    lossy_reference,
)
from vllm_ddtree.tree.draft_tree import DraftTree

PROMPT = [5, 17, 33, 2, 60, 41, 9, 12, 77, 3, 28, 50]


def tree_of(tokens, parents):
    tokens = torch.tensor([tokens])
    parents = torch.tensor([parents])
    depths = torch.zeros_like(parents)
    for i, p in enumerate(parents[0].tolist()):
        depths[0, i] = 1 if p < 0 else depths[0, p] + 1
    return DraftTree(tokens, parents, depths, torch.zeros(tokens.shape))


def test_the_first_child_of_the_stopping_node_replaces_the_targets_token():
    # root -> node0 (tok 7) -> node2 (tok 9); root -> node1 (tok 8)
    tree = tree_of([7, 8, 9], [-1, -1, 0])
    targets = torch.tensor([[7, 4, 5, 6]])  # root chose 7 (node0), node0 chose 4: no child
    out, changed = corrupt_targets(tree, targets, torch.tensor([True]))
    assert changed.tolist() == [True]
    assert out.tolist() == [[7, 9, 5, 6]]  # node0's token: its first child's (9)
    same, changed = corrupt_targets(tree, targets, torch.tensor([False]))
    assert torch.equal(same, targets) and changed.tolist() == [False]
    # stopping at the root: its first child is node0 (the drafter's best)
    out, _ = corrupt_targets(tree, torch.tensor([[3, 4, 5, 6]]), torch.tensor([True]))
    assert out[0, 0] == 7
    # stopping at a leaf: the deepest path node with another child is the root
    leaf = torch.tensor([[7, 9, 5, 6]])  # walks root -> node0 -> node2 (a leaf)
    out, changed = corrupt_targets(tree, leaf, torch.tensor([True]))
    assert out.tolist() == [[8, 9, 5, 6]] and changed.tolist() == [True]
    # a chain the target accepts whole has no other token to commit
    chain = tree_of([7, 9], [-1, 0])
    whole = torch.tensor([[7, 9, 5]])
    out, changed = corrupt_targets(chain, whole, torch.tensor([True]))
    assert torch.equal(out, whole) and changed.tolist() == [False]


def test_masked_nodes_are_never_committed():
    tree = tree_of([-1, 8], [-1, -1])  # node0 masked out (inactive budget)
    out, _ = corrupt_targets(tree, torch.tensor([[3, 4, 5]]), torch.tensor([True]))
    assert out[0, 0] == 8


@pytest.mark.parametrize("rate", [-0.1, 1.5, "0.1", True])
def test_rate_is_checked(rate):
    with pytest.raises(ValueError, match="rate="):
        check_rate(rate)


def test_reference_engine_under_the_lossy_verifier():
    target = tiny_target("deepseek_v3")
    drafter = tiny_drafter(target)
    ar = generate(target, None, PROMPT, 40, "ar")
    with lossy_reference(0.0) as counts:
        clean = generate(target, drafter, PROMPT, 40, "ddtree", budget=16)
    assert clean.tokens == ar.tokens and counts["corrupted"] == 0 and counts["rounds"] > 0
    with lossy_reference(1.0) as counts:
        lossy = generate(target, drafter, PROMPT, 40, "ddtree", budget=16)
    assert counts["corrupted"] > 0 and lossy.tokens != ar.tokens
    # the wrapper is gone after the block
    assert generate(target, drafter, PROMPT, 40, "ddtree", budget=16).tokens == ar.tokens


def test_vllm_hook_corrupts_the_drawn_rows(monkeypatch):
    """Two requests in one flat batch: request 0 has 3 drafted nodes, request 1 is a
    prefill chunk (no draft). Rate 1: request 0's stopping row gets its first child's
    token; request 1 is left alone."""
    from vllm_ddtree.verify import verifier as verifier_module

    drawn = torch.tensor([3, 4, 5, 6, 11])  # rows: r0 root, node0..2; r1's only row
    monkeypatch.setattr(verifier_module.DDTreeVerifier, "draw_target_tokens",
                        lambda self, logits, batch, needs_history=True: (drawn, None, None))
    apply_lossy_verifier(1.0, seed=0)
    budget = 3
    state = SimpleNamespace(adaptive=False, parents=torch.tensor([[-1, -1, 0], [-1, 0, 1]]),
                            depths=torch.tensor([[1, 1, 2], [1, 2, 3]]), active_nodes=None)
    fake = SimpleNamespace(budget=budget, state=state)
    batch = SimpleNamespace(input_ids=torch.tensor([1, 7, 8, 9, 2]),
                            logits_indices=torch.arange(5),
                            cu_num_logits=torch.tensor([0, 4, 5], dtype=torch.int32),
                            idx_mapping=torch.tensor([0, 1], dtype=torch.int32))
    out, _, _ = verifier_module.DDTreeVerifier.draw_target_tokens(fake, None, batch)
    assert out.tolist() == [7, 4, 5, 6, 11]  # root chose 3 (no child): node0's 7
    apply_lossy_verifier(0.0)
    out, _, _ = verifier_module.DDTreeVerifier.draw_target_tokens(fake, None, batch)
    assert out.tolist() == drawn.tolist()
