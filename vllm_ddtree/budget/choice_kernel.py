# SPDX-License-Identifier: Apache-2.0
"""``ddtree_budget: "auto"``'s per-round choice in one Triton launch.

:meth:`vllm_ddtree.budget.policy.BudgetPolicy.choose` (the cost table's interpolation
per request, the trees' expected tokens per candidate budget, the argmax of tokens per
second) is about 20 small PyTorch kernels, eager, every round. ``_choose_budget_kernel``
does it in one program: blocks of ``BLOCK_R`` requests at a time, each row's node
probabilities sorted (``tl.sort``) and summed up to every candidate, the table
interpolated at each request's context. Same formulas as the PyTorch path; the sums run
in another order, so a near-tie between two candidates may go either way (any choice
is lossless: it only sets how many nodes are verified).

The same launch first folds the round's wall-time sample into the base-time EMA
(``BudgetPolicy.update_base_``'s formula, about ten eager kernels on the PyTorch path)
when the host recorded one: a round of ``auto`` then costs the host one launch and
one host-to-device copy.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_ddtree.budget.choice import RATE_TOLERANCE

__all__ = ["choose_budget_triton"]

BLOCK_R = 16


@triton.jit
def _fold_wall_sample(base, wall, last_attention, ema_weight):
    """``BudgetPolicy.update_base_``: sample = max(wall - last_attention, 0), at most
    2 x base + 0.1 ms, into the EMA (the sample itself while base < 0)."""
    sample = tl.maximum(wall - last_attention, 0.0)
    known = base >= 0
    sample = tl.where(known, tl.minimum(sample, 2 * base + 1e-4), sample)
    return tl.where(known, (1 - ema_weight) * base + ema_weight * sample, sample)


@triton.jit(do_not_specialize=["num_reqs", "num_nodes", "num_budgets", "num_contexts",
                               "has_sample", "has_rows", "idx_stride"])
def _choose_budget_kernel(
    scores_ptr,  # fp32 [R, B]
    ctx_ptr,  # int [R]
    contexts_ptr,  # fp32 [C]
    seconds_ptr,  # fp32 [C, K]
    budgets_ptr,  # int64 [K]
    base_ptr,  # fp32 [1]
    chosen_ptr,  # int64 [1]
    last_attention_ptr,  # fp32 [1]
    wall_ptr,  # fp32 [1]: the round's wall seconds (read when has_sample); with
    # SAMPLE_FLAG fp32 [2]: (seconds, pending), pending != 0 read and cleared here
    has_sample,  # int: 1 = fold wall_ptr into the base EMA first
    ema_weight,  # fp32
    rows_ptr,  # fp32 [K]: one request's row cost at 1 + b_k rows (read when has_rows)
    has_rows,  # int
    hidden_ptr,  # fp32 [2]: (arm, seconds) the host hides beyond the arm's cost (HAS_HIDDEN)
    rate_tolerance,  # fp32
    num_reqs,
    num_nodes,
    num_budgets,
    num_contexts,
    stride_scores_r,
    num_layers,
    idx_ptr,  # int [>= (R - 1) * idx_stride + 1]: row r counts iff idx[r * stride] >= 0
    idx_stride,
    EXTRAPOLATE: tl.constexpr,
    HAS_IDX: tl.constexpr,
    SAMPLE_FLAG: tl.constexpr,
    HAS_HIDDEN: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    offs_b = tl.arange(0, BLOCK_B)
    offs_k = tl.arange(0, BLOCK_K)
    offs_c = tl.arange(0, BLOCK_C)
    valid_k = offs_k < num_budgets
    budgets = tl.load(budgets_ptr + offs_k, mask=valid_k, other=0)
    contexts = tl.load(contexts_ptr + offs_c, mask=offs_c < num_contexts, other=float("inf"))
    first_ctx = tl.load(contexts_ptr)
    last_ctx = tl.load(contexts_ptr + num_contexts - 1)
    tokens = tl.zeros([BLOCK_K], tl.float32)
    attention = tl.zeros([BLOCK_K], tl.float32)
    num_valid = 0.0
    for first in range(0, num_reqs, BLOCK_R):
        rows = first + tl.arange(0, BLOCK_R)
        valid_r = rows < num_reqs
        if HAS_IDX:  # CUDA-graph padding requests (state row -1) do not count
            state_row = tl.load(idx_ptr + rows.to(tl.int64) * idx_stride, mask=valid_r,
                                other=-1)
            valid_r = valid_r & (state_row >= 0)
        num_valid += tl.sum(valid_r.to(tl.float32), axis=0)
        # Expected committed tokens: 1 + the sum of the b largest node probabilities.
        scores = tl.load(
            scores_ptr + rows[:, None].to(tl.int64) * stride_scores_r + offs_b[None, :],
            mask=valid_r[:, None] & (offs_b[None, :] < num_nodes), other=float("-inf"))
        probs = tl.sort(tl.exp(scores), dim=1, descending=True)
        cums = tl.cumsum(probs, axis=1)  # [BLOCK_R, BLOCK_B]
        for k in range(num_budgets):
            budget = tl.load(budgets_ptr + k)
            per_row = tl.sum(tl.where(offs_b[None, :] == budget - 1, cums, 0.0), axis=1)
            batch = tl.sum(tl.where(valid_r, 1.0 + per_row, 0.0), axis=0)
            tokens += tl.where(offs_k == k, batch, 0.0)

        # The cost table at each request's context (BudgetCostTable.at).
        ctx = tl.load(ctx_ptr + rows, mask=valid_r, other=0).to(tl.float32)
        if num_contexts == 1:
            row = tl.load(seconds_ptr + offs_k, mask=valid_k, other=0.0)
            cost = row[None, :] + 0.0 * ctx[:, None]
        else:
            ctx = tl.maximum(ctx, first_ctx)
            if not EXTRAPOLATE:
                ctx = tl.minimum(ctx, last_ctx)
            hi = tl.sum((contexts[None, :] < ctx[:, None]).to(tl.int32), axis=1)
            hi = tl.minimum(tl.maximum(hi, 1), num_contexts - 1)
            lo = hi - 1
            ctx_lo = tl.load(contexts_ptr + lo)
            ctx_hi = tl.load(contexts_ptr + hi)
            w = tl.maximum((ctx - ctx_lo) / tl.maximum(ctx_hi - ctx_lo, 1e-9), 0.0)
            if not EXTRAPOLATE:
                w = tl.minimum(w, 1.0)
            sec_lo = tl.load(seconds_ptr + lo[:, None] * num_budgets + offs_k[None, :],
                             mask=valid_r[:, None] & valid_k[None, :], other=0.0)
            sec_hi = tl.load(seconds_ptr + hi[:, None] * num_budgets + offs_k[None, :],
                             mask=valid_r[:, None] & valid_k[None, :], other=0.0)
            cost = tl.maximum(sec_lo * (1 - w[:, None]) + sec_hi * w[:, None], 0.0)
        attention += tl.sum(tl.where(valid_r[:, None], cost, 0.0), axis=0)

    attention = attention * num_layers
    if has_rows != 0:
        if num_budgets > 1:
            # budget.rows_seconds_for_batch: the cost at num_reqs * (1 + b_k) rows,
            # piecewise linear over the one-request points 1 + b_j, last segment extended.
            xs = tl.where(valid_k, 1.0 + budgets.to(tl.float32), float("inf"))
            x = num_valid * (1.0 + budgets.to(tl.float32))
            hi = tl.sum((xs[None, :] < x[:, None]).to(tl.int32), axis=1)
            hi = tl.minimum(tl.maximum(hi, 1), num_budgets - 1)
            lo = hi - 1
            x_lo = 1.0 + tl.load(budgets_ptr + lo, mask=valid_k, other=0).to(tl.float32)
            x_hi = 1.0 + tl.load(budgets_ptr + hi, mask=valid_k, other=1).to(tl.float32)
            y_lo = tl.load(rows_ptr + lo, mask=valid_k, other=0.0)
            y_hi = tl.load(rows_ptr + hi, mask=valid_k, other=0.0)
            w = (x - x_lo) / (x_hi - x_lo)
            attention += tl.where(valid_k, tl.maximum(y_lo + w * (y_hi - y_lo), 0.0), 0.0)
    if HAS_HIDDEN:  # BudgetPolicy.hidden_costs
        arm = tl.load(hidden_ptr)
        hidden = tl.load(hidden_ptr + 1)
        at_arm = tl.sum(tl.where(valid_k & (budgets.to(tl.float32) == arm), attention, 0.0),
                        axis=0)
        attention = tl.where(hidden > 0, tl.maximum(attention, at_arm + hidden), attention)
    base = tl.load(base_ptr)
    if SAMPLE_FLAG:
        pending = tl.load(wall_ptr + 1) != 0
        folded = _fold_wall_sample(base, tl.load(wall_ptr), tl.load(last_attention_ptr),
                                   ema_weight)
        base = tl.where(pending, folded, base)
        tl.store(base_ptr, base)
        tl.store(wall_ptr + 1, 0.0)
    elif has_sample != 0:
        base = _fold_wall_sample(base, tl.load(wall_ptr), tl.load(last_attention_ptr),
                                 ema_weight)
        tl.store(base_ptr, base)
    at_max = tl.sum(tl.where(offs_k == num_budgets - 1, attention, 0.0), axis=0)
    base = tl.where(base >= 0, base, at_max)
    rate = tl.where(valid_k, tokens / (base + attention), float("-inf"))
    best_rate = tl.max(rate, axis=0)
    # budget.choose_batch_budget: the smallest candidate within rate_tolerance of the best
    near_best = rate >= (1 - rate_tolerance) * best_rate
    best = tl.min(tl.where(near_best, offs_k, BLOCK_K), axis=0)
    tl.store(chosen_ptr, tl.sum(tl.where(offs_k == best, budgets, 0), axis=0))
    tl.store(last_attention_ptr, tl.sum(tl.where(offs_k == best, attention, 0.0), axis=0))


def choose_budget_triton(
    scores: torch.Tensor,
    context_lens: torch.Tensor,
    contexts: torch.Tensor,
    seconds: torch.Tensor,
    budgets: torch.Tensor,
    base_seconds: torch.Tensor,
    last_attention: torch.Tensor,
    num_layers: int,
    extrapolate: bool,
    wall_seconds: torch.Tensor | None = None,
    ema_weight: float = 0.0,
    row_seconds: torch.Tensor | None = None,
    row_of_sample: torch.Tensor | None = None,
    idx_stride: int = 1,
    sample_flag: bool = False,
    out: torch.Tensor | None = None,
    hidden: torch.Tensor | None = None,
) -> torch.Tensor:
    """The batch's active budget, as ``BudgetPolicy.choose`` computes it.

    Args:
        scores: float32 ``[R, B]`` node scores (``DraftTree.scores``), last dim contiguous.
        context_lens: int ``[R]``.
        contexts / seconds / budgets: the cost table (``BudgetCostTable``: fp32 ``[C]``,
            fp32 ``[C, K]`` contiguous, int64 ``[K]``); extrapolate: its flag.
        base_seconds: fp32 ``[1]`` (< 0: no sample yet, the cost at B stands in);
            updated in place when ``wall_seconds`` is given.
        last_attention: fp32 ``[1]``: the previous round's modeled attention (read by
            the EMA), then gets the chosen round's.
        num_layers: target attention layers.
        wall_seconds: fp32 ``[1]``, a wall-time sample to fold into ``base_seconds``
            first with ``ema_weight`` (``BudgetPolicy.update_base_``), or None.
        row_seconds: fp32 ``[K]``, one request's row cost per candidate
            (``BudgetPolicy.row_seconds``), added to the modeled attention as
            ``budget.rows_seconds_for_batch`` does; None: no row cost.
        row_of_sample: int, request ``r`` counts only if ``row_of_sample[r *
            idx_stride] >= 0`` (inside the drafter's CUDA graph: DFlash's
            ``sample_idx_mapping``, -1 for padding requests); None: every row counts.
        sample_flag: ``wall_seconds`` is fp32 ``[2]``, (seconds, pending): the sample
            is folded only if pending != 0, and pending is cleared (a graph replayed
            every round reads whether the host recorded a sample).
        out: int64 ``[1]`` to write ``b`` to (a persistent buffer under a CUDA graph).
        hidden: fp32 ``[2]``, ``(arm, seconds)``: where ``seconds > 0``, every
            candidate's modeled cost is at least the arm's plus ``seconds`` (the host's
            step hides that much GPU time: ``BudgetPolicy.hidden_costs``); None: none.

    Returns:
        int64 0-dim tensor ``b`` (one of ``budgets``; a view of ``out`` when given).
        No host sync.
    """
    if sample_flag and (wall_seconds is None or wall_seconds.numel() < 2):
        raise ValueError("sample_flag needs wall_seconds of two entries (seconds, pending)")
    num_reqs, num_nodes = scores.shape
    if scores.stride(1) != 1 or not seconds.is_contiguous():
        raise ValueError("scores (last dim) and seconds must be contiguous")
    chosen = torch.empty(1, dtype=torch.int64, device=scores.device) if out is None else out
    block_b = triton.next_power_of_2(max(num_nodes, 1))
    _choose_budget_kernel[(1,)](
        scores, context_lens, contexts, seconds, budgets, base_seconds, chosen,
        last_attention, base_seconds if wall_seconds is None else wall_seconds,
        int(wall_seconds is not None), float(ema_weight),
        base_seconds if row_seconds is None else row_seconds, int(row_seconds is not None),
        base_seconds if hidden is None else hidden,
        RATE_TOLERANCE,
        num_reqs, num_nodes, budgets.numel(), contexts.numel(),
        scores.stride(0), float(num_layers),
        chosen if row_of_sample is None else row_of_sample, idx_stride,
        EXTRAPOLATE=extrapolate, HAS_IDX=row_of_sample is not None, SAMPLE_FLAG=sample_flag,
        HAS_HIDDEN=hidden is not None,
        BLOCK_R=min(BLOCK_R, max(1, 4096 // block_b)),
        BLOCK_B=block_b,
        BLOCK_K=triton.next_power_of_2(budgets.numel()),
        BLOCK_C=triton.next_power_of_2(contexts.numel()),
    )  # fmt: skip
    return chosen[0]
