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


# v2 (gluon_kernels_v2): warp-specialized seesaw. Its SASS also holds mbarrier try-wait
# retry loops (a backward branch from a stub at the end of the function), so only
# predicated backward branches count as loops here.
_COMPILE_SCRIPT_V2 = textwrap.dedent(
    """
    import json, os, re, subprocess, tempfile
    from pathlib import Path

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from attention_backends.mla_tree import gluon_kernels as gk
    from attention_backends.mla_tree import gluon_kernels_v2 as gk2

    BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    fn = gk2._mla_tree_fwd_gluon_v2_kernel
    aligned = ("stride_qt", "stride_qh", "stride_kvb", "stride_kvp", "stride_ot",
               "stride_oh", "stride_os")


    def classify(line):
        if "HGMMA.64x256" in line:
            return "pv"
        if "HGMMA.64x64" in line:
            return "s"
        if "HGMMA" in line:
            return "other_mma"
        if "WARPGROUP.DEPBAR" in line:
            return "wait" + re.search(r"0x([0-9a-f]+)", line).group(1)
        if re.search(r"\\b(STL|LDL)\\b", line):
            return "spill"
        if re.search(r"\\bBAR\\.SYNC", line):
            # "BAR.SYNC id, count" is a named (partition) barrier; without a count the
            # whole CTA.
            return "bar" if re.search(r"BAR\\.SYNC\\S*\\s+[^,;]+,\\s*[^;]+;", line) else "bar_cta"
        if "SYNCS.PHASECHK" in line:
            return "mbar_wait"
        if "LDGSTS" in line:
            return "cp_async"
        return None


    def main_loops(sass):
        labels, instrs = {}, []
        for line in sass.splitlines():
            m = re.match(r"^\\s*(\\.L_x_\\d+):", line)
            if m:
                labels[m.group(1)] = len(instrs)
            elif re.search(r"/\\*[0-9a-f]{4,}\\*/", line):
                instrs.append(line)
        loops = []
        for end, line in enumerate(instrs):
            t = re.search(r"@!?U?P\\d\\s+BRA\\s+`?\\(?(\\.L_x_\\d+)", line)
            if t and labels.get(t.group(1), end) < end - 8:
                ops = [classify(x) for x in instrs[labels[t.group(1)]:end + 1]]
                ops = [op for op in ops if op]
                loops.append([op for i, op in enumerate(ops) if i == 0 or op != ops[i - 1]])
        return loops


    result = []
    for page, heads in ((64, 8), (64, 128), (16, 8), (16, 128), (1, 8), (1, 128)):
        ptrs = {"Q": "*bf16", "KV": "*bf16", "BlockTable": "*i32", "SeqLens": "*i32",
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
                           options={"num_warps": gk2.NUM_WARPS})
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
        result.append(dict(page=page, heads=heads, shared=k.metadata.shared,
                           num_warps=k.metadata.num_warps, registers=regs,
                           spill_stores=int(spill.group(1)), spill_loads=int(spill.group(2)),
                           loops=main_loops(sass),
                           warp_specialize=k.asm["ttgir"].count("ttg.warp_specialize(")))
    print(json.dumps(result))
    """
)


@pytest.fixture(scope="module")
def reports_v2():
    return compiled_shared_memory(_COMPILE_SCRIPT_V2)


def _v2_kv_loops(r):
    """The two partitions' KV loops: those issuing both S (64x64) and PV (64x256)."""
    loops = [loop for loop in r["loops"] if "s" in loop and "pv" in loop]
    assert len(loops) == 2, r
    return loops


def test_v2_fits_hopper_shared_memory_and_is_warp_specialized(reports_v2):
    for r in reports_v2:
        assert 0 < r["shared"] <= HOPPER_SHARED_MEMORY_BYTES, r
        assert r["warp_specialize"] == 1 and r["num_warps"] == 8, r


def test_v2_no_register_spills_in_the_kv_loops(reports_v2):
    for r in reports_v2:
        assert r["registers"] <= 255, r
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, r
        assert all("spill" not in loop for loop in _v2_kv_loops(r)), r


def test_v2_each_warpgroup_computes_full_s_tiles(reports_v2):
    """S = Q K^T as n=64 wgmmas (a full 64-key tile per warpgroup), never v1's n=32."""
    for r in reports_v2:
        for loop in _v2_kv_loops(r):
            assert "other_mma" not in loop, loop


def test_v2_loops_sync_by_mbarrier_and_keep_pv_in_flight(reports_v2):
    """No CTA-wide barrier in either KV loop (hand-offs are mbarrier waits, barriers
    are per-partition), and one loop (warpgroup 1) waits for PV(b) with PV(a) still in
    flight (``wait1``), then refills a KV buffer (cp.async) before the 0-pending wait."""
    for r in reports_v2:
        loops = _v2_kv_loops(r)
        for loop in loops:
            assert "bar_cta" not in loop and "mbar_wait" in loop, loop
        partial = [loop for loop in loops if "wait1" in loop]
        assert len(partial) == 1, loops
        ops = partial[0]
        i = ops.index("wait1")
        assert ops[:i].count("pv") >= 2, ops  # PV(b) and PV(a) issued before the wait
        rest = ops[i + 1:]
        assert "cp_async" in rest and rest.index("cp_async") < rest.index("wait0"), ops
