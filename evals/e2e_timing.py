"""Where a decoding step's time goes: CUDA events around vLLM 0.26's V2 runner stages.

Used by ``evals/bench_e2e.py`` inside the process that runs the model (the engine runs
in-process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, with the uni-process executor, which
calls the runner synchronously from the engine loop's thread).

One engine step of the V2 runner (``vllm/v1/worker/gpu/model_runner.py``) is
``execute_model`` (input preparation + the target forward; for speculative methods the
forward over ``[bonus, drafts...]`` is the *verify* pass) followed by ``sample_tokens``
(sampler / rejection sampler / DDTree's tree walk, bookkeeping, then
``speculator.propose``: the *draft* of the next round, ``model_runner.py:1507``). The
engine core calls them in that order for every step (``v1/engine/core.py``
``step_with_batch_queue``). We record a CUDA event pair on the current stream around

- ``GPUModelRunner.execute_model``                 -> ``verify``
- ``GPUModelRunner.sample_tokens``                 -> ``sample_tokens`` (contains draft)
- ``DFlashSpeculator.propose`` / ``DDTreeSpeculator.propose`` -> ``draft`` (outermost
  call only: ``DDTreeSpeculator.propose`` calls ``DFlashSpeculator.propose`` through
  ``super()``, so a depth counter keeps the time from being counted twice)
- ``DDTreeSpeculator._compact_target_kv``          -> ``compact`` (part of draft)

and we note the CUDA-graph mode of each dispatch (``CudaGraphManager.dispatch``): the
target's (``ModelCudaGraphManager``, the verify forward) and the drafter's
(``DFlashCudaGraphManager``). A decode step whose verify did not replay a FULL graph
(e.g. an adaptive verify shape with no captured graph) runs piecewise or eager, with
far more host work; ``summarize_steps`` counts those steps.

Beside each GPU span the timer keeps the host time spent inside the same call
(``time.perf_counter``): ``host_draft`` / ``host_verify`` in ms. A GPU span close to
its host time means the GPU waited for the host's launches (a host-bound stage);
one well above it means GPU work (the host ran ahead). Host time alone (no events) is
also kept for the pieces a step's host time is made of (``HOST_REGIONS``): vLLM's
DFlash ``propose`` (inside DDTree's), DDTree's KV compaction, tree scatter, budget
choice and verifier, and the whole ``sample_tokens``, plus the Python garbage
collector's pauses inside a step (``gc.callbacks``: a collection may land in any region);
``summarize_steps`` reports their means as ``host_regions_ms``.

Events are only recorded while ``StepTimer.active`` is set, never in dummy runs or
during CUDA-graph capture, and never synchronized inside a step: ``StepTimer.end``
synchronizes once after ``generate`` and converts the events to milliseconds. A span
measures GPU-timeline time from the moment the stream reaches its start event to the
moment it reaches its end event, so host time during which the GPU waits for the
stage's launches is included in that stage; the gaps between stages (scheduler, output
handling) end up in *other*.
"""

from __future__ import annotations

import gc
import inspect
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

# Raw span labels recorded per step.
VERIFY, SAMPLE_TOKENS, DRAFT, COMPACT = "verify", "sample_tokens", "draft", "compact"
SPAN_LABELS = (VERIFY, SAMPLE_TOKENS, DRAFT, COMPACT)
# Host-only labels (StepTimer.wrap_host): where a step's host time goes.
HOST_DFLASH, HOST_STORE, HOST_BUDGET, HOST_VERIFIER, HOST_GC = (
    "dflash_propose", "store_trees", "budget", "verifier", "gc")
HOST_REGIONS = (VERIFY, SAMPLE_TOKENS, DRAFT, HOST_DFLASH, COMPACT, HOST_STORE,
                HOST_BUDGET, HOST_VERIFIER, HOST_GC)


def _add_host(step: dict, label: str, seconds: float) -> None:
    """Add ``seconds`` of host time to region ``label`` of a raw step."""
    host = step.setdefault("host", {})
    host[label] = host.get(label, 0.0) + seconds


def _cuda_event():
    import torch

    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _cuda_capturing() -> bool:
    import torch

    return torch.cuda.is_current_stream_capturing()


def _cuda_sync() -> None:
    import torch

    torch.cuda.synchronize()


def is_decode_step(scheduler_output: Any, prompt_len: int | None) -> bool:
    """Whether a scheduled step only continues requests past their prompt.

    With ``prompt_len`` (every prompt of the measured batch has this length): no new
    request, and every scheduled request has ``num_computed_tokens >= prompt_len``
    (``CachedRequestData.num_computed_tokens``, ``v1/core/sched/output.py``). Without
    it: every request schedules exactly ``1 + its draft tokens``.
    """
    if getattr(scheduler_output, "total_num_scheduled_tokens", 0) == 0:
        return False
    if getattr(scheduler_output, "scheduled_new_reqs", None):
        return False
    scheduled = scheduler_output.num_scheduled_tokens
    if prompt_len is not None:
        cached = scheduler_output.scheduled_cached_reqs
        computed = dict(zip(cached.req_ids, cached.num_computed_tokens, strict=False))
        return all(computed.get(req_id, -1) >= prompt_len for req_id in scheduled)
    spec = getattr(scheduler_output, "scheduled_spec_decode_tokens", None) or {}
    return all(n == 1 + len(spec.get(req_id, ())) for req_id, n in scheduled.items())


def _arg(args: tuple, kwargs: dict, names: list[str], name: str, default=None):
    """Argument ``name`` of a call ``f(self, *args, **kwargs)`` whose parameters after
    ``self`` are ``names``."""
    if name in kwargs:
        return kwargs[name]
    if name in names:
        index = names.index(name)
        if index < len(args):
            return args[index]
    return default


class StepTimer:
    """Records per-step CUDA event spans of vLLM's V2 runner (see the module doc)."""

    def __init__(self, event_factory: Callable[[], Any] = _cuda_event,
                 capturing: Callable[[], bool] = _cuda_capturing,
                 synchronize: Callable[[], None] = _cuda_sync,
                 clock: Callable[[], float] = time.perf_counter):
        self.event_factory = event_factory
        self.clock = clock
        self.capturing = capturing
        self.synchronize = synchronize
        self.active = False
        self.prompt_len: int | None = None
        self.raw_steps: list[dict] = []
        self._current: dict | None = None
        self._depth: dict[str, int] = {}
        self._suppressed = 0
        self._open: dict | None = None  # the step whose execute_model is running
        self._gc_start: float | None = None
        self.installed: list[str] = []

    # -- measurement window -------------------------------------------------------------

    def begin(self, prompt_len: int | None) -> None:
        self.raw_steps = []
        self._current = None
        self._depth = {}
        self._suppressed = 0
        self._gc_start = None
        self.prompt_len = prompt_len
        self.active = True
        if self._on_gc not in gc.callbacks:
            gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        """``gc.callbacks`` hook: a collection's pause goes to host region ``gc`` of the
        step it interrupted, or of the last recorded step when it ran after it (vLLM's
        output handling and scheduling between steps)."""
        if phase == "start":
            self._gc_start = self.clock()
            return
        step = self._open or self._current
        if self._gc_start is None or step is None or not self.active:
            return
        _add_host(step, HOST_GC, self.clock() - self._gc_start)
        self._gc_start = None

    def end(self) -> list[dict]:
        """Stop recording; synchronize once; per step: ``decode``, ``tokens``,
        ``start`` / ``end`` (ms from the first step's start) and ms per span label."""
        self.active = False
        self._current = None
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        if not self.raw_steps:
            return []
        self.synchronize()
        ref = self.raw_steps[0]["spans"][VERIFY][0][0]
        steps = []
        for raw in self.raw_steps:
            spans = raw["spans"]
            start = ref.elapsed_time(spans[VERIFY][0][0])
            last = spans.get(SAMPLE_TOKENS) or spans[VERIFY]
            step = {"decode": raw["decode"], "tokens": raw["tokens"], "start": start,
                    "end": ref.elapsed_time(last[-1][1]), "graphs": raw.get("graphs", {})}
            for label in SPAN_LABELS:
                step[label] = sum(e0.elapsed_time(e1) for e0, e1 in spans.get(label, ()))
            for label in HOST_REGIONS:
                step[f"host_{label}"] = 1000 * raw.get("host", {}).get(label, 0.0)
            steps.append(step)
        return steps

    # -- wrappers -----------------------------------------------------------------------

    def _recording(self) -> bool:
        return self.active and not self.capturing()

    def wrap_step(self, cls: type, name: str = "execute_model") -> None:
        """``cls.name(self, scheduler_output, ..., dummy_run=False, ...)`` starts a step."""
        original = cls.__dict__[name]
        if getattr(original, "_e2e_timer", None) is self:
            return
        names = list(inspect.signature(original).parameters)[1:]
        timer = self

        def wrapper(runner, *args, **kwargs):
            scheduler_output = _arg(args, kwargs, names, "scheduler_output",
                                    args[0] if args else None)
            if (not timer._recording() or _arg(args, kwargs, names, "dummy_run", False)
                    or scheduler_output is None
                    or not getattr(scheduler_output, "total_num_scheduled_tokens", 0)):
                return original(runner, *args, **kwargs)
            step = {"decode": is_decode_step(scheduler_output, timer.prompt_len),
                    "tokens": int(scheduler_output.total_num_scheduled_tokens),
                    "spans": {}, "host": {}}
            timer._current = None
            timer._open = step
            start, host_start = timer.event_factory(), timer.clock()
            try:
                return original(runner, *args, **kwargs)
            finally:
                step["spans"][VERIFY] = [(start, timer.event_factory())]
                step["host"][VERIFY] = timer.clock() - host_start
                timer.raw_steps.append(step)
                timer._open = None
                timer._current = step

        self._install(cls, name, original, wrapper)

    def wrap_span(self, cls: type, name: str, label: str) -> None:
        """Record ``cls.name`` as span ``label`` of the current step (outermost call
        only; ``dummy_run=True`` calls are skipped)."""
        original = cls.__dict__[name]
        if getattr(original, "_e2e_timer", None) is self:
            return
        names = list(inspect.signature(original).parameters)[1:]
        timer = self

        def wrapper(obj, *args, **kwargs):
            step = timer._current
            depth = timer._depth.get(label, 0)
            dummy = bool(_arg(args, kwargs, names, "dummy_run", False))
            if step is None or depth or dummy or timer._suppressed or not timer._recording():
                # Pass through; a dummy run also hides the spans nested in it.
                timer._depth[label] = depth + 1
                timer._suppressed += dummy
                try:
                    return original(obj, *args, **kwargs)
                finally:
                    timer._depth[label] = depth
                    timer._suppressed -= dummy
            timer._depth[label] = 1
            start, host_start = timer.event_factory(), timer.clock()
            try:
                return original(obj, *args, **kwargs)
            finally:
                step["spans"].setdefault(label, []).append((start, timer.event_factory()))
                _add_host(step, label, timer.clock() - host_start)
                timer._depth[label] = 0

        self._install(cls, name, original, wrapper)

    def wrap_host(self, cls: type, name: str, label: str) -> None:
        """Add the host time of ``cls.name`` (outermost call per label, no CUDA events,
        dummy runs skipped) to host region ``label`` of the current step."""
        original = cls.__dict__[name]
        if getattr(original, "_e2e_host", None) == (id(self), label):
            return
        names = list(inspect.signature(original).parameters)[1:]
        timer = self
        key = f"host:{label}"

        def wrapper(obj, *args, **kwargs):
            step = timer._open or timer._current
            depth = timer._depth.get(key, 0)
            if (step is None or depth or timer._suppressed or not timer._recording()
                    or _arg(args, kwargs, names, "dummy_run", False)):
                return original(obj, *args, **kwargs)
            timer._depth[key] = 1
            host_start = timer.clock()
            try:
                return original(obj, *args, **kwargs)
            finally:
                _add_host(step, label, timer.clock() - host_start)
                timer._depth[key] = 0

        self._install(cls, name, original, wrapper)
        wrapper._e2e_host = (id(self), label)

    def wrap_dispatch(self, cls: type, label: str) -> None:
        """Note the ``cg_mode`` name of every ``cls.dispatch`` result inside a recorded
        step, under ``step["graphs"][label]`` (``wrap_inherited_dispatch``)."""
        timer = self

        def note(desc, args, kwargs) -> None:
            step = timer._open or timer._current
            if step is not None and timer._recording():
                step.setdefault("graphs", {}).setdefault(label, []).append(mode_name(desc))

        if wrap_inherited_dispatch(cls, note, owner=self):
            self.installed.append(f"{cls.__module__}.{cls.__qualname__}.dispatch")

    def _install(self, cls: type, name: str, original, wrapper) -> None:
        wrapper.__name__ = getattr(original, "__name__", name)
        wrapper.__qualname__ = getattr(original, "__qualname__", name)
        wrapper.__doc__ = getattr(original, "__doc__", None)
        wrapper.__wrapped__ = original
        wrapper._e2e_timer = self
        setattr(cls, name, wrapper)
        self.installed.append(f"{cls.__module__}.{cls.__qualname__}.{name}")

    def install_vllm(self) -> list[str]:
        """Wrap vLLM 0.26's V2 runner and speculators (and DDTree's when importable)."""
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner
        from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator

        self.wrap_step(GPUModelRunner, "execute_model")
        self.wrap_span(GPUModelRunner, "sample_tokens", SAMPLE_TOKENS)
        self.wrap_span(DFlashSpeculator, "propose", DRAFT)
        try:
            from vllm_ddtree.draft.speculator import DDTreeSpeculator
        except ImportError:
            return self.installed
        if "propose" in DDTreeSpeculator.__dict__:
            self.wrap_span(DDTreeSpeculator, "propose", DRAFT)
        if "_compact_target_kv" in DDTreeSpeculator.__dict__:
            self.wrap_span(DDTreeSpeculator, "_compact_target_kv", COMPACT)
        self.install_host_regions()
        return self.installed

    def install_host_regions(self) -> None:
        """Host-only regions (``HOST_REGIONS``) of vLLM's DFlash propose and of DDTree's
        per-round host work (vLLM 0.26 V2 runner; DDTree's only when importable)."""
        from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator

        self.wrap_host(DFlashSpeculator, "propose", HOST_DFLASH)
        try:
            from vllm_ddtree.budget.policy import BudgetPolicy
            from vllm_ddtree.runtime_state import DDTreeRuntimeState
            from vllm_ddtree.verify.verifier import DDTreeVerifier
        except ImportError:
            return
        self.wrap_host(DDTreeRuntimeState, "store_trees_", HOST_STORE)
        self.wrap_host(BudgetPolicy, "choose", HOST_BUDGET)
        self.wrap_host(BudgetPolicy, "observe_round", HOST_BUDGET)
        self.wrap_host(DDTreeVerifier, "__call__", HOST_VERIFIER)

    def install_graph_modes(self) -> None:
        """Note the CUDA-graph mode of the target's (``verify``) and the DFlash
        drafter's (``draft``) dispatches (vLLM 0.26 V2 runner)."""
        from vllm.v1.worker.gpu.cudagraph_utils import ModelCudaGraphManager
        from vllm.v1.worker.gpu.spec_decode.dflash.cudagraph import DFlashCudaGraphManager

        self.wrap_dispatch(ModelCudaGraphManager, VERIFY)
        self.wrap_dispatch(DFlashCudaGraphManager, DRAFT)


def mode_name(desc: Any) -> str:
    """``"FULL"`` / ``"PIECEWISE"`` / ``"NONE"`` of a ``BatchExecutionDescriptor``."""
    return getattr(desc.cg_mode, "name", str(desc.cg_mode))


def wrap_inherited_dispatch(cls: type, note: Callable[[Any, tuple, dict], None],
                            owner: Any) -> bool:
    """Give ``cls`` (a vLLM ``CudaGraphManager`` subclass that inherits ``dispatch``)
    a ``dispatch`` that calls the inherited one, looked up at call time so that a patch
    of the base class applied later (``patches/verify_shapes.py``) stays in effect, and
    passes the descriptor and the call's arguments to ``note``. False when ``owner``
    already wrapped it; TypeError when ``cls`` defines ``dispatch`` itself."""
    if "dispatch" in cls.__dict__:
        if getattr(cls.__dict__["dispatch"], "_e2e_timer", None) is owner:
            return False
        raise TypeError(f"{cls.__qualname__} defines dispatch itself; wrap its base")
    parent = cls.__mro__[1]

    def dispatch(manager, *args, **kwargs):
        desc = parent.dispatch(manager, *args, **kwargs)
        note(desc, args, kwargs)
        return desc

    dispatch.__qualname__ = f"{cls.__qualname__}.dispatch"
    dispatch._e2e_timer = owner
    cls.dispatch = dispatch
    return True


# ---------------------------------------------------------------------------------------
# Arithmetic (pure Python; tested on CPU)


# torch.cuda.memory_stats() counters of the caching allocator's calls into CUDA
ALLOCATOR_COUNTERS = ("num_device_alloc", "num_device_free", "num_alloc_retries")


def allocator_counts() -> dict[str, int]:
    """The caching allocator's cumulative device mallocs / frees / retries on the
    current CUDA device (``torch.cuda.memory_stats``); empty without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return {}
    stats = torch.cuda.memory_stats()
    return {k: int(stats.get(k, 0)) for k in ALLOCATOR_COUNTERS}


def allocator_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int] | None:
    """``after - before`` per counter; None when either is empty (no CUDA)."""
    if not before or not after:
        return None
    return {k: after[k] - before.get(k, 0) for k in after}


def summarize_steps(steps: list[dict]) -> dict | None:
    """Decode-step figures from ``StepTimer.end`` output, in ms.

    ``decode_ms`` spans from the first decode step's start to the last one's end (GPU
    timeline, so gaps between steps count); ``step_ms = decode_ms / steps``. Per step
    (means): ``draft`` (propose), ``verify`` (execute_model: input preparation + target
    forward), ``sample`` (sample_tokens minus draft: sampler / rejection / tree walk and
    bookkeeping), ``compact`` (DDTree's KV compaction, inside draft) and
    ``other = step - draft - verify`` (sample + host gaps), so
    ``draft + verify + other == step`` exactly. ``host_draft_ms`` / ``host_verify_ms``:
    host time inside propose / execute_model (means; 0 where not recorded).
    """
    decode = [s for s in steps if s["decode"]]
    if not decode:
        return None
    n = len(decode)
    decode_ms = decode[-1]["end"] - decode[0]["start"]
    durations = [b["start"] - a["start"] for a, b in zip(decode, decode[1:], strict=False)]
    durations.append(decode[-1]["end"] - decode[-1]["start"])
    draft = sum(s[DRAFT] for s in decode) / n
    verify = sum(s[VERIFY] for s in decode) / n
    sample = sum(s[SAMPLE_TOKENS] - s[DRAFT] for s in decode) / n
    compact = sum(s[COMPACT] for s in decode) / n
    host = {label: sum(s.get(f"host_{label}", 0.0) for s in decode) / n
            for label in HOST_REGIONS}
    return split_step(decode_ms, n, draft, verify) | {
        "sample_ms": sample,
        "compact_ms": compact,
        "host_draft_ms": host[DRAFT],
        "host_verify_ms": host[VERIFY],
        "host_regions_ms": host,
        "full_graph_steps": full_graph_steps(decode),
        "step_ms_median": statistics.median(durations),
        "step_ms_max": max(durations),
        "prefill_steps": len(steps) - n,
        "prefill_tokens": sum(s["tokens"] for s in steps if not s["decode"]),
    }


def split_by_prefill(steps: list[dict]) -> dict:
    """Means over the steps that run only decodes and over those that also prefill (a
    refill's prompt, ``decode`` False), in ms: ``n``, ``verify`` (``execute_model``'s
    GPU span: input preparation and the target forward), ``host_verify`` (the host's
    time inside it: near the span, the GPU waited for the host), ``draft`` (propose's
    span), ``sample`` (``sample_tokens`` beside propose), ``host_sample`` (the host's
    time in ``sample_tokens``, propose included) and ``gc`` (the garbage collector's
    pauses charged to the step), and ``eager_share``: the share of the steps whose
    target forward dispatched no CUDA graph (vLLM's mode ``NONE``; among the steps whose
    modes were noted, where any was). Keys ``decode_*`` and ``prefill_*``; a kind
    without steps is left out."""
    out: dict = {}
    for kind, chosen in (("decode", [s for s in steps if s["decode"]]),
                         ("prefill", [s for s in steps if not s["decode"]])):
        if not chosen:
            continue
        n = len(chosen)
        out[f"{kind}_n"] = n
        out[f"{kind}_verify_ms"] = sum(s[VERIFY] for s in chosen) / n
        out[f"{kind}_host_verify_ms"] = sum(s.get(f"host_{VERIFY}", 0.0) for s in chosen) / n
        out[f"{kind}_draft_ms"] = sum(s[DRAFT] for s in chosen) / n
        out[f"{kind}_sample_ms"] = sum(s[SAMPLE_TOKENS] - s[DRAFT] for s in chosen) / n
        for label, key in ((SAMPLE_TOKENS, "host_sample"), (HOST_GC, "gc")):
            out[f"{kind}_{key}_ms"] = sum(s.get(f"host_{label}", 0.0) for s in chosen) / n
        modes = [s["graphs"][VERIFY] for s in chosen if s.get("graphs", {}).get(VERIFY)]
        if modes:
            out[f"{kind}_eager_share"] = sum("NONE" in m for m in modes) / len(modes)
    return out


def full_graph_steps(decode_steps: list[dict]) -> dict[str, list[int]]:
    """Per dispatch label (``verify`` / ``draft``): ``[full, dispatched]``, the decode
    steps whose dispatches all chose a FULL graph and those that dispatched at all
    (labels never seen are left out)."""
    out = {}
    for label in (VERIFY, DRAFT):
        modes = [s["graphs"][label] for s in decode_steps if s.get("graphs", {}).get(label)]
        if modes:
            full = sum(all(m == "FULL" for m in step) for step in modes)
            out[label] = [full, len(modes)]
    return out


def split_step(decode_ms: float, steps: int, draft_ms: float, verify_ms: float) -> dict:
    """``step_ms = decode_ms / steps`` split into draft, verify and the rest."""
    if steps <= 0:
        raise ValueError("no decode steps")
    step = decode_ms / steps
    return {"decode_ms": decode_ms, "steps": steps, "step_ms": step, "draft_ms": draft_ms,
            "verify_ms": verify_ms, "other_ms": step - draft_ms - verify_ms}


def _python_workload(n: int) -> int:
    """Interpreter-bound work (dict stores, int arithmetic, calls), like a runner's
    per-step bookkeeping; no allocation that grows with ``n``."""
    table: dict[int, int] = {}
    total = 0
    for i in range(n):
        table[i & 255] = i
        total += len(table) + i % 7
    return total


def python_speed_ms(repeats: int = 5, n: int = 20000) -> float:
    """Median milliseconds of one fixed pure-Python workload in this process.

    Host-bound decode steps of two processes compare only when their interpreters run
    at the same speed; on a shared host this figure can differ by up to 1.8x between
    processes of one benchmark run (same code, same configuration), so
    ``bench_e2e`` records it beside every cell."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        _python_workload(n)
        times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times)


def host_cpu_state() -> dict | None:
    """Machine-wide CPU times (``psutil.cpu_times()``, seconds) and the mean clock
    (MHz, None where the VM hides it), for :func:`host_cpu_delta`; None without psutil."""
    try:
        import psutil
    except ImportError:
        return None
    freq = psutil.cpu_freq()
    return {"times": psutil.cpu_times()._asdict(), "mhz": freq.current if freq else None}


def host_cpu_delta(before: dict | None, after: dict | None) -> dict:
    """Over a cell: ``steal_pct`` (share of all CPU time the hypervisor gave to other
    guests, Linux's ``steal``), ``busy_pct`` (share not idle / iowait / steal: load from
    every process of the machine) and ``mhz`` (the clock at the end). Empty when
    either snapshot is missing. A host-bound step that slows with a high steal share
    or a lower clock is the machine's state, not the code."""
    if not before or not after:
        return {}
    delta = {k: after["times"][k] - before["times"].get(k, 0.0) for k in after["times"]}
    total = sum(delta.values())
    if total <= 0:
        return {}
    idle = delta.get("idle", 0.0) + delta.get("iowait", 0.0)
    steal = delta.get("steal", 0.0)
    return {"steal_pct": 100 * steal / total, "busy_pct": 100 * (total - idle - steal) / total,
            "mhz": after.get("mhz")}


def current_cpu_and_node() -> tuple[int | None, int | None]:
    """The CPU this thread runs on now and its NUMA node (Linux sysfs), None where
    unknown: beside ``python_speed_ms``, it tells a slow core or a remote-memory
    placement from a slow process."""
    try:
        import psutil

        cpu = psutil.Process().cpu_num()
    except (ImportError, AttributeError, OSError):
        return None, None
    try:
        nodes = [n for n in os.listdir(f"/sys/devices/system/cpu/cpu{cpu}")
                 if n.startswith("node") and n[4:].isdigit()]
    except OSError:
        return cpu, None
    return cpu, int(nodes[0][4:]) if nodes else None
