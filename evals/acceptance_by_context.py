"""Acceptance of the DFlash chain and DDTree against prompt length, reference engine.

    python evals/acceptance_by_context.py                      # the embedded pair
    python evals/acceptance_by_context.py --checkpoints /tmp/ckpt --out-dir /tmp/acc \
        --compare-to evals/results/acceptance_by_context.json   # + the shipping gate

A pair is only worth shipping when it accepts at the contexts it is measured at: the
pair trained on 512-token windows accepted 2.9 tokens per round at 384-token prompts and
1.3 at 1024 (its target fell apart past ~600 tokens of relative distance). For each
prompt length, ``--prompts`` disjoint slices of standard-library source
(``e2e_models.code_prompts``, what ``bench_e2e``'s code prompts are) are decoded
greedily (fp32) with the chain and DDTree at each budget; every method must produce
the chain's tokens. Also the target's own loss by position on the longest prompts
(where a target trained on short windows breaks). Writes
``acceptance_by_context.{md,png,json}`` into ``--out-dir``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

BUCKET = 128  # positions per bucket of the target-loss table


def measure(pair, lengths: list[int], num_prompts: int, new_tokens: int,
            budgets: list[int], progress: bool = True) -> dict:
    """Per (length, method): committed tokens of every round and whether the tokens
    equal the chain's; the target's mean loss per ``BUCKET`` positions on the longest
    prompts. A JSON-able dict."""
    import torch
    from e2e_models import code_prompts
    from tqdm import tqdm

    from vllm_ddtree.reference import generate

    methods = [("dflash", 0)] + [("ddtree", b) for b in budgets]
    eos = pair.tokenizer.eos_token_id
    rows = []
    prompts = {n: code_prompts(pair.tokenizer, num_prompts, n) for n in lengths}
    bar = tqdm(total=len(lengths) * num_prompts * len(methods), desc="decode",
               disable=not progress)
    for length in lengths:
        for i, prompt in enumerate(prompts[length]):
            chain_tokens = None
            for method, budget in methods:
                out = generate(pair.target, pair.drafter, prompt, new_tokens, method,
                               budget=max(budget, 1), eos_token_id=eos)
                chain_tokens = out.tokens if chain_tokens is None else chain_tokens
                rows.append({"length": length, "prompt": i, "method": method,
                             "budget": budget, "committed": [s.committed for s in out.stats],
                             "same_as_chain": out.tokens == chain_tokens})
                bar.update(1)
    bar.close()
    longest = max(lengths)
    sums: dict[int, list[float]] = {}
    for prompt in prompts[longest]:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            logits = pair.target(input_ids=ids).logits[0].float()
        nll = torch.nn.functional.cross_entropy(logits[:-1], ids[0, 1:], reduction="none")
        for lo in range(0, longest - 1, BUCKET):
            sums.setdefault(lo, []).append(float(nll[lo:lo + BUCKET].mean()))
    loss = {f"{lo}-{lo + BUCKET - 1}": sum(v) / len(v) for lo, v in sums.items()}
    return {"rows": rows, "target_loss_by_position": loss, "lengths": lengths,
            "prompts": num_prompts, "new_tokens": new_tokens, "budgets": budgets}


def summarize(result: dict) -> list[dict]:
    """One entry per (length, method): mean committed tokens per round, rounds, and
    whether every prompt's tokens equal the chain's."""
    out = []
    keys = sorted({(r["length"], r["method"], r["budget"]) for r in result["rows"]},
                  key=lambda k: (k[0], k[1] != "dflash", k[2]))
    for length, method, budget in keys:
        rows = [r for r in result["rows"]
                if (r["length"], r["method"], r["budget"]) == (length, method, budget)]
        committed = [c for r in rows for c in r["committed"]]
        out.append({"length": length, "method": method, "budget": budget,
                    "mean_committed": sum(committed) / max(1, len(committed)),
                    "rounds": len(committed),
                    "identical": all(r["same_as_chain"] for r in rows)})
    return out


def compare_to_reference(candidate: dict, reference: dict, short_max: int = 512,
                         short_floor: float = 0.95, long_gain: float = 1.2) -> dict:
    """The shipping gate of a new pair against the shipped one (two ``measure`` results).

    For every (length, method) cell both measured: ``ratio`` = candidate / reference mean
    committed tokens per round. Passes when every cell up to ``short_max`` tokens keeps
    ``ratio >= short_floor`` (the short prompts the shipped pair is good at; a small
    sample, hence the tolerance) and every longer cell has ``ratio >= long_gain``.
    Returns ``{"cells": [...], "passed": bool}``; each cell holds length, method name,
    both means, the ratio, the bound it must meet and ``ok``."""
    ref = {(s["length"], method_name(s["method"], s["budget"])): s["mean_committed"]
           for s in summarize(reference)}
    cells = []
    for s in summarize(candidate):
        key = (s["length"], method_name(s["method"], s["budget"]))
        if key not in ref:
            continue
        ratio = s["mean_committed"] / ref[key]
        bound = short_floor if s["length"] <= short_max else long_gain
        cells.append({"length": key[0], "method": key[1], "candidate": s["mean_committed"],
                      "reference": ref[key], "ratio": ratio, "bound": bound,
                      "ok": ratio >= bound})
    if not cells:
        raise ValueError("no (length, method) cell measured in both results: use the "
                         "same --lengths and --budgets as the reference")
    return {"cells": cells, "passed": all(c["ok"] for c in cells)}


def gate_markdown(gate: dict, reference_name: str) -> str:
    """The gate as a markdown table with its verdict."""
    lines = [f"## Against {reference_name}", "",
             "| length | method | this pair | reference | ratio | needs | ok |",
             "|---|---|---|---|---|---|---|"]
    for c in gate["cells"]:
        lines.append(f"| {c['length']} | {c['method']} | {c['candidate']:.2f} | "
                     f"{c['reference']:.2f} | {c['ratio']:.2f} | >= {c['bound']:.2f} | "
                     f"{'yes' if c['ok'] else '**no**'} |")
    lines += ["", f"gate: {'PASSED' if gate['passed'] else 'FAILED'}", ""]
    return "\n".join(lines)


def method_name(method: str, budget: int) -> str:
    return "DFlash chain" if method == "dflash" else f"DDTree B={budget}"


def write_report(result: dict, out_dir: Path, command: str) -> None:
    """``acceptance_by_context.md`` (tables) and ``.png`` (acceptance against length)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = summarize(result)
    lengths = result["lengths"]
    names = list(dict.fromkeys(method_name(s["method"], s["budget"]) for s in summary))
    cell = {(method_name(s["method"], s["budget"]), s["length"]): s for s in summary}
    lines = [
        f"# Acceptance against prompt length: {result.get('pair', 'pair')}, reference engine",
        "",
        f"Mean committed tokens per round (accepted depth + 1, prefill excluded); "
        f"{result['prompts']} prompts of standard-library source per length "
        f"(`e2e_models.code_prompts`), {result['new_tokens']} new tokens, greedy, fp32. "
        "`identical`: every method produced the chain's tokens.",
        "",
        f"command: `{command}`",
        "",
        "| method | " + " | ".join(str(n) for n in lengths) + " |",
        "|---|" + "---|" * len(lengths),
    ]
    for name in names:
        lines.append(f"| {name} | " + " | ".join(
            f"{cell[name, n]['mean_committed']:.2f}" for n in lengths) + " |")
    identical = all(s["identical"] for s in summary)
    lines += ["", f"identical tokens in every cell: {identical}", "",
              "Target loss (nats per token) by position on the longest prompts:", "",
              "| positions | " + " | ".join(result["target_loss_by_position"]) + " |",
              "|---|" + "---|" * len(result["target_loss_by_position"]),
              "| loss | " + " | ".join(f"{v:.2f}" for v in
                                       result["target_loss_by_position"].values()) + " |", ""]
    (out_dir / "acceptance_by_context.md").write_text("\n".join(lines))
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in names:
        ax.plot(lengths, [cell[name, n]["mean_committed"] for n in lengths], marker="o",
                label=name)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("tokens per round")
    ax.set_title("Acceptance against context, reference engine")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "acceptance_by_context.png", dpi=120)
    plt.close(fig)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoints", default=str(REPO / "vllm_ddtree" / "checkpoints"),
                   help="folder with target/ and drafter/ (default: the embedded pair)")
    p.add_argument("--lengths", type=int, nargs="+", default=[128, 256, 384, 512, 768, 1024])
    p.add_argument("--prompts", type=int, default=4, help="prompts per length")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--budgets", type=int, nargs="+", default=[32, 64])
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    p.add_argument("--out-dir", default=str(REPO / "evals" / "results"))
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--compare-to", default=None,
                   help="acceptance_by_context.json of the shipped pair: append the "
                   "shipping gate (compare_to_reference) and exit 1 when it fails")
    p.add_argument("--yarn-factor", type=float, default=None,
                   help="serve the target with YaRN of this factor over its 512-token "
                   "window (vllm_ddtree/long_context.py), drafter unchanged")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from vllm_ddtree.demo.reference_engine import load_embedded_pair

    if args.threads:
        torch.set_num_threads(args.threads)
    checkpoints = Path(args.checkpoints)
    if not (checkpoints / "target" / "config.json").exists():
        sys.exit(f"--checkpoints {checkpoints}: no target/config.json there")
    label = checkpoints
    if args.yarn_factor:
        import tempfile

        from vllm_ddtree.long_context import write_rope_scaled_pair, yarn_parameters

        checkpoints = write_rope_scaled_pair(
            checkpoints, Path(tempfile.mkdtemp(prefix="acceptance_yarn_")),
            yarn_parameters(args.yarn_factor))
    pair = load_embedded_pair(checkpoints)
    start = time.time()
    result = measure(pair, sorted(args.lengths), args.prompts, args.new_tokens, args.budgets,
                     progress=not args.no_progress)
    try:
        result["pair"] = str(label.resolve().relative_to(REPO))
    except ValueError:
        result["pair"] = str(label)
    if args.yarn_factor:
        result["pair"] += f", target with YaRN x{args.yarn_factor:g}"
    result["seconds"] = round(time.time() - start, 1)
    command = "python evals/acceptance_by_context.py " + " ".join(argv or sys.argv[1:])
    result["command"] = command.strip()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "acceptance_by_context.json").write_text(json.dumps(result, indent=1))
    write_report(result, out_dir, result["command"])
    report = out_dir / "acceptance_by_context.md"
    passed = True
    if args.compare_to:
        gate = compare_to_reference(result, json.loads(Path(args.compare_to).read_text()))
        report.write_text(report.read_text() + "\n" + gate_markdown(gate, args.compare_to))
        passed = gate["passed"]
    print(report.read_text())
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
