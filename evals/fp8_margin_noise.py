"""How far rounding-sized noise in the decode attention moves greedy margins on an fp8
cache (CPU, fp32): the yardstick for a bf16 backend's flip on vLLM's e4m3 MLA cache.

The embedded target decodes one of ``evals/check_mla_backend.py``'s prompts greedily in
exact arithmetic on vLLM's fp8 cache (``vllm_ddtree.testing.fp8_mla_reference``). Then,
per seed, every decode row's attention output (the input of each layer's ``o_proj``)
takes independent relative Gaussian noise of standard deviation ``sigma`` per element,
as a kernel's own rounding would (bf16 output rounding: about 1.5e-3 relative), and the
same tokens are scored again (teacher-forced). Reported: the spread of the exact top-1's
lead over the exact top-2 at one position and over every decoded position, and how often
the noise flipped a greedy token. The noise reaches the next layers' e4m3 query codes,
so the amplification an fp8 cache adds is in it.

    python evals/fp8_margin_noise.py [--prompt 3] [--tokens 21] [--position 20]
        [--sigmas 1e-3 3e-3] [--seeds 20]

``--bf16``: bf16 arithmetic instead, the yardstick of ``compare.FP8_CACHE_BF16_TIE_GAP``.
Every linear and norm output of the target is rounded by a uniform relative error of up
to half a bf16 step (``2**-8``) per element, on every row; over all five prompts
(``--tokens`` greedy tokens each, ``--seeds`` draws), reported: the exact top-2 gap's
change per position (percentiles) and |log-prob difference| of the top 2 (median, 95th
percentile), the figure to set beside a GPU run's.

    python evals/fp8_margin_noise.py --bf16 --tokens 24 --seeds 20
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class NoiseSpread:
    """What ``sigma`` did to the exact top-1's lead over the exact top-2 (nats)."""

    sigma: float
    at_position: np.ndarray  # fp64 [seeds]: the lead at the chosen position
    change: np.ndarray  # fp64 [seeds * positions]: the lead's change at every position
    flips: int  # greedy tokens the noise changed, over seeds and positions


def exact_greedy(model, prompt: list[int], tokens: int) -> list[int]:
    """``tokens`` greedy tokens of ``model`` on vLLM's fp8 cache, exact arithmetic."""
    from vllm_ddtree.testing.fp8_mla_reference import fp8_cache_logits

    generated: list[int] = []
    for _ in range(tokens):
        generated.append(int(fp8_cache_logits(model, prompt, generated)[-1].argmax()))
    return generated


def noise_spread(model, prompt: list[int], generated: list[int], position: int,
                 sigmas: list[float], seeds: int) -> tuple[float, list[NoiseSpread]]:
    """The exact lead at ``position`` (row of ``fp8_cache_logits``: it scores
    ``generated[position]``) and, per ``sigma``, its spread under ``seeds`` draws."""
    from vllm_ddtree.testing.fp8_mla_reference import fp8_cache_logits

    exact = fp8_cache_logits(model, prompt, generated)
    top2 = exact.topk(2, dim=-1).indices  # [positions + 1, 2]

    def lead(logits: torch.Tensor) -> np.ndarray:
        picked = logits.gather(1, top2)
        return (picked[:, 0] - picked[:, 1]).numpy().astype(np.float64)

    base = lead(exact)
    draw = {"sigma": 0.0, "rng": None}

    def perturb(module, args):
        if draw["sigma"] == 0.0:
            return None
        (x,) = args
        decode = x[:, len(prompt):]
        noise = torch.randn(decode.shape, generator=draw["rng"]) * draw["sigma"]
        return (torch.cat([x[:, :len(prompt)], decode * (1 + noise)], dim=1),)

    layers = [m for m in model.modules() if type(m).__name__ == "DeepseekV3Attention"]
    hooks = [layer.o_proj.register_forward_pre_hook(perturb) for layer in layers]
    spreads = []
    try:
        for sigma in sigmas:
            at, change, flips = [], [], 0
            for seed in range(seeds):
                draw["sigma"], draw["rng"] = sigma, torch.Generator().manual_seed(seed)
                logits = fp8_cache_logits(model, prompt, generated)
                moved = lead(logits)
                at.append(moved[position])
                change.append(moved[1:] - base[1:])  # row 0: the prefill, no noise
                flips += int((logits[1:].argmax(-1) != top2[1:, 0]).sum())
            spreads.append(NoiseSpread(sigma, np.array(at), np.concatenate(change), flips))
    finally:
        for hook in hooks:
            hook.remove()
    return float(base[position]), spreads


BF16_HALF_STEP = 2.0 ** -8  # bf16 keeps 8 significant bits: half a step relative


def bf16_rounding_spread(model, prompts: list[list[int]], tokens: int,
                         seeds: int) -> tuple[np.ndarray, np.ndarray]:
    """Per prompt, ``tokens`` exact greedy tokens on vLLM's fp8 cache, then per seed the
    same tokens scored (teacher-forced) with every ``nn.Linear`` and RMSNorm output
    rounded by a uniform relative error in ``[-BF16_HALF_STEP, BF16_HALF_STEP]``.
    Returns fp64 ``(gap_change, logprob_change)``: |change| of the exact top-2 gap at
    every decoded position (the prefill row left out), and of the top 2's log-probs."""
    from vllm_ddtree.testing.fp8_mla_reference import fp8_cache_logits

    draw = {"rng": None}

    def rounded(module, args, out):
        if draw["rng"] is None:
            return None
        error = (torch.rand(out.shape, generator=draw["rng"]) * 2 - 1) * BF16_HALF_STEP
        return out * (1 + error)

    hooks = [m.register_forward_hook(rounded) for m in model.modules()
             if isinstance(m, torch.nn.Linear) or type(m).__name__.endswith("RMSNorm")]
    gaps, logprobs = [], []
    try:
        for prompt in prompts:
            draw["rng"] = None
            generated = exact_greedy(model, prompt, tokens)
            exact = fp8_cache_logits(model, prompt, generated)[:-1].log_softmax(-1)
            top2 = exact.topk(2, dim=-1).indices
            exact_top = exact.gather(1, top2)
            for seed in range(seeds):
                draw["rng"] = torch.Generator().manual_seed(seed)
                moved = fp8_cache_logits(model, prompt, generated)[:-1].log_softmax(-1)
                moved_top = moved.gather(1, top2)
                change = (moved_top[:, 0] - moved_top[:, 1]) - (exact_top[:, 0] - exact_top[:, 1])
                gaps.append(change[1:].abs().double().numpy())
                logprobs.append((moved_top - exact_top).abs().flatten().double().numpy())
    finally:
        for hook in hooks:
            hook.remove()
    return np.concatenate(gaps), np.concatenate(logprobs)


def bf16_report(gap_change: np.ndarray, logprob_change: np.ndarray) -> str:
    """Markdown table of :func:`bf16_rounding_spread`'s result."""
    pct = np.percentile(gap_change, [95, 99, 99.9])
    return "\n".join([
        "| positions | top-2 gap change: 95th / 99th / 99.9th pct / max | "
        "|log-prob change|: median / 95th pct |", "|---|---|---|",
        f"| {len(gap_change)} | {pct[0]:.3f} / {pct[1]:.3f} / {pct[2]:.3f} / "
        f"{gap_change.max():.3f} | {np.median(logprob_change):.3f} / "
        f"{np.percentile(logprob_change, 95):.3f} |"])


def report(exact_lead: float, spreads: list[NoiseSpread], position: int) -> str:
    """Markdown table of :func:`noise_spread`'s result."""
    lines = [f"exact lead at position {position}: {exact_lead:.3f} nats", "",
             f"| sigma | lead at {position}: mean / s.d. / min / max | change over every "
             "position: s.d. / 99th pct of abs / max abs | greedy flips |",
             "|---|---|---|---|"]
    for s in spreads:
        a, c = s.at_position, np.abs(s.change)
        lines.append(f"| {s.sigma:g} | {a.mean():.3f} / {a.std():.3f} / {a.min():.3f} / "
                     f"{a.max():.3f} | {s.change.std():.3f} / {np.percentile(c, 99):.3f} / "
                     f"{c.max():.3f} | {s.flips} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from check_mla_backend import PROMPT_LENGTHS, prompts

    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt", type=int, default=3,
                   help=f"index into check_mla_backend's prompts (lengths {PROMPT_LENGTHS})")
    p.add_argument("--tokens", type=int, default=21, help="greedy tokens decoded")
    p.add_argument("--position", type=int, default=20, help="the position reported alone")
    p.add_argument("--sigmas", type=float, nargs="+", default=[1e-3, 3e-3])
    p.add_argument("--seeds", type=int, default=20)
    p.add_argument("--bf16", action="store_true",
                   help="bf16 rounding of every linear and norm output, all prompts")
    args = p.parse_args(argv)
    if not 0 <= args.prompt < len(PROMPT_LENGTHS):
        p.error(f"--prompt must be in [0, {len(PROMPT_LENGTHS) - 1}], got {args.prompt}")
    if not 0 <= args.position < args.tokens:
        p.error(f"--position must be in [0, --tokens), got {args.position} with "
                f"--tokens {args.tokens}")
    from vllm_ddtree.demo.reference_engine import load_embedded_pair

    model = load_embedded_pair().target.float().eval()
    if args.bf16:
        print(bf16_report(*bf16_rounding_spread(model, prompts(), args.tokens, args.seeds)))
        return 0
    prompt = prompts()[args.prompt]
    generated = exact_greedy(model, prompt, args.tokens)
    print(f"prompt {args.prompt} ({len(prompt)} tokens), exact greedy: {generated}")
    exact_lead, spreads = noise_spread(model, prompt, generated, args.position,
                                       args.sigmas, args.seeds)
    print(report(exact_lead, spreads, args.position))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
