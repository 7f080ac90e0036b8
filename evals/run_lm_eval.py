"""lm-eval's own command line, with ``--model ddtree-ref`` registered and ``evals/tasks``
on the include path (lm-eval has no plugin entry point for models).

    python evals/run_lm_eval.py --model ddtree-ref --model_args method=ddtree budget=32 \\
        --tasks ddtree_humaneval --limit 5 --confirm_run_unsafe_code
    python evals/run_lm_eval.py ls tasks          # lists the ddtree_* tasks too

Every argument goes to lm-eval (``lm-eval run --help``); ``--include_path evals/tasks``
is added unless given. With ``DDTREE_PENDING_PATCHES=1`` (``--model vllm`` only)
DDTree's vLLM runner integration still pending GPU validation
(``patches.PENDING_GPU_VALIDATION``) is applied in this process, and the engine is
kept in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so that the patches apply.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TASKS_DIR = REPO / "evals" / "tasks"


def main() -> None:
    """Register ``ddtree-ref``, then hand over to ``lm_eval``'s CLI."""
    if os.environ.get("DDTREE_PENDING_PATCHES") == "1":
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        sys.path.insert(0, str(REPO))
        from patches import apply_pending_gpu_validation

        print(f"[run_lm_eval] applied patches: {apply_pending_gpu_validation()}",
              file=sys.stderr)
    from lm_eval.__main__ import cli_evaluate

    import vllm_ddtree.evaluation.ref_lm  # noqa: F401  (registers ddtree-ref)

    if "--include_path" not in sys.argv:
        sys.argv += ["--include_path", str(TASKS_DIR)]
    cli_evaluate()


if __name__ == "__main__":
    main()
