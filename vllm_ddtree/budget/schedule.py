"""``num_speculative_tokens_per_batch_size`` for DDTree: the tree budget per batch size.

The key means what it means for vLLM's chain (``vllm.v1.spec_decode.dynamic``): a list
of inclusive batch-size ranges ``(range_start, range_end, k)``; a batch of ``R``
requests verifies at most ``k`` draft tokens a request, ``k`` capped at
``num_speculative_tokens``; gaps between ranges take the previous range's ``k``, sizes
past the last range its ``k``. For DDTree ``k`` is the tree budget: the first ``k``
nodes of each request's best-first tree (a budget-``k`` tree, ``vllm_ddtree.tree.
draft_tree``); ``k = 0`` is a plain decoding step (one verify row a request, no drafter
block pass). With ``ddtree_budget: "auto"`` it caps auto's choice.

vLLM's scheduler never sees the key (``vllm_ddtree.config.split_ddtree_spec`` keeps it
from vLLM's config): it would apply the budget of the previous step's batch size
(``scheduler.py:1134`` sets the next step's placeholders) and would stop padding new
decode requests to one verify length (``scheduler.py:847``). The scheduler keeps
scheduling ``B`` drafts a request, and the worker cuts them to this step's budget
before the runner builds the batch (``vllm_ddtree.verify.shape.StepPlan``,
``patches/verify_shapes.py``), with a FULL CUDA graph for every ``1 + k``. The
worker's lookup uses the batch size of the step itself, vLLM's own dense table
(``build_dynamic_sd_schedule_lookup``).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["BatchSchedule", "schedule_budgets"]


class BatchSchedule:
    """The tree budget per batch size, from a normalised schedule.

    Args:
        entries: ``(range_start, range_end, k)`` tuples (``DDTreeConfig.batch_schedule``).
        max_num_reqs: ``max_num_seqs``, the largest batch.
        max_budget: B (``num_speculative_tokens``); every ``k`` is capped at it.
    """

    def __init__(self, entries: Sequence[Sequence[int]], max_num_reqs: int,
                 max_budget: int) -> None:
        from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

        self.entries = tuple(tuple(int(x) for x in e) for e in entries)
        self.max_num_reqs = max_num_reqs
        self.max_budget = max_budget
        # index R -> k for R in 1..max_num_reqs (index 0 unused), vLLM's own expansion
        self.table = build_dynamic_sd_schedule_lookup(
            [list(e) for e in self.entries], max_num_reqs, max_budget)

    def budget_for(self, num_reqs: int) -> int:
        """``k`` for a batch of ``num_reqs`` requests (clamped to ``1..max_num_reqs``)."""
        return self.table[min(max(int(num_reqs), 1), self.max_num_reqs)]

    def budgets(self) -> list[int]:
        """Every ``k`` a batch of 1..max_num_reqs requests can get, increasing."""
        return sorted(set(self.table[1:]))


def schedule_budgets(entries: Sequence[Sequence[int]] | None, max_num_reqs: int,
                     max_budget: int) -> list[int]:
    """:meth:`BatchSchedule.budgets`, or ``[]`` without a schedule."""
    if not entries:
        return []
    return BatchSchedule(entries, max_num_reqs, max_budget).budgets()
