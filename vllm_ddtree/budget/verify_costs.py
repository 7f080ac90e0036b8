"""Verify and drafter forward times by shape and batch size, measured at start-up.

``ddtree_budget: "auto"``'s cost model (``vllm_ddtree.budget.policy``) times the tree
attention itself; with adaptive verify shapes the rest of the verify forward (GEMMs,
MoE experts, lm_head, sampling) also depends on the number of rows. vLLM captures a
FULL CUDA graph of the target for every shape ``1 + s`` and request count (``patches.
verify_shapes``); :class:`ShapeGraphTimer` replays a graph right after its capture,
while the dummy inputs it was captured with are still in the runner's buffers (vLLM
prepares the next shape's inputs only when it asks for the next forward function,
``cudagraph_utils.py:320-357``). It keeps one request's time per shape for
``BudgetPolicy.set_row_costs`` and, for auto's step gate, the times of 1, 2, 4, ...
requests: the verify forward by total rows, and the same for the drafter's block pass
(its graphs, one shape) by requests (``vllm_ddtree.budget.step_cost.StepCostModel``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["ShapeGraphTimer", "timing_request_counts"]

logger = logging.getLogger("vllm.ddtree.verify_shape_costs")


def timing_request_counts(max_num_reqs: int) -> list[int]:
    """Request counts whose graphs the step gate times: 1, 2, 4, ... up to
    ``max_num_reqs``, and ``max_num_reqs`` itself (graphs exist only where vLLM
    captured them)."""
    counts, n = [], 1
    while n < max_num_reqs:
        counts.append(n)
        n *= 2
    return [*counts, max(1, max_num_reqs)]


class ShapeGraphTimer:
    """Times FULL graphs of the given shapes and request counts as they are captured.

    Args:
        graphs: the graph manager's ``{BatchExecutionDescriptor: CUDAGraph}``, filled
            while vLLM captures.
        shapes: drafts per request ``s`` (graphs of ``1 + s`` rows a request; for the
            drafter ``block_size - 1``).
        time_fn: ``time_fn(run) -> seconds`` of one call of ``run`` (default: CUDA
            events, ``attention_timing.cuda_time_fn``, the least of 3 groups of 3
            replays).
        request_counts: the ``num_reqs`` of the graphs to time (default: one request).
    """

    def __init__(self, graphs: dict, shapes: Iterable[int],
                 time_fn: Callable[[Callable[[], Any]], float] | None = None,
                 request_counts: Iterable[int] = (1,)) -> None:
        if time_fn is None:
            from vllm_ddtree.budget.attention_timing import cuda_time_fn

            time_fn = cuda_time_fn(iters=3, groups=3)
        self.graphs = graphs
        self.shapes = set(shapes)
        self.request_counts = set(request_counts)
        self.time_fn = time_fn
        # {(shape, num_reqs): (num_tokens, seconds)}
        self.times: dict[tuple[int, int], tuple[int, float]] = {}
        self._seen: set = set()
        self.failed: str | None = None

    @property
    def seconds(self) -> dict[int, float]:
        """One request's time per shape, ``{s: seconds}``: each at most the least time
        of any graph timed with as many tokens or more (more requests or rows never
        cost less; a time above such a graph's was taken while another process's
        kernels ran, as the engines of a benchmark starting beside it: one request's
        33 and 65 rows at 7.2 and 7.4 ms, two requests' 130 rows at 3.6 ms)."""
        from vllm_ddtree.budget.step_cost import lower_envelope

        least: dict[int, float] = {}  # the least time of each token count
        for n, t in self.times.values():
            least[n] = min(t, least.get(n, t))
        floor = lower_envelope(least)
        return {s: floor[n] for (s, r), (n, _) in self.times.items() if r == 1}

    def by_tokens(self) -> dict[int, float]:
        """Time by the graph's token count (every shape and request count; the mean
        where two graphs have the same count)."""
        sums: dict[int, list[float]] = {}
        for tokens, t in self.times.values():
            sums.setdefault(tokens, []).append(t)
        return {n: sum(ts) / len(ts) for n, ts in sums.items()}

    def by_reqs(self) -> dict[int, float]:
        """Time by request count (the largest shape timed at each count)."""
        out: dict[int, tuple[int, float]] = {}
        for (s, r), (_, t) in self.times.items():
            if r not in out or s > out[r][0]:
                out[r] = (s, t)
        return {r: t for r, (_, t) in out.items()}

    def time_new_graphs(self) -> None:
        """Replay-time every graph captured since the last call that has one of the
        shapes and request counts (call it before vLLM prepares the next graph's
        inputs). A failure is logged once and ends the measurement (``auto`` then runs
        without row costs)."""
        for desc, graph in list(self.graphs.items()):
            if desc in self._seen:
                continue
            self._seen.add(desc)
            shape = (getattr(desc, "uniform_token_count", None) or 0) - 1
            num_reqs = getattr(desc, "num_reqs", None)
            if (self.failed or num_reqs not in self.request_counts
                    or shape not in self.shapes):
                continue
            try:
                seconds = float(self.time_fn(graph.replay))
                self.times[(shape, num_reqs)] = (int(desc.num_tokens), seconds)
            except Exception as e:  # noqa: BLE001 - a measurement must not stop start-up
                self.failed = f"{type(e).__name__}: {e}"
                logger.warning("DDTree: timing the verify graph of %d drafts failed (%s); "
                               "auto budgets run without row costs", shape, self.failed)
