# SPDX-License-Identifier: Apache-2.0
"""``GraphTimer`` on the GPU: the start-up attention timer captures the tree kernels
(GQA and MLA, one request or a batch of 64, 1 + b active rows each) in a CUDA graph
and times replays; the caller's stream is current again afterwards, also after a
capture that fails (then the timer falls back to eager launches). Only sanity bounds
on the times (CPU side: tests/test_attention_graph_timing.py)."""

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("TRITON_INTERPRET=1: run tests/gpu in its own process", allow_module_level=True)

from vllm_ddtree.budget.attention_timing import (  # noqa: E402
    GraphTimer,
    cuda_time_fn,
    gqa_attention_timer,
    mla_attention_timer,
)

# A graph replay skips the per-launch host overhead, so it should not be slower than
# eager launches; the factor only absorbs noise (this is no benchmark).
SANITY_FACTOR = 3.0
MAX_QUERY_LEN, MAX_CONTEXT = 9, 4096


def attention_measure(kind: str, time_fn, num_reqs: int = 1):
    device = torch.device("cuda")
    if kind == "gqa":
        return gqa_attention_timer(32, 8, 128, MAX_QUERY_LEN, MAX_CONTEXT, torch.bfloat16,
                                   device, time_fn=time_fn, num_reqs=num_reqs)
    return mla_attention_timer(16, 512, 64, MAX_QUERY_LEN, MAX_CONTEXT, torch.bfloat16,
                               device, graph_max_seq_len=MAX_CONTEXT + MAX_QUERY_LEN,
                               time_fn=time_fn, num_reqs=num_reqs)


@pytest.mark.parametrize("num_reqs", [1, 64])
@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_graph_timing_runs_captured_and_keeps_the_callers_stream(kind, num_reqs):
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        timer = GraphTimer()
        in_graphs = attention_measure(kind, timer, num_reqs)
        eager = attention_measure(kind, cuda_time_fn(), num_reqs)
        for context, rows in ((1024, 1), (1024, 5), (MAX_CONTEXT, MAX_QUERY_LEN)):
            graph_seconds = in_graphs(context, rows)
            assert torch.cuda.current_stream() == stream
            eager_seconds = eager(context, rows)
            assert math.isfinite(graph_seconds) and graph_seconds > 0, (context, rows)
            assert graph_seconds <= SANITY_FACTOR * eager_seconds, (
                context, rows, graph_seconds, eager_seconds)
        assert timer.failure is None and timer.graph_timings == 3
    assert torch.cuda.current_stream() != stream


def test_a_failed_capture_restores_the_stream_and_times_eagerly():
    """A host sync cannot be captured: the capture raises, the caller's stream is
    current again, the timer times eagerly from then on, and CUDA still works."""
    x = torch.ones(4, device="cuda")

    def host_sync():
        return (x * 2).sum().item()

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        timer = GraphTimer()
        first = timer(host_sync)
        assert torch.cuda.current_stream() == stream
        assert timer.failure is not None and not timer.in_graphs
        second = timer(host_sync)
        assert torch.cuda.current_stream() == stream
    assert timer.graph_timings == 0
    assert all(math.isfinite(t) and t > 0 for t in (first, second))
    assert float((x + 1).sum()) == 8.0
    torch.cuda.synchronize()


def test_a_failed_capture_leaves_the_allocator_as_it_was():
    """torch 2.11's capture_end raises before it stops routing allocations to the
    graph's pool, and the graph never releases that pool: ``_capture_cuda_graph`` does
    both, so that after a failed capture (one that allocated 64 MiB in its pool) the
    allocator gives every cached byte back (a pool left routing would keep its segment
    reserved, and the allocator would believe a capture is under way from then on)."""
    import gc

    def allocate_then_sync():
        block = torch.ones(16 << 20, device="cuda")  # 64 MiB, in the graph's pool
        return block.sum().item()  # a host sync invalidates the capture

    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    baseline = torch.cuda.memory_reserved()
    timer = GraphTimer()
    assert timer(allocate_then_sync) > 0 and timer.failure is not None
    gc.collect()
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved() == baseline
    # The allocator is out of capture mode: a graph captures and replays normally.
    x = torch.zeros(4, device="cuda")
    assert GraphTimer()(lambda: x.add_(1)) > 0
    torch.cuda.synchronize()
    assert bool((x > 0).all())
