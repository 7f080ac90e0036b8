"""Our MLA backend (CUSTOM) gives vLLM's own MLA backends' greedy tokens (GPU)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vllm_ddtree.testing.compare import mismatch_problems

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

ROOT = Path(__file__).resolve().parents[2]


def run_backend(model: Path, backend: str, tmp_path: Path, graphs: bool = False,
                kv_cache_dtype: str = "auto") -> dict:
    out = tmp_path / f"{backend}-{graphs}-{kv_cache_dtype}.json"
    cmd = [sys.executable, str(ROOT / "evals/check_mla_backend.py"), str(model),
           "--backend", backend, "--out", str(out), "--kv-cache-dtype", kv_cache_dtype]
    cmd += ["--graphs"] if graphs else []
    subprocess.run(cmd, check=True, timeout=900)
    return json.loads(out.read_text())


def compare(ours: dict, ref: dict) -> list[str]:
    """Unexplained mismatches (the first differing position of each prompt)."""
    return mismatch_problems(ours["outputs"], ref["outputs"])


@pytest.fixture(scope="module")
def tiny_mla(tmp_path_factory):
    sys.path.insert(0, str(ROOT / "evals"))
    from tiny_mla import make_tiny_deepseek

    return make_tiny_deepseek(tmp_path_factory.mktemp("tiny_mla"))


def test_custom_backend_matches_vllm_mla_backends(tiny_mla, tmp_path):
    ours = run_backend(tiny_mla, "CUSTOM", tmp_path)
    problems = {}
    for ref_name in ("TRITON_MLA", "FLASH_ATTN_MLA"):
        ref = run_backend(tiny_mla, ref_name, tmp_path)
        problems[f"CUSTOM vs {ref_name}"] = compare(ours, ref)
    graphs = run_backend(tiny_mla, "CUSTOM", tmp_path, graphs=True)
    problems["CUSTOM graphs vs eager"] = compare(graphs, ours)
    for name, found in problems.items():  # printed at once: a time limit may cut pytest
        print(f"{name}: {found or 'equal up to bf16 ties'}", flush=True)
    assert not any(problems.values()), problems
