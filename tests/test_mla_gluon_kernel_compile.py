# SPDX-License-Identifier: Apache-2.0
"""The Gluon sm_90 MLA tree-verify kernel compiles offline (no GPU) and keeps its
pipeline: Hopper's shared memory, no register spills, and in the SASS of the KV loop
an async wgmma wait that leaves MMA groups in flight (``WARPGROUP.DEPBAR.LE gsb0, N``
with ``N > 0``, after the ``S = Q K^T`` wgmmas were issued behind ``O += P V``).

The compile runs in a subprocess (tests/conftest.py sets TRITON_INTERPRET=1 on CPU
machines) with the alignment the JIT sees at a real launch (16-byte aligned pointers,
strides that are multiples of 16), as ``evals/kernel_spills.py`` does.
"""

import textwrap

import pytest

pytest.importorskip("triton")
pytest.importorskip("triton.experimental.gluon")

from kernel_testing import compiled_shared_memory  # noqa: E402

HOPPER_SHARED_MEMORY_BYTES = 227 * 1024

_COMPILE_SCRIPT = textwrap.dedent(
    """
    import json, os, re, subprocess, tempfile
    from pathlib import Path

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from attention_backends.mla_tree import gluon_kernels as gk

    BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    fn = gk._mla_tree_fwd_gluon_kernel
    aligned = ("stride_qt", "stride_qh", "stride_kvb", "stride_kvp", "stride_ot",
               "stride_oh", "stride_os")


    def sass_loops(sass):
        # (label, body lines) of each loop: a label to a later branch back to it.
        labels, instrs = {}, []
        for line in sass.splitlines():
            m = re.match(r"^\\s*(\\.L_x_\\d+):", line)
            if m:
                labels[m.group(1)] = len(instrs)
            elif re.search(r"/\\*[0-9a-f]{4,}\\*/", line):
                instrs.append(line)
        loops = []
        for end, line in enumerate(instrs):
            t = re.search(r"BRA\\s+`?\\(?(\\.L_x_\\d+)", line)
            if t and labels.get(t.group(1), end) < end:
                loops.append(instrs[labels[t.group(1)]:end + 1])
        return loops


    result = []
    for page, heads, dt in ((64, 8, "bf16"), (64, 128, "bf16"), (16, 8, "bf16"),
                            (1, 16, "fp16")):
        ptrs = {"Q": "*" + dt, "KV": "*" + dt, "BlockTable": "*i32", "SeqLens": "*i32",
                "QueryStartLoc": "*i32", "AncestorBits": "*i64", "Out": "*fp32",
                "Lse": "*fp32"}
        consts = dict(NUM_HEADS=heads, KV_LORA=512, ROPE=64, PAGE_SIZE=page,
                      BLOCK_M=gk.BLOCK_M, BLOCK_N=gk.BLOCK_N)
        sig = {n: "constexpr" if n in consts else
               ptrs.get(n, "fp32" if n == "qk_scale" else "i32") for n in fn.arg_names}
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
                 if n in ptrs or n in aligned}
        k = triton.compile(GluonASTSource(fn, sig, constexprs=consts, attrs=attrs),
                           target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": gk.NUM_WARPS})
        with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
            f.write(k.asm["ptx"])
            f.flush()
            info = subprocess.run([str(BIN / "ptxas"), "-v", "--gpu-name", "sm_90a", f.name,
                                   "-o", os.devnull], capture_output=True, text=True,
                                  check=True).stderr
        regs = int(re.search(r"Used (\\d+) registers", info).group(1))
        spill = re.search(r"(\\d+) bytes spill stores, (\\d+) bytes spill loads", info)
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(k.asm["cubin"])
            f.flush()
            sass = subprocess.run([str(BIN / "nvdisasm"), "-c", f.name], capture_output=True,
                                  text=True, check=True).stdout
        loops = []
        for body in sass_loops(sass):
            ops = []
            for line in body:
                if "HGMMA.64x256" in line:
                    ops.append("pv")
                elif "HGMMA.64x32" in line:
                    ops.append("s")
                elif "WARPGROUP.DEPBAR" in line:
                    ops.append("wait" + re.search(r"0x([0-9a-f]+)", line).group(1))
                elif re.search(r"\\b(STL|LDL)\\b", line):
                    ops.append("spill")
            loops.append([op for i, op in enumerate(ops) if i == 0 or op != ops[i - 1]])
        result.append(dict(page=page, heads=heads, dtype=dt, shared=k.metadata.shared,
                           registers=regs, spill_stores=int(spill.group(1)),
                           spill_loads=int(spill.group(2)), loops=loops,
                           ttgir_async=k.asm["ttgir"].count("isAsync = true")))
    print(json.dumps(result))
    """
)


@pytest.fixture(scope="module")
def reports():
    return compiled_shared_memory(_COMPILE_SCRIPT)


def test_fits_hopper_shared_memory(reports):
    for r in reports:
        assert 0 < r["shared"] <= HOPPER_SHARED_MEMORY_BYTES, r


def test_no_register_spills(reports):
    for r in reports:
        assert r["registers"] <= 255, r
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, r
        assert all("spill" not in loop for loop in r["loops"]), r


def test_kv_loop_keeps_wgmma_in_flight(reports):
    """The KV loop issues PV(j), then S(j+1), then waits with S(j+1) (2 groups: nope
    and rope) still in flight; only then a 0-pending wait (softmax of j+1)."""
    for r in reports:
        assert r["ttgir_async"] >= 5, r  # S tile 0 (2), loop PV + S (3), last PV
        kv_loops = [loop for loop in r["loops"] if "pv" in loop and "s" in loop]
        assert len(kv_loops) == 1, r
        ops = kv_loops[0]
        pv, s = ops.index("pv"), ops.index("s")
        waits = [(i, op) for i, op in enumerate(ops) if op.startswith("wait")]
        partial = [i for i, op in waits if op != "wait0"]
        assert pv < s and partial and partial[0] > s, ops
        # No 0-pending wait between issuing PV(j) and the partial wait.
        assert all(op != "wait0" for i, op in waits if i < partial[0]), ops
