"""CPU tests of the harness behind tests/gpu/test_ddtree_serve.py
(``vllm_ddtree.testing.serve`` / ``.compare``): server start / health / stop with
a stand-in HTTP server, Prometheus parsing, spec-decode counter checks, the bf16-tie
comparison rule. (The whole serve test also runs on CPU against a tiny Qwen3 with
``DDTREE_SERVE_DRYRUN=1``; that takes minutes, so it is not part of this suite.)"""

import os
import sys
import textwrap
import time

import pytest

from vllm_ddtree.testing import serve
from vllm_ddtree.testing.compare import TIE_GAP, first_mismatch, mismatch_problem, top2_gaps
from vllm_ddtree.testing.serve import (
    ServerDiedError,
    ddtree_counter_problems,
    free_port,
    parse_prometheus,
    serve_command,
    spec_decode_counters,
    spec_decode_problems,
    start_server,
)

# A stand-in for `vllm serve`: answers /health and /metrics, and starts a child that
# must die with it (vLLM's engine core is such a child).
FAKE_SERVER = textwrap.dedent("""
    import http.server, subprocess, sys
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    print("child", child.pid, flush=True)
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = b"vllm:num_requests_running{engine=\\"0\\"} 0.0\\n"
            self.send_response(200 if self.path in ("/health", "/metrics") else 404)
            self.end_headers()
            self.wfile.write(body)
        def log_message(self, *a):
            pass
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
""")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by its dead parent's init) counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def test_server_starts_answers_and_stops_with_its_children(tmp_path):
    port = free_port()
    log = tmp_path / "server.log"
    srv = start_server("unused", log, port=port, startup_timeout=30,
                       command=[sys.executable, "-c", FAKE_SERVER, str(port)])
    try:
        assert srv.healthy() and srv.base_url == f"http://127.0.0.1:{port}"
        assert srv.metrics().value("vllm:num_requests_running") == 0.0
        assert srv.wait_until_idle(timeout=5).value("vllm:num_requests_running") == 0.0
        for _ in range(50):
            if "child" in srv.log_tail():
                break
            time.sleep(0.1)
        child = int(srv.log_tail().split("child")[1].split()[0])
        assert pid_alive(child)
    finally:
        srv.stop(timeout=5)
    assert not srv.alive() and not srv.healthy()
    for _ in range(50):
        if not pid_alive(child):
            break
        time.sleep(0.1)
    assert not pid_alive(child), "the server's child survived stop()"
    srv.stop(timeout=1)  # idempotent


def test_startup_failures_carry_the_log_tail(tmp_path):
    dying = [sys.executable, "-c", "print('engine exploded', flush=True); raise SystemExit(3)"]
    with pytest.raises(ServerDiedError, match=r"(?s)code 3.*engine exploded"):
        start_server("unused", tmp_path / "a.log", port=free_port(), startup_timeout=30,
                     command=dying)
    silent = [sys.executable, "-c", "print('loading', flush=True); import time; time.sleep(60)"]
    t0 = time.monotonic()
    with pytest.raises(ServerDiedError, match=r"(?s)did not answer.*loading"):
        start_server("unused", tmp_path / "b.log", port=free_port(), startup_timeout=2,
                     command=silent)
    assert time.monotonic() - t0 < 30  # and the silent process was killed, not waited on


def test_serve_command(monkeypatch):
    spec = {"method": "ddtree", "model": "/d", "num_speculative_tokens": 32}
    monkeypatch.setattr(serve, "_has_vllm_distribution", lambda: True)
    cmd = serve_command("/t", 8000, speculative_config=spec, served_model_name="target",
                        extra_args=["--enforce-eager"], python="py")
    assert cmd[:5] == ["py", "-m", "vllm.entrypoints.cli.main", "serve", "/t"]
    i = cmd.index("--speculative-config")
    assert cmd[i + 1] == '{"method": "ddtree", "model": "/d", "num_speculative_tokens": 32}'
    assert cmd[cmd.index("--port") + 1] == "8000" and cmd[-1] == "--enforce-eager"
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1"
    monkeypatch.setattr(serve, "_has_vllm_distribution", lambda: False)
    cmd = serve_command("/t", 8000, python="py")
    assert cmd[:5] == ["py", "-m", "vllm.entrypoints.openai.api_server", "--model", "/t"]
    assert "--speculative-config" not in cmd


METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="target"} 0.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="target"} 0.0
# TYPE vllm:spec_decode_num_drafts counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="target"} 10.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="target"} 1.7e9
# TYPE vllm:spec_decode_num_draft_tokens counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="target"} 320.0
# TYPE vllm:spec_decode_num_accepted_tokens counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="target"} 25.0
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter
{per_pos}
"""


def metrics_text(per_pos: list[float]) -> str:
    lines = [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",'
             f'model_name="target",position="{i}"}} {v}' for i, v in enumerate(per_pos)]
    return METRICS.replace("{per_pos}", "\n".join(lines))


def test_prometheus_parsing_and_spec_counters():
    per_pos = [10.0, 8.0, 5.0, 2.0] + [0.0] * 28  # B = 32, deepest accepted depth 4
    m = parse_prometheus(metrics_text(per_pos))
    assert m.value("vllm:num_requests_running") == 0.0
    assert m.value("vllm:spec_decode_num_drafts") == 10.0  # exported as _total
    assert m.value("vllm:spec_decode_num_drafts", engine="1") is None
    assert m.value("vllm:no_such_metric") is None
    assert m.kv_cache_usage() == 0.0
    counters = spec_decode_counters(m)
    assert counters == {"drafts": 10.0, "draft_tokens": 320.0, "accepted": 25.0,
                        "accepted_per_pos": per_pos}
    assert spec_decode_problems(counters, 32, 15) == []
    old = parse_prometheus('vllm:gpu_cache_usage_perc{engine="0"} 0.25\n')
    assert old.kv_cache_usage() == 0.25  # pre-0.11 gauge name


@pytest.mark.parametrize(("change", "message"), [
    (dict(accepted=200.0), "x max depth"),
    (dict(draft_tokens=400.0), "outside"),
    (dict(drafts=0.0), "no drafts"),
    (dict(accepted_per_pos=[10.0, 8.0, 5.0, 2.0, 1.0] + [0.0] * 27), "sum to"),
    (dict(accepted_per_pos=[10.0, 5.0, 8.0, 2.0] + [0.0] * 28), "increase"),
    (dict(accepted_per_pos=[10.0, 8.0, 5.0, 2.0]), "per-position counters"),
    (dict(drafts=None), "missing"),
])
def test_spec_counter_problems_are_reported(change, message):
    counters = {"drafts": 10.0, "draft_tokens": 320.0, "accepted": 25.0,
                "accepted_per_pos": [10.0, 8.0, 5.0, 2.0] + [0.0] * 28}
    counters.update(change)
    assert any(message in p for p in spec_decode_problems(counters, 32, 15))


def test_acceptance_deeper_than_the_drafter_block_is_reported():
    deep = {"drafts": 10.0, "draft_tokens": 320.0, "accepted": 26.0,
            "accepted_per_pos": [10.0, 8.0, 5.0, 2.0, 1.0] + [0.0] * 27}
    assert spec_decode_problems(deep, 32, 5) == []
    assert any("positions >= max depth 4" in p for p in spec_decode_problems(deep, 32, 4))


def test_tie_rule():
    assert first_mismatch([1, 2, 3], [1, 2, 3]) is None
    assert first_mismatch([1, 2, 4], [1, 2, 3]) == 2
    assert first_mismatch([1, 2], [1, 2, 3]) == 2
    gaps = [1.0, 1.0, TIE_GAP, 1.0]
    assert mismatch_problem([1, 2, 9, 9], [1, 2, 3, 4], gaps) is None  # a tie, rest free
    assert "pos 3" in mismatch_problem([1, 2, 3, 9], [1, 2, 3, 4], gaps)
    assert "lengths" in mismatch_problem([1, 2], [1, 2, 3], gaps)
    assert top2_gaps([{"a": -0.1, "b": -0.5}, {"a": -0.2}, None]) == pytest.approx(
        [0.4, float("inf"), float("inf")])


DDTREE_METRICS = """\
vllm:ddtree_rounds_total{engine="0",model_name="target"} 10.0
vllm:ddtree_committed_tokens_total{engine="0",model_name="target"} 35.0
vllm:ddtree_tree_nodes_total{engine="0",model_name="target"} 320.0
"""


def test_ddtree_counters_agree_with_spec_decode_counters():
    per_pos = [10.0, 8.0, 5.0, 2.0] + [0.0] * 28
    hist = [0.0, 2.0, 3.0, 3.0, 2.0] + [0.0] * 28  # from per_pos: rounds of depth 0..32
    lines = [f'vllm:ddtree_rounds_by_accepted_depth_total{{engine="0",model_name="target",'
             f'depth="{d}"}} {n}' for d, n in enumerate(hist)]
    m = parse_prometheus(metrics_text(per_pos) + DDTREE_METRICS + "\n".join(lines) + "\n")
    counters = spec_decode_counters(m)
    assert ddtree_counter_problems(m, counters, 15) == []
    assert ddtree_counter_problems(parse_prometheus(metrics_text(per_pos)), counters, 15) is None
    bad = dict(counters, accepted=23.0, drafts=11.0)
    problems = ddtree_counter_problems(m, bad, 3)
    assert len(problems) == 4  # rounds, committed, histogram's accepted, depth 4 > 3
