"""The drafter's compacted context rows of tree-decode rounds (vllm_ddtree.draft.context_rows):
which batches compact, the PyTorch compaction against a per-row loop, the one-launch
Triton compaction (in place) against the PyTorch one, and the batch copy DFlash drafts
from. Without a GPU the kernel runs in Triton's interpreter (tests/conftest.py)."""

import textwrap
from types import SimpleNamespace as NS

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from kernel_testing import (  # noqa: E402
    DEVICE,
    compiled_shared_memory,
    skip_unless_kernels_run_here,
)

from vllm_ddtree.draft import hidden_rows_kernel  # noqa: E402
from vllm_ddtree.draft.context_rows import (  # noqa: E402
    compact_path_rows_torch,
    compacted_batch,
    context_rows_per_request,
)

DEPTHS = 7  # L: c = 8 context rows a request


def tree_decode_batch(qlens, prefilling=None, drafts=None):
    qlens = np.array(qlens, dtype=np.int32)
    num_reqs = len(qlens)
    return NS(num_reqs=num_reqs, num_scheduled_tokens=qlens,
              num_draft_tokens_per_req=qlens - 1 if drafts is None else np.array(drafts),
              is_prefilling_np=np.zeros(num_reqs, bool) if prefilling is None
              else np.array(prefilling))


def test_only_batches_of_tree_decodes_longer_than_the_block_compact():
    assert context_rows_per_request(tree_decode_batch([65, 65, 65]), DEPTHS) == 8
    assert context_rows_per_request(tree_decode_batch([65, 8, 17]), DEPTHS) == 8
    # a prefill chunk anywhere in the batch: every row of it is context
    assert context_rows_per_request(tree_decode_batch([65, 65], prefilling=[0, 1]),
                                    DEPTHS) is None
    # a request whose rows are not root + drafts (a chunk without drafts)
    assert context_rows_per_request(tree_decode_batch([65, 65], drafts=[64, 0]),
                                    DEPTHS) is None
    # a truncated tree shorter than the block, or nothing to gain
    assert context_rows_per_request(tree_decode_batch([65, 5]), DEPTHS) is None
    assert context_rows_per_request(tree_decode_batch([8, 8]), DEPTHS) is None
    # no drafts scheduled at all (vLLM leaves the array None)
    batch = tree_decode_batch([65])
    batch.num_draft_tokens_per_req = None
    assert context_rows_per_request(batch, DEPTHS) is None


def random_round(qlens, accepted, hidden=10, num_tensors=3, padding=5, seed=0):
    """Aux states, walk and positions of one verified round: request r accepted
    ``accepted[r]`` nodes (sorted node rows, as a walk down one path gives)."""
    gen = torch.Generator().manual_seed(seed)
    qsl = torch.tensor([0, *np.cumsum(qlens)], dtype=torch.int32)
    src = torch.full((len(qlens), DEPTHS), -1, dtype=torch.int64)
    for r, a in enumerate(accepted):
        src[r, :a] = torch.randperm(qlens[r] - 1, generator=gen)[:a].sort().values + 1
    num_rows = int(qsl[-1]) + padding
    xs = [torch.randn(num_rows, hidden, generator=gen).to(torch.bfloat16)
          for _ in range(num_tensors)]
    seqs = torch.randint(100, 5000, (len(qlens),), generator=gen)
    positions = torch.cat([s + torch.arange(q) for s, q in zip(seqs, qlens, strict=True)]
                          + [torch.zeros(padding, dtype=torch.int64)])
    num_sampled = torch.tensor(accepted, dtype=torch.int32) + 1
    return xs, qsl, src, positions, num_sampled


def loop_compaction(xs, qsl, src, positions, num_sampled, rows):
    """Per-row reference: the old tensors read, the new ones written row by row."""
    old = [x.clone() for x in xs]
    new = [x.clone() for x in xs]
    out_pos, out_rej = [], []
    for r in range(src.shape[0]):
        start = int(qsl[r])
        for k in range(rows):
            node = int(src[r, k - 1]) if 1 <= k <= src.shape[1] else -1
            row = start + (node if node >= 0 else k)
            for o, n in zip(old, new, strict=True):
                n[r * rows + k] = o[row]
            out_pos.append(int(positions[start + k]))
        out_rej.append(rows - int(num_sampled[r]))
    return new, out_pos, out_rej


CASES = [  # (qlens, accepted)
    ([65], [7]),
    ([65, 65, 65], [0, 7, 3]),
    ([65, 9, 17, 8], [2, 7, 5, 7]),  # uneven trees, one exactly c rows
    ([9] * 10, [7, 0, 7, 1, 7, 7, 2, 7, 7, 4]),  # destinations inside earlier requests
]


@pytest.mark.parametrize("qlens,accepted", CASES)
def test_pytorch_compaction_equals_the_row_loop(qlens, accepted):
    xs, qsl, src, positions, num_sampled = random_round(qlens, accepted)
    want, want_pos, want_rej = loop_compaction(xs, qsl, src, positions, num_sampled, 8)
    out_pos = torch.full((40 * 8,), -7, dtype=torch.int64)
    out_rej = torch.full((40,), -7, dtype=torch.int32)
    compact_path_rows_torch(xs, qsl, src, positions, num_sampled, 8, out_pos, out_rej)
    count = len(qlens) * 8
    for got, w in zip(xs, want, strict=True):
        assert torch.equal(got, w)
    assert out_pos[:count].tolist() == want_pos and out_rej[:len(qlens)].tolist() == want_rej
    assert (out_pos[count:] == -7).all() and (out_rej[len(qlens):] == -7).all()
    # the path landed at rows r * c .. r * c + a_r, rows past the batch untouched
    assert torch.equal(xs[0][count:], want[0][count:])


needs_kernel = skip_unless_kernels_run_here(hidden_rows_kernel._compact_path_rows_kernel)


@needs_kernel
@pytest.mark.parametrize("num_tensors,block_h", [(3, 4), (5, 128)])
@pytest.mark.parametrize("qlens,accepted", CASES)
def test_triton_compaction_in_place_equals_the_pytorch_one(qlens, accepted, num_tensors,
                                                           block_h):
    """Bit-equal rows for every tensor (more than one launch of four for five tensors),
    positions and rejected counts; request 9's destination rows hold request 8's
    sources, read before they are written."""
    from vllm_ddtree.draft.hidden_rows_kernel import compact_path_rows_triton

    xs, qsl, src, positions, num_sampled = random_round(qlens, accepted,
                                                        num_tensors=num_tensors)
    want = [x.clone() for x in xs]
    want_pos = torch.zeros(40 * 8, dtype=torch.int64)
    want_rej = torch.zeros(40, dtype=torch.int32)
    compact_path_rows_torch(want, qsl, src, positions, num_sampled, 8, want_pos, want_rej)
    got = [x.clone().to(DEVICE) for x in xs]
    got_pos = torch.zeros(40 * 8, dtype=torch.int64, device=DEVICE)
    got_rej = torch.zeros(40, dtype=torch.int32, device=DEVICE)
    assert compact_path_rows_triton(got, qsl.to(DEVICE), src.to(DEVICE),
                                    positions.to(DEVICE), num_sampled.to(DEVICE), 8,
                                    got_pos, got_rej, block_h=block_h)
    for g, w, x in zip(got, want, xs, strict=True):
        assert torch.equal(g.cpu(), w)
        assert not torch.equal(g.cpu(), x)  # rows did move
    assert torch.equal(got_pos.cpu(), want_pos) and torch.equal(got_rej.cpu(), want_rej)
    # tensors of another layout, or aliased ones, are refused (PyTorch path)
    assert not compact_path_rows_triton([got[0], got[0][:, :4]], qsl.to(DEVICE),
                                        src.to(DEVICE), positions.to(DEVICE),
                                        num_sampled.to(DEVICE), 8, got_pos, got_rej)
    assert not compact_path_rows_triton([got[0], got[0]], qsl.to(DEVICE), src.to(DEVICE),
                                        positions.to(DEVICE), num_sampled.to(DEVICE), 8,
                                        got_pos, got_rej)


_COMPILE_SCRIPT = textwrap.dedent(
    """
    import json
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from vllm_ddtree.draft.hidden_rows_kernel import _compact_path_rows_kernel as fn

    result = []
    for arch in (90, 120):
        consts = dict(NUM=4, BLOCK_C=8, BLOCK_H=128)
        types = {"qsl_ptr": "*i32", "src_ptr": "*i64", "positions_ptr": "*i64",
                 "num_sampled_ptr": "*i32", "out_positions_ptr": "*i64",
                 "out_num_rejected_ptr": "*i32"}
        sig = {n: "constexpr" if n in consts else types.get(n, "*bf16")
               if n.endswith("_ptr") else "i32" for n in fn.arg_names}
        k = triton.compile(ASTSource(fn, sig, constexprs=consts),
                           target=GPUTarget("cuda", arch, 32), options={"num_warps": 4})
        result.append(k.metadata.shared)
    print(json.dumps(result))
    """
)


def test_kernel_compiles_for_sm90_and_sm120():
    shared = compiled_shared_memory(_COMPILE_SCRIPT)
    assert len(shared) == 2 and max(shared) <= 99 * 1024, shared


def test_compacted_batch_holds_c_rows_a_request_and_leaves_the_original():
    batch = tree_decode_batch([65, 65, 65])
    batch.num_tokens, batch.num_tokens_after_padding = 195, 200
    batch.query_start_loc = torch.tensor([0, 65, 130, 195, 195], dtype=torch.int32)
    batch.query_start_loc_np = batch.query_start_loc.numpy()
    batch.positions = torch.arange(200)
    batch.idx_mapping = torch.tensor([3, 0, 1], dtype=torch.int32)
    qsl = 8 * torch.arange(9, dtype=torch.int32)
    positions = torch.arange(64) + 1000
    proxy = compacted_batch(batch, 8, qsl, positions)
    assert proxy.num_tokens == proxy.num_tokens_after_padding == 24
    assert proxy.num_scheduled_tokens.tolist() == [8, 8, 8]
    assert proxy.query_start_loc.tolist() == [0, 8, 16, 24]
    assert proxy.query_start_loc_np.tolist() == [0, 8, 16, 24]
    assert torch.equal(proxy.positions, positions[:24])
    assert proxy.idx_mapping is batch.idx_mapping and proxy.num_reqs == 3
    assert batch.num_tokens == 195 and batch.num_scheduled_tokens.tolist() == [65] * 3
