"""Test hook: replace ``ddtree_budget: "auto"``'s per-round choice by given budgets.

:func:`force_budget_choices` patches ``BudgetPolicy.choose`` (the eager choice: CPU,
TP > 1) to return the budgets in turn, and ``BudgetPolicy.choose_in_graph`` (the choice
inside the drafter's CUDA graph) to write them in turn from a device counter that
every replay advances (the policy still runs, so its side effects stay). A budget 0 is
a plain decoding step: the step gate's choice (``SpeculationGate._choose``, on the
host, before the drafter's pass) follows the list in turn, arm 0 for a 0 and else the
batch's cap (no cut below the device budget), and only the drafted rounds take the
device budgets (the list's non-zero entries in turn); without a gate (TP > 1, fixed
verify shapes) the zeros are left out. It exists so the GPU tests can
force verify shapes below B, plain steps, shape changes and choices that differ from
the (lagged) shape, which the policy itself rarely picks on the small embedded pair.

Nothing in the plugin imports it: a test or check script applies it itself, in the
process that builds the engine before ``LLM()`` is created (``evals/check_ddtree_vllm.py
--cycle-budgets`` runs the engine in its own process), and in tensor-parallel workers
through ``LLM.collective_rpc(apply_in_worker, args=(budgets,))`` before the first
generate. Never use it in production.
"""

from __future__ import annotations

__all__ = ["apply_in_worker", "force_budget_choices", "parse_budgets"]


def parse_budgets(text: str) -> list[int]:
    """``"1,4,0,3"`` -> ``[1, 4, 0, 3]``; each must be >= 0 (0: a plain decoding
    step), at least one >= 1."""
    try:
        budgets = [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"forced budgets must be comma-separated integers, got {text!r}"
                         ) from None
    if not budgets or min(budgets) < 0 or max(budgets) < 1:
        raise ValueError(f"forced budgets must be >= 0, at least one >= 1, got {text!r}")
    return budgets


def force_budget_choices(budgets: list[int]) -> None:
    """Patch ``BudgetPolicy.choose`` to return the non-zero ``budgets`` in turn (capped
    at B), as an int64 0-dim tensor on the scores' device, and the step gate to choose
    a plain step (arm 0) for each 0 in turn, else the cap. Idempotent per process."""
    import torch

    from vllm_ddtree.budget.gate import SpeculationGate
    from vllm_ddtree.budget.policy import BudgetPolicy

    all_budgets = list(budgets)
    budgets = [b for b in all_budgets if b > 0]
    original_gate = getattr(SpeculationGate._choose, "_forced_original",
                            SpeculationGate._choose)
    host_turn = iter(range(10**12))

    def gate_choose(self, num_reqs, contexts, cap, columns):
        if cap <= 0:
            return 0
        return cap if all_budgets[next(host_turn) % len(all_budgets)] > 0 else 0

    gate_choose._forced_original = original_gate
    SpeculationGate._choose = gate_choose

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


def apply_in_worker(worker, budgets: list[int]) -> None:
    """:func:`force_budget_choices` in a vLLM worker process, for
    ``LLM.collective_rpc(apply_in_worker, args=(budgets,))`` (the worker is unused)."""
    force_budget_choices(list(budgets))
