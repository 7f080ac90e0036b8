# SPDX-License-Identifier: Apache-2.0
"""DFlash's draft inputs for every drafter KV-cache group in one launch
(``vllm_ddtree.draft.inputs_kernel``) against vLLM's ``prepare_dflash_inputs`` called
once per group, exactly: every output buffer (pre-filled with garbage) bit-equal, for
one and three groups of different kernel block sizes and block tables, tree-decode
batches, a chunked-prefill request, CUDA-graph padding, both sampling layouts.

Without a GPU both kernels run in Triton's interpreter (tests/conftest.py); vLLM's
module is re-executed with the real ``triton`` for that (on CPU vLLM swaps in a
placeholder)."""

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

from vllm_ddtree.draft import inputs_kernel as dflash_inputs_kernel  # noqa: E402
from vllm_ddtree.draft.inputs_kernel import (  # noqa: E402
    MAX_GROUPS,
    prepare_dflash_inputs_groups,
)

pytestmark = skip_unless_kernels_run_here(
    dflash_inputs_kernel._prepare_dflash_inputs_groups_kernel
)

GARBAGE = -12345
MAX_REQS, MAX_TOKENS, MAX_MODEL_LEN = 6, 1024, 4096
NUM_ALL_GROUPS = 5  # rows of BlockTables.slot_mappings (target groups included)
DRAFT_TOKEN_ID = 151_000
TREE_Q = 1 + 64  # a tree verify's rows per request


def vllm_prepare_dflash_inputs():
    """vLLM's ``prepare_dflash_inputs``, runnable here: on CPU its module sees vLLM's
    triton placeholder, so a fresh copy runs with the real package (interpreter)."""
    import vllm.triton_utils as placeholder

    if placeholder.HAS_TRITON:
        from vllm.v1.worker.gpu.spec_decode.dflash.speculator import prepare_dflash_inputs

        return prepare_dflash_inputs
    import importlib.util
    import sys
    import types

    import triton

    name = "vllm.v1.worker.gpu.spec_decode.dflash.speculator"
    real = types.ModuleType("vllm.triton_utils")
    real.__dict__.update(placeholder.__dict__)
    real.triton, real.tl, real.HAS_TRITON = triton, triton.language, True
    saved = sys.modules["vllm.triton_utils"]
    try:
        sys.modules["vllm.triton_utils"] = real
        spec = importlib.util.find_spec(name)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.modules["vllm.triton_utils"] = saved
    return module.prepare_dflash_inputs


@pytest.fixture(scope="module")
def vllm_prepare():
    return vllm_prepare_dflash_inputs()


def make_case(kinds, block_sizes, sample_from_anchor, seed):
    """Inputs of one round: requests of the given kinds (``tree``: 65 rows, some
    rejected; ``prefill``: a 300-token chunk, nothing sampled; ``edge``: a tree near
    max_model_len, whose query positions and block numbers clamp), G block tables."""
    gen = torch.Generator().manual_seed(seed)
    steps = 15
    num_query = steps if sample_from_anchor else 1 + steps  # as DSpark / DFlash set it
    qlens = [{"tree": TREE_Q, "edge": TREE_Q, "prefill": 300}[k] for k in kinds]
    num_reqs = len(kinds)
    idx = torch.randperm(MAX_REQS, generator=gen)[:num_reqs].int()
    positions, sampled = [], []
    for kind, q in zip(kinds, qlens, strict=True):
        start = MAX_MODEL_LEN - 40 if kind == "edge" else int(torch.randint(0, 3000, (1,),
                                                                            generator=gen))
        positions.append(start + torch.arange(q))
        sampled.append(0 if kind == "prefill" else int(torch.randint(1, q + 1, (1,),
                                                                     generator=gen)))
    num_tokens = sum(qlens)
    target_positions = torch.cat([*positions, torch.full((7,), 77)]).long()  # + padding
    num_sampled = torch.tensor(sampled, dtype=torch.int32)
    num_rejected = torch.tensor([0 if s == 0 else q - s for q, s in zip(qlens, sampled,
                                                                        strict=True)],
                                dtype=torch.int32)
    qsl = torch.tensor([0, *np.cumsum(qlens)], dtype=torch.int32)
    block_tables = [
        torch.randint(0, 50_000, (MAX_REQS, -(-MAX_MODEL_LEN // bs)), dtype=torch.int32,
                      generator=gen)
        for bs in block_sizes
    ]
    inputs = dict(
        input_batch=NS(positions=target_positions, query_start_loc=qsl, idx_mapping=idx,
                       num_reqs=num_reqs, num_scheduled_tokens=np.array(qlens, np.int32)),
        num_sampled=num_sampled, num_rejected=num_rejected,
        last_sampled=torch.randint(0, 150_000, (MAX_REQS, 1), generator=gen),
        next_prefill_tokens=torch.randint(0, 150_000, (MAX_REQS,), dtype=torch.int32,
                                          generator=gen),
        parallel_drafting_token_id=DRAFT_TOKEN_ID, num_query_per_req=num_query,
        num_speculative_steps=steps, max_num_reqs=MAX_REQS, max_num_tokens=MAX_TOKENS,
        max_model_len=MAX_MODEL_LEN, sample_from_anchor=sample_from_anchor,
    )
    assert num_tokens <= MAX_TOKENS
    return inputs, block_tables


def garbage_outputs(num_groups, steps, num_rows):
    full = lambda n, dtype: torch.full((n,), GARBAGE, dtype=dtype, device=DEVICE)  # noqa: E731
    return dict(
        input_ids=full(MAX_TOKENS, torch.int32), positions=full(MAX_TOKENS, torch.int64),
        query_start_loc=full(MAX_REQS + 1, torch.int32),
        seq_lens=full(MAX_REQS, torch.int32),
        query_slots=torch.full((num_rows, MAX_TOKENS), GARBAGE, dtype=torch.int64,
                               device=DEVICE),
        context_positions=full(MAX_TOKENS, torch.int64),
        context_slots=torch.full((num_groups + 1, MAX_TOKENS), GARBAGE, dtype=torch.int64,
                                 device=DEVICE),
        sample_indices=full(MAX_REQS * steps, torch.int64),
        sample_pos=full(MAX_REQS * steps, torch.int64),
        sample_idx_mapping=full(MAX_REQS * steps, torch.int32),
    )


def to_device(inputs, block_tables):
    inputs = {k: v.to(DEVICE) if torch.is_tensor(v) else v for k, v in inputs.items()}
    batch = inputs["input_batch"]
    inputs["input_batch"] = NS(**{k: v.to(DEVICE) if torch.is_tensor(v) else v
                                  for k, v in vars(batch).items()})
    return inputs, [bt.to(DEVICE) for bt in block_tables]


def buffers_of(out):
    return NS(input_ids=out["input_ids"], positions=out["positions"],
              query_start_loc=out["query_start_loc"], seq_lens=out["seq_lens"])


def run_vllm(prepare, inputs, block_tables, block_sizes, rows, num_rows=NUM_ALL_GROUPS):
    out = garbage_outputs(len(block_tables), inputs["num_speculative_steps"], num_rows)
    for i, gid in enumerate(rows):  # DFlashSpeculator.propose's loop
        prepare(buffers_of(out), out["query_slots"][gid], out["context_positions"],
                out["context_slots"][i], out["sample_indices"], out["sample_pos"],
                out["sample_idx_mapping"], inputs["input_batch"], inputs["num_sampled"],
                inputs["num_rejected"], inputs["last_sampled"],
                inputs["next_prefill_tokens"], block_tables[i], block_sizes[i],
                inputs["parallel_drafting_token_id"], inputs["num_query_per_req"],
                inputs["num_speculative_steps"], inputs["max_num_reqs"],
                inputs["max_num_tokens"], inputs["max_model_len"],
                inputs["sample_from_anchor"])
    return out


def run_ours(inputs, block_tables, block_sizes, rows, num_rows=NUM_ALL_GROUPS):
    out = garbage_outputs(len(block_tables), inputs["num_speculative_steps"], num_rows)
    done = prepare_dflash_inputs_groups(
        buffers_of(out), out["query_slots"], rows, out["context_positions"],
        out["context_slots"], out["sample_indices"], out["sample_pos"],
        out["sample_idx_mapping"], inputs["input_batch"], inputs["num_sampled"],
        inputs["num_rejected"], inputs["last_sampled"], inputs["next_prefill_tokens"],
        block_tables, block_sizes, inputs["parallel_drafting_token_id"],
        inputs["num_query_per_req"], inputs["num_speculative_steps"],
        inputs["max_num_reqs"], inputs["max_num_tokens"], inputs["max_model_len"],
        sample_from_anchor=inputs["sample_from_anchor"])
    return done, out


GROUPS = {
    "one": ([16], [0]),
    "three": ([16, 64, 32], [1, 3, 4]),  # non-contiguous group ids
}
BATCHES = {
    "trees": ("tree", "tree", "tree"),  # num_reqs < max_num_reqs: padding
    "mixed": ("tree", "prefill", "edge", "tree"),
    "full": ("tree",) * MAX_REQS,
}


# Entries per padding program: the module's (one chunk here) and a small one, so that
# several programs share the padding and its chunks end inside each padded buffer.
PAD_BLOCKS = (dflash_inputs_kernel._PAD_BLOCK, 16)


@pytest.mark.parametrize("pad_block", PAD_BLOCKS)
@pytest.mark.parametrize("sample_from_anchor", [False, True])
@pytest.mark.parametrize("batch", sorted(BATCHES))
@pytest.mark.parametrize("groups", sorted(GROUPS))
def test_one_launch_equals_vllms_per_group_calls(vllm_prepare, monkeypatch, groups, batch,
                                                 sample_from_anchor, pad_block):
    monkeypatch.setattr(dflash_inputs_kernel, "_PAD_BLOCK", pad_block)
    block_sizes, rows = GROUPS[groups]
    kinds = BATCHES[batch]
    inputs, block_tables = to_device(*make_case(kinds, block_sizes, sample_from_anchor,
                                                seed=len(kinds) + len(rows)))
    want = run_vllm(vllm_prepare, inputs, block_tables, block_sizes, rows)
    done, got = run_ours(inputs, block_tables, block_sizes, rows)
    assert done
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name

    # Not vacuous: everything vLLM writes was written (no garbage left there).
    num_reqs, num_query = len(kinds), inputs["num_query_per_req"]
    num_tokens = int(inputs["input_batch"].query_start_loc[-1])
    steps = inputs["num_speculative_steps"]
    assert not (got["input_ids"][:num_reqs * num_query] == GARBAGE).any()
    assert not (got["positions"][:num_reqs * num_query] == GARBAGE).any()
    assert (got["positions"][num_reqs * num_query:] == GARBAGE).all()
    assert not (got["query_start_loc"] == GARBAGE).any()
    assert not (got["seq_lens"] == GARBAGE).any()
    assert not (got["context_positions"][:num_tokens] == GARBAGE).any()
    for name in ("sample_indices", "sample_pos", "sample_idx_mapping"):
        assert not (got[name][:MAX_REQS * steps] == GARBAGE).any(), name
    for i, gid in enumerate(rows):
        assert not (got["query_slots"][gid] == GARBAGE).any()
        assert not (got["context_slots"][i, :num_tokens] == GARBAGE).any()
    others = [r for r in range(NUM_ALL_GROUPS) if r not in rows]
    assert (got["query_slots"][others] == GARBAGE).all()
    assert (got["context_slots"][len(rows)] == GARBAGE).all()

    # Independent of vLLM: request 0's first context slot and bonus-token slot, per group.
    batch_in = inputs["input_batch"]
    last_pos = int(batch_in.positions[TREE_Q - int(inputs["num_rejected"][0]) - 1])
    for i, (gid, bs) in enumerate(zip(rows, block_sizes, strict=True)):
        bt = block_tables[i].cpu()
        pos = int(batch_in.positions[0])
        assert int(got["context_slots"][i, 0]) == int(bt[0, pos // bs]) * bs + pos % bs
        pos = last_pos + 1
        assert int(got["query_slots"][gid, 0]) == int(bt[0, pos // bs]) * bs + pos % bs
        assert (got["query_slots"][gid, num_reqs * num_query:] == -1).all()


def test_eight_groups_and_refusals(vllm_prepare):
    """MAX_GROUPS groups in one launch; more groups, a repeated or out-of-range row,
    or a short context-slot buffer are refused with nothing written."""
    assert MAX_GROUPS == 8
    block_sizes = [16, 32, 64, 16, 128, 16, 32, 256]
    rows = [4, 0, 1, 2, 3, 5, 6, 7]
    inputs, block_tables = to_device(*make_case(("tree", "prefill"), block_sizes, False, 9))
    want = run_vllm(vllm_prepare, inputs, block_tables, block_sizes, rows, num_rows=8)
    done, got = run_ours(inputs, block_tables, block_sizes, rows, num_rows=8)
    assert done
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
    assert not (got["query_slots"] == GARBAGE).any()
    refused = [
        (block_tables + block_tables[:1], block_sizes + [16], rows + [0]),  # 9 groups
        (block_tables[:2], block_sizes[:2], [1, 1]),  # one row twice
        (block_tables[:2], block_sizes[:2], [1, 8]),  # past the 8 rows
    ]
    for bts, sizes, group_rows in refused:
        done, got = run_ours(inputs, bts, sizes, group_rows, num_rows=8)
        assert not done
        assert all((t == GARBAGE).all() for t in got.values())


def test_host_side_has_no_sync(monkeypatch):
    """Everything but the launch under the host-sync detector: the wrapper reads
    shapes, strides and the host-side scheduled token counts only; one launch."""
    from vllm_ddtree.testing.sync_guard import HostSyncDetector

    block_sizes, rows = GROUPS["three"]
    inputs, block_tables = to_device(*make_case(("tree", "prefill"), block_sizes, False, 4))
    launches = []

    class Recorded:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((grid, kwargs["NUM_GROUPS"]))

    monkeypatch.setattr(dflash_inputs_kernel, "_prepare_dflash_inputs_groups_kernel",
                        Recorded())
    with HostSyncDetector() as detector:
        done, _ = run_ours(inputs, block_tables, block_sizes, rows)
    assert done
    # 300 + 16 rows: two blocks of 256; one more row of programs for the padding
    assert launches == [((3, 2), 3)]
    assert detector.count() == 0, detector.report()


_COMPILE_SCRIPT = textwrap.dedent(
    """
    import json, triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from vllm_ddtree.draft.inputs_kernel import _prepare_dflash_inputs_groups_kernel as fn

    i32 = {"out_input_ids_ptr", "out_query_start_loc_ptr", "out_seq_lens_ptr",
           "out_sample_idx_mapping_ptr", "target_query_start_loc_ptr", "idx_mapping_ptr",
           "next_prefill_tokens_ptr", "num_sampled_ptr", "num_rejected_ptr"}
    i32 |= {f"bt{g}_ptr" for g in range(8)}
    result = []
    for arch in (90, 120):
        for groups, anchor, block in ((1, False, 128), (8, False, 256), (8, True, 256)):
            consts = dict(NUM_GROUPS=groups, SAMPLE_FROM_ANCHOR=anchor, PAD_SLOT_ID=-1,
                          BLOCK_SIZE=block, PAD_BLOCK=1024)
            sig = {n: "constexpr" if n in consts else ("*i32" if n in i32 else "*i64")
                   if n.endswith("_ptr") else "i32" for n in fn.arg_names}
            k = triton.compile(ASTSource(fn, sig, constexprs=consts),
                               target=GPUTarget("cuda", arch, 32), options={"num_warps": 4})
            result.append(k.metadata.shared)
    print(json.dumps(result))
    """
)


def test_kernel_compiles_for_sm90_and_sm120():
    """Compiled (no GPU needed) for Hopper and sm_120, with one and eight groups."""
    shared = compiled_shared_memory(_COMPILE_SCRIPT)
    assert len(shared) == 6 and max(shared) <= 99 * 1024, shared
