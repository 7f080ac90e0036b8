"""Counting a ``torch.profiler`` Chrome trace of decode steps per step and per range
(pure Python, tested on CPU): host syncs, device-to-host copies, kernel launches and
GPU time, attributed to the innermost annotated range (``ddtree::*``, ``vllm::*``) and,
with stacks, to the innermost Python frame outside torch. ``evals/count_host_syncs.py``
records the trace (GPU) and writes :func:`format_markdown`'s report.
"""

from __future__ import annotations

import bisect
import gzip
import json
from collections import Counter
from pathlib import Path

STEP_NAME = "count_host_syncs::step"
# A step that also prefills a refilled request (``count_host_syncs.py --refill-every``).
REFILL_STEP_NAME = "count_host_syncs::refill_step"
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
