"""Host synchronisations per decode step of DDTree under vLLM, with DFlash and AR
baselines (GPU; torch.profiler trace of a window of decode steps).

    python evals/count_host_syncs.py [--methods ddtree dflash ar] [--budget 32]
        [--top-k K] [--auto] [--steps 20] [--warmup-steps 8] [--prompts 4] [--graphs]
        [--with-stack/--no-with-stack] [--out evals/results/host_syncs.md]
        [--setup trained|kimi8|kimi64 [--context 16384] [--gpu-mem 0.6]]

``--setup kimi8`` / ``kimi64``: the Kimi-K2-shaped target and drafter of
``evals/bench_e2e.py`` with dummy weights and random prompts of ``--context`` tokens
(where does a long-context round's time go); default: the embedded trained pair.

Each method runs in its own child process (a fresh ``LLM``; vLLM does not free a GPU
engine reliably inside one process) with the engine in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, uni-process executor): the model runner, the
DDTree speculator and verifier run in the process that profiles. The child adds the
prompts to ``llm.llm_engine``, runs ``--warmup-steps`` engine steps (prefill, first
rounds, Triton JIT), then profiles ``--steps`` engine steps with ``torch.profiler``
(CPU + CUDA activities), each inside a ``count_host_syncs::step`` range. (vLLM's own
``LLM.start_profile`` with a ``profiler_config`` profiles the same process here, but
cannot mark step boundaries or DDTree's functions.)

Counted from the Chrome trace, per step:

* host syncs: CUDA runtime / driver calls that block the host on the device
  (``cudaStreamSynchronize``, ``cudaDeviceSynchronize``, ``cudaEventSynchronize``,
  their ``cu*`` driver forms, the synchronous ``cudaMemcpy*`` calls, and the implicitly
  synchronizing ``cudaFree`` / pinned-host allocations). ``.item()``
  and blocking copies show up as a ``cudaMemcpyAsync`` + ``cudaStreamSynchronize``;
* device-to-host copies: GPU ``Memcpy DtoH`` activities (``Device -> Pageable``
  ones block the host; ``Device -> Pinned`` ones are vLLM's asynchronous output
  copies);
* kernel launches: ``cudaLaunchKernel`` / ``cudaLaunchKernelExC`` / ``cuLaunchKernel``
  / ``cuLaunchKernelEx`` and CUDA-graph replays (``cudaGraphLaunch``,
  ``cuGraphLaunch``), by API: many individual launches where one graph launch was
  expected mean a region runs eagerly;
* GPU time: the summed duration of GPU activities (kernels, memcpys, memsets), each
  charged to the runtime call that launched it (``args.correlation``; the kernels of
  a graph replay to its ``cudaGraphLaunch``), and the kernels that take the most.

Each event is attributed to the innermost range of this script's annotations
(``ddtree::propose``, ``ddtree::verify``, ``ddtree::verify_inputs``, ...,
``vllm::execute_model``, ``vllm::sample_tokens``, ``vllm::dflash_propose``,
``vllm::rejection_sampler``) and, with ``--with-stack``, to the innermost Python
frame outside torch. vLLM copies the sampled tokens to the host once per step and
waits for them: the DFlash and AR rows are that baseline. A DDTree round without
host syncs of its own shows the same per-step syncs as DFlash and none attributed
to ``ddtree::*`` ranges.

The CPU-side complement is ``tests/test_no_host_sync.py`` (a dispatch-mode detector
over the round's functions). The trace parsing here is pure Python and is tested on
CPU there.
"""

from __future__ import annotations

import argparse
import bisect
import functools
import gzip
import json
import os
import shlex
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

STEP_NAME = "count_host_syncs::step"
OUR_PREFIXES = ("ddtree::", "vllm::")

SYNC_APIS = frozenset({
    "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
    "cuStreamSynchronize", "cuCtxSynchronize", "cuEventSynchronize",
    # Implicitly synchronizing (CUDA runtime API docs): freeing device memory (the
    # caching allocator releasing blocks) and page-locked host allocations
    # (``Tensor.pin_memory()``, ``torch.empty(pin_memory=True)``).
    "cudaFree", "cudaFreeHost", "cudaHostAlloc", "cudaMallocHost",
    "cuMemFree_v2", "cuMemFreeHost", "cuMemHostAlloc", "cuMemAllocHost_v2",
})
# Synchronous copy APIs (the `Async` forms are not host syncs by themselves).
BLOCKING_MEMCPY_APIS = frozenset({
    "cudaMemcpy", "cudaMemcpy2D", "cudaMemcpy3D", "cudaMemcpyToSymbol",
    "cudaMemcpyFromSymbol", "cuMemcpy", "cuMemcpyDtoH_v2", "cuMemcpyHtoD_v2",
    "cuMemcpyDtoD_v2",
})
RUNTIME_CATEGORIES = frozenset({"cuda_runtime", "cuda_driver"})
MEMCPY_CATEGORY = "gpu_memcpy"
GPU_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
# Kernel launches and graph replays (memcpy / memset calls are not launches).
LAUNCH_APIS = frozenset({
    "cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
    "cudaGraphLaunch", "cuGraphLaunch",
})
TOP_KERNELS = 10
TOP_REGION_KERNELS = 6  # per region: what a region's GPU time is made of

# Functions wrapped in a record_function range: (module, class or None, attribute, label).
ANNOTATED = [
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner", "execute_model",
     "vllm::execute_model"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner", "sample_tokens",
     "vllm::sample_tokens"),
    ("vllm.v1.worker.gpu.spec_decode.dflash.speculator", "DFlashSpeculator", "propose",
     "vllm::dflash_propose"),
    ("vllm.v1.worker.gpu.spec_decode.rejection_sampler", "RejectionSampler", "__call__",
     "vllm::rejection_sampler"),
    ("vllm_ddtree.draft.speculator", "DDTreeSpeculator", "propose", "ddtree::propose"),
    ("vllm_ddtree.draft.speculator", "DDTreeSpeculator", "_compact_target_kv",
     "ddtree::compact_kv"),
    ("vllm_ddtree.draft.speculator", "DDTreeSpeculator", "_generate_draft",
     "ddtree::generate_draft"),
    ("vllm_ddtree.verify.verifier", "DDTreeVerifier", "__call__", "ddtree::verify"),
    ("vllm_ddtree.verify.verifier", "DDTreeVerifier", "draw_target_tokens", "ddtree::draw"),
    ("vllm_ddtree.verify.verifier", "DDTreeVerifier", "walk", "ddtree::walk"),
    ("vllm_ddtree.runtime_state", None, "verify_inputs_", "ddtree::verify_inputs"),
    ("vllm_ddtree.runtime_state", "DDTreeRuntimeState", "store_trees_",
     "ddtree::store_trees"),
    # ddtree_budget: "auto" only: what it adds to a round on the host.
    ("vllm_ddtree.budget.policy", "BudgetPolicy", "observe_round", "ddtree::observe_round"),
    ("vllm_ddtree.budget.policy", "BudgetPolicy", "choose", "ddtree::budget_choice"),
    ("vllm_ddtree.verify.shape", "VerifyShapeChooser", "record_", "ddtree::shape_record"),
    ("vllm_ddtree.verify.shape", "VerifyShapeChooser", "next_shape", "ddtree::next_shape"),
]
# --methods: "ddtree-auto" is DDTree with ddtree_budget "auto" (--budget the maximum),
# beside fixed-budget "ddtree" in one run; --auto turns every "ddtree" into it.
METHODS = ("ddtree", "ddtree-auto", "dflash", "ar")

_PROJECT_MARKERS = ("vllm_ddtree/", "attention_backends/", "patches/")


# ----------------------------------------------------------------------------------
# Trace parsing (pure Python, tested on CPU)
# ----------------------------------------------------------------------------------


def load_trace_events(path: str | Path) -> list[dict]:
    """The ``traceEvents`` of a Chrome trace written by ``export_chrome_trace``
    (``.json`` or ``.json.gz``)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def short_site(name: str) -> str:
    """``/abs/.../vllm_ddtree/verify/batch.py(139): f`` -> ``vllm_ddtree/verify/batch.py:139 f``
    (paths cut at the project's packages or at ``site-packages/``)."""
    head, sep, func = name.partition("): ")
    path, _, line = head.rpartition("(")
    if not sep or not path:
        return name
    for marker in _PROJECT_MARKERS + ("evals/", "tests/"):
        index = path.find(marker)
        if index >= 0 and (index == 0 or path[index - 1] == "/"):
            path = path[index:]
            break
    else:
        if "site-packages/" in path:
            path = path.split("site-packages/", 1)[1]
    return f"{path}:{line} {func}"


_SKIPPED_FILES = frozenset({"contextlib.py", "functools.py", "typing.py",
                            "count_host_syncs.py"})


def _is_torch_or_builtin_frame(name: str) -> bool:
    """Frames that never explain a sync: C functions, torch, wrappers."""
    if name.startswith("<built-in"):
        return True
    path = name.partition("(")[0]
    return (path.startswith("torch/") or "site-packages/torch/" in path
            or path.rsplit("/", 1)[-1] in _SKIPPED_FILES)


def _ends(event: dict) -> float:
    return float(event["ts"]) + float(event.get("dur", 0.0))


def _contains(outer: dict, inner: dict) -> bool:
    """Whether ``outer``'s time range holds ``inner``'s (a strictly larger one when they
    start together: of two ops of equal start and end neither counts as the parent)."""
    start_o, start_i = float(outer["ts"]), float(inner["ts"])
    end_o, end_i = _ends(outer), _ends(inner)
    return start_o <= start_i and end_i <= end_o and (start_o, end_o) != (start_i, end_i)


def is_launch_api(name: str) -> bool:
    """``LAUNCH_APIS``, also in per-thread-stream (``_ptsz``) or versioned (``_v11060``)
    spellings."""
    base = name
    for suffix in ("_ptsz", "_ptds"):
        base = base.removesuffix(suffix)
    head, sep, version = base.rpartition("_v")
    if sep and version.isdigit():
        base = head
    return base in LAUNCH_APIS


def _our_region(stack: list[dict]) -> str:
    """Innermost ``ddtree::`` / ``vllm::`` annotation of a stack, ``-`` without one."""
    ours = [s["name"] for s in stack if s.get("cat") == "user_annotation"
            and s["name"].startswith(OUR_PREFIXES)]
    return ours[-1] if ours else "-"


class _ThreadIndex:
    """Nested ranges of one thread (user annotations, Python frames, CPU ops), for
    "which ranges contain time ts" queries. Ranges of one thread nest like a call
    stack, so the ranges containing ts are ancestors of the last range started by ts."""

    def __init__(self, ranges: list[dict]) -> None:
        self.ranges = sorted(ranges, key=lambda e: (float(e["ts"]), -_ends(e)))
        self.starts = [float(e["ts"]) for e in self.ranges]
        self.parent: list[int | None] = []
        stack: list[int] = []
        for i, e in enumerate(self.ranges):
            while stack and _ends(self.ranges[stack[-1]]) < float(e["ts"]):
                stack.pop()
            self.parent.append(stack[-1] if stack else None)
            stack.append(i)

    def enclosing(self, ts: float) -> list[dict]:
        """Ranges containing ``ts``, outermost first."""
        chain = []
        i = bisect.bisect_right(self.starts, ts) - 1
        while i is not None and i >= 0:
            if _ends(self.ranges[i]) >= ts:
                chain.append(self.ranges[i])
            i = self.parent[i]
        return chain[::-1]


def count_trace(events: list[dict], step_name: str = STEP_NAME,
                region_top: int = TOP_REGION_KERNELS) -> dict:
    """Host syncs, device-to-host copies, kernel launches and GPU time per step of a
    Chrome trace.

    Args:
        events: Chrome trace events (dicts with ``ph``, ``cat``, ``name``, ``pid``,
            ``tid``, ``ts``, ``dur``, ``args``); only complete events (``ph == "X"``)
            are read.
        step_name: name of the ``user_annotation`` range around each step.

    Returns:
        A JSON-able dict: ``steps`` (number of step ranges), ``syncs`` and ``dtoh``
        (totals inside steps), ``dtoh_pageable``, ``per_step_syncs`` /
        ``per_step_dtoh`` (lists), ``ddtree_syncs`` / ``ddtree_dtoh`` (inside a
        ``ddtree::`` range), ``outside_steps`` (``{"syncs", "dtoh"}`` outside every
        step) and ``sites``: rows ``{kind, owner, region, op, site, count}``, most
        frequent first (``kind``: ``sync`` or ``dtoh``; ``owner``: ``ddtree`` or
        ``vllm`` from the innermost ``ddtree::`` / ``vllm::`` range; ``region``:
        that range; ``op``: innermost CPU op; ``site``: innermost Python frame
        outside torch, ``-`` without a Python stack).

        GPU time and launches inside steps (totals over the steps, not per step):
        ``launches``: rows ``{region, api, count}`` (``api``: the runtime / driver
        launch call, see ``LAUNCH_APIS``; ``region`` as for ``sites``, on the
        calling thread), most frequent first; ``gpu_time``: rows ``{region,
        kernel_us, kernels}`` (GPU activities of categories ``GPU_CATEGORIES``,
        i.e. kernels, memcpys and memsets, charged to the region and step of the
        runtime call with the same ``args.correlation``; ``kernel_us``: summed
        ``dur`` in microseconds; ``kernels``: number of activities), most time
        first; ``top_kernels``: the ``TOP_KERNELS`` activity names with the most
        time, rows ``{name, us, count}`` (``name`` cut to 80 characters);
        ``region_top_kernels``: per region (regions by GPU time), its
        ``region_top`` (default ``TOP_REGION_KERNELS``) costliest activity names, rows
        ``{region, name, us, count}``: e.g. what one method's draft runs that another's does not;
        ``step_gpu_us``: float, summed duration of all those activities.

        Host time inside steps: ``host_time``: rows ``{region, host_us, ranges}``, the
        summed wall duration of the ``ddtree::`` / ``vllm::`` ranges themselves
        (inclusive of ranges nested in them; under the profiler, so inflated alike for
        every method), most time first; ``step_wall_us``: summed step durations. A
        region whose host time exceeds its GPU time by much is where the GPU can idle.
        ``host_ops``: rows ``{region, ops}``, the CPU ops (``cpu_op`` events: eager
        torch dispatches) not nested in another CPU op, by innermost region, most
        first: each costs host time whether or not it launches a kernel.
    """
    complete = [e for e in events if e.get("ph") == "X" and "ts" in e]
    ranges: dict[tuple, list[dict]] = {}
    runtime_by_corr: dict = {}
    for e in complete:
        cat = e.get("cat", "")
        if cat in ("user_annotation", "python_function", "cpu_op"):
            ranges.setdefault((e.get("pid"), e.get("tid")), []).append(e)
        if cat in RUNTIME_CATEGORIES:
            corr = (e.get("args") or {}).get("correlation")
            if corr is not None:
                runtime_by_corr[corr] = e
    steps = sorted((e for e in complete
                    if e.get("cat") == "user_annotation" and e.get("name") == step_name),
                   key=lambda e: float(e["ts"]))
    step_starts = [float(e["ts"]) for e in steps]
    threads = {key: _ThreadIndex(r) for key, r in ranges.items()}

    def step_of(ts: float) -> int | None:
        # Steps run one after another on the engine thread: match by time only, so
        # that events of other threads (vLLM's output thread) land in their step too.
        step = bisect.bisect_right(step_starts, ts) - 1
        return None if step < 0 or ts > _ends(steps[step]) else step

    def stack_of(anchor: dict, ts: float) -> list[dict]:
        thread = threads.get((anchor.get("pid"), anchor.get("tid")))
        return thread.enclosing(ts) if thread else []

    counted: list[tuple[str, dict, bool]] = []  # (kind, CPU-side anchor, pageable)
    for e in complete:
        cat, name = e.get("cat", ""), e.get("name", "")
        if cat in RUNTIME_CATEGORIES and (name in SYNC_APIS or name in BLOCKING_MEMCPY_APIS):
            counted.append(("sync", e, False))
        elif cat == MEMCPY_CATEGORY and "DtoH" in name:
            corr = (e.get("args") or {}).get("correlation")
            counted.append(("dtoh", runtime_by_corr.get(corr, e), "Pageable" in name))

    per_step = {"sync": [0] * len(steps), "dtoh": [0] * len(steps)}
    outside = {"sync": 0, "dtoh": 0}
    ddtree = {"sync": 0, "dtoh": 0}
    pageable = 0
    sites: Counter = Counter()
    for kind, anchor, is_pageable in counted:
        ts = float(anchor["ts"])
        step = step_of(ts)
        if step is None:
            outside[kind] += 1
            continue
        per_step[kind][step] += 1
        pageable += is_pageable
        stack = stack_of(anchor, ts)
        region = _our_region(stack)
        owner = "ddtree" if region.startswith("ddtree::") else "vllm"
        ddtree[kind] += owner == "ddtree"
        ops = [s["name"] for s in stack if s.get("cat") == "cpu_op"]
        frames = [s["name"] for s in stack if s.get("cat") == "python_function"
                  and not _is_torch_or_builtin_frame(s["name"])]
        site = short_site(frames[-1]) if frames else "-"
        sites[(kind, owner, region, ops[-1] if ops else anchor.get("name", "-"), site)] += 1

    launches: Counter = Counter()  # (region, api) -> launches
    region_us: Counter = Counter()
    region_count: Counter = Counter()
    kernel_us: Counter = Counter()
    kernel_count: Counter = Counter()
    region_kernel_us: Counter = Counter()
    region_kernel_count: Counter = Counter()
    for e in complete:
        cat, name = e.get("cat", ""), e.get("name", "")
        if cat in RUNTIME_CATEGORIES and is_launch_api(name):
            anchor = e
        elif cat in GPU_CATEGORIES:
            # GPU timestamps say when the work ran, not which step queued it.
            anchor = runtime_by_corr.get((e.get("args") or {}).get("correlation"), e)
        else:
            continue
        ts = float(anchor["ts"])
        if step_of(ts) is None:
            continue
        region = _our_region(stack_of(anchor, ts))
        if cat in RUNTIME_CATEGORIES:
            launches[(region, name)] += 1
            continue
        dur = float(e.get("dur", 0.0))
        region_us[region] += dur
        region_count[region] += 1
        kernel_us[name[:80]] += dur
        kernel_count[name[:80]] += 1
        region_kernel_us[(region, name[:80])] += dur
        region_kernel_count[(region, name[:80])] += 1

    host_us: Counter = Counter()
    host_ranges: Counter = Counter()
    host_ops: Counter = Counter()  # region -> top-level CPU ops (eager dispatches)
    for e in complete:
        cat = e.get("cat")
        if step_of(float(e["ts"])) is None:
            continue
        if cat == "user_annotation" and e.get("name", "").startswith(OUR_PREFIXES):
            host_us[e["name"]] += float(e.get("dur", 0.0))
            host_ranges[e["name"]] += 1
        elif cat == "cpu_op":
            stack = stack_of(e, float(e["ts"]))
            if not any(s is not e and s.get("cat") == "cpu_op" and _contains(s, e)
                       for s in stack):
                host_ops[_our_region(stack)] += 1

    return {
        "steps": len(steps),
        "syncs": sum(per_step["sync"]),
        "dtoh": sum(per_step["dtoh"]),
        "dtoh_pageable": pageable,
        "per_step_syncs": per_step["sync"],
        "per_step_dtoh": per_step["dtoh"],
        "ddtree_syncs": ddtree["sync"],
        "ddtree_dtoh": ddtree["dtoh"],
        "outside_steps": {"syncs": outside["sync"], "dtoh": outside["dtoh"]},
        "sites": [dict(kind=k, owner=o, region=r, op=op, site=s, count=n)
                  for (k, o, r, op, s), n in sites.most_common()],
        "launches": [dict(region=r, api=a, count=n) for (r, a), n in
                     sorted(launches.items(), key=lambda kv: (-kv[1], kv[0]))],
        "gpu_time": [dict(region=r, kernel_us=round(region_us[r], 3), kernels=region_count[r])
                     for r in sorted(region_us, key=lambda r: (-region_us[r], r))],
        "top_kernels": [dict(name=k, us=round(kernel_us[k], 3), count=kernel_count[k])
                        for k in sorted(kernel_us, key=lambda k: (-kernel_us[k], k))
                        [:TOP_KERNELS]],
        "region_top_kernels": [
            dict(region=r, name=k, us=round(region_kernel_us[(r, k)], 3),
                 count=region_kernel_count[(r, k)])
            for r in sorted(region_us, key=lambda r: (-region_us[r], r))
            for k in sorted((k for rr, k in region_kernel_us if rr == r),
                            key=lambda k, r=r: (-region_kernel_us[(r, k)], k))
            [:region_top]],
        "step_gpu_us": round(sum(region_us.values()), 3),
        "host_time": [dict(region=r, host_us=round(host_us[r], 3), ranges=host_ranges[r])
                      for r in sorted(host_us, key=lambda r: (-host_us[r], r))],
        "host_ops": [dict(region=r, ops=host_ops[r])
                     for r in sorted(host_ops, key=lambda r: (-host_ops[r], r))],
        "step_wall_us": round(sum(float(e.get("dur", 0.0)) for e in steps), 3),
    }


def _per_step(total: int, steps: int) -> str:
    return f"{total / steps:.2f}" if steps else "n/a"


def _ms_per_step(us: float | None, steps: int) -> str:
    return f"{us / steps / 1000:.3f}" if steps and us is not None else "n/a"


def _compact(x: float) -> str:
    """``120.0`` -> ``120``, ``0.5`` -> ``0.5``, ``1.3333`` -> ``1.33``."""
    return f"{x:.2f}".rstrip("0").rstrip(".")


def _region_rows(r: dict) -> list[str]:
    """Markdown rows of the per-region GPU time, host time and launches table of one
    result (host time ``-`` for regions without a range of their own, e.g. ``-``)."""
    steps = r["steps"]
    gpu = {g["region"]: g for g in r.get("gpu_time", [])}
    host = {h["region"]: h["host_us"] for h in r.get("host_time", [])}
    ops = {h["region"]: h["ops"] for h in r.get("host_ops", [])}
    apis: dict[str, list[str]] = {}
    for row in r.get("launches", []):
        apis.setdefault(row["region"], []).append(
            f"{row['api']} {_compact(row['count'] / steps)}")
    regions = list(gpu) + [region for region in apis if region not in gpu]
    regions += [region for region in host if region not in regions]
    regions += [region for region in ops if region not in regions]
    return [f"| {region} | {_ms_per_step(gpu.get(region, {}).get('kernel_us', 0.0), steps)} "
            f"| {_ms_per_step(host[region], steps) if region in host else '-'} "
            f"| {_per_step(ops[region], steps) if region in ops else '-'} "
            f"| {_per_step(gpu.get(region, {}).get('kernels', 0), steps)} "
            f"| {', '.join(apis.get(region, [])) or '-'} |" for region in regions]


def format_markdown(results: list[dict], command: str, top: int = 3) -> str:
    """Markdown report: a summary table (one row per method) and the attributed sites.

    Args:
        results: ``count_trace`` dicts with ``method`` (and optionally ``label``,
            ``note``) added.
        command: the command line that produced them.
        top: call sites listed per method in the summary table.
    """
    lines = [
        "# Host synchronisations per decode step",
        "",
        f"Command: `{command}`",
        "",
        "| method | steps | host syncs / step | DtoH copies / step (pageable) "
        "| DDTree syncs / step | DDTree DtoH / step | GPU ms / step | top call sites |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        steps = r["steps"]
        top_sites = "; ".join(
            f"{s['kind']} `{s['site'] if s['site'] != '-' else s['op']}` "
            f"({s['region']}) x{s['count']}" for s in r["sites"][:top]) or "-"
        lines.append(
            f"| {r.get('label', r['method'])} | {steps} | {_per_step(r['syncs'], steps)} "
            f"| {_per_step(r['dtoh'], steps)} ({r['dtoh_pageable']}) "
            f"| {_per_step(r['ddtree_syncs'], steps)} | {_per_step(r['ddtree_dtoh'], steps)} "
            f"| {_ms_per_step(r.get('step_gpu_us'), steps)} | {top_sites} |")
    lines += ["", "Host syncs: `cudaStreamSynchronize` / `cudaDeviceSynchronize` / "
              "`cudaEventSynchronize` (and `cu*` forms, synchronous `cudaMemcpy*`, the "
              "implicitly synchronizing `cudaFree` and pinned-host allocations) inside "
              "the profiled steps. DtoH copies: GPU `Memcpy DtoH` activities (pageable "
              "ones block the host). DDTree columns: events inside a `ddtree::` range. GPU ms: "
              "summed duration of the kernels, memcpys and memsets launched inside the "
              "steps.", ""]
    baseline = next((r for r in results if r["method"] == "dflash" and r["steps"]), None)
    for r in results:
        if not r["method"].startswith("ddtree") or not r["steps"]:
            continue
        text = (f"- {r.get('label', r['method'])}: {r['ddtree_syncs']} host syncs and "
                f"{r['ddtree_dtoh']} DtoH copies inside `ddtree::` ranges over "
                f"{r['steps']} steps; {_per_step(r['syncs'], r['steps'])} syncs/step in all")
        if baseline is not None:
            text += (f" vs {_per_step(baseline['syncs'], baseline['steps'])} for "
                     f"{baseline.get('label', 'dflash')}")
        lines.append(text + ".")
    lines += ["", "Per-step counts and every attributed site:", ""]
    for r in results:
        lines.append(f"## {r.get('label', r['method'])}")
        lines.append("")
        lines.append(f"- syncs per step: {r['per_step_syncs']}")
        lines.append(f"- DtoH copies per step: {r['per_step_dtoh']}")
        lines.append(f"- outside the profiled steps: {r['outside_steps']}")
        if r.get("note"):
            lines.append(f"- note: {r['note']}")
        lines.append("")
        lines.append("| kind | owner | region | op | site | count | per step |")
        lines.append("|---|---|---|---|---|---|---|")
        for s in r["sites"]:
            lines.append(f"| {s['kind']} | {s['owner']} | {s['region']} | `{s['op']}` "
                         f"| `{s['site']}` | {s['count']} | {_per_step(s['count'], r['steps'])} |")
        lines.append("")
        region_rows = _region_rows(r) if r["steps"] else []
        if region_rows:
            lines += ["### GPU time, host time and launches per step by region", "",
                      "| region | GPU ms / step | host ms / step | host ops / step "
                      "| kernels / step | launches / step |",
                      "|---|---|---|---|---|---|", *region_rows, "",
                      "Host ops: eager torch dispatches (top-level `cpu_op` events) whose "
                      "innermost annotated range is the region.", ""]
            if r.get("step_wall_us") is not None:
                lines += [f"Step wall time (host, under the profiler): "
                          f"{_ms_per_step(r['step_wall_us'], r['steps'])} ms / step; GPU "
                          f"activities: {_ms_per_step(r.get('step_gpu_us'), r['steps'])} "
                          "ms / step.", ""]
        if r["steps"] and r.get("top_kernels", []):
            lines += ["### Top kernels", "", "| name | ms / step | count / step |",
                      "|---|---|---|"]
            lines += [f"| `{k['name']}` | {_ms_per_step(k['us'], r['steps'])} "
                      f"| {_per_step(k['count'], r['steps'])} |" for k in r["top_kernels"]]
            lines.append("")
        if r["steps"] and r.get("region_top_kernels", []):
            lines += ["### Top kernels per region", "",
                      "| region | name | ms / step | count / step |", "|---|---|---|---|"]
            lines += [f"| {k['region']} | `{k['name']}` | {_ms_per_step(k['us'], r['steps'])} "
                      f"| {_per_step(k['count'], r['steps'])} |"
                      for k in r["region_top_kernels"]]
            lines.append("")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------
# GPU run (child process per method)
# ----------------------------------------------------------------------------------


def install_annotations() -> list[str]:
    """Wrap ``ANNOTATED`` functions in ``torch.profiler.record_function`` ranges;
    returns the labels installed (a missing module or attribute is skipped)."""
    import importlib

    import torch

    installed = []
    for module_name, class_name, attr, label in ANNOTATED:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        owner = getattr(module, class_name, None) if class_name else module
        original = getattr(owner, attr, None) if owner is not None else None
        if original is None or getattr(original, "_count_host_syncs", False):
            continue

        def wrapper(*args, _original=original, _label=label, **kwargs):
            with torch.profiler.record_function(_label):
                return _original(*args, **kwargs)

        functools.update_wrapper(wrapper, original)
        wrapper._count_host_syncs = True
        setattr(owner, attr, wrapper)
        installed.append(label)
    return installed


def speculative_config(method: str, budget: int, top_k: int | None, drafter: str,
                       auto: bool = False, drafter_block: int = 16):
    """vLLM's ``speculative_config`` for ``method`` (``METHODS``; None for AR)."""
    if method == "ddtree-auto":
        method, auto = "ddtree", True
    if method == "ar":
        return None
    if method == "dflash":
        # vLLM's chain drafts block_size - 1 tokens.
        return {"method": "dflash", "model": drafter,
                "num_speculative_tokens": drafter_block - 1}
    spec = {"method": "ddtree", "model": drafter, "num_speculative_tokens": budget}
    if top_k is not None:
        spec["ddtree_top_k"] = top_k
    if auto:
        spec["ddtree_budget"] = "auto"
    return spec


def run_child(args: argparse.Namespace) -> None:
    """Profile ``args.child`` and write ``count_trace``'s dict to ``args.child_out``."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
    import torch

    import vllm_ddtree

    vllm_ddtree.register()
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_ddtree.demo.reference_engine import CHECKPOINTS

    labels = install_annotations()
    method = args.child
    from e2e_models import SETUPS, prepare_setup, random_prompts

    setup = SETUPS[args.setup]
    tokens_per_step = {"ar": 1, "dflash": setup.block_size}.get(method, args.budget + 1)
    steps_tokens = (args.warmup_steps + args.steps + 4) * tokens_per_step
    extra = {}
    if setup.dummy:  # Kimi-shaped pair, dummy weights: random prompts of --context tokens
        models = prepare_setup(setup, Path(args.model_dir),
                               min_positions=args.context + steps_tokens + 64)
        target, drafter = models.target, str(models.drafter)
        prompts = random_prompts(args.prompts, args.context, setup.random_ids, seed=0)
        max_model_len = args.context + steps_tokens + 64
        extra.update(load_format="dummy", skip_tokenizer_init=True)
    else:
        target, drafter = CHECKPOINTS / "target", str(CHECKPOINTS / "drafter")
        tokenizer = AutoTokenizer.from_pretrained(target)
        from check_pair_vllm import PROMPTS

        prompts = [tokenizer.encode(PROMPTS[i % len(PROMPTS)]) for i in range(args.prompts)]
        max_model_len = 4096
    backend = {"ar": args.ar_backend, "dflash": args.dflash_backend}.get(method, "auto")
    if backend != "auto":
        extra["attention_backend"] = backend
    llm = LLM(model=str(target),
              speculative_config=speculative_config(method, args.budget, args.top_k, drafter,
                                                   args.auto, setup.block_size),
              enforce_eager=not args.graphs, dtype="bfloat16",
              gpu_memory_utilization=args.gpu_mem, max_model_len=max_model_len,
              max_num_seqs=max(8, args.prompts), seed=0, **extra)
    engine = llm.llm_engine
    max_tokens = min(max_model_len - max(map(len, prompts)) - 1, steps_tokens)
    for i, prompt in enumerate(prompts):
        params = SamplingParams(temperature=args.temperature, max_tokens=max_tokens,
                                ignore_eos=True, detokenize=not setup.dummy,
                                seed=1000 + i if args.temperature else None)
        engine.add_request(f"sync-{i}", TokensPrompt(prompt_token_ids=prompt), params)
    for _ in range(args.warmup_steps):
        engine.step()
    torch.cuda.synchronize()

    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities, with_stack=args.with_stack) as prof:
        for _ in range(args.steps):
            with torch.profiler.record_function(STEP_NAME):
                engine.step()
    unfinished = engine.get_num_unfinished_requests()
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(args.keep_trace) if args.keep_trace else Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        result = count_trace(load_trace_events(trace), region_top=args.region_kernels)
    result["method"] = method
    auto = args.auto or method == "ddtree-auto"
    result["label"] = {"ar": "AR", "dflash": f"DFlash (vLLM, {setup.block_size - 1} drafts)"}.get(
        method, (f"DDTree auto (B <= {args.budget})" if auto else f"DDTree B={args.budget}")
        + (f" top_k={args.top_k}" if args.top_k else ""))
    notes = [f"setup: {setup.name}" + (f", {args.context}-token prompts" if setup.dummy else ""),
             f"attention backend: {backend}", f"annotations: {len(labels)}"]
    if unfinished < len(prompts):
        notes.append(f"only {unfinished}/{len(prompts)} requests still running at the end "
                     "of the window: later steps had smaller batches")
    result["note"] = "; ".join(notes)
    Path(args.child_out).write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)  # vLLM engines can hang at interpreter exit


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", nargs="+", choices=METHODS,
                   default=["ddtree", "dflash", "ar"])
    p.add_argument("--budget", type=int, default=32, help="DDTree tree nodes B")
    p.add_argument("--top-k", type=int, default=None, help="DDTree children per node")
    p.add_argument("--auto", action="store_true",
                   help='DDTree with ddtree_budget "auto" (--budget is the maximum)')
    p.add_argument("--steps", type=int, default=20, help="profiled engine steps")
    p.add_argument("--warmup-steps", type=int, default=8,
                   help="engine steps before the window (prefill, JIT, first rounds)")
    p.add_argument("--prompts", type=int, default=4, help="concurrent requests")
    p.add_argument("--temperature", type=float, default=0.0)
    graphs = p.add_mutually_exclusive_group()
    graphs.add_argument("--graphs", dest="graphs", action="store_true",
                        help="CUDA graphs (vLLM's default mode)")
    graphs.add_argument("--enforce-eager", dest="graphs", action="store_false",
                        help="eager (default): every launch and sync is visible")
    p.set_defaults(graphs=False)
    p.add_argument("--with-stack", action=argparse.BooleanOptionalAction, default=True,
                   help="record Python stacks to attribute syncs to call sites")
    p.add_argument("--ar-backend", default="CUSTOM",
                   help="AR attention backend ('auto' = vLLM's choice; default CUSTOM, the "
                   "tree MLA backend DDTree's target uses)")
    p.add_argument("--dflash-backend", default="auto",
                   help="DFlash attention backend ('auto' = vLLM's choice)")
    p.add_argument("--setup", choices=["trained", "kimi8", "kimi64"], default="trained",
                   help="model pair (evals/e2e_models.py): the embedded pair, or a "
                   "Kimi-K2-shaped target with dummy weights")
    p.add_argument("--context", type=int, default=1024,
                   help="prompt tokens of the Kimi-shaped setups (random ids)")
    p.add_argument("--gpu-mem", type=float, default=0.3, help="gpu_memory_utilization")
    p.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(),
                                                       "ddtree_e2e_models"),
                   help="where the Kimi-shaped config files are written")
    p.add_argument("--region-kernels", type=int, default=TOP_REGION_KERNELS,
                   help="kernels listed per region (costliest first)")
    p.add_argument("--out", default="evals/results/host_syncs.md")
    p.add_argument("--keep-trace", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child", choices=METHODS, help=argparse.SUPPRESS)
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def child_command(args: argparse.Namespace, method: str, out: Path) -> list[str]:
    """Command line of the child process that profiles ``method``."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", method,
           "--child-out", str(out), "--budget", str(args.budget), "--steps", str(args.steps),
           "--warmup-steps", str(args.warmup_steps), "--prompts", str(args.prompts),
           "--temperature", str(args.temperature), "--ar-backend", args.ar_backend,
           "--dflash-backend", args.dflash_backend, "--setup", args.setup,
           "--context", str(args.context), "--gpu-mem", str(args.gpu_mem),
           "--model-dir", args.model_dir, "--region-kernels", str(args.region_kernels),
           "--graphs" if args.graphs else "--enforce-eager",
           "--with-stack" if args.with_stack else "--no-with-stack"]
    if args.top_k is not None:
        cmd += ["--top-k", str(args.top_k)]
    if args.auto:
        cmd.append("--auto")
    return cmd


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        run_child(args)
        return
    command = "python evals/count_host_syncs.py " + shlex.join(
        sys.argv[1:] if argv is None else argv)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for method in args.methods:
            out = Path(tmp) / f"{method}.json"
            proc = subprocess.run(child_command(args, method, out), timeout=1800)
            if proc.returncode != 0 or not out.exists():
                results.append({"method": method, "label": method, "steps": 0, "syncs": 0,
                                "dtoh": 0, "dtoh_pageable": 0, "ddtree_syncs": 0,
                                "ddtree_dtoh": 0, "per_step_syncs": [], "per_step_dtoh": [],
                                "outside_steps": {}, "sites": [], "launches": [],
                                "gpu_time": [], "top_kernels": [], "region_top_kernels": [],
                                "step_gpu_us": 0.0,
                                "note": f"child failed (exit code {proc.returncode})"})
                continue
            results.append(json.loads(out.read_text()))
    report = format_markdown(results, command)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(report + "\n")
    print(report)


if __name__ == "__main__":
    main()
