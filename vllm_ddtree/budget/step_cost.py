"""A step's GPU time by batch size, drafts per request and context, from start-up
measurements: the cost model of ``ddtree_budget: "auto"``'s step gate
(``vllm_ddtree.budget.gate``).

:class:`StepCostModel` holds the target's verify forward by total rows (its FULL graphs
of every verify shape at several request counts), the drafter's block pass by requests
(its FULL graphs), and the tree / plain verify attention per request, layer and context
(the tree kernel at 1 and ``1 + b`` active rows).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["StepCostModel"]


# The slope past the last timed point spans at least this fraction of its x.
_TAIL_SPAN = 0.25
# Batch sizes whose arm costs step_seconds_by_drafts keeps (it is cleared when full).
_ARM_COST_CACHE = 1024


def _tail_slope(xs: np.ndarray, ys: np.ndarray) -> float:
    """The slope past the last point (2+ points): from the last point at or below
    ``1 - _TAIL_SPAN`` of the last x (else the first) to the last. The verify forward's
    timed token counts mix shapes and request counts, and the last two can be a few rows
    apart (at 8 requests and B = 64: 260 = 4 x 65 and 264 = 8 x 33 rows): their last
    segment turned microseconds of timing difference into microseconds a row, and a
    prefill chunk of thousands of tokens into tens of milliseconds."""
    j = int(np.searchsorted(xs, (1.0 - _TAIL_SPAN) * xs[-1], side="right")) - 1
    j = min(max(j, 0), xs.size - 2)
    return float((ys[-1] - ys[j]) / (xs[-1] - xs[j]))


def _interp(x: float, xs: np.ndarray, ys: np.ndarray) -> float:
    """Piecewise linear in ``xs`` (increasing), clamped below the first point and
    continued past the last with :func:`_tail_slope` (one point: proportional)."""
    if xs.size == 0:
        return 0.0
    if xs.size == 1:
        return float(ys[0] * max(x, xs[0]) / xs[0])
    if x <= xs[-1]:
        return float(np.interp(x, xs, ys))
    return float(ys[-1] + _tail_slope(xs, ys) * (x - xs[-1]))


def _interp_many(x: np.ndarray, xs: np.ndarray, ys: np.ndarray) -> np.ndarray:
    """:func:`_interp` at every point of ``x`` (fp64, any shape) at once."""
    if xs.size == 0:
        return np.zeros(x.shape)
    if xs.size == 1:
        return ys[0] * np.maximum(x, xs[0]) / xs[0]
    slope = _tail_slope(xs, ys)
    return np.where(x <= xs[-1], np.interp(x, xs, ys), ys[-1] + slope * (x - xs[-1]))


def _monotone_points(points: dict[int, float]) -> tuple[np.ndarray, np.ndarray]:
    """Sorted ``(x, seconds)`` arrays, seconds made non-decreasing in x by lowering
    each to the least time at any larger x (:func:`lower_envelope`)."""
    kept = lower_envelope(points)
    xs = np.array(sorted(kept), dtype=np.float64)
    return xs, np.array([kept[int(x)] for x in xs], dtype=np.float64)


def lower_envelope(points: dict[int, float]) -> dict[int, float]:
    """``points`` (``{size: seconds}``) with each time lowered to the least at any
    larger size: interference (another process's kernels on the GPU while the graphs
    are timed) only ever adds time, so of two readings out of order the earlier one is
    the wrong one. Raising the later ones instead carried one slow reading to every
    larger shape (V2-Lite-shaped target beside six starting engines: 33 rows timed
    7.2 ms, 128 rows 3.9 ms; all of 33-96 then cost 7.2)."""
    floor, kept = float("inf"), {}
    for x in sorted(points, reverse=True):
        floor = min(floor, points[x])
        kept[x] = floor
    return kept


class StepCostModel:
    """Modeled GPU seconds of one step, from start-up measurements (host numbers).

    Args:
        num_layers: target attention layers on this GPU.
        contexts: increasing context lengths the attention was timed at.
        plain_attention: ``[C]`` seconds of one request's share of a batch's verify
            attention, one layer, one row (a plain step).
        tree_attention: ``[C, K]`` the same at ``1 + b_k`` rows.
        budgets: the ``K`` candidate budgets ``b_k`` (increasing).
    """

    def __init__(self, num_layers: int, contexts: Sequence[int],
                 plain_attention: Sequence[float], tree_attention: Any,
                 budgets: Sequence[int]) -> None:
        self.num_layers = num_layers
        self.contexts = np.asarray(contexts, dtype=np.float64)
        self._context_list = self.contexts.tolist()
        attention = np.asarray(tree_attention, dtype=np.float64).reshape(len(contexts), -1)
        # column 0: b = 0 (one row), then the candidates
        self.attention = np.concatenate(
            [np.asarray(plain_attention, dtype=np.float64).reshape(-1, 1), attention], axis=1)
        self.budgets = np.asarray([0, *budgets], dtype=np.float64)
        self.verify_rows = np.zeros(0)
        self.verify_seconds = np.zeros(0)
        self.draft_reqs = np.zeros(0)
        self.draft_seconds = np.zeros(0)
        # (num_reqs, drafts' int64 bytes) -> step_seconds_by_drafts' parts but attention
        self._arm_costs: dict[tuple[int, bytes], tuple[Any, ...]] = {}

    def set_graph_costs(self, verify_by_rows: dict[int, float],
                        draft_by_reqs: dict[int, float]) -> None:
        """Take the start-up graph timings: the target's verify forward by total rows
        (``{num_tokens: seconds}``) and the drafter's block pass by requests
        (``{num_reqs: seconds}``); either may be empty (no graphs: not modeled)."""
        if verify_by_rows:
            self.verify_rows, self.verify_seconds = _monotone_points(verify_by_rows)
        if draft_by_reqs:
            self.draft_reqs, self.draft_seconds = _monotone_points(draft_by_reqs)
        self._arm_costs.clear()

    @property
    def has_graph_costs(self) -> bool:
        return self.verify_rows.size > 0

    def attention_columns(self, contexts: np.ndarray) -> np.ndarray:
        """fp64 ``[1 + K]``: one layer's attention seconds summed over the requests of
        ``contexts`` at every timed budget (column 0: b = 0). Linear in the context
        between the timed ones, clamped below the first and continued past the last with
        the last segment's slope. One vectorized pass: the gate needs it at every step."""
        ctx = np.asarray(contexts, dtype=np.float64).reshape(-1)
        xs, table = self.contexts, self.attention
        if ctx.size == 0:
            return np.zeros(table.shape[1])
        if xs.size == 1:
            return table[0] * ctx.size
        if ctx.size == 1:  # batch 1, where the host's time is the step's: no vector pass
            points, c = self._context_list, float(ctx[0])
            lo = min(max(bisect.bisect_right(points, c) - 1, 0), len(points) - 2)
            frac = max((c - points[lo]) / (points[lo + 1] - points[lo]), 0.0)
            return (1.0 - frac) * table[lo] + frac * table[lo + 1]
        lo = np.clip(np.searchsorted(xs, ctx, side="right") - 1, 0, xs.size - 2)
        frac = np.maximum((ctx - xs[lo]) / (xs[lo + 1] - xs[lo]), 0.0)
        return (1.0 - frac) @ table[lo] + frac @ table[lo + 1]

    def attention_seconds(self, contexts: np.ndarray, num_drafts: int,
                          columns: np.ndarray | None = None) -> float:
        """``num_layers * sum_r attn(ctx_r, 1 + num_drafts)``: :meth:`attention_columns`
        (or ``columns``, its result for these contexts), linear in the row count between
        the timed budgets."""
        if columns is None:
            columns = self.attention_columns(contexts)
        b = min(num_drafts, self.budgets[-1])
        return self.num_layers * float(np.interp(b, self.budgets, columns))

    def step_seconds(self, num_reqs: int, contexts: np.ndarray, num_drafts: int,
                     drafted: bool, columns: np.ndarray | None = None) -> float:
        """A step of ``num_reqs`` requests verifying ``1 + num_drafts`` rows each, plus
        the drafter's block pass when ``drafted``; ``columns``: as in
        :meth:`attention_seconds`."""
        rows = num_reqs * (1 + num_drafts)
        seconds = _interp(rows, self.verify_rows, self.verify_seconds)
        seconds += self.attention_seconds(contexts, num_drafts, columns)
        if drafted:
            seconds += _interp(num_reqs, self.draft_reqs, self.draft_seconds)
        return seconds

    def extra_rows_seconds(self, rows: int, extra: int) -> float:
        """The verify forward's seconds for ``extra`` more rows beside ``rows`` (a
        step's prefill tokens beside its decodes: their weights' work; their attention
        is not modeled), continued past the timed shapes as :func:`_interp` does;
        never negative (the timings are made non-decreasing); 0 without graph costs."""
        if extra <= 0 or not self.has_graph_costs:
            return 0.0
        return (_interp(rows + extra, self.verify_rows, self.verify_seconds)
                - _interp(rows, self.verify_rows, self.verify_seconds))

    def step_seconds_by_drafts(self, num_reqs: int, num_drafts: np.ndarray,
                               columns: np.ndarray) -> np.ndarray:
        """fp64 ``[A]``: :meth:`step_seconds` for every count of ``num_drafts`` (int
        ``[A]``) at once, the drafter's block pass included exactly where the count is
        above 0 (the step gate's arms); ``columns``: :meth:`attention_columns` of the
        step's contexts."""
        drafts = np.asarray(num_drafts, dtype=np.int64)
        key = (num_reqs, drafts.tobytes())
        costs = self._arm_costs.get(key)
        if costs is None:
            costs = self._arm_costs_of(num_reqs, drafts, key)
        verify, attention_index, budgets, draft = costs
        if attention_index is not None:
            attention = columns[attention_index]
        else:
            attention = np.interp(budgets, self.budgets, columns)
        seconds = verify + self.num_layers * attention
        seconds += draft
        return seconds

    def _arm_costs_of(self, num_reqs: int, drafts: np.ndarray,
                      key: tuple[int, bytes]) -> tuple[Any, ...]:
        """The parts of :meth:`step_seconds_by_drafts` that depend on the batch size and
        the draft counts (int64 ``[A]``) alone, kept per ``(num_reqs, drafts)``: the verify forward
        (fp64 ``[A]``), where the attention is read from the columns (int64 ``[A]``
        indices where every count is a timed budget, else None and the clipped counts,
        fp64 ``[A]``, to interpolate at) and the drafter's block pass (fp64 ``[A]``),
        cached under ``key``."""
        values = np.asarray(drafts, dtype=np.float64)
        verify = _interp_many(num_reqs * (1.0 + values), self.verify_rows, self.verify_seconds)
        budgets = np.minimum(values, self.budgets[-1])
        index = np.searchsorted(self.budgets, budgets)
        exact = bool(np.all(self.budgets[np.minimum(index, self.budgets.size - 1)] == budgets))
        draft = np.zeros(values.shape)
        if self.draft_reqs.size > 0:
            draft = (values > 0) * _interp(num_reqs, self.draft_reqs, self.draft_seconds)
        if len(self._arm_costs) >= _ARM_COST_CACHE:
            self._arm_costs.clear()
        costs = (verify, index if exact else None, budgets, draft)
        self._arm_costs[key] = costs
        return costs
