"""The main job: the embedded pair on HumanEval prompts, AR vs DFlash vs DDTree."""

from __future__ import annotations

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
    from vllm_ddtree.reference.inputs import check_int

    values = {"num_prompts": num_prompts, "max_new_tokens": max_new_tokens, "budget": budget}
    for field, value in values.items():
        lo, hi, note = LIMITS[field]
        check_int(where, field, value, lo, hi, note)
