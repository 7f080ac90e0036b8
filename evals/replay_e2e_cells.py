"""Reference-engine acceptance along vLLM's own text, cell by cell of a bench_e2e run.

    python evals/replay_e2e_cells.py evals/results/e2e_trained_yarn.json \
        --out evals/results/e2e_trained_yarn_replay.md

A vLLM cell's accept len and the CPU reference engine's on "the same prompt" differ
as soon as the two greedy texts part at a bf16 argmax tie, and looping text makes that
difference large (vLLM 10.67 tokens per round for the chain on a prompt where the
reference's own text gave 4.92). For each cell of a trained setup whose AR row kept
its generated ids (``output_token_ids``; older bench_e2e rows lack them), this forces
the fp32 reference engine along vLLM AR's text (``vllm_ddtree.reference.replay``) with
the chain and with each fixed DDTree budget of the run, and sets its tokens per round
beside vLLM's: equal up to bf16 drafter noise when vLLM's drafter and tree see what the
reference's do.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from e2e_report import (  # noqa: E402
    ar_outputs,
    collapse_repeats,
    ctx_label,
    ok_rows,
    run_label,
    run_sort_key,
)


def replay_plan(rows: list[dict]) -> list[tuple[dict, list[list[int]]]]:
    """The speculative rows to replay with their cell's AR ids: measured, of a fixed
    budget (``auto`` picks its size per round, which replay cannot follow) or the
    chain, in cells whose AR row kept its ids; one per (run, cell) (the median repeat)."""
    rows = collapse_repeats(ok_rows(rows))
    ar = ar_outputs(rows)
    plan = []
    for r in rows:
        if r.get("method") not in ("dflash", "ddtree") or r.get("budget") == "auto":
            continue
        if str(r.get("run", "")).startswith("ddtree-auto"):
            continue
        ids = ar.get((r["context"], r["batch"], r["kind"]))
        if ids:
            plan.append((r, ids))
    return sorted(plan, key=lambda p: (p[0]["kind"], p[0]["context"], p[0]["batch"],
                                       run_sort_key(p[0])))


def replay_cells(data: dict, model_root: Path | None = None, progress: bool = True
                 ) -> list[dict]:
    """Per planned row: vLLM's accept len and the fp32 reference's along vLLM AR's
    text (mean tokens per round over every request of the cell)."""
    import torch
    from e2e_models import SETUPS, cell_seed, load_tokenizer, make_prompts, prepare_setup
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    from vllm_ddtree.reference import replay
    from vllm_ddtree.training.common import load_drafter

    setup = SETUPS[data["setup"]]
    if setup.dummy:
        raise SystemExit(f"setup {setup.name}: dummy weights have no meaningful text to replay")
    root = Path(model_root or tempfile.mkdtemp(prefix="replay_e2e_"))
    models = prepare_setup(setup, root)
    target = AutoModelForCausalLM.from_pretrained(models.target, dtype=torch.float32).eval()
    drafter = load_drafter(models.drafter, dtype=torch.float32)
    tokenizer = load_tokenizer(models.tokenizer_file)
    out = []
    plan = replay_plan(data["rows"])
    for r, ar_ids in tqdm(plan, desc="replayed cells", disable=not progress):
        context, batch, kind = r["context"], r["batch"], r["kind"]
        prompts = make_prompts(kind, batch, context, setup, tokenizer,
                               seed=cell_seed(context, batch))
        method = "dflash" if r["method"] == "dflash" else "ddtree"
        budget = int(r["budget"]) if method == "ddtree" else 1
        rounds: list[int] = []
        for prompt, ids in zip(prompts, ar_ids, strict=True):
            rounds += replay(target, drafter, prompt, ids, method, budget=budget)
        out.append({"run": r["run"], "label": run_label(r), "context": context,
                    "batch": batch, "kind": kind, "vllm_accept": r.get("acceptance_length"),
                    "reference_accept": sum(rounds) / len(rounds) if rounds else None,
                    "rounds": len(rounds)})
    return out


def markdown(results: list[dict], source: str, command: str) -> str:
    lines = ["# Reference replay along vLLM's AR text", "",
             f"Source: `{source}`. Command: `{command}`.", "",
             "vLLM accept len = 1 + accepted / drafts of the cell (its own greedy text); "
             "reference = tokens per round of the fp32 reference engine forced along vLLM "
             "AR's generated ids of the same cell (`reference.replay`). A ratio near 1 "
             "says vLLM's drafter and tree accept what the reference's do on that text.", "",
             "| prompts | ctx | batch | method | vLLM accept len | reference along vLLM's text | "
             "vLLM / reference | rounds |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        ratio = (r["vllm_accept"] / r["reference_accept"]
                 if r["vllm_accept"] and r["reference_accept"] else None)
        cells = [r["kind"], ctx_label(r["context"]), str(r["batch"]), r["label"],
                 f"{r['vllm_accept']:.2f}" if r["vllm_accept"] else "—",
                 f"{r['reference_accept']:.2f}" if r["reference_accept"] else "—",
                 f"{ratio:.2f}" if ratio else "—", str(r["rounds"])]
        lines.append("| " + " | ".join(cells) + " |")
    if not results:
        lines.append("| (no cell with AR's generated ids: rows of an older bench_e2e) "
                     "| | | | | | | |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json", help="an e2e_<setup>.json of bench_e2e.py")
    parser.add_argument("--out", default=None, help="markdown report (default: stdout only)")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    data = json.loads(Path(args.json).read_text())
    results = replay_cells(data, progress=not args.no_progress)
    command = "python evals/replay_e2e_cells.py " + " ".join(argv or sys.argv[1:])
    text = markdown(results, args.json, command.strip())
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
