"""Refit a DFlash2 drafter's candidate selector alone, the rest of the drafter frozen.

Frozen, the drafter's block outputs do not change while the selector trains: for
``anchors_per_seq`` seeded anchors per greedy-pool sequence, its final-normed states and
the selector's targets (:func:`~vllm_ddtree.training.selector_loss.selector_targets`:
candidates, unary term, true predecessors, the truth's slot) are computed once
(:func:`frozen_selector_blocks`). Each step of :func:`train_selector` then draws
``batch_size * anchors_per_seq`` of those blocks and trains the selector's
cross-entropy on them, so a step costs the selector's forward and backward only, not the
drafter's (on the CPU about 0.2 s against about 7 s a step for 1,024 blocks of the
embedded drafter).

Why a refit: a DDTree tree at B = 64 ranks 64 candidates a position, a checkpoint's
selector may have been trained on its chain walk's ``selector_top_k`` only
(:mod:`vllm_ddtree.training.selector_loss`). ``evals/train_pair.py --selector-only``
runs it; everything but ``candidate_selector.*`` leaves the checkpoint unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_ddtree.training.common import (
    BestKeeper,
    StepPlan,
    TrainLog,
    flush_losses,
    host_to_device,
    progress_bar,
    run_step_loop,
)
from vllm_ddtree.training.drafter_forward import block_labels, drafter_block_outputs
from vllm_ddtree.training.selector_loss import (
    SelectorTargets,
    selector_cross_entropy,
    selector_targets,
)
from vllm_ddtree.training.train_drafter import DrafterTrainConfig, GreedyPool, sample_anchors
from vllm_ddtree.training.train_target import autocast_for

__all__ = ["SelectorBlocks", "evaluate_selector", "frozen_selector_blocks", "train_selector"]


@dataclass
class SelectorBlocks:
    """``N`` frozen drafter blocks of ``L`` depths: ``hidden`` fp32 ``[N, L, H]`` (the
    drafter's final-normed states) and their ``targets``
    (:class:`~vllm_ddtree.training.selector_loss.SelectorTargets`, leading shape
    ``[N]``; the candidate ids kept as int32)."""

    hidden: torch.Tensor
    targets: SelectorTargets

    def __len__(self) -> int:
        return self.hidden.shape[0]

    def take(self, idx: torch.Tensor) -> tuple[torch.Tensor, SelectorTargets]:
        """Blocks ``idx`` (int64 ``[n]``): (hidden ``[n, L, H]``, targets ``[n, L, ...]``)."""
        t = self.targets
        return self.hidden[idx], SelectorTargets(
            t.candidate_ids[idx].to(torch.int64), t.unary[idx], t.previous[idx],
            t.slot[idx], t.covered[idx])


@torch.no_grad()
def frozen_selector_blocks(drafter, target, pool: GreedyPool, anchors_per_seq: int,
                           cfg: DrafterTrainConfig, seed: int, progress: bool = True,
                           desc: str = "frozen blocks") -> SelectorBlocks:
    """The :class:`SelectorBlocks` of ``anchors_per_seq`` anchors per sequence of
    ``pool`` (drawn as training draws them, from a generator seeded with ``seed``),
    scoring ``cfg.selector_candidates`` candidates a depth (None: the drafter's
    ``selector_top_k``; at most V); ``cfg.batch_size`` sequences a drafter pass."""
    if len(pool) == 0:
        raise ValueError("frozen_selector_blocks: the pool holds no sequence")
    device = pool.tokens.device
    was_training = drafter.training
    drafter.eval()
    gen = torch.Generator().manual_seed(seed)
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    k = cfg.selector_candidates or drafter.selector_top_k
    blocks: SelectorBlocks | None = None  # filled in place: no second copy at the end
    bar = progress_bar(len(pool), desc, progress)
    for start in range(0, len(pool), cfg.batch_size):
        rows = torch.arange(start, min(len(pool), start + cfg.batch_size))
        anchors = sample_anchors(pool.prefix_len[rows], cfg.seq_len, drafter.block_size,
                                 anchors_per_seq, gen, end=pool.ends(rows))
        rows, anchors = host_to_device(rows, device), host_to_device(anchors, device)
        tokens = pool.tokens[rows]
        with autocast_for(device):
            hidden, logits = drafter_block_outputs(drafter, tokens, pool.aux[rows], anchors,
                                                   embed, lm_head)
        t = selector_targets(logits, torch.gather(tokens, 1, anchors),
                             block_labels(tokens, anchors, drafter.block_size),
                             min(k, logits.shape[-1]))
        part = SelectorBlocks(hidden.float().flatten(0, 1), SelectorTargets(
            t.candidate_ids.to(torch.int32).flatten(0, 1), t.unary.flatten(0, 1),
            t.previous.flatten(0, 1), t.slot.flatten(0, 1), t.covered.flatten(0, 1)))
        if blocks is None:
            blocks = _empty_like(part, len(pool) * anchors_per_seq)
        first = start * anchors_per_seq
        _fill(blocks, part, first)
        bar.update(len(rows))
    bar.close()
    drafter.train(was_training)
    return blocks


_TARGET_FIELDS = ("candidate_ids", "unary", "previous", "slot", "covered")


def _empty_like(part: SelectorBlocks, num_blocks: int) -> SelectorBlocks:
    def empty(x: torch.Tensor) -> torch.Tensor:
        return x.new_empty((num_blocks, *x.shape[1:]))
    return SelectorBlocks(empty(part.hidden), SelectorTargets(
        *(empty(getattr(part.targets, f)) for f in _TARGET_FIELDS)))


def _fill(blocks: SelectorBlocks, part: SelectorBlocks, first: int) -> None:
    end = first + len(part)
    blocks.hidden[first:end] = part.hidden
    for f in _TARGET_FIELDS:
        getattr(blocks.targets, f)[first:end] = getattr(part.targets, f)


@torch.no_grad()
def evaluate_selector(selector, blocks: SelectorBlocks, chunk: int = 1024) -> dict:
    """Cross-entropy over every covered depth of ``blocks`` and the teacher-forced
    stats of :func:`~vllm_ddtree.training.selector_loss.selector_cross_entropy`
    (``sel_cover``, ``sel_acc``, ``sel_tau``), over all blocks, ``chunk`` at a time."""
    loss_sum = covered = right = tau_sum = depths = 0.0
    for start in range(0, len(blocks), chunk):
        idx = torch.arange(start, min(len(blocks), start + chunk), device=blocks.hidden.device)
        hidden, targets = blocks.take(idx)
        loss, stats = selector_cross_entropy(selector, hidden, targets)
        n_cov = float(targets.covered.sum())
        loss_sum += float(loss) * n_cov
        covered += n_cov
        right += float(stats["sel_acc"]) * n_cov
        tau_sum += float(stats["sel_tau"]) * len(idx)
        depths += targets.covered.numel()
    return {"loss": loss_sum / max(covered, 1.0), "sel_cover": covered / max(depths, 1.0),
            "sel_acc": right / max(covered, 1.0), "sel_tau": tau_sum / max(len(blocks), 1)}


def train_selector(drafter, train_blocks: SelectorBlocks, eval_blocks: SelectorBlocks | None,
                   cfg: DrafterTrainConfig, progress: bool = True) -> TrainLog:
    """Train ``drafter.candidate_selector`` in place on ``train_blocks``
    (:func:`frozen_selector_blocks`); no other parameter changes. Optimizer, schedule
    and step plan as :func:`~vllm_ddtree.training.train_drafter.train_drafter`
    (``cfg.lr``, ``cfg.weight_decay``, ``cfg.steps`` or ``cfg.minutes``); a step draws
    ``cfg.batch_size * cfg.anchors_per_seq`` blocks. ``eval_blocks`` is evaluated
    every ``cfg.eval_every`` steps (``TrainLog.extra``: ``eval_init``, ``eval_last``,
    ``eval_kept``, ``eval_tau``); with ``cfg.keep_best`` the selector ends with the
    weights of the lowest validation cross-entropy."""
    selector = drafter.candidate_selector
    device = train_blocks.hidden.device
    selector.to(device).train()
    params = list(selector.parameters())
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas,
                            weight_decay=cfg.weight_decay, fused=device.type == "cuda")
    plan = StepPlan(cfg.steps, cfg.minutes, cfg.max_steps, device)
    log = TrainLog()
    log.extra["eval_tau"] = {"steps": [], "values": [],
                             "label": "validation tau (selector, teacher forced)"}
    if eval_blocks is not None:
        log.extra["eval_init"] = evaluate_selector(selector, eval_blocks)
    best = BestKeeper()
    gen = torch.Generator().manual_seed(cfg.seed)
    blocks_per_step = cfg.batch_size * cfg.anchors_per_seq
    pending: list[torch.Tensor] = []
    taus: list[torch.Tensor] = []
    bar = progress_bar(plan.total, "selector", progress)

    def flush(step: int) -> None:
        flush_losses(step, pending, taus, log, bar, "sel_tau")

    def evaluate(step: int) -> None:
        if eval_blocks is None:
            return
        res = evaluate_selector(selector, eval_blocks)
        log.record_eval(step, res, res["sel_tau"], best if cfg.keep_best else None, selector)

    def compute_loss() -> torch.Tensor:
        idx = torch.randint(0, len(train_blocks), (blocks_per_step,), generator=gen)
        hidden, targets = train_blocks.take(host_to_device(idx, device))
        loss, stats = selector_cross_entropy(selector, hidden, targets)
        taus.append(stats["sel_tau"])
        return loss

    step = run_step_loop(plan, cfg, opt, params, compute_loss, pending, bar, flush,
                         evaluate, log)
    log.extra["blocks_seen"] = step * blocks_per_step
    log.extra["kept_step"] = best.step if best.restore(selector) else step
    selector.eval()
    return log
