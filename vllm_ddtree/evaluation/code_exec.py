"""Run a HumanEval program in a child interpreter with a timeout (pass@1, our own check)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

DEFAULT_TIMEOUT_S = 10.0
MEMORY_LIMIT_BYTES = 2 * 1024**3


def humaneval_program(prompt: str, completion: str, test: str, entry_point: str) -> str:
    """The program whose exit status decides pass@1: prompt + completion + tests."""
    return f"{prompt}{completion}\n\n\n{test}\n\ncheck({entry_point})\n"


def _prepare_child() -> None:  # runs in the child before exec (POSIX only)
    os.setsid()  # a process group of its own, killed whole on timeout
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT_BYTES, MEMORY_LIMIT_BYTES))
    except (ImportError, ValueError, OSError):
        pass


def run_program(program: str, timeout: float = DEFAULT_TIMEOUT_S) -> bool:
    """True when ``program`` exits with status 0 within ``timeout`` seconds.

    It runs as a file in a fresh temporary directory under ``python -I`` (isolated:
    no user site, no environment variables, cwd not on ``sys.path``), in its own
    process group, which is killed whole on timeout; memory is capped at 2 GiB.
    """
    with tempfile.TemporaryDirectory(prefix="ddtree-humaneval-") as tmp:
        path = Path(tmp) / "program.py"
        path.write_text(program, encoding="utf-8")
        proc = subprocess.Popen(
            [sys.executable, "-I", "-B", str(path)],
            cwd=tmp,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={"PATH": os.environ.get("PATH", ""), "PYTHONHASHSEED": "0"},
            preexec_fn=_prepare_child if os.name == "posix" else None,
        )
        try:
            return proc.wait(timeout=timeout) == 0
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                proc.kill()
            proc.wait()
            return False
