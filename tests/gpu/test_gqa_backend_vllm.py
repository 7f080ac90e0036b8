"""Our GQA backend (CUSTOM, VLLM_DDTREE_TREE_BACKEND=gqa) gives FLASH_ATTN's greedy
tokens on tiny sliding-window models, on vLLM's V2 runner (DDTree's) (GPU)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vllm_ddtree.testing.compare import mismatch_problems

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

ROOT = Path(__file__).resolve().parents[2]


def run_backend(model: Path, backend: str, tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / f"{model.name}-{backend}-{'-'.join(extra) or 'eager'}.json"
    cmd = [sys.executable, str(ROOT / "evals/check_gqa_backend.py"), str(model),
           "--backend", backend, "--out", str(out), "--runner", "v2", *extra]
    subprocess.run(cmd, check=True, timeout=900)
    return json.loads(out.read_text())


def compare(ours: dict, ref: dict) -> list[str]:
    """Unexplained mismatches (the first differing position of each prompt)."""
    return mismatch_problems(ours["outputs"], ref["outputs"])


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def tiny_gqa(request, tmp_path_factory):
    sys.path.insert(0, str(ROOT / "evals"))
    from tiny_gqa import make_tiny_gqa

    return make_tiny_gqa(tmp_path_factory.mktemp(request.param), request.param)


def test_custom_backend_matches_flash_attn(tiny_gqa, tmp_path):
    ref = run_backend(tiny_gqa, "FLASH_ATTN", tmp_path)
    ours = run_backend(tiny_gqa, "CUSTOM", tmp_path)
    assert ours["backend_class"].endswith("TreeGQABackend")
    problems = {"CUSTOM vs FLASH_ATTN": compare(ours, ref)}
    # prompts of up to 64 tokens through the tree kernel (causal bits), the rest
    # through vLLM's prefill kernel, in the same batch (engine in the check's process,
    # where it raises TreeGQAMetadataBuilder.min_tree_query_len)
    short = run_backend(tiny_gqa, "CUSTOM", tmp_path, "--tree-threshold", "64")
    assert 1 < short["max_tree_query_len"] <= 64, short["max_tree_query_len"]
    problems["CUSTOM (tree kernel up to 64 tokens) vs FLASH_ATTN"] = compare(short, ref)
    graphs = run_backend(tiny_gqa, "CUSTOM", tmp_path, "--graphs")
    problems["CUSTOM graphs vs eager"] = compare(graphs, ours)
    for name, found in problems.items():  # printed at once: a time limit may cut pytest
        print(f"{name}: {found or 'equal up to bf16 ties'}", flush=True)
    assert not any(problems.values()), problems
