"""Token choice keyed by (seed, position): the same draw whatever the decoding method."""

from __future__ import annotations

import torch

_MIX = 0x9E3779B97F4A7C15


def position_generator(seed: int, position: int) -> torch.Generator:
    """A CPU generator whose stream depends only on ``(seed, position)``."""
    key = (seed * _MIX + position * 0xBF58476D1CE4E5B9 + 1) % (2**63 - 1)
    return torch.Generator().manual_seed(key)


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
    vocab = logits.shape[-1]
    gumbel = torch.stack(
        [
            -torch.log(
                -torch.log(
                    torch.rand(
                        vocab, generator=position_generator(seed, int(p)), dtype=torch.float64
                    ).clamp_min(1e-300)
                )
            )
            for p in positions.tolist()
        ]
    ).to(logits.device)
    return (logits.double() / temperature + gumbel).argmax(dim=-1)
