"""lm-eval entry points refuse bad arguments before any model loads or any baseline
runs: ``evals/validate.py`` (at parse time, exit status 2), ``evals/run_lm_eval.py``
and the ``ddtree-ref`` model's arguments. Each message names the field and the value."""

import json
import sys

import pytest
from evals_scripts import REPO, load_evals_script
from tiny_models import drafter_config, tiny_target

pytest.importorskip("lm_eval")

from vllm_ddtree.evaluation import ref_lm  # noqa: E402
from vllm_ddtree.evaluation.ref_args import DTYPES  # noqa: E402

validate = load_evals_script("validate")
run_lm_eval = load_evals_script("run_lm_eval")


def _fail(*args, **kwargs):
    pytest.fail("a model was loaded or a task run for a bad argument")


@pytest.fixture(autouse=True)
def no_model_load(monkeypatch):
    """Loading a model pair, building an lm-eval model or running a task fails."""
    monkeypatch.setattr(ref_lm, "load_pair", _fail)
    monkeypatch.setattr(validate, "run_task", _fail)
    monkeypatch.setattr(validate, "_run_vllm", _fail)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """Config-only model directories: a target (3 layers), its drafter, and a drafter
    made for a deeper target (target layer 5)."""
    root = tmp_path_factory.mktemp("models")
    target = tiny_target("qwen3").config
    for name, config in (("target", target), ("drafter", drafter_config(target)),
                         ("other_drafter", drafter_config(target, target_layer_ids=(0, 5)))):
        config.save_pretrained(root / name)
    return {name: str(root / name) for name in ("target", "drafter", "other_drafter")}


# -- ddtree-ref model args ---------------------------------------------------------------

@pytest.mark.parametrize(("kwargs", "field", "value"), [
    ({"budget": 0}, "budget", 0),
    ({"budget": 513}, "budget", 513),
    ({"budget": "32"}, "budget", "32"),
    ({"budget": True}, "budget", True),
    ({"method": "beam"}, "method", "beam"),
    ({"temperature": float("nan")}, "temperature", float("nan")),
    ({"temperature": -1.0}, "temperature", -1.0),
    ({"max_gen_toks": 0}, "max_gen_toks", 0),
    ({"device": "gpu"}, "device", "gpu"),
    ({"top_k": 0}, "top_k", 0),
    ({"threads": 0}, "threads", 0),
    ({"dtype": "fp8"}, "dtype", "fp8"),
    ({"max_length": -1}, "max_length", -1),
    ({"pretrained": "/no/such/dir"}, "pretrained", "/no/such/dir"),
])
def test_ddtree_ref_model_args(kwargs, field, value):
    with pytest.raises(ValueError) as info:
        ref_lm.DDTreeRefLM(**kwargs)
    assert str(info.value).startswith(f"ddtree-ref: {field}={value!r} is not allowed: ")


def test_ddtree_ref_needs_a_drafter_made_for_its_target(dirs):
    with pytest.raises(ValueError, match=r"^ddtree-ref: drafter=None is not allowed"):
        ref_lm.DDTreeRefLM(pretrained=dirs["target"])
    with pytest.raises(ValueError, match=r"^ddtree-ref: drafter='.*other_drafter' is not "
                                         r"allowed: .*target_layer_ids"):
        ref_lm.DDTreeRefLM(pretrained=dirs["target"], drafter=dirs["other_drafter"])


def test_dtypes_are_the_models():
    assert set(DTYPES) == set(ref_lm._DTYPES) == set(validate.DTYPES)


# -- evals/validate.py -------------------------------------------------------------------

SPEC = '{"method": "ddtree", "model": "%s", "num_speculative_tokens": %s}'
VLLM = ["--backend", "vllm", "--model-args", '{"pretrained": "T"}']


def refused(capsys, argv, *parts):
    """``validate.py argv`` exits with status 2 before any model loads; the message
    holds every one of ``parts``."""
    with pytest.raises(SystemExit) as info:
        validate.main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    for part in parts:
        assert part in err, err
    return err


@pytest.mark.parametrize(("argv", "parts"), [
    (["--budget", "0"], ["argument --budget: 0 is not allowed", "1..512"]),
    (["--budget", "513"], ["argument --budget: 513 is not allowed", "1..512"]),
    (["--budget", "big"], ["argument --budget: 'big' is not allowed"]),
    (["--limit", "0"], ["argument --limit: 0 is not allowed", ">= 1"]),
    (["--max-gen-toks", "-1"], ["argument --max-gen-toks: -1 is not allowed"]),
    (["--threads", "0"], ["argument --threads: 0 is not allowed"]),
    (["--top-k", "0"], ["argument --top-k: 0 is not allowed"]),
    (["--tasks", "humaneval"], ["argument --tasks: invalid choice: 'humaneval'",
                                "ddtree_humaneval"]),
    (["--margin", "1.5"], ["argument --margin: 1.5 is not allowed", "0..1"]),
    (["--inject-lossy-rate", "-0.1"], ["argument --inject-lossy-rate: -0.1 is not allowed"]),
    (["--resamples", "0"], ["argument --resamples: 0 is not allowed"]),
    (["--device", "gpu"], ["argument --device: 'gpu' is not allowed", "'cuda:<index>'"]),
    (["--dtype", "fp8"], ["argument --dtype: invalid choice: 'fp8'"]),
    (["--metadata", "[1]"], ["argument --metadata: '[1]' is not allowed: a JSON object"]),
    (["--metadata", '{"long_context_token": 9}'],
     ["argument --metadata: 'long_context_token' is not allowed", "long_context_tokens"]),
    (["--metadata", '{"long_context_tokens": 0}'],
     ["argument --metadata: {'long_context_tokens': 0} is not allowed"]),
    (["--metadata", '{"long_context_tokens": "4k"}'],
     ["argument --metadata: {'long_context_tokens': '4k'} is not allowed"]),
    (["--metadata", '{"long_context_docs": 0}'],
     ["argument --metadata: {'long_context_docs': 0} is not allowed"]),
    (["--model-args", '{"pretrained": "T"}'],
     ["argument --model-args: {'pretrained': 'T'} is not allowed", "--backend vllm"]),
    (["--pretrained", "/no/such/dir", "--drafter", "/no/such/dir"],
     ["ddtree-ref: pretrained='/no/such/dir' is not allowed", "config.json"]),
])
def test_validate_ref_backend_arguments(capsys, argv, parts):
    refused(capsys, argv, *parts)


def test_validate_pair_and_output_folder(capsys, dirs, tmp_path):
    refused(capsys, ["--pretrained", dirs["target"]], "ddtree-ref: drafter=None is not allowed")
    refused(capsys, ["--pretrained", dirs["target"], "--drafter", dirs["other_drafter"]],
            "ddtree-ref: drafter=", "target_layer_ids")
    blocker = tmp_path / "file"
    blocker.write_text("")
    refused(capsys, ["--out-dir", str(blocker / "reports")],
            f"argument --out-dir: '{blocker / 'reports'}' is not allowed", "is a file")


@pytest.mark.parametrize(("argv", "parts"), [
    (["--backend", "vllm"], ["argument --model-args: {} is not allowed", '"pretrained"']),
    (VLLM, ["argument --speculative-config: required"]),
    (VLLM + ["--speculative-config", "{not json"],
     ["argument --speculative-config: '{not json' is not allowed: a JSON object"]),
    (VLLM + ["--speculative-config", '{"model": "D"}'],
     ["argument --speculative-config: {'model': 'D'} is not allowed", '"method"']),
    (VLLM + ["--speculative-config", SPEC % ("D", 0)],
     ["argument --speculative-config:", "num_speculative_tokens", "0"]),
    (VLLM + ["--speculative-config", SPEC % ("D", '"32"')],
     ["argument --speculative-config:", "num_speculative_tokens", "'32'"]),
    (VLLM + ["--speculative-config", SPEC[:-1] % ("D", 8) + ', "ddtree_top_k": 0}'],
     ["argument --speculative-config:", "ddtree_top_k", "0"]),
    (VLLM + ["--speculative-config", SPEC[:-1] % ("D", 8) + ', "ddtree_budget": "fast"}'],
     ["argument --speculative-config:", "ddtree_budget", "fast"]),
    (VLLM + ["--speculative-config", SPEC % ("D", 8), "--budget", "16"],
     ["argument --budget: 16 is not allowed", "--speculative-config"]),
    (VLLM + ["--speculative-config", SPEC % ("D", 8), "--drafter", "D"],
     ["argument --drafter: 'D' is not allowed", "--speculative-config"]),
    (["--backend", "vllm", "--model-args",
      '{"pretrained": "T", "speculative_config": {"method": "ddtree"}}', "--drafter", "D"],
     ["argument --model-args:", "is not allowed: no speculative_config"]),
    (VLLM + ["--drafter", "D", "--top-k", "4"], ["argument --top-k: 4 is not allowed",
                                                 "ddtree_top_k"]),
])
def test_validate_vllm_backend_arguments(capsys, argv, parts):
    refused(capsys, argv, *parts)


def test_validate_vllm_drafter_must_fit_the_target(capsys, dirs):
    model_args = json.dumps({"pretrained": dirs["target"]})
    refused(capsys, ["--backend", "vllm", "--model-args", model_args,
                     "--drafter", dirs["other_drafter"]],
            "argument --speculative-config:", "target_layer_ids")
    args = validate.parse_args(["--backend", "vllm", "--model-args", model_args,
                                "--drafter", dirs["drafter"], "--budget", "16"])
    assert validate.speculative_config_of(args) == {
        "method": "ddtree", "model": dirs["drafter"], "num_speculative_tokens": 16}


def test_validate_refuses_a_bad_budget_before_the_baseline(tmp_path):
    """The programmatic path: ``validate()`` checks the arguments before running."""
    args = validate.parse_args(["--limit", "1"])
    args.budget = 0
    with pytest.raises(ValueError, match=r"^ddtree-ref: budget=0 is not allowed"):
        validate.validate(["ddtree_humaneval"], "ddtree-ref", args, tmp_path)
    with pytest.raises(ValueError, match=r"^argument --tasks: 'nope' is not allowed"):
        validate.validate(["nope"], "ddtree-ref", validate.parse_args([]), tmp_path)


def test_task_names_are_the_yaml_tasks():
    import yaml

    for name in validate.TASKS:
        text = (REPO / "evals" / "tasks" / f"{name}.yaml").read_text()
        assert yaml.safe_load(text.replace("!function", "")).get("task") == name
    assert set(validate.DEFAULT_TASKS) <= set(validate.TASKS)


# -- evals/run_lm_eval.py ----------------------------------------------------------------

LM_EVAL = ["run_lm_eval.py", "--tasks", "ddtree_humaneval", "--model"]


@pytest.mark.parametrize(("argv", "parts"), [
    (["ddtree-ref", "--model_args", "budget=0"], ["ddtree-ref: budget=0 is not allowed"]),
    (["ddtree-ref", "--model_args", "budget=abc"], ["ddtree-ref: budget='abc' is not allowed"]),
    (["ddtree-ref", "--model_args", "temperature=nan"],
     ["ddtree-ref: temperature=nan is not allowed"]),
    (["ddtree-ref", "--model_args", "method=DDTree"],
     ["ddtree-ref: method='DDTree' is not allowed"]),
    (["ddtree-ref", "--model_args", "max_gen_toks=0"],
     ["ddtree-ref: max_gen_toks=0 is not allowed"]),
    (["ddtree-ref", "--model_args", "budgett=8"],
     ["ddtree-ref: model argument='budgett' is not allowed", "budget"]),
    (["ddtree-ref", "--device", "gpu"], ["ddtree-ref: device='gpu' is not allowed"]),
    (["vllm", "--model_args", '{"pretrained": "T", "speculative_config": '
      '{"method": "ddtree", "model": "D", "num_speculative_tokens": 0}}'],
     ["num_speculative_tokens", "0"]),
])
def test_run_lm_eval_checks_model_args(monkeypatch, capsys, argv, parts):
    import lm_eval.__main__

    monkeypatch.setattr(lm_eval.__main__, "cli_evaluate", _fail)
    monkeypatch.setattr(sys, "argv", LM_EVAL + argv)
    with pytest.raises(SystemExit) as info:
        run_lm_eval.main()
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "error: argument --model_args: " in err
    for part in parts:
        assert part in err, err


def test_run_lm_eval_passes_good_model_args():
    assert run_lm_eval.model_args_error(LM_EVAL + ["ddtree-ref", "--model_args",
                                                   "method=ddtree", "budget=32"]) is None
    assert run_lm_eval.model_args_error(["run_lm_eval.py", "ls", "tasks"]) is None
