# SPDX-License-Identifier: Apache-2.0
"""Registers, spills and shared memory of the MLA tree-verify kernel per tile config,
compiled offline (no GPU): Triton lowers the kernel to PTX for sm_90 / sm_120 and
Triton's own ``ptxas -v`` reports registers per thread and local-memory spills.

Spills in the KV loop cost memory traffic on every tile; the H200 measurements put
the kernel at about 0.31 of the MMA floor's rate at 128k (``evals/results/README.md``).
The compile models the JIT's specialization (aligned pointers and strides); without it
Triton does not pipeline the KV loads and the report is wrong (it was until
2026-11-30: 2,248 B of spills for the 64-row tile against 344 B as launched).

    python evals/kernel_spills.py                     # the default + sweep configs
    python evals/kernel_spills.py --heads 8 64 --out evals/results/mla_kernel_spills.md
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compile for real (no GPU needed)

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from attention_backends.mla_tree import MLATileConfig  # noqa: E402
from attention_backends.mla_tree import kernels as mla_kernels  # noqa: E402

POINTERS = {"Q": "*bf16", "KV": "*bf16", "BlockTable": "*i32", "SeqLens": "*i32",
            "QueryStartLoc": "*i32", "AncestorBits": "*i64", "Out": "*bf16", "Lse": "*fp32",
            "ActiveQueryLens": "*i32", "MergeBase": "*i32", "MergeCount": "*i32"}
# Integer arguments that are multiples of 16 at every launch (576-wide latent rows, 512-wide
# output rows); Triton specializes on that.
ALIGNED_INTS = ("stride_qt", "stride_qh", "stride_kvb", "stride_kvp", "stride_ot", "stride_os")
ARCHES = {90: ("sm_90a", "ptxas"), 120: ("sm_120a", "ptxas-blackwell")}


def default_configs() -> list[MLATileConfig]:
    sys.path.insert(0, str(REPO / "evals"))
    from bench_verify_attention import sweep_configs

    extra = [MLATileConfig(block_m=32, block_n=32, num_warps=8, num_stages=3),
             MLATileConfig(block_m=16, block_n=32, num_warps=4, num_stages=3),
             MLATileConfig(block_m=32, block_n=64, num_warps=8, num_stages=2)]
    return sweep_configs() + extra


def compile_report(config: MLATileConfig, arch: int, heads: int) -> dict:
    """Registers per thread, spill bytes (stores, loads) and shared bytes of one
    config for one architecture (bf16, kv_lora_rank 512 + rope 64, page 64)."""
    fn = mla_kernels._mla_tree_fwd_kernel
    consts = dict(NUM_HEADS=heads, KV_LORA=512, ROPE=64, BLOCK_L=512, BLOCK_R=64,
                  PAGE_SIZE=64, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                  DOT_PRECISION="tf32", DOT_UPCAST=False, HAS_ACTIVE=False,
                  MIN_TILES=8, MAX_SPLITS=128)
    sig = {n: "constexpr" if n in consts else POINTERS.get(n, "fp32" if n == "qk_scale"
                                                           else "i32") for n in fn.arg_names}
    # What Triton's JIT knows at a real launch: 16-byte aligned pointers and strides that
    # are multiples of 16. Without it the KV tiles are not software-pipelined (no
    # cp.async: every tile goes through registers), which inflates the spills and
    # understates shared memory.
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if n in POINTERS or n in ALIGNED_INTS}
    kernel = triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs),
                            target=GPUTarget("cuda", arch, 32),
                            options={"num_warps": config.num_warps,
                                     "num_stages": config.num_stages})
    gpu, exe = ARCHES[arch]
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / exe
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as ptx:
        ptx.write(kernel.asm["ptx"])
        ptx.flush()
        info = subprocess.run([str(ptxas), "-v", "--gpu-name", gpu, ptx.name, "-o", os.devnull],
                              capture_output=True, text=True, check=True).stderr
    registers = spill_stores = spill_loads = None
    for line in info.splitlines():
        if "Used" in line and "registers" in line:
            registers = int(line.split("Used")[1].split("registers")[0])
        if "spill stores" in line:
            parts = line.replace(",", "").split()
            spill_stores = int(parts[parts.index("spill") - 2])
            spill_loads = int(parts[len(parts) - 4])
    return {"registers": registers, "spill_stores": spill_stores,
            "spill_loads": spill_loads, "shared": kernel.metadata.shared,
            "loops": loop_spills(kernel.asm["cubin"])}


def loop_spills(cubin: bytes) -> list[tuple[int, int, int]] | None:
    """``(MMA, STL, LDL)`` instruction counts of each loop of the SASS, in code order
    (a loop: the instructions from a label to a branch back to it): where the spills
    sit. For this kernel the first loop is the unmasked context loop (nearly all the
    time at long context), the second the masked tail / new-token loop. None if
    ``nvdisasm`` fails."""
    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        run = subprocess.run([str(nvdisasm), "-c", f.name], capture_output=True, text=True)
    if run.returncode != 0:
        return None
    labels, instrs = {}, []
    for line in run.stdout.splitlines():
        label = re.match(r"^\s*(\.L_x_\d+):", line)
        if label:
            labels[label.group(1)] = len(instrs)
        elif re.search(r"/\*[0-9a-f]{4,}\*/", line):
            instrs.append(line)
    loops = []
    for end, line in enumerate(instrs):
        target = re.search(r"BRA\s+`?\(?(\.L_x_\d+)", line)
        if target and labels.get(target.group(1), end) < end:
            body = instrs[labels[target.group(1)]:end + 1]
            loops.append(tuple(sum(1 for x in body if re.search(pattern, x))
                               for pattern in (r"HGMMA|HMMA", r"\bSTL\b", r"\bLDL\b")))
    return loops


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", nargs="+", type=int, default=[8])
    p.add_argument("--out", default=str(REPO / "evals" / "results" / "mla_kernel_spills.md"))
    args = p.parse_args(argv)
    lines = ["# MLA tree-verify kernel: registers and spills per tile config (offline)", "",
             f"command: `python evals/kernel_spills.py {shlex.join(argv or sys.argv[1:])}`",
             f"(Triton {triton.__version__}, its ptxas -v; bf16, kv_lora 512 + rope 64, "
             "page 64)", "",
             "Spill instructions by loop (SASS, `nvdisasm`): *KV loop* is the unmasked "
             "context loop (nearly all the time at long context), *tail loop* the masked "
             "one over the last partial tile and the new tokens; `STL / LDL` = spill "
             "stores / loads in the loop body.", "",
             "| heads | arch | block_m | block_n | warps | stages | registers | spill "
             "stores (B/thread) | spill loads | shared (B) | KV loop STL / LDL | tail loop "
             "STL / LDL |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for heads in args.heads:
        for config in default_configs():
            for arch in ARCHES:
                try:
                    r = compile_report(config, arch, heads)
                except Exception as e:  # a config Triton cannot lower for this arch
                    print(f"{config} sm_{arch}: {str(e).splitlines()[0][:120]}")
                    continue
                loops = r["loops"] or []
                per_loop = [f"{st} / {ld}" for _, st, ld in loops[:2]]
                per_loop += ["n/a"] * (2 - len(per_loop))
                lines.append(f"| {heads} | sm_{arch} | {config.block_m} | {config.block_n} | "
                             f"{config.num_warps} | {config.num_stages} | {r['registers']} | "
                             f"{r['spill_stores']} | {r['spill_loads']} | {r['shared']} | "
                             f"{per_loop[0]} | {per_loop[1]} |")
                print(lines[-1])
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
