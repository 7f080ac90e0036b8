"""Shared GPU fixtures: AR references from ``evals/check_ddtree_vllm.py --method ar``
(in-process engine, same V2 runner and CUSTOM attention backend as DDTree), made
once per test run and shared by test_ddtree_serve.py and test_ddtree_oracle_vllm.py.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# AR tokens generated past what the DDTree runs ask for: the oracle's truth for the
# depths 1..L = 15 of the last rounds.
AR_EXTRA_TOKENS = 16
AR_RUNS = {
    # the 4 code prompts of check_pair_vllm.py, 128 (+16) greedy tokens, 8 running
    "plain": ["--prompts", "4", "--max-tokens", "128"],
    # 12 prompts of 16..3000 tokens, 8 running (later ones arrive while others
    # decode), the last 4 seeded-sampled at T=0.8 (check_ddtree_vllm.mixed_prompts)
    "mixed": ["--mixed"],
}


def run_eval(script: str, args: list[str], out: Path, timeout: float = 900) -> dict:
    """Run ``evals/<script> ... --out out`` in a subprocess; returns its JSON."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'evals'}:{ROOT}:" +
           os.environ.get("PYTHONPATH", "")}
    subprocess.run([sys.executable, str(ROOT / "evals" / script), *args, "--out", str(out)],
                   check=True, timeout=timeout, env=env)
    return json.loads(out.read_text())


@pytest.fixture(scope="session")
def ar_runs(tmp_path_factory):
    """``ar_runs(name) -> Path`` of the AR JSON ``name`` (a key of ``AR_RUNS``),
    generated on first use. Each output holds ``prompt``, ``tokens`` (asked-for +
    ``AR_EXTRA_TOKENS``), ``top2_gap``, ``temperature``, ``seed``."""
    cache: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in cache:
            path = tmp_path_factory.mktemp(f"ar-{name}") / "ar.json"
            run_eval("check_ddtree_vllm.py", ["--method", "ar", "--extra-tokens",
                                              str(AR_EXTRA_TOKENS), *AR_RUNS[name]], path)
            cache[name] = path
        return cache[name]

    return get


@pytest.fixture(scope="session")
def eval_script():
    """:func:`run_eval` as a fixture (test modules cannot import this conftest)."""
    return run_eval
