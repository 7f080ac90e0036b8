"""The main job: the embedded pair on HumanEval prompts, AR vs DFlash vs DDTree."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from vllm_ddtree.cli_args import int_arg
from vllm_ddtree.config import MAX_BUDGET

HUMANEVAL_PROBLEMS = 164
# The embedded target has 4096 positions and the longest HumanEval prompt is 483 of
# its tokens: prompt + output fit.
MAX_NEW_TOKENS = 3072
LIMITS = {  # argument -> (lowest, highest, what the bound is)
    "num_prompts": (1, HUMANEVAL_PROBLEMS, f"HumanEval has {HUMANEVAL_PROBLEMS} problems"),
    "max_new_tokens": (1, MAX_NEW_TOKENS, "prompt + output fit the target's 4096 positions"),
    "budget": (1, MAX_BUDGET, "DDTree tree nodes per round"),
}


def check_demo_args(num_prompts, max_new_tokens, budget, where: str = "demo") -> None:
    """Each argument is an int within ``LIMITS``; raises ``ValueError`` naming it."""
    from vllm_ddtree.checks import check_int

    values = {"num_prompts": num_prompts, "max_new_tokens": max_new_tokens, "budget": budget}
    for field, value in values.items():
        lo, hi, note = LIMITS[field]
        check_int(where, field, value, lo, hi, note)


def demo_arg(field: str) -> Callable[[str], int]:
    """argparse ``type`` of a demo argument, bounded as ``LIMITS``."""
    return int_arg(*LIMITS[field])


def add_demo_args(parser: argparse.ArgumentParser) -> None:
    """``--prompts``, ``--max-new-tokens`` and ``--budget``, with their ranges."""
    parser.add_argument("--prompts", type=demo_arg("num_prompts"), default=3,
                        help="HumanEval prompts, 1..164")
    parser.add_argument("--max-new-tokens", type=demo_arg("max_new_tokens"), default=64)
    parser.add_argument("--budget", type=demo_arg("budget"), default=32,
                        help="DDTree nodes per round, 1..512")
