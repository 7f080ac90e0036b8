"""Which arm ``ddtree_budget: "auto"``'s step gate probes next, and when a bucket's probe
schedule restarts (``vllm_ddtree.budget.gate``; host only, on a bucket's
``GateStats``)."""

from __future__ import annotations

import numpy as np

from vllm_ddtree.budget.gate_stats import MIN_REFERENCE, SCALE_LIMIT, GateStats

# Steps a probe runs its arm: the middle ones are intervals of that arm alone.
PROBE_STEPS = 3
# Decisions between scheduled probes of one bucket: doubles after each up to the max,
# back to the start when the settled arm's committed tokens per tree move by
# INTERVAL_RESTART (the requests changed).
PROBE_INTERVAL = 32
MAX_PROBE_INTERVAL = 1024
INTERVAL_RESTART = 0.2
# From a speculative arm, plain decoding is probed once per bucket (every speculative arm
# pays the drafter's whole pass, so 1 or 2 drafts can be slower than both plain decoding
# and a larger arm) and then once every probe interval while it is unmeasured or the
# settled arm is predicted at most this fraction faster than it.
PLAIN_PROBE_MARGIN = 0.25
# Residual samples of the settled arm before its neighbours are first probed.
CALIBRATION_SAMPLES = 2
# Probes of an arm above the settled one run again, at most this many times in a row,
# while their trees cut to the settled arm accepted no draft (blank_probe_retry).
BLANK_PROBE_RETRIES = 2

__all__ = ["BLANK_PROBE_RETRIES", "PROBE_INTERVAL", "PROBE_STEPS", "blank_probe_retry",
           "probe_target", "restart_interval"]


def blank_probe_retry(stats: GateStats, current: int,
                      num_arms: int) -> tuple[int, int] | None:
    """``(arm, retries left)`` where the last probe of an arm above the speculative
    arm ``current`` (index; ``num_arms``: the arms the batch's cap allows) drew only
    trees that, cut to ``current``, accepted no draft: they say nothing of what the
    larger tree adds (``gate_stats._scale_above_settled`` takes no factor from them)
    and left the arm rated at ``current``'s figure, the schedule's next probe of it up
    to ``MAX_PROBE_INTERVAL`` decisions away. Such a probe runs again at once, at most
    ``BLANK_PROBE_RETRIES`` times in a row. H100, V2-Lite at batch 1: settled on 32
    drafts, the one probe of 64 drew three trees that committed 1 token at every cut,
    and the bucket stayed on 32 where 64 committed 15 % more a tree at the same step.
    None while the probe's trees are not in (``PROBE_STEPS - 1`` of them counted, as
    ``restart_interval`` waits)."""
    pending = stats.blank_probe
    if pending is None:
        return None
    arm, retries = pending
    if stats.committed_count[arm] < PROBE_STEPS - 1:
        return None
    stats.blank_probe = None
    if retries <= 0 or current == 0 or not current < arm < num_arms:
        return None
    if stats.reference_cut_tokens[arm, current] - 1.0 >= MIN_REFERENCE:
        return None
    return arm, retries - 1


def restart_interval(stats: GateStats, current: int) -> None:
    """Back to ``PROBE_INTERVAL`` when the settled arm's committed tokens per tree
    moved by ``INTERVAL_RESTART`` since the interval last restarted. Plain steps
    count no trees: there a probe's trees moving the probed arm's figure by as much
    restart it (the requests changed, the other arms' figures are stale)."""
    tokens = 1.0 if current == 0 else float(stats.committed_tokens[current])
    if stats.reference is None:
        stats.reference = tokens
    elif abs(tokens - stats.reference) > INTERVAL_RESTART * stats.reference:
        stats.reference = tokens
        stats.interval, stats.stale_since = PROBE_INTERVAL, stats.decisions
    if current == 0 and stats.probed_figure is not None:
        arm, before = stats.probed_figure
        if stats.committed_count[arm] >= PROBE_STEPS - 1:
            stats.probed_figure = None
            if abs(stats.committed_tokens[arm] - before) > INTERVAL_RESTART * before:
                stats.interval, stats.stale_since = PROBE_INTERVAL, stats.decisions


def probe_target(stats: GateStats, current: int, rates: np.ndarray, measured: np.ndarray,
                 num_arms: int) -> int | None:
    """The arm (index) to probe now, or None. First-time probes (each arm once per
    bucket, once the settled arm is calibrated): an unmeasured neighbour, or the
    first unmeasured arm beyond neighbours measured faster than the settled one
    (each hop may gain less than the hysteresis); from plain decoding also the arm
    below the smallest measured speculative arm, from a speculative arm plain
    decoding. From an arm above 1 draft, plain decoding once every ``interval``
    decisions while it is unmeasured or the settled arm is predicted at most
    ``PLAIN_PROBE_MARGIN`` faster (a turn of its own: the neighbours keep their
    pace). Then every ``interval`` decisions the least recently probed of the
    neighbours (from plain decoding: also the best measured speculative arm, the arm
    below the smallest measured one, and the smallest measured arm not probed since
    plain decoding began or the requests changed; from a speculative arm also the
    smallest measured arm beyond the neighbours not probed since the requests
    changed that would be faster at twice its predicted acceptance)."""
    spec_measured = below = None
    if current == 0:
        spec_measured = np.flatnonzero(measured[1:]) + 1
        if spec_measured.size > 0 and spec_measured[0] > 1:
            below = int(spec_measured[0]) - 1
    if stats.residual_count[current] >= CALIBRATION_SAMPLES:
        for step in (-1, 1):
            j = current + step
            while 0 <= j < num_arms and measured[j] and rates[j] > rates[current]:
                j += step
            if 0 <= j < num_arms and not measured[j] and j not in stats.probed:
                return j
        if below is not None and below not in stats.probed:
            return below
        if current > 0 and not measured[0] and 0 not in stats.probed:
            return 0  # plain decoding: no step between it and 1 draft is cheaper
    if (current > 1 and stats.decisions - stats.last_probe[0] >= stats.interval
            and (not measured[0]
                 or rates[current] <= rates[0] * (1 + PLAIN_PROBE_MARGIN))):
        return 0  # on the schedule's pace, beside the neighbours' turns
    if stats.steps < stats.interval:
        return None
    stats.steps = 0
    stats.interval = min(2 * stats.interval, MAX_PROBE_INTERVAL)
    candidates = {j for j in (current - 1, current + 1) if 0 <= j < num_arms}
    if current == 0:
        if spec_measured.size > 0:
            candidates.add(int(spec_measured[np.argmax(rates[spec_measured])]))
            # and, smallest first, each measured arm not probed since its figure
            # became suspect: a larger tree may pay where the smaller ones do not
            stale = spec_measured[stats.last_probe[spec_measured] < stats.stale_since]
            if stale.size > 0:
                candidates.add(int(stale[0]))
        if below is not None:
            candidates.add(below)
    else:
        # the smallest measured arm beyond the neighbours not probed since the
        # requests changed that would win at twice its predicted acceptance: rates
        # need not fall monotonically past a slower neighbour, and a figure from
        # other requests (the warm-up's random prompts) is never beaten else
        far = np.arange(current + 2, num_arms)
        stale = far[measured[far] & (stats.last_probe[far] < stats.stale_since)
                    & (SCALE_LIMIT * rates[far] > rates[current])]
        if stale.size > 0:
            candidates.add(int(stale[0]))
    if not candidates:
        return None
    return min(candidates, key=lambda j: (stats.last_probe[j], j))
