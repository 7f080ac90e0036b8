"""Patch ``vllm.engine.arg_utils.EngineArgs._set_default_max_num_seqs_and_batched_tokens_args``
(vLLM 0.26.0): batch limits that fit a DDTree tree.

vLLM reserves ``max_num_new_slots_for_drafting * max_num_seqs`` of the step's token budget
for drafting (``VllmConfig._set_max_num_scheduled_tokens``, ``config/vllm.py:1689-1736``;
DDTree reserves ``block_size - 2`` a request, ``patches/drafting_slots.py``), and a tree
decode schedules ``1 + B`` tokens a request. With vLLM's defaults on an H100 / H200
(``vllm serve``: 1,024 sequences, 8,192 tokens, ``arg_utils.py:2460-2469``) the
reservation alone exceeds the budget and the engine refuses to start. Where the user did
not set a limit, DDTree chooses it so that every running request can verify its whole tree
in each step, and logs the choice; where the user's limits cannot schedule even one tree,
the error names the budget and the fix.
"""

from __future__ import annotations

import logging

from vllm_ddtree.patches._guard import mark_patched, require_vllm_version

PATCHED_FUNCTION = (
    "vllm.engine.arg_utils.EngineArgs._set_default_max_num_seqs_and_batched_tokens_args")
# Set on the EngineArgs by the DDTree front end (patches/speculative_config.py):
# (tree budget B, drafter block_size).
TREE_SHAPE_ATTR = "_ddtree_tree_shape"

# a child of vLLM's "vllm" logger, so the note shows in `vllm serve`'s log
logger = logging.getLogger("vllm.ddtree.batch_defaults")


def fit_batch_to_tree(budget: int, block_size: int, max_num_seqs: int,
                      max_num_batched_tokens: int, seqs_set: bool, tokens_set: bool,
                      ) -> tuple[int, int, str | None]:
    """Batch limits for a tree of ``budget`` nodes drafted in blocks of ``block_size``.

    A request needs ``1 + budget`` scheduled tokens to verify its tree and reserves
    ``block_size - 2`` drafting slots. Limits the user did not set (``seqs_set`` /
    ``tokens_set`` False) are lowered (sequences) or raised (tokens) so that all
    ``max_num_seqs`` requests verify in one step; limits the user set are kept.

    Returns:
        ``(max_num_seqs, max_num_batched_tokens, note)``: ``note`` says what changed
        (None: nothing).

    Raises:
        ValueError: the user's limits leave fewer than ``1 + budget`` schedulable
            tokens, so no tree could ever be verified, or fewer tokens than the drafter's
            block pass takes with every sequence (``max_num_seqs * block_size``).
    """
    from vllm_ddtree.config import DDTreeConfigError

    verify = 1 + budget
    slots = max(0, block_size - 2)
    per_request = verify + slots
    seqs, tokens = max_num_seqs, max_num_batched_tokens
    if not tokens_set and tokens < slots + verify:
        tokens = slots + verify
    if not seqs_set:
        seqs = max(1, min(seqs, tokens // per_request))
    elif not tokens_set:
        tokens = max(tokens, seqs * per_request)
    if tokens - seqs * slots < verify:
        raise DDTreeConfigError(
            f"DDTree with num_speculative_tokens={budget} (drafter block_size {block_size}) "
            f"needs max_num_batched_tokens - max_num_seqs * {slots} >= {verify} (one tree "
            f"verified per step), but max_num_batched_tokens={tokens} and max_num_seqs="
            f"{seqs} leave {tokens - seqs * slots}: raise --max-num-batched-tokens to at "
            f"least {seqs * per_request}, lower --max-num-seqs, or lower "
            f"num_speculative_tokens")
    if tokens < seqs * block_size:  # the drafter's block pass: block_size rows a request
        raise DDTreeConfigError(
            f"DDTree's drafter (block_size {block_size}) drafts every running request in "
            f"one pass of {block_size} rows each, but max_num_seqs={seqs} x {block_size} = "
            f"{seqs * block_size} exceeds max_num_batched_tokens={tokens}: raise "
            f"--max-num-batched-tokens to at least {seqs * block_size} or lower "
            f"--max-num-seqs to at most {tokens // block_size}")
    if (seqs, tokens) == (max_num_seqs, max_num_batched_tokens):
        return seqs, tokens, None
    note = (f"DDTree (num_speculative_tokens={budget}, drafter block_size {block_size}): "
            f"max_num_seqs {max_num_seqs} -> {seqs}, max_num_batched_tokens "
            f"{max_num_batched_tokens} -> {tokens}, so that every running request verifies "
            f"its {verify} tree tokens in each step (set --max-num-seqs / "
            f"--max-num-batched-tokens to choose them yourself)")
    return seqs, tokens, note


def apply() -> None:
    require_vllm_version(PATCHED_FUNCTION)
    from vllm.engine.arg_utils import EngineArgs

    original = EngineArgs._set_default_max_num_seqs_and_batched_tokens_args
    if getattr(original, "_ddtree_patched", False):
        return

    def _set_default_max_num_seqs_and_batched_tokens_args(self, usage_context, model_config,
                                                          parallel_config):
        seqs_set = self.max_num_seqs is not None
        tokens_set = self.max_num_batched_tokens is not None
        original(self, usage_context, model_config, parallel_config)
        shape = getattr(self, TREE_SHAPE_ATTR, None)
        if shape is None:
            return
        self.max_num_seqs, self.max_num_batched_tokens, note = fit_batch_to_tree(
            *shape, self.max_num_seqs, self.max_num_batched_tokens, seqs_set, tokens_set)
        if note is not None:
            logger.info(note)

    mark_patched(_set_default_max_num_seqs_and_batched_tokens_args, original)
    EngineArgs._set_default_max_num_seqs_and_batched_tokens_args = (
        _set_default_max_num_seqs_and_batched_tokens_args)
