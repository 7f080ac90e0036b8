"""vLLM 0.26 loads the embedded pair and generates the reference engine's greedy tokens."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vllm_ddtree.demo.reference_engine import CHECKPOINTS
from vllm_ddtree.testing.compare import mismatch_problem

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
ROOT = Path(__file__).resolve().parents[2]


def run_vllm(mode: str, tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / f"{mode}.json"
    env = {**__import__("os").environ, "PYTHONPATH": f"{ROOT / 'evals'}:" +
           __import__("os").environ.get("PYTHONPATH", "")}
    subprocess.run([sys.executable, str(ROOT / "evals/check_pair_vllm.py"), "--mode", mode,
                    "--out", str(out), *extra], check=True, timeout=600, env=env)
    return json.loads(out.read_text())


def first_unexplained(got: list[int], want: list[int], gaps: list[float]) -> str | None:
    return mismatch_problem(got, want, gaps)


@pytest.mark.skipif(not (CHECKPOINTS / "target" / "config.json").exists(),
                    reason="embedded pair not trained yet")
def test_vllm_matches_reference_engine_and_runs_dflash(tmp_path):
    from transformers import AutoModelForCausalLM

    from vllm_ddtree.reference import generate
    from vllm_ddtree.training.common import load_drafter

    ar = run_vllm("ar", tmp_path)
    chain = run_vllm("dflash", tmp_path)
    target = AutoModelForCausalLM.from_pretrained(CHECKPOINTS / "target",
                                                  dtype=torch.float32).cuda().eval()
    drafter = load_drafter(CHECKPOINTS / "drafter", device="cuda")
    differing = []
    for a, c in zip(ar["outputs"], chain["outputs"], strict=True):
        n = len(a["tokens"])
        ref = generate(target, drafter, a["prompt"], n, "ddtree", budget=32).tokens
        problem = first_unexplained(a["tokens"], ref, a["top2_gap"])
        assert problem is None, f"vLLM AR vs reference: {problem}"
        differing.append(a["tokens"] != ref)
        problem = first_unexplained(c["tokens"], a["tokens"], a["top2_gap"])
        assert problem is None, f"vLLM DFlash vs vLLM AR: {problem}"
    print(f"prompts whose vLLM bf16 tokens differ from the fp32 reference at a tie: "
          f"{sum(differing)}/{len(differing)}")


@pytest.mark.skipif(not (CHECKPOINTS / "target" / "config.json").exists(),
                    reason="embedded pair not trained yet")
def test_vllm_yarn_target_matches_reference_past_the_window(tmp_path):
    """The YaRN copy of the target (``vllm_ddtree/long_context.py``) on 1,024-token code
    prompts: vLLM's DeepSeek YaRN (``deepseek_yarn``) gives the fp32 reference's greedy
    tokens up to measured bf16 ties, and its DFlash chain gives vLLM AR's."""
    from transformers import AutoModelForCausalLM

    from vllm_ddtree.long_context import write_rope_scaled_pair, yarn_parameters
    from vllm_ddtree.reference import generate
    from vllm_ddtree.training.common import load_drafter

    pair = write_rope_scaled_pair(CHECKPOINTS, tmp_path / "pair", yarn_parameters())
    extra = ("--checkpoints", str(pair), "--prompt-tokens", "1024", "--prompts", "2")
    ar = run_vllm("ar", tmp_path, *extra)
    chain = run_vllm("dflash", tmp_path, *extra)
    target = AutoModelForCausalLM.from_pretrained(pair / "target",
                                                  dtype=torch.float32).cuda().eval()
    drafter = load_drafter(CHECKPOINTS / "drafter", device="cuda")
    for a, c in zip(ar["outputs"], chain["outputs"], strict=True):
        ref = generate(target, drafter, a["prompt"], len(a["tokens"]), "ddtree", budget=32)
        problem = first_unexplained(a["tokens"], ref.tokens, a["top2_gap"])
        assert problem is None, f"vLLM AR (YaRN) vs reference: {problem}"
        problem = first_unexplained(c["tokens"], a["tokens"], a["top2_gap"])
        assert problem is None, f"vLLM DFlash (YaRN) vs vLLM AR: {problem}"
