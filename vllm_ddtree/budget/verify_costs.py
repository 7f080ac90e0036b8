"""One request's verify forward time per adaptive verify shape, measured at start-up.

``ddtree_budget: "auto"``'s cost model (``vllm_ddtree.budget.policy``) times the tree
attention itself; with adaptive verify shapes the rest of the verify forward (GEMMs,
MoE experts, lm_head, sampling) also depends on the number of rows. vLLM captures a
FULL CUDA graph of the target for every shape ``1 + s`` at one request (``patches.
verify_shapes``); :class:`ShapeGraphTimer` replays each right after its capture, while
the dummy inputs it was captured with are still in the runner's buffers (vLLM prepares
the next shape's inputs only when it asks for the next forward function,
``cudagraph_utils.py:320-357``), and keeps the time per shape for
``BudgetPolicy.set_row_costs``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["ShapeGraphTimer"]

logger = logging.getLogger("vllm.ddtree.verify_shape_costs")


class ShapeGraphTimer:
    """Times the one-request FULL graphs of the verify shapes as they are captured.

    Args:
        graphs: the graph manager's ``{BatchExecutionDescriptor: CUDAGraph}``, filled
            while vLLM captures.
        shapes: candidate drafts per request ``s`` (graphs of ``1 + s`` rows).
        time_fn: ``time_fn(run) -> seconds`` of one call of ``run`` (default: CUDA
            events, ``budget_policy.cuda_time_fn``).
    """

    def __init__(self, graphs: dict, shapes: Iterable[int],
                 time_fn: Callable[[Callable[[], Any]], float] | None = None) -> None:
        if time_fn is None:
            from vllm_ddtree.budget.policy import cuda_time_fn

            time_fn = cuda_time_fn()
        self.graphs = graphs
        self.shapes = set(shapes)
        self.time_fn = time_fn
        self.seconds: dict[int, float] = {}
        self._seen: set = set()
        self.failed: str | None = None

    def time_new_graphs(self) -> None:
        """Replay-time every graph captured since the last call that is a one-request
        verify shape (call it before vLLM prepares the next shape's inputs). A failure
        is logged once and ends the measurement (``auto`` then runs without row
        costs)."""
        for desc, graph in list(self.graphs.items()):
            if desc in self._seen:
                continue
            self._seen.add(desc)
            shape = (getattr(desc, "uniform_token_count", None) or 0) - 1
            if self.failed or getattr(desc, "num_reqs", None) != 1 or shape not in self.shapes:
                continue
            try:
                self.seconds[shape] = float(self.time_fn(graph.replay))
            except Exception as e:  # noqa: BLE001 - a measurement must not stop start-up
                self.failed = f"{type(e).__name__}: {e}"
                logger.warning("DDTree: timing the verify graph of %d drafts failed (%s); "
                               "auto budgets run without row costs", shape, self.failed)
