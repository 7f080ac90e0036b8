"""Tests of the benchmark and evaluation tooling in ``evals/`` (run by CI beside tests/)."""

import os
import sys
from pathlib import Path

import torch

EVALS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(EVALS))
sys.path.insert(0, str(EVALS.parent / "tests"))  # shared helpers (tiny_models, kernel_testing)

# Triton kernels run in the interpreter on CPU machines; set before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
