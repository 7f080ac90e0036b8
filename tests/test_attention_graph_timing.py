"""How the start-up attention table is timed: in CUDA graphs (``GraphTimer``) where the
run's decode steps replay FULL graphs, eagerly otherwise; a failed capture restores the
caller's stream and falls back to eager timing for good, and the table is then timed
eagerly throughout. CPU: the CUDA calls are faked (the GPU side:
tests/gpu/test_attention_graph_timer_gpu.py)."""

import logging
from contextlib import contextmanager
from types import SimpleNamespace as NS

import pytest
import torch
from test_adaptive_budget import fake_vllm_config
from vllm.config.compilation import CUDAGraphMode

from vllm_ddtree.budget import attention_timing
from vllm_ddtree.budget.attention_timing import (
    GraphTimer,
    attention_time_fn,
    full_decode_graphs,
    measure_attention_costs,
    measure_attention_table,
    target_attention_timer,
)

FULL_DECODE = {
    CUDAGraphMode.NONE: False,
    CUDAGraphMode.PIECEWISE: False,
    CUDAGraphMode.FULL: True,
    CUDAGraphMode.FULL_DECODE_ONLY: True,
    CUDAGraphMode.FULL_AND_PIECEWISE: True,
}


def config_with(mode, eager: bool = False):
    config = fake_vllm_config(True, eager=eager)
    config.compilation_config = NS(cudagraph_mode=mode)
    return config


@contextmanager
def warnings_of(logger: logging.Logger):
    """The WARNING records ``logger`` emits inside the block (vLLM's loggers do not
    propagate to the root logger that caplog watches)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


# -- graph or eager, from the cudagraph mode ------------------------------------------


def test_every_cudagraph_mode_is_classified():
    assert set(FULL_DECODE) == set(CUDAGraphMode)


@pytest.mark.parametrize("mode", list(FULL_DECODE), ids=str)
def test_graph_timing_follows_the_runs_cudagraph_mode(mode):
    """FULL graphs for decode (FULL, FULL_DECODE_ONLY, FULL_AND_PIECEWISE) on a CUDA
    device: a GraphTimer; NONE / PIECEWISE, enforce_eager or a CPU device: eager."""
    assert full_decode_graphs(config_with(mode)) is FULL_DECODE[mode]
    assert isinstance(attention_time_fn(config_with(mode), torch.device("cuda")),
                      GraphTimer) is FULL_DECODE[mode]
    assert not isinstance(attention_time_fn(config_with(mode), "cpu"), GraphTimer)
    assert not full_decode_graphs(config_with(mode, eager=True))
    assert not isinstance(attention_time_fn(config_with(mode, eager=True), "cuda"),
                          GraphTimer)


def test_no_cudagraph_mode_times_eagerly():
    assert not full_decode_graphs(config_with(None))
    assert not isinstance(attention_time_fn(config_with(None), "cuda"), GraphTimer)


def test_target_timer_times_with_the_runs_time_fn(monkeypatch):
    """Without a ``time_fn`` the target's timer takes ``attention_time_fn``'s choice
    for the run's config and device (the launch is mocked)."""
    from vllm_ddtree.attention_backends import mla_tree

    monkeypatch.setattr(mla_tree, "mla_tree_verify", lambda *a, **k: None)
    chosen = []

    def choose(config, device):
        chosen.append((config, device))
        return lambda run: (run(), 7e-6)[1]

    monkeypatch.setattr(attention_timing, "attention_time_fn", choose)
    config = config_with(CUDAGraphMode.FULL_AND_PIECEWISE)
    measure = target_attention_timer(config, 1 + 4, torch.device("cpu"))
    assert measure(24, 3) == 7e-6
    assert chosen == [(config, torch.device("cpu"))]


def test_graph_timer_refuses_bad_counts():
    with pytest.raises(ValueError, match=r"calls_per_graph=0.*calls_per_graph >= 1"):
        GraphTimer(calls_per_graph=0)
    with pytest.raises(ValueError, match=r"samples=0.*samples >= 1"):
        GraphTimer(samples=0)
    with pytest.raises(ValueError, match=r"warmup=-1.*warmup >= 0"):
        GraphTimer(warmup=-1)


# -- the capture helper restores the caller's stream ----------------------------------


class FakeStream:
    def __init__(self, name):
        self.name = name
        self.waited_on = []

    def wait_stream(self, other):
        self.waited_on.append(other)


class FakeGraph:
    """``torch.cuda.CUDAGraph``: ``pool()`` raises unless its capture ended, as torch's."""

    kind = "graph"

    def __init__(self):
        self.ended = False

    def pool(self):
        if not self.ended:
            raise RuntimeError("Called CUDAGraph::pool() without a preceding successful "
                               "capture.")
        return "pool-of-graph"


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda's stream, graph and graph-pool calls, faked: ``torch.cuda.graph``
    behaves as torch 2.11's (its exit ends the capture first, which raises after a
    capture the body's error invalidated, before the allocator stops routing to the
    pool, and only then restores the stream); ``undo`` records the allocator calls."""
    caller = FakeStream("caller")
    cuda = NS(current=caller, caller=caller, set_stream_calls=[], graph_kwargs=[],
              side=None, graphs=[], undo=[], undo_errors={}, invalidating=True)

    def new_stream():
        cuda.side = FakeStream("side")
        return cuda.side

    def set_stream(stream):
        cuda.set_stream_calls.append(stream)
        cuda.current = stream

    def new_graph():
        cuda.graphs.append(FakeGraph())
        return cuda.graphs[-1]

    class FakeGraphContext:
        def __init__(self, graph, pool=None, stream=None, capture_error_mode="global"):
            cuda.graph_kwargs.append(dict(pool=pool, stream=stream,
                                          capture_error_mode=capture_error_mode))
            self.graph, self.stream = graph, stream

        def __enter__(self):
            self.previous, cuda.current = cuda.current, self.stream

        def __exit__(self, exc_type, *args):
            if exc_type is not None and cuda.invalidating:  # capture_end raises
                raise RuntimeError("CUDA error: operation failed due to a previous error "
                                   "during capture")
            self.graph.ended = True
            cuda.current = self.previous

    def allocator_call(name):
        def call(device, pool):
            cuda.undo.append((name, device, pool))
            if name in cuda.undo_errors:
                raise RuntimeError(cuda.undo_errors[name])
        return call

    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: cuda.current)
    monkeypatch.setattr(torch.cuda, "Stream", new_stream)
    monkeypatch.setattr(torch.cuda, "set_stream", set_stream)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", new_graph)
    monkeypatch.setattr(torch.cuda, "graph", FakeGraphContext)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: ("pool", 7))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda.memory, "_cuda_endAllocateToPool", allocator_call("end"))
    monkeypatch.setattr(torch.cuda.memory, "_cuda_releasePool", allocator_call("release"))
    return cuda


def not_capturable_on(cuda, calls):
    def run():
        calls.append(cuda.current.name)
        raise RuntimeError("operation not permitted when stream is capturing")
    return run


def test_failed_capture_restores_the_callers_stream(fake_cuda):
    calls = []
    with pytest.raises(RuntimeError, match="previous error during capture"):
        attention_timing._capture_cuda_graph(not_capturable_on(fake_cuda, calls), calls=3)
    assert calls == ["side"]  # ran on the side stream, stopped at the error
    assert fake_cuda.set_stream_calls == [fake_cuda.caller]
    assert fake_cuda.current is fake_cuda.caller
    assert fake_cuda.graph_kwargs == [dict(pool=("pool", 7), stream=fake_cuda.side,
                                           capture_error_mode="thread_local")]
    assert fake_cuda.side.waited_on == [fake_cuda.caller]


def test_failed_capture_gives_the_allocator_its_pool_back(fake_cuda):
    """torch 2.11's capture_end raises before it ends the allocator's routing to the
    graph's pool, and the graph never releases a pool whose capture did not end: the
    helper ends the routing and releases the pool (on the capture's device), or the
    allocator would believe a capture is under way for the rest of the run."""
    with pytest.raises(RuntimeError):
        attention_timing._capture_cuda_graph(not_capturable_on(fake_cuda, []), calls=3)
    assert fake_cuda.undo == [("end", 3, ("pool", 7)), ("release", 3, ("pool", 7))]


def test_undo_steps_the_capture_never_reached_are_skipped(fake_cuda):
    """A capture that failed before routing began (or after it ended): the allocator
    refuses to end the routing; the pool is still released, and the caller sees the
    capture's own error (capture_end's)."""
    fake_cuda.undo_errors["end"] = "endAllocatePool: not currently recording to mempool_id"
    with pytest.raises(RuntimeError, match="previous error during capture"):
        attention_timing._capture_cuda_graph(not_capturable_on(fake_cuda, []), calls=3)
    assert [name for name, *_ in fake_cuda.undo] == ["end", "release"]
    fake_cuda.undo.clear()
    fake_cuda.undo_errors["release"] = "INTERNAL ASSERT FAILED: it != graph_pools.end()"
    with pytest.raises(RuntimeError, match="previous error during capture"):
        attention_timing._capture_cuda_graph(not_capturable_on(fake_cuda, []), calls=3)
    assert [name for name, *_ in fake_cuda.undo] == ["end", "release"]
    assert fake_cuda.current is fake_cuda.caller


def test_an_ended_capture_keeps_its_pool_for_the_graph(fake_cuda):
    """The body raised, but the capture ended (nothing invalidated it): the graph owns
    its pool and releases it when destroyed; the helper undoes nothing. A successful
    capture neither."""
    fake_cuda.invalidating = False

    def bad_argument():
        raise ValueError("bad launch argument")

    with pytest.raises(ValueError, match="bad launch argument"):
        attention_timing._capture_cuda_graph(bad_argument, calls=2)
    assert fake_cuda.undo == [] and fake_cuda.current is fake_cuda.caller
    graph = attention_timing._capture_cuda_graph(lambda: None, calls=2)
    assert graph.ended and fake_cuda.undo == []


def test_capture_runs_the_calls_on_a_side_stream(fake_cuda):
    calls = []
    graph = attention_timing._capture_cuda_graph(lambda: calls.append(fake_cuda.current),
                                                 calls=3)
    assert graph.kind == "graph"
    assert calls == [fake_cuda.side] * 3
    assert fake_cuda.current is fake_cuda.caller
    assert fake_cuda.caller.waited_on == [fake_cuda.side]  # the caller waits for capture
    assert fake_cuda.undo == []


def test_replay_time_is_the_median_after_warmup(monkeypatch):
    """``_median_replay_seconds``: ``warmup`` untimed replays, then one replay between
    two events per sample; the median sample, in seconds."""
    replays = []
    elapsed_ms = iter([5.0, 1.0, 3.0, 100.0, 2.0, 4.0, 6.0])

    class FakeEvent:
        def __init__(self, enable_timing=False):
            assert enable_timing

        def record(self):
            self.replays = len(replays)

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            assert end.replays == self.replays + 1  # one replay per sample
            return next(elapsed_ms)

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    graph = NS(replay=lambda: replays.append(1))
    seconds = attention_timing._median_replay_seconds(graph, warmup=3, samples=7)
    assert len(replays) == 3 + 7
    assert seconds == pytest.approx(4e-3)


# -- GraphTimer: graphs, and the sticky eager fallback --------------------------------


class FakeCapture:
    """``_capture_cuda_graph`` that succeeds ``successes`` times, then raises."""

    def __init__(self, successes: int):
        self.successes = successes
        self.attempts = []

    def __call__(self, run, calls):
        self.attempts.append(calls)
        if len(self.attempts) > self.successes:
            raise RuntimeError("operation not permitted when stream is capturing")
        return NS(kind="graph")


GRAPH_REPLAY_SECONDS = 8e-6  # one replay of calls_per_graph = 4 calls


def eager_seconds(context: int, query_len: int) -> float:
    """What the fake eager timer reports for a cell: far from any graph time."""
    return 1e-3 * (1 + context / 1024) * query_len


@pytest.fixture
def fake_graph_timing(monkeypatch):
    """Graph timing faked on the CPU; returns ``install(successes) -> (timer, capture,
    eager_cells)``: the timer's eager time_fn records the cell of each call."""
    monkeypatch.setattr(attention_timing, "_median_replay_seconds",
                        lambda graph, warmup, samples: GRAPH_REPLAY_SECONDS)

    def install(successes):
        capture = FakeCapture(successes)
        monkeypatch.setattr(attention_timing, "_capture_cuda_graph", capture)
        eager_cells = []

        def eager(run):
            cell = run()
            eager_cells.append(cell)
            return eager_seconds(*cell)

        return GraphTimer(calls_per_graph=4, eager_time_fn=eager), capture, eager_cells

    return install


def cell_measure(time_fn, runs=None):
    """A measure_fn whose call returns its cell ``(context, query_len)``."""
    def measure(context, query_len):
        def run():
            if runs is not None:
                runs.append((context, query_len))
            return context, query_len
        return time_fn(run)
    return measure


def test_graph_timer_times_replays_per_call(fake_graph_timing):
    timer, capture, eager_cells = fake_graph_timing(successes=10)
    runs = []
    seconds = cell_measure(timer, runs)(1024, 3)
    assert seconds == pytest.approx(GRAPH_REPLAY_SECONDS / 4)
    assert capture.attempts == [4]  # 4 calls in one graph
    assert runs == [(1024, 3)]  # one eager call (compiles) before the capture
    assert eager_cells == [] and timer.in_graphs and timer.graph_timings == 1


def test_failed_capture_falls_back_to_eager_for_good(fake_graph_timing):
    """One capture attempt, one warning naming the error, every call eager after."""
    timer, capture, eager_cells = fake_graph_timing(successes=0)
    measure = cell_measure(timer)
    with warnings_of(attention_timing.logger) as warnings:
        times = [measure(c, q) for c in (1024, 4096) for q in (1, 2, 3)]
    assert capture.attempts == [4]  # not retried cell by cell
    assert times == [eager_seconds(c, q) for c in (1024, 4096) for q in (1, 2, 3)]
    assert eager_cells == [(c, q) for c in (1024, 4096) for q in (1, 2, 3)]
    assert len(warnings) == 1
    message = warnings[0].getMessage()
    assert "RuntimeError" in message and "not permitted when stream is capturing" in message
    assert timer.failure == "RuntimeError: operation not permitted when stream is capturing"
    assert not timer.in_graphs and timer.graph_timings == 0


CONTEXTS, BUDGETS = [1024, 4096, 16384], [1, 2, 4]


def eager_reference():
    seconds = [[eager_seconds(c, 1 + b) for b in BUDGETS] for c in CONTEXTS]
    return torch.tensor(seconds, dtype=torch.float32), [eager_seconds(c, 1) for c in CONTEXTS]


@pytest.mark.parametrize("successes", [0, 1, 5, 9, 11])
def test_a_failure_anywhere_leaves_a_table_timed_eagerly_throughout(
        fake_graph_timing, successes):
    """The capture fails at the first cell, mid-grid, or in the one-row column (9 table
    cells, then 3 plain ones): every cell of the table and the column is the eager
    time, after exactly one failed capture."""
    timer, capture, eager_cells = fake_graph_timing(successes)
    with warnings_of(attention_timing.logger) as warnings:
        table, plain = measure_attention_costs(cell_measure(timer), CONTEXTS, BUDGETS,
                                               time_fn=timer)
    seconds, plain_reference = eager_reference()
    torch.testing.assert_close(table.seconds, seconds, rtol=0, atol=0)
    assert plain == pytest.approx(plain_reference, rel=1e-6)
    assert len(capture.attempts) == successes + 1 and len(warnings) == 1
    grid = [(c, 1 + b) for c in CONTEXTS for b in BUDGETS] + [(c, 1) for c in CONTEXTS]
    # timed again from the start when some cells were timed in graphs
    assert eager_cells == (grid if successes == 0 else grid[successes:] + grid)


def test_graph_timed_table_without_failure(fake_graph_timing):
    timer, capture, eager_cells = fake_graph_timing(successes=100)
    table, plain = measure_attention_costs(cell_measure(timer), CONTEXTS, BUDGETS,
                                           time_fn=timer)
    assert bool((table.seconds == GRAPH_REPLAY_SECONDS / 4).all())
    assert plain == [pytest.approx(GRAPH_REPLAY_SECONDS / 4)] * len(CONTEXTS)
    assert eager_cells == [] and len(capture.attempts) == 12


def test_costs_match_the_table_for_an_eager_measure():
    """Without a GraphTimer: :func:`measure_attention_table`'s table, and the one-row
    column."""
    measure = lambda c, q: eager_seconds(c, q)  # noqa: E731
    table, plain = measure_attention_costs(measure, CONTEXTS, BUDGETS)
    torch.testing.assert_close(table.seconds,
                               measure_attention_table(measure, CONTEXTS, BUDGETS).seconds)
    assert plain == pytest.approx(eager_reference()[1], rel=1e-6)
