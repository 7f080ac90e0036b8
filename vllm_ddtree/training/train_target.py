"""Next-token training of the MLA target (``DeepseekV3ForCausalLM``).

Random ``seq_len + 1`` windows of the flat train token array, AdamW, linear warmup
+ cosine LR, gradient clipping, bf16 autocast on CUDA (fp32 master weights).
Batches come from a seeded CPU generator, so a run with a fixed step count is
repeatable. The step count is capped by ``max_epochs`` passes over the train
tokens (the corpus is small: a time budget alone would repeat it hundreds of
times on a GPU); the weights with the lowest validation loss (evaluated every
``eval_every`` steps) are kept. ``evaluate_nll`` gives the loss / perplexity.
"""

from __future__ import annotations

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
    toks = torch.as_tensor(np.asarray(tokens, dtype=np.int64))
    n_windows = (toks.shape[0] - 1) // seq_len
    if max_windows is not None:
        n_windows = min(n_windows, max_windows)
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    ctx = autocast_for(device) if amp else nullcontext()
    for start in range(0, n_windows, batch_size):
        idx = torch.arange(start, min(n_windows, start + batch_size))
        rows = idx[:, None] * seq_len + torch.arange(seq_len + 1)
        windows = toks[rows].to(device)
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
) -> TrainLog:
    """Train ``model`` in place on ``train_tokens`` (flat ``uint16``/int array).

    ``eval_tokens`` (the validation split) is evaluated every ``cfg.eval_every``
    steps on its first ``cfg.eval_windows`` windows; with ``cfg.keep_best`` the
    model ends with the weights of the lowest such loss. Returns the ``TrainLog``.
    """
    device = torch.device(device)
    model.to(device).train()
    tokens = torch.as_tensor(np.asarray(train_tokens, dtype=np.int64), device=device)
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
        if cfg.keep_best:
            best.update(model, nll, step)

    def compute_loss() -> torch.Tensor:
        windows = sample_windows(tokens, cfg.batch_size, cfg.seq_len + 1, gen)
        with autocast_for(device):
            return lm_loss(model, windows)

    step = run_step_loop(plan, cfg, opt, list(model.parameters()), compute_loss, pending, bar,
                         flush, evaluate, log)
    log.extra["tokens_seen"] = step * cfg.batch_size * cfg.seq_len
    log.extra["train_epochs"] = log.extra["tokens_seen"] / max(1, len(train_tokens))
    log.extra["kept_step"] = best.step if best.restore(model) else step
    log.extra["kept_eval_loss"] = best.loss if best.step is not None else None
    model.eval()
    return log
