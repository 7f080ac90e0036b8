"""With DDTree, a prompt token id outside the target's vocabulary gets a ValueError
(HTTP 400 from vllm serve) at input validation, naming the id, its position and the
allowed range, instead of an embedding failure that ends the engine
(patches/prompt_token_ids.py)."""

from types import SimpleNamespace

import pytest

VOCAB = 4096


def config(ddtree: bool):
    return SimpleNamespace(
        speculative_config=SimpleNamespace(ddtree={"budget": 8}) if ddtree else None,
        model_config=SimpleNamespace(get_vocab_size=lambda: VOCAB))


@pytest.mark.parametrize(("ids", "position", "token"), [
    ([5, 17, VOCAB], 2, VOCAB),          # what vLLM 0.26's own check lets through
    ([VOCAB + 1000, 3], 0, VOCAB + 1000),
    ([4, -1, 9], 1, -1),
])
def test_out_of_vocabulary_ids_are_refused_with_ddtree(ids, position, token):
    from vllm_ddtree.patches.prompt_token_ids import check_prompt_ids_for_ddtree

    with pytest.raises(ValueError) as info:
        check_prompt_ids_for_ddtree(config(ddtree=True), ids)
    text = str(info.value)
    assert f"token id {token} at position {position}" in text
    assert f"0..{VOCAB - 1}" in text
    check_prompt_ids_for_ddtree(config(ddtree=False), ids)  # without DDTree: vLLM's business


def test_ids_inside_the_vocabulary_pass():
    from vllm_ddtree.patches.prompt_token_ids import check_prompt_ids_for_ddtree

    check_prompt_ids_for_ddtree(config(ddtree=True), [0, 17, VOCAB - 1])
    check_prompt_ids_for_ddtree(config(ddtree=True), [])


def test_the_patched_input_processor_checks_token_prompts():
    from vllm.v1.engine.input_processor import InputProcessor

    from vllm_ddtree import patches

    patches.apply_all()
    assert InputProcessor._validate_model_input._ddtree_patched
    cfg = config(ddtree=True)
    processor = SimpleNamespace(vllm_config=cfg, model_config=SimpleNamespace(
        get_vocab_size=lambda: VOCAB, max_model_len=64), tokenizer=None,
        _validate_prompt_len=lambda prompt_len, prompt_type: None)
    prompt = {"type": "token", "prompt_token_ids": [1, 2, VOCAB]}
    with pytest.raises(ValueError, match=f"token id {VOCAB} at position 2"):
        InputProcessor._validate_model_input(processor, prompt, "decoder")
    InputProcessor._validate_model_input(processor, {"type": "token",
                                                     "prompt_token_ids": [1, 2]}, "decoder")
