"""Test hook: replace ``ddtree_budget: "auto"``'s per-round choice by given budgets.

``VLLM_DDTREE_TEST_FORCED_BUDGETS=1,4,3,16`` makes ``BudgetPolicy.choose`` return
those budgets in turn (the policy still runs, so its side effects stay). The plugin
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

    from vllm_ddtree.budget_policy import BudgetPolicy

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


def apply_from_env() -> bool:
    """Apply :func:`force_budget_choices` when ``ENV`` is set; returns whether it did."""
    text = os.environ.get(ENV)
    if not text:
        return False
    force_budget_choices(parse_budgets(text))
    return True
