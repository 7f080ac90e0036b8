"""The end-to-end benchmark's step timer and host probes (evals/e2e_timing.py,
evals/e2e_engine.py, evals/host_profile.py, evals/host_speed_report.py) on fake
runner classes: the step split, the runner hooks, host regions, GC pauses,
allocator calls and the interpreter speed."""

import gc
import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "evals"))
import e2e_report  # noqa: E402
import e2e_runs  # noqa: E402
import e2e_timing  # noqa: E402
from bench_e2e import parse_args  # noqa: E402

# ---------------------------------------------------------------------------------------
# Step split


def _step(decode, start, end, verify, sample_tokens=0.0, draft=0.0, compact=0.0, tokens=1):
    return {"decode": decode, "tokens": tokens, "start": start, "end": end,
            "verify": verify, "sample_tokens": sample_tokens, "draft": draft,
            "compact": compact}


def test_summarize_steps_split_adds_up():
    steps = [_step(False, 0.0, 50.0, 45.0, 5.0, 2.0, tokens=4096),
             _step(True, 51.0, 55.0, 2.0, 1.5, 1.0, 0.1),
             _step(True, 56.0, 60.5, 2.5, 1.5, 1.0, 0.1),
             _step(True, 61.0, 65.0, 2.0, 1.8, 1.2, 0.1)]
    s = e2e_timing.summarize_steps(steps)
    assert s["steps"] == 3 and s["decode_ms"] == pytest.approx(14.0)
    assert s["step_ms"] == pytest.approx(14.0 / 3)
    assert s["draft_ms"] + s["verify_ms"] + s["other_ms"] == pytest.approx(s["step_ms"])
    assert s["verify_ms"] == pytest.approx(6.5 / 3) and s["draft_ms"] == pytest.approx(3.2 / 3)
    assert s["sample_ms"] == pytest.approx((4.8 - 3.2) / 3)
    assert s["compact_ms"] == pytest.approx(0.1)
    assert s["step_ms_median"] == pytest.approx(5.0) and s["step_ms_max"] == pytest.approx(5.0)
    assert (s["prefill_steps"], s["prefill_tokens"]) == (1, 4096)
    assert e2e_timing.summarize_steps([steps[0]]) is None
    split = e2e_timing.split_step(10.0, 4, 1.0, 0.75)
    assert split["other_ms"] == pytest.approx(0.75)


def test_split_by_prefill_keeps_decode_and_refill_steps_apart():
    """The sweep's question: do the steps that prefill a refill cost more in the
    target's forward, in the host's launches, or in the drafter's propose?"""
    steps = [_step(True, 0.0, 5.0, 2.0, 3.0, 2.5), _step(True, 5.0, 10.0, 4.0, 2.0, 1.5),
             _step(False, 10.0, 40.0, 20.0, 9.0, 8.0)]
    steps[0]["host_verify"], steps[1]["host_verify"], steps[2]["host_verify"] = 1.0, 3.0, 18.0
    steps[2]["host_gc"], steps[2]["host_sample_tokens"] = 12.0, 9.5
    got = e2e_timing.split_by_prefill(steps)
    assert got["decode_n"] == 2 and got["prefill_n"] == 1
    assert got["decode_verify_ms"] == pytest.approx(3.0)
    assert got["decode_host_verify_ms"] == pytest.approx(2.0)
    assert got["decode_draft_ms"] == pytest.approx(2.0)
    assert got["decode_sample_ms"] == pytest.approx(0.5)
    assert got["prefill_verify_ms"] == pytest.approx(20.0)
    assert got["prefill_host_verify_ms"] == pytest.approx(18.0)
    assert got["prefill_sample_ms"] == pytest.approx(1.0)
    assert got["prefill_gc_ms"] == 12.0 and got["decode_gc_ms"] == 0.0
    assert got["prefill_host_sample_ms"] == 9.5
    assert "decode_eager_share" not in got  # no graph modes noted
    steps[0]["graphs"] = {e2e_timing.VERIFY: ["FULL"]}
    steps[1]["graphs"] = {e2e_timing.VERIFY: ["FULL"], e2e_timing.DRAFT: ["NONE"]}
    steps[2]["graphs"] = {e2e_timing.VERIFY: ["NONE"]}
    got = e2e_timing.split_by_prefill(steps)
    assert got["decode_eager_share"] == 0.0 and got["prefill_eager_share"] == 1.0
    steps[2]["graphs"] = {e2e_timing.VERIFY: ["PIECEWISE"]}
    assert e2e_timing.split_by_prefill(steps)["prefill_eager_share"] == 0.0
    del steps[0]["graphs"], steps[1]["graphs"], steps[2]["graphs"]
    assert e2e_timing.split_by_prefill(steps[:2]).keys() == {
        "decode_n", "decode_verify_ms", "decode_host_verify_ms", "decode_draft_ms",
        "decode_sample_ms", "decode_host_sample_ms",
        "decode_gc_ms"}  # no prefill step: nothing of that kind


# ---------------------------------------------------------------------------------------
# Runner hooks on fake vLLM classes


class FakeEvent:
    clock = [0.0]

    def __init__(self):
        FakeEvent.clock[0] += 1.0
        self.t = FakeEvent.clock[0]

    def elapsed_time(self, other):
        return other.t - self.t


class FakeSchedulerOutput:
    def __init__(self, new, computed):
        self.scheduled_new_reqs = ["r0"] if new else []
        self.num_scheduled_tokens = {f"r{i}": 1 for i in range(len(computed))}
        self.total_num_scheduled_tokens = len(computed)
        self.scheduled_cached_reqs = type("C", (), {
            "req_ids": [f"r{i}" for i in range(len(computed))],
            "num_computed_tokens": computed})()


class FakeRunner:
    def __init__(self, speculator):
        self.speculator = speculator

    def execute_model(self, scheduler_output, intermediate_tensors=None, dummy_run=False):
        return None

    def sample_tokens(self, grammar_output):
        if self.speculator is not None:
            self.speculator.propose(None, dummy_run=False)


class FakeChain:
    def propose(self, input_batch, dummy_run=False):
        return "chain"


class FakeTree(FakeChain):
    def propose(self, input_batch, dummy_run=False):
        self._compact_target_kv()
        return super().propose(input_batch, dummy_run=dummy_run)

    def _compact_target_kv(self):
        pass


def test_step_timer_hooks_count_nested_propose_once():
    ticks = iter(range(10**6))  # host clock: one second per call
    timer = e2e_timing.StepTimer(event_factory=FakeEvent, capturing=lambda: False,
                                 synchronize=lambda: None, clock=lambda: float(next(ticks)))
    timer.wrap_step(FakeRunner, "execute_model")
    timer.wrap_span(FakeRunner, "sample_tokens", e2e_timing.SAMPLE_TOKENS)
    timer.wrap_span(FakeChain, "propose", e2e_timing.DRAFT)
    timer.wrap_span(FakeTree, "propose", e2e_timing.DRAFT)
    timer.wrap_span(FakeTree, "_compact_target_kv", e2e_timing.COMPACT)
    timer.wrap_span(FakeTree, "propose", e2e_timing.DRAFT)  # idempotent
    assert len(timer.installed) == 5

    runner = FakeRunner(FakeTree())
    runner.execute_model(FakeSchedulerOutput(True, [0]))  # inactive: nothing recorded
    runner.sample_tokens(None)
    timer.begin(prompt_len=100)
    runner.execute_model(FakeSchedulerOutput(False, [100]), dummy_run=True)  # skipped
    runner.execute_model(FakeSchedulerOutput(True, [0]))  # prefill step
    runner.sample_tokens(None)
    for _ in range(3):
        runner.execute_model(FakeSchedulerOutput(False, [100, 120]))
        runner.sample_tokens(None)
    assert runner.speculator.propose(None, dummy_run=True) == "chain"  # outside a step
    steps = timer.end()
    assert [s["decode"] for s in steps] == [False, True, True, True]
    for s in steps:
        # events: exec start/end (2), sample start (1), draft start (1), compact (2),
        # draft end, sample end: one draft span of 4 ticks holding a 1-tick compact span
        assert s["verify"] == 1.0 and s["draft"] == 3.0 and s["compact"] == 1.0
        assert s["sample_tokens"] == 5.0 and s["end"] - s["start"] == 7.0
    summary = e2e_timing.summarize_steps(steps)
    assert summary["steps"] == 3 and summary["sample_ms"] == pytest.approx(2.0)
    # Host clock reads per step: execute_model 2 (1 s apart), sample_tokens 2 around
    # propose 2 around compact 2 (the nested propose / compact read their own): propose
    # spans 3 ticks (start, compact's 2, end), execute_model 1 tick.
    for s in steps:
        assert s["host_verify"] == 1000.0 and s["host_draft"] == 3000.0
    assert summary["host_draft_ms"] == 3000.0 and summary["host_verify_ms"] == 1000.0
    assert FakeTree.propose.__wrapped__ is not None


def test_is_decode_step_rules():
    so = FakeSchedulerOutput(False, [1024, 1030])
    assert e2e_timing.is_decode_step(so, 1024)
    assert not e2e_timing.is_decode_step(FakeSchedulerOutput(False, [1024, 512]), 1024)
    assert not e2e_timing.is_decode_step(FakeSchedulerOutput(True, [1024]), 1024)
    so.scheduled_spec_decode_tokens = {"r0": [5, 6], "r1": [7, 8]}
    so.num_scheduled_tokens = {"r0": 3, "r1": 3}
    assert e2e_timing.is_decode_step(so, None)
    so.num_scheduled_tokens = {"r0": 3, "r1": 64}
    assert not e2e_timing.is_decode_step(so, None)


class FakeMode:
    def __init__(self, name):
        self.name = name


class FakeDesc:
    def __init__(self, mode):
        self.cg_mode = FakeMode(mode)


class FakeManagerBase:
    modes = iter(())

    def dispatch(self, num_reqs, num_tokens, uniform_token_count, num_active_loras=0):
        return FakeDesc(next(FakeManagerBase.modes))


class FakeTargetManager(FakeManagerBase):
    pass


class FakeDrafterManager(FakeManagerBase):
    pass


class GraphRunner(FakeRunner):
    def __init__(self, speculator):
        super().__init__(speculator)
        self.cudagraph_manager = FakeTargetManager()

    def execute_model(self, scheduler_output, intermediate_tensors=None, dummy_run=False):
        self.cudagraph_manager.dispatch(1, 9, 9)

    def sample_tokens(self, grammar_output):
        self.speculator.propose(None, dummy_run=False)


class GraphChain(FakeChain):
    manager = FakeDrafterManager()

    def propose(self, input_batch, dummy_run=False):
        self.manager.dispatch(1, 16, 16)
        return "chain"


def test_step_timer_counts_full_graph_steps_and_keeps_later_base_patches():
    timer = e2e_timing.StepTimer(event_factory=FakeEvent, capturing=lambda: False,
                                 synchronize=lambda: None)
    timer.wrap_step(GraphRunner, "execute_model")
    timer.wrap_span(GraphRunner, "sample_tokens", e2e_timing.SAMPLE_TOKENS)
    timer.wrap_span(GraphChain, "propose", e2e_timing.DRAFT)
    timer.wrap_dispatch(FakeTargetManager, e2e_timing.VERIFY)
    timer.wrap_dispatch(FakeDrafterManager, e2e_timing.DRAFT)
    timer.wrap_dispatch(FakeDrafterManager, e2e_timing.DRAFT)  # idempotent
    with pytest.raises(TypeError, match="defines dispatch itself"):
        timer.wrap_dispatch(FakeManagerBase, e2e_timing.VERIFY)
    # A patch of the base class after the timer was installed (as the plugin's
    # verify_shapes patch is) must still decide the mode: FULL for every 9-row verify.
    original = FakeManagerBase.dispatch

    def patched(self, num_reqs, num_tokens, uniform_token_count, num_active_loras=0):
        desc = original(self, num_reqs, num_tokens, uniform_token_count, num_active_loras)
        return FakeDesc("FULL") if num_tokens == 9 else desc

    FakeManagerBase.dispatch = patched
    try:
        # per step: verify dispatch (overridden to FULL by the patch), draft dispatch
        FakeManagerBase.modes = iter(["PIECEWISE", "FULL", "NONE", "FULL", "NONE", "NONE"])
        runner = GraphRunner(GraphChain())
        timer.begin(prompt_len=100)
        for _ in range(3):
            runner.execute_model(FakeSchedulerOutput(False, [100]))
            runner.sample_tokens(None)
        steps = timer.end()
    finally:
        FakeManagerBase.dispatch = original
    assert [s["graphs"] for s in steps] == [
        {"verify": ["FULL"], "draft": ["FULL"]},
        {"verify": ["FULL"], "draft": ["FULL"]},
        {"verify": ["FULL"], "draft": ["NONE"]},
    ]
    summary = e2e_timing.summarize_steps(steps)
    assert summary["full_graph_steps"] == {"verify": [3, 3], "draft": [2, 3]}
    row = {"full_graph_steps": summary["full_graph_steps"]}
    assert e2e_report._graph_steps(row) == "3/3 / 2/3"
    assert e2e_report._graph_steps({}) == "—"
    base = {"method": "ddtree", "batch": 1, "max_tokens": 4, "context": 1024}
    note = e2e_runs.cell_row(base, summary, {}, wall_s=0.01)["note"]
    assert "1 of 3 decode steps ran the draft forward outside a FULL CUDA graph" in note
    assert "verify forward" not in note


def test_vllm_internals_the_timer_relies_on():
    """Read (without importing vLLM) the 0.26 sources whose call order the step split
    assumes: execute_model(scheduler_output, ..., dummy_run) runs the target forward;
    sample_tokens samples / verifies, then calls speculator.propose; the engine core
    calls execute_model then sample_tokens for each step."""
    import ast
    import importlib.util

    root = Path(importlib.util.find_spec("vllm").submodule_search_locations[0])

    def functions(path: Path, cls: str) -> dict:
        tree = ast.parse(path.read_text())
        node = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls)
        return {f.name: f for f in node.body if isinstance(f, ast.FunctionDef)}

    def params(fn) -> list[str]:
        return [a.arg for a in fn.args.args + fn.args.kwonlyargs]

    runner_src = root / "v1/worker/gpu/model_runner.py"
    runner = functions(runner_src, "GPUModelRunner")
    assert params(runner["execute_model"])[:2] == ["self", "scheduler_output"]
    assert "dummy_run" in params(runner["execute_model"])
    body = ast.get_source_segment(runner_src.read_text(), runner["sample_tokens"])
    assert 0 <= body.index("self.sample(") < body.index("self.speculator.propose(")
    dflash = functions(root / "v1/worker/gpu/spec_decode/dflash/speculator.py",
                       "DFlashSpeculator")
    assert "dummy_run" in params(dflash["propose"])
    core = (root / "v1/engine/core.py").read_text()
    step = core[core.index("def step_with_batch_queue"):]
    assert step.index("model_executor.execute_model(") < step.index(
        "model_executor.sample_tokens(")
    output = (root / "v1/core/sched/output.py").read_text()
    assert "num_computed_tokens: list[int]" in output  # CachedRequestData, is_decode_step
    # StepTimer.wrap_dispatch wraps the graph managers' inherited dispatch
    graphs = root / "v1/worker/gpu/cudagraph_utils.py"
    assert "dispatch" in functions(graphs, "CudaGraphManager")
    assert "dispatch" not in functions(graphs, "ModelCudaGraphManager")
    assert "dispatch" not in functions(root / "v1/worker/gpu/spec_decode/dflash/cudagraph.py",
                                       "DFlashCudaGraphManager")


# ---------------------------------------------------------------------------------------
# Host time by region, GC pauses, allocator calls


class FakeState:
    def store_trees_(self):
        HostClock.now += 0.5


class HostClock:
    now = 0.0


class FakeHostChain:
    def propose(self, input_batch, dummy_run=False):
        HostClock.now += 2.0
        return "chain"


class FakeHostTree(FakeHostChain):
    state = FakeState()

    def propose(self, input_batch, dummy_run=False):
        out = super().propose(input_batch, dummy_run=dummy_run)
        self.state.store_trees_()
        return out


class FakeHostRunner(FakeRunner):
    def execute_model(self, scheduler_output, intermediate_tensors=None, dummy_run=False):
        HostClock.now += 1.0

    def sample_tokens(self, grammar_output):
        HostClock.now += 0.25
        self.speculator.propose(None, dummy_run=False)


def test_step_timer_host_regions_split_a_steps_host_time(tmp_path):
    """``wrap_host``: host time of nested calls (vLLM's DFlash propose inside DDTree's,
    the tree scatter) per step, outermost call per label, no events; summarized as
    ``host_regions_ms`` and rendered as the host table."""
    timer = e2e_timing.StepTimer(event_factory=FakeEvent, capturing=lambda: False,
                                 synchronize=lambda: None, clock=lambda: HostClock.now)
    timer.wrap_step(FakeHostRunner, "execute_model")
    timer.wrap_span(FakeHostRunner, "sample_tokens", e2e_timing.SAMPLE_TOKENS)
    timer.wrap_span(FakeHostChain, "propose", e2e_timing.DRAFT)
    timer.wrap_span(FakeHostTree, "propose", e2e_timing.DRAFT)
    timer.wrap_host(FakeHostChain, "propose", e2e_timing.HOST_DFLASH)
    timer.wrap_host(FakeState, "store_trees_", e2e_timing.HOST_STORE)
    timer.wrap_host(FakeState, "store_trees_", e2e_timing.HOST_STORE)  # idempotent
    assert len(timer.installed) == 6

    runner = FakeHostRunner(FakeHostTree())
    timer.begin(prompt_len=100)
    for _ in range(2):
        runner.execute_model(FakeSchedulerOutput(False, [100]))
        runner.sample_tokens(None)
    assert runner.speculator.propose(None, dummy_run=True) == "chain"  # outside a step
    steps = timer.end()
    assert len(steps) == 2
    for s in steps:
        assert s["host_verify"] == 1000.0 and s["host_sample_tokens"] == 2750.0
        assert s["host_draft"] == 2500.0 and s["host_dflash_propose"] == 2000.0
        assert s["host_store_trees"] == 500.0 and s["host_budget"] == 0.0
    regions = e2e_timing.summarize_steps(steps)["host_regions_ms"]
    assert regions["dflash_propose"] == 2000.0 and regions["store_trees"] == 500.0

    row = {"run": "ddtree-64", "method": "ddtree", "budget": 64, "context": 1024,
           "batch": 1, "kind": "random", "status": "ok", "step_ms": 5.0,
           "host_regions_ms": regions}
    lines = e2e_report._host_table([row])
    assert "runner host / step" in lines[4]
    # runner host = execute_model + sample_tokens; empty regions read "—"
    assert "| 3750 | 1000 | 2750 | 2500 | 2000 | — | 500 | — | — | — | — |" in lines[6]
    assert e2e_report._host_table([dict(row, host_regions_ms=None)]) == []
    threaded = e2e_report._host_table([dict(row, engine_threads=["MainThread", "output"])])
    assert "Python threads" in threaded[4] and "| — | 2 |" in threaded[6]
    timed = e2e_report._host_table([dict(row, python_ms=1.234)])
    assert "Python ms (fixed loop" in timed[4] and timed[6].endswith("| 1.23 | — |")
    placed = e2e_report._host_table([dict(row, python_ms=1.234, cpu=5, numa_node=1)])
    assert placed[6].endswith("| 1.23 (cpu 5, node 1) | — |")
    machine = e2e_report._host_table([dict(row, python_ms=1.234, python_ms_after=2.5,
                                           host_steal_pct=12.34, host_busy_pct=20.4,
                                           host_mhz=2100.0)])
    assert "machine steal % / busy % / MHz" in machine[4]
    assert machine[6].endswith("| 1.23 -> 2.50 | 12.3 / 20 / 2100 |")


class GcRunner(FakeRunner):
    def execute_model(self, scheduler_output, intermediate_tensors=None, dummy_run=False):
        gc.collect()


def test_step_timer_counts_gc_pauses_inside_steps_only():
    timer = e2e_timing.StepTimer(event_factory=FakeEvent, capturing=lambda: False,
                                 synchronize=lambda: None)
    timer.wrap_step(GcRunner, "execute_model")
    runner = GcRunner(None)
    timer.begin(prompt_len=100)
    assert timer._on_gc in gc.callbacks
    runner.execute_model(FakeSchedulerOutput(False, [100]))
    gc.collect()  # after the step (output handling): still the last step's
    timer._current = None
    gc.collect()  # outside any step: not counted
    steps = timer.end()
    assert timer._on_gc not in gc.callbacks
    assert steps[0]["host_gc"] > 0.0
    summary = e2e_timing.summarize_steps(steps)
    assert summary["host_regions_ms"]["gc"] == steps[0]["host_gc"]


def test_allocator_calls_during_a_cell_are_reported():
    """Device frees of the caching allocator inside the measured generate synchronize the
    device: the row keeps the counts and notes them."""
    assert e2e_timing.allocator_delta({}, {"num_device_free": 1}) is None
    delta = e2e_timing.allocator_delta(
        {"num_device_alloc": 5, "num_device_free": 1, "num_alloc_retries": 0},
        {"num_device_alloc": 7, "num_device_free": 3, "num_alloc_retries": 1})
    assert delta == {"num_device_alloc": 2, "num_device_free": 2, "num_alloc_retries": 1}
    base = {"setup": "kimi8", "run": "ddtree-64", "method": "ddtree", "backend": "CUSTOM",
            "budget": 64, "context": 1024, "batch": 1, "kind": "random", "max_tokens": 65}
    summary = e2e_timing.split_step(40.0, 20, 0.5, 1.0) | {
        "sample_ms": 0.2, "compact_ms": 0.1, "step_ms_median": 2.0, "step_ms_max": 2.5,
        "prefill_steps": 1, "prefill_tokens": 0}
    row = e2e_runs.cell_row(base, summary, {}, wall_s=0.05, allocator=delta)
    assert row["allocator_calls"] == delta
    assert "freed device memory 2 times and retried 1" in row["note"]
    quiet = dict(delta, num_device_free=0, num_alloc_retries=0)
    assert "allocator" not in e2e_runs.cell_row(base, summary, {}, wall_s=0.05,
                                                 allocator=quiet)["note"]


# ---------------------------------------------------------------------------------------
# Host profile (BENCH_E2E_HOST_PROFILE) and host speed


def test_host_profile_reports_per_step_calls_of_a_fake_engine(tmp_path):
    import host_profile  # noqa: E402

    runner_file = tmp_path / "model_runner.py"
    runner_file.write_text(
        "def propose():\n    return sum(range(50))\n\n"
        "def execute_model():\n    propose()\n    propose()\n"
    )
    sys.path.insert(0, str(tmp_path))
    try:
        import model_runner  # the fake runner: 2 propose calls per engine step
    finally:
        sys.path.remove(str(tmp_path))

    class FakeLLM:
        def generate(self, inputs, params, use_tqdm=False):
            for _ in range(params):
                model_runner.execute_model()

    out = host_profile.profile_generate(FakeLLM(), [], 5, tmp_path / "p" / "x.md", "fake")
    text = out.read_text()
    assert text.startswith("# Host profile: fake")
    assert "5 engine steps" in text
    row = next(line for line in text.splitlines() if "model_runner.py:1 propose" in line)
    assert row.split("|")[2].strip() == "2.0"  # calls per step
    assert "## Threads: CPU time" in text and "| thread id |" in text  # psutil is there


def test_python_speed_is_a_positive_median_and_cpus_parse():
    before = e2e_timing.host_cpu_state()
    sum(i * i for i in range(200000))
    delta = e2e_timing.host_cpu_delta(before, e2e_timing.host_cpu_state())
    if delta:  # {} when the clock ticks did not advance (10 ms resolution)
        assert 0 <= delta["steal_pct"] <= 100 and 0 <= delta["busy_pct"] <= 100
    fake = {"times": {"user": 10.0, "system": 0.0, "idle": 10.0, "steal": 0.0}, "mhz": None}
    later = {"times": {"user": 13.0, "system": 1.0, "idle": 14.0, "steal": 2.0}, "mhz": 1800.0}
    assert e2e_timing.host_cpu_delta(fake, later) == {"steal_pct": 20.0, "busy_pct": 40.0,
                                                      "mhz": 1800.0}
    assert e2e_timing.host_cpu_delta(None, later) == {}
    ms = e2e_timing.python_speed_ms(repeats=3, n=2000)
    assert 0 < ms < 1000
    assert e2e_runs.parse_cpus("0-2,5") == {0, 1, 2, 5}
    cpu, node = e2e_timing.current_cpu_and_node()
    assert cpu is None or cpu in os.sched_getaffinity(0)
    assert node is None or node >= 0
    with pytest.raises(Exception, match="pin-cpus"):
        e2e_runs.parse_cpus("a-b")
    with pytest.raises(SystemExit):  # a CPU this machine lacks is refused up front
        parse_args(["--setup", "kimi8", "--pin-cpus", "100000", "--fake"])


def test_host_speed_report_normalises_steps_by_the_profiled_interpreter_speed(tmp_path):
    import host_speed_report

    run_dir = tmp_path / "call1"
    (run_dir / "profiles").mkdir(parents=True)
    rows = [{"run": "ddtree-64", "status": "ok", "step_ms": 4.0, "context": 1024, "batch": 1},
            {"run": "ddtree-64", "status": "ok", "step_ms": 9.0, "context": 131072, "batch": 1},
            {"run": "ddtree-auto-64", "status": "ok", "step_ms": 6.0, "context": 1024,
             "batch": 1}]
    (run_dir / "e2e_trained.json").write_text(json.dumps(
        {"invocations": [{"runs": ["ddtree-64", "ddtree-auto-64"]}], "rows": rows}))
    for name, us in (("ddtree-64", 0.2), ("ddtree-auto-64", 0.3)):
        calls = 200.0
        (run_dir / "profiles" / f"host_profile_{name}.md").write_text(
            f"# Host profile: {name}, trained, context 1024, batch 1\n\n## By own time\n\n"
            f"| `builtin:0 <built-in method builtins.isinstance>` | {calls} | "
            f"{calls * us / 1000:.3f} | 0.1 |\n")
    entries = host_speed_report.collect([run_dir])
    assert [(e["run"], e["order"]) for e in entries] == [("ddtree-64", 1),
                                                          ("ddtree-auto-64", 2)]
    assert [round(e["us_per_call"], 3) for e in entries] == [0.2, 0.3]
    # an --engine-process cell of the same run: its own row and profile are paired
    data = json.loads((run_dir / "e2e_trained.json").read_text())
    data["rows"].append({"run": "ddtree-64", "status": "ok", "step_ms": 3.0,
                         "engine_process": True, "context": 1024, "batch": 1})
    (run_dir / "e2e_trained.json").write_text(json.dumps(data))
    (run_dir / "profiles" / "host_profile_ddtree-64_engine.md").write_text(
        "# Host profile: ddtree-64, trained, context 1024, batch 1 (engine-core process)\n\n"
        "## By own time\n\n| `builtin:0 <built-in method builtins.isinstance>` | 100.0 | "
        "0.015 | 0.1 |\n")
    remote = [e for e in host_speed_report.collect([run_dir]) if "engine" in e["run"]]
    assert [(e["run"], e["step_ms"], round(e["us_per_call"], 3)) for e in remote] == [
        ("ddtree-64 (engine process)", 3.0, 0.15)]
    entries = host_speed_report.collect([run_dir])
    assert [e["step_ms"] for e in entries if e["run"] == "ddtree-64"] == [4.0]
    entries = [e for e in entries if "engine" not in e["run"]]
    host_speed_report.write(entries, tmp_path / "out", "cmd")
    table = (tmp_path / "out.md").read_text()
    assert "| call1 | 2 | ddtree-auto-64 | 1024 | 6.00 | 0.300 | — | 20.0 |" in table
    assert (tmp_path / "out.png").stat().st_size > 0


def test_remote_engine_runs_the_probes_through_collective_rpc(tmp_path, monkeypatch):
    """``--engine-process``: every probe goes through ``llm.collective_rpc(fn, args=...)``
    with the worker first (here a fake that runs it in this process) and rank 0's result
    comes back; the profile is started and stopped there around the generate."""
    import e2e_engine

    calls = []

    class FakeLLM:
        def collective_rpc(self, method, args=()):
            calls.append(method.__name__)
            return [method("worker", *args), "rank 1 ignored"]

        def generate(self, inputs, params, use_tqdm=False):
            calls.append("generate")

    monkeypatch.setattr(e2e_engine, "_TIMER", None)
    monkeypatch.setattr(e2e_timing.StepTimer, "install_vllm", lambda self: self.installed)
    monkeypatch.setattr(e2e_timing.StepTimer, "install_graph_modes", lambda self: None)
    engine = e2e_engine.RemoteEngine(FakeLLM())
    assert engine.remote and engine.hooks == [] and calls == ["engine_install_timer"]
    speed, _cpu, _node = engine.call(e2e_engine.engine_host_speed)
    assert speed > 0
    engine.call(e2e_engine.engine_timer_begin, 128)
    assert e2e_engine._TIMER.active and e2e_engine._TIMER.prompt_len == 128
    assert engine.call(e2e_engine.engine_timer_end) == []  # no step ran
    engine.profile(FakeLLM(), [], None, tmp_path / "p.md", "fake")
    assert calls[-3:] == ["engine_profile_start", "generate", "engine_profile_stop"]
    assert "(engine-core process)" in (tmp_path / "p.md").read_text()
    local = e2e_engine.LocalEngine()  # the in-process default: the same functions, direct
    assert not local.remote and local.call(e2e_engine.engine_active_counters) is None
