"""Adaptive budget pieces (vllm_ddtree.budget.choice) against brute force and Monte Carlo."""

import pytest
import torch

from vllm_ddtree.budget.choice import (
    BudgetCostTable,
    choose_batch_budget,
    expected_committed_by_budget,
)
from vllm_ddtree.tree.draft_tree import build_ddtree


def node_paths(tree, r: int) -> list[tuple[int, ...]]:
    """Token path root -> node of every node of request r."""
    paths = []
    for i in range(tree.tokens.shape[1]):
        path, j = [], i
        while j >= 0:
            path.append(int(tree.tokens[r, j]))
            j = int(tree.parents[r, j])
        paths.append(tuple(reversed(path)))
    return paths


def test_trees_of_smaller_budgets_are_the_best_nodes_of_a_larger_one():
    logits = torch.randn(3, 4, 6, generator=torch.Generator().manual_seed(0)) * 2
    big = build_ddtree(logits, 40)
    for b in (1, 5, 17, 40):
        small = build_ddtree(logits, b)
        for r in range(3):
            best = big.scores[r].argsort(descending=True)[:b].tolist()
            assert {node_paths(big, r)[i] for i in best} == set(node_paths(small, r))


def test_expected_committed_matches_a_monte_carlo_walk():
    """Target tokens drawn from the drafter's own per-depth distributions: the mean
    committed count of the tree walk approaches 1 + the summed node probabilities."""
    gen = torch.Generator().manual_seed(1)
    depths, vocab, samples = 4, 5, 20000
    logits = torch.randn(1, depths, vocab, generator=gen) * 1.5
    expected = expected_committed_by_budget(build_ddtree(logits, 60).scores)[0]
    draws = torch.multinomial(logits[0].softmax(-1), samples, replacement=True,
                              generator=gen).T  # [samples, depths]
    for b in (1, 8, 30, 60):
        tree = build_ddtree(logits, b)
        paths = set(node_paths(tree, 0))
        committed = torch.ones(samples)
        for d in range(1, depths + 1):
            on_tree = torch.tensor([tuple(row[:d].tolist()) in paths for row in draws])
            committed += on_tree.float()
        se = committed.std() / samples ** 0.5
        assert float(committed.mean()) == pytest.approx(float(expected[b - 1]), abs=4 * float(se))


def test_choice_maximises_expected_tokens_per_second():
    scores = torch.log(torch.tensor([[0.9, 0.5, 0.3, 0.05, 0.01, 0.01]]))
    expected = expected_committed_by_budget(scores)
    assert expected[0].tolist() == pytest.approx([1.9, 2.4, 2.7, 2.75, 2.76, 2.77])
    budgets = torch.tensor([1, 3, 6])
    cheap_wide = torch.tensor([1.0, 1.0, 1.0])  # same cost: the widest tree wins
    assert int(choose_batch_budget(expected, cheap_wide, budgets)) == 6
    costly_wide = torch.tensor([1.0, 1.3, 2.0])  # 1.9 vs 2.08 vs 1.385 tokens/s
    assert int(choose_batch_budget(expected, costly_wide, budgets)) == 3


def test_cost_table_interpolates_in_context():
    table = BudgetCostTable(torch.tensor([1024, 8192]), torch.tensor([8, 64]),
                            torch.tensor([[1.0, 2.0], [3.0, 10.0]]))
    assert table.at(torch.tensor(1024)).tolist() == pytest.approx([1.0, 2.0])
    assert table.at(torch.tensor(4608)).tolist() == pytest.approx([2.0, 6.0])
    assert table.at(torch.tensor(100_000)).tolist() == pytest.approx([3.0, 10.0])
    with pytest.raises(ValueError, match="seconds must be"):
        BudgetCostTable(torch.tensor([1024]), torch.tensor([8, 64]), torch.ones(2, 2))
    with pytest.raises(ValueError, match="increasing"):
        BudgetCostTable(torch.tensor([8192, 1024]), torch.tensor([8]), torch.ones(2, 1))
