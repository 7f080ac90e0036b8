# SPDX-License-Identifier: Apache-2.0
"""Where a launch right after a CUDA-graph replay spends its host time (GPU only).

The e2e host tables showed two one-kernel regions of a DDTree round (KV compaction, the
tree scatter) costing a fixed ~0.14 ms each, independent of the host's Python speed
and of direct launch. Both follow a CUDA-graph replay. This probe times, on the host,
one tiny Triton launch and one tiny PyTorch op:

- ``idle``: the GPU idle (synchronized first);
- ``after graph``: right after replaying a captured graph of ``--graph-kernels``
  small kernels (the drafter / target step stand-in);
- ``after graph + gap``: the same with ``--gap-us`` of host busy-wait between replay
  and launch (a wait that shrinks here is the driver finishing the graph's submission);
- ``busy thread``: idle GPU, a second Python thread looping (a GIL hand-off at the
  launcher's ``Py_BEGIN_ALLOW_THREADS`` would show here).

Writes a markdown table (median / p90 host us per launch) to ``--out``.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from pathlib import Path

import torch
import triton
import triton.language as tl


@triton.jit
def _bump_kernel(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=mask) + 1, mask=mask)


def _triton_launch(x: torch.Tensor) -> None:
    _bump_kernel[(1,)](x, x.numel(), BLOCK=128)


def _torch_launch(x: torch.Tensor) -> None:
    x.add_(1)


def _busy_wait(us: float) -> None:
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass


def summarize_us(samples_s: list[float]) -> tuple[float, float]:
    """(median, p90) of host times given in seconds, in microseconds."""
    ordered = sorted(samples_s)
    p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
    return statistics.median(ordered) * 1e6, p90 * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--graph-kernels", type=int, default=300)
    parser.add_argument("--gap-us", type=float, default=300.0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    x = torch.zeros(128, device="cuda")
    work = torch.zeros(1 << 16, device="cuda")
    for _ in range(3):  # compile / warm both launch paths
        _triton_launch(x)
        _torch_launch(x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(2):
            work.mul_(1.0001)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(args.graph_kernels):
                work.mul_(1.0001)
    torch.cuda.synchronize()

    def timed(launch, before) -> list[float]:
        samples = []
        for _ in range(args.iters):
            torch.cuda.synchronize()
            before()
            t0 = time.perf_counter()
            launch(x)
            samples.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        return samples

    def replay_s() -> list[float]:
        samples = []
        for _ in range(args.iters):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            graph.replay()
            samples.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        return samples

    scenarios = {
        "idle": lambda: None,
        "after graph": graph.replay,
        "after graph + gap": lambda: (graph.replay(), _busy_wait(args.gap_us)),
    }
    rows = []
    for name, before in scenarios.items():
        for kind, launch in (("triton", _triton_launch), ("torch", _torch_launch)):
            rows.append((name, kind, *summarize_us(timed(launch, before))))
    stop = threading.Event()

    def spin() -> None:
        n = 0
        while not stop.is_set():
            n += 1

    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
    try:
        for kind, launch in (("triton", _triton_launch), ("torch", _torch_launch)):
            rows.append(("busy thread", kind, *summarize_us(timed(launch, lambda: None))))
    finally:
        stop.set()
        thread.join()
    replay_med, replay_p90 = summarize_us(replay_s())

    lines = [
        "# Host time of one launch after a CUDA-graph replay",
        "",
        f"- GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}, "
        f"triton {triton.__version__}",
        f"- graph: {args.graph_kernels} kernels; replay call {replay_med:.1f} us median "
        f"({replay_p90:.1f} p90); gap {args.gap_us:.0f} us; {args.iters} launches per row",
        "",
        "| scenario | launch | host us median | p90 |",
        "|---|---|---|---|",
    ]
    lines += [f"| {name} | {kind} | {med:.1f} | {p90:.1f} |" for name, kind, med, p90 in rows]
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
