"""The keyed sampling noise is independent across neighbouring positions, tokens and
seeds (requests), and so are the tokens it draws.

Plain decoding and the speculative path use the same keyed-noise function, so a
losslessness test cannot see noise shared between neighbouring positions (both sides
would share it): only a test of the noise itself can. Bars fixed in advance: every
chi-square test of independence on a 10 x 10 joint histogram of uniforms must have
p > ``P_MIN``; every Pearson correlation must be within ``R_MAX`` (6 standard errors
of a correlation of independent samples, 1 / sqrt(n)). With about 24 such tests the
chance that correct noise fails any bar is below 1e-4 (and the noise is a fixed
function: a pass is a pass for good). Noise keyed by ``position // 2`` (shared by
neighbours) has a correlation of about 0.5 and a chi-square p-value of 0.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from vllm_ddtree.reference.sampling import choose_tokens, keyed_uniform

P_MIN = 1e-4
BINS = 10
POSITIONS = 4000
VOCAB = 64
N = POSITIONS * VOCAB  # 256,000 pairs per test
R_MAX = 6 / np.sqrt(N)


def _joint_chi2(a: np.ndarray, b: np.ndarray) -> float:
    """p-value of the chi-square test of independence of two samples of (0, 1)
    uniforms, on their ``BINS x BINS`` joint histogram."""
    table, _, _ = np.histogram2d(a, b, bins=BINS, range=[[0, 1], [0, 1]])
    return float(stats.chi2_contingency(table, correction=False).pvalue)


def _check_independent(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    a, b = a.flatten().numpy(), b.flatten().numpy()
    r = float(np.corrcoef(a, b)[0, 1])
    assert abs(r) < R_MAX, f"{what}: correlation {r:.4f} (bar {R_MAX:.4f})"
    p = _joint_chi2(a, b)
    assert p > P_MIN, f"{what}: chi-square p = {p:.3g} (bar {P_MIN})"


@pytest.mark.parametrize("seed", [0, 1, 12345, 2**31 - 1])
@pytest.mark.parametrize("gap", [1, 2])
def test_neighbouring_positions_draw_independent_noise(seed, gap):
    positions = torch.arange(POSITIONS + gap)
    u = keyed_uniform(seed, positions, VOCAB)
    _check_independent(u[:-gap], u[gap:], f"seed {seed}, positions p and p + {gap}")


@pytest.mark.parametrize("seed", [0, 7])
def test_neighbouring_tokens_draw_independent_noise(seed):
    u = keyed_uniform(seed, torch.arange(POSITIONS), VOCAB + 1)
    _check_independent(u[:, :-1], u[:, 1:], f"seed {seed}, tokens v and v + 1")


@pytest.mark.parametrize("seeds", [(0, 1), (41, 42), (3, 2**20 + 3), (5, 5 + 2**32)])
def test_requests_with_other_seeds_draw_independent_noise(seeds):
    """Requests differ by their seed (``ddtree-ref`` keys each by seed + a hash of its
    prompt); neighbouring seeds and seeds equal in their low bits must not share noise."""
    positions = torch.arange(POSITIONS)
    a = keyed_uniform(seeds[0], positions, VOCAB)
    b = keyed_uniform(seeds[1], positions, VOCAB)
    _check_independent(a, b, f"seeds {seeds}")


def test_seed_and_position_do_not_trade_places():
    """(seed s, position p + 1) and (seed s + 1, position p) are different keys."""
    positions = torch.arange(POSITIONS)
    a = keyed_uniform(10, positions + 1, VOCAB)
    b = keyed_uniform(11, positions, VOCAB)
    _check_independent(a, b, "(s, p + 1) vs (s + 1, p)")


def test_tokens_drawn_at_neighbouring_positions_are_independent():
    """Gumbel-max draws from one fixed distribution at consecutive positions: the
    joint histogram of (token at p, token at p + 1) factorises (chi-square test of
    independence), and each position's histogram matches the softmax."""
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 0.2])
    n = 20000
    rows = logits.expand(n + 1, -1)
    draws = choose_tokens(rows, torch.arange(n + 1), 1.0, seed=3).numpy()
    table = np.zeros((6, 6))
    np.add.at(table, (draws[:-1], draws[1:]), 1)
    assert stats.chi2_contingency(table, correction=False).pvalue > P_MIN
    expected = torch.softmax(logits.double(), -1).numpy() * (n + 1)
    assert stats.chisquare(np.bincount(draws, minlength=6), expected).pvalue > P_MIN


def test_the_bars_reject_noise_shared_by_neighbours():
    """The same checks on noise keyed by ``position // 2`` (what a sharing bug does)."""
    positions = torch.arange(POSITIONS + 1)
    u = keyed_uniform(0, positions // 2, VOCAB)
    with pytest.raises(AssertionError, match="correlation"):
        _check_independent(u[:-1], u[1:], "shared")
    a, b = u[:-1].flatten().numpy(), u[1:].flatten().numpy()
    assert _joint_chi2(a, b) < P_MIN
