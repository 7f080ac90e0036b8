"""What ``ddtree_budget: "auto"``'s step gate (``vllm_ddtree.budget.gate``) measures per
batch-size bucket: the residual step time and the committed tokens per tree of each arm,
and the bucket's decision state (:class:`GateStats`), with the bucketing itself.

An arm's residual is the bucket's *level* plus the arm's *offset*. The host's speed, most
of a small target's step, moves by up to 2x within seconds (H100 traces of the batch
sweep: every arm's steps went from 9 to 16 ms together at batch 64), so a median of each
arm's own samples compared arms measured at different times: the arm that ran while the
host was fast looked cheap long after. The level follows every timed step of any arm;
an arm's offset is what its steps took beyond the level of the moment (the steps just
before, mostly the settled arm's): a paired difference, which the host's drift leaves
alone while a cost of the arm that the start-up model misses stays in it."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

__all__ = ["Ema", "GateStats", "batch_bucket", "bucket_batches", "bucket_bounds",
           "follow_settled_arm", "hidden_seconds", "idle_engine"]

# An arm above the settled one follows the settled arm's acceptance (accepted nodes per
# tree) by at most this factor either way, from a reference of at least MIN_REFERENCE.
SCALE_LIMIT = 2.0
MIN_REFERENCE = 0.1
# Weight of a new sample in an arm's committed tokens per tree (after the first 1 / it).
EMA_WEIGHT = 0.2
# A sample of n trees weighs 1 - exp(-n / EMA_TREES), at most EMA_WEIGHT: the figures
# remember about this many trees at batch 1-2 (a sample is the trees since the last
# decision, one at batch 1). Five trees (EMA_WEIGHT alone) let a stretch of hard text
# drop the settled arm below plain decoding's for a few steps (10-round windows of the
# embedded drafter's recorded rounds commit 1.1 to 9.3 tokens a tree); a long memory
# keeps drafting a request the drafter cannot predict. CPU simulation over those rounds
# in order (tests/test_budget_gate.py, batch 1, 4-8 seeds): 8 to 64 trees all reach
# 0.94-1.0 of the best fixed arm where five reached 0.76-0.86 (seeds 0-2); after the
# trees stop committing drafts, 12 trees decode plainly within 16-27 steps (0.93-0.95
# of plain decoding's rate over 500 steps) where 64 took about a hundred (0.82-0.86).
EMA_TREES = 12.0
# Samples the residual level and each arm's offset are the (lower) median of: one
# interval stretched by a host stall (a GC pause, a log flush) must not move them.
RESIDUAL_WINDOW = 15
# Standard error of a median of n samples, per median absolute deviation over sqrt(n):
# 1.25 (a median's error over a mean's, normal samples) x 1.4826 (sigma per MAD).
MEDIAN_ERROR = 1.25 * 1.4826
# Level samples before their spread is known: with fewer, offsets count as none (the
# arms compare on the start-up model alone; the lower median of two deviations is 0).
SPREAD_SAMPLES = 5
# Samples of an offset before its own spread widens its error (the lower median of two
# deviations from their median is 0: two samples say nothing of their scatter).
OWN_SPREAD_SAMPLES = 3
# An arm's offset takes samples until it has this many even while the arm is settled:
# an offset frozen from one sample kept a host stall in it for good.
OFFSET_SAMPLES = 3
# A step holding a prefill counts toward the residuals only where at least PREFILL_SHARE
# of its bucket's last PREFILL_WINDOW timed steps held one, and its prefill's attention
# work (query-key pairs, ``vllm_ddtree.verify.shape.prefill_load``) is at most
# TYPICAL_PREFILL times the lower median of theirs: typical of the bucket.
PREFILL_WINDOW = 128
PREFILL_SHARE = 0.25
TYPICAL_PREFILL = 4.0
# An interval is an idle engine, not a step, where the GPU idled after the step's work
# more than IDLE_GAP_SECONDS and IDLE_GAP_FACTOR times what the step itself took (no
# requests for a while, a benchmark's turn elsewhere; a host stall as well).
IDLE_GAP_SECONDS = 0.05
IDLE_GAP_FACTOR = 4.0
# Host slack samples (the GPU idle between a settled speculative step's last launch's
# end and the next step's start) before the slack hides any arm's modeled difference.
SLACK_SAMPLES = 5
# A median idle time below this is the gap between two queued steps' launches, not a
# host that outlasts the GPU (hidden_seconds).
MIN_HIDDEN_SECONDS = 10e-6
# Before any slack is known in a bucket, a smaller speculative arm must be predicted at
# least this much faster for the bucket to move to it (GateStats.may_switch).
UNSEEN_SLACK_EDGE = 0.1


def idle_engine(seconds: float, idle: float | None) -> bool:
    """Whether an interval of ``seconds`` whose GPU idled ``idle`` of them after the
    step's work (None: not measured) spans an idle engine rather than a step."""
    return idle is not None and idle > max(IDLE_GAP_SECONDS,
                                           IDLE_GAP_FACTOR * (seconds - idle))


def hidden_seconds(stats: GateStats | None) -> float:
    """GPU time the host's step hides beyond the settled speculative arm's: the lower
    median of the GPU's idle time after that arm's last steps
    (:meth:`GateStats.slack_samples`); 0.0 where most of them did not idle, before
    ``SLACK_SAMPLES`` of them, below ``MIN_HIDDEN_SECONDS``, or where the bucket decodes
    plainly. For the device's per-round budget choice (``BudgetPolicy.hide_``)."""
    idle = None if stats is None else stats.slack_samples()
    if idle is None:
        return 0.0
    seconds = float(np.sort(idle)[(len(idle) - 1) // 2])
    return seconds if seconds >= MIN_HIDDEN_SECONDS else 0.0


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
    """An EMA that averages its first ``1 / weight`` samples equally: a probe's few
    trees (one a step at batch 1) must not rest on the first one."""

    value: float = 0.0
    count: int = 0

    def add(self, sample: float, weight: float = EMA_WEIGHT) -> None:
        self.count += 1
        self.value += max(weight, 1.0 / self.count) * (sample - self.value)


def tree_weight(trees: int | None) -> float:
    """The EMA weight of a committed-tokens sample averaging ``trees`` trees
    (``EMA_TREES``); None: ``EMA_WEIGHT``."""
    if trees is None:
        return EMA_WEIGHT
    return min(EMA_WEIGHT, -math.expm1(-trees / EMA_TREES))


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

    def spread(self) -> float:
        """The lower median of the window's absolute deviations from its median (0.0
        below three samples)."""
        deviations = sorted(abs(x - self.value) for x in self.samples)
        return deviations[(len(deviations) - 1) // 2] if deviations else 0.0


class GateStats:
    """What the gate measured in one batch-size bucket, per arm (index into the gate's
    sorted arms, 0: plain decoding), and the bucket's decision state.

    Args:
        num_arms: ``A``, the gate's arms.
        settled: the index of the arm the bucket starts from.
        interval: decisions before its first scheduled probe.
    """

    def __init__(self, num_arms: int, settled: int, interval: int) -> None:
        # every arm's samples less its offset; per arm, its samples less the level before
        self.level = _Median()
        self.offsets = [_Median() for _ in range(num_arms)]
        self.committed = [Ema() for _ in range(num_arms)]
        # the same as arrays for the vectorized rates: fp64 / int64 [A]; an arm's residual
        # (refresh_residuals) is the settled arm's, the level plus its offset, and the
        # offsets' difference beyond their noise
        self.residual_offsets = np.zeros(num_arms)
        self.offset_count = np.zeros(num_arms, dtype=np.int64)  # samples in each offset
        # fp64 [A]: each offset's own spread (median absolute deviation of its window's
        # samples; 0 below OWN_SPREAD_SAMPLES)
        self.offset_spread = np.zeros(num_arms)
        # the settled arm as add_residual last saw it, and its samples since it settled
        self._settled_arm, self._settled_samples = -1, 0
        self.residual_seconds = np.zeros(num_arms)
        self.residual_count = np.zeros(num_arms, dtype=np.int64)
        self.committed_tokens = np.zeros(num_arms)
        self.committed_count = np.zeros(num_arms, dtype=np.int64)
        # [arm][smaller arm]: an arm's own trees cut to each smaller speculative arm (same
        # EMA weights; fp64 [A, A]), the reference its figure follows the settled arm by
        self.reference_cut = [[Ema() for _ in range(num_arms)] for _ in range(num_arms)]
        self.reference_cut_tokens = np.zeros((num_arms, num_arms))
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
        # (arm, retries left) of the last probe above the settled arm, until its trees are
        # in (gate_probes.blank_probe_retry)
        self.blank_probe: tuple[int, int] | None = None
        self.last_probe = np.full(num_arms, -1, dtype=np.int64)  # decision of the last probe
        # prefill attention pairs of the bucket's last timed steps (0: none)
        self.prefill_pairs: deque[int] = deque(maxlen=PREFILL_WINDOW)
        # fp64 [A]: each arm's offset less the settled arm's (0 without samples) and its
        # standard error (inf before SPREAD_SAMPLES level samples: it counts as none)
        self.offset_diff = np.zeros(num_arms)
        self.offset_error = np.full(num_arms, np.inf)
        # the GPU's idle time after the settled arm's last steps (add_slack) and that arm
        self.slack: deque[float] = deque(maxlen=RESIDUAL_WINDOW)
        self._slack_arm = -1
        self.slack_seen = False  # some settled arm had SLACK_SAMPLES of them

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
        """A timed step of ``arm`` (index) took ``seconds`` beyond the model. An arm
        other than the settled one (a probe) first adds the sample less the level
        before it to its offset; the settled arm's offset stays once it has
        ``OFFSET_SAMPLES`` and the arm has been settled for as many samples (its first
        ones after a switch are paired with the level its predecessor set: with a
        probe's three samples alone its offset, which every other arm is compared
        with, was 2 ms off at 40 % noise on 9 ms steps), so that its steps, most of the
        bucket's, move the level when the host's speed moves (its offset would
        otherwise take the move first and keep the level, and every other arm's
        residual, where it was). The bucket's first sample sets the level (its arm's
        offset sample 0). Then the level takes the sample less the arm's offset."""
        offset = self.offsets[arm]
        if arm == self.settled:
            if self._settled_arm != arm:
                self._settled_arm, self._settled_samples = arm, 0
            self._settled_samples += 1
        if not self.level.count:
            offset.add(0.0)
        elif (arm != self.settled or offset.count < OFFSET_SAMPLES
              or self._settled_samples <= OFFSET_SAMPLES):
            offset.add(seconds - self.level.value)
        self.level.add(seconds - offset.value)
        self.residual_offsets[arm] = offset.value
        self.offset_count[arm] = offset.count
        if len(offset.samples) >= OWN_SPREAD_SAMPLES:
            self.offset_spread[arm] = offset.spread()
        self.residual_count[arm] += 1
        self.refresh_residuals()

    def refresh_residuals(self) -> None:
        """``residual_seconds`` from the level and the offsets, after a sample or a new
        settled arm: the settled arm's residual is the level plus its offset; another
        arm differs from it by the offsets' difference less one standard error of the
        arm's own offset (the wider of the bucket's spread, as the level's median
        absolute deviation, and that of the offset's own samples, over the root of its
        sample count), none where that error covers it,
        and none before ``SPREAD_SAMPLES`` level samples. At batch 64 on a small target
        one interval's spread was half the step (H100 traces): a probe's three samples
        then made offsets of several ms either way, and the gate moved on them; where
        steps are steady the offsets count whole. (Counting the settled arm's error
        too shrank real differences the start-up model misses, and the committed tokens
        alone chose: ``tests/test_budget_gate.py``'s prefill case.) An arm without
        samples takes the settled arm's residual. :meth:`residuals` shrinks toward the
        host slack's prediction instead of toward none."""
        samples = self.level.samples
        settled = self.settled
        base = self.residual_offsets[settled] if self.residual_count[settled] else 0.0
        np.subtract(self.residual_offsets, base, out=self.offset_diff)
        self.offset_diff[self.residual_count == 0] = 0.0
        if len(samples) < SPREAD_SAMPLES:
            self.offset_error[:] = np.inf
        else:
            # An offset is the median of at most RESIDUAL_WINDOW samples, however many
            # it has seen: its error is that window's (with every sample counted, an
            # arm's offset hundreds of samples old lost its error and the gate moved
            # on noise). Its spread is the wider of the bucket's and its own samples':
            # a probe that caught a host stall or a slow phase scatters more than the
            # level (batch 32, H100: three samples of 64 drafts at 8-18 ms beside the
            # settled arm's 3-10 kept the gate off the faster arm for the rest of the
            # cell).
            spread = self.level.spread()
            self.offset_error[:] = MEDIAN_ERROR * np.maximum(spread, self.offset_spread) / (
                np.sqrt(np.clip(self.offset_count, 1, RESIDUAL_WINDOW)))
        self.residual_seconds = self.residuals(np.zeros(len(self.offset_diff)))

    def residuals(self, prior: np.ndarray) -> np.ndarray:
        """fp64 ``[A]``: each arm's residual where, without samples beyond their noise,
        it is predicted to differ from the settled arm's by ``prior`` (fp64 ``[A]``,
        0 at the settled arm; zeros: the start-up model's difference counts whole): the
        level and the settled arm's offset, plus ``prior`` and the measured difference
        from it less its error (soft thresholding), none for an arm without samples."""
        level = self.level.value
        if self.residual_count[self.settled]:
            level += self.residual_offsets[self.settled]
        beyond = self.offset_diff - prior
        shrunk = np.maximum(np.abs(beyond) - self.offset_error, 0.0)
        np.copysign(shrunk, beyond, out=shrunk)
        shrunk[self.residual_count == 0] = 0.0
        return level + prior + shrunk

    def hidden_residuals(self, model_seconds: np.ndarray) -> np.ndarray:
        """fp64 ``[A]``: :meth:`residuals` where the host's step hides part of the
        model's difference between speculative arms (vLLM prepares a step on the host
        while the GPU runs the last: a step takes the longer of the two), as the GPU's
        idle time after the settled arm's last steps (:meth:`slack_samples`) says: a
        step ``d`` longer on the GPU takes ``max(0, d - idle)`` more after one that
        idled and ``d`` more after one that did not; ``d`` shorter, nothing less after
        one that idled (the host is what it waits for) and ``d`` less after one that
        did not. ``residual_seconds`` without slack samples. ``model_seconds``: fp64
        ``[n]``, the start-up model's step of the first ``n`` arms at this batch."""
        n = len(model_seconds)
        idle = self.slack_samples() if self.settled < n else None
        if idle is None:
            return self.residual_seconds
        gpu = np.asarray(model_seconds[1:]) - model_seconds[self.settled]
        longer = np.maximum(gpu[:, None] - idle[None, :], 0.0).mean(axis=1)
        step = np.where(gpu > 0.0, longer, gpu * float(np.mean(idle <= 0.0)))
        prior = np.zeros(len(self.offset_diff))
        prior[1:n] = step - gpu
        return self.residuals(prior)

    def add_slack(self, arm: int, seconds: float) -> None:
        """A timed step of ``arm`` (index, speculative) left the GPU idle ``seconds``
        before the next step's start: the host's step outlasted the GPU's by that much.
        Kept for the settled arm only (a probe's own GPU time moves it), from the
        settled arm's first sample."""
        if arm != self.settled:
            return
        if self._slack_arm != arm:
            self._slack_arm = arm
            self.slack.clear()
        self.slack.append(max(seconds, 0.0))
        self.slack_seen = self.slack_seen or len(self.slack) >= SLACK_SAMPLES

    def slack_samples(self) -> np.ndarray | None:
        """fp64 ``[k]``: the GPU's idle time after each of the settled arm's last
        ``k <= RESIDUAL_WINDOW`` timed steps (seconds, 0 where it did not wait); None
        before ``SLACK_SAMPLES`` of them or where the settled arm is plain decoding."""
        if (self.settled == 0 or self._slack_arm != self.settled
                or len(self.slack) < SLACK_SAMPLES):
            return None
        return np.fromiter(self.slack, dtype=np.float64)

    def may_switch(self, arm: int, seconds: np.ndarray) -> bool:
        """Whether the bucket may move to ``arm`` (index) now, ``seconds`` (fp64 ``[n]``)
        the arms' predicted steps: before the bucket first knew a settled speculative
        arm's host slack (:meth:`slack_samples`), not to a smaller speculative arm
        predicted less than ``UNSEEN_SLACK_EDGE`` faster, an edge the host may hide
        (batch 1, H100: the gate moved from 64 to 32 drafts 0.15 s in, after 3 slack
        samples, on a 2 % modelled edge that the GPU's 0.6 ms idle after each step hid,
        and ran 191 steps on 32 where 64's trees committed 8 % more). A larger arm is
        predicted no faster for an unknown slack (the slack only hides its extra time),
        and a larger edge is not all hidden time: waiting for the slack there cost
        probes of the arms above (batch 256: 4 % of the next 600 steps)."""
        settled = self.settled
        if arm == 0 or settled == 0 or arm > settled or self.slack_seen:
            return True
        return bool(seconds[settled] > (1.0 + UNSEEN_SLACK_EDGE) * seconds[arm])

    def add_committed(self, arm: int, tokens: float, trees: int | None = None) -> None:
        """``arm`` committed ``tokens`` a tree over ``trees`` trees (:func:`tree_weight`)."""
        ema = self.committed[arm]
        ema.add(tokens, tree_weight(trees))
        self.committed_tokens[arm] = ema.value
        self.committed_count[arm] = ema.count

    def add_reference_cut(self, arm: int, reference: int, tokens: float,
                          trees: int | None = None) -> None:
        """``arm``'s trees cut to ``reference`` (indices, ``reference < arm``) committed
        ``tokens`` a tree over ``trees`` trees."""
        ema = self.reference_cut[arm][reference]
        ema.add(tokens, tree_weight(trees))
        self.reference_cut_tokens[arm, reference] = ema.value

    def reset_committed(self, arm: int) -> None:
        self.committed[arm] = Ema()
        self.committed_tokens[arm] = 0.0
        self.committed_count[arm] = 0
        self.reference_cut[arm] = [Ema() for _ in self.reference_cut[arm]]
        self.reference_cut_tokens[arm] = 0.0

    def measured(self, num_arms: int) -> np.ndarray:
        """bool ``[num_arms]``: the first arms with a residual, and (speculative arms)
        trees counted."""
        done = self.residual_count[:num_arms] > 0
        done[1:] &= self.committed_count[1:num_arms] > 0
        return done


def follow_settled_arm(stats: GateStats, committed: np.ndarray, num_arms: int,
                       min_trees: int) -> None:
    """Fresh figures for the arms above the settled one (``_scale_above_settled``), then
    every counted speculative arm floored by the counted arms below it: on the same
    trees a larger arm commits at least what a smaller one does, and the smaller arms'
    figures are the fresher (the settled arm's trees cut to each of them count at every
    decision, a probe counts the probed arm's). Without the floor a bucket settled on
    64 drafts, probing 32 on an easy stretch of code (6 tokens a tree against 64's 3.2
    from the first harder rounds), moved to 32, then 16 and 8 the same way, and
    committed 106 tokens where 64 committed 115 in the same rounds (batch 1, H100). In
    place on ``committed`` (fp64 ``[num_arms]``)."""
    _scale_above_settled(stats, committed, num_arms, min_trees)
    counts = stats.committed_count.tolist()
    floor = 0.0
    for i in range(1, num_arms):  # a few arms: numpy's per-call cost would be the step's
        if counts[i] > 0:
            floor = max(floor, float(committed[i]))
            committed[i] = floor


def _scale_above_settled(stats: GateStats, committed: np.ndarray, num_arms: int,
                         min_trees: int) -> None:
    """Arms above the settled one last counted trees in their probes: scale what they
    accepted by how the settled arm's figure (fresh from every decision) moved since,
    as their own trees cut to the settled arm measured it (paired: the same trees; the
    walk's arm counters cut each tree to every smaller arm). The smallest speculative
    arm is the reference where the bucket decodes plainly. The factor is kept within
    ``SCALE_LIMIT`` and taken only from references ``MIN_REFERENCE`` above a plain
    step's one token and a reference figure of ``min_trees`` trees. A larger arm never
    falls below the settled arm's figure (the same trees accept at least as much), also
    where no factor applies: a probe on the warm-up's random prompts left the largest
    arm at 1.33 tokens a tree at batch 1 beside the settled arm's 2.5, which it then
    never beat. In place on ``committed`` (fp64 ``[num_arms]``)."""
    reference = max(stats.settled, 1)
    if num_arms <= reference + 1 or stats.committed_count[reference] < min_trees:
        return
    # A Python loop: at most a few arms, and numpy's per-call cost is the step's host
    # time at batch 1.
    now = float(stats.committed_tokens[reference]) - 1.0
    refs = stats.reference_cut_tokens[:, reference].tolist()
    counts = stats.committed_count.tolist()
    floor = float(committed[stats.settled]) if stats.settled > 0 else None
    for i in range(reference + 1, num_arms):
        if counts[i] <= 0:
            continue
        ref = refs[i] - 1.0  # -1 where never counted
        if ref >= MIN_REFERENCE:
            factor = min(max(now / ref, 1.0 / SCALE_LIMIT), SCALE_LIMIT)
            committed[i] = 1.0 + (float(committed[i]) - 1.0) * factor
        if floor is not None:
            committed[i] = max(float(committed[i]), floor)
