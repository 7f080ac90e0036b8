"""Patch ``vllm.v1.core.sched.scheduler.Scheduler.__init__`` (vLLM 0.26.0): DDTree's
KV lookahead.

For DFlash the scheduler allocates ``num_lookahead_tokens = B + 1`` slots past the
scheduled tokens (``scheduler.py:254-258``) for the drafter's query block. DDTree's
block is the drafter's ``block_size`` tokens placed right after the last committed
token, so it needs ``block_size`` lookahead slots whatever B is
(``vllm_ddtree.runtime_state.ddtree_lookahead_tokens``): B + 1 is too few when
B < block_size - 1 and wastes KV for large B. ``AsyncScheduler`` inherits
``__init__``, so both schedulers are covered.
"""

from __future__ import annotations

from vllm_ddtree.patches._guard import mark_patched, require_vllm_version

PATCHED_FUNCTION = "vllm.v1.core.sched.scheduler.Scheduler.__init__ (num_lookahead_tokens)"


def apply() -> None:
    require_vllm_version(PATCHED_FUNCTION)
    from vllm.v1.core.sched.scheduler import Scheduler

    original = Scheduler.__init__
    if getattr(original, "_ddtree_patched", False):
        return

    def __init__(self, vllm_config, *args, **kwargs):
        original(self, vllm_config, *args, **kwargs)
        from vllm_ddtree.runtime_state import (
            ddtree_config_of,
            ddtree_lookahead_tokens,
            drafter_block_size,
        )

        spec = vllm_config.speculative_config
        if ddtree_config_of(spec) is not None:
            self.num_lookahead_tokens = ddtree_lookahead_tokens(drafter_block_size(spec))

    mark_patched(__init__, original)
    Scheduler.__init__ = __init__
