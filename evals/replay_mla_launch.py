# SPDX-License-Identifier: Apache-2.0
"""Replay, in isolation, the MLA tree-verify launches vLLM made, beside the bench's
compact launch of the same shape: is the kernel slower inside vLLM because of the
split count frozen at CUDA-graph capture, because of vLLM's cache layout (padded
pages), or neither?

The launches come from the lines ``VLLM_DDTREE_LOG_LAUNCHES=1`` prints (one per distinct
launch; under CUDA graphs they are the capture-time launches, whose ``max_seq_len`` is
``max_model_len``). ``--context`` is the context the replay gives every request.

    VLLM_DDTREE_LOG_LAUNCHES=1 python evals/count_host_syncs.py --setup kimi64 \\
        --context 16384 --budget 16 --methods ddtree --graphs --out /tmp/s.md 2> launches.log
    python evals/replay_mla_launch.py launches.log --context 16384 --out replay.md

Columns (ms, GPU time in a CUDA graph, ``bench_verify_attention.graph_time_ms``):
vLLM's layout and split count; the same with the split count chosen per request at
run time (``runtime_kv_splits``, what the backend captures since 2026-11-30 s16); vLLM's
layout with the split count chosen for ``--context``; a compact cache with vLLM's split
count; compact and chosen (the bench).
"""

from __future__ import annotations

import argparse
import random
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
for path in (REPO, REPO / "evals"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

LAUNCH_LINE = re.compile(
    r"mla_tree launch (?P<kernel>\w+): q \((?P<q_shape>[\d, ]+)\) \((?P<q_stride>[\d, ]+)\), "
    r"kv_cache \((?P<kv_shape>[\d, ]+)\) \((?P<kv_stride>[\d, ]+)\), (?P<params>.*)$")
PARAM = re.compile(r"(\w+)=(\([^)]*\)|[^,]+)")


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.replace(" ", "").split(",") if x)


@dataclass(frozen=True)
class Launch:
    """One logged launch: the kernel (``gluon`` / ``triton``), q's and the cache's
    shapes and strides, and the launch parameters (strings, as logged)."""

    kernel: str
    q_shape: tuple[int, ...]
    q_stride: tuple[int, ...]
    kv_shape: tuple[int, ...]
    kv_stride: tuple[int, ...]
    params: tuple[tuple[str, str], ...]

    def param(self, name: str) -> str:
        return dict(self.params)[name]


def parse_launches(text: str) -> list[Launch]:
    """The distinct launches of a log, in first-seen order."""
    out: list[Launch] = []
    for line in text.splitlines():
        m = LAUNCH_LINE.search(line)
        if not m:
            continue
        params = tuple((k, v.strip()) for k, v in PARAM.findall(m["params"]))
        launch = Launch(m["kernel"], _ints(m["q_shape"]), _ints(m["q_stride"]),
                        _ints(m["kv_shape"]), _ints(m["kv_stride"]), params)
        if launch not in out:
            out.append(launch)
    return out


def build_inputs(launch: Launch, context: int, device: str, dtype: torch.dtype,
                 compact: bool = False, seed: int = 0) -> dict:
    """``mla_tree_verify`` keyword arguments reproducing ``launch`` with ``context``
    context tokens per request: q with the logged strides, a cache holding just the
    pages the requests use, with the logged page stride (``compact``: contiguous pages
    instead), random page order, a bushy random tree per request."""
    from bench_verify_attention import bushy_tree_parents
    from vllm_ddtree.attention_backends.mla_tree import ancestor_bits_from_parents

    gen = torch.Generator(device=device).manual_seed(seed)
    num_tokens, num_heads, head_dim = launch.q_shape
    num_reqs = int(launch.param("requests"))
    qlen = int(launch.param("max_query_len"))
    if num_reqs * qlen > num_tokens:
        raise ValueError(f"{num_reqs} requests x {qlen} tokens exceed q's {num_tokens} rows")
    page = launch.kv_shape[1]
    seq_len = context + qlen
    pages_per_req = -(-seq_len // page)
    num_blocks = num_reqs * pages_per_req
    kv_stride = (page * head_dim, head_dim, 1) if compact else launch.kv_stride
    kv_cache = torch.empty_strided((num_blocks, page, head_dim), kv_stride, dtype=dtype,
                                   device=device)
    kv_cache.copy_(torch.randn(num_blocks, page, head_dim, generator=gen, device=device))
    q = torch.empty_strided(launch.q_shape, launch.q_stride, dtype=dtype, device=device)
    q.copy_(torch.randn(launch.q_shape, generator=gen, device=device))
    order = torch.randperm(num_blocks, generator=gen, device=device).to(torch.int32)
    tree_bits = ancestor_bits_from_parents(bushy_tree_parents(qlen, random.Random(seed)))
    bits = torch.zeros(num_tokens, tree_bits.shape[1], dtype=torch.int64)  # padding rows: 0
    bits[: num_reqs * qlen] = tree_bits.repeat(num_reqs, 1)
    return dict(
        q=q, kv_cache=kv_cache,
        block_table=order.view(num_reqs, pages_per_req),
        seq_lens=torch.full((num_reqs,), seq_len, dtype=torch.int32, device=device),
        query_start_loc=torch.arange(num_reqs + 1, dtype=torch.int32, device=device) * qlen,
        ancestor_bits=bits.to(device),
        scale=head_dim ** -0.5, kv_lora_rank=int(launch.param("kv_lora_rank")),
        max_query_len=qlen, max_seq_len=seq_len, validate_values=False,
        kernel="triton" if launch.kernel == "triton" else "auto",
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("log", help="stderr of a run with VLLM_DDTREE_LOG_LAUNCHES=1")
    p.add_argument("--context", type=int, required=True)
    p.add_argument("--rep", type=float, default=50.0, help="ms of calls per graph")
    p.add_argument("--out", required=True, help="markdown table")
    args = p.parse_args(argv)
    launches = parse_launches(Path(args.log).read_text(errors="replace"))
    if not launches:
        print(f"no 'mla_tree launch' lines in {args.log}")
        return 1
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    from bench_verify_attention import graph_time_ms
    from vllm_ddtree.attention_backends.mla_tree import mla_tree_verify

    lines = [f"# MLA tree launches from `{args.log}`, replayed at {args.context} context",
             "", f"({torch.cuda.get_device_name()}; GPU ms per call in a CUDA graph)", "",
             "| kernel | q | kv page stride | requests | splits logged | vLLM layout, logged "
             "splits | same, run-time split choice | vLLM layout, chosen splits | compact, "
             "logged splits | compact, chosen (bench) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    variants = [(False, True, False), (False, True, True), (False, False, False),
                (True, True, False), (True, False, False)]  # compact, logged, run-time
    for launch in launches:
        splits = int(launch.param("splits"))
        times = []
        for compact, logged, runtime in variants:
            kwargs = build_inputs(launch, args.context, "cuda", torch.bfloat16, compact)
            times.append(graph_time_ms(
                lambda kw=kwargs, s=splits if logged else None, rt=runtime: mla_tree_verify(
                    **kw, num_kv_splits=s, runtime_kv_splits=rt),
                args.rep))
        lines.append(f"| {launch.kernel} | {list(launch.q_shape)} | {launch.kv_stride[0]} | "
                     f"{launch.param('requests')} | {splits} | "
                     + " | ".join(f"{t:.3f}" for t in times) + " |")
        print(lines[-1], flush=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
