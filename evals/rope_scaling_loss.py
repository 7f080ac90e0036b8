"""The target's loss by position with its RoPE as trained and stretched by YaRN (CPU).

    python evals/rope_scaling_loss.py                       # embedded target, 2048 tokens
    python evals/rope_scaling_loss.py --factors 2 4 8 --length 4096 --prompts 2

For each variant (``default`` = the checkpoint's own RoPE, ``yarn xF`` = the copy written
by ``vllm_ddtree.long_context.write_rope_scaled`` with factor F over the 512-token
training window), the mean next-token loss (nats, fp32) per bucket of positions over
``--prompts`` slices of standard-library source (``e2e_models.code_prompts``). Writes
``rope_scaling_loss.{md,png,json}`` into ``--out-dir``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))


def bucket_losses(model, prompts: list[list[int]], bucket: int) -> list[float]:
    """Mean loss per ``bucket`` positions, averaged over ``prompts`` (equal lengths,
    a multiple of ``bucket``). Position p's loss predicts token p + 1; the last
    position repeats the one before it."""
    import torch

    sums = None
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            logits = model(input_ids=ids).logits[0, :-1].float()
            loss = torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="none")
            loss = torch.cat([loss, loss[-1:]]).view(-1, bucket).mean(1)
            sums = loss if sums is None else sums + loss
    return (sums / len(prompts)).tolist()


def measure(target_dir: Path, factors: list[float], length: int, num_prompts: int,
            bucket: int, progress: bool = True) -> dict:
    import torch
    from e2e_models import code_prompts
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_ddtree.long_context import (
        EMBEDDED_TRAIN_WINDOW,
        scaled_max_positions,
        write_rope_scaled,
        yarn_parameters,
    )

    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    prompts = code_prompts(tokenizer, num_prompts, length)
    tmp = Path(tempfile.mkdtemp(prefix="rope_scaling_loss_"))
    variants = [("default", target_dir, None)]
    for factor in factors:
        rope = yarn_parameters(factor, EMBEDDED_TRAIN_WINDOW)
        variants.append((f"yarn x{factor:g}",
                         write_rope_scaled(target_dir, tmp / f"yarn{factor:g}", rope),
                         scaled_max_positions(rope)))
    rows = []
    for name, path, positions in tqdm(variants, desc="variants", disable=not progress):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        start = time.time()
        rows.append({"variant": name, "max_positions": positions,
                     "loss": bucket_losses(model, prompts, bucket),
                     "seconds": round(time.time() - start, 1)})
    return {"length": length, "prompts": num_prompts, "bucket": bucket,
            "train_window": EMBEDDED_TRAIN_WINDOW, "rows": rows}


def write_report(result: dict, out_dir: Path, command: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bucket = result["bucket"]
    n = len(result["rows"][0]["loss"])
    heads = [f"{i * bucket}-{(i + 1) * bucket - 1}" for i in range(n)]
    lines = [
        "# Target loss by position: RoPE as trained vs stretched by YaRN",
        "",
        f"Mean next-token loss (nats, fp32, transformers on the CPU) per {bucket} positions "
        f"over {result['prompts']} slices of {result['length']} tokens of standard-library "
        f"source; the target was trained on {result['train_window']}-token windows. "
        "`yarn xF`: `vllm_ddtree.long_context.write_rope_scaled` with factor F (covers "
        "F x 512 positions; rows past that are extrapolation).",
        "",
        f"command: `{command}`",
        "",
        "| variant | " + " | ".join(heads) + " |",
        "|---|" + "---|" * n,
    ]
    for row in result["rows"]:
        lines.append(f"| {row['variant']} | " + " | ".join(f"{x:.2f}" for x in row["loss"])
                     + " |")
    (out_dir / "rope_scaling_loss.md").write_text("\n".join(lines) + "\n")
    fig, ax = plt.subplots(figsize=(8, 4))
    centers = [(i + 0.5) * bucket for i in range(n)]
    for row in result["rows"]:
        ax.plot(centers, row["loss"], marker="o", ms=3, label=row["variant"])
    ax.axvline(result["train_window"], color="grey", ls=":", label="training window")
    ax.set_xlabel("position")
    ax.set_ylabel("loss (nats / token)")
    ax.set_title("Embedded target: loss by position, RoPE as trained vs YaRN")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "rope_scaling_loss.png", dpi=120)
    plt.close(fig)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=str(REPO / "vllm_ddtree" / "checkpoints" / "target"))
    p.add_argument("--factors", type=float, nargs="+", default=[2.0, 4.0, 8.0])
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--bucket", type=int, default=128)
    p.add_argument("--out-dir", default=str(REPO / "evals" / "results"))
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.length % args.bucket:
        p.error(f"--length {args.length} must be a multiple of --bucket {args.bucket}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    result = measure(Path(args.target), args.factors, args.length, args.prompts, args.bucket,
                     progress=not args.no_progress)
    command = ("python evals/rope_scaling_loss.py " + " ".join(argv or sys.argv[1:])).strip()
    result["command"] = command
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "rope_scaling_loss.json").write_text(json.dumps(result, indent=1))
    write_report(result, out_dir, command)
    print((out_dir / "rope_scaling_loss.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
