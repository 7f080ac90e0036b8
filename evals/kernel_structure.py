# SPDX-License-Identifier: Apache-2.0
"""What the MLA tree-verify kernel's KV loop compiles to, per cache variant and tile config,
offline (no GPU): the 16-bit cache, the fp8 cache (``KV_FP8``) and the fp8 cache with
transposed products (``KV_FP8_TRANSPOSED``), compiled for sm_90a / sm_120a as launched
(``kernel_spills.launch_signature``: aligned pointers and strides).

Per variant: registers, spilled bytes and shared memory (Triton's ``ptxas -v``); from
the TTGIR of the unmasked KV loop (nearly all the time at long context) how the KV tiles
reach the MMAs: tiles copied to shared memory asynchronously (``cp.async`` ring) or
loaded to registers, 16-bit tensors written to shared memory per tile (a widened tile's
round trip), wgmma A operands taken from registers or shared memory; from its PTX the
byte loads from shared memory (``ld.shared.b8``: an operand gathered a byte at a time);
and the loop's SASS instructions per 64 keys, by kind.

    python evals/kernel_structure.py            # sm_90 and sm_120, 16 heads (stdout)
    python evals/kernel_structure.py --arch 90 --out /tmp/structure.md
"""

from __future__ import annotations

import argparse
import collections
import re
import shlex
import sys
from pathlib import Path

from kernel_spills import (
    ALIGNED_INTS,
    POINTERS,
    launch_signature,
    ptxas_report,
    sass_loops,
    sass_of,
    triton,
)
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from vllm_ddtree.attention_backends.mla_tree import kernels as mla_kernels
from vllm_ddtree.attention_backends.mla_tree.configs import (
    FP8_TRANSPOSED_TILE_CONFIGS,
    LARGE_SMEM_TILE_CONFIGS,
    MLA_TILE_CONFIGS,
    MLATileConfig,
)

# A SASS loop ends in a branch back to its label: "@P0 BRA `(.L_x_3)" or, on sm_120,
# "BRA.U !UP0, `(.L_x_1)".
SASS_BRANCH = r"BRA[.\w]*(?:\s+!?U?P\w+,)?"
# SASS opcode prefixes counted per 64 keys, in table order.
SASS_KINDS = {
    "F2FP": "F2FP",  # conversions, e4m3x2 -> f16x2 among them
    "PRMT": "PRMT",  # byte / half-word permutes
    "LDS": "LDS",  # shared loads, LDS.128 etc. (not LDSM)
    "LDSM": "LDSM",  # ldmatrix
    "STS": "STS",  # shared stores (STSM: stmatrix)
    "LDGSTS": "LDGSTS",  # cp.async
    "LDG": "LDG",  # global loads to registers
    "MMA": ("HGMMA", "HMMA"),  # wgmma / mma.sync
    "BAR": "BAR",  # barriers
    "STL": "STL",  # spill stores
    "LDL": "LDL",  # spill loads
}


def variants(arch: int) -> list[tuple[str, MLATileConfig]]:
    """``(cache, config)`` pairs compiled for ``arch``: every table config with the 16-bit
    and the fp8 cache (the 64-row tile on sm_90 only) and the transposed fp8 configs."""
    configs = list(MLA_TILE_CONFIGS) + (list(LARGE_SMEM_TILE_CONFIGS) if arch == 90 else [])
    pairs = [(cache, c) for cache in ("bf16", "fp8") for c in configs]
    return pairs + [("fp8", c) for c in FP8_TRANSPOSED_TILE_CONFIGS]


def compile_variant(cache: str, config: MLATileConfig, arch: int, heads: int, page: int = 64):
    """Triton's compiled kernel (bf16 q, kv_lora_rank 512 + rope 64)."""
    fn = mla_kernels._mla_tree_fwd_kernel
    fp8 = cache == "fp8"
    consts = dict(NUM_HEADS=heads, KV_LORA=512, ROPE=64, BLOCK_L=512, BLOCK_R=64,
                  PAGE_SIZE=page, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                  DOT_PRECISION="tf32", DOT_UPCAST=False, HAS_ACTIVE=False, MIN_TILES=8,
                  MAX_SPLITS=128, RUNTIME_SPLITS=False, KV_FP8=fp8,
                  KV_FP8_TRANSPOSED=fp8 and config.fp8_transposed)
    pointers = {**POINTERS, "KV": "*fp8e4nv" if fp8 else "*bf16"}
    sig, attrs = launch_signature(fn, consts, pointers, ALIGNED_INTS)
    return triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs),
                          target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": config.num_warps,
                                   "num_stages": config.num_stages})


def first_loop(text: str, start: str, end: str) -> str:
    """The text of the first loop: from the first line matching ``start`` to the first
    line after it matching ``end``."""
    lines = text.splitlines()
    first = next(i for i, line in enumerate(lines) if re.search(start, line))
    last = next(i for i in range(first, len(lines)) if re.search(end, lines[i]))
    return "\n".join(lines[first:last + 1])


def ttgir_facts(ttgir: str) -> dict:
    """How the unmasked KV loop's tiles reach the MMAs (its first ``scf.for``): 16-bit
    tensors written to shared memory are the probabilities (an MMA result, in an MMA
    layout) or else a KV tile's (widened) columns."""
    loop = first_loop(ttgir, r"scf\.for", r"scf\.yield")
    stored = {"probs": 0, "tile": 0}
    for rows, cols, layout in re.findall(
            r"ttg\.local_alloc %\S+ : \(tensor<(\d+)x(\d+)xb?f16, #(\w+)>", loop):
        stored["probs" if layout.startswith("mma") else "tile"] += int(rows) * int(cols) * 2
    a_operands = re.findall(r"ttng\.warp_group_dot [^\n]*?\} : (\S+)", loop)
    return {
        "async_copies": len(re.findall(r"ttg\.async_copy_global_to_local", loop)),
        "tile_loads": len(re.findall(r"tt\.load %\S+(?:, %\S+)*(?: cacheModifier = \w+)? : "
                                     r"tensor<\d+x\d+x!tt\.ptr<(?:f8E4M3FN|bf16)>", loop)),
        "widened_to_smem": stored["tile"],
        "probs_to_smem": stored["probs"],
        "wgmma_a_regs": sum(t.startswith("tensor<") for t in a_operands),
        "wgmma_a_smem": sum(t.startswith("!ttg.memdesc") for t in a_operands),
    }


def ptx_byte_loads(ptx: str) -> int:
    """``ld.shared.b8`` / ``.u8`` in the first loop of ``ptx``."""
    labels = re.findall(r"^(\$L__BB\d+_\d+):", ptx, flags=re.M)
    for label in labels:
        body = ptx.split(label + ":", 1)[1]
        back = re.search(r"bra(?:\.uni)?\s+" + re.escape(label) + ";", body)
        if back:
            return len(re.findall(r"ld\.shared(?:\.v\d)?\.[bu]8\b", body[:back.start()]))
    return 0


def sass_counts(sass: str | None, keys_per_tile: int) -> dict | None:
    """SASS instructions of the first (unmasked) KV loop per 64 keys, by kind."""
    loops = sass_loops(sass, SASS_BRANCH) if sass else []
    if not loops:
        return None
    ops = collections.Counter(
        re.sub(r"^@!?U?P\w+\s+", "", line.split("*/", 1)[1].strip()).split()[0]
        for line in loops[0])
    scale = 64 / keys_per_tile

    def total(prefixes) -> int:
        return sum(n for op, n in ops.items() if op.split(".")[0] in
                   ((prefixes,) if isinstance(prefixes, str) else prefixes))
    counts = {kind: round(total(prefixes) * scale) for kind, prefixes in SASS_KINDS.items()}
    counts["all"] = round(sum(ops.values()) * scale)
    return counts


def report(cache: str, config: MLATileConfig, arch: int, heads: int) -> dict:
    kernel = compile_variant(cache, config, arch, heads)
    name = f"{'fp8t' if config.fp8_transposed else cache} m{config.block_m}"
    return dict(name=name, arch=arch, config=config, shared=kernel.metadata.shared,
                **ptxas_report(kernel.asm["ptx"], arch),
                **ttgir_facts(kernel.asm["ttgir"]),
                byte_loads=ptx_byte_loads(kernel.asm["ptx"]),
                sass=sass_counts(sass_of(kernel.asm["cubin"]), config.block_n))


def markdown(rows: list[dict], command: str) -> str:
    lines = [
        "# MLA tree-verify kernel: what the KV loop compiles to (offline)", "",
        f"command: `{command}` (Triton {triton.__version__}; bf16 q, kv_lora_rank 512 + "
        "rope 64, page 64, 16 heads; configs from `attention_backends/mla_tree/configs.py`)",
        "",
        "Variants: `bf16` the 16-bit cache, `fp8` the fp8 cache (`KV_FP8`: the widened tile "
        "is the MMAs' B operand), `fp8t` the fp8 cache with transposed products "
        "(`KV_FP8_TRANSPOSED`: the widened tile is the A operand).", "",
        "## How the KV tiles reach the MMAs (unmasked KV loop)", "",
        "cp.async: tiles (TTGIR `async_copy_global_to_local` ops) the loop copies to shared "
        "memory asynchronously, `stages - 1` KV tiles ahead; tile loads: KV tiles loaded to "
        "registers instead; widened to "
        "smem: bytes of 16-bit tensors written to shared memory per tile; wgmma A: products "
        "taking A from registers / shared memory (`-`: mma.sync); P to smem: bytes of the "
        "16-bit probabilities written to shared memory per tile (an MMA operand); "
        "ld.shared.b8: byte loads from shared memory per tile (PTX).", "",
        "| arch | variant | block_n | warps | stages | registers | spill stores / loads (B) "
        "| shared (B) | cp.async | tile loads | widened to smem (B) | P to smem (B) "
        "| wgmma A regs / smem | ld.shared.b8 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c = r["config"]
        wgmma = (f"{r['wgmma_a_regs']} / {r['wgmma_a_smem']}"
                 if r["wgmma_a_regs"] + r["wgmma_a_smem"] else "-")
        lines.append(
            f"| sm_{r['arch']} | {r['name']} | {c.block_n} | {c.num_warps} | {c.num_stages} | "
            f"{r['registers']} | {r['spill_stores']} / {r['spill_loads']} | {r['shared']} | "
            f"{r['async_copies']} | {r['tile_loads']} | {r['widened_to_smem']} | "
            f"{r['probs_to_smem']} | {wgmma} | "
            f"{r['byte_loads']} |")
    kinds = [*SASS_KINDS, "all"]
    lines += ["", "## SASS instructions of the unmasked KV loop per 64 keys (per thread)", "",
              "F2FP: conversions (e4m3x2 -> f16x2 among them); PRMT: byte permutes; LDS: "
              "shared loads other than LDSM (ldmatrix); STS: shared stores; LDGSTS: cp.async; "
              "LDG: global loads to registers; MMA: HGMMA (wgmma) or HMMA (mma.sync); BAR: "
              "barriers; STL / LDL: spill stores / loads; all: every instruction. A tile of "
              "32 keys counts twice.", "",
              "| arch | variant | " + " | ".join(kinds) + " |",
              "|---|---|" + "---|" * len(kinds)]
    for r in rows:
        counts = r["sass"] or {}
        lines.append(f"| sm_{r['arch']} | {r['name']} | "
                     + " | ".join(str(counts.get(k, "n/a")) for k in kinds) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", type=int, nargs="+", choices=(90, 120), default=[90, 120])
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--out", help="markdown file (default: standard output)")
    args = p.parse_args(argv)
    rows = []
    for arch in args.arch:
        for cache, config in variants(arch):
            rows.append(report(cache, config, arch, args.heads))
            print(rows[-1]["name"], f"sm_{arch}", {k: v for k, v in rows[-1].items()
                                                   if k not in ("config", "name", "arch")})
    command = "python evals/kernel_structure.py " + shlex.join(argv or sys.argv[1:])
    text = markdown(rows, command.strip())
    if args.out is None:
        print(text)
    else:
        Path(args.out).write_text(text)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
