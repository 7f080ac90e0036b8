"""``ddtree_budget: "auto"``: the start-up cost model and the per-round budget choice.

The scheduler keeps scheduling ``B = num_speculative_tokens`` draft tokens. Each
round only the first ``b`` nodes of every tree are *active*: the tree-verify attention
skips the other rows and the verifier ignores them (the first ``b`` nodes are the
budget-``b`` tree, see ``vllm_ddtree.tree.draft_tree``). With adaptive verify shapes
(``vllm_ddtree.verify.shape``) the runner also verifies only ``1 + s`` rows, ``s`` the
candidate >= a recent round's ``b``; with fixed ones it verifies ``1 + B``. One ``b``
per batch:

    tokens(b)  = sum_r E[committed tokens of request r | b]   (drafter's own estimate)
    seconds(b) = base + num_layers * sum_r attn(ctx_r, 1 + b) + rows(R * (1 + b))
    b*         = the smallest candidate within 1 % of the best tokens(b) / seconds(b)

* ``attn(ctx, q)``: one request's tree-verify attention in one target layer, measured
  at start-up with the target's own kernel on dummy tensors over a (context x query
  length) grid (:func:`measure_attention_costs`), interpolated on the device. Where
  the run's decode steps replay FULL CUDA graphs (``cudagraph_mode`` FULL,
  FULL_AND_PIECEWISE or FULL_DECODE_ONLY) each cell is timed as replays of a graph
  capturing the kernel (``attention_timing.GraphTimer``), as the verify step runs it;
  otherwise (NONE, PIECEWISE, ``enforce_eager``) as eager launches, which is what
  those steps pay (a failed capture falls back to eager timing for the whole grid).
  Summing it over requests overcounts the fixed launch cost of short contexts at
  larger batches (a batch runs one kernel); that cost does not depend on ``b``.
* ``rows(n)``: with adaptive verify shapes, what verifying ``n`` rows costs beside
  attention (the target's GEMMs or MoE experts, lm_head, sampling): one request's
  captured verify graph of each shape ``1 + s`` is replayed at start-up
  (``vllm_ddtree.patches.verify_shapes``; :meth:`BudgetPolicy.set_row_costs`), minus the smallest
  shape's time, interpolated in the total row count (``budget.rows_seconds_for_batch``).
  Zero with fixed shapes (every round runs ``1 + B`` rows) or before the measurement.
* ``base``: everything else in a round (drafter, the smallest shape's forward,
  sampling, host work). It is not measured per part; :class:`BudgetPolicy` keeps an EMA
  of ``wall time between consecutive rounds - modeled attention and rows of the round``.
  The host reads the wall time with ``time.perf_counter`` at each ``propose``: in
  steady state the host loop runs at the GPU's pace (it waits on each step's sampled
  tokens), so the interval is one round's time. Intervals after an idle engine or a
  step without trees are dropped, and one sample may at most double the estimate.
  Until the first sample, ``base`` is the modeled attention at ``B`` (a neutral start:
  neither tiny nor huge trees are favoured a priori).

Every per-round operation stays on the device (no ``.item()``, no host sync); only
the start-up measurement synchronizes.

**The step gate: each step's arm** (``vllm_ddtree.budget.gate``; TP = 1 with adaptive
verify shapes). The choice above is made on the device *after* the drafter's block
pass, from the drafter's confidence, and sees only the attention and row costs it
models. Two things it cannot express: "no tree" (b = 0: at a large batch, or with a
drafter that is rarely right, even a one-node tree is slower per token than plain
decoding, the block pass and the wider verify costing more than the trees commit), and
costs it does not model that grow with the verified rows at large batch (host work per
draft token, sampling, the drafter's context K/V): there it verified B nodes where
fewer were faster. So the host picks, at each ``propose`` *before* the pass and for the
next step, an *arm*: 0 (plain decoding, no block pass) or ``s``, one of the verify
shapes, capping the step's shape (the device still picks ``b <= s``):

* **what it compares**: per batch-size bucket (powers of two) and arm, the predicted
  tokens per second ``E(a) / (T(a) + residual(a))`` for this batch of ``R`` requests and
  their contexts. ``T`` = the start-up model (``vllm_ddtree.budget.step_cost.
  StepCostModel``: the target's verify forward by total rows, timed on its own FULL
  CUDA graphs of every verify shape at 1, 2, 4, ... requests; the drafter's block pass
  by requests, timed on its graphs; the verify attention per request (its share of a
  batch's launch), layer and context at 1 and ``1 + b`` rows, the table above plus a
  one-row column), the arm taken as the
  step's shape. ``residual(a)`` = what steps of that arm in that bucket took beyond
  ``T`` of each at the shape it verified: the bucket's level (the lower median of the
  last 15 intervals of any arm, each less its arm's offset) plus the arm's offset (the
  lower median of its probe steps less the level of the moment; the settled arm's steps
  move the level), so that the host's speed, which moves every arm's steps together,
  moves every arm's residual; an offset's difference from the settled arm's counts
  only beyond one standard error of its median, from what the host's step hides: vLLM
  prepares a step on the host while the GPU runs the last, so where the GPU idled after
  the settled arm's steps (an event at the end of each timed ``propose``), an arm ``d``
  longer on the GPU is predicted ``max(0, d - idle)`` longer per such step and one
  ``d`` shorter no shorter (the device's
  budget may cut an arm's trees further; a prefill's tokens in the step priced as more
  rows of the forward): what they actually took beyond the model, from CUDA timing
  events at the start of each step the gate times and of the step after it, read only
  once completed (``Event.query``); the gate times the step whose propose decides, and a
  decision holds for as many steps as keep its own host time at 1 % of theirs (several
  at batch 1, where the step's time is the host's). A step that
  holds a prefill counts only where at least a quarter of the bucket's last 128 timed
  steps hold one (continuous batching at large batch) and its prefill's attention
  (query-key pairs) is at most 4x the median of theirs: a long prompt's chunks on
  consecutive steps, their attention growing with the prompt, would fill the level's
  window. ``E(a)`` =
  tokens committed per tree of that arm's trees (an EMA of DDTree's device counters
  that remembers about 12 trees at batch 1-2, ``gate_stats.EMA_TREES``: a stretch of
  hard rounds must not flip batch 1 to plain decoding, nor a request the drafter cannot
  predict keep drafting for a hundred steps; copied to pinned memory at each
  decision, the held steps' trees with it, and read once their copy completed; 1 for plain
  decoding; for an arm without counted trees the nearest arm's figure). The walk also
  counts what each tree would have accepted cut to every arm's size (the accepted
  path's nodes below it: a parent precedes its children in the tree's best-first
  order), so each step of an arm gives every smaller arm's figure from the same trees,
  paired with its own, not from a probe's few trees of other requests; an arm above the
  settled one, counted in its probes only, follows how the settled arm's figure moved
  since, as its probe's trees cut to the settled arm measured it (at most 2x either
  way). So the model
  carries the batch-size and row dependence of the GPU work, the residuals what no
  start-up measurement sees; neither needs a host sync.
* **settling**: each bucket keeps a settled arm (a new bucket starts from the nearest
  bucket's) and moves to its best measured arm when that is predicted 2 % faster and
  was measured on at least 3 intervals (else it is probed again first).
* **probes** (three steps of another arm; the middle ones are clean intervals of it;
  the probe's trees replace the arm's committed figure): the first time in a bucket,
  every unmeasured neighbour of the settled arm (the next smaller and larger arms), the
  arm beyond a neighbour that measured faster (so a slope where each hop gains less
  than 2 % is still followed) and, from plain decoding, the arm below the smallest
  measured one; then every 32 decisions of a bucket the least recently probed of the
  neighbours and, from plain decoding, of the best measured speculative arm, that arm
  below and (smallest first) the measured arms not probed since plain decoding began
  or the requests changed: plain steps count no trees, so the way back must be probed,
  and where one draft loses to plain decoding a larger tree may still win. The
  interval doubles up to 1,024 and restarts when the settled arm's committed tokens per
  tree (from plain decoding: a probed arm's) move by 20 % (the requests changed);
  decisions, not steps: under a hold of up to 16 steps they are further apart. A probe
  of a larger arm whose trees, cut to the settled arm, accepted no draft says nothing of
  what the larger tree adds: it runs again at once, at most twice in a row. A
  speculative step after plain ones loses nothing: a plain step's ``propose`` still
  writes the drafter's context K/V of the tokens it committed
  (``DDTreeSpeculator._store_context_kv``), only the block pass is skipped, so the
  drafter's cache is the one it would have had.
* **the batch schedule** (``num_speculative_tokens_per_batch_size``,
  ``vllm_ddtree.budget.schedule``) caps the arms per batch size (a cap below every
  speculative arm leaves plain decoding); a cap of 0 is a plain step without the gate,
  and then no probe runs.
* **the log**: an INFO line (logger ``vllm.ddtree.budget_gate``) lists the settled arms
  by batch size whenever one changes, at most once a minute.
* Not at TP > 1: each rank would time its own steps and could decide differently,
  while the ranks must cut the same drafts; auto's smallest budget stays 1 there.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from vllm_ddtree.budget.attention_timing import (
    GraphTimer,
    MeasureFn,
    attention_time_fn,
    measure_attention_costs,
    measurement_contexts,
    target_attention_timer,
)
from vllm_ddtree.budget.choice import (
    BudgetCostTable,
    choose_batch_budget,
    expected_committed_by_budget,
    rows_seconds_for_batch,
)
from vllm_ddtree.budget.choice_kernel import choose_budget_triton
from vllm_ddtree.triton_path import use_triton

if TYPE_CHECKING:
    from vllm_ddtree.budget.step_cost import StepCostModel

__all__ = ["BudgetPolicy", "candidate_budgets", "format_table"]

# Under "vllm." so that the start-up table reaches vLLM's log handler (its "vllm"
# logger does not propagate to the root logger).
logger = logging.getLogger("vllm.ddtree.budget_policy")

# Wall intervals longer than this are an idle engine, not a round.
MAX_ROUND_SECONDS = 2.0
EMA_WEIGHT = 0.1
# Pinned host slots for the wall time: the host may run a few steps ahead of the GPU,
# so a slot must not be rewritten before its copy ran.
_WALL_SLOTS = 8


def candidate_budgets(max_budget: int) -> list[int]:
    """Budgets ``b`` a round may pick: powers of two below ``max_budget``, then
    ``max_budget`` itself (sorted, unique; ``[1]`` for ``max_budget = 1``)."""
    if max_budget < 1:
        raise ValueError(f"max_budget must be >= 1, got {max_budget}")
    out, b = [], 1
    while b < max_budget:
        out.append(b)
        b *= 2
    return out + [max_budget]


def format_table(table: BudgetCostTable) -> str:
    """The table as text, microseconds per request and layer (for the start-up log)."""
    budgets = table.budgets.tolist()
    lines = ["context  " + " ".join(f"b={b:>5}" for b in budgets)]
    for ctx, row in zip(table.contexts.tolist(), table.seconds.tolist(), strict=True):
        lines.append(f"{int(ctx):>7}  " + " ".join(f"{1e6 * s:7.1f}" for s in row))
    return "\n".join(lines)


class BudgetPolicy:
    """Per-round choice of the active budget, on the device.

    Args:
        table: one request's attention seconds per layer (``budgets`` = candidates,
            the last one = B), e.g. from :func:`measure_attention_costs`.
        num_layers: target attention layers on this GPU.
        ema_weight: weight of a new base-time sample.
        tp_group: vLLM's tensor-parallel ``GroupCoordinator`` when it has more than one
            rank: every rank then takes the first rank's choice (each rank times its
            own table and wall clock, and the ranks' walks must agree).
        plain_attention: one request's attention seconds per layer at one row (a plain
            decoding step), per context of ``table`` (host floats), for the step gate's
            cost model (:meth:`cost_model`); None: the ``b = 1`` column stands in.
    """

    def __init__(self, table: BudgetCostTable, num_layers: int,
                 ema_weight: float = EMA_WEIGHT, tp_group: Any = None,
                 plain_attention: Sequence[float] | None = None) -> None:
        budgets = table.budgets.tolist()
        if budgets != sorted(set(budgets)) or budgets[0] < 1:
            raise ValueError(f"candidate budgets must be increasing and >= 1, got {budgets}")
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        self.table = table
        self.plain_attention = None if plain_attention is None else list(plain_attention)
        self.budgets = table.budgets
        self.max_budget = budgets[-1]
        self.num_layers = num_layers
        self.ema_weight = ema_weight
        self.tp_group = tp_group
        device = table.seconds.device
        f32 = dict(dtype=torch.float32, device=device)
        # < 0: no sample yet (the choice then uses the modeled attention at B).
        self.base_seconds = torch.full((1,), -1.0, **f32)
        # Modeled attention (+ rows) of the last chosen round: what the next wall
        # sample covers besides the base time.
        self.last_attention = torch.zeros(1, **f32)
        # rows(1 + b_k) of one request, float32 [K] (set_row_costs); None: not measured.
        self.row_seconds: torch.Tensor | None = None
        # The same in a buffer a CUDA graph reads (zeros: no row cost), written in place.
        self._row_seconds_buffer = torch.zeros(len(budgets), **f32)
        self._wall_device = torch.zeros(1, **f32)
        self._wall_host = torch.zeros(
            _WALL_SLOTS, dtype=torch.float32, pin_memory=device.type == "cuda"
        )
        # choose_in_graph: the chosen budget, and (wall seconds, pending) the graph reads.
        self.in_graph = False
        self.chosen = torch.full((1,), self.max_budget, dtype=torch.int64, device=device)
        self._wall_flagged = torch.zeros(2, **f32)
        self._wall_host_flagged = torch.zeros(
            _WALL_SLOTS, 2, dtype=torch.float32, pin_memory=device.type == "cuda"
        )
        # The pinned slots as views the copies read and as NumPy arrays written without
        # a torch op (observe_round ran eight: microseconds of the host's round).
        self._wall_host_slots = [self._wall_host[i : i + 1] for i in range(_WALL_SLOTS)]
        self._wall_host_values = self._wall_host.numpy()
        self._wall_flagged_slots = list(self._wall_host_flagged.unbind(0))
        self._wall_flagged_values = self._wall_host_flagged.numpy()
        self._slot = 0
        # (arm, seconds): GPU time the host's step hides beyond the arm's modeled cost
        # (hide_; the step gate measures it), in a buffer the graph's choice reads, and
        # its pinned slots; (0, 0): none
        self.hidden = torch.zeros(2, **f32)
        self._hidden_host = torch.zeros(
            _WALL_SLOTS, 2, dtype=torch.float32, pin_memory=device.type == "cuda"
        )
        self._hidden_slots = list(self._hidden_host.unbind(0))
        self._hidden_values = self._hidden_host.numpy()
        self._hidden_slot = 0
        self._hidden_last = (0, 0.0)
        self._last_round_start: float | None = None
        # A wall sample copied to _wall_device that the next choose folds into base.
        self._sample_pending = False

    # -- the choice ----------------------------------------------------------------

    def attention_seconds(self, context_lens: torch.Tensor) -> torch.Tensor:
        """float32 ``[K]``: modeled target attention of a round per candidate,
        ``num_layers * sum_r attn(ctx_r, 1 + b)`` for int ``context_lens [R]``."""
        return self.num_layers * self.table.at(context_lens.reshape(-1)).sum(dim=0)

    def set_row_costs(self, seconds_by_shape: dict[int, float]) -> None:
        """Take one request's measured verify forward time per shape (``{s: seconds}``
        for every candidate ``s``, 1 + s rows): the row cost is each minus the smallest
        shape's, each time first lowered to the least at any larger shape. Raises
        ``ValueError`` when a candidate is missing or a time is not positive."""
        budgets = self.budgets.tolist()
        missing = [b for b in budgets if b not in seconds_by_shape]
        if missing:
            raise ValueError(f"verify times missing for budgets {missing}")
        times = torch.tensor([float(seconds_by_shape[b]) for b in budgets])
        if not bool((times > 0).all()):
            raise ValueError(f"verify times must be positive, got {times.tolist()}")
        # non-decreasing from above, as step_cost._monotone_points: a reading above a
        # larger shape's is interference (it only adds time)
        kept = times.flip(0).cummin(dim=0).values.flip(0)
        rows = kept - kept[0]
        self._row_seconds_buffer.copy_(rows)
        self.row_seconds = self._row_seconds_buffer
        logger.info(
            "DDTree auto budget: one request's verify forward per shape (us): %s; row "
            "cost over the smallest shape (us): %s",
            {b: round(1e6 * t, 1) for b, t in zip(budgets, times.tolist(), strict=True)},
            [round(1e6 * r, 1) for r in rows.tolist()],
        )

    def modeled_seconds(self, context_lens: torch.Tensor) -> torch.Tensor:
        """float32 ``[K]``: the round's modeled attention plus, once measured, the row
        cost of ``R * (1 + b)`` verified rows (``R = context_lens.numel()``)."""
        modeled = self.attention_seconds(context_lens)
        if self.row_seconds is not None:
            modeled = modeled + rows_seconds_for_batch(self.row_seconds, self.budgets,
                                                       context_lens.numel())
        return modeled

    def hide_(self, arm: int, seconds: float) -> None:
        """Host: the next choices count every candidate's modeled cost as at least the
        arm's plus ``seconds`` (``seconds <= 0``: as modeled). Where the host's step
        outlasts the GPU's (a small target at batch 1: the GPU idled 0.6 ms after each
        step, H100), a tree cut below the arm saves no time the host does not wait
        for anyway, and a tree above it costs only what exceeds that idle time; modeled
        as saving its whole GPU time, the cut left 37 of 64 nodes a round active and
        committed 10 % fewer tokens a round than fixed B = 64 at the same step time.
        ``arm``: a candidate budget (the step gate's settled arm), ``seconds``: the
        GPU's idle time after that arm's steps (``SpeculationGate.device_hidden``). A
        pinned non-blocking copy when the pair changed; no host sync."""
        pair = (int(arm), float(seconds)) if seconds > 0 else (0, 0.0)
        if pair == self._hidden_last:
            return
        self._hidden_last = pair
        slot = self._hidden_slot
        self._hidden_slot = (slot + 1) % _WALL_SLOTS
        self._hidden_values[slot] = pair
        self.hidden.copy_(self._hidden_slots[slot], non_blocking=True)

    def hidden_costs(self, modeled: torch.Tensor) -> torch.Tensor:
        """float32 ``[K]``: ``modeled`` at least the arm's plus the hidden seconds of
        :meth:`hide_` (as ``modeled`` where none). No host sync."""
        arm, seconds = self.hidden[0], self.hidden[1]
        at_arm = torch.where(self.budgets.to(modeled.dtype) == arm, modeled, 0.0).sum()
        return torch.where(seconds > 0, torch.maximum(modeled, at_arm + seconds), modeled)

    def round_seconds(self, attention: torch.Tensor) -> torch.Tensor:
        """float32 ``[K]``: ``base + attention`` (base = ``attention[-1]``, the cost
        at B, until the first wall sample)."""
        base = torch.where(self.base_seconds >= 0, self.base_seconds, attention[-1:])
        return base + attention

    def choose(self, scores: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor:
        """The batch's active budget.

        Args:
            scores: float32 ``[R, B]``, the trees' node scores (``DraftTree.scores``).
            context_lens: int ``[R]``, the requests' context lengths.

        Returns:
            int64 0-dim tensor ``b`` (one of the candidates). First folds the wall
            sample :meth:`observe_round` recorded, if any, into the base time; records
            the chosen round's modeled attention for the next sample. No host sync.
            On CUDA one Triton launch for both (``budget_choice_kernel``); CPU
            tensors: the ops below.
        """
        pending, self._sample_pending = self._sample_pending, False
        if use_triton(scores):
            table = self.table
            b = choose_budget_triton(
                scores, context_lens, table.contexts, table.seconds, self.budgets,
                self.base_seconds, self.last_attention, self.num_layers, table.extrapolate,
                wall_seconds=self._wall_device if pending else None,
                ema_weight=self.ema_weight, row_seconds=self.row_seconds,
                hidden=self.hidden,
            )
        else:
            if pending:
                self.update_base_(self._wall_device)
            modeled = self.hidden_costs(self.modeled_seconds(context_lens))
            expected = expected_committed_by_budget(scores)
            b = choose_batch_budget(expected, self.round_seconds(modeled), self.budgets)
            index = torch.searchsorted(self.budgets, b.reshape(1))
            self.last_attention.copy_(modeled[index])
        if self.tp_group is not None:
            # An NCCL broadcast on the stream: no host sync.
            torch.distributed.broadcast(b, src=self.tp_group.ranks[0],
                                        group=self.tp_group.device_group)
        return b

    def choose_in_graph(self, scores: torch.Tensor, context_lens: torch.Tensor,
                        row_of_sample: torch.Tensor, idx_stride: int) -> torch.Tensor:
        """:meth:`choose` for a step captured in a CUDA graph (the drafter's), TP = 1 on
        CUDA: only rows whose ``row_of_sample[r * idx_stride] >= 0`` count (padding
        requests are -1), the wall sample is folded when the flag :meth:`observe_round`
        copied with it says so, the row costs are read from a buffer that
        :meth:`set_row_costs` fills later, and the choice lands in ``self.chosen``
        (int64 ``[1]``, returned). One launch, no host sync. Call
        :meth:`enable_in_graph_` first."""
        if not self.in_graph:
            raise RuntimeError("choose_in_graph needs enable_in_graph_() first")
        table = self.table
        return choose_budget_triton(
            scores, context_lens, table.contexts, table.seconds, self.budgets,
            self.base_seconds, self.last_attention, self.num_layers, table.extrapolate,
            wall_seconds=self._wall_flagged, ema_weight=self.ema_weight,
            row_seconds=self._row_seconds_buffer, row_of_sample=row_of_sample,
            idx_stride=idx_stride, sample_flag=True, out=self.chosen, hidden=self.hidden)

    def enable_in_graph_(self) -> None:
        """Choose inside a CUDA graph from now on (:meth:`choose_in_graph`): wall
        samples go to the device with a pending flag. Raises ``NotImplementedError``
        at TP > 1 (the ranks' choice is broadcast eagerly) or off CUDA."""
        if self.tp_group is not None:
            raise NotImplementedError("the in-graph budget choice is for TP = 1")
        if self.base_seconds.device.type != "cuda":
            raise NotImplementedError("the in-graph budget choice needs CUDA")
        self.in_graph = True

    def cost_model(self) -> StepCostModel:
        """The step gate's start-up cost model (``vllm_ddtree.budget.step_cost``): this
        policy's attention tables on the host, plus the plain step's column. Reads the
        device table once (start-up)."""
        from vllm_ddtree.budget.step_cost import StepCostModel

        tree = self.table.seconds.cpu().double().numpy()
        plain = self.plain_attention if self.plain_attention is not None else tree[:, 0]
        return StepCostModel(self.num_layers, self.table.contexts.cpu().tolist(), plain,
                             tree, self.budgets.cpu().tolist())

    # -- the base time ---------------------------------------------------------------

    def update_base_(self, wall_seconds: torch.Tensor) -> None:
        """Fold one round's wall time (float32 ``[1]`` on the device) into the base
        EMA: sample = ``max(wall - last_attention, 0)``, at most ``2 x base + 0.1 ms``."""
        sample = (wall_seconds - self.last_attention).clamp_min(0)
        known = self.base_seconds >= 0
        sample = torch.where(known, torch.minimum(sample, 2 * self.base_seconds + 1e-4), sample)
        w = self.ema_weight
        self.base_seconds.copy_(
            torch.where(known, (1 - w) * self.base_seconds + w * sample, sample)
        )

    def observe_round(self, now: float | None = None, verified: bool = True,
                      sample: bool = True) -> None:
        """Host hook at the start of every ``propose``: the time since the previous
        call is one round when ``verified`` (this step verified trees) and the engine
        was not idle in between. Copies it to the device without a sync (one torch op);
        the next :meth:`choose` folds it into the base time (:meth:`update_base_`).
        ``sample`` False: only restart the round clock (the step gate holds its
        decision: one sample a decision is enough for the base time's EMA)."""
        now = time.perf_counter() if now is None else now
        last, self._last_round_start = self._last_round_start, now
        if (last is None or not (verified and sample)
                or not 0 < now - last <= MAX_ROUND_SECONDS):
            return
        slot = self._slot
        self._slot = (slot + 1) % _WALL_SLOTS
        if self.in_graph:  # (seconds, pending) for the graph's choice
            pair = self._wall_flagged_values[slot]
            pair[0], pair[1] = now - last, 1.0
            self._wall_flagged.copy_(self._wall_flagged_slots[slot], non_blocking=True)
            return
        self._wall_host_values[slot] = now - last
        self._wall_device.copy_(self._wall_host_slots[slot], non_blocking=True)
        self._sample_pending = True

    def reset_round_clock(self) -> None:
        """Forget the previous round's start and any sample not yet folded (after a
        dummy or profile run)."""
        self._last_round_start = None
        self._sample_pending = False
        if self.in_graph:
            self._wall_flagged[1:].zero_()

    # -- construction in vLLM ------------------------------------------------------------

    @classmethod
    def from_vllm_config(cls, vllm_config: Any, max_budget: int,
                         device: torch.device | str,
                         measure_fn: MeasureFn | None = None) -> BudgetPolicy:
        """Measure the target's verify attention (``measure_fn`` default: the MLA or
        GQA tree kernel with the target's shapes, timed in CUDA graphs or eagerly as
        the run's ``cudagraph_mode`` runs it: ``attention_timing.attention_time_fn``)
        and build the policy. Syncs."""
        model_config = vllm_config.model_config
        parallel = vllm_config.parallel_config
        budgets = candidate_budgets(max_budget)
        contexts = measurement_contexts(model_config.max_model_len)
        device = torch.device(device)
        start = time.perf_counter()
        timing = "as eager launches" if measure_fn is None else "by the given measure_fn"
        adaptive_shapes = _adaptive_verify_shapes(vllm_config)
        if measure_fn is None and device.type == "cuda":
            # Launch on the runner's GPU; give the dummy caches back before vLLM
            # profiles memory.
            with torch.cuda.device(device):
                time_fn = attention_time_fn(vllm_config, device)
                attention = target_attention_timer(vllm_config, 1 + max_budget, device,
                                                   time_fn=time_fn,
                                                   adaptive_shapes=adaptive_shapes)
                table, plain = measure_attention_costs(attention, contexts, budgets, device,
                                                       time_fn=time_fn)
                in_graphs = isinstance(time_fn, GraphTimer) and time_fn.in_graphs
                timing = "as CUDA graph replays" if in_graphs else "as eager launches"
                del attention, time_fn
                torch.cuda.empty_cache()
        else:
            measure_fn = measure_fn or target_attention_timer(
                vllm_config, 1 + max_budget, device, adaptive_shapes=adaptive_shapes)
            table, plain = measure_attention_costs(measure_fn, contexts, budgets, device)
        num_layers = model_config.get_num_layers(parallel)
        tp_group = None
        if parallel.tensor_parallel_size > 1:
            from vllm.distributed.parallel_state import get_tp_group

            tp_group = get_tp_group()
        logger.info(
            "DDTree auto budget: candidates %s, %d target layers; verify attention per "
            "request (its share of a batch's launch) and layer (us), timed %s in %.2f s:\n%s",
            budgets, num_layers, timing, time.perf_counter() - start, format_table(table),
        )
        return cls(table, num_layers, tp_group=tp_group, plain_attention=plain)


def _adaptive_verify_shapes(vllm_config: Any) -> bool:
    """Whether the run verifies adaptive shapes (``ddtree_verify_shape`` resolved to
    "adaptive"): a round of budget ``b`` then verifies ``1 + b`` rows, and the
    speculator sets the MLA backend's ``TREE_MASK_STATE.mostly_active``, which picks the
    verify kernel on sm_90, so the start-up timing must launch those rows with it too.
    False without a DDTree config."""
    from vllm_ddtree.runtime_state import ddtree_config_of

    ddtree = ddtree_config_of(getattr(vllm_config, "speculative_config", None))
    if ddtree is None:
        return False
    tp = vllm_config.parallel_config.tensor_parallel_size
    return ddtree.resolved_verify_shape(tp) == "adaptive"
