"""Shared pieces of the training scripts: seeding, LR schedule, step planning,
checkpoints and loss plots."""

from __future__ import annotations

import copy
import math
import random
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm


def progress_bar(total: int | None, desc: str, enabled: bool = True) -> tqdm:
    """A tqdm bar on stderr; redrawn at most every 15 s when stderr is not a
    terminal (captured logs stay short)."""
    interval = 0.5 if sys.stderr.isatty() else 15.0
    return tqdm(
        total=total, desc=desc, disable=not enabled, mininterval=interval, dynamic_ncols=True
    )


def host_to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a small CPU tensor to ``device`` without stalling the CUDA stream
    (pinned memory, non-blocking), so the host can queue the next step."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and CUDA)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def cosine_lr(step: int, total: int, peak: float, warmup: int, min_ratio: float) -> float:
    """Linear warmup over ``warmup`` steps, then cosine decay to ``min_ratio * peak``
    at ``total``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


@dataclass
class StepLoopConfig:
    """Optimizer and loop settings both trainers share (``run_step_loop``, ``StepPlan``)."""

    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    steps: int | None = None  # fixed step count; None: as many as fit in `minutes`
    minutes: float = 3.0
    max_steps: int = 20000
    keep_best: bool = True  # restore the weights of the best validation loss
    log_every: int = 10
    eval_every: int = 250
    seed: int = 0


def flush_losses(step: int, pending: list, taus: list, log, bar: tqdm, tau_name: str) -> None:
    """Move the losses of the steps since the last flush (``pending``, scalar tensors,
    ending at ``step``) into ``log`` and show the last one and the mean of ``taus`` on
    ``bar`` as ``tau_name``; one host read for each list. Both lists end empty."""
    if not pending:
        return
    vals = torch.stack(pending).tolist()
    log.steps.extend(range(step - len(vals) + 1, step + 1))
    log.losses.extend(vals)
    tau = float(torch.stack(taus).mean())
    pending.clear()
    taus.clear()
    bar.set_postfix({"loss": f"{vals[-1]:.3f}", tau_name: f"{tau:.2f}"})


def run_step_loop(plan, cfg, opt, params, compute_loss, pending: list, bar: tqdm,
                  flush, evaluate, log) -> int:
    """The optimizer loop both trainers share; returns the number of steps taken.

    ``cfg`` is a ``StepLoopConfig``; ``params`` an iterable of the parameters to clip.
    Each step: cosine LR (``cfg.lr``,
    ``cfg.warmup_steps``, ``cfg.min_lr_ratio``),
    ``compute_loss()`` (a scalar tensor; the caller samples its batch there), backward,
    clipping at ``cfg.grad_clip``, optimizer step, ``pending.append(loss)``; then the
    progress bar, ``flush(step)`` every ``cfg.log_every`` and ``evaluate(step)`` every
    ``cfg.eval_every`` steps, until ``plan`` (a ``StepPlan``) says stop. Ends with a
    final flush and evaluation and fills ``log``'s step count and timing.
    """
    # a generator (model.parameters()) would be spent by the first clip_grad_norm_
    params = list(params)
    plan.start()
    step = 0
    while not plan.finished(step):
        lr = cosine_lr(step, plan.horizon(), cfg.lr, cfg.warmup_steps, cfg.min_lr_ratio)
        for group in opt.param_groups:
            group["lr"] = lr
        loss = compute_loss()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        pending.append(loss.detach())
        step += 1
        plan.after_step(step)
        if bar.total != plan.total:
            bar.total = plan.total
        bar.update(1)
        if step % cfg.log_every == 0:
            flush(step)
        if step % cfg.eval_every == 0:
            evaluate(step)
    flush(step)
    if not log.eval_steps or log.eval_steps[-1] != step:
        evaluate(step)
    bar.close()
    log.total_steps = step
    log.seconds = plan.elapsed()
    log.stopped_by_clock = plan.stopped_by_clock
    return step


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class StepPlan:
    """How many optimizer steps a run takes.

    With ``steps`` set, exactly that many (reproducible: same seed, same steps,
    same batches). Otherwise the run times steps ``calib_start..calib_end`` and
    fixes ``total = min(max_steps, steps that fit in minutes)``; the chosen total
    is logged so that a rerun with ``steps=total`` repeats the run. The LR
    schedule's horizon is ``total`` once known (calibration ends inside the
    warmup, whose LR does not depend on it). A run without ``steps`` also stops
    when the wall clock passes ``hard_factor * minutes`` (then the log says so).
    """

    steps: int | None
    minutes: float
    max_steps: int
    device: torch.device
    calib_start: int = 5
    calib_end: int = 25
    overhead: float = 1.08  # evals and logging between steps
    hard_factor: float = 1.25
    total: int | None = None
    stopped_by_clock: bool = False
    _t0: float = 0.0
    _t_calib: float = 0.0

    def __post_init__(self):
        if self.steps is not None:
            self.total = int(self.steps)
        elif self.max_steps <= self.calib_end:
            self.total = int(self.max_steps)

    def start(self) -> None:
        _sync(self.device)
        self._t0 = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self._t0

    def horizon(self) -> int:
        """The LR schedule's last step (``max_steps`` until calibration ends)."""
        return self.total if self.total is not None else self.max_steps

    def after_step(self, done: int) -> None:
        """Call after ``done`` steps have completed."""
        if self.total is not None:
            return
        if done == self.calib_start:
            _sync(self.device)
            self._t_calib = time.perf_counter()
        elif done == self.calib_end:
            _sync(self.device)
            per_step = (time.perf_counter() - self._t_calib) / (self.calib_end - self.calib_start)
            left = self.minutes * 60.0 - self.elapsed()
            fit = done + int(max(0.0, left) / (per_step * self.overhead))
            self.total = max(done, min(self.max_steps, fit))

    def finished(self, done: int) -> bool:
        if self.total is not None and done >= self.total:
            return True
        # Fixed steps are a reproduction: exactly that many, whatever the clock says.
        if self.steps is None and self.elapsed() > self.hard_factor * self.minutes * 60.0:
            self.stopped_by_clock = True
            return True
        return False


class BestKeeper:
    """Keeps a copy of the weights (``state_dict``) with the lowest evaluation loss."""

    def __init__(self):
        self.loss = math.inf
        self.step: int | None = None
        self.state: dict | None = None

    def update(self, model, loss: float, step: int) -> None:
        if loss < self.loss:
            self.loss, self.step = loss, step
            self.state = {k: v.detach().clone() for k, v in model.state_dict().items()}

    def restore(self, model) -> bool:
        """Load the best weights into ``model``; False when there were none."""
        if self.state is None:
            return False
        model.load_state_dict(self.state)
        return True


@dataclass
class TrainLog:
    """Per-step training loss and periodic evaluation of one run."""

    steps: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    eval_steps: list[int] = field(default_factory=list)
    eval_losses: list[float] = field(default_factory=list)
    extra: dict = field(default_factory=dict)
    total_steps: int = 0
    seconds: float = 0.0
    stopped_by_clock: bool = False

    def record_eval(self, step: int, res: dict, tau: float, best: BestKeeper | None,
                    model) -> None:
        """Log one evaluation (``res`` with its ``"loss"``; ``tau`` on the ``eval_tau``
        curve); with ``best`` (keep-best runs) keep ``model``'s weights when the loss is
        the lowest so far."""
        self.eval_steps.append(step)
        self.eval_losses.append(res["loss"])
        self.extra["eval_tau"]["steps"].append(step)
        self.extra["eval_tau"]["values"].append(tau)
        self.extra["eval_last"] = res
        if best is not None and res["loss"] < best.loss:
            best.update(model, res["loss"], step)
            self.extra["eval_kept"] = res

    def final_loss(self, last: int = 50) -> float:
        """Mean training loss over the last ``last`` logged steps."""
        tail = self.losses[-last:]
        return float(sum(tail) / max(1, len(tail)))

    def to_dict(self) -> dict:
        return {
            "total_steps": self.total_steps,
            "seconds": round(self.seconds, 2),
            "stopped_by_clock": self.stopped_by_clock,
            "final_train_loss": self.final_loss(),
            "eval_steps": self.eval_steps,
            "eval_losses": self.eval_losses,
            **self.extra,
        }


def save_checkpoint(
    model, out_dir: str | Path, tokenizer_dir: str | Path | None = None, dtype=torch.bfloat16
) -> int:
    """Save a copy of ``model`` in ``dtype`` as a Hugging Face checkpoint
    (``config.json``, ``model.safetensors``) plus the other files of ``tokenizer_dir``
    (its tokenizer; e.g. a corpus's ``tokenizer/`` or another checkpoint); returns the
    directory's size in bytes. ``model`` itself is not changed."""
    out_dir = Path(out_dir)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    cpu_copy = copy.deepcopy(model).to(device="cpu", dtype=dtype)
    cpu_copy.save_pretrained(str(out_dir), safe_serialization=True)
    if tokenizer_dir is not None:
        # never over the weights and config just written (a checkpoint directory given
        # as the tokenizer's would put its own weights back)
        for f in sorted(Path(tokenizer_dir).iterdir()):
            if f.is_file() and not (out_dir / f.name).exists():
                shutil.copy2(f, out_dir / f.name)
    return dir_size(out_dir)


def load_drafter(path: str | Path, dtype=torch.float32, device="cpu"):
    """The drafter at ``path`` (``DFlashDraftModel``, or ``DFlash2DraftModel`` when its
    config.json names it) in ``dtype`` on ``device``, eval mode."""
    from vllm_ddtree.drafter_config import is_dflash2, read_drafter_config_json
    from vllm_ddtree.reference.dflash2 import DFlash2DraftModel
    from vllm_ddtree.reference.drafter import DFlashDraftModel

    cls = DFlash2DraftModel if is_dflash2(read_drafter_config_json(path)) else DFlashDraftModel
    return cls.from_pretrained(str(path), dtype=dtype).to(device).eval()


def dir_size(path: str | Path) -> int:
    """Total size in bytes of the files under ``path``."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def smooth(values: list[float], weight: float = 0.9) -> list[float]:
    """Bias-corrected exponential moving average."""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc = weight * acc + (1 - weight) * v
        out.append(acc / (1 - weight ** (i + 1)))
    return out


def plot_losses(path: str | Path, log: TrainLog, title: str, extra_axis: str | None = None):
    """PNG of the training loss (raw and smoothed), the validation loss and the
    step whose weights were kept.

    ``extra_axis`` names a ``log.extra`` series ``{"steps": [...], "values": [...]}``
    drawn on a second y axis (e.g. the drafter's acceptance length)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(log.steps, log.losses, color="tab:blue", alpha=0.25, lw=0.8)
    weight = 0.9 if len(log.losses) < 500 else 0.98
    ax.plot(log.steps, smooth(log.losses, weight), color="tab:blue", lw=1.5, label="train (EMA)")
    if log.eval_steps:
        ax.plot(log.eval_steps, log.eval_losses, "o-", color="tab:orange", ms=3, label="validation")
    if log.extra.get("kept_step") is not None:
        ax.axvline(log.extra["kept_step"], color="gray", ls=":", lw=1, label="kept checkpoint")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if extra_axis and log.extra.get(extra_axis):
        series = log.extra[extra_axis]
        ax2 = ax.twinx()
        (h,) = ax2.plot(series["steps"], series["values"], "s--", color="tab:green", ms=3)
        ax2.set_ylabel(series.get("label", extra_axis))
        handles.append(h)
        labels.append(series.get("label", extra_axis))
    ax.legend(handles, labels, loc="upper right")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
