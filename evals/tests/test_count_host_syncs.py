"""``evals/count_host_syncs.py`` on CPU: the trace counting (``evals/host_sync_trace.py``,
pure Python, on synthetic Chrome traces), the command line and the annotations it
installs on the GPU run."""

import argparse
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "evals"))
import count_host_syncs  # noqa: E402
import host_sync_trace  # noqa: E402


def X(cat, name, ts, dur, tid=1, pid=100, **args):  # noqa: N802 - Chrome trace "X" event
    event = {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts,
             "dur": dur}
    if args:
        event["args"] = args
    return event


def synthetic_trace() -> list[dict]:
    """Two steps: step 0 has a DDTree ``.item()`` (DtoH to pageable memory + stream
    sync) in ``ddtree::verify``; step 1 has vLLM's async output copy (DtoH to pinned)
    and its event sync in ``vllm::sample_tokens``, plus a sync on another thread. One
    device sync falls between steps; an HtoD copy is not counted."""
    step = host_sync_trace.STEP_NAME
    return [
        {"ph": "M", "name": "process_name", "pid": 100, "args": {"name": "python"}},
        X("user_annotation", step, 0, 100),
        X("user_annotation", "ddtree::propose", 5, 60),
        X("user_annotation", "ddtree::verify", 10, 30),
        X("python_function", "vllm_ddtree/verify/verifier.py(330): __call__", 11, 28),
        X("python_function", "vllm_ddtree/verify/batch.py(139): compact_kv_cache_", 12, 20),
        X("python_function", "torch/_tensor.py(40): wrapped", 13, 10),
        X("python_function", "<built-in method item of Tensor object at 0x1>", 14, 8),
        X("cpu_op", "aten::item", 14, 8),
        X("cpu_op", "aten::_local_scalar_dense", 14.5, 7),
        X("cuda_runtime", "cudaMemcpyAsync", 15, 2, correlation=7),
        X("cuda_runtime", "cudaStreamSynchronize", 17.5, 3, correlation=8),
        X("gpu_memcpy", "Memcpy DtoH (Device -> Pageable)", 5000, 1, pid=0, tid=7,
          correlation=7),
        X("cuda_runtime", "cudaMemcpyAsync", 50, 1, correlation=9),
        X("gpu_memcpy", "Memcpy HtoD (Pageable -> Device)", 5100, 1, pid=0, tid=7,
          correlation=9),
        X("user_annotation", step, 100, 100),
        X("user_annotation", "vllm::sample_tokens", 110, 50),
        X("python_function",
          "/venv/lib/python3.11/site-packages/vllm/v1/worker/gpu/async_utils.py(60): get_output",
          111, 40),
        X("cuda_runtime", "cudaMemcpyAsync", 115, 1, correlation=11),
        X("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 5200, 1, pid=0, tid=7,
          correlation=11),
        X("cuda_runtime", "cudaEventSynchronize", 120, 5, correlation=12),
        X("cuda_runtime", "cudaStreamSynchronize", 170, 1, tid=2, correlation=13),
        X("cuda_runtime", "cudaDeviceSynchronize", 300, 1, correlation=14),
        {"ph": "s", "id": 7, "pid": 100, "tid": 1, "ts": 15, "cat": "ac2g", "name": "flow"},
    ]


def test_count_trace_counts_and_attributes_per_step():
    result = host_sync_trace.count_trace(synthetic_trace())
    assert result["steps"] == 2
    assert result["per_step_syncs"] == [1, 2] and result["per_step_dtoh"] == [1, 1]
    assert (result["syncs"], result["dtoh"], result["dtoh_pageable"]) == (3, 2, 1)
    assert (result["ddtree_syncs"], result["ddtree_dtoh"]) == (1, 1)
    assert result["outside_steps"] == {"syncs": 1, "dtoh": 0}
    sites = {(s["kind"], s["owner"], s["region"], s["op"], s["site"]): s["count"]
             for s in result["sites"]}
    assert sites == {
        ("sync", "ddtree", "ddtree::verify", "aten::_local_scalar_dense",
         "vllm_ddtree/verify/batch.py:139 compact_kv_cache_"): 1,
        ("dtoh", "ddtree", "ddtree::verify", "aten::_local_scalar_dense",
         "vllm_ddtree/verify/batch.py:139 compact_kv_cache_"): 1,
        ("sync", "vllm", "vllm::sample_tokens", "cudaEventSynchronize",
         "vllm/v1/worker/gpu/async_utils.py:60 get_output"): 1,
        ("dtoh", "vllm", "vllm::sample_tokens", "cudaMemcpyAsync",
         "vllm/v1/worker/gpu/async_utils.py:60 get_output"): 1,
        ("sync", "vllm", "-", "cudaStreamSynchronize", "-"): 1,
    }
    # Only the three copies run on the GPU: no launches, 3 us of memcpys.
    assert result["launches"] == [] and result["step_gpu_us"] == 3.0
    assert result["gpu_time"] == [
        {"region": "ddtree::propose", "kernel_us": 1.0, "kernels": 1},
        {"region": "ddtree::verify", "kernel_us": 1.0, "kernels": 1},
        {"region": "vllm::sample_tokens", "kernel_us": 1.0, "kernels": 1},
    ]


def test_count_trace_reads_a_json_trace_and_writes_markdown(tmp_path):
    import gzip

    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": synthetic_trace(), "displayTimeUnit": "ms"}, f)
    result = host_sync_trace.count_trace(host_sync_trace.load_trace_events(path))
    result.update(method="ddtree", label="DDTree B=32")
    empty = host_sync_trace.count_trace([])
    empty.update(method="ar")
    # A baseline holding only the second (vLLM) step.
    baseline = host_sync_trace.count_trace([e for e in synthetic_trace()
                                             if e.get("ts", 0) >= 100])
    baseline.update(method="dflash", label="DFlash")
    text = host_sync_trace.format_markdown([result, baseline, empty],
                                            "python evals/count_host_syncs.py")
    assert "| DDTree B=32 | 2 | 1.50 | 1.00 (1) | 0.50 | 0.50 |" in text
    assert "| ar | 0 | n/a | n/a (0) | n/a | n/a | n/a | - |" in text
    assert "`vllm_ddtree/verify/batch.py:139 compact_kv_cache_`" in text
    assert "Command: `python evals/count_host_syncs.py`" in text
    assert ("- DDTree B=32: 1 host syncs and 1 DtoH copies inside `ddtree::` ranges over 2 "
            "steps; 1.50 syncs/step in all vs 2.00 for DFlash.") in text


GEMM = ("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_"
        "tn_align8>(Params)")


def synthetic_gpu_trace() -> list[dict]:
    """Two steps, each with eager launches in ``ddtree::verify`` (step 0: three
    ``cudaLaunchKernel`` and a ``cudaMemcpyAsync``; step 1: one ``cudaLaunchKernel``,
    one driver ``cuLaunchKernel``; one top-level CPU op there in each step, with a
    nested one in step 1, and one CPU op outside our ranges) and one ``cudaGraphLaunch`` in
    ``vllm::execute_model`` whose two kernels correlate to it; step 1 also launches a
    kernel outside our ranges. A launch after the steps is not counted. GPU events run
    later (ts 5000+) on the device's pid / tid."""
    step = host_sync_trace.STEP_NAME

    def gpu(name, ts, dur, corr, cat="kernel"):
        return X(cat, name, ts, dur, pid=0, tid=7, correlation=corr)

    return [
        X("user_annotation", step, 0, 100),
        X("user_annotation", "ddtree::verify", 10, 30),
        X("cpu_op", "aten::gather", 11, 3),
        X("cuda_runtime", "cudaLaunchKernel", 12, 1, correlation=21),
        X("cuda_runtime", "cudaLaunchKernel", 15, 1, correlation=22),
        X("cuda_runtime", "cudaLaunchKernel", 18, 1, correlation=23),
        X("cuda_runtime", "cudaMemcpyAsync", 20, 1, correlation=25),
        X("user_annotation", "vllm::execute_model", 50, 40),
        X("cuda_runtime", "cudaGraphLaunch", 60, 5, correlation=24),
        gpu("tree_walk_kernel", 5000, 30, 21),
        gpu("gather_kernel", 5030, 20, 22),
        gpu("tree_walk_kernel", 5050, 30, 23),
        gpu("Memcpy HtoD (Pinned -> Device)", 5080, 4, 25, cat="gpu_memcpy"),
        gpu(GEMM, 5100, 400, 24),
        gpu("flash_fwd_kernel", 5500, 100, 24),
        X("user_annotation", step, 100, 100),
        X("user_annotation", "ddtree::verify", 110, 30),
        X("cuda_runtime", "cudaLaunchKernel", 112, 1, correlation=31),
        X("cuda_driver", "cuLaunchKernel", 115, 1, correlation=32),
        X("cpu_op", "aten::index", 120, 5),
        X("cpu_op", "aten::empty", 121, 1),  # inside aten::index: not a dispatch of its own
        X("user_annotation", "vllm::execute_model", 150, 40),
        X("cpu_op", "aten::add", 192, 1),
        X("cuda_runtime", "cudaGraphLaunch", 160, 5, correlation=33),
        X("cuda_runtime", "cudaLaunchKernel", 195, 1, tid=2, correlation=34),
        gpu("tree_walk_kernel", 6000, 30, 31),
        gpu("triton_draw", 6030, 10, 32),
        gpu(GEMM, 6100, 400, 33),
        gpu("flash_fwd_kernel", 6500, 100, 33),
        gpu("elementwise_kernel", 6600, 6, 34),
        X("cuda_runtime", "cudaLaunchKernel", 300, 1, correlation=40),
        gpu("warmup_kernel", 7000, 1000, 40),
    ]


def test_count_trace_gpu_time_and_launches_per_region():
    result = host_sync_trace.count_trace(synthetic_gpu_trace())
    assert result["steps"] == 2 and result["syncs"] == 0 and result["dtoh"] == 0
    assert result["launches"] == [
        {"region": "ddtree::verify", "api": "cudaLaunchKernel", "count": 4},
        {"region": "vllm::execute_model", "api": "cudaGraphLaunch", "count": 2},
        {"region": "-", "api": "cudaLaunchKernel", "count": 1},
        {"region": "ddtree::verify", "api": "cuLaunchKernel", "count": 1},
    ]
    assert result["gpu_time"] == [
        {"region": "vllm::execute_model", "kernel_us": 1000.0, "kernels": 4},
        {"region": "ddtree::verify", "kernel_us": 124.0, "kernels": 6},
        {"region": "-", "kernel_us": 6.0, "kernels": 1},
    ]
    assert result["top_kernels"] == [
        {"name": GEMM[:80], "us": 800.0, "count": 2},
        {"name": "flash_fwd_kernel", "us": 200.0, "count": 2},
        {"name": "tree_walk_kernel", "us": 90.0, "count": 3},
        {"name": "gather_kernel", "us": 20.0, "count": 1},
        {"name": "triton_draw", "us": 10.0, "count": 1},
        {"name": "elementwise_kernel", "us": 6.0, "count": 1},
        {"name": "Memcpy HtoD (Pinned -> Device)", "us": 4.0, "count": 1},
    ]
    assert len(GEMM) > 80
    assert result["region_top_kernels"] == [
        {"region": "vllm::execute_model", "name": GEMM[:80], "us": 800.0, "count": 2},
        {"region": "vllm::execute_model", "name": "flash_fwd_kernel", "us": 200.0,
         "count": 2},
        {"region": "ddtree::verify", "name": "tree_walk_kernel", "us": 90.0, "count": 3},
        {"region": "ddtree::verify", "name": "gather_kernel", "us": 20.0, "count": 1},
        {"region": "ddtree::verify", "name": "triton_draw", "us": 10.0, "count": 1},
        {"region": "ddtree::verify", "name": "Memcpy HtoD (Pinned -> Device)", "us": 4.0,
         "count": 1},
        {"region": "-", "name": "elementwise_kernel", "us": 6.0, "count": 1},
    ]
    assert result["step_gpu_us"] == 1130.0
    assert result["host_time"] == [
        {"region": "vllm::execute_model", "host_us": 80.0, "ranges": 2},
        {"region": "ddtree::verify", "host_us": 60.0, "ranges": 2},
    ]
    assert result["step_wall_us"] == 200.0
    assert result["host_ops"] == [{"region": "ddtree::verify", "ops": 2},
                                  {"region": "-", "ops": 1}]

    result.update(method="ddtree", label="DDTree B=32")
    old = {k: v for k, v in result.items()
           if k not in ("launches", "gpu_time", "top_kernels", "region_top_kernels",
                        "step_gpu_us", "host_time", "host_ops",
                        "step_wall_us")}
    old.update(method="dflash", label="old")
    text = host_sync_trace.format_markdown([result, old], "cmd")
    assert "| GPU ms / step | top call sites |" in text
    assert "| DDTree B=32 | 2 | 0.00 | 0.00 (0) | 0.00 | 0.00 | 0.565 | - |" in text
    assert "| old | 2 | 0.00 | 0.00 (0) | 0.00 | 0.00 | n/a | - |" in text
    assert text.count("### GPU time, host time and launches per step by region") == 1
    assert text.count("### Top kernels\n") == 1
    assert text.count("### Top kernels per region") == 1
    assert "| ddtree::verify | `triton_draw` | 0.005 | 0.50 |" in text
    assert ("| region | GPU ms / step | host ms / step | host ops / step | kernels / step "
            "| launches / step |\n"
            "|---|---|---|---|---|---|\n"
            "| vllm::execute_model | 0.500 | 0.040 | - | 2.00 | cudaGraphLaunch 1 |\n"
            "| ddtree::verify | 0.062 | 0.030 | 1.00 | 3.00 "
            "| cudaLaunchKernel 2, cuLaunchKernel 0.5 |\n"
            "| - | 0.003 | - | 0.50 | 0.50 | cudaLaunchKernel 0.5 |\n") in text
    assert "Step wall time (host, under the profiler): 0.100 ms / step; GPU activities: " \
        "0.565 ms / step." in text
    assert ("| name | ms / step | count / step |\n|---|---|---|\n"
            f"| `{GEMM[:80]}` | 0.400 | 1.00 |\n"
            "| `flash_fwd_kernel` | 0.100 | 1.00 |\n"
            "| `tree_walk_kernel` | 0.045 | 1.50 |\n") in text


def test_launch_api_names():
    assert all(host_sync_trace.is_launch_api(n) for n in (
        "cudaLaunchKernel", "cudaLaunchKernelExC_v11060", "cuLaunchKernelEx",
        "cudaGraphLaunch_ptsz", "cuGraphLaunch"))
    assert not any(host_sync_trace.is_launch_api(n) for n in (
        "cudaMemcpyAsync", "cudaMemsetAsync", "cudaStreamSynchronize", "cudaLaunchHostFunc"))


def test_count_host_syncs_cli_and_child_command():
    args = count_host_syncs.parse_args(["--methods", "ddtree", "ar", "--budget", "16",
                                        "--graphs", "--top-k", "4"])
    assert args.methods == ["ddtree", "ar"] and args.graphs and args.with_stack
    cmd = count_host_syncs.child_command(args, "ddtree", Path("/tmp/x.json"))
    assert cmd[cmd.index("--child") + 1] == "ddtree" and "--graphs" in cmd
    assert cmd[cmd.index("--top-k") + 1] == "4"
    assert not count_host_syncs.parse_args([]).graphs  # eager by default
    assert count_host_syncs.speculative_config("ddtree", 16, 4, "d") == {
        "method": "ddtree", "model": "d", "num_speculative_tokens": 16, "ddtree_top_k": 4}
    assert count_host_syncs.speculative_config("ar", 16, None, "d") is None
    # The Kimi-shaped setup reaches the child, and the chain drafts its block - 1 tokens.
    kimi = count_host_syncs.parse_args(["--setup", "kimi64", "--context", "16384", "--auto",
                                        "--gpu-mem", "0.6"])
    child = count_host_syncs.parse_args(count_host_syncs.child_command(
        kimi, "ddtree", Path("/tmp/x.json"))[2:])
    assert (child.setup, child.context, child.gpu_mem, child.auto) == ("kimi64", 16384, 0.6,
                                                                       True)
    assert count_host_syncs.speculative_config(
        "dflash", 16, None, "d", drafter_block=8)["num_speculative_tokens"] == 7
    # Fixed and adaptive budgets side by side in one run.
    both = count_host_syncs.parse_args(["--methods", "ddtree", "ddtree-auto", "--budget", "64"])
    child = count_host_syncs.parse_args(count_host_syncs.child_command(
        both, "ddtree-auto", Path("/tmp/x.json"))[2:])
    assert child.child == "ddtree-auto" and not child.auto
    assert count_host_syncs.speculative_config("ddtree-auto", 64, None, "d") == {
        "method": "ddtree", "model": "d", "num_speculative_tokens": 64,
        "ddtree_budget": "auto"}
    assert "ddtree_budget" not in count_host_syncs.speculative_config("ddtree", 64, None, "d")


def test_install_annotations_wraps_functions_in_named_ranges(monkeypatch, tmp_path):
    import types

    module = types.ModuleType("fake_round_module")

    class Verifier:
        def __call__(self, x):
            return x + 1

    module.Verifier = Verifier
    module.verify_inputs_ = lambda x: x * 2
    monkeypatch.setitem(sys.modules, "fake_round_module", module)
    monkeypatch.setattr(count_host_syncs, "ANNOTATED", [
        ("fake_round_module", "Verifier", "__call__", "ddtree::verify"),
        ("fake_round_module", None, "verify_inputs_", "ddtree::verify_inputs"),
        ("no_such_module_here", None, "f", "vllm::f"),
    ])
    assert count_host_syncs.install_annotations() == ["ddtree::verify", "ddtree::verify_inputs"]
    assert count_host_syncs.install_annotations() == []  # idempotent
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with torch.profiler.record_function(host_sync_trace.STEP_NAME):
            assert int(Verifier()(module.verify_inputs_(torch.ones(2))).sum()) == 6
    prof.export_chrome_trace(str(tmp_path / "trace.json"))
    events = host_sync_trace.load_trace_events(tmp_path / "trace.json")
    names = {e["name"] for e in events if e.get("cat") == "user_annotation"}
    assert {"ddtree::verify", "ddtree::verify_inputs", host_sync_trace.STEP_NAME} <= names
    assert host_sync_trace.count_trace(events)["steps"] == 1


def test_count_trace_counts_implicit_syncs_of_frees_and_pinned_allocations():
    """``cudaFree`` (the caching allocator releasing memory) and pinned host allocations
    (``pin_memory()``) block the host on the device without a ``*Synchronize`` call."""
    step = host_sync_trace.STEP_NAME
    trace = [
        X("user_annotation", step, 0, 100),
        X("user_annotation", "ddtree::propose", 5, 60),
        X("cpu_op", "aten::_pin_memory", 10, 20),
        X("cuda_runtime", "cudaHostAlloc", 12, 5, correlation=1),
        X("cuda_runtime", "cudaFree", 40, 5, correlation=2),
        X("cuda_runtime", "cudaMalloc", 50, 5, correlation=3),  # not a sync by itself
    ]
    result = host_sync_trace.count_trace(trace)
    assert result["per_step_syncs"] == [2] and result["ddtree_syncs"] == 2
    ops = sorted(s["op"] for s in result["sites"] if s["kind"] == "sync")
    assert ops == ["aten::_pin_memory", "cudaFree"]


def test_annotated_functions_exist():
    """``install_annotations`` skips a missing target silently (vLLM's may move between
    versions); ours must all resolve, or a profile would lose a region without notice,
    and so must the MLA attention ranges of vLLM 0.26 (what a refill step's eager layers
    spend in vLLM's prefill path and in each backend's decode launch; the FLASH_ATTN_MLA
    impl imports vLLM's CUDA FlashAttention: checked where it imports)."""
    import importlib

    mla_labels = ("mla_attention", "mla_prefill", "mla_decode")
    checked = [a for a in count_host_syncs.ANNOTATED
               if a[0].startswith("vllm_ddtree") or a[3].endswith(mla_labels)]
    assert sum(a[3].endswith(mla_labels) for a in checked) == 4
    for module, owner, attr, label in checked:
        try:
            obj = importlib.import_module(module)
        except ImportError:
            assert module.endswith("flashattn_mla"), (module, label)
            continue
        obj = getattr(obj, owner) if owner else obj
        assert callable(getattr(obj, attr, None)), (module, owner, attr, label)


def test_pin_arm_needs_auto_and_reaches_the_child(tmp_path):
    """``--pin-arm S`` pins auto's step gate in the profiled child (auto's steps below
    its maximum); without ``--auto`` it is refused by argparse."""
    import pytest

    with pytest.raises(SystemExit):
        count_host_syncs.parse_args(["--pin-arm", "32"])
    args = count_host_syncs.parse_args(["--auto", "--budget", "64", "--pin-arm", "32"])
    cmd = count_host_syncs.child_command(args, "ddtree", tmp_path / "out.json")
    assert cmd[cmd.index("--pin-arm") + 1] == "32" and "--auto" in cmd


def test_refill_steps_are_counted_apart_and_reach_the_child():
    """``--refill-every``: the steps right after a refill carry their own range name, so
    the same trace counts decode steps and refill steps as two rows; a refilled prompt
    keeps the first prompt's prefix (cached) and gets a new tail."""
    events = synthetic_trace()
    refill = X("user_annotation", host_sync_trace.REFILL_STEP_NAME, 400, 50)
    events += [refill, X("user_annotation", "vllm::execute_model", 405, 40),
               X("cuda_runtime", "cudaStreamSynchronize", 410, 20, correlation=30)]
    decode = host_sync_trace.count_trace(events)
    refills = host_sync_trace.count_trace(events, host_sync_trace.REFILL_STEP_NAME)
    assert decode["steps"] == 2 and refills["steps"] == 1
    assert refills["per_step_syncs"] == [1] and refills["step_wall_us"] == 50
    assert refills["sites"][0]["region"] == "vllm::execute_model"
    assert decode["outside_steps"]["syncs"] == 2  # the refill's sync is no decode step's

    args = count_host_syncs.parse_args(["--setup", "v2lite", "--refill-every", "4",
                                        "--refill-tail", "64"])
    child = count_host_syncs.parse_args(count_host_syncs.child_command(
        args, "ar", Path("/tmp/x.json"))[2:])
    assert (child.setup, child.refill_every, child.refill_tail) == ("v2lite", 4, 64)
    prompt = count_host_syncs.refill_prompt(list(range(200)), 64, (1000, 2000))
    first, again, other = prompt(3), prompt(3), prompt(4)
    assert first[:136] == list(range(136)) and len(first) == 200
    assert all(1000 <= t < 2000 for t in first[136:])
    assert first == again and first[136:] != other[136:]
    with pytest.raises(ValueError, match="--refill-tail 2 is not allowed: 1 .. 1"):
        count_host_syncs.refill_prompt([1, 2], 2, (0, 9))


def test_methods_take_an_attention_backend_and_cprofile_reaches_the_child():
    """``ar@FLASH_ATTN_MLA`` picks AR's backend per run (the label names it); a backend
    for DDTree, or an unknown method, is refused naming the entry."""
    args = count_host_syncs.parse_args(["--methods", "ar@FLASH_ATTN_MLA", "ar", "ddtree-auto",
                                        "--cprofile"])
    assert args.methods == ["ar@FLASH_ATTN_MLA", "ar", "ddtree-auto"]
    child = count_host_syncs.parse_args(count_host_syncs.child_command(
        args, "ar@FLASH_ATTN_MLA", Path("/tmp/x.json"))[2:])
    assert child.child == "ar@FLASH_ATTN_MLA" and child.cprofile
    assert count_host_syncs.method_label("ar@FLASH_ATTN_MLA", args, 16) == "AR, FLASH_ATTN_MLA"
    assert count_host_syncs.method_label("ar", args, 16) == "AR"
    assert count_host_syncs.method_label("ddtree-auto", args, 16) == "DDTree auto (B <= 32)"
    for bad, message in (("ddtree@CUSTOM", "'@BACKEND' names the attention backend"),
                         ("ar@", "'@BACKEND' names the attention backend"),
                         ("beam", "the method must be one of")):
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            count_host_syncs.method_spec(bad)


def test_cprofile_windows_time_and_profile_refill_steps_apart(tmp_path):
    """``refill_profile.profile_steps``: an unprofiled window times each step by kind,
    a second window (refills numbered on) profiles each kind apart; the report tables
    both and puts the refill steps' extra function first in the diff against the first
    run."""
    import importlib.util
    import sys

    from refill_profile import format_report, profile_steps

    path = tmp_path / "model_runner.py"
    path.write_text("def execute_model(refill):\n"
                    "    return sum(range(50)) + (prefill_tail() if refill else 0)\n\n"
                    "def prefill_tail():\n"
                    "    total = 0\n"
                    "    for i in range(20000):\n"
                    "        total += i\n"
                    "    return total\n")
    spec = importlib.util.spec_from_file_location("fake_model_runner", path)
    runner = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(runner)
    sys.modules.pop("fake_model_runner", None)

    class Engine:
        def __init__(self, refill_work):
            self.refill_work, self.pending = refill_work, False

        def step(self):
            runner.execute_model(self.pending and self.refill_work)
            self.pending = False

    results, seen = [], []
    for method, work in (("ar@FLASH_ATTN_MLA", False), ("ddtree-auto", True)):
        engine = Engine(work)

        def next_step(i, engine=engine):
            seen.append(i)
            if i and i % 4 == 0:
                engine.pending = True
                return host_sync_trace.REFILL_STEP_NAME
            return host_sync_trace.STEP_NAME

        results += profile_steps(engine, next_step, 12, tmp_path, method, method.upper())
    assert seen[:24] == list(range(24))  # the profiled window's refills are new ones
    kinds = [(r["method"], r["kind"], len(r["wall_ms"]), len(r["profiled_wall_ms"]))
             for r in results]
    assert kinds == [("ar@FLASH_ATTN_MLA", "decode", 10, 9), ("ar@FLASH_ATTN_MLA", "refill",
                                                              2, 3),
                     ("ddtree-auto", "decode", 10, 9), ("ddtree-auto", "refill", 2, 3)]
    out = tmp_path / "report"
    text = format_report(results, "cmd", out)
    assert (out / "host_profile_ddtree_auto_refill.prof").is_file()
    assert "| DDTREE-AUTO, steps that prefill a refill | 2 |" in text
    diff = text.split("## Steps that prefill a refill: DDTREE-AUTO against AR@FLASH_ATTN_MLA")[1]
    first_row = [line for line in diff.splitlines() if line.startswith("| `")][0]
    assert "prefill_tail" in first_row and "| 0.0 | 3.0 |" not in first_row
    assert "| 1.0 | 0.0 |" in first_row  # calls per step: the refill run's, the first's


def test_cprofile_report_counts_the_steps_it_profiled(tmp_path):
    """Per-step figures divide by the steps ``profile_steps`` ran under the profiler,
    not by the ``execute_model`` calls the profile saw: a step that enters no
    ``execute_model`` there (an engine that ran it ahead) still counts."""
    from refill_profile import format_report, profile_steps

    def prefill_tail():
        return sum(range(2000))

    class Engine:
        refill = False

        def step(self):
            if self.refill:
                prefill_tail()
            self.refill = False

    engine = Engine()

    def next_step(i):
        engine.refill = bool(i % 2)
        return host_sync_trace.REFILL_STEP_NAME if i % 2 else host_sync_trace.STEP_NAME

    results = profile_steps(engine, next_step, 6, tmp_path, "ddtree-auto", "AUTO")
    text = format_report(results, "cmd", tmp_path / "report")
    refill = text.split("##: AUTO, steps that prefill a refill")[1]
    assert "3 engine steps under cProfile" in refill
    row = [line for line in refill.splitlines() if "prefill_tail" in line][0]
    assert row.split("|")[2].strip() == "1.0"  # calls per step


def test_range_clock_splits_unprofiled_steps_by_annotated_range(tmp_path):
    """``--cprofile``'s unprofiled window: ``install_annotations(clock)`` times the
    annotated functions with the clock (no profiler range), per kind of step, and the
    report tables the mean ms a step inside each; the profiled window is not counted."""
    import time
    import types

    from refill_profile import RangeClock, format_report, profile_steps

    module = types.ModuleType("fake_mla_module")

    class Impl:
        def forward_mha(self, seconds):
            time.sleep(seconds)

    module.Impl = Impl
    sys.modules["fake_mla_module"] = module
    try:
        clock = RangeClock()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(count_host_syncs, "ANNOTATED",
                       [("fake_mla_module", "Impl", "forward_mha", "vllm::mla_prefill")])
            assert count_host_syncs.install_annotations(clock) == ["vllm::mla_prefill"]
        impl = Impl()

        class Engine:
            refill = False

            def step(self):
                impl.forward_mha(0.004 if self.refill else 0.0)
                self.refill = False

        engine = Engine()

        def next_step(i):
            engine.refill = i % 3 == 2
            return host_sync_trace.REFILL_STEP_NAME if engine.refill else host_sync_trace.STEP_NAME

        results = profile_steps(engine, next_step, 6, tmp_path, "ddtree", "DDT", clock)
        assert not clock.enabled and not clock.totals
        by_kind = {r["kind"]: r["range_ms"]["vllm::mla_prefill"] for r in results}
        assert by_kind["refill"] >= 4.0 > 1.0 > by_kind["decode"]
        text = format_report(results, "cmd", tmp_path / "report")
        row = [line for line in text.splitlines()
               if line.startswith("| DDT, steps that prefill a refill | ")][-1]
        assert float(row.split("|")[2]) >= 4.0
        assert "`vllm::mla_prefill`" in text
    finally:
        sys.modules.pop("fake_mla_module", None)


def test_range_clock_times_a_triton_kernels_launch(monkeypatch):
    """A Triton kernel in ``ANNOTATED`` (its ``run`` wrapped on the kernel object) is
    timed where the launcher launches it, ``kernel[grid](...)``, and still runs: the
    interpreted merge kernel of the MLA launcher on the CPU."""
    import torch
    from refill_profile import RangeClock

    from vllm_ddtree.attention_backends.mla_tree import kernels, ops

    kernel = kernels._mla_tree_merge_kernel  # interpreted on the CPU (conftest)
    monkeypatch.setattr(kernel, "run", kernel.run, raising=False)  # undone after the test
    clock = RangeClock()
    monkeypatch.setattr(count_host_syncs, "ANNOTATED", [
        ("vllm_ddtree.attention_backends.mla_tree.kernels", "_mla_tree_merge_kernel", "run",
         "triton::merge_run")])
    assert count_host_syncs.install_annotations(clock) == ["triton::merge_run"]
    tokens, heads, splits, width = 3, 2, 4, 16
    out_buf = torch.randn(tokens, heads, splits, width)
    lse_buf = torch.randn(tokens, heads, splits)
    out = torch.empty(tokens, heads, width)
    lse = torch.empty(tokens, heads)
    unused = torch.zeros(tokens, dtype=torch.int32)
    clock.enabled = True
    ops.merge_splits(out_buf, lse_buf, out, lse, splits, 1, unused, unused, 16, width, False)
    clock.enabled = False
    assert clock.take_ms()["triton::merge_run"] > 0.0
    weights = torch.softmax(lse_buf, dim=-1)
    torch.testing.assert_close(out, (weights[..., None] * out_buf).sum(2))
    torch.testing.assert_close(lse, torch.logsumexp(lse_buf, dim=-1))
