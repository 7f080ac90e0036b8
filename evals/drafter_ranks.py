# SPDX-License-Identifier: Apache-2.0
"""Rank of the target's greedy token in the embedded drafter's per-depth distributions
(CPU, reference engine), the table the ``v2lite`` setup's oracle drafter draws from.

    python evals/drafter_ranks.py --prompts 32 --prompt-len 256 --new-tokens 128

The embedded pair (``vllm_ddtree/checkpoints``, fp32) decodes code prompts
(``e2e_models.code_prompts``: standard-library source, 256 tokens, inside the target's
512-token training window) greedily with DDTree B = 64 on the reference engine. At every
round the drafter's logits ``[L, V]`` of depths 1..L (L = 15) are kept; once the output
is known, the true token of depth d is the target's greedy token at the root position +
d, and its rank is the number of tokens with a larger logit at that depth. A round whose
depths run past the known output is dropped.

Writes ``evals/data/drafter_ranks.json``: ``vectors`` (one string per round, one
character per depth: ``0-9a-v`` = ranks 0..31, ``x`` = rank >= 32, i.e. out of reach of
the trees benchmarked), ``top1_prob`` (mean top-1 probability per depth, also over the
rounds whose true token ranks first, ``top1_prob_rank0``, and the others,
``top1_prob_missed``), per-depth rank histograms, ``calibration`` (what the best-first
tree of b nodes promises by the drafter's own probabilities against what it commits,
means by budget: the oracle's logits are fitted to it), the chain's and DDTree B = 64's
measured tokens per round, and the command.
Drawing whole vectors (not depth by depth) keeps the correlation between depths: an easy
passage is easy at every depth.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

EVALS = Path(__file__).resolve().parent
REPO = EVALS.parent
for _p in (str(EVALS), str(REPO)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from cli_args import positive_int  # noqa: E402

TABLE_PATH = EVALS / "data" / "drafter_ranks.json"
# Budgets of the calibration curve: what the drafter's own probabilities promise a tree
# of b nodes commits (``budget.choice.expected_committed_by_budget``, what auto's device
# cut trusts) against what it commits.
CALIBRATION_BUDGETS = (1, 2, 4, 8, 16, 32, 64)
RANK_CAP = 32  # ranks >= this are stored as "beyond" (RANK_CHARS[RANK_CAP])
RANK_CHARS = "0123456789abcdefghijklmnopqrstuvx"  # 0..31, then "x" = beyond


def encode_ranks(ranks: list[int]) -> str:
    """Ranks of one round (ints >= 0) -> its string (ranks >= RANK_CAP as ``x``)."""
    out = []
    for i, r in enumerate(ranks):
        if not isinstance(r, int) or isinstance(r, bool) or r < 0:
            raise ValueError(f"ranks[{i}]={r!r} is not allowed: an int >= 0")
        out.append(RANK_CHARS[min(r, RANK_CAP)])
    return "".join(out)


def decode_ranks(text: str) -> list[int]:
    """A round's string -> ranks (``x`` -> RANK_CAP, meaning "beyond")."""
    bad = [c for c in text if c not in RANK_CHARS]
    if bad:
        raise ValueError(f"rank vector {text!r}: characters {sorted(set(bad))} are not "
                         f"allowed: one of {RANK_CHARS!r} per depth")
    return [RANK_CHARS.index(c) for c in text]


def load_table(path: Path = TABLE_PATH) -> dict:
    """The stored table, checked: every vector has ``depths`` characters."""
    data = json.loads(Path(path).read_text())
    depths = data.get("depths")
    vectors = data.get("vectors")
    if not isinstance(depths, int) or depths < 1 or not vectors:
        raise ValueError(f"{path}: depths={depths!r} / {len(vectors or [])} vectors is not "
                         "allowed: an int >= 1 and at least one vector")
    for i, v in enumerate(vectors):
        if len(decode_ranks(v)) != depths:
            raise ValueError(f"{path}: vectors[{i}]={v!r} has {len(v)} depths, not {depths}")
    return data


def chain_accepted(ranks: list[int]) -> int:
    """Depth a greedy chain accepts: the leading depths whose true token ranks first."""
    n = 0
    for r in ranks:
        if r != 0:
            break
        n += 1
    return n


def rank_of(logits_row, token: int) -> int:
    """How many tokens have a larger logit than ``token`` (float ``[V]``)."""
    return int((logits_row > logits_row[token]).sum())


def calibration(logits, truth: list[int], budgets=CALIBRATION_BUDGETS,
                ) -> tuple[list[float], list[int]]:
    """One round's calibration: for each budget b, the committed tokens the drafter's
    probabilities promise the best-first tree of b nodes (1 + the b largest node
    probabilities) and those it commits (1 + the depth of ``truth`` in it). ``logits``
    float ``[L, V]`` of depths 1..L; ``truth`` the L true tokens."""
    from vllm_ddtree.budget.choice import expected_committed_by_budget, mask_inactive_nodes
    from vllm_ddtree.testing.oracle import true_path_depth
    from vllm_ddtree.tree.draft_tree import build_ddtree

    tree = build_ddtree(logits[None].float(), max(budgets))
    promised = expected_committed_by_budget(tree.scores)[0]
    parents = tree.parents[0].tolist()
    got = []
    for b in budgets:
        tokens = mask_inactive_nodes(tree.tokens, promised.new_tensor([b]))[0].tolist()
        got.append(1 + true_path_depth(tokens, parents, truth))
    return [float(promised[b - 1]) for b in budgets], got


def measure(pair, prompts: list[list[int]], new_tokens: int, budget: int,
            progress: bool = True) -> dict:
    """Rank vectors, top-1 probabilities and tokens per round over ``prompts``."""
    import torch
    from tqdm import tqdm

    from vllm_ddtree.reference import generate

    drafter = pair.drafter
    seen: list[tuple[int, torch.Tensor]] = []
    original = drafter.block_logits

    def recording(bonus, position, context, embed, lm_head):
        logits = original(bonus, position, context, embed, lm_head)
        seen.append((position, logits.detach().clone()))
        return logits

    vectors, probs, committed, promised, got = [], [], [], [], []
    drafter.block_logits = recording
    try:
        for prompt in tqdm(prompts, desc="prompts", disable=not progress):
            seen.clear()
            with torch.no_grad():
                out = generate(pair.target, drafter, prompt, new_tokens, "ddtree", budget)
            committed += [s.committed for s in out.stats]
            truth = list(prompt) + list(out.tokens)
            for position, logits in seen:
                depths = logits.shape[0]
                if position + depths >= len(truth):
                    continue
                true = truth[position + 1: position + 1 + depths]
                vectors.append([rank_of(logits[d], true[d]) for d in range(depths)])
                probs.append(torch.softmax(logits, -1).max(-1).values.tolist())
                p, g = calibration(logits, true)
                promised.append(p)
                got.append(g)
    finally:
        drafter.block_logits = original
    return {"vectors": vectors, "probs": probs, "committed": committed,
            "promised": promised, "got": got}


def top1_prob_split(vectors: list[list[int]], probs: list[list[float]]
                    ) -> tuple[list[float | None], list[float | None]]:
    """Mean top-1 probability per depth over the rounds whose true token ranks first,
    and over the others (None where a depth has no such round)."""
    right, wrong = [], []
    for d in range(len(vectors[0])):
        hit = [p[d] for v, p in zip(vectors, probs, strict=True) if v[d] == 0]
        miss = [p[d] for v, p in zip(vectors, probs, strict=True) if v[d] != 0]
        right.append(round(sum(hit) / len(hit), 4) if hit else None)
        wrong.append(round(sum(miss) / len(miss), 4) if miss else None)
    return right, wrong


def calibration_curve(promised: list[list[float]], got: list[list[int]],
                      budgets=CALIBRATION_BUDGETS) -> dict:
    """Means over rounds of :func:`calibration`: ``{"budgets", "promised", "committed"}``."""
    n = len(promised)
    return {"budgets": list(budgets),
            "promised": [round(sum(p[i] for p in promised) / n, 3) for i in range(len(budgets))],
            "committed": [round(sum(g[i] for g in got) / n, 3) for i in range(len(budgets))]}


def summarize(measured: dict, command: str, prompt_len: int, new_tokens: int,
              budget: int) -> dict:
    """The stored table (see the module docstring) from :func:`measure`'s output."""
    vectors = measured["vectors"]
    if not vectors:
        raise ValueError("no complete round measured: more prompts or new tokens")
    depths = len(vectors[0])
    hist = [[0] * (RANK_CAP + 1) for _ in range(depths)]
    for v in vectors:
        for d, r in enumerate(v):
            hist[d][min(r, RANK_CAP)] += 1
    n = len(vectors)
    top1 = [sum(p[d] for p in measured["probs"]) / n for d in range(depths)]
    committed = measured["committed"]
    right, wrong = top1_prob_split(vectors, measured["probs"])
    return {
        "command": command,
        "date": time.strftime("%Y-%m-%d"),
        "pair": "vllm_ddtree/checkpoints (embedded trained pair, fp32, reference engine)",
        "prompts": f"code, {prompt_len} tokens; {new_tokens} new tokens, greedy, "
                   f"DDTree B = {budget} rounds",
        "depths": depths,
        "rank_cap": RANK_CAP,
        "rounds": n,
        "top1_prob": [round(p, 4) for p in top1],
        "rank0_share": [round(hist[d][0] / n, 4) for d in range(depths)],
        "top1_prob_rank0": right,
        "top1_prob_missed": wrong,
        "calibration": calibration_curve(measured["promised"], measured["got"]),
        "rank_hist": hist,
        "tokens_per_round": {
            f"ddtree-{budget} (measured)": round(sum(committed) / len(committed), 3),
            "chain (leading rank-0 depths + 1)": round(
                sum(chain_accepted(v) + 1 for v in vectors) / n, 3),
        },
        "vectors": [encode_ranks(v) for v in vectors],
    }


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=positive_int, default=32, help="code prompts")
    p.add_argument("--prompt-len", type=positive_int, default=256)
    p.add_argument("--new-tokens", type=positive_int, default=128)
    p.add_argument("--budget", type=positive_int, default=64, help="DDTree B of the rounds")
    p.add_argument("--out", default=str(TABLE_PATH))
    args = p.parse_args(argv)
    if args.prompt_len + args.new_tokens > 512:
        p.error(f"--prompt-len {args.prompt_len} + --new-tokens {args.new_tokens} is not "
                "allowed: at most 512 (the embedded target's training window)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    from e2e_models import code_prompts

    from vllm_ddtree.demo.reference_engine import load_embedded_pair

    torch.set_num_threads(2)
    pair = load_embedded_pair()
    prompts = code_prompts(pair.tokenizer, args.prompts, args.prompt_len)
    measured = measure(pair, prompts, args.new_tokens, args.budget)
    command = "python " + shlex.join(
        ["evals/drafter_ranks.py"] + (list(argv) if argv is not None else sys.argv[1:]))
    table = summarize(measured, command, args.prompt_len, args.new_tokens, args.budget)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps({k: v for k, v in table.items() if k != "vectors"}, indent=1)
    Path(args.out).write_text(text[:-2] + ',\n "vectors": '
                              + json.dumps(table["vectors"]) + "\n}\n")
    print(json.dumps({k: table[k] for k in ("rounds", "top1_prob", "rank0_share",
                                            "top1_prob_rank0", "top1_prob_missed",
                                            "calibration", "tokens_per_round")}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
