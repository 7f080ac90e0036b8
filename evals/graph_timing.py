# SPDX-License-Identifier: Apache-2.0
"""GPU time of a kernel launch replayed in CUDA graphs (the MLA verify benchmarks)."""

from __future__ import annotations

import torch

TIMER_TITLES = {
    "graph": "GPU time per call, calls replayed in a CUDA graph with an L2 flush before "
    "each (the flush's own time subtracted), median of 5 replays",
    "events": "triton.testing.do_bench (host launches, so launch overhead included), "
    "median, L2 flushed between runs",
}
GRAPH_MAX_CALLS = 100


def graph_time_ms(fn, rep_ms: float) -> float:
    """GPU milliseconds per ``fn()`` call: ``n`` calls, each after an L2 flush, captured in
    one CUDA graph, minus a graph of the ``n`` flushes alone. Host launch overhead, which
    the verify step's CUDA graph removes in vLLM, is not counted."""
    flush = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm-up: JIT compiles and first-call planning outside the capture
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(3):
            flush.zero_()
            fn()
        end.record()
        torch.cuda.synchronize()
        calls = max(1, min(GRAPH_MAX_CALLS, int(rep_ms / max(start.elapsed_time(end) / 3, 1e-3))))
        graphs = []
        for with_fn in (True, False):
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, stream=stream):
                    for _ in range(calls):
                        flush.zero_()
                        if with_fn:
                            fn()
            except RuntimeError as e:
                if "captur" not in str(e):
                    raise
                raise NotCapturable(str(e).splitlines()[0][:120]) from e
            graphs.append(graph)
        medians = []
        for graph in graphs:
            times = []
            for _ in range(5):
                start.record()
                graph.replay()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            medians.append(sorted(times)[2])
    del graphs, flush
    return max(medians[0] - medians[1], 0.0) / calls


class NotCapturable(RuntimeError):
    """A method that cannot run inside a CUDA graph capture (e.g. a host-to-device copy)."""
