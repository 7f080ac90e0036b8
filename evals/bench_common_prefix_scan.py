# SPDX-License-Identifier: Apache-2.0
"""Host cost of vLLM 0.26's per-step common-prefix scan, which
``patches/scheduler_common_prefix.py`` removes for V2-runner DDTree engines (CPU only).

Every ``Scheduler.schedule()`` calls ``get_num_common_prefix_blocks`` once per KV-cache
group; vLLM's ``FullAttentionManager`` walks the first running request's blocks while
every request holds them (``single_type_kv_cache_manager.py:795-802``): at batch 1 the
whole context. This times that method itself (vLLM's code, real ``KVCacheBlock``
objects at batch 1) per context and page size, times ``--groups`` (the kimi8 bench's
target has 5 full-attention groups), on this machine's CPU. Not a GPU figure: it is
host time added to every decoding step (``evals/bench_e2e.py`` measures the steps).

    python evals/bench_common_prefix_scan.py --out evals/results/common_prefix_scan
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path
from types import SimpleNamespace

CONTEXTS = (1024, 16384, 65536, 131072, 204800)
PAGES = (16, 64)


def scan_us(context: int, page: int, repeats: int) -> float:
    """Median microseconds of one ``FullAttentionManager.get_num_common_prefix_blocks``
    call for one running request of ``context`` tokens in ``page``-token blocks."""
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

    blocks = [KVCacheBlock(block_id=i, ref_cnt=1) for i in range(-(-context // page))]
    manager = SimpleNamespace(req_to_blocks={"req-0": blocks})
    scan = FullAttentionManager.get_num_common_prefix_blocks
    assert scan(manager, "req-0") == len(blocks)  # the whole context is "common"
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        scan(manager, "req-0")
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2] * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--out", type=Path, required=True, help="path without suffix")
    args = parser.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import vllm

    per_step = {page: [args.groups * scan_us(c, page, args.repeats) / 1000 for c in CONTEXTS]
                for page in PAGES}
    command = "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]])
    lines = [
        "# vLLM's per-step common-prefix scan at batch 1 (host ms per step)",
        "",
        f"- command: `{command}`",
        f"- vllm {vllm.__version__}, Python {platform.python_version()}, CPU: "
        f"{platform.processor() or platform.machine()} (this machine, not the GPU host)",
        f"- {args.groups} full-attention KV-cache groups (the kimi8 bench's target), "
        f"median of {args.repeats} calls per group",
        "",
        "| page | " + " | ".join(f"{c // 1024}k" for c in CONTEXTS) + " |",
        "|---|" + "---|" * len(CONTEXTS),
    ]
    for page, values in per_step.items():
        lines.append(f"| {page} | " + " | ".join(f"{v:.3f}" for v in values) + " |")
    lines += ["", "`patches/scheduler_common_prefix.py` makes this 0 for V2-runner DDTree "
              "engines (only vLLM's V1 runner reads the result, for cascade attention)."]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    fig, ax = plt.subplots(figsize=(6, 4))
    for page, values in per_step.items():
        ax.plot([c / 1024 for c in CONTEXTS], values, marker="o", label=f"{page}-token pages")
    ax.set_xlabel("context (k tokens)")
    ax.set_ylabel(f"host ms per step ({args.groups} groups)")
    ax.set_title("vLLM common-prefix scan per schedule() at batch 1")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out.with_suffix(".png"), dpi=120)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
