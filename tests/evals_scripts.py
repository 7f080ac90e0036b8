"""The scripts of ``evals/`` as modules, for tests that call their functions."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]


def load_evals_script(name: str) -> ModuleType:
    """``evals/<name>.py`` executed afresh as module ``ddtree_<name>``, registered in
    ``sys.modules`` (dataclasses and pickles resolve their module there)."""
    spec = importlib.util.spec_from_file_location(f"ddtree_{name}", REPO / "evals" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
