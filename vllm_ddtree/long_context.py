"""Long-context serving of a target trained on short windows: RoPE stretched by YaRN.

The embedded target was trained on 512-token windows; past ~640 positions its loss
doubles (2.2 -> 4.8 nats) and every drafter conditioned on it stops being accepted.
YaRN (Peng et al. 2023) interpolates the RoPE frequencies whose wavelength exceeds the
training window and leaves the fast ones alone, with no retraining; with factor 4 the
embedded target holds 1.5-2.1 nats out to 2048 positions for about +0.1 nats below 512
(`evals/results/long_context_rope.md`). Like Qwen's "add rope_scaling only when long
contexts are needed", it is a serving choice: ``write_rope_scaled`` writes a copy of a
checkpoint whose config carries the scaling, which vLLM and transformers load alike
(vLLM: ``--hf-overrides '{"rope_parameters": ..., "max_position_embeddings": ...}'``
does the same on the command line; vLLM 0.26 applies a dict override to the target
only, not to the drafter, which keeps the RoPE it was trained with: stretching the
drafter's too lowered acceptance at every length in our runs).

    python -m vllm_ddtree.long_context --src vllm_ddtree/checkpoints/target --out /tmp/t
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

# The embedded target's training window and its RoPE base.
EMBEDDED_TRAIN_WINDOW = 512
EMBEDDED_ROPE_THETA = 10000.0
DEFAULT_YARN_FACTOR = 4.0


def yarn_parameters(factor: float = DEFAULT_YARN_FACTOR,
                    original_positions: int = EMBEDDED_TRAIN_WINDOW,
                    rope_theta: float = EMBEDDED_ROPE_THETA) -> dict:
    """``rope_parameters`` for YaRN with ``factor`` over ``original_positions``.

    No ``mscale`` / ``mscale_all_dim``: transformers and vLLM then both scale cos/sin by
    ``0.1 ln(factor) + 1`` and leave the softmax scale alone (for DeepSeek-V3 vLLM maps
    ``yarn`` to ``deepseek_yarn``; ``tests/test_long_context.py`` checks the two agree).
    """
    if factor <= 1.0:
        raise ValueError(f"YaRN factor must be > 1, got {factor}")
    if original_positions < 1:
        raise ValueError(f"original_positions must be >= 1, got {original_positions}")
    return {"rope_type": "yarn", "rope_theta": float(rope_theta), "factor": float(factor),
            "original_max_position_embeddings": int(original_positions)}


def scaled_max_positions(rope_parameters: dict) -> int:
    """Positions a YaRN config covers: ``factor * original_max_position_embeddings``.

    vLLM's YaRN tables hold exactly this many positions (more would index past them),
    and transformers warns when ``max_position_embeddings`` differs from it."""
    return int(rope_parameters["factor"] * rope_parameters["original_max_position_embeddings"])


def write_rope_scaled(src: Path, out: Path, rope_parameters: dict, link: bool = True
                      ) -> Path:
    """Copy of the Hugging Face checkpoint ``src`` in ``out`` with ``rope_parameters``
    and ``max_position_embeddings = scaled_max_positions(rope_parameters)``; every other
    file is symlinked (``link``) or copied (weights are unchanged). Returns ``out``.
    Rewrites ``out`` when called again."""
    src, out = Path(src).resolve(), Path(out)
    config_path = src / "config.json"
    if not config_path.exists():
        raise FileNotFoundError(f"{src}: no config.json (not a Hugging Face checkpoint)")
    config = json.loads(config_path.read_text())
    old_rope = config.get("rope_parameters") or {}
    if old_rope.get("rope_type", "default") != "default":
        raise ValueError(f"{src}: rope_parameters already scaled ({old_rope}); "
                         "start from an unscaled checkpoint")
    config["rope_parameters"] = dict(rope_parameters)
    config["max_position_embeddings"] = scaled_max_positions(rope_parameters)
    if out.resolve() == src:
        raise ValueError("--out must differ from --src")
    return _write_with_config(src, out, config, link)


def _remove(path: Path) -> None:
    """Remove ``path`` if present: a link or file is unlinked (never what it points
    to), a folder removed with its contents."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


def _write_with_config(src: Path, out: Path, config: dict, link: bool) -> Path:
    """``out`` (replaced, :func:`_remove`) = ``src`` with ``config`` as its
    config.json; every other file symlinked (``link``) or copied."""
    _remove(out)
    out.mkdir(parents=True)
    for entry in src.iterdir():
        if entry.name == "config.json":
            continue
        if link:
            os.symlink(entry, out / entry.name)
        elif entry.is_dir():
            shutil.copytree(entry, out / entry.name)
        else:
            shutil.copy2(entry, out / entry.name)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def write_rope_scaled_pair(checkpoints: Path, out: Path, rope_parameters: dict) -> Path:
    """``out/target`` = :func:`write_rope_scaled` of ``checkpoints/target`` and
    ``out/drafter``: the drafter keeps its RoPE. A link to ``checkpoints/drafter`` when
    its ``max_position_embeddings`` covers the scaled target's, else a copy whose config
    raises it to that (weights linked): vLLM sizes the drafter's RoPE table by it, and
    DDTree refuses a ``max_model_len`` beyond it (``config.check_drafter_positions``).
    Past its training length the drafter's RoPE extrapolates: its acceptance falls
    there, never the output's correctness. Returns ``out``, a pair folder like
    ``vllm_ddtree/checkpoints``."""
    checkpoints, out = Path(checkpoints), Path(out)
    write_rope_scaled(checkpoints / "target", out / "target", rope_parameters)
    src = (checkpoints / "drafter").resolve()
    drafter = out / "drafter"
    config = json.loads((src / "config.json").read_text())
    positions = scaled_max_positions(rope_parameters)
    if config.get("max_position_embeddings", positions) < positions:
        _write_with_config(src, drafter, {**config, "max_position_embeddings": positions},
                           link=True)
        return out
    _remove(drafter)
    drafter.symlink_to(src, target_is_directory=True)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--src", required=True, help="Hugging Face checkpoint (target) folder; "
                   "with --pair a folder holding target/ and drafter/")
    p.add_argument("--out", required=True, help="folder to write (replaced if present)")
    p.add_argument("--factor", type=float, default=DEFAULT_YARN_FACTOR)
    p.add_argument("--original-positions", type=int, default=EMBEDDED_TRAIN_WINDOW,
                   help="the training window of the checkpoint")
    p.add_argument("--copy", action="store_true",
                   help="copy the weights and tokenizer instead of linking them (a folder "
                   "that travels on its own, e.g. /tmp/ckpt/target for train_pair)")
    p.add_argument("--pair", action="store_true",
                   help="write a pair folder (write_rope_scaled_pair): the scaled target and "
                   "its drafter, whose positions are raised to the target's if fewer")
    args = p.parse_args(argv)
    target = Path(args.src) / "target" if args.pair else Path(args.src)
    config = json.loads((target / "config.json").read_text())
    theta = (config.get("rope_parameters") or {}).get("rope_theta", EMBEDDED_ROPE_THETA)
    rope = yarn_parameters(args.factor, args.original_positions, theta)
    if args.pair:
        out = write_rope_scaled_pair(Path(args.src), Path(args.out), rope)
    else:
        out = write_rope_scaled(Path(args.src), Path(args.out), rope, link=not args.copy)
    print(f"{out}: rope_parameters {rope}, max_position_embeddings "
          f"{scaled_max_positions(rope)}")


if __name__ == "__main__":
    main()
