"""lm-eval's own command line, with ``--model ddtree-ref`` registered and ``evals/tasks``
on the include path (lm-eval has no plugin entry point for models).

    python evals/run_lm_eval.py --model ddtree-ref --model_args method=ddtree budget=32 \\
        --tasks ddtree_humaneval --limit 5 --confirm_run_unsafe_code
    python evals/run_lm_eval.py ls tasks          # lists the ddtree_* tasks too

Every argument goes to lm-eval (``lm-eval run --help``); ``--include_path evals/tasks``
is added unless given. ``--model vllm`` needs no wrapper: plain ``lm-eval`` loads the
vLLM plugin, whose front end accepts ``method: ddtree``.

Before lm-eval indexes its tasks, the model args are checked (:func:`model_args_error`):
a bad one exits with status 2 and a message naming it and its value.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TASKS_DIR = REPO / "evals" / "tasks"


def _lm_eval_args(argv: list[str]):
    """``argv`` parsed by lm-eval's own parser (``sys.argv`` is left as it was)."""
    from lm_eval._cli import HarnessCLI

    saved = sys.argv
    sys.argv = list(argv)
    try:
        return HarnessCLI().parse_args()
    finally:
        sys.argv = saved


def _speculative_config(value) -> dict:
    """A ``speculative_config`` model arg: a dict, or its JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            pass
    if not isinstance(value, dict):
        raise ValueError(f"speculative_config={value!r} is not allowed: a JSON object")
    return value


def model_args_error(argv: list[str]) -> str | None:
    """The error in ``--model_args``, or None: ``ddtree-ref``'s arguments
    (:func:`vllm_ddtree.evaluation.ref_args.check_ref_lm_args`, ``--device`` too);
    for ``vllm``, a ``speculative_config`` as the DDTree front end parses it
    (:func:`vllm_ddtree.config.split_ddtree_spec`). No model loads."""
    args = _lm_eval_args(argv)
    model, model_args = getattr(args, "model", None), getattr(args, "model_args", None) or {}
    try:
        if model == "ddtree-ref":
            from vllm_ddtree.evaluation.ref_args import check_ref_lm_args

            device = getattr(args, "device", None)
            check_ref_lm_args({**model_args, **({"device": device} if device else {})})
        elif model == "vllm" and "speculative_config" in model_args:
            from vllm_ddtree.config import split_ddtree_spec

            split_ddtree_spec(_speculative_config(model_args["speculative_config"]))
    except ValueError as err:
        return f"argument --model_args: {err}"
    return None


def main() -> None:
    """Register ``ddtree-ref``, check the model args, then hand over to ``lm_eval``'s CLI."""
    from lm_eval.__main__ import cli_evaluate

    import vllm_ddtree.evaluation.ref_lm  # noqa: F401  (registers ddtree-ref)

    error = model_args_error(sys.argv)
    if error:
        print(f"{Path(sys.argv[0]).name}: error: {error}", file=sys.stderr)
        raise SystemExit(2)
    if "--include_path" not in sys.argv:
        sys.argv += ["--include_path", str(TASKS_DIR)]
    cli_evaluate()


if __name__ == "__main__":
    main()
