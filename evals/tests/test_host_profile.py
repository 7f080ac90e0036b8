"""``evals/host_profile.py diff``: two profiles' host work per engine step, function by
function (CPU)."""

import cProfile
import importlib.util
import sys

import pytest
from host_profile import diff_table, main

RUNNER = '''
def execute_model():
    return sum(range(50))

def gate_decision():
    total = 0
    for i in range(3000):  # own Python time, not a builtin's
        total += i * i
    return total

def step(with_gate):
    execute_model()
    if with_gate:
        gate_decision()
'''


@pytest.fixture
def runner(tmp_path):
    """A module whose file is ``model_runner.py``: its ``execute_model`` calls count
    the engine steps, as the V2 runner's do."""
    path = tmp_path / "model_runner.py"
    path.write_text(RUNNER)
    spec = importlib.util.spec_from_file_location("fake_model_runner", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules.pop("fake_model_runner", None)
    return module


def profiled(runner, steps: int, with_gate: bool, path) -> str:
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(steps):
        runner.step(with_gate)
    profile.disable()
    profile.dump_stats(path)
    return str(path)


def test_diff_puts_the_extra_work_of_one_run_first(runner, tmp_path, capsys):
    """The run with a gate decision every step against one without: the decision heads
    the table with its calls per step (1 against 0), steps are counted from
    ``execute_model`` in a ``model_runner`` file (200 and 100 here: per step, not per
    run), and the command line refuses a missing profile by name."""
    import pstats

    auto = profiled(runner, 200, True, tmp_path / "auto.prof")
    fixed = profiled(runner, 100, False, tmp_path / "fixed.prof")
    text = diff_table(pstats.Stats(auto), pstats.Stats(fixed), names=("auto", "fixed"))
    lines = text.splitlines()
    assert "auto" in lines[0] and "(200 steps)" in lines[0] and "(100 steps)" in lines[0]
    first = lines[4]
    assert "gate_decision" in first and "| 1.0 | 0.0 |" in first
    surplus = float(first.rsplit("|", 2)[-2])
    assert surplus > 0
    execute = next(line for line in lines if "execute_model" in line)
    assert "| 1.0 | 1.0 |" in execute  # once a step in both
    assert main(["diff", auto, fixed]) == 0
    assert "gate_decision" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["diff", auto, str(tmp_path / "missing.prof")])
    assert "missing.prof: no such profile" in capsys.readouterr().err
