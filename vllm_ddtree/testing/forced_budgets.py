"""Test hook: replace ``ddtree_budget: "auto"``'s per-round choice by given budgets.

``VLLM_DDTREE_TEST_FORCED_BUDGETS=1,4,3,16`` makes ``BudgetPolicy.choose`` return
those budgets in turn, and ``BudgetPolicy.choose_in_graph`` (the choice inside the
drafter's CUDA graph, ``VLLM_DDTREE_AUTO_IN_GRAPH=1``) write them in turn from a device
counter that every replay advances (the policy still runs, so its side effects stay). The plugin
applies it in every process that loads it (``vllm_ddtree.register``), so it reaches
tensor-parallel workers too; ``evals/check_ddtree_vllm.py --cycle-budgets`` sets it.
It exists so the GPU tests can force verify shapes below B, shape changes and choices
that differ from the (lagged) shape, which the policy itself rarely picks on the
small embedded pair. Never set it in production.
"""

from __future__ import annotations

import os

ENV = "VLLM_DDTREE_TEST_FORCED_BUDGETS"

__all__ = ["ENV", "apply_from_env", "force_budget_choices", "parse_budgets"]


def parse_budgets(text: str) -> list[int]:
    """``"1,4,3"`` -> ``[1, 4, 3]``; each must be >= 1."""
    try:
        budgets = [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"{ENV} must be comma-separated integers, got {text!r}") from None
    if not budgets or min(budgets) < 1:
        raise ValueError(f"{ENV} budgets must be >= 1, got {text!r}")
    return budgets


def force_budget_choices(budgets: list[int]) -> None:
    """Patch ``BudgetPolicy.choose`` to return ``budgets`` in turn (capped at B), as
    an int64 0-dim tensor on the scores' device. Idempotent per process."""
    import torch

    from vllm_ddtree.budget.policy import BudgetPolicy

    original = getattr(BudgetPolicy.choose, "_forced_original", BudgetPolicy.choose)
    turn = iter(range(10**12))

    def choose(self, scores, context_lens):
        original(self, scores, context_lens)
        b = min(budgets[next(turn) % len(budgets)], self.max_budget)
        chosen = torch.tensor(b, dtype=torch.int64, device=scores.device)
        if self.tp_group is not None:  # keep the policy's contract: ranks agree
            torch.distributed.broadcast(chosen, src=self.tp_group.ranks[0],
                                        group=self.tp_group.device_group)
        return chosen

    choose._forced_original = original
    BudgetPolicy.choose = choose

    original_in_graph = getattr(BudgetPolicy.choose_in_graph, "_forced_original",
                                BudgetPolicy.choose_in_graph)

    def choose_in_graph(self, scores, context_lens, row_of_sample, idx_stride):
        original_in_graph(self, scores, context_lens, row_of_sample, idx_stride)
        forced = getattr(self, "_forced_budgets", None)
        if forced is None:
            # A graph cannot capture this host-to-device copy: the speculator makes one
            # eager call before any capture (``DDTreeSpeculator.__init__``).
            if self.chosen.is_cuda and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("forced budgets: the first in-graph choice was captured")
            capped = [min(b, self.max_budget) for b in budgets]
            forced = torch.tensor(capped, dtype=torch.int64, device=self.chosen.device)
            self._forced_budgets = forced
            self._forced_turn = torch.zeros(1, dtype=torch.int64, device=forced.device)
        # Device ops only, so that every replay of the graph picks the next budget.
        index = torch.remainder(self._forced_turn, forced.numel())
        self.chosen.copy_(forced.index_select(0, index))
        self._forced_turn.add_(1)
        return self.chosen

    choose_in_graph._forced_original = original_in_graph
    BudgetPolicy.choose_in_graph = choose_in_graph


def apply_from_env() -> bool:
    """Apply :func:`force_budget_choices` when ``ENV`` is set; returns whether it did."""
    text = os.environ.get(ENV)
    if not text:
        return False
    force_budget_choices(parse_budgets(text))
    return True
