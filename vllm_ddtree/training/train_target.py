"""Next-token training of the MLA target (``DeepseekV3ForCausalLM``).

Random ``seq_len + 1`` windows of the flat train token array, AdamW, linear warmup
+ cosine LR, gradient clipping, bf16 autocast on CUDA (fp32 master weights).
Batches come from a seeded CPU generator, so a run with a fixed step count is
repeatable. The step count is capped by ``max_epochs`` passes over the train
tokens (the corpus is small: a time budget alone would repeat it hundreds of
times on a GPU); the weights with the lowest validation loss (evaluated every
``eval_every`` steps) are kept. ``evaluate_nll`` gives the loss / perplexity.

A fine-tune that teaches exact answers (``training.synthetic``) selects on those instead:
given an ``AnswerSet`` and ``valid_slack``, it keeps the weights of the lowest answer
loss among the evaluations whose validation loss on ``slack_seq_len``-token windows
stays within ``valid_slack`` nats of the starting weights' (evaluated before the first
step): what the fine-tune adds, at no more than that cost to the code it was trained
on, measured at the windows the starting weights were trained on (a fine-tune on
longer windows lowers the loss at long range whatever it does at short range).

Such a fine-tune also moves the target's code distribution, and with it what a drafter
can predict: the exact-answer mix at 0.03 nats of code loss cost the embedded pair a
third of its tokens per round on code (a drafter retrained on the new target's own
greedy text included). ``anchor_weight`` adds ``anchor_weight * KL(start || model)``
on windows of code only (``anchor_tokens``, ``anchor_seq_len`` tokens, the windows
the starting weights were trained on) to every step's loss: the fine-tune learns the
answers while its code predictions stay the starting weights'. The evaluations then
also log that KL on the validation split (``extra["anchor_kls"]``).
"""

from __future__ import annotations

import copy
import math
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from vllm_ddtree.training.common import (
    BestKeeper,
    StepLoopConfig,
    StepPlan,
    TrainLog,
    host_to_device,
    progress_bar,
    run_step_loop,
)


@dataclass
class TargetTrainConfig(StepLoopConfig):
    seq_len: int = 512
    batch_size: int = 64
    max_epochs: float | None = 30.0  # caps the steps at this many passes over the data
    eval_windows: int = 64  # validation windows per periodic evaluation
    valid_slack: float | None = None  # with an AnswerSet: selection on answers, see above
    slack_seq_len: int | None = None  # windows of the slack's validation loss (seq_len)
    anchor_weight: float | None = None  # KL to the starting weights on code, see above
    anchor_seq_len: int | None = None  # windows of the anchor's KL (seq_len)


@dataclass
class AnswerSet:
    """Held-out prompts with exact answers, right-padded into one batch.

    ``tokens [N, L]`` int64 (prompt then answer, then padding), ``answer_mask [N, L - 1]``
    bool: True where the next token (``tokens[:, 1:]``) is an answer token."""

    tokens: torch.Tensor
    answer_mask: torch.Tensor

    @classmethod
    def from_pairs(cls, pairs: list[tuple[list[int], list[int]]], pad_id: int) -> AnswerSet:
        """From ``(prompt ids, answer ids)`` pairs (each part non-empty)."""
        if not pairs or any(not p or not a for p, a in pairs):
            raise ValueError("an AnswerSet needs at least one pair, each with a non-empty "
                             "prompt and answer")
        length = max(len(p) + len(a) for p, a in pairs)
        tokens = torch.full((len(pairs), length), pad_id, dtype=torch.int64)
        mask = torch.zeros((len(pairs), length - 1), dtype=torch.bool)
        for i, (p, a) in enumerate(pairs):
            tokens[i, : len(p) + len(a)] = torch.tensor(p + a)
            mask[i, len(p) - 1 : len(p) + len(a) - 1] = True
        return cls(tokens, mask)


@torch.no_grad()
def answer_nll(model, answers: AnswerSet, batch_size: int = 64,
               device: torch.device | str | None = None) -> float:
    """Mean NLL (nats) of the answer tokens of ``answers``, teacher-forced."""
    device = torch.device(device or next(model.parameters()).device)
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for start in range(0, answers.tokens.shape[0], batch_size):
        tokens = answers.tokens[start : start + batch_size].to(device)
        mask = answers.answer_mask[start : start + batch_size].to(device)
        with autocast_for(device):
            logits = model(input_ids=tokens[:, :-1]).logits
        nll = F.cross_entropy(logits.float().transpose(1, 2), tokens[:, 1:], reduction="none")
        total += float(nll[mask].sum())
        count += int(mask.sum())
    model.train(was_training)
    return total / count


def autocast_for(device: torch.device):
    """bf16 autocast on CUDA, nothing elsewhere."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return nullcontext()


def sample_windows(
    tokens: torch.Tensor, batch_size: int, length: int, gen: torch.Generator
) -> torch.Tensor:
    """``[batch_size, length]`` int64 windows at uniform random starts of the flat
    ``tokens [N]`` (on any device); starts drawn from the CPU generator ``gen``."""
    starts = torch.randint(0, tokens.shape[0] - length + 1, (batch_size,), generator=gen)
    starts = host_to_device(starts, tokens.device)
    idx = starts[:, None] + torch.arange(length, device=tokens.device)
    return tokens[idx]


def lm_loss(model, windows: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy (fp32) of ``windows [B, T+1]``."""
    logits = model(input_ids=windows[:, :-1]).logits
    return F.cross_entropy(logits.float().flatten(0, 1), windows[:, 1:].flatten())


def anchor_kl(model, anchor, windows: torch.Tensor) -> torch.Tensor:
    """Mean over the tokens of ``windows [B, T]`` (int64) of ``KL(anchor || model)``
    between their next-token distributions, fp32 (gradient through ``model`` only)."""
    with torch.no_grad():
        ref = F.log_softmax(anchor(input_ids=windows).logits.float(), dim=-1)
    cur = F.log_softmax(model(input_ids=windows).logits.float(), dim=-1)
    return F.kl_div(cur, ref, log_target=True, reduction="none").sum(-1).mean()


def consecutive_windows(tokens: np.ndarray | torch.Tensor, seq_len: int, overlap: int,
                        batch_size: int, max_windows: int | None, device: torch.device):
    """Batches ``[b, seq_len + overlap]`` int64 (on ``device``) of the windows starting
    every ``seq_len`` tokens of the flat ``tokens``, at most ``max_windows`` of them."""
    toks = torch.as_tensor(np.asarray(tokens, dtype=np.int64))
    n_windows = (toks.shape[0] - overlap) // seq_len
    if max_windows is not None:
        n_windows = min(n_windows, max_windows)
    for start in range(0, n_windows, batch_size):
        idx = torch.arange(start, min(n_windows, start + batch_size))
        yield toks[idx[:, None] * seq_len + torch.arange(seq_len + overlap)].to(device)


@torch.no_grad()
def evaluate_anchor_kl(model, anchor, tokens: np.ndarray | torch.Tensor, seq_len: int,
                       batch_size: int = 32, max_windows: int | None = None,
                       device: torch.device | str | None = None) -> float:
    """:func:`anchor_kl` over consecutive ``seq_len``-token windows of ``tokens``."""
    device = torch.device(device or next(model.parameters()).device)
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for windows in consecutive_windows(tokens, seq_len, 0, batch_size, max_windows, device):
        with autocast_for(device):
            total += float(anchor_kl(model, anchor, windows)) * windows.numel()
        count += windows.numel()
    model.train(was_training)
    return total / max(1, count)


@torch.no_grad()
def evaluate_nll(
    model,
    tokens: np.ndarray | torch.Tensor,
    seq_len: int,
    batch_size: int = 32,
    max_windows: int | None = None,
    device: torch.device | str | None = None,
    amp: bool = True,
) -> tuple[float, int]:
    """Mean next-token NLL (nats) and number of predicted tokens over consecutive,
    non-overlapping windows of ``seq_len + 1`` tokens (each window predicts
    ``seq_len`` tokens; the first token of a window has no earlier context)."""
    device = torch.device(device or next(model.parameters()).device)
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    ctx = autocast_for(device) if amp else nullcontext()
    for windows in consecutive_windows(tokens, seq_len, 1, batch_size, max_windows, device):
        with ctx:
            logits = model(input_ids=windows[:, :-1]).logits
        nll = F.cross_entropy(
            logits.float().flatten(0, 1), windows[:, 1:].flatten(), reduction="sum"
        )
        total += float(nll)
        count += windows[:, 1:].numel()
    model.train(was_training)
    return total / max(1, count), count


def perplexity(nll: float) -> float:
    return float(math.exp(nll))


def max_steps_for(cfg: TargetTrainConfig, num_tokens: int) -> int:
    """``cfg.max_steps``, lowered to ``cfg.max_epochs`` passes over ``num_tokens``."""
    steps = cfg.max_steps
    if cfg.max_epochs is not None:
        per_step = cfg.batch_size * cfg.seq_len
        steps = min(steps, max(1, math.ceil(cfg.max_epochs * num_tokens / per_step)))
    return steps


def train_target(
    model,
    train_tokens: np.ndarray,
    eval_tokens: np.ndarray | None,
    cfg: TargetTrainConfig,
    device: torch.device | str,
    progress: bool = True,
    answers: AnswerSet | None = None,
    anchor_tokens: np.ndarray | None = None,
) -> TrainLog:
    """Train ``model`` in place on ``train_tokens`` (flat ``uint16``/int array).

    ``eval_tokens`` (the validation split) is evaluated every ``cfg.eval_every``
    steps on its first ``cfg.eval_windows`` windows; with ``cfg.keep_best`` the
    model ends with the weights of the lowest such loss. With ``answers`` (and
    ``cfg.valid_slack`` and ``eval_tokens``) every evaluation also scores the answers,
    the starting weights are evaluated first, and the kept weights are those of the
    lowest answer loss whose validation loss is within ``cfg.valid_slack`` of the
    start's (module docstring). Returns the ``TrainLog``; ``extra["answer_losses"]``
    runs beside ``eval_losses`` then. With ``cfg.anchor_weight`` every step adds the KL
    to the starting weights on a batch of ``anchor_tokens`` (flat, code only) windows.
    """
    on_answers = answers is not None
    if on_answers and (cfg.valid_slack is None or eval_tokens is None):
        raise ValueError("selection on answers needs valid_slack and eval_tokens: the "
                         "validation loss bounds what the answers may cost")
    anchored = bool(cfg.anchor_weight)
    anchor_len = cfg.anchor_seq_len or cfg.seq_len
    if cfg.anchor_weight is not None and not cfg.anchor_weight >= 0:
        raise ValueError(f"anchor_weight={cfg.anchor_weight!r} is not allowed: a KL "
                         "weight >= 0 (0 or None: no anchor)")
    if anchored and (anchor_tokens is None or len(anchor_tokens) <= anchor_len):
        raise ValueError(f"anchor_weight={cfg.anchor_weight} needs anchor_tokens (code "
                         f"only) longer than anchor_seq_len={anchor_len}, got "
                         f"{None if anchor_tokens is None else len(anchor_tokens)} tokens")
    device = torch.device(device)
    model.to(device).train()
    tokens = torch.as_tensor(np.asarray(train_tokens, dtype=np.int64), device=device)
    anchor = code = None
    if anchored:  # the starting weights, frozen
        anchor = copy.deepcopy(model).eval().requires_grad_(False)
        code = torch.as_tensor(np.asarray(anchor_tokens, dtype=np.int64), device=device)
        # a quarter of a step's tokens: the KL needs no more to hold the distribution,
        # and the steps stay within a third longer
        anchor_rows = max(1, cfg.batch_size * cfg.seq_len // (4 * anchor_len))
    gen = torch.Generator().manual_seed(cfg.seed)
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.dim() >= 2 and "embed" not in name else no_decay).append(p)
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=cfg.lr,
        betas=cfg.betas,
        fused=device.type == "cuda",
    )
    plan = StepPlan(cfg.steps, cfg.minutes, max_steps_for(cfg, len(train_tokens)), device)
    log = TrainLog()
    best = BestKeeper()
    pending: list[torch.Tensor] = []
    bar = progress_bar(plan.total, "target", progress)

    def flush(step: int) -> None:
        if pending:
            vals = torch.stack(pending).tolist()
            first = step - len(vals) + 1
            log.steps.extend(range(first, step + 1))
            log.losses.extend(vals)
            pending.clear()
            bar.set_postfix(loss=f"{vals[-1]:.3f}")

    def evaluate(step: int) -> None:
        if eval_tokens is None:
            return
        nll, _ = evaluate_nll(
            model, eval_tokens, cfg.seq_len, max_windows=cfg.eval_windows, device=device
        )
        log.eval_steps.append(step)
        log.eval_losses.append(nll)
        score = nll
        if on_answers:
            score = answer_nll(model, answers, device=device)
            log.extra.setdefault("answer_losses", []).append(score)
            short = nll
            if cfg.slack_seq_len not in (None, cfg.seq_len):
                short, _ = evaluate_nll(model, eval_tokens, cfg.slack_seq_len,
                                        max_windows=cfg.eval_windows, device=device)
            shorts = log.extra.setdefault("slack_eval_losses", [])
            shorts.append(short)
            if short > shorts[0] + cfg.valid_slack:
                score = math.inf  # the code loss rose too far: not a candidate
        if anchored:
            log.extra.setdefault("anchor_kls", []).append(evaluate_anchor_kl(
                model, anchor, eval_tokens, anchor_len, max_windows=cfg.eval_windows,
                device=device))
        if cfg.keep_best:
            best.update(model, score, step)

    def compute_loss() -> torch.Tensor:
        windows = sample_windows(tokens, cfg.batch_size, cfg.seq_len + 1, gen)
        with autocast_for(device):
            loss = lm_loss(model, windows)
            if anchored:
                loss = loss + cfg.anchor_weight * anchor_kl(
                    model, anchor, sample_windows(code, anchor_rows, anchor_len, gen))
            return loss

    if on_answers:
        evaluate(0)  # the starting weights: the validation loss's bound, a candidate too
    step = run_step_loop(plan, cfg, opt, list(model.parameters()), compute_loss, pending, bar,
                         flush, evaluate, log)
    log.extra["tokens_seen"] = step * cfg.batch_size * cfg.seq_len
    log.extra["train_epochs"] = log.extra["tokens_seen"] / max(1, len(train_tokens))
    log.extra["kept_step"] = best.step if best.restore(model) else step
    kept = log.eval_steps.index(best.step) if best.step is not None else None
    log.extra["kept_eval_loss"] = log.eval_losses[kept] if kept is not None else None
    if on_answers:
        log.extra["kept_answer_loss"] = (log.extra["answer_losses"][kept]
                                         if kept is not None else None)
    model.eval()
    return log
