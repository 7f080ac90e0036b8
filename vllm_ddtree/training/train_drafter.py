"""DFlash drafter training on the frozen target's own greedy continuations.

Data. Random corpus prefixes (length ``prefix_min..prefix_max``) are continued
greedily by the frozen target (batched, KV-cached) up to ``seq_len`` tokens; one
causal target forward over ``prefix + continuation`` gives the aux hidden states
(``target_layer_ids`` outputs). Why greedy continuations and not teacher-forced
argmax labels on corpus text: at decoding time the drafter's context is the
*target's own* committed text and depth ``j`` must predict the target's greedy
token after the target's own tokens ``a+1..a+j-1``. Teacher forcing would label
depth ``j`` with ``argmax p(. | corpus[:a+j])``, which conditions on corpus tokens
the target would not have produced, so the labels of one block would not form a
single continuation wherever the target disagrees with the text. Continuations
match the decoding distribution exactly (context included); the cost is one
batched generation pass before training.

With ``continuation_max`` a sequence holds at most that many greedy tokens after its
prefix and is padded to ``seq_len`` (EOS); the padding is never a context position
or a label (anchors end ``block_size`` before the continuation does). Long corpus
contexts then cost only the continuation's decoding steps.

Training. Per sequence, ``anchors_per_seq`` distinct anchors ``a`` are drawn in
the continuation region (``prefix_len <= a <= end - block_size``, ``end`` =
prefix + continuation); block
``[token[a], MASK x (block_size-1)]`` at positions ``a..`` sees the context
positions ``< a`` (``drafter_forward``). Loss: cross-entropy of depth ``j``
against ``token[a+j]`` weighted by ``exp(-(j-1)/gamma)``. Embeddings and LM head
are the target's, frozen. Metric: the chain acceptance length ``tau`` (1 +
number of leading depths whose argmax equals the label), i.e. tokens committed
per DFlash round at that anchor.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from transformers import DynamicCache

from vllm_ddtree.patches.hf_mla_expand_kv import incremental_expand_kv
from vllm_ddtree.reference.drafter import DFlashDraftModel
from vllm_ddtree.training.common import (
    BestKeeper,
    StepLoopConfig,
    StepPlan,
    TrainLog,
    flush_losses,
    host_to_device,
    progress_bar,
    run_step_loop,
)
from vllm_ddtree.training.drafter_forward import (
    block_labels,
    drafter_block_outputs,
    target_aux_hidden,
)
from vllm_ddtree.training.selector_loss import selector_loss
from vllm_ddtree.training.train_target import autocast_for


@dataclass
class DrafterTrainConfig(StepLoopConfig):
    seq_len: int = 512
    prefix_min: int = 32
    prefix_max: int = 256
    gen_sequences: int = 12288
    gen_batch: int = 1024
    gen_minutes: float | None = 1.5  # stop generating new batches after this long
    continuation_max: int | None = None  # greedy tokens per sequence (None: to seq_len)
    eval_sequences: int = 128
    text_sequences: int = 0  # corpus-text rows added to the train pool (text_pool)
    batch_size: int = 32  # sequences per step
    anchors_per_seq: int = 32
    eval_anchors_per_seq: int = 16
    loss_gamma: float = 7.0
    # DFlash2: candidates the selector loss scores per depth; 64 = what a DDTree tree
    # ranks at B = 64 (selector_loss module docstring); None: the selector_top_k
    selector_candidates: int | None = 64
    weight_decay: float = 0.01  # (StepLoopConfig: 0.1)


@torch.no_grad()
def greedy_continue(target, prefix: torch.Tensor, num_new: int) -> torch.Tensor:
    """``[B, P + num_new]``: ``prefix [B, P]`` (int64) followed by the target's
    greedy (argmax) continuation, computed with a KV cache (MLA keys/values expanded
    once per position: ``vllm_ddtree.patches.hf_mla_expand_kv``)."""
    if num_new <= 0:
        return prefix
    cache = DynamicCache(config=target.config)
    with incremental_expand_kv(target):
        out = target(input_ids=prefix, past_key_values=cache, use_cache=True,
                     logits_to_keep=1)
        nxt = out.logits[:, -1].argmax(-1)
        new = [nxt]
        for _ in range(num_new - 1):
            out = target(input_ids=nxt[:, None], past_key_values=cache, use_cache=True)
            nxt = out.logits[:, -1].argmax(-1)
            new.append(nxt)
    return torch.cat([prefix, torch.stack(new, dim=1)], dim=1)


def stratified_prefix_lengths(prefix_min: int, prefix_max: int, num_batches: int,
                              gen: torch.Generator) -> list[int]:
    """One corpus-prefix length per generation batch: one uniform draw from each of
    ``num_batches`` equal strata of ``[prefix_min, prefix_max]``, in a random order.

    Anchors are drawn at or after a sequence's prefix, so the shortest prefix of the
    pool is the shortest context the drafter trains on. With long sequences a timed
    pool holds only a few batches (e.g. 3 at 1536 tokens), and independent
    draws left short contexts out; strata cover the range, and the random order keeps
    a pool cut by the clock spread over it."""
    edges = torch.linspace(prefix_min, prefix_max + 1, num_batches + 1, dtype=torch.float64)
    draws = edges[:-1] + torch.rand(num_batches, generator=gen, dtype=torch.float64) * (
        edges[1:] - edges[:-1])
    lengths = draws.floor().long().clamp(prefix_min, prefix_max)
    return lengths[torch.randperm(num_batches, generator=gen)].tolist()


def continuation_length(cfg: DrafterTrainConfig, prefix_len: int) -> int:
    """Tokens after a ``prefix_len``-token prefix in a pool row: up to ``cfg.seq_len``,
    at most ``cfg.continuation_max``."""
    span = cfg.seq_len - prefix_len
    return span if cfg.continuation_max is None else min(span, cfg.continuation_max)


def padding_token_id(target) -> int:
    """The token that pads pool sequences past their continuation: the target's EOS
    (the first one when it has several; 0 when it has none)."""
    eos_id = target.config.eos_token_id
    return int(eos_id[0] if isinstance(eos_id, (list, tuple)) else eos_id or 0)


@dataclass
class GreedyPool:
    """Training sequences: ``tokens [N, S]`` int64 (corpus prefix + target greedy
    continuation + EOS padding), ``prefix_len [N]`` and ``end [N]`` int64 (on the CPU:
    anchors are drawn there; ``end`` = prefix + continuation, ``S`` without
    ``continuation_max``), ``aux [N, S, A]`` (target dtype); ``tokens`` and ``aux`` on
    the device."""

    tokens: torch.Tensor
    prefix_len: torch.Tensor
    aux: torch.Tensor
    end: torch.Tensor

    def ends(self, idx: torch.Tensor | None = None) -> torch.Tensor:
        """``end`` of the rows ``idx`` (all rows when None), int64 on the CPU."""
        return self.end if idx is None else self.end[idx.cpu()]

    def __len__(self) -> int:
        return self.tokens.shape[0]


@torch.no_grad()
def pool_from_tokens(target, tokens: torch.Tensor, prefix_len: torch.Tensor,
                     end: torch.Tensor, layer_ids, cfg: DrafterTrainConfig,
                     device: torch.device | str) -> GreedyPool:
    """A :class:`GreedyPool` of ready sequences: ``tokens [N, S]`` int64 moved to
    ``device``, ``prefix_len`` / ``end`` int64 ``[N]`` kept on the CPU, and the aux
    hidden states of ``target`` over the rows (batches of ``cfg.gen_batch``)."""
    tokens = tokens.to(device)
    aux = torch.cat([target_aux_hidden(target, tokens[i:i + cfg.gen_batch], layer_ids)
                     for i in range(0, tokens.shape[0], cfg.gen_batch)])
    return GreedyPool(tokens, prefix_len.cpu().long(), aux, end.cpu().long())


def text_pool(target, corpus: np.ndarray, num_seqs: int, layer_ids, cfg: DrafterTrainConfig,
              seed: int, device: torch.device | str) -> GreedyPool:
    """``num_seqs`` rows of corpus text in the pool layout: a prefix of stratified length
    (``cfg.prefix_min .. cfg.prefix_max``), then the next ``min(seq_len - p,
    continuation_max)`` corpus tokens in place of a greedy continuation, EOS padding.

    Extra training data that costs one target forward and no decoding, for when the
    greedy pool is small enough to be memorised. Its labels are the text, not the
    target's greedy tokens (see the module docstring): a target that has learnt the
    corpus mostly reproduces it greedily, and the validation pool stays greedy, so the
    kept checkpoint is still the one that predicts the target best."""
    gen = torch.Generator().manual_seed(seed)
    toks = torch.as_tensor(np.asarray(corpus, dtype=np.int64))
    lengths = stratified_prefix_lengths(cfg.prefix_min, cfg.prefix_max, num_seqs, gen)
    tokens = torch.full((num_seqs, cfg.seq_len), padding_token_id(target), dtype=torch.long)
    prefix_len = torch.tensor(lengths, dtype=torch.long)
    end = torch.empty(num_seqs, dtype=torch.long)
    for i, p in enumerate(lengths):
        span = continuation_length(cfg, p)
        start = int(torch.randint(0, toks.shape[0] - p - span + 1, (1,), generator=gen))
        tokens[i, :p + span] = toks[start:start + p + span]
        end[i] = p + span
    return pool_from_tokens(target, tokens, prefix_len, end, layer_ids, cfg, device)


def concat_pools(first: GreedyPool, second: GreedyPool) -> GreedyPool:
    """The rows of ``first`` then ``second`` (same sequence length and aux width)."""
    return GreedyPool(torch.cat([first.tokens, second.tokens]),
                      torch.cat([first.prefix_len, second.prefix_len]),
                      torch.cat([first.aux, second.aux]),
                      torch.cat([first.end, second.end]))


@torch.no_grad()
def build_pool(
    target,
    corpus: np.ndarray,
    num_seqs: int,
    layer_ids,
    cfg: DrafterTrainConfig,
    seed: int,
    device: torch.device | str,
    progress: bool = True,
    desc: str = "greedy pool",
    max_seconds: float | None = None,
    decode=None,
) -> GreedyPool:
    """Generate ``num_seqs`` sequences of ``cfg.seq_len`` tokens from random prefixes of
    the flat ``corpus`` (one prefix length per generation batch of ``cfg.gen_batch``,
    see :func:`stratified_prefix_lengths`) and their aux hidden states. Seeded by
    ``seed``. With ``max_seconds`` no new batch starts after that long (the pool is
    then smaller; its size is the sequence count to pass back for an exact rerun).
    ``decode(prefix [b, p], num_new) -> [b, p + num_new]`` decodes a batch (default
    :func:`greedy_continue`; e.g. a ``static_decode.StaticGreedyDecoder``)."""
    device = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    toks = torch.as_tensor(np.asarray(corpus, dtype=np.int64))
    num_batches = -(-num_seqs // cfg.gen_batch)
    eos_id = padding_token_id(target)
    prefix_lengths = stratified_prefix_lengths(cfg.prefix_min, cfg.prefix_max, num_batches, gen)
    chunks_t, chunks_p, chunks_e, chunks_a = [], [], [], []
    bar = progress_bar(num_seqs, desc, progress)
    done = 0
    t0 = time.perf_counter()
    for p in prefix_lengths:
        if done and max_seconds is not None and time.perf_counter() - t0 > max_seconds:
            break
        b = min(cfg.gen_batch, num_seqs - done)
        starts = torch.randint(0, toks.shape[0] - p + 1, (b,), generator=gen)
        prefix = toks[starts[:, None] + torch.arange(p)].to(device)
        num_new = continuation_length(cfg, p)
        seq = (decode or functools.partial(greedy_continue, target))(prefix, num_new)
        # EOS padding to seq_len: the causal aux rows before it are unchanged.
        seq = torch.nn.functional.pad(seq, (0, cfg.seq_len - p - num_new), value=eos_id)
        chunks_t.append(seq)
        chunks_p.append(torch.full((b,), p, dtype=torch.long))
        chunks_e.append(torch.full((b,), p + num_new, dtype=torch.long))
        chunks_a.append(target_aux_hidden(target, seq, layer_ids))
        done += b
        bar.update(b)
    bar.close()
    return GreedyPool(torch.cat(chunks_t), torch.cat(chunks_p), torch.cat(chunks_a),
                      torch.cat(chunks_e))


def sample_anchors(
    prefix_len: torch.Tensor, seq_len: int, block_size: int, n: int, gen: torch.Generator,
    end: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[B, n]`` distinct sorted anchors per row (CPU int64), uniform in
    ``prefix_len[b] .. end[b] - block_size`` (``end`` int64 ``[B]``, default
    ``seq_len``; drawn from the CPU generator ``gen``)."""
    bsz = prefix_len.shape[0]
    lo = prefix_len.cpu()[:, None]
    hi = (torch.full((bsz,), seq_len) if end is None else end.cpu())[:, None] - block_size
    pos = torch.arange(seq_len)[None, :]
    valid = (pos >= lo) & (pos <= hi)
    if int(valid.sum(1).min()) < n:
        raise ValueError(f"fewer than {n} anchor positions in a row (from its prefix to "
                         "its end - block_size): shorten prefix_max or raise continuation_max")
    scores = torch.rand(bsz, seq_len, generator=gen).masked_fill(~valid, -1.0)
    return scores.topk(n, dim=1).indices.sort(dim=1).values


def depth_weights(num_depths: int, gamma: float, device=None) -> torch.Tensor:
    """``exp(-(j-1)/gamma)`` for depths ``j = 1..num_depths`` (fp32)."""
    return torch.exp(-torch.arange(num_depths, device=device, dtype=torch.float32) / gamma)


def dflash_loss(
    logits: torch.Tensor, labels: torch.Tensor, gamma: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Depth-weighted cross-entropy of ``logits [B, N, L, V]`` against
    ``labels [B, N, L]``: ``sum_j w_j CE_j / sum_j w_j``, mean over blocks.

    Also returns detached stats: ``acc`` (per-depth top-1 accuracy ``[L]``) and
    ``tau`` (mean of 1 + leading correct depths, scalar)."""
    depths = logits.shape[-2]
    w = depth_weights(depths, gamma, logits.device)
    ce = F.cross_entropy(logits.float().flatten(0, 2), labels.flatten(), reduction="none").view(
        labels.shape
    )
    loss = (ce * w).sum(-1).mean() / w.sum()
    with torch.no_grad():
        correct = logits.argmax(-1) == labels
        stats = {
            "acc": correct.float().mean(dim=(0, 1)),
            "tau": 1.0 + correct.long().cumprod(-1).sum(-1).float().mean(),
        }
    return loss, stats


def batch_loss(drafter, target, pool: GreedyPool, idx, anchors, gamma: float,
               selector_candidates: int | None = None
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`dflash_loss` of the blocks anchored at ``anchors`` in rows ``idx`` of
    ``pool``; a DFlash2 drafter adds its selector's loss and stats over
    ``selector_candidates`` candidates a depth, capped at V
    (:func:`vllm_ddtree.training.selector_loss.selector_loss`)."""
    tokens = pool.tokens[idx]
    hidden, logits = drafter_block_outputs(
        drafter,
        tokens,
        pool.aux[idx],
        anchors,
        target.get_input_embeddings(),
        target.get_output_embeddings(),
    )
    labels = block_labels(tokens, anchors, drafter.block_size)
    loss, stats = dflash_loss(logits, labels, gamma)
    if hasattr(drafter, "candidate_selector"):
        k = selector_candidates
        extra, extra_stats = selector_loss(drafter, hidden, logits,
                                           torch.gather(tokens, 1, anchors), labels,
                                           None if k is None else min(k, logits.shape[-1]))
        loss = loss + extra
        stats.update(extra_stats)
    return loss, stats


@torch.no_grad()
def evaluate_drafter(
    drafter: DFlashDraftModel, target, pool: GreedyPool, cfg: DrafterTrainConfig, seed: int = 1234
) -> dict:
    """Loss, ``tau`` and per-depth accuracy on ``pool`` with seeded anchors
    (``cfg.eval_anchors_per_seq`` per sequence)."""
    device = pool.tokens.device
    gen = torch.Generator().manual_seed(seed)
    was_training = drafter.training
    drafter.eval()
    tot_loss, tot_tau, acc, batches = 0.0, 0.0, None, 0
    for start in range(0, len(pool), cfg.batch_size):
        idx = torch.arange(start, min(len(pool), start + cfg.batch_size))
        anchors = sample_anchors(
            pool.prefix_len[idx], cfg.seq_len, drafter.block_size, cfg.eval_anchors_per_seq, gen,
            end=pool.ends(idx),
        )
        idx, anchors = idx.to(device), anchors.to(device)
        with autocast_for(device):
            loss, stats = batch_loss(drafter, target, pool, idx, anchors, cfg.loss_gamma,
                                     cfg.selector_candidates)
        tot_loss += float(loss)
        tot_tau += float(stats["tau"])
        acc = stats["acc"] if acc is None else acc + stats["acc"]
        batches += 1
    drafter.train(was_training)
    return {
        "loss": tot_loss / batches,
        "tau": tot_tau / batches,
        "acc_by_depth": [round(float(a) / batches, 4) for a in acc],
    }


def train_drafter(
    drafter: DFlashDraftModel,
    target,
    pool: GreedyPool,
    eval_pool: GreedyPool | None,
    cfg: DrafterTrainConfig,
    progress: bool = True,
) -> TrainLog:
    """Train ``drafter`` in place on ``pool`` (the target stays frozen).

    ``eval_pool`` (from the validation split) is evaluated every ``cfg.eval_every``
    steps; ``TrainLog.extra["eval_tau"]`` holds its chain acceptance length. With
    ``cfg.keep_best`` the drafter ends with the weights of the lowest eval loss."""
    device = pool.tokens.device
    drafter.to(device).train()
    for p in target.parameters():
        p.requires_grad_(False)
    gen = torch.Generator().manual_seed(cfg.seed)
    # No decay on vectors, nor on DFlash2's base kernels (decay would pull their
    # identity tap towards 0).
    named = list(drafter.named_parameters())
    decay = [p for n, p in named if p.dim() >= 2 and not n.endswith("base_kernel")]
    no_decay = [p for n, p in named if p.dim() < 2 or n.endswith("base_kernel")]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=cfg.lr,
        betas=cfg.betas,
        fused=device.type == "cuda",
    )
    plan = StepPlan(cfg.steps, cfg.minutes, cfg.max_steps, device)
    log = TrainLog()
    log.extra["eval_tau"] = {"steps": [], "values": [], "label": "validation tau (chain)"}
    best = BestKeeper()
    pending: list[torch.Tensor] = []
    taus: list[torch.Tensor] = []
    bar = progress_bar(plan.total, "drafter", progress)

    def flush(step: int) -> None:
        flush_losses(step, pending, taus, log, bar, "tau")

    def evaluate(step: int) -> None:
        if eval_pool is None:
            return
        res = evaluate_drafter(drafter, target, eval_pool, cfg)
        log.record_eval(step, res, res["tau"], best if cfg.keep_best else None, drafter)

    def compute_loss() -> torch.Tensor:
        idx = torch.randint(0, len(pool), (cfg.batch_size,), generator=gen)
        anchors = sample_anchors(
            pool.prefix_len[idx], cfg.seq_len, drafter.block_size, cfg.anchors_per_seq, gen,
            end=pool.ends(idx),
        )
        idx, anchors = host_to_device(idx, device), host_to_device(anchors, device)
        with autocast_for(device):
            loss, stats = batch_loss(drafter, target, pool, idx, anchors, cfg.loss_gamma,
                                     cfg.selector_candidates)
        taus.append(stats["tau"])
        return loss

    step = run_step_loop(plan, cfg, opt, [p for _, p in named], compute_loss, pending, bar,
                         flush, evaluate, log)
    log.extra["blocks_seen"] = step * cfg.batch_size * cfg.anchors_per_seq
    log.extra["kept_step"] = best.step if best.restore(drafter) else step
    drafter.eval()
    return log
