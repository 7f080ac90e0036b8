"""Where ``bench_e2e`` measures: in the process that runs vLLM's model runner.

By default a benchmark child runs the engine in its own process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the step timer, the DDTree counters, the
allocator counters and the host profile are read directly (:class:`LocalEngine`). That
also puts vLLM's front-end work (stat loggers, output processing, detokenisation) on the
engine's thread, which ``vllm serve`` and a default ``LLM()`` run in another process.
``--engine-process`` keeps vLLM's own layout (engine core in a child process) and reads
the same figures there through ``LLM.collective_rpc`` (:class:`RemoteEngine`): the
functions below are sent by reference (this module must be importable in the engine
process: the child puts ``evals/`` on ``PYTHONPATH``) and run on the worker, which the
uni-process executor drives from the engine core's thread.

Every ``engine_*`` function takes the worker (``collective_rpc``'s first argument; None
in-process) and returns plain data.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

_TIMER = None  # the StepTimer of this (engine) process
_PROFILE = None  # the cProfile.Profile running in this process, if any
_BATCH: list[int] | None = None  # [steps, requests scheduled in them] while counting


def install_batch_counter(cls: Any = None) -> None:
    """Count the requests each ``execute_model`` of ``cls`` (vLLM's V2
    ``GPUModelRunner``) schedules while :func:`engine_batch_count_start` is on: the
    engine's own batch, which a client's in-flight count cannot show (a refill waits
    for a step, a preempted request leaves it). Two integer additions a step."""
    if cls is None:
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner as cls
    original = cls.execute_model
    if getattr(original, "_e2e_batch_counter", False):
        return

    def execute_model(self, scheduler_output, *args, **kwargs):
        if _BATCH is not None and getattr(scheduler_output, "total_num_scheduled_tokens", 0):
            _BATCH[0] += 1
            _BATCH[1] += len(scheduler_output.num_scheduled_tokens)
        return original(self, scheduler_output, *args, **kwargs)

    execute_model._e2e_batch_counter = True
    cls.execute_model = execute_model


def engine_batch_count_start(worker: Any = None) -> None:
    global _BATCH
    install_batch_counter()
    _BATCH = [0, 0]


def engine_batch_count_take(worker: Any = None) -> float | None:
    """Mean requests per step since :func:`engine_batch_count_start` (None: no step)."""
    global _BATCH
    got, _BATCH = _BATCH, None
    return got[1] / got[0] if got and got[0] else None


def engine_install_timer(worker: Any = None) -> list[str]:
    """Wrap vLLM's runner in this process with a ``StepTimer`` (once); its hooks."""
    global _TIMER
    from e2e_timing import StepTimer

    if _TIMER is None:
        _TIMER = StepTimer()
        _TIMER.install_vllm()
        _TIMER.install_graph_modes()
    return list(_TIMER.installed)


def engine_timer_begin(worker: Any, prompt_len: int | None) -> None:
    _TIMER.begin(prompt_len=prompt_len)


def engine_timer_end(worker: Any = None) -> list[dict]:
    return _TIMER.end()


def engine_host_speed(worker: Any = None) -> tuple[float, int | None, int | None]:
    """(``python_speed_ms``, CPU, NUMA node) of this process."""
    from e2e_timing import current_cpu_and_node, python_speed_ms

    return (python_speed_ms(), *current_cpu_and_node())


def engine_allocator_counts(worker: Any = None) -> dict[str, int]:
    from e2e_timing import allocator_counts

    return allocator_counts()


def engine_active_counters(worker: Any = None) -> tuple[int, int] | None:
    """(active tree nodes, verified trees) counted by ``ddtree_budget: "auto"`` in this
    process, or None."""
    from vllm_ddtree.runtime_state import DDTREE_STATE

    if not DDTREE_STATE.adaptive or DDTREE_STATE.active_nodes_sum is None:
        return None
    return int(DDTREE_STATE.active_nodes_sum.item()), int(DDTREE_STATE.num_drafts.item())


def _worker_gate(worker: Any) -> Any:
    """The worker's ``SpeculationGate`` (``ddtree_budget: "auto"``), or None."""
    runner = getattr(worker, "model_runner", None)
    plan = getattr(getattr(runner, "speculator", None), "step_plan", None)
    return getattr(plan, "gate", None)


def engine_gate_snapshot(worker: Any) -> dict | None:
    """``ddtree_budget: "auto"``'s step gate per batch-size bucket
    (``SpeculationGate.snapshot``), or None without one. Needs the worker: call it
    through ``LLM.collective_rpc``, in-process too."""
    gate = _worker_gate(worker)
    return None if gate is None else gate.snapshot()


def engine_gate_forget(worker: Any) -> bool:
    """Drops what ``ddtree_budget: "auto"``'s step gate learned (``SpeculationGate.forget``)
    after the warm-up's random prompts, so the cells start as a fresh server does;
    False without a gate. Through ``LLM.collective_rpc``."""
    gate = _worker_gate(worker)
    if gate is not None:
        gate.forget()
    return gate is not None


def engine_gate_skip_gap(worker: Any) -> bool:
    """``--interleave-s``: the step gate leaves out the interval from the last step's
    start to the next one's, which spans the other runs' turn (its timing events are
    ``SpeculationGate.marks``; a mark without a modeled time is never a sample). False
    without a gate or a mark. Through ``LLM.collective_rpc``."""
    gate = _worker_gate(worker)
    if gate is None or not gate.marks:
        return False
    gate.marks[-1].model = None
    return True


def engine_gate_trace_start(worker: Any = None) -> None:
    """Start (or restart) the step gate's trace in this process (``gate_trace``)."""
    import gate_trace

    gate_trace.install()


def engine_gate_trace_take(worker: Any = None) -> list[list]:
    """The step gate's trace records since the start or the last take."""
    import gate_trace

    return gate_trace.take()


def engine_threads(worker: Any = None) -> list[str]:
    """Names of this process's live Python threads: Triton's launcher releases the GIL
    around every launch, so any of them that wants it can run inside a round."""
    import threading

    return sorted(t.name for t in threading.enumerate())


def engine_profile_start(worker: Any = None) -> None:
    """Start cProfile on this thread (the engine core's, which runs the steps)."""
    global _PROFILE
    import cProfile

    _PROFILE = cProfile.Profile()
    _PROFILE.enable()


def engine_profile_stop(worker: Any, path: str, title: str) -> str:
    """Stop it and write ``host_profile.summarize`` to ``path``."""
    global _PROFILE
    from host_profile import summarize

    profile, _PROFILE = _PROFILE, None
    profile.disable()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(summarize(profile, title + " (engine-core process)"))
    profile.dump_stats(Path(path).with_suffix(".prof"))  # host_profile.py diff reads it
    return path


class LocalEngine:
    """The figures of an in-process engine (the child's own process)."""

    remote = False

    def __init__(self) -> None:
        self.hooks = engine_install_timer()  # before LLM(): the runner classes it wraps

    def call(self, fn, *args):
        return fn(None, *args)

    def profile(self, llm, inputs, params, path: Path, title: str) -> None:
        from host_profile import profile_generate

        profile_generate(llm, inputs, params, path, title)


class RemoteEngine(LocalEngine):
    """The same figures from vLLM's engine-core process, through ``collective_rpc``
    (one worker: tensor-parallel runs read rank 0)."""

    remote = True

    def __init__(self, llm) -> None:
        self.llm = llm
        self.hooks = self.call(engine_install_timer)

    def call(self, fn, *args):
        return self.llm.collective_rpc(fn, args=args)[0]

    def profile(self, llm, inputs, params, path: Path, title: str) -> None:
        self.call(engine_profile_start)
        try:
            llm.generate(inputs, params, use_tqdm=False)
        finally:
            self.call(engine_profile_stop, str(path), title)
