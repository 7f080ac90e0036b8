"""DFlash2 in the reference engine: the selector chain and DDTree over selector scores or
marginals give AR's tokens (greedy and keyed sampling, fp32, CPU); the selector tree
equals its heapq oracle and its top-1 case is the greedy walk from the anchor."""

import pytest
import torch
from tiny_models import drafter_config, tiny_target

from vllm_ddtree.reference import generate
from vllm_ddtree.reference.dflash2 import DFlash2DraftModel
from vllm_ddtree.tree.selector_tree import (
    build_selector_tree,
    build_selector_tree_reference,
    candidate_log_mass,
    tree_candidates,
)

PROMPT = [5, 17, 33, 2, 60, 41, 9, 12, 77, 3, 28, 50]
TOP_K = 4


def tiny_dflash2(target, seed: int = 0) -> DFlash2DraftModel:
    config = drafter_config(target.config, architectures=["DFlash2DraftModel"])
    config.dflash_config = {**config.dflash_config, "conv_kernel_size": 2,
                            "conv_group_size": 16, "selector_rank": 8,
                            "selector_top_k": TOP_K, "output_multiplier": 0.9}
    torch.manual_seed(2000 + seed)
    return DFlash2DraftModel(config).eval()


@pytest.fixture(scope="module", params=[("qwen3", 0), ("deepseek_v3", 1)],
                ids=lambda p: f"{p[0]}-seed{p[1]}")
def pair(request):
    kind, seed = request.param
    target = tiny_target(kind, seed=seed)
    return target, tiny_dflash2(target, seed)


RUNS = [("dflash2", 1, None), ("dflash", 1, None), ("ddtree", 1, None), ("ddtree", 8, None),
        ("ddtree", 64, None), ("ddtree", 16, "marginals"), ("ddtree", 64, "marginals")]


def test_greedy_equals_ar(pair):
    target, drafter = pair
    ar = generate(target, None, PROMPT, 28, "ar")
    for method, budget, scores in RUNS:
        out = generate(target, drafter, PROMPT, 28, method, budget=budget, draft_scores=scores)
        assert out.tokens == ar.tokens, (method, budget, scores)


@pytest.mark.parametrize("seed", [0, 3])
def test_keyed_sampling_equals_ar(pair, seed):
    target, drafter = pair
    ar = generate(target, None, PROMPT, 20, "ar", temperature=1.0, seed=seed)
    assert ar.tokens != generate(target, None, PROMPT, 20, "ar").tokens  # T=1 samples
    for method, budget, scores in RUNS:
        out = generate(target, drafter, PROMPT, 20, method, budget=budget, temperature=1.0,
                       seed=seed, draft_scores=scores)
        assert out.tokens == ar.tokens, (method, budget, scores)


def test_the_selector_tree_differs_from_the_marginal_tree(pair):
    """With trained-scale edge weights the two trees are different trees."""
    target, drafter = pair
    from vllm_ddtree.reference.engine import prefill
    from vllm_ddtree.reference.target import TargetRunner
    from vllm_ddtree.tree.draft_tree import build_ddtree

    runner = TargetRunner(target, drafter.target_layer_ids)
    try:
        _, context = prefill(runner, drafter, PROMPT)
        block = drafter.draft_block(7, len(PROMPT), context, runner.embed,
                                    runner.lm_head_logits)
    finally:
        runner.close()
    selector = build_selector_tree(block.candidate_ids[None], block.edge_scores[None] * 20, 16)
    marginal = build_ddtree(block.logits[None], 16, top_k=TOP_K)
    assert not torch.equal(selector.tokens, marginal.tokens)


def greedy_walk(ids: torch.Tensor, scores: torch.Tensor) -> list[int]:
    """vLLM's DFlash2 greedy walk: from slot 0, the best child of the previous pick,
    the lowest slot among equal scores."""
    previous, tokens = 0, []
    for position in range(ids.shape[0]):
        row = scores[position, previous].tolist()
        best = max(row)
        previous = row.index(best)
        tokens.append(int(ids[position, previous]))
    return tokens


def test_top1_selector_tree_is_the_greedy_walk():
    g = torch.Generator().manual_seed(4)
    for trial in range(20):
        ids = torch.randint(0, 1000, (3, 7, 6), generator=g)
        scores = torch.randn(3, 7, 6, 6, generator=g)
        if trial % 2:
            scores = scores.round()  # ties
        chain = build_selector_tree(ids, scores, budget=7, top_k=1)
        for r in range(3):
            assert chain.tokens[r].tolist() == greedy_walk(ids[r], scores[r])
            assert chain.parents[r].tolist() == list(range(-1, 6))


@pytest.mark.parametrize("budget,top_k", [(1, None), (6, 1), (9, 2), (30, None), (50, 3)])
@pytest.mark.parametrize("with_mass", [False, True])
def test_selector_tree_equals_heapq_oracle(budget, top_k, with_mass):
    g = torch.Generator().manual_seed(budget)
    for trial in range(8):
        ids = torch.randint(0, 50, (2, 6, 5), generator=g)
        scores = torch.randn(2, 6, 5, 5, generator=g) * 3
        if trial % 2:
            scores = scores.round()
        scores[:, 0] = scores[:, 0, :1]  # every predecessor row of position 1 is the anchor
        mass = -torch.rand(2, 6, generator=g) * 2 if with_mass else None
        if with_mass and trial == 3:
            mass[0, 2] = float("nan")  # a broken row adds nothing
        got = build_selector_tree(ids, scores, budget, top_k, mass)
        want = build_selector_tree_reference(ids, scores, budget, top_k, mass)
        for name in ("tokens", "parents", "depths", "scores"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name
        # Best first and topological: a parent precedes its child and scores more.
        for r in range(2):
            for node, parent in enumerate(got.parents[r].tolist()):
                assert parent < node
                if parent >= 0:
                    assert got.scores[r, parent] >= got.scores[r, node]
                    assert got.depths[r, node] == got.depths[r, parent] + 1


def test_bad_arguments_are_refused_by_name(pair):
    target, drafter = pair
    with pytest.raises(ValueError, match=r"budget=8 .*at most 7: .*1 candidates"):
        generate(target, drafter, PROMPT, 4, "ddtree", budget=8, top_k=1)
    with pytest.raises(ValueError, match=r"budget=300 .*at most 254: .*2 candidates"):
        generate(target, drafter, PROMPT, 4, "ddtree", budget=300, top_k=2)
    with pytest.raises(ValueError, match="draft_scores='best' .*'selector', 'marginals'"):
        generate(target, drafter, PROMPT, 4, "ddtree", draft_scores="best")
    with pytest.raises(ValueError, match="draft_scores='selector' .*'ddtree'"):
        generate(target, drafter, PROMPT, 4, "dflash2", draft_scores="selector")
    from tiny_models import tiny_drafter

    with pytest.raises(ValueError, match="drafter='DFlashDraftModel' .*DFlash2DraftModel"):
        generate(target, tiny_drafter(target), PROMPT, 4, "dflash2")
    with pytest.raises(ValueError, match=r"budget=0 is not allowed"):
        build_selector_tree(torch.zeros(1, 2, 3, dtype=torch.long), torch.zeros(1, 2, 3, 3), 0)
    with pytest.raises(ValueError, match=r"budget=13 .*at most 12"):
        build_selector_tree(torch.zeros(1, 2, 3, dtype=torch.long), torch.zeros(1, 2, 3, 3), 13)


def test_candidate_mass_makes_uncertain_positions_cost_depth():
    """Position 2's candidates hold 1 % of its marginal mass: without the mass term the
    tree runs down the certain-looking chain; with it, the budget goes to siblings at
    position 1 instead, which is what the marginals say is likelier."""
    ids = torch.arange(2 * 3).view(1, 2, 3)
    scores = torch.zeros(1, 2, 3, 3)
    scores[0, 0, :, 0] = 2.0  # position 1: slot 0 likely, slots 1-2 less
    scores[0, 1, :, 0] = 8.0  # position 2: slot 0 all but certain among the candidates
    log_norm = torch.tensor([[0.0, 0.0]])
    unary = torch.log(torch.tensor([[[0.6, 0.2, 0.2], [0.005, 0.003, 0.002]]]))
    mass = candidate_log_mass(unary, log_norm)
    torch.testing.assert_close(mass, torch.log(torch.tensor([[1.0, 0.01]])))
    plain = build_selector_tree(ids, scores, 3)
    weighed = build_selector_tree(ids, scores, 3, position_log_mass=mass)
    assert plain.depths[0].tolist() == [1, 2, 1]
    assert weighed.depths[0].tolist() == [1, 1, 1]


def test_trees_rank_as_many_candidates_as_a_node_may_have_children(pair):
    """tree_candidates: the budget (or top_k), at least the checkpoint's K, at most the
    vocabulary; a B = 16 tree of the reference engine can hold tokens beyond the
    checkpoint's top-K of their position."""
    assert tree_candidates(8, 64, None, 4096) == 64
    assert tree_candidates(8, 64, 4, 4096) == 8  # never fewer than the checkpoint's K
    assert tree_candidates(8, 64, 16, 4096) == 16
    assert tree_candidates(8, 15, 1, 4096) == 8  # the chain walk
    assert tree_candidates(8, 64, None, 32) == 32
    target, drafter = pair
    from vllm_ddtree.reference.draft_trees import draft_tree
    from vllm_ddtree.reference.engine import prefill
    from vllm_ddtree.reference.target import TargetRunner

    runner = TargetRunner(target, drafter.target_layer_ids)
    try:
        _, context = prefill(runner, drafter, PROMPT)
        tree = draft_tree(drafter, runner, context, 7, len(PROMPT), "ddtree", 16, None,
                          "selector")
        block = drafter.draft_block(7, len(PROMPT), context, runner.embed,
                                    runner.lm_head_logits)
    finally:
        runner.close()
    top = block.candidate_ids  # the checkpoint's TOP_K per position
    outside = [t for t, d in zip(tree.tokens[0].tolist(), tree.depths[0].tolist(), strict=True)
               if t not in top[d - 1].tolist()]
    assert outside, "every node is among the checkpoint's top-K"
