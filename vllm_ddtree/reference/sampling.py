"""Token choice keyed by (seed, position): the same draw whatever the decoding method."""

from __future__ import annotations

import torch


def _wrap(value: int) -> int:
    """A 64-bit constant as the signed int64 torch stores."""
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN = _wrap(0x9E3779B97F4A7C15)
_MUL1 = _wrap(0xBF58476D1CE4E5B9)
_MUL2 = _wrap(0x94D049BB133111EB)


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _splitmix64(x: torch.Tensor) -> torch.Tensor:
    x = x + _GOLDEN
    x = (x ^ _shr(x, 30)) * _MUL1
    x = (x ^ _shr(x, 27)) * _MUL2
    return x ^ _shr(x, 31)


def keyed_uniform(seed: int, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """Uniform noise in (0, 1), float64 ``[N, vocab]``, a pure function of
    ``(seed, position, token id)`` (counter-based splitmix64; int64 ops wrap)."""
    pos = positions.to(torch.int64).cpu()[:, None]
    token = torch.arange(vocab, dtype=torch.int64)[None, :]
    key = _splitmix64(_splitmix64(torch.full_like(pos, seed) * _MUL1 + pos) + token)
    mantissa = _shr(key, 11).to(torch.float64)  # 53 random bits
    return (mantissa + 0.5) / float(1 << 53)


def choose_tokens(
    logits: torch.Tensor, positions: torch.Tensor, temperature: float, seed: int | None
) -> torch.Tensor:
    """Target token for each row of ``logits [N, V]``.

    ``positions [N]`` are the absolute positions of the tokens being chosen.
    Greedy (argmax) when ``temperature == 0``; otherwise Gumbel-max sampling at
    ``temperature`` whose noise is keyed by ``(seed, position)``, so AR decoding
    and a speculative method draw the same token at the same position.
    Returns int64 ``[N]``.
    """
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    if seed is None:
        raise ValueError("sampling with temperature > 0 needs `seed` (an int)")
    gumbel = -torch.log(-torch.log(keyed_uniform(seed, positions, logits.shape[-1])))
    return (logits.double() / temperature + gumbel.to(logits.device)).argmax(dim=-1)
