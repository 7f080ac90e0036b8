"""Numeric arguments of the evals entry points: argparse refuses non-positive (or
negative, where 0 means "no limit") values with exit status 2 and a message naming the
option, the value and what is allowed."""

import argparse
import re
import shlex
from pathlib import Path

# evals/ is on sys.path (conftest)
import acceptance_humaneval
import bench_e2e
import bench_verify_attention
import cli_args
import pytest
import train_pair


def _never(*args, **kwargs):
    pytest.fail("the script started work on a bad argument")


def _acceptance_main(argv):
    return acceptance_humaneval.main(["run", "--out", "x.json", *argv])


PARSERS = {
    "bench_e2e": bench_e2e.parse_args,
    "bench_verify_attention": bench_verify_attention.parse_args,
    "acceptance_humaneval": _acceptance_main,
    "train_pair": train_pair.parse_args,
}
BAD = [
    ("bench_e2e", "--batches", "0", ">= 1"),
    ("bench_e2e", "--batches", "-8", ">= 1"),
    ("bench_e2e", "--repeats", "0", ">= 1"),
    ("bench_e2e", "--max-minutes", "-1", ">= 0"),
    ("bench_e2e", "--grace-minutes", "-2", ">= 0"),
    ("bench_e2e", "--child-timeout-min", "0", "> 0"),
    ("bench_e2e", "--gpu-mem", "1.5", "0..1"),
    ("bench_e2e", "--temperature", "nan", ">= 0"),
    ("bench_e2e", "--contexts", "0", ">= 16"),
    ("bench_verify_attention", "--heads", "0", ">= 1"),
    ("bench_verify_attention", "--ctx", "-4096", ">= 1"),
    ("bench_verify_attention", "--qlen", "0", ">= 1"),
    ("bench_verify_attention", "--page", "zero", ">= 1"),
    ("bench_verify_attention", "--rep", "0", ">= 1"),
    ("bench_verify_attention", "--max-minutes", "-1", ">= 0"),
    ("acceptance_humaneval", "--prompts", "0", "1..164"),
    ("acceptance_humaneval", "--prompts", "165", "1..164"),
    ("acceptance_humaneval", "--max-new-tokens", "0", ">= 1"),
    ("acceptance_humaneval", "--threads", "0", ">= 1"),
    ("acceptance_humaneval", "--temperature", "-1", ">= 0"),
    ("acceptance_humaneval", "--budgets", "0", ">= 1"),
    ("acceptance_humaneval", "--device", "gpu", "'cuda:<index>'"),
    ("train_pair", "--target-minutes", "0", "> 0"),
    ("train_pair", "--drafter-minutes", "-3", "> 0"),
    ("train_pair", "--gen-minutes", "-1", ">= 0"),
    ("train_pair", "--gen-sequences", "0", ">= 1"),
    ("train_pair", "--text-sequences", "-1", ">= 0"),
    ("train_pair", "--target-steps", "0", ">= 1"),
    ("train_pair", "--drafter-batch", "0", ">= 1"),
    ("train_pair", "--drafter-lr", "0", "> 0"),
    ("train_pair", "--target-seq-len", "0", ">= 1"),
    ("train_pair", "--accept-prompts", "0", ">= 1"),
]


@pytest.mark.parametrize(("script", "option", "value", "allowed"), BAD,
                         ids=[f"{s}{o}={v}" for s, o, v, _ in BAD])
def test_entry_points_refuse_bad_numbers(monkeypatch, capsys, script, option, value, allowed):
    monkeypatch.setattr(acceptance_humaneval, "run", _never)
    with pytest.raises(SystemExit) as info:
        PARSERS[script]([option, value])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option}: " in err and value in err and allowed in err, err


def test_types_accept_good_values_and_name_what_is_allowed():
    assert cli_args.positive_int("3") == 3
    assert cli_args.non_negative_float("0") == 0.0
    assert cli_args.fraction("1") == 1.0
    assert cli_args.json_object('{"a": 1}') == {"a": 1}
    for parse, text, message in [
        (cli_args.positive_int, "0", "0 is not allowed: an integer >= 1"),
        (cli_args.positive_int, "1.5", "'1.5' is not allowed: an integer >= 1"),
        (cli_args.positive_float, "0", "0 is not allowed: a finite number > 0"),
        (cli_args.non_negative_float, "inf", "inf is not allowed: a finite number >= 0"),
        (cli_args.fraction, "-0.1", "-0.1 is not allowed: a finite number in 0..1"),
        (cli_args.json_object, "[]", "'[]' is not allowed: a JSON object"),
    ]:
        with pytest.raises(argparse.ArgumentTypeError, match=re.escape(message)):
            parse(text)


def test_good_arguments_still_parse():
    args = bench_verify_attention.parse_args(["--heads", "8", "--ctx", "8192", "--max-minutes",
                                              "0"])
    assert args.heads == [8] and args.max_minutes == 0.0
    assert train_pair.parse_args(["--gen-minutes", "0", "--text-sequences", "0"]).gen_minutes == 0


def test_the_acceptance_result_commands_still_parse(monkeypatch):
    """Each ``command:`` line of ``evals/results/acceptance_humaneval.md`` reproduces it."""
    text = (Path(acceptance_humaneval.__file__).parent / "results"
            / "acceptance_humaneval.md").read_text()
    commands = re.findall(r"command: `evals/acceptance_humaneval.py (.*)`", text)
    assert commands
    parsed = []
    monkeypatch.setattr(acceptance_humaneval, "run", parsed.append)
    for command in commands:
        acceptance_humaneval.main(shlex.split(command))
    assert [a.budgets for a in parsed] == [list(acceptance_humaneval.BUDGETS)] * len(commands)
    assert not any(a.dflash2 for a in parsed)
