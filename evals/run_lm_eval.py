"""lm-eval's own command line, with ``--model ddtree-ref`` registered and ``evals/tasks``
on the include path (lm-eval has no plugin entry point for models).

    python evals/run_lm_eval.py --model ddtree-ref --model_args method=ddtree budget=32 \\
        --tasks ddtree_humaneval --limit 5 --confirm_run_unsafe_code
    python evals/run_lm_eval.py ls tasks          # lists the ddtree_* tasks too

Every argument goes to lm-eval (``lm-eval run --help``); ``--include_path evals/tasks``
is added unless given. ``--model vllm`` needs no wrapper: plain ``lm-eval`` loads the
vLLM plugin, whose front end accepts ``method: ddtree``.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TASKS_DIR = REPO / "evals" / "tasks"


def main() -> None:
    """Register ``ddtree-ref``, then hand over to ``lm_eval``'s CLI."""
    from lm_eval.__main__ import cli_evaluate

    import vllm_ddtree.evaluation.ref_lm  # noqa: F401  (registers ddtree-ref)

    if "--include_path" not in sys.argv:
        sys.argv += ["--include_path", str(TASKS_DIR)]
    cli_evaluate()


if __name__ == "__main__":
    main()
