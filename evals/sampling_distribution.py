"""Does DDTree sample the target's distribution? A two-sample test on short continuations.

    python evals/sampling_distribution.py --backend vllm --samples 2000      # GPU
    python evals/sampling_distribution.py --backend ref --samples 200 --top-p 1 \\
        --prompts 1 --lossy-rate 1.0 --out /tmp/sd.md                       # CPU, small

Seeded speculative sampling cannot be checked token by token against plain decoding
(vLLM's DFlash and DDTree draw other streams than plain decoding from the same seeds),
so this checks the distribution: for each prompt, ``--samples`` continuations of
``--positions`` tokens at ``--temperature`` / ``--top-p`` from plain decoding (arm
``ar``), from DDTree (arm ``ddtree``) and from DDTree with the lossy verifier of
``vllm_ddtree.testing.lossy_verifier`` (arm ``lossy``, rate ``--lossy-rate``; 0 leaves
the arm out). Every arm draws with its own seeds (independent samples). Per prompt and
position, a chi-square test of homogeneity compares the arm's token histogram with
plain decoding's (2 x k table; tokens whose pooled count is below ``MIN_POOLED`` share
one tail bin). An arm is rejected when any of its p-values is below
``--alpha / (prompts * positions)`` (Bonferroni); DDTree must not be rejected, the lossy
arm must be. Power: with 2,000 samples per arm and 4 prompts x 3 positions (Bonferroni
level 0.01 / 12), a shift of about 7 % of a position's probability mass between two
tokens is detected 80 % of the time (a 3 % shift: under 10 %); the lossy verifier moves
at most ``rate`` of it (only rounds where the target's token is not the drafter's first
child change), so the GPU stage uses rate 0.25; a 2 % rate would need about 20,000 to
100,000 samples per arm. Position 1 comes from the prefill (no verification), so its
tests cannot differ but count in the Bonferroni denominator (conservative).

Backends: ``vllm`` (``LLM()`` in this process, bf16 on the embedded pair, one engine
without and one with DDTree; the lossy arm patches the DDTree engine's verifier) and
``ref`` (the fp32 reference engine on the CPU; it has no top-p: ``--top-p`` must be 1).
The report goes to ``--out`` (markdown) and a PNG beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "evals"))

from cli_args import fraction, positive_int  # noqa: E402

MIN_POOLED = 10  # a token seen fewer times in both arms together goes to the tail bin
OUT = REPO / "evals" / "results" / "sampling_distribution.md"
PROMPTS = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "import os\nimport sys\n\n\ndef main(argv):\n",
    "class Queue:\n    def __init__(self, maxsize=0):\n        self.maxsize = maxsize\n",
    "    for key, value in sorted(items.items()):\n",
]
SEED_BASE = {"ar": 0, "ddtree": 1_000_000, "lossy": 2_000_000}


def homogeneity_test(a: list[int], b: list[int]) -> dict:
    """Chi-square test that two samples of tokens come from one distribution: a 2 x k
    table of counts, tokens with fewer than ``MIN_POOLED`` pooled draws in one tail bin.
    Returns ``{"chi2", "dof", "p", "bins"}`` (p = 1 when only one bin is left)."""
    from scipy.stats import chi2_contingency

    ca, cb = Counter(a), Counter(b)
    kept = sorted(t for t in set(ca) | set(cb) if ca[t] + cb[t] >= MIN_POOLED)
    rows = [[ca[t] for t in kept], [cb[t] for t in kept]]
    tail_a = len(a) - sum(rows[0])
    tail_b = len(b) - sum(rows[1])
    if tail_a + tail_b:
        rows[0].append(tail_a)
        rows[1].append(tail_b)
    if len(rows[0]) < 2:
        return {"chi2": 0.0, "dof": 0, "p": 1.0, "bins": len(rows[0])}
    result = chi2_contingency(rows, correction=False)
    return {"chi2": float(result.statistic), "dof": int(result.dof),
            "p": float(result.pvalue), "bins": len(rows[0])}


def sample_ref(prompts: list[list[int]], arm: str, args) -> list[list[list[int]]]:
    """``[prompt][sample] -> tokens`` from the reference engine (fp32, CPU)."""
    from vllm_ddtree.demo.reference_engine import load_embedded_pair
    from vllm_ddtree.reference import generate
    from vllm_ddtree.testing.lossy_verifier import lossy_reference

    pair = sample_ref.pair = getattr(sample_ref, "pair", None) or load_embedded_pair()
    method = "ar" if arm == "ar" else "ddtree"
    rate = args.lossy_rate if arm == "lossy" else 0.0
    out = []
    with lossy_reference(rate, seed=args.seed):
        for ids in prompts:
            out.append([generate(pair.target, pair.drafter if method != "ar" else None, ids,
                                 args.positions, method, budget=args.budget,
                                 temperature=args.temperature,
                                 seed=SEED_BASE[arm] + args.seed * 10_000_000 + i).tokens
                         for i in range(args.samples)])
    return out


def sample_vllm(prompts: list[list[int]], arms: list[str], args) -> dict:
    """``{arm: [prompt][sample] -> tokens}`` through ``vllm.LLM`` (engine in this process)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams
    from vllm.compilation.monitor import set_cudagraph_capturing_enabled
    from vllm.inputs import TokensPrompt

    from vllm_ddtree.demo.reference_engine import CHECKPOINTS
    from vllm_ddtree.testing.lossy_verifier import apply_in_worker, apply_lossy_verifier

    # A fixed 2 GiB KV cache: no start-up memory profiling, so it can share a GPU.
    common = dict(model=str(CHECKPOINTS / "target"), dtype="bfloat16", max_model_len=1024,
                  max_num_seqs=32, gpu_memory_utilization=0.05,
                  kv_cache_memory_bytes=2 << 30, seed=args.seed)
    spec = {"method": "ddtree", "model": str(CHECKPOINTS / "drafter"),
            "num_speculative_tokens": args.budget}
    results = {}

    def draw(llm, arm):
        requests, params = [], []
        for ids in prompts:
            for i in range(args.samples):
                requests.append(TokensPrompt(prompt_token_ids=ids))
                params.append(SamplingParams(temperature=args.temperature, top_p=args.top_p,
                                             max_tokens=args.positions, ignore_eos=True,
                                             seed=SEED_BASE[arm] + args.seed * 10_000_000 + i))
        outs = llm.generate(requests, params, use_tqdm=False)
        flat = [list(o.outputs[0].token_ids) for o in outs]
        results[arm] = [flat[k * args.samples:(k + 1) * args.samples]
                        for k in range(len(prompts))]

    apply_lossy_verifier(0.0)
    for extra, names in (({}, ["ar"]), ({"speculative_config": spec},
                                        [a for a in arms if a != "ar"])):
        # A second engine in this process must be allowed to capture CUDA graphs
        # (see evals/validate.py, _run_vllm).
        set_cudagraph_capturing_enabled(True)
        llm = LLM(**common, **extra)
        for arm in names:
            rate = args.lossy_rate if arm == "lossy" else 0.0
            if extra:
                apply_lossy_verifier(rate, args.seed)
                llm.collective_rpc(apply_in_worker, args=(rate, args.seed))
            draw(llm, arm)
        del llm
        import gc

        import torch

        gc.collect()
        torch.cuda.empty_cache()
    return results


def analyse(samples: dict, args) -> dict:
    """Per arm (other than ``ar``), prompt and position: the homogeneity test against
    ``ar``; the arm's verdict at the Bonferroni level."""
    tests = {}
    for arm in samples:
        if arm == "ar":
            continue
        rows = []
        for k, (got, ref) in enumerate(zip(samples[arm], samples["ar"], strict=True)):
            for j in range(args.positions):
                a = [s[j] for s in ref if len(s) > j]
                b = [s[j] for s in got if len(s) > j]
                rows.append({"prompt": k, "position": j + 1, **homogeneity_test(a, b)})
        level = args.alpha / max(1, len(rows))
        tests[arm] = {"rows": rows, "level": level,
                      "rejected": any(r["p"] < level for r in rows)}
    return tests


def report(tests: dict, args, seconds: float, command: str) -> str:
    lines = ["# Sampling distribution: DDTree against plain decoding", "",
             f"command: `{command}`", "",
             f"Backend `{args.backend}`, temperature {args.temperature}, top-p {args.top_p}, "
             f"{args.samples} samples per prompt and arm, first {args.positions} tokens, "
             f"B = {args.budget}, lossy rate {args.lossy_rate}; {seconds:.0f} s. "
             f"Chi-square test of homogeneity per prompt and position (tokens with fewer "
             f"than {MIN_POOLED} pooled draws in one tail bin); an arm is rejected when a "
             f"p-value is below alpha / tests (alpha {args.alpha}). Position 1 comes from "
             "the prefill (no verification); later positions from verified rounds.", ""]
    for arm, t in tests.items():
        want = "not rejected" if arm == "ddtree" else "rejected"
        ok = (not t["rejected"]) if arm == "ddtree" else t["rejected"]
        lines += [f"## `{arm}`: {'rejected' if t['rejected'] else 'not rejected'} "
                  f"(expected: {want}) -> **{'PASS' if ok else 'FAIL'}**", "",
                  f"level {t['level']:.2e}", "",
                  "| prompt | position | chi2 | dof | bins | p-value |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {r['prompt']} | {r['position']} | {r['chi2']:.1f} | {r['dof']} | "
                  f"{r['bins']} | {r['p']:.3g} |" for r in t["rows"]]
        lines.append("")
    return "\n".join(lines)


def plot(tests: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(7, 3.5))
    for n, (arm, t) in enumerate(tests.items()):
        p = np.array([max(r["p"], 1e-300) for r in t["rows"]])
        ax.bar(np.arange(len(p)) + 0.4 * n, -np.log10(p), width=0.4, label=arm)
        ax.axhline(-np.log10(t["level"]), color="grey", ls="--", lw=0.8)
    ax.set_xlabel("prompt x position")
    ax.set_ylabel("-log10 p (homogeneity with AR)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=["vllm", "ref"], default="vllm")
    p.add_argument("--samples", type=positive_int, default=2000)
    p.add_argument("--prompts", type=int, choices=range(1, len(PROMPTS) + 1),
                   default=len(PROMPTS), metavar=f"1..{len(PROMPTS)}")
    p.add_argument("--positions", type=positive_int, default=3)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-p", type=fraction, default=0.95)
    p.add_argument("--budget", type=positive_int, default=32)
    p.add_argument("--lossy-rate", type=fraction, default=0.25)
    p.add_argument("--alpha", type=fraction, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    if not args.temperature > 0:
        p.error(f"argument --temperature: {args.temperature} is not allowed: > 0 (sampling)")
    if args.backend == "ref" and args.top_p != 1.0:
        p.error(f"argument --top-p: {args.top_p} is not allowed with --backend ref: 1 "
                "(the reference engine has no top-p)")
    return args


def run(args, command: str = "") -> dict:
    """Sample every arm, test, write the report; returns the tests."""
    from transformers import AutoTokenizer

    from vllm_ddtree.demo.reference_engine import CHECKPOINTS

    tok = AutoTokenizer.from_pretrained(str(CHECKPOINTS / "target"))
    prompts = [tok.encode(p.rstrip(), add_special_tokens=False)
               for p in PROMPTS[:args.prompts]]
    arms = ["ar", "ddtree"] + (["lossy"] if args.lossy_rate > 0 else [])
    start = time.perf_counter()
    if args.backend == "ref":
        samples = {arm: sample_ref(prompts, arm, args) for arm in arms}
    else:
        samples = sample_vllm(prompts, arms, args)
    tests = analyse(samples, args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report(tests, args, time.perf_counter() - start, command))
    plot(tests, args.out.with_suffix(".png"))
    args.out.with_suffix(".json").write_text(json.dumps(tests, indent=1))
    return tests


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = "python evals/sampling_distribution.py " + " ".join(
        sys.argv[1:] if argv is None else argv)
    tests = run(args, command)
    for arm, t in tests.items():
        print(f"{arm}: {'rejected' if t['rejected'] else 'not rejected'} "
              f"(smallest p {min(r['p'] for r in t['rows']):.3g}, level {t['level']:.2e})")
    ok = not tests["ddtree"]["rejected"] and all(
        t["rejected"] for arm, t in tests.items() if arm == "lossy")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
