"""The README's GPU commands, run as printed (GPU): the embedded pair's ``vllm serve``
commands (vLLM's default batch limits, which DDTree lowers to fit its trees; the YaRN
one), the offline ``LLM()`` example and the lm-eval command. Each is read from the
README's code blocks, so a README edit is what gets tested.

Only what a test cannot avoid is added: ``--host``/``--port`` for the servers and, when
``VLLM_DDTREE_TEST_KV_GIB`` is set (the GPU shared with other suites), a fixed KV cache
for them. The offline example and lm-eval take vLLM's default GPU memory share (0.9),
so run this module alone on its GPU (``scripts/gpu_suites.sh readme``).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vllm_ddtree.testing.serve import start_server

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
openai = pytest.importorskip("openai")

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
STARTUP_TIMEOUT = 900.0


def code_blocks(text: str) -> list[str]:
    """The fenced code blocks of ``text`` (without the fences)."""
    return re.findall(r"^```[a-z]*\n(.*?)^```", text, flags=re.S | re.M)


def block_starting(prefix: str, contains: str = "") -> str:
    """The first README block that starts with ``prefix`` and holds ``contains``."""
    for block in code_blocks(README.read_text()):
        if block.startswith(prefix) and contains in block:
            return block
    raise AssertionError(f"README.md has no code block starting {prefix!r} with {contains!r}")


def argv_of(block: str) -> list[str]:
    """The shell words of a one-command block (backslash continuations joined)."""
    return shlex.split(block.replace("\\\n", " "))


def executable(argv: list[str]) -> list[str]:
    """``argv`` with its program resolved: the console script when installed, else the
    module it runs (``vllm`` -> ``python -m vllm.entrypoints.cli.main``, ``lm-eval`` ->
    ``python -m lm_eval``)."""
    if shutil.which(argv[0]):
        return argv
    modules = {"vllm": "vllm.entrypoints.cli.main", "lm-eval": "lm_eval"}
    return [sys.executable, "-m", modules[argv[0]], *argv[1:]]


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": f"{ROOT}:" + os.environ.get("PYTHONPATH", "")}


def run_to_exit(argv: list[str], log: Path, timeout: float = 900) -> tuple[int, str]:
    """Run ``argv`` in its own process group with its output in ``log``; once it exits
    (or ``timeout`` s pass) kill what is left of the group. vLLM's engine-core process
    can outlive an ``LLM()`` script and hold its stdout: a pipe would never close, and
    it would hold the GPU memory the next command needs. Returns (exit code, output)."""
    import signal

    with open(log, "w") as out:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env(), stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = -1
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    return code, log.read_text(errors="replace")


def serve_and_ask(argv: list[str], tmp_path: Path) -> str:
    """Start the printed ``vllm serve`` command, ask it one completion, stop it;
    returns the server log."""
    from vllm_ddtree.testing.serve import free_port

    port = free_port()
    extra = ["--host", "127.0.0.1", "--port", str(port)]
    kv_gib = os.environ.get("VLLM_DDTREE_TEST_KV_GIB")
    if kv_gib:
        extra += ["--gpu-memory-utilization", "0.05",
                  "--kv-cache-memory-bytes", str(int(float(kv_gib) * 2**30))]
    log = tmp_path / "server.log"
    srv = start_server(argv[2], log, command=executable(argv) + extra, port=port, env=env(),
                       startup_timeout=STARTUP_TIMEOUT)
    try:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="EMPTY", max_retries=0,
                               timeout=300)
        model = client.models.list().data[0].id
        resp = client.completions.create(model=model, prompt="def fibonacci(n):",
                                         max_tokens=64, temperature=0.0)
        text = resp.choices[0].text
        assert resp.usage.completion_tokens > 0 and text, resp
        print(f"{' '.join(argv[:3])} ...: {text[:80]!r}")
        metrics = srv.get("/metrics")[1]
        assert "vllm:spec_decode_num_drafts" in metrics, "the server did not speculate"
    finally:
        srv.stop()
    return log.read_text(errors="replace")


def test_serve_command_with_default_limits(tmp_path):
    block = block_starting("vllm serve vllm_ddtree/checkpoints/target", '"method": "ddtree"')
    argv = argv_of(block)
    assert "--max-num-seqs" not in argv, "the README's serve command should use vLLM's defaults"
    log = serve_and_ask(argv, tmp_path)
    assert "DDTree (num_speculative_tokens=" in log, (
        "DDTree did not log the batch limits it chose:\n" + log[-3000:])


def test_yarn_serve_command(tmp_path):
    argv = argv_of(block_starting("vllm serve vllm_ddtree/checkpoints/target", "--hf-overrides"))
    serve_and_ask(argv, tmp_path)


def test_offline_example(tmp_path):
    script = tmp_path / "offline.py"
    marker = "--- completion ---"
    # the README block (its print marked), then a hard exit: an LLM() process can hang
    # at interpreter exit
    block = block_starting("from vllm import LLM")
    script.write_text(block.replace("print(", f"print({marker!r}); print(", 1)
                      + "\nimport os\nos._exit(0)\n")
    code, output = run_to_exit([sys.executable, str(script)], tmp_path / "offline.log")
    assert code == 0, output[-4000:]
    completion = output.split(marker, 1)[-1].strip() if marker in output else ""
    assert completion, "the offline example printed no completion:\n" + output[-3000:]
    print(completion[:300])


def test_lm_eval_command(tmp_path):
    code, output = run_to_exit(executable(argv_of(block_starting("lm-eval run"))),
                               tmp_path / "lm_eval.log")
    assert code == 0, output[-4000:]
    assert "ddtree_humaneval" in output and "pass@1" in output, output[-3000:]
    print(output[-800:])
