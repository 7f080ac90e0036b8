# SPDX-License-Identifier: Apache-2.0
"""Registers, spills and shared memory of the MLA tree-verify kernel per tile config,
compiled offline (no GPU): Triton lowers the kernel to PTX for sm_90 / sm_120 and
Triton's own ``ptxas -v`` reports registers per thread and local-memory spills.

Spills in the KV loop cost memory traffic on every tile; the H200 measurements put
the kernel at about 0.31 of the MMA floor's rate at 128k (``evals/results/README.md``).
The compile models the JIT's specialization (aligned pointers and strides); without it
Triton does not pipeline the KV loads and the report is wrong (e.g. 2,248 B of spills
for the 64-row tile against 344 B as launched).

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

from vllm_ddtree.attention_backends.mla_tree import MLATileConfig  # noqa: E402
from vllm_ddtree.attention_backends.mla_tree import kernels as mla_kernels  # noqa: E402

POINTERS = {"Q": "*bf16", "KV": "*bf16", "BlockTable": "*i32", "SeqLens": "*i32",
            "QueryStartLoc": "*i32", "AncestorBits": "*i64", "Out": "*bf16", "Lse": "*fp32",
            "ActiveQueryLens": "*i32", "MergeBase": "*i32", "MergeCount": "*i32",
            "KVScale": "*fp32"}
# Integer arguments that are multiples of 16 at every launch (576-wide latent rows, 512-wide
# output rows); Triton specializes on that.
ALIGNED_INTS = ("stride_qt", "stride_qh", "stride_kvb", "stride_kvp", "stride_ot", "stride_os")
ARCHES = {90: ("sm_90a", "ptxas"), 120: ("sm_120a", "ptxas-blackwell")}
TRITON_BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def default_configs() -> list[MLATileConfig]:
    sys.path.insert(0, str(REPO / "evals"))
    from bench_verify_attention import sweep_configs

    extra = [MLATileConfig(block_m=32, block_n=32, num_warps=8, num_stages=3),
             MLATileConfig(block_m=16, block_n=32, num_warps=4, num_stages=3),
             MLATileConfig(block_m=32, block_n=64, num_warps=8, num_stages=2)]
    return sweep_configs() + extra


def compile_report(config: MLATileConfig, arch: int, heads: int) -> dict:
    """Registers per thread, spill bytes (stores, loads) and shared bytes of one
    config for one architecture (bf16, kv_lora_rank 512 + rope 64, page 64), and
    ``loops``: ``(MMA, STL, LDL)`` instruction counts of each SASS loop in code order
    (the first is the unmasked context loop, nearly all the time at long context; the
    second the masked tail / new-token loop), None if ``nvdisasm`` fails."""
    fn = mla_kernels._mla_tree_fwd_kernel
    consts = dict(NUM_HEADS=heads, KV_LORA=512, ROPE=64, BLOCK_L=512, BLOCK_R=64,
                  PAGE_SIZE=64, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                  DOT_PRECISION="tf32", DOT_UPCAST=False, HAS_ACTIVE=False,
                  MIN_TILES=8, MAX_SPLITS=128, RUNTIME_SPLITS=False, KV_FP8=False,
                  KV_FP8_TRANSPOSED=False)
    sig, attrs = launch_signature(fn, consts, POINTERS, ALIGNED_INTS)
    kernel = triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs),
                            target=GPUTarget("cuda", arch, 32),
                            options={"num_warps": config.num_warps,
                                     "num_stages": config.num_stages})
    sass = sass_of(kernel.asm["cubin"])
    loops = None if sass is None else [
        tuple(sum(1 for x in body if re.search(pattern, x))
              for pattern in (r"HGMMA|HMMA", r"\bSTL\b", r"\bLDL\b"))
        for body in sass_loops(sass)]
    return {**ptxas_report(kernel.asm["ptx"], arch), "shared": kernel.metadata.shared,
            "loops": loops}


# -- offline compile helpers (also used by tests/test_mla_gluon_kernel_compile.py) --------


def launch_signature(fn, consts: dict, pointers: dict, aligned_ints) -> tuple[dict, dict]:
    """``(signature, attrs)`` of ``fn`` for ``triton.compile`` as the JIT sees a real
    launch: ``pointers`` (name -> type) 16-byte aligned, ``aligned_ints`` multiples of
    16, other ints i32, ``qk_scale`` fp32, ``consts`` constexpr. Without the alignment
    Triton does not pipeline the KV loads (no cp.async), which inflates spills and
    understates shared memory."""
    sig = {n: "constexpr" if n in consts else pointers.get(n, "fp32" if n == "qk_scale"
                                                           else "i32") for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if n in pointers or n in aligned_ints}
    return sig, attrs


def ptxas_report(ptx: str, arch: int = 90) -> dict:
    """Triton's own ``ptxas -v`` on ``ptx`` for ``arch`` (90 or 120): ``registers`` per
    thread and ``spill_stores`` / ``spill_loads`` bytes."""
    gpu, exe = ARCHES[arch]
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        info = subprocess.run([str(TRITON_BIN / exe), "-v", "--gpu-name", gpu, f.name,
                               "-o", os.devnull], capture_output=True, text=True,
                              check=True).stderr
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", info)
    return {"registers": int(re.search(r"Used (\d+) registers", info).group(1)),
            "spill_stores": int(spill.group(1)), "spill_loads": int(spill.group(2))}


def sass_of(cubin: bytes) -> str | None:
    """SASS text of ``cubin`` (Triton's ``nvdisasm -c``); None if it fails."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        run = subprocess.run([str(TRITON_BIN / "nvdisasm"), "-c", f.name],
                             capture_output=True, text=True)
    return run.stdout if run.returncode == 0 else None


def sass_loops(sass: str, branch: str = r"BRA", min_instructions: int = 1) -> list[list[str]]:
    """Instruction lines of each loop of ``sass``, in code order: from a label to a
    ``branch`` (regex of the branch instruction, e.g. only predicated ones) back to it,
    at least ``min_instructions`` long (shorter ones: e.g. mbarrier retry spins)."""
    labels, instrs = {}, []
    for line in sass.splitlines():
        label = re.match(r"^\s*(\.L_x_\d+):", line)
        if label:
            labels[label.group(1)] = len(instrs)
        elif re.search(r"/\*[0-9a-f]{4,}\*/", line):
            instrs.append(line)
    loops = []
    for end, line in enumerate(instrs):
        target = re.search(branch + r"\s+`?\(?(\.L_x_\d+)", line)
        if target and labels.get(target.group(1), end) < end - (min_instructions - 1):
            loops.append(instrs[labels[target.group(1)]:end + 1])
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
