# SPDX-License-Identifier: Apache-2.0
"""The Triton beam selection (vllm_ddtree.tree.build_kernel) vs build_ddtree and the
heapq oracle build_ddtree_reference, exactly (tokens, parents, depths, score bits).

Without a GPU the kernel runs in Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1 before triton's first import); with a GPU the same cases run
compiled. Tie-heavy logits (uniform, quantized, repeated rows, exact 0 / -inf
log-probs) check that the kernel's sort keys give build_ddtree's order.
"""

import textwrap

import pytest
import torch

triton = pytest.importorskip("triton")

from kernel_testing import (  # noqa: E402
    DEVICE,
    compiled_shared_memory,
    skip_unless_kernels_run_here,
)
from test_tree import make_logits  # noqa: E402

from vllm_ddtree.tree import build_kernel as tree_build_kernel  # noqa: E402
from vllm_ddtree.tree import draft_tree as tree_mod  # noqa: E402
from vllm_ddtree.tree.build_kernel import (  # noqa: E402
    MAX_BLOCK,
    beam_plan,
    build_ddtree_fast,
    build_ddtree_triton,
)
from vllm_ddtree.tree.draft_tree import build_ddtree, build_ddtree_reference  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    skip_unless_kernels_run_here(tree_build_kernel._build_tree_kernel),
]

FIELDS = ("tokens", "parents", "depths", "scores")


def assert_same_tree(got, want, exact_scores=True):
    """Same tokens, parents and depths; scores bit for bit (the same fp32 adds, -inf
    included) or, with ``exact_scores=False``, within 4 fp32 ulps (a reference on
    another device: CUDA's and the CPU's log-softmax differ in the last bits)."""
    for name in FIELDS:
        a, b = getattr(got, name).cpu(), getattr(want, name).cpu()
        assert a.dtype == b.dtype and a.shape == b.shape, name
        if name == "scores" and not exact_scores:
            assert torch.equal(a.isinf(), b.isinf()), (name, a, b)
            finite = ~a.isinf()
            torch.testing.assert_close(a[finite], b[finite], rtol=5e-7, atol=0)
            continue
        if name == "scores":
            a, b = a.view(torch.int32), b.view(torch.int32)
        assert torch.equal(a, b), (name, a, b)


CASES = [
    # kind, (R, L, V), budget, top_k
    ("randn", (2, 15, 30), 16, None),  # L = 15, as the drafters
    ("randn", (2, 6, 60), 48, 6),
    ("randn", (4, 5, 30), 100, 3),
    ("quantized", (3, 6, 9), 40, None),
    ("uniform", (2, 4, 3), 30, None),
    ("repeated", (2, 7, 12), 50, 4),
    ("peaked", (2, 8, 20), 16, None),
    ("randn", (1, 1, 40), 7, None),  # one depth: depth 1's beam is the tree
    ("randn", (2, 15, 30), 15, 1),  # top_k 1: chains
    ("randn", (1, 3, 4), 84, None),  # every prefix (4 + 16 + 64)
]


@pytest.mark.parametrize("kind,shape,budget,top_k", CASES)
def test_kernel_equals_build_ddtree(kind, shape, budget, top_k):
    logits = make_logits(kind, shape, seed=sum(shape) + budget).to(DEVICE)
    got = build_ddtree_triton(logits, budget, top_k)
    assert got is not None
    assert_same_tree(got, build_ddtree(logits, budget, top_k))


@pytest.mark.parametrize("budget,top_k", [(16, None), (63, 4), (64, 4), (100, 3),
                                          (130, 2)])
def test_kernel_ancestor_bits_equal_the_pytorch_ones(budget, top_k):
    """``packed_bits`` (1, 2 and 3 mask words) against ``DraftTree.ancestor_bits``'
    pointer doubling on the same parents."""
    logits = make_logits("randn", (2, 8, 30), seed=budget).to(DEVICE)
    got = build_ddtree_triton(logits, budget, top_k)
    want = build_ddtree(logits, budget, top_k)
    assert_same_tree(got, want)
    want.packed_bits = None
    assert torch.equal(got.packed_bits.cpu(), want.ancestor_bits().cpu())


@pytest.mark.parametrize("force_triton", [True, False])
def test_out_buffers_are_written_in_place(force_triton):
    """``out``: row slices of larger persistent buffers (the speculator's), written by
    the launch (or copied from the PyTorch build); rows past the batch untouched."""
    logits = make_logits("quantized", (2, 6, 20), seed=7).to(DEVICE)
    tokens = torch.full((5, 24), -7, dtype=torch.int64, device=DEVICE)
    bits = torch.full((5, 25, 1), -7, dtype=torch.int64, device=DEVICE)
    out = tree_mod.DraftTree(tokens=tokens[:2], parents=tokens.clone()[:2],
                             depths=tokens.clone()[:2],
                             scores=torch.zeros(5, 24, device=DEVICE)[:2], packed_bits=bits[:2])
    got = build_ddtree_fast(logits, 24, out=out, force_triton=force_triton)
    assert got is out
    want = build_ddtree(logits, 24)
    assert_same_tree(out, want)
    assert torch.equal(bits[:2].cpu(), want.ancestor_bits().cpu())
    assert (tokens[2:] == -7).all() and (bits[2:] == -7).all()
    with pytest.raises(ValueError, match="out.packed_bits"):
        build_ddtree_triton(logits, 24, out=tree_mod.DraftTree(
            out.tokens, out.parents, out.depths, out.scores))


@pytest.mark.parametrize("kind", ["randn", "quantized", "peaked"])
def test_kernel_equals_the_heapq_reference(kind):
    logits = make_logits(kind, (2, 6, 10), seed=5)
    got = build_ddtree_triton(logits.to(DEVICE), 24)
    # The heapq oracle runs on the CPU: exact scores only when the kernel did too.
    assert_same_tree(got, build_ddtree_reference(logits, 24),
                     exact_scores=torch.device(DEVICE).type == "cpu")


def test_low_precision_logits_and_no_requests():
    logits = make_logits("randn", (2, 5, 40), seed=2).to(torch.bfloat16).to(DEVICE)
    assert_same_tree(build_ddtree_triton(logits, 24), build_ddtree(logits, 24))
    empty = build_ddtree_triton(torch.zeros(0, 8, 40, device=DEVICE), 16)
    assert empty.tokens.shape == (0, 16)


def test_the_same_plan_serves_every_batch():
    """The host tables depend on (B, k, L, device) only, and are built once."""
    beam_plan.cache_clear()
    for requests in (1, 5):
        logits = make_logits("randn", (requests, 4, 32), seed=requests).to(DEVICE)
        assert_same_tree(build_ddtree_triton(logits, 16), build_ddtree(logits, 16))
    assert beam_plan.cache_info().currsize == 1


def test_dispatch_and_fallback(monkeypatch):
    logits = make_logits("randn", (2, 4, 30), seed=3)
    calls = []
    original = tree_build_kernel.build_ddtree_triton
    monkeypatch.setattr(tree_build_kernel, "build_ddtree_triton",
                        lambda *a, **kw: calls.append(a) or original(*a, **kw))
    assert_same_tree(build_ddtree_fast(logits, 20), build_ddtree(logits, 20))
    assert not calls  # CPU tensors: the PyTorch build
    assert_same_tree(build_ddtree_fast(logits.to(DEVICE), 20, force_triton=True),
                     build_ddtree(logits, 20))
    assert len(calls) == 1
    # A budget whose blocks pass MAX_BLOCK: None from the kernel, build_ddtree instead.
    big = make_logits("randn", (1, 15, 700), seed=4).to(DEVICE)
    assert beam_plan(600, 600, 15, big.device) is None
    assert build_ddtree_triton(big, 600) is None
    assert_same_tree(build_ddtree_fast(big, 600, force_triton=True), build_ddtree(big, 600))
    assert MAX_BLOCK >= 512 * 8  # B = 512, k = 8 still fits


def test_bad_arguments_raise_like_build_ddtree():
    with pytest.raises(ValueError, match="budget"):
        build_ddtree_triton(torch.zeros(1, 2, 3, device=DEVICE), 0)
    with pytest.raises(ValueError, match="exceeds"):
        build_ddtree_triton(torch.zeros(1, 1, 3, device=DEVICE), 5)


def test_host_side_has_no_sync_once_the_plan_exists(monkeypatch):
    """Everything but the launch (which the interpreter runs on host arrays) under the
    host-sync detector: the vocabulary ranking, the scratch and output allocations and
    the launch arguments read nothing back once ``beam_plan`` is cached."""
    from vllm_ddtree.testing.sync_guard import HostSyncDetector

    logits = make_logits("randn", (3, 6, 40), seed=8).to(DEVICE)
    build_ddtree_triton(logits, 24)  # builds and caches the plan (a host-to-device copy)
    launches = []

    class Recorded:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append(grid)

    monkeypatch.setattr(tree_build_kernel, "_build_tree_kernel", Recorded())
    with HostSyncDetector() as detector:
        build_ddtree_triton(logits, 24)
    assert launches == [(3,)]
    assert detector.count() == 0, detector.report()


_COMPILE_SCRIPT = textwrap.dedent(
    """
    import json, triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from vllm_ddtree.tree.build_kernel import _build_tree_kernel as fn

    from vllm_ddtree.tree.vocab_top_k_kernel import (
        MAX_MERGE_BLOCK, _CHUNK, _chunk_top_k_kernel, _merge_top_k_kernel)

    pointers = {"LogProbs": "*fp32", "BeamScores": "*fp32", "OutScores": "*fp32",
                "Tokens": "*i64", "BeamTokens": "*i64", "OutTokens": "*i64",
                "OutParents": "*i64", "OutDepths": "*i64", "OutBits": "*i64",
                "Keys": "*i64", "OutLogProbs": "*fp32"}
    # (kernel, its constexprs, num_warps): the build at its smallest and largest block,
    # the two ranking passes at the largest blocks the launcher picks.
    configs = [(fn, dict(BLOCK_C=256, BLOCK_N=256), 4),
               (fn, dict(BLOCK_C=4096, BLOCK_N=4096), 8),
               (_chunk_top_k_kernel, dict(CHUNK=_CHUNK, K=128), 8),
               (_merge_top_k_kernel, dict(BLOCK=MAX_MERGE_BLOCK, K=128), 8)]
    result = []
    for arch in (90, 120):
        for kernel, consts, num_warps in configs:
            sig = {n: "constexpr" if n in consts else pointers.get(n, "*i32")
                   if n[0].isupper() else "i32" for n in kernel.arg_names}
            k = triton.compile(ASTSource(kernel, sig, constexprs=consts),
                               target=GPUTarget("cuda", arch, 32),
                               options={"num_warps": num_warps})
            result.append(k.metadata.shared)
    print(json.dumps(result))
    """
)


def test_kernel_compiles_for_sm90_and_sm120_within_shared_memory():
    """Compile (no GPU needed) the build kernel at its smallest and largest block and
    the vocabulary ranking at its largest, for Hopper and for sm_120 (about 99 KB of
    shared memory per block there)."""
    shared = compiled_shared_memory(_COMPILE_SCRIPT)
    assert len(shared) == 8 and max(shared) <= 99 * 1024, shared
    print(f"shared memory per config: {shared}")


def test_tree_build_benchmark_dry_run(tmp_path):
    """``evals/bench_tree_build.py`` on CPU: every variant builds ``build_ddtree``'s
    trees (it raises otherwise) and the report is written."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "evals"))
    import bench_tree_build

    out = tmp_path / "tree_build.md"
    bench_tree_build.main(["--device", DEVICE, "--requests", "2", "--vocab", "24",
                           "--budgets", "6", "--depths", "3", "--iters", "1",
                           "--out", str(out)])
    text = out.read_text()
    assert "| 2 | 24 | 6 |" in text and out.with_suffix(".png").exists()
