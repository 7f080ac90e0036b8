"""Per-document metrics of the local lm-eval tasks (lm-eval ``process_results``)."""

from __future__ import annotations

from vllm_ddtree.evaluation.code_exec import DEFAULT_TIMEOUT_S, humaneval_program, run_program


def humaneval_pass(doc: dict, completion: str, timeout: float = DEFAULT_TIMEOUT_S) -> bool:
    """True when ``doc["prompt"] + completion`` passes the problem's tests."""
    program = humaneval_program(doc["prompt"], completion, doc["test"], doc["entry_point"])
    return run_program(program, timeout)


def humaneval_results(doc: dict, results: list[str]) -> dict[str, float]:
    """lm-eval ``process_results`` of ``ddtree_humaneval``: ``{"pass@1": 0.0 or 1.0}``."""
    return {"pass@1": float(humaneval_pass(doc, results[0]))}


def next_lines_match(completion: str, target: str) -> dict[str, float]:
    """Exact match of the next lines: ``target`` is ``"\\n"`` + the expected lines;
    the completion must start a new line and its first lines must equal them
    (trailing whitespace ignored). ``first_line_match`` checks the first line only."""
    want = [line.rstrip() for line in target.split("\n")[1:]]
    if not completion.startswith("\n"):
        return {"exact_match": 0.0, "first_line_match": 0.0}
    got = [line.rstrip() for line in completion.split("\n")[1:1 + len(want)]]
    return {
        "exact_match": float(got == want),
        "first_line_match": float(bool(got) and got[0] == want[0]),
    }


def completion_results(doc: dict, results: list[str]) -> dict[str, float]:
    """lm-eval ``process_results`` of the completion and long-context tasks."""
    return next_lines_match(results[0], doc["target"])
