"""Acceptance of DFlash (chain) and DDTree on HumanEval prompts, reference engine.

    python evals/acceptance_humaneval.py run --temperature 0 --out evals/results/acc_t0.json
    python evals/acceptance_humaneval.py run --temperature 1 --out evals/results/acc_t1.json
    python evals/acceptance_humaneval.py report evals/results/acc_t0.json evals/results/acc_t1.json

``run`` decodes every prompt with each method on the embedded pair (fp32, CPU or
CUDA) and stores per-round stats: the DFlash chain and DDTree at each ``--budgets``
value over the embedded DFlash drafter's marginals. ``--dflash2 DIR`` (a trained
``DFlash2DraftModel``) adds the DFlash2 chain (the selector's walk) and DDTree at each
budget over the DFlash2 marginals and over the DFlash2 selector scores. Every method
must return the first one's tokens (lossless check).

``report`` writes ``acceptance_humaneval.md`` and a PNG into ``--out-dir``
(``acceptance_dflash2.md`` / ``.png`` when the runs include a DFlash2 drafter, with the
selector / DFlash2 marginals and selector / DFlash2 chain ratios at B = 64). Mean
acceptance length = tokens committed per round (accepted depth + 1), prefill excluded.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from cli_args import device_arg, int_arg, non_negative_float, positive_int

from vllm_ddtree.demo import HUMANEVAL_PROBLEMS

BUDGETS = (16, 32, 64, 128)
CHAIN = "DFlash chain (15)"
DFLASH2_CHAIN = "DFlash2 chain (selector walk)"


def runs_of(budgets: list[int], dflash2: bool) -> list[tuple[str, str, str, int, str | None]]:
    """The decodes of one prompt, in order: ``(label, drafter "dflash" | "dflash2",
    method, budget, draft_scores)``; the DFlash2 ones only with ``dflash2``."""
    runs = [(CHAIN, "dflash", "dflash", 1, None)]
    runs += [(f"DDTree B={b}", "dflash", "ddtree", b, None) for b in budgets]
    if dflash2:
        runs.append((DFLASH2_CHAIN, "dflash2", "dflash2", 1, None))
        for scores in ("marginals", "selector"):
            runs += [(f"DDTree B={b}, DFlash2 {scores}", "dflash2", "ddtree", b, scores)
                     for b in budgets]
    return runs


def run(args) -> None:
    import torch
    from tqdm import tqdm

    from vllm_ddtree.demo.reference_engine import humaneval_prompts, load_embedded_pair
    from vllm_ddtree.reference import generate

    torch.set_num_threads(args.threads)
    pair = load_embedded_pair()
    if pair.tokenizer is None:
        sys.exit("no embedded trained pair: acceptance would be meaningless")
    drafters = {"dflash": pair.drafter.to(args.device)}
    if args.dflash2:
        from vllm_ddtree.reference.dflash2 import DFlash2DraftModel
        from vllm_ddtree.training.common import load_drafter

        drafters["dflash2"] = load_drafter(args.dflash2, torch.float32, args.device)
        if not isinstance(drafters["dflash2"], DFlash2DraftModel):
            sys.exit(f"--dflash2 {args.dflash2}: not a DFlash2DraftModel checkpoint")
    target = pair.target.to(args.device)
    prompts = [pair.tokenizer.encode(p) for p in humaneval_prompts(args.prompts)]
    rows = []
    start = time.time()
    for i, prompt in enumerate(tqdm(prompts, desc=f"T={args.temperature}")):
        first = None
        for label, kind, method, budget, scores in runs_of(args.budgets, bool(args.dflash2)):
            out = generate(target, drafters[kind], prompt, args.max_new_tokens, method,
                           budget=budget, temperature=args.temperature, seed=i,
                           eos_token_id=pair.tokenizer.eos_token_id, draft_scores=scores)
            first = out.tokens if first is None else first
            rows.append({
                "prompt": i, "label": label,
                "committed": [s.committed for s in out.stats],
                "depth": [s.accepted_depth for s in out.stats],
                "tokens": len(out.tokens), "same_as_first": out.tokens == first,
            })
    Path(args.out).write_text(json.dumps({
        "temperature": args.temperature, "max_new_tokens": args.max_new_tokens,
        "prompts": len(prompts), "budgets": args.budgets,
        "dflash2": str(args.dflash2) if args.dflash2 else None, "device": args.device,
        "threads": args.threads, "seconds": time.time() - start, "rows": rows,
        "command": " ".join(sys.argv),
    }))


def summarize(data: dict) -> dict[str, dict]:
    """Per method label: mean acceptance length and accepted depth over all rounds of
    all prompts, the number of rounds, and whether every prompt matched the first
    method's tokens."""
    table = {}
    for label, *_ in runs_of(data["budgets"], bool(data["dflash2"])):
        rows = [r for r in data["rows"] if r["label"] == label]
        committed = [c for r in rows for c in r["committed"]]
        depths = [d for r in rows for d in r["depth"]]
        table[label] = {
            "mean_acceptance_length": sum(committed) / max(1, len(committed)),
            "mean_accepted_depth": sum(depths) / max(1, len(depths)),
            "rounds": len(committed),
            "identical_tokens": all(r["same_as_first"] for r in rows),
        }
    return table


def _where(data: dict) -> str:
    if data["device"] != "cpu":
        return data["device"]
    return f"{data['threads']} CPU core" + ("s" if data["threads"] > 1 else "")


def _ratios(table: dict[str, dict], budgets: list[int]) -> str:
    """The selector / DFlash2 marginals and selector / DFlash2 chain ratios at B = 64
    (the largest budget run when 64 was not)."""
    b = 64 if 64 in budgets else max(budgets)
    length = {label: row["mean_acceptance_length"] for label, row in table.items()}
    sel = length[f"DDTree B={b}, DFlash2 selector"]
    return (f"At B = {b}: selector / DFlash2 marginals "
            f"{sel / length[f'DDTree B={b}, DFlash2 marginals']:.3f}x (target >= 1.1x); "
            f"selector / DFlash2 chain {sel / length[DFLASH2_CHAIN]:.3f}x (target >= 1.3x).")


def report(args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [json.loads(Path(p).read_text()) for p in args.inputs]
    with_dflash2 = any(data["dflash2"] for data in runs)
    lines = ["# Acceptance on HumanEval, embedded pair, reference engine", "",
             "Mean acceptance length = tokens committed per round (accepted depth + 1), "
             "prefill excluded; HumanEval prompts (trailing whitespace stripped), EOS "
             "stops. `identical` = every method produced the chain's tokens (lossless "
             "check).", ""]
    if with_dflash2:
        lines += ["`DDTree B=N` builds over the embedded DFlash drafter's marginals; the "
                  "DFlash2 rows use the DFlash2 drafter named in each heading.", ""]
    fig, ax = plt.subplots(figsize=(7, 4.5) if with_dflash2 else (6, 4))
    for data in runs:
        t, budgets = data["temperature"], data["budgets"]
        table = summarize(data)
        chain = table[CHAIN]["mean_acceptance_length"]
        drafter = f"; DFlash2 drafter `{data['dflash2']}`" if data["dflash2"] else ""
        lines += [f"## T = {t} ({data['prompts']} prompts, up to "
                  f"{data['max_new_tokens']} new tokens, {data['seconds'] / 60:.1f} min on "
                  f"{_where(data)}{drafter})", "",
                  "| method | mean acceptance length | vs chain | mean accepted depth | rounds "
                  "| identical |", "|---|---|---|---|---|---|"]
        for name, row in table.items():
            lines.append(f"| {name} | {row['mean_acceptance_length']:.3f} | "
                         f"{row['mean_acceptance_length'] / chain:.2f}x | "
                         f"{row['mean_accepted_depth']:.3f} | {row['rounds']} | "
                         f"{row['identical_tokens']} |")
        if data["dflash2"]:
            lines += ["", _ratios(table, budgets)]
        lines += ["", f"command: `{data['command']}`", ""]
        # (label suffix, legend, the chain drawn in the same colour)
        curves = [("", "DDTree", CHAIN, "DFlash chain")]
        if data["dflash2"]:
            curves = [("", "DDTree, DFlash marginals", CHAIN, "DFlash chain"),
                      (", DFlash2 marginals", "DDTree, DFlash2 marginals", None, None),
                      (", DFlash2 selector", "DDTree, DFlash2 selector", DFLASH2_CHAIN,
                       "DFlash2 chain")]
        for suffix, legend, chain_label, chain_legend in curves:
            (line,) = ax.plot(
                budgets, [table[f"DDTree B={b}{suffix}"]["mean_acceptance_length"]
                          for b in budgets], marker="o", label=f"{legend}, T={t}")
            if chain_label is not None:
                ax.axhline(table[chain_label]["mean_acceptance_length"], linestyle="--",
                           color=line.get_color(), label=f"{chain_legend}, T={t}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tree budget B (nodes per round)")
    ax.set_ylabel("tokens committed per round")
    ax.legend(fontsize=7 if with_dflash2 else None)
    fig.tight_layout()
    out = Path(args.out_dir)
    name = "acceptance_dflash2" if with_dflash2 else "acceptance_humaneval"
    fig.savefig(out / f"{name}.png", dpi=120)
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--temperature", type=non_negative_float, default=0.0)
    r.add_argument("--prompts", type=int_arg(1, HUMANEVAL_PROBLEMS), default=HUMANEVAL_PROBLEMS)
    r.add_argument("--max-new-tokens", type=positive_int, default=128)
    r.add_argument("--budgets", type=positive_int, nargs="+", default=list(BUDGETS),
                   help="DDTree tree budgets (nodes per round)")
    r.add_argument("--dflash2", help="a trained DFlash2 drafter directory: adds the DFlash2 "
                   "chain and DDTree over its marginals and its selector scores")
    r.add_argument("--threads", type=positive_int, default=1)
    r.add_argument("--device", type=device_arg, default="cpu")
    r.add_argument("--out", required=True)
    p = sub.add_parser("report")
    p.add_argument("inputs", nargs="+")
    p.add_argument("--out-dir", default="evals/results")
    args = parser.parse_args(argv)
    run(args) if args.cmd == "run" else report(args)


if __name__ == "__main__":
    main()
