"""Build ``evals/tasks/data/target_agreement.json`` for the ``ddtree_target_agreement``
lm-eval task: held-out standard-library contexts and the shipped target's own greedy
continuation of each (fp32, reference engine, CPU).

    python evals/make_target_agreement.py            # CPU, about 2 minutes

Why a task scored against the target itself: the embedded target cannot solve any
exact-answer task (measured on the CPU with greedy decoding: 0 of 20 ``__init__``
argument lists copied into ``self.x = x`` lines, 0 of 16 repeated 8-line blocks, 0 of 12
periodic 2-line blocks continued, 0 of 67 held-out cut points completed 2 lines
exactly), so a lossy verifier cannot lower a ground-truth metric that is already 0.
Here the answer is what the target alone writes: the plain-decoding baseline scores
1.0 in fp32 by construction (less in bf16, where ties part from the fp32 text), and
every token a verifier commits against the target's choice lowers the exact match of
its document. It measures agreement with the target, not ability; rebuild it whenever
the shipped pair changes (``tests/test_lm_eval_lossy.py`` fails until then).

Documents: the first ``--docs`` contexts of ``ddtree_stdlib_completion`` (48 held-out
lines each), continuations of ``--tokens`` tokens (EOS ends one early). Contexts and
continuations are stored as text, so the task does not depend on the Python that runs
it.

``--context-tokens N`` makes the long variant (``ddtree_target_agreement_16k``): held-out
files concatenated to N tokens (the contexts of ``ddtree_long_context``), continued by
the target served with YaRN ``--yarn-factor`` (``vllm_ddtree.long_context``), stored
gzipped:

    python evals/make_target_agreement.py --context-tokens 16384 --yarn-factor 64 \
        --docs 24 --tokens 32 --out evals/tasks/data/target_agreement_16k.json.gz
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "evals"))

from cli_args import non_negative_int, positive_float, positive_int  # noqa: E402

OUT = REPO / "evals" / "tasks" / "data" / "target_agreement.json"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--docs", type=positive_int, default=96)
    p.add_argument("--tokens", type=positive_int, default=128)
    p.add_argument("--context-tokens", type=non_negative_int, default=0,
                   help="long contexts of this many tokens (0: the completion contexts)")
    p.add_argument("--yarn-factor", type=positive_float, default=None,
                   help="continue with the target served with YaRN of this factor")
    p.add_argument("--out", type=Path, default=OUT, help="*.json, or *.json.gz (gzipped)")
    p.add_argument("--threads", type=positive_int, default=1,
                   help="CPU threads (fp32 sums, hence near-tie tokens, may change with it)")
    args = p.parse_args(argv)

    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    from vllm_ddtree.demo.reference_engine import CHECKPOINTS, load_embedded_pair
    from vllm_ddtree.evaluation.task_data import long_context_docs, stdlib_completion_docs
    from vllm_ddtree.long_context import write_rope_scaled, yarn_parameters
    from vllm_ddtree.reference import generate

    torch.set_num_threads(args.threads)
    pair = load_embedded_pair()
    tok, target = pair.tokenizer, pair.target
    if args.yarn_factor is not None:
        with tempfile.TemporaryDirectory() as tmp:
            scaled = write_rope_scaled(CHECKPOINTS / "target", Path(tmp) / "target",
                                       yarn_parameters(args.yarn_factor))
            target = AutoModelForCausalLM.from_pretrained(scaled, dtype=torch.float32).eval()
    contexts = (long_context_docs(tok, [args.context_tokens], args.docs)
                if args.context_tokens else stdlib_completion_docs()[:args.docs])
    docs, start = [], time.monotonic()
    for doc in tqdm(contexts, desc="target continuations"):
        ids = tok.encode(doc["context"], add_special_tokens=False)
        out = generate(target, None, ids, args.tokens, "ar", eos_token_id=tok.eos_token_id)
        docs.append({"file": doc["file"], "line": doc["line"], "context": doc["context"],
                     "context_tokens": len(ids),
                     "target": tok.decode(out.tokens, skip_special_tokens=True),
                     "target_tokens": len(out.tokens)})
    meta = {"command": "python evals/make_target_agreement.py " + " ".join(
                sys.argv[1:] if argv is None else argv),
            "tokens": args.tokens, "context_tokens": args.context_tokens,
            "yarn_factor": args.yarn_factor, "python": sys.version.split()[0],
            "pair": pair.label.replace(f"{REPO}/", "")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps({"meta": meta, "docs": docs}, indent=1) + "\n"
    if args.out.suffix == ".gz":
        # mtime 0: the same documents give the same bytes
        args.out.write_bytes(gzip.compress(text.encode(), mtime=0))
    else:
        args.out.write_text(text)
    print(f"{len(docs)} documents in {time.monotonic() - start:.0f} s -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
