"""Patch ``vllm.v1.engine.input_processor.InputProcessor._validate_model_input`` (vLLM
0.26.0): with ``method: ddtree``, refuse a prompt token id outside the target's
vocabulary before the request reaches the engine.

vLLM refuses an id only above ``max(tokenizer.max_token_id, model vocab size - 1)``
(``input_processor.py:469-484``). Its cached tokenizer's ``max_token_id`` can be the
vocabulary *size* (4,096 for the embedded pair, whose ids end at 4,095), so id 4,096
passes, and the target's embedding lookup then fails inside the engine, which ends
it for every request it serves. Here the request gets a ``ValueError`` (HTTP 400 from
``vllm serve``) naming the id, its position and the allowed range.
"""

from __future__ import annotations

from vllm_ddtree.patches._guard import mark_patched, require_vllm_version

PATCHED_FUNCTION = "vllm.v1.engine.input_processor.InputProcessor._validate_model_input"


def check_prompt_ids_for_ddtree(vllm_config, prompt_ids) -> None:
    """Raise ``ValueError`` when ``vllm_config`` decodes with DDTree and a token id of
    ``prompt_ids`` (a sequence of ints) lies outside ``0..vocab_size - 1`` of the
    target."""
    from vllm_ddtree.runtime_state import ddtree_config_of

    if not prompt_ids or ddtree_config_of(vllm_config.speculative_config) is None:
        return
    vocab_size = vllm_config.model_config.get_vocab_size()
    if 0 <= min(prompt_ids) and max(prompt_ids) < vocab_size:
        return
    position, token = next((i, t) for i, t in enumerate(prompt_ids)
                           if not 0 <= t < vocab_size)
    raise ValueError(
        f"prompt token id {token} at position {position} is out of vocabulary: token ids "
        f"must lie in 0..{vocab_size - 1} (the target's vocab_size is {vocab_size})")


def apply() -> None:
    require_vllm_version(PATCHED_FUNCTION)
    from vllm.v1.engine.input_processor import InputProcessor

    original = InputProcessor._validate_model_input
    if getattr(original, "_ddtree_patched", False):
        return

    def _validate_model_input(self, prompt_input, prompt_type):
        original(self, prompt_input, prompt_type)
        if prompt_input["type"] != "embeds":
            check_prompt_ids_for_ddtree(self.vllm_config, prompt_input["prompt_token_ids"])

    mark_patched(_validate_model_input, original)
    InputProcessor._validate_model_input = _validate_model_input
