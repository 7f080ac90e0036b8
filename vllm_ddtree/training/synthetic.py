"""Exact-answer Python snippets: training text that teaches in-context copying and simple
algorithms, and the documents of the ``ddtree_synthetic`` and ``ddtree_copy`` lm-eval
tasks.

Four kinds, each a short module (well inside the target's 512-token training windows)
whose last line is completed by a unique answer:

- ``copy``: a function of 2-6 arguments whose body sets an accumulator from one argument,
  then updates it in 3-10 statements (``acc = acc OP x`` or ``acc = x OP acc``, ``x`` an
  argument drawn with replacement in random order or a small literal; ``//`` and ``%``
  by a nonzero literal; some under ``if acc > x:``) and returns it; the function is then
  redefined under a new name with the same signature and the answer is its body, copied
  line for line. Since the operands do not follow the header, only reading the first
  body gives the copy. Answers are 25-117 tokens (mean 53) with the shipped tokenizer
  over the 100 ``ddtree_copy`` documents, without a blank line (tasks stop at one).
- ``lookup``: a dict literal of identifiers to ints, then ``assert TABLE[key] == ``;
  the answer is the value (1-3 tokens).
- ``brackets``: a nested literal of lists, tuples and dicts cut after its last atom; the
  answer closes every bracket (2-6 tokens).
- ``sort``: ``assert sorted([...]) == ``; the answer is the sorted list (12-24
  tokens).

Training (``python -m vllm_ddtree.training.corpus --synthetic-docs N``) draws documents
with seeds ``0..N-1``: every other one a copy, the others lookup, brackets and sort in
turn (copy, lookup, copy, brackets, copy, sort, ...), since the long copies are what a
lossy verifier is caught on and the hardest to learn. The tasks draw with seeds from
``EVAL_SEED_BASE`` on, and the trainer's checkpoint selection (``selection_docs``) from
``SELECT_SEED_BASE`` on: three disjoint ranges, so neither the training nor the
selection sees a task document. Identifiers come from a fixed word list, so all share
the vocabulary but not the documents.
"""

from __future__ import annotations

import random

__all__ = ["EVAL_SEED_BASE", "KINDS", "SELECT_SEED_BASE", "eval_docs", "make_doc",
           "selection_docs", "training_kind", "training_texts"]

KINDS = ("copy", "lookup", "brackets", "sort")
EVAL_SEED_BASE = 10**9
SELECT_SEED_BASE = 10**8
WORDS = ("name", "value", "path", "mode", "size", "timeout", "encoding", "errors", "buffer",
         "parent", "level", "flags", "prefix", "suffix", "data", "count", "offset", "limit",
         "stream", "handler", "key", "default", "callback", "context", "options", "host",
         "port", "user", "index", "result", "state", "owner", "line", "start", "end", "text",
         "items", "total", "width", "height", "depth", "weight", "label", "token", "chunk")
_CLOSE = {"[": "]", "(": ")", "{": "}"}


def _ident(rng: random.Random, n: int) -> list[str]:
    return rng.sample(WORDS, n)


def _copy_operand(rng: random.Random, args: list[str]) -> str:
    """An argument, or now and then a small int literal."""
    return str(rng.randint(2, 9)) if rng.random() < 0.15 else rng.choice(args)


def _copy_line(rng: random.Random, acc: str, args: list[str], indent: str) -> str:
    """One line ``acc = acc OP X`` or ``acc = X OP acc`` after ``indent``; floor division
    and modulo only by a nonzero literal, so every body is defined for any int arguments."""
    op = rng.choice(("+", "-", "*", "+", "-", "*", "//", "%"))
    if op in ("//", "%"):
        return f"{indent}{acc} = {acc} {op} {rng.randint(2, 9)}"
    x = _copy_operand(rng, args)
    left, right = (acc, x) if rng.random() < 0.5 else (x, acc)
    return f"{indent}{acc} = {left} {op} {right}"


def _copy(rng: random.Random) -> tuple[str, str]:
    args = _ident(rng, rng.randint(2, 6))
    acc = rng.choice([w for w in WORDS if w not in args])
    # Operands are drawn with replacement in random order: the copy must be read back
    # from the first body, not rebuilt from the header.
    body = [f"    {acc} = {rng.choice(args)}"]
    for _ in range(rng.randint(3, 10)):
        if rng.random() < 0.2:
            body.append(f"    if {acc} > {_copy_operand(rng, args)}:")
            body.append(_copy_line(rng, acc, args, " " * 8))
        else:
            body.append(_copy_line(rng, acc, args, " " * 4))
    body.append(f"    return {acc}")
    name, copy = rng.sample([f"{w}_{v}" for w in ("get", "make", "compute", "read")
                             for v in WORDS], 2)
    header = f"({', '.join(args)}):"
    prompt = (f"def {name}{header}\n" + "\n".join(body) + "\n\n\n"
              f"# {copy} is {name} under another name\ndef {copy}{header}")
    return prompt, "\n" + "\n".join(body)


def _lookup(rng: random.Random) -> tuple[str, str]:
    keys = _ident(rng, rng.randint(4, 8))
    values = [rng.randint(0, 999) for _ in keys]
    table = ",\n".join(f'    "{k}": {v}' for k, v in zip(keys, values, strict=True))
    k = rng.randrange(len(keys))
    return f'TABLE = {{\n{table},\n}}\nassert TABLE["{keys[k]}"] ==', f" {values[k]}"


def _brackets(rng: random.Random) -> tuple[str, str]:
    text, stack = "x = ", []
    for _ in range(rng.randint(3, 6)):
        if stack and stack[-1] == "{":  # a value inside a dict needs its key
            text += f'"{rng.choice(WORDS)}": '
        opener = rng.choice("[({")
        stack.append(opener)
        text += opener + (f'"{rng.choice(WORDS)}": ' if opener == "{" else "")
        text += f"{rng.randint(0, 99)}, "
    text = text[:-2]
    return text, "".join(_CLOSE[o] for o in reversed(stack))


def _sort(rng: random.Random) -> tuple[str, str]:
    values = [rng.randint(0, 99) for _ in range(rng.randint(4, 8))]
    return f"assert sorted({values}) ==", f" {sorted(values)}"


_MAKERS = {"copy": _copy, "lookup": _lookup, "brackets": _brackets, "sort": _sort}


def make_doc(kind: str, seed: int) -> tuple[str, str]:
    """``(prompt, answer)`` of one document of ``kind`` drawn with ``seed``."""
    if kind not in _MAKERS:
        raise ValueError(f"kind={kind!r} is not allowed: one of {', '.join(KINDS)}")
    return _MAKERS[kind](random.Random(f"{kind}:{seed}"))


def training_kind(i: int) -> str:
    """The kind of training document ``i``: ``copy`` at even ``i``, the other kinds in
    turn at odd ``i`` (half of the documents are copies)."""
    others = KINDS[1:]
    return "copy" if i % 2 == 0 else others[(i // 2) % len(others)]


def training_texts(n: int, seed: int = 0) -> dict[str, str]:
    """``n`` documents (kinds by ``training_kind``) as training files
    ``{"synthetic/<kind>_<i>.py": prompt + answer + "\\n"}``, seeds ``seed..seed + n - 1``."""
    out = {}
    for i in range(n):
        kind = training_kind(i)
        prompt, answer = make_doc(kind, seed + i)
        out[f"synthetic/{kind}_{i}.py"] = prompt + answer + "\n"
    return out


def eval_docs(per_kind: int = 25, kinds: tuple[str, ...] = KINDS) -> list[dict]:
    """A task's documents: ``{"kind", "context", "target"}``, ``per_kind`` of each of
    ``kinds``, seeds from ``EVAL_SEED_BASE`` (``ddtree_synthetic``: 25 of every kind;
    ``ddtree_copy``: 100 copies)."""
    return [{"kind": kind, "context": prompt, "target": answer}
            for kind in kinds for i in range(per_kind)
            for prompt, answer in [make_doc(kind, EVAL_SEED_BASE + i)]]


def selection_docs(per_kind: int = 64) -> list[tuple[str, str, str]]:
    """``(kind, prompt, answer)`` of ``per_kind`` documents of each kind, seeds from
    ``SELECT_SEED_BASE``: the held-out answers a trainer selects its checkpoint on."""
    return [(kind, *make_doc(kind, SELECT_SEED_BASE + i))
            for kind in KINDS for i in range(per_kind)]
