# SPDX-License-Identifier: Apache-2.0
"""The Gluon sm_90 MLA tree-verify kernel (``gluon_kernel``) compiles offline (no GPU)
and keeps its schedule: Hopper's shared memory, two warp-specialized 4-warp partitions,
no register spills in its KV loops, a full 64 x 64 ``S`` tile per warpgroup, and in the
SASS of the KV loops mbarrier hand-offs (no CTA-wide barrier) with a PV wgmma left in
flight (``WARPGROUP.DEPBAR.LE gsb0, 1``) while a KV buffer is refilled.

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

# The Gluon kernel's pointer types and the ints aligned at every launch, for
# kernel_spills.launch_signature.
_LAUNCH_TYPES = """
POINTERS = {"Q": "*bf16", "KV": "*bf16", "BlockTable": "*i32", "SeqLens": "*i32",
            "QueryStartLoc": "*i32", "AncestorBits": "*i64", "Out": "*fp32", "Lse": "*fp32"}
ALIGNED = ("stride_qt", "stride_qh", "stride_kvb", "stride_kvp", "stride_ot", "stride_oh",
           "stride_os")
"""

# The SASS also holds mbarrier try-wait retry loops (a backward branch from a stub at
# the end of the function), so only predicated backward branches count as loops here.
_COMPILE_SCRIPT = _LAUNCH_TYPES + textwrap.dedent(
    """
    import json, re, sys

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    sys.path.insert(0, "evals")
    from kernel_spills import launch_signature, ptxas_report, sass_loops, sass_of

    from vllm_ddtree.attention_backends.mla_tree import gluon_kernel as gk

    fn = gk._mla_tree_fwd_gluon_kernel


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
        loops = []
        for body in sass_loops(sass, branch=r"@!?U?P\\d\\s+BRA", min_instructions=9):
            ops = [op for op in map(classify, body) if op]
            loops.append([op for i, op in enumerate(ops) if i == 0 or op != ops[i - 1]])
        return loops


    result = []
    for page, heads, runtime in ((64, 8, False), (64, 128, False), (16, 8, False),
                                 (16, 128, False), (1, 8, False), (1, 128, False),
                                 (64, 8, True)):
        consts = dict(NUM_HEADS=heads, KV_LORA=512, ROPE=64, PAGE_SIZE=page,
                      BLOCK_M=gk.BLOCK_M, BLOCK_N=gk.BLOCK_N, RUNTIME_SPLITS=runtime)
        sig, attrs = launch_signature(fn, consts, POINTERS, ALIGNED)
        k = triton.compile(GluonASTSource(fn, sig, constexprs=consts, attrs=attrs),
                           target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": gk.NUM_WARPS})
        result.append(dict(page=page, heads=heads, runtime=runtime, shared=k.metadata.shared,
                           num_warps=k.metadata.num_warps, **ptxas_report(k.asm["ptx"]),
                           loops=main_loops(sass_of(k.asm["cubin"])),
                           warp_specialize=k.asm["ttgir"].count("ttg.warp_specialize(")))
    print(json.dumps(result))
    """
)


@pytest.fixture(scope="module")
def reports():
    return compiled_shared_memory(_COMPILE_SCRIPT)


def _kv_loops(r):
    """The two partitions' KV loops: those issuing both S (64x64) and PV (64x256)."""
    loops = [loop for loop in r["loops"] if "s" in loop and "pv" in loop]
    assert len(loops) == 2, r
    return loops


def test_fits_hopper_shared_memory_and_is_warp_specialized(reports):
    for r in reports:
        assert 0 < r["shared"] <= HOPPER_SHARED_MEMORY_BYTES, r
        assert r["warp_specialize"] == 1 and r["num_warps"] == 8, r


def test_no_register_spills_in_the_kv_loops(reports):
    for r in reports:
        assert r["registers"] <= 255, r
        if r["runtime"]:
            # The run-time split choice costs the kernel (whose registers are all in use)
            # a few spilled bytes before its loops, never inside them.
            assert r["spill_stores"] <= 16 and r["spill_loads"] <= 16, r
        else:
            assert r["spill_stores"] == 0 and r["spill_loads"] == 0, r
        assert all("spill" not in loop for loop in _kv_loops(r)), r


def test_each_warpgroup_computes_full_s_tiles(reports):
    """S = Q K^T as n=64 wgmmas (a full 64-key tile per warpgroup), never split by key
    columns over the warpgroups (n=32)."""
    for r in reports:
        for loop in _kv_loops(r):
            assert "other_mma" not in loop, loop


def test_loops_sync_by_mbarrier_and_keep_pv_in_flight(reports):
    """No CTA-wide barrier in either KV loop (hand-offs are mbarrier waits, barriers
    are per-partition), and one loop (warpgroup 1) waits for PV(b) with PV(a) still in
    flight (``wait1``), then refills a KV buffer (cp.async) before the 0-pending wait."""
    for r in reports:
        loops = _kv_loops(r)
        for loop in loops:
            assert "bar_cta" not in loop and "mbar_wait" in loop, loop
        partial = [loop for loop in loops if "wait1" in loop]
        assert len(partial) == 1, loops
        ops = partial[0]
        i = ops.index("wait1")
        assert ops[:i].count("pv") >= 2, ops  # PV(b) and PV(a) issued before the wait
        rest = ops[i + 1:]
        assert "cp_async" in rest and rest.index("cp_async") < rest.index("wait0"), ops
