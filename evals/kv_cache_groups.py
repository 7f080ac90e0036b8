"""How vLLM 0.26 groups the KV caches of an MLA target beside a DFlash drafter.

Every KV-cache group costs host time in every step: its own block table and slot
mapping, and an attention-metadata build per attention backend (for the target's verify
and for the drafter). With the hybrid KV-cache manager (vLLM's default) a target of M
MLA layers beside a drafter with sliding-window and full layers gets one group per
layer; with ``disable_hybrid_kv_cache_manager`` one group holds them all (the drafter's
sliding layers then keep KV for the whole context, as full layers do: more memory, the
same attention, since the window is the layer's, not the cache's). This runs vLLM's own
grouping (``get_kv_cache_groups``, through ``vllm_ddtree.kv_grouping``, which DDTree's
default grouping also uses) on the layer specs of the setups we benchmark, built from
their configs; CPU only, no model is built.

    python evals/kv_cache_groups.py --out evals/results/kv_cache_groups.md
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # e2e_models

from vllm_ddtree.kv_group_choice import (  # noqa: E402
    ONE_GROUP_MAX_KV_RATIO,
    choose_by_kv_bytes,
)
from vllm_ddtree.kv_grouping import (  # noqa: E402
    DRAFTER_SLIDING_BLOCK,
    KVPairShape,
    kv_bytes_per_token,
    pair_kv_shape,
    vllm_kv_cache_groups,
)


@dataclass(frozen=True)
class PairShape(KVPairShape):
    """A pair's :class:`~vllm_ddtree.kv_grouping.KVPairShape` with the name the tables use."""

    name: str = ""


def _named(name: str, target_config, drafter_config) -> PairShape:
    return PairShape(**vars(pair_kv_shape(target_config, drafter_config)), name=name)


def shapes() -> tuple[PairShape, ...]:
    """The embedded pair (its checkpoint configs), the kimi8 / kimi64 setups of
    ``bench_e2e`` and Kimi-K2's 61 layers beside the same drafter, from their configs."""
    from e2e_models import kimi_drafter_config, kimi_target_config
    from transformers import AutoConfig

    from vllm_ddtree.demo.reference_engine import CHECKPOINTS

    kimi_k2 = kimi_target_config(64)
    kimi_k2.num_hidden_layers = 61
    return (_named("embedded pair (vllm_ddtree/checkpoints)",
                   AutoConfig.from_pretrained(CHECKPOINTS / "target"),
                   AutoConfig.from_pretrained(CHECKPOINTS / "drafter")),
            _named("kimi8 / kimi64 benchmark setups", kimi_target_config(8),
                   kimi_drafter_config()),
            _named("Kimi-K2 + Kimi-K2.6-shaped drafter", kimi_k2, kimi_drafter_config()))


def vllm_groups(shape: PairShape, hybrid: bool, page: int = 64,
                sliding_page: int | None = None, align: bool = False) -> list:
    """The ``KVCacheGroupSpec`` list vLLM forms for ``shape``
    (``vllm_ddtree.kv_grouping.vllm_kv_cache_groups``), through vLLM's own
    ``unify_hybrid_kv_cache_specs`` even where ``patches.unify_kv_block_size`` is
    applied in this process: ``align`` alone says whether the patch's alignment runs.
    Raises vLLM's ``ValueError`` when it cannot form the groups."""
    from unittest import mock

    from vllm.v1.core import kv_cache_utils

    unify = kv_cache_utils.unify_hybrid_kv_cache_specs
    vllm_unify = getattr(unify, "_ddtree_original", unify)  # vLLM's own, patched or not
    with mock.patch.object(kv_cache_utils, "unify_hybrid_kv_cache_specs", vllm_unify):
        return vllm_kv_cache_groups(shape, hybrid, page, sliding_page=sliding_page,
                                    align=align)


def kv_cache_groups(shape: PairShape, hybrid: bool, page: int = 64,
                    sliding_page: int | None = None, align: bool = False
                    ) -> list[tuple[str, int]]:
    """``[(spec type, number of layers)]`` per KV-cache group of :func:`vllm_groups`."""
    return [(type(g.kv_cache_spec).__name__, len(g.layer_names))
            for g in vllm_groups(shape, hybrid, page, sliding_page, align)]


def kv_layout(shape: PairShape, hybrid: bool) -> tuple[int, int]:
    """``(KV bytes per context token, prefix-cache hit granularity in tokens)`` of the
    groups vLLM forms for ``shape`` as a DDTree engine on our MLA backend builds its
    specs (``vllm_ddtree.kv_grouping.kv_bytes_per_token``: 64-token pages, the
    drafter's sliding layers on FlashAttention's 16-token blocks, aligned in one group);
    the granularity is the least common multiple of the block sizes (vLLM's
    ``scheduler_block_size``)."""
    import math

    groups = vllm_groups(shape, hybrid, sliding_page=DRAFTER_SLIDING_BLOCK, align=not hybrid)
    return (kv_bytes_per_token(shape, hybrid),
            math.lcm(*{g.kv_cache_spec.block_size for g in groups}))


def unpadded_bytes_per_token(shape: PairShape) -> int:
    """Bytes per context token the target's and the drafter's full layers need."""
    item = shape.dtype.itemsize
    target = shape.target_kv_heads * shape.target_head_size * (1 if shape.target_mla else 2)
    return (shape.target_layers * target * item
            + shape.full_layers * 2 * shape.drafter_kv_heads * shape.drafter_head_size * item)


def describe(groups: list[tuple[str, int]]) -> str:
    counts = Counter(groups)
    return ", ".join(f"{n} x {kind} of {layers} layer{'s' * (layers > 1)}"
                     for (kind, layers), n in counts.items())


def scheduler_table(batches: list[int], steps: int, drafts: tuple[int, ...] = (16, 64)
                    ) -> list[str]:
    """Markdown lines: vLLM's scheduler host ms per decode step
    (``scheduler_steps.scheduler_step_ms``) for each pair's target alone (plain
    decoding), and beside its drafter with the hybrid manager and with one group."""
    import dataclasses
    import platform

    from scheduler_steps import scheduler_step_ms
    from tqdm import tqdm

    lines = ["", "Host time of vLLM's scheduler per decode step (`AsyncScheduler.schedule` + "
             "`update_from_output`, prefix caching on, V2 runner; no model: "
             "`evals/scheduler_steps.py`), median ms over "
             f"{steps} steps of 900-token prompts, 2 drafts accepted a step, on this "
             f"machine's CPU ({platform.processor() or platform.machine()}, "
             f"{platform.python_version()}): what the engine core spends on the host each "
             "step beside the GPU's work. The target alone forms one group.", "",
             "| pair | engine | " + " | ".join(f"batch {b}" for b in batches) + " |",
             "|---|---|" + "---|" * len(batches)]
    for shape in tqdm(shapes(), desc="scheduler host time"):
        target = dataclasses.replace(shape, sliding_layers=0, full_layers=0)
        rows = [("plain decoding, the target alone", vllm_groups(target, True), 0)]
        for hybrid, label in ((True, "hybrid manager"), (False, "one group")):
            groups = vllm_groups(shape, hybrid, sliding_page=16, align=not hybrid)
            rows += [(f"{k} drafts a step, {label} ({len(groups)} group"
                      f"{'s' * (len(groups) > 1)})", groups, k) for k in drafts]
        for label, groups, k in rows:
            cells = [f"{scheduler_step_ms(groups, k, b, steps=steps):.3f}" for b in batches]
            lines.append(f"| {shape.name} | {label} | " + " | ".join(cells) + " |")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("evals/results/kv_cache_groups.md"))
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64],
                   help="requests in flight for the scheduler's host time")
    p.add_argument("--steps", type=int, default=120,
                   help="decode steps timed per cell (the median is reported)")
    args = p.parse_args(argv)
    if min(args.batches) < 1 or args.steps < 1:
        p.error(f"--batches and --steps must be >= 1, got {args.batches} and {args.steps}")
    lines = ["# KV-cache groups of an MLA target beside a DFlash drafter (vLLM 0.26.0)", "",
             "Command: `python evals/kv_cache_groups.py --out " + str(args.out) + "` (CPU: "
             "vLLM's `get_kv_cache_groups` on the layers' KV specs, 64-token pages).", "",
             "| pair | layers (target MLA + drafter sliding + full) | groups, hybrid manager "
             "(default) | groups, `disable_hybrid_kv_cache_manager` | the same, sliding layers on "
             "16-token blocks (FlashAttention's own choice): vLLM 0.26 / with "
             "`patches/unify_kv_block_size.py` |", "|---|---|---|---|---|"]
    for shape in shapes():
        hybrid, single = kv_cache_groups(shape, True), kv_cache_groups(shape, False)
        try:
            kv_cache_groups(shape, False, sliding_page=16)
            unpatched = "starts"
        except ValueError:
            unpatched = "refuses to start"
        aligned = kv_cache_groups(shape, False, sliding_page=16, align=True)
        lines.append(f"| {shape.name} | {shape.target_layers} + {shape.sliding_layers} + "
                     f"{shape.full_layers} | {len(hybrid)}: {describe(hybrid)} | "
                     f"{len(single)}: {describe(single)} | {unpatched} / {len(aligned)}: "
                     f"{describe(aligned)} |")
    lines += ["", "KV bytes per context token and prefix-cache hit granularity, as a DDTree "
              "engine builds the specs (64-token MLA and full-attention pages, the drafter's "
              "sliding layers on FlashAttention's 16-token blocks; sliding layers in their own "
              "groups hold a window and are not counted): the hybrid manager equalises page "
              "bytes by padding or stretching pages.", "",
              "| pair | unpadded full layers (B/token) | hybrid manager: B/token, hit every | "
              "`disable_hybrid_kv_cache_manager`: B/token, hit every | DDTree's default "
              f"(one group where it takes <= {ONE_GROUP_MAX_KV_RATIO:.2f}x the hybrid "
              "manager's bytes; `vllm_ddtree/kv_group_choice.py`) |", "|---|---|---|---|---|"]
    for shape in shapes():
        need = unpadded_bytes_per_token(shape)
        (hb, hg), (sb, sg) = kv_layout(shape, True), kv_layout(shape, False)
        one = choose_by_kv_bytes(shape, 64).disable_hybrid_kv_cache_manager
        default = (f"one group ({sb / hb:.2f}x)" if one else
                   f"hybrid manager (one group: {sb / hb:.2f}x)")
        lines.append(f"| {shape.name} | {need:,} | {hb:,} ({hb / need:.2f}x), {hg} tokens | "
                     f"{sb:,} ({sb / need:.2f}x), {sg} tokens | {default} |")
    lines += scheduler_table(args.batches, args.steps)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
