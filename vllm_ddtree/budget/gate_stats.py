"""What ``ddtree_budget: "auto"``'s step gate (``vllm_ddtree.budget.gate``) measures per
batch-size bucket: the residual step time and the committed tokens per tree of each arm,
and the bucket's decision state (:class:`GateStats`), with the bucketing itself."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

__all__ = ["Ema", "GateStats", "batch_bucket", "bucket_batches", "bucket_bounds"]

# Weight of a new sample in an arm's committed tokens per tree (after the first 1 / it).
EMA_WEIGHT = 0.2
# Residual samples an arm's estimate is the (lower) median of: one interval stretched
# by a host stall (a GC pause, a log flush) must not move it.
RESIDUAL_WINDOW = 15
# A step holding a prefill counts toward the residuals only where at least PREFILL_SHARE
# of its bucket's last PREFILL_WINDOW timed steps held one, and its prefill's attention
# work (query-key pairs, ``vllm_ddtree.verify.shape.prefill_load``) is at most
# TYPICAL_PREFILL times the lower median of theirs: typical of the bucket.
PREFILL_WINDOW = 128
PREFILL_SHARE = 0.25
TYPICAL_PREFILL = 4.0


def batch_bucket(num_reqs: int) -> int:
    """``ceil(log2(num_reqs))``: batches of 1, 2, 3-4, 5-8, ... share statistics."""
    return max(0, math.ceil(math.log2(max(1, num_reqs))))


def bucket_bounds(bucket: int) -> tuple[int, int]:
    """``(lo, hi)``: the batch sizes :func:`batch_bucket` puts in ``bucket``, ``lo <= n
    <= hi`` (bucket 0 from 0 requests): two comparisons where a step asks."""
    return (0, 1) if bucket <= 0 else (2 ** (bucket - 1) + 1, 2 ** bucket)


def bucket_batches(bucket: int) -> str:
    """The batch sizes of a bucket as text: ``"1"``, ``"2"``, ``"3-4"``, ``"5-8"``..."""
    if bucket <= 1:
        return str(bucket + 1)
    return f"{2 ** (bucket - 1) + 1}-{2 ** bucket}"


@dataclass
class Ema:
    """An EMA that averages its first ``1 / EMA_WEIGHT`` samples equally: a probe's
    few trees (one a step at batch 1) must not rest on the first one."""

    value: float = 0.0
    count: int = 0

    def add(self, sample: float) -> None:
        self.count += 1
        self.value += max(EMA_WEIGHT, 1.0 / self.count) * (sample - self.value)


@dataclass
class _Median:
    """The lower median of the last ``RESIDUAL_WINDOW`` samples (of two: the smaller).
    An EMA carried one stalled interval for tens of steps, long enough to keep the
    stalled arm looking slow until it was measured again."""

    samples: deque = field(default_factory=lambda: deque(maxlen=RESIDUAL_WINDOW))
    value: float = 0.0
    count: int = 0

    def add(self, sample: float) -> None:
        self.samples.append(sample)
        self.count += 1
        ordered = sorted(self.samples)
        self.value = ordered[(len(ordered) - 1) // 2]


class GateStats:
    """What the gate measured in one batch-size bucket, per arm (index into the gate's
    sorted arms, 0: plain decoding), and the bucket's decision state.

    Args:
        num_arms: ``A``, the gate's arms.
        settled: the index of the arm the bucket starts from.
        interval: decisions before its first scheduled probe.
    """

    def __init__(self, num_arms: int, settled: int, interval: int) -> None:
        self.residuals = [_Median() for _ in range(num_arms)]
        self.committed = [Ema() for _ in range(num_arms)]
        # the same as arrays for the vectorized rates: fp64 / int64 [A]
        self.residual_seconds = np.zeros(num_arms)
        self.residual_count = np.zeros(num_arms, dtype=np.int64)
        self.committed_tokens = np.zeros(num_arms)
        self.committed_count = np.zeros(num_arms, dtype=np.int64)
        # per arm: its own trees cut to the smallest speculative arm (same EMA weights)
        self.smallest_cut = [Ema() for _ in range(num_arms)]
        self.smallest_cut_tokens = np.zeros(num_arms)
        self.chosen = np.zeros(num_arms, dtype=np.int64)  # steps per arm
        self.settled = settled
        self.decisions = 0
        self.steps = 0  # decisions since the last scheduled probe
        self.interval = interval
        self.reference: float | None = None  # committed tokens when the interval restarted
        # decision since which arms' committed figures are suspect: plain decoding began
        # or the interval restarted (the requests changed)
        self.stale_since = 0
        self.probed_figure: tuple[int, float] | None = None  # a probed arm's figure before
        self.probed: set[int] = set()  # arms probed here (first-time probes run once)
        self.last_probe = np.full(num_arms, -1, dtype=np.int64)  # decision of the last probe
        # prefill attention pairs of the bucket's last timed steps (0: none)
        self.prefill_pairs: deque[int] = deque(maxlen=PREFILL_WINDOW)

    def typical_prefill(self, pairs: int) -> bool:
        """Record a timed step's prefill attention pairs (0 without a prefill); whether
        they are typical of the bucket's last ``PREFILL_WINDOW`` steps, this one
        included: a step without a prefill always is; one with a prefill where at least
        ``PREFILL_SHARE`` of the steps hold one and its pairs are at most
        ``TYPICAL_PREFILL`` times the lower median of theirs. (The lower median of all
        the steps, zeros included, put every prefill out where fewer than half of the
        steps held one, and where just over half did it was one of the smallest: under
        continuous batching at large batch, a new request's prompt tail every second or
        third step, most timed steps were lost. A long prompt's chunks on consecutive
        steps of a bucket where prefills are otherwise rare stay out while they are
        under a quarter of the window: 32 timed steps.)"""
        self.prefill_pairs.append(pairs)
        if pairs <= 0:
            return True
        held = sorted(p for p in self.prefill_pairs if p > 0)
        if len(held) < PREFILL_SHARE * len(self.prefill_pairs):
            return False
        return pairs <= TYPICAL_PREFILL * held[(len(held) - 1) // 2]

    def add_residual(self, arm: int, seconds: float) -> None:
        median = self.residuals[arm]
        median.add(seconds)
        self.residual_seconds[arm] = median.value
        self.residual_count[arm] = median.count

    def add_committed(self, arm: int, tokens: float) -> None:
        ema = self.committed[arm]
        ema.add(tokens)
        self.committed_tokens[arm] = ema.value
        self.committed_count[arm] = ema.count

    def add_smallest_cut(self, arm: int, tokens: float) -> None:
        ema = self.smallest_cut[arm]
        ema.add(tokens)
        self.smallest_cut_tokens[arm] = ema.value

    def reset_committed(self, arm: int) -> None:
        self.committed[arm] = Ema()
        self.committed_tokens[arm] = 0.0
        self.committed_count[arm] = 0
        self.smallest_cut[arm] = Ema()
        self.smallest_cut_tokens[arm] = 0.0

    def measured(self, num_arms: int) -> np.ndarray:
        """bool ``[num_arms]``: the first arms with a residual, and (speculative arms)
        trees counted."""
        done = self.residual_count[:num_arms] > 0
        done[1:] &= self.committed_count[1:num_arms] > 0
        return done
