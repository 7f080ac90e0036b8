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
    (trailing whitespace ignored). ``first_line_match`` checks the first line only.

    Graded, on the completion's first ``len(expected lines)`` lines against the expected
    ones (each joined by newlines, trailing whitespace stripped, 0 when the completion
    does not start a new line): ``edit_similarity``, difflib's
    ``SequenceMatcher.ratio`` (2 * matched characters / total characters, 0..1), and
    ``chrf``, sacreBLEU's character n-gram F-score (chrF, beta 2) divided by 100."""
    want = [line.rstrip() for line in target.split("\n")[1:]]
    if not completion.startswith("\n"):
        return {"exact_match": 0.0, "first_line_match": 0.0, "edit_similarity": 0.0,
                "chrf": 0.0}
    got = [line.rstrip() for line in completion.split("\n")[1:1 + len(want)]]
    return {
        "exact_match": float(got == want),
        "first_line_match": float(bool(got) and got[0] == want[0]),
        **graded_similarity("\n".join(got), "\n".join(want)),
    }


def graded_similarity(got: str, want: str) -> dict[str, float]:
    """``{"edit_similarity", "chrf"}`` of ``got`` against ``want``, each in 0..1."""
    from difflib import SequenceMatcher

    from sacrebleu.metrics import CHRF

    edit = SequenceMatcher(None, got, want, autojunk=False).ratio() if got or want else 1.0
    chrf = CHRF().sentence_score(got, [want]).score / 100.0
    return {"edit_similarity": float(edit), "chrf": float(chrf)}


def agreement_results(doc: dict, results: list[str]) -> dict[str, float]:
    """lm-eval ``process_results`` of ``ddtree_target_agreement``: ``exact_match`` of the
    whole continuation with the target's own (trailing whitespace ignored), and the
    graded ``edit_similarity`` / ``chrf`` of the two texts."""
    got, want = results[0].rstrip(), doc["target"].rstrip()
    return {"exact_match": float(got == want), **graded_similarity(got, want)}


def synthetic_results(doc: dict, results: list[str]) -> dict[str, float]:
    """lm-eval ``process_results`` of ``ddtree_synthetic``: ``exact_match`` when the
    completion starts with the answer and does not go on with the same token (no
    further digit, letter or closing bracket right after it); ``edit_similarity`` of
    the answer and the completion's first ``len(answer)`` characters."""
    got, want = results[0], doc["target"]
    after = got[len(want):len(want) + 1]
    exact = got.startswith(want) and not (after.isalnum() or (after and after in ")]}_"))
    return {"exact_match": float(exact),
            "edit_similarity": graded_similarity(got[:len(want)], want)["edit_similarity"]}


def completion_results(doc: dict, results: list[str]) -> dict[str, float]:
    """lm-eval ``process_results`` of the completion and long-context tasks."""
    return next_lines_match(results[0], doc["target"])
