"""Acceptance of DFlash (chain) and DDTree on HumanEval prompts, reference engine.

    python evals/acceptance_humaneval.py run --temperature 0 --out evals/results/acc_t0.json
    python evals/acceptance_humaneval.py run --temperature 1 --out evals/results/acc_t1.json
    python evals/acceptance_humaneval.py report evals/results/acc_t0.json evals/results/acc_t1.json

``run`` decodes every prompt with each method on the embedded pair (fp32, CPU or
CUDA) and stores per-round stats; ``report`` writes
``evals/results/acceptance_humaneval.md`` and a PNG. Mean acceptance length =
tokens committed per round (accepted depth + 1), prefill excluded.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from cli_args import int_arg, non_negative_float, positive_int

from vllm_ddtree.demo import HUMANEVAL_PROBLEMS

METHODS = [("dflash", 0), ("ddtree", 16), ("ddtree", 32), ("ddtree", 64), ("ddtree", 128)]


def run(args) -> None:
    import torch
    from tqdm import tqdm

    from vllm_ddtree.demo.reference_engine import humaneval_prompts, load_embedded_pair
    from vllm_ddtree.reference import generate

    torch.set_num_threads(args.threads)
    pair = load_embedded_pair()
    if pair.tokenizer is None:
        sys.exit("no embedded trained pair: acceptance would be meaningless")
    prompts = [pair.tokenizer.encode(p) for p in humaneval_prompts(args.prompts)]
    rows = []
    start = time.time()
    for i, prompt in enumerate(tqdm(prompts, desc=f"T={args.temperature}")):
        reference = None
        for method, budget in METHODS:
            out = generate(pair.target, pair.drafter, prompt, args.max_new_tokens, method,
                           budget=budget or 1, temperature=args.temperature, seed=i,
                           eos_token_id=pair.tokenizer.eos_token_id)
            reference = out.tokens if reference is None else reference
            rows.append({
                "prompt": i, "method": method, "budget": budget,
                "committed": [s.committed for s in out.stats],
                "depth": [s.accepted_depth for s in out.stats],
                "tokens": len(out.tokens), "same_as_first_method": out.tokens == reference,
            })
    Path(args.out).write_text(json.dumps({
        "temperature": args.temperature, "max_new_tokens": args.max_new_tokens,
        "prompts": len(prompts), "seconds": time.time() - start, "rows": rows,
        "command": " ".join(sys.argv),
    }))


def summarize(data: dict) -> dict[str, dict]:
    table = {}
    for method, budget in METHODS:
        name = "DFlash chain (15)" if method == "dflash" else f"DDTree B={budget}"
        rows = [r for r in data["rows"] if r["method"] == method and r["budget"] == budget]
        committed = [c for r in rows for c in r["committed"]]
        depths = [d for r in rows for d in r["depth"]]
        table[name] = {
            "mean_acceptance_length": sum(committed) / max(1, len(committed)),
            "mean_accepted_depth": sum(depths) / max(1, len(depths)),
            "rounds": len(committed),
            "identical_tokens": all(r["same_as_first_method"] for r in rows),
        }
    return table


def report(args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [json.loads(Path(p).read_text()) for p in args.inputs]
    lines = ["# Acceptance on HumanEval, embedded pair, reference engine", "",
             "Mean acceptance length = tokens committed per round (accepted depth + 1), "
             "prefill excluded; HumanEval prompts (trailing whitespace stripped), EOS "
             "stops. `identical` = every method produced the chain's tokens (lossless "
             "check).", ""]
    fig, ax = plt.subplots(figsize=(6, 4))
    for data in runs:
        table = summarize(data)
        chain = table["DFlash chain (15)"]["mean_acceptance_length"]
        lines += [f"## T = {data['temperature']} ({data['prompts']} prompts, up to "
                  f"{data['max_new_tokens']} new tokens, {data['seconds'] / 60:.1f} min on 1 "
                  "CPU core)", "",
                  "| method | mean acceptance length | vs chain | mean accepted depth | rounds "
                  "| identical |", "|---|---|---|---|---|---|"]
        for name, row in table.items():
            lines.append(f"| {name} | {row['mean_acceptance_length']:.3f} | "
                         f"{row['mean_acceptance_length'] / chain:.2f}x | "
                         f"{row['mean_accepted_depth']:.3f} | {row['rounds']} | "
                         f"{row['identical_tokens']} |")
        lines += ["", f"command: `{data['command']}`", ""]
        budgets = [b for m, b in METHODS if m == "ddtree"]
        (line,) = ax.plot(
            budgets, [table[f"DDTree B={b}"]["mean_acceptance_length"] for b in budgets],
            marker="o", label=f"DDTree, T={data['temperature']}",
        )
        ax.axhline(chain, linestyle="--", color=line.get_color(),
                   label=f"DFlash chain, T={data['temperature']}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tree budget B (nodes per round)")
    ax.set_ylabel("tokens committed per round")
    ax.legend()
    fig.tight_layout()
    out = Path(args.out_dir)
    fig.savefig(out / "acceptance_humaneval.png", dpi=120)
    (out / "acceptance_humaneval.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--temperature", type=non_negative_float, default=0.0)
    r.add_argument("--prompts", type=int_arg(1, HUMANEVAL_PROBLEMS), default=HUMANEVAL_PROBLEMS)
    r.add_argument("--max-new-tokens", type=positive_int, default=128)
    r.add_argument("--threads", type=positive_int, default=1)
    r.add_argument("--out", required=True)
    p = sub.add_parser("report")
    p.add_argument("inputs", nargs="+")
    p.add_argument("--out-dir", default="evals/results")
    args = parser.parse_args(argv)
    run(args) if args.cmd == "run" else report(args)


if __name__ == "__main__":
    main()
