"""Tokens per round on HumanEval: DFlash vs DFlash2 drafters, chains and DDTree trees over
marginals or selector scores (reference engine, embedded target, fp32, CPU or CUDA).

    python evals/acceptance_dflash2.py run --dflash2 DIR --temperature 0 --out acc2_t0.json
    python evals/acceptance_dflash2.py run --dflash2 DIR --temperature 1 --out acc2_t1.json
    python evals/acceptance_dflash2.py report acc2_t0.json acc2_t1.json

``run`` decodes each prompt with: the DFlash chain (the embedded DFlash drafter), the
DFlash2 chain (the selector's walk), and DDTree at B = 16 / 32 / 64 over the DFlash
marginals, the DFlash2 marginals and the DFlash2 selector scores; every method must
return the first one's tokens (lossless). ``report`` writes
``evals/results/acceptance_dflash2.md`` and a PNG, with the two ratios the issue asks
for at B = 64 (selector / DFlash2 marginals, selector / DFlash2 chain).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from cli_args import int_arg, non_negative_float, positive_int

from vllm_ddtree.demo import HUMANEVAL_PROBLEMS

BUDGETS = (16, 32, 64)
# (label, drafter "dflash" | "dflash2", method, budget, draft_scores)
RUNS = ([("DFlash chain", "dflash", "dflash", 1, None),
         ("DFlash2 chain (selector walk)", "dflash2", "dflash2", 1, None)]
        + [(f"DDTree B={b}, DFlash marginals", "dflash", "ddtree", b, None) for b in BUDGETS]
        + [(f"DDTree B={b}, DFlash2 marginals", "dflash2", "ddtree", b, "marginals")
           for b in BUDGETS]
        + [(f"DDTree B={b}, DFlash2 selector", "dflash2", "ddtree", b, "selector")
           for b in BUDGETS])


def run(args) -> None:
    import torch
    from tqdm import tqdm

    from vllm_ddtree.demo.reference_engine import humaneval_prompts, load_embedded_pair
    from vllm_ddtree.reference import generate
    from vllm_ddtree.reference.dflash2 import DFlash2DraftModel
    from vllm_ddtree.training.common import load_drafter

    torch.set_num_threads(args.threads)
    pair = load_embedded_pair()
    if pair.tokenizer is None:
        sys.exit("no embedded trained pair: acceptance would be meaningless")
    drafters = {"dflash": pair.drafter.to(args.device),
                "dflash2": load_drafter(args.dflash2, torch.float32, args.device)}
    if not isinstance(drafters["dflash2"], DFlash2DraftModel):
        sys.exit(f"--dflash2 {args.dflash2}: not a DFlash2DraftModel checkpoint")
    target = pair.target.to(args.device)
    prompts = [pair.tokenizer.encode(p) for p in humaneval_prompts(args.prompts)]
    rows, start = [], time.time()
    for i, prompt in enumerate(tqdm(prompts, desc=f"T={args.temperature}")):
        first = None
        for label, kind, method, budget, scores in RUNS:
            out = generate(target, drafters[kind], prompt, args.max_new_tokens, method,
                           budget=budget, temperature=args.temperature, seed=i,
                           eos_token_id=pair.tokenizer.eos_token_id, draft_scores=scores)
            first = out.tokens if first is None else first
            rows.append({"prompt": i, "label": label,
                         "committed": [s.committed for s in out.stats],
                         "same_as_first": out.tokens == first})
    Path(args.out).write_text(json.dumps({
        "temperature": args.temperature, "max_new_tokens": args.max_new_tokens,
        "prompts": len(prompts), "dflash2": str(args.dflash2), "device": args.device,
        "seconds": time.time() - start, "rows": rows, "command": " ".join(sys.argv)}))


def summarize(data: dict) -> dict[str, dict]:
    table = {}
    for label, *_ in RUNS:
        rows = [r for r in data["rows"] if r["label"] == label]
        committed = [c for r in rows for c in r["committed"]]
        table[label] = {"tokens_per_round": sum(committed) / max(1, len(committed)),
                        "rounds": len(committed),
                        "identical": all(r["same_as_first"] for r in rows)}
    return table


def report(args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [json.loads(Path(p).read_text()) for p in args.inputs]
    lines = ["# DFlash vs DFlash2 on HumanEval, embedded target, reference engine", "",
             "Tokens committed per round (accepted depth + 1), prefill excluded; EOS stops. "
             "`identical`: the method returned the DFlash chain's tokens (lossless check).",
             ""]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for data in runs:
        t = data["temperature"]
        table = summarize(data)
        lines += [f"## T = {t} ({data['prompts']} prompts, up to {data['max_new_tokens']} new "
                  f"tokens, {data['seconds'] / 60:.1f} min on {data['device']}; DFlash2 "
                  f"drafter `{data['dflash2']}`)", "",
                  "| method | tokens per round | rounds | identical |", "|---|---|---|---|"]
        lines += [f"| {label} | {row['tokens_per_round']:.3f} | {row['rounds']} | "
                  f"{row['identical']} |" for label, row in table.items()]
        sel = table["DDTree B=64, DFlash2 selector"]["tokens_per_round"]
        lines += ["", f"At B = 64: selector / DFlash2 marginals "
                  f"{sel / table['DDTree B=64, DFlash2 marginals']['tokens_per_round']:.3f}x "
                  "(issue target >= 1.1x); selector / DFlash2 chain "
                  f"{sel / table['DFlash2 chain (selector walk)']['tokens_per_round']:.3f}x "
                  "(target >= 1.3x).", "", f"command: `{data['command']}`", ""]
        for kind in ("DFlash marginals", "DFlash2 marginals", "DFlash2 selector"):
            ax.plot(BUDGETS, [table[f"DDTree B={b}, {kind}"]["tokens_per_round"]
                              for b in BUDGETS], marker="o", label=f"DDTree, {kind}, T={t}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(BUDGETS, [str(b) for b in BUDGETS])
    ax.set_xlabel("tree budget B (nodes per round)")
    ax.set_ylabel("tokens committed per round")
    ax.legend(fontsize=7)
    fig.tight_layout()
    out = Path(args.out_dir)
    fig.savefig(out / "acceptance_dflash2.png", dpi=120)
    (out / "acceptance_dflash2.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--dflash2", required=True, help="a trained DFlash2 drafter directory")
    r.add_argument("--temperature", type=non_negative_float, default=0.0)
    r.add_argument("--prompts", type=int_arg(1, HUMANEVAL_PROBLEMS), default=40)
    r.add_argument("--max-new-tokens", type=positive_int, default=128)
    r.add_argument("--threads", type=positive_int, default=1)
    r.add_argument("--device", default="cpu", help="cpu or cuda")
    r.add_argument("--out", required=True)
    p = sub.add_parser("report")
    p.add_argument("inputs", nargs="+")
    p.add_argument("--out-dir", default="evals/results")
    args = parser.parse_args(argv)
    run(args) if args.cmd == "run" else report(args)


if __name__ == "__main__":
    main()
