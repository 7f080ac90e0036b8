"""The reference engine refuses bad arguments before any model work, naming the field,
the value and what is allowed."""

import importlib

import pytest
from tiny_models import VOCAB, tiny_drafter, tiny_target

from vllm_ddtree.reference import engine, generate, replay

REPLAY_MODULE = importlib.import_module("vllm_ddtree.reference.replay")

PROMPT = [5, 17, 33, 2]
NAN, INF = float("nan"), float("inf")


@pytest.fixture(scope="module")
def pair():
    target = tiny_target("qwen3")
    return target, tiny_drafter(target)


@pytest.fixture(autouse=True)
def no_model_work(monkeypatch):
    """Any forward pass (the target runner of generate or replay) fails the test."""
    def reached(*args, **kwargs):
        pytest.fail("the engine started model work on a bad argument")

    monkeypatch.setattr(engine, "TargetRunner", reached)
    monkeypatch.setattr(REPLAY_MODULE, "TargetRunner", reached)


def refused(pair, field, value, **kwargs):
    """Call ``generate`` with ``kwargs`` over a good default call; assert the error
    names ``field=value``."""
    target, drafter = pair
    call = {"prompt_ids": PROMPT, "max_new_tokens": 8, "method": "ddtree", **kwargs}
    with pytest.raises(ValueError) as info:
        generate(target, drafter, **call)
    text = str(info.value)
    assert text.startswith(f"generate: {field}={value!r} is not allowed: "), text
    return text


@pytest.mark.parametrize(("prompt", "field", "value"), [
    ([5, VOCAB, 2], "prompt_ids[1]", VOCAB),
    ([5, -1], "prompt_ids[1]", -1),
    ([5, 2.0], "prompt_ids[1]", 2.0),
    (["5"], "prompt_ids[0]", "5"),
    ([True, 3], "prompt_ids[0]", True),
    ([], "prompt_ids", []),
    ("abc", "prompt_ids", "str"),
])
def test_prompt_ids_must_be_token_ids_of_the_vocabulary(pair, prompt, field, value):
    text = refused(pair, field, value, prompt_ids=prompt)
    if field != "prompt_ids":
        assert f"0..{VOCAB - 1}" in text


@pytest.mark.parametrize("temperature", [NAN, INF, -INF, -0.5, "0.7", True, None])
def test_temperature_must_be_finite_and_non_negative(pair, temperature):
    text = refused(pair, "temperature", temperature, temperature=temperature, seed=0)
    assert text.endswith("a finite number >= 0")


def test_nan_temperature_message():
    target = tiny_target("qwen3")
    with pytest.raises(ValueError, match=r"^generate: temperature=nan is not allowed: "
                                         r"a finite number >= 0$"):
        generate(target, None, PROMPT, 8, "ar", temperature=NAN)


@pytest.mark.parametrize("eos", [VOCAB, -1, 10**9, [1, 2], "2", 1.0])
def test_eos_token_id_must_be_inside_the_vocabulary(pair, eos):
    text = refused(pair, "eos_token_id", eos, eos_token_id=eos)
    assert f"0..{VOCAB - 1}" in text


@pytest.mark.parametrize("budget", ["32", True, 0, -4, 513, 2.5, None])
def test_budget_must_be_an_int_in_range(pair, budget):
    text = refused(pair, "budget", budget, budget=budget)
    assert "1..512" in text


@pytest.mark.parametrize("method", ["beam", "DDTree", "", None])
def test_method_must_be_known(pair, method):
    text = refused(pair, "method", method, method=method)
    assert "'ar', 'dflash', 'dflash2', 'ddtree'" in text


@pytest.mark.parametrize("max_new", [0, -5, 2.5, "8", True])
def test_max_new_tokens_must_be_a_positive_int(pair, max_new):
    text = refused(pair, "max_new_tokens", max_new, max_new_tokens=max_new)
    assert text.endswith("an int >= 1")


@pytest.mark.parametrize(("kwargs", "field", "value"), [
    ({"temperature": 1.0}, "seed", None),
    ({"temperature": 1.0, "seed": "7"}, "seed", "7"),
    ({"top_k": 0}, "top_k", 0),
    ({"stop": "\n"}, "stop", "\n"),
    ({"budget_chooser": 4}, "budget_chooser", 4),
    ({"method": "dflash", "budget_chooser": lambda tree, ctx: 1}, "method", "dflash"),
])
def test_other_arguments(pair, kwargs, field, value):
    refused(pair, field, value, **kwargs)


@pytest.mark.parametrize("method", ["ddtree", "dflash"])
def test_speculative_methods_need_a_drafter(pair, method):
    target, _ = pair
    with pytest.raises(ValueError, match=rf"^generate: drafter=None is not allowed: "
                                         rf"a DFlashDraftModel \(method '{method}'\)"):
        generate(target, None, PROMPT, 8, method)


@pytest.mark.parametrize(("kwargs", "field", "value"), [
    ({"method": "ar"}, "method", "ar"),
    ({"tokens": [3, VOCAB]}, "tokens[1]", VOCAB),
    ({"tokens": "ab"}, "tokens", "str"),
    ({"prompt_ids": [-3]}, "prompt_ids[0]", -3),
    ({"budget": "8"}, "budget", "8"),
])
def test_replay_checks_its_arguments(pair, kwargs, field, value):
    target, drafter = pair
    call = {"prompt_ids": PROMPT, "tokens": [3, 4], **kwargs}
    with pytest.raises(ValueError) as info:
        replay(target, drafter, **call)
    assert str(info.value).startswith(f"replay: {field}={value!r} is not allowed: ")


def test_prompt_plus_new_tokens_must_fit_the_target_positions(pair):
    limit = pair[0].config.max_position_embeddings
    text = refused(pair, "max_new_tokens", limit, max_new_tokens=limit)
    assert f"at most {limit - len(PROMPT)}" in text and "max_position_embeddings" in text
