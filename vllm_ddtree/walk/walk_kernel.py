# SPDX-License-Identifier: Apache-2.0
"""The verifier's round after the draw as one Triton kernel: the acceptance walk of
:func:`vllm_ddtree.walk.follow.follow_tree` and what follows it.

``follow_tree`` is batched PyTorch with a Python loop over the depths: about ten
small ops per depth, ~150 kernel launches per verify step at ``L = 15``, all of them
eager on the host path of every decoding round, plus the walk's inputs and its
finish. :func:`verify_walk_triton` does all of it in one launch: the walk's inputs
read in place from the verify batch, the walk, and what follows it (vLLM's sampled
rows and counts, the KV source rows for propose, the acceptance counters).

``_verify_walk_kernel``: grid ``(R,)``, one program per request. Its walk
(``_walk_path``) keeps the current node (``-1`` = the root) and, for each of the
``max_depth`` steps, loads the target's token at the current node, scans the
request's ``B`` nodes in blocks of ``BLOCK_B`` for ``parent == current and token ==
target`` and takes the lowest matching index (``tl.min``), which is ``follow_tree``'s
rule for duplicate child tokens. Tokens are compared as int64 exactly as
``follow_tree`` compares them, so a node masked to ``-1`` never matches a real
(``>= 0``) target token. The path and its tokens accumulate in registers (``BLOCK_L``
columns); the outputs are stored once, after the loop. Launch shape depends only on
tensor shapes: no host sync, and the launch can be captured in a CUDA graph.

The verifier runs it for CUDA tensors (``vllm_ddtree.triton_path``); CPU tensors take
``follow_tree`` and the PyTorch finish, which the tests compare the kernel with (on CPU
the kernel runs only in Triton's interpreter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_ddtree.walk.follow import WalkResult

__all__ = ["MAX_BLOCK_B", "verify_walk_triton"]

MAX_BLOCK_B = 512


@triton.jit
def _walk_path(
    tok_ptr,  # INDIRECT: int [T], node i's token at tok_ptr[rows_ptr[i]]; else tok_ptr[i * stride]
    tok_stride,
    rows_ptr,  # int [>= limit], read with INDIRECT
    par_ptr,  # node i's parent at par_ptr[i * par_stride]
    par_stride,
    tgt_ptr,  # the target's token at the root (0) and at node i (i + 1), tgt_stride apart
    tgt_stride,
    num_targets,  # target columns present (the rest read as -1)
    limit,  # nodes that may match (later ones are masked out)
    num_nodes,
    max_depth,
    INDIRECT: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_L: tl.constexpr,
):
    """One request's walk: ``(path, path_tokens, bonus)``, the accepted nodes and their
    tokens (``[BLOCK_L]``, -1 padded) and the target's token after the last one."""
    offs = tl.arange(0, BLOCK_B)
    cols = tl.arange(0, BLOCK_L)
    current = tl.full((), -1, tl.int64)
    path = tl.full((BLOCK_L,), -1, tl.int64)
    path_tokens = tl.full((BLOCK_L,), -1, tl.int64)
    for step in range(max_depth):
        wanted = tl.load(tgt_ptr + (current + 1) * tgt_stride, mask=current + 1 < num_targets,
                         other=-1).to(tl.int64)
        best = tl.full((), num_nodes, tl.int32)
        for first in range(0, num_nodes, BLOCK_B):
            idx = first + offs
            live = idx < limit
            par = tl.load(par_ptr + idx * par_stride, mask=live, other=-2).to(tl.int64)
            if INDIRECT:
                row = tl.load(rows_ptr + idx, mask=live, other=0)
                tok = tl.load(tok_ptr + row, mask=live, other=-1).to(tl.int64)
            else:
                tok = tl.load(tok_ptr + idx * tok_stride, mask=live, other=-1).to(tl.int64)
            match = live & (par == current) & (tok == wanted)
            best = tl.minimum(best, tl.min(tl.where(match, idx, num_nodes), axis=0))
        # A stopped walk stays stopped: `current` and `wanted` no longer change.
        alive = best < num_nodes
        node = best.to(tl.int64)
        current = tl.where(alive, node, current)
        here = (cols == step) & alive
        path = tl.where(here, node, path)
        path_tokens = tl.where(here, wanted, path_tokens)
    bonus = tl.load(tgt_ptr + (current + 1) * tgt_stride, mask=current + 1 < num_targets,
                    other=-1).to(tl.int64)
    return path, path_tokens, bonus


# One variant for every batch: num_reqs == 1 would be specialized, and num_rejected is
# the second row of one [2, R] int32 allocation, its 16-byte alignment following R (a
# batch-1 request compiled its own variant mid-serving after vLLM's warm-up batches).
@triton.jit(do_not_specialize=["num_reqs", "num_nodes", "max_depth", "budget", "walk_width"],
            do_not_specialize_on_alignment=["num_sampled_ptr", "num_rejected_ptr"])
def _verify_walk_kernel(
    input_ids_ptr,  # int [T]
    logits_indices_ptr,  # int [num_logits]
    drawn_ptr,  # int [num_logits]
    cu_ptr,  # int32 [R + 1]
    idx_ptr,  # int32 [R]
    state_parents_ptr,  # int64 [max_reqs, B]
    active_nodes_ptr,  # int64 [max_reqs]; read with ADAPTIVE
    seq_lens_ptr,  # int32 [R]
    prefill_len_ptr,  # int32 [max_reqs]
    walk_ptr,  # int64 [6 chunks]: accepted, depth, committed, num_committed, bonus, src
    sampled_ptr,  # int64 [R, B + 1]
    num_sampled_ptr,  # int32 [R]
    num_rejected_ptr,  # int32 [R]
    walk_rows_ptr,  # int64 [max_reqs, W >= L]
    accepted_sum_ptr,  # int64 [1]; with COUNT
    num_drafts_ptr,  # int64 [1]; with COUNT
    active_sum_ptr,  # int64 [1]; with COUNT and ADAPTIVE
    arm_sizes_ptr,  # int64 [NUM_ARMS]; with COUNT
    arm_accepted_ptr,  # int64 [NUM_ARMS]; with COUNT
    num_reqs,
    num_nodes,
    max_depth,
    budget,
    walk_width,
    stride_state_r,
    stride_walk_r,
    ADAPTIVE: tl.constexpr,
    COUNT: tl.constexpr,
    NUM_ARMS: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_A: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    start = tl.load(cu_ptr + r).to(tl.int64)
    num_logits = tl.load(cu_ptr + r + 1).to(tl.int64) - start
    num_drafts = num_logits - 1
    slot = tl.load(idx_ptr + r).to(tl.int64)
    limit = tl.minimum(num_drafts, num_nodes)
    if ADAPTIVE:
        limit = tl.minimum(limit, tl.load(active_nodes_ptr + slot))
    # The walk, reading node i's token in place (input_ids[logits_indices[start + 1 +
    # i]]) and its parent from the state row.
    path, path_tokens, bonus = _walk_path(
        input_ids_ptr, 1, logits_indices_ptr + start + 1,
        state_parents_ptr + slot * stride_state_r, 1, drawn_ptr + start, 1, num_logits,
        limit, num_nodes, max_depth, INDIRECT=True, BLOCK_B=BLOCK_B, BLOCK_L=BLOCK_L)
    cols = tl.arange(0, BLOCK_L)
    depth = tl.sum((path >= 0).to(tl.int64), axis=0)
    committed = tl.where(cols < depth, path_tokens, tl.where(cols == depth, bonus, -1))
    src = tl.where(path >= 0, path + 1, -1)
    in_path = cols < max_depth
    # WalkResult chunks, laid out in one buffer (see verify_walk_triton).
    accepted_base = walk_ptr
    depth_base = accepted_base + num_reqs * max_depth
    committed_base = depth_base + num_reqs
    num_committed_base = committed_base + num_reqs * (max_depth + 1)
    bonus_base = num_committed_base + num_reqs
    src_base = bonus_base + num_reqs
    tl.store(accepted_base + r * max_depth + cols, path, mask=in_path)
    tl.store(src_base + r * max_depth + cols, src, mask=in_path)
    tl.store(committed_base + r * (max_depth + 1) + cols, committed, mask=cols <= max_depth)
    tl.store(depth_base + r, depth)
    tl.store(num_committed_base + r, depth + 1)
    tl.store(bonus_base + r, bonus)

    # The finish: vLLM's sampled rows, the KV source rows for propose, the counters
    # (each output in two stores to disjoint columns: registers, then the -1 padding).
    tl.store(sampled_ptr + r * (budget + 1) + cols, committed,
             mask=(cols <= max_depth) & (cols <= budget))
    scols = tl.arange(0, BLOCK_S)
    tl.store(sampled_ptr + r * (budget + 1) + scols, tl.full((BLOCK_S,), -1, tl.int64),
             mask=(scols > max_depth) & (scols <= budget))
    tl.store(walk_rows_ptr + r * stride_walk_r + cols, src,
             mask=in_path & (cols < walk_width))
    wcols = tl.arange(0, BLOCK_W)
    tl.store(walk_rows_ptr + r * stride_walk_r + wcols, tl.full((BLOCK_W,), -1, tl.int64),
             mask=(wcols >= max_depth) & (wcols < walk_width))
    if COUNT:
        is_tree = num_drafts > 0
        tl.atomic_add(accepted_sum_ptr, tl.where(is_tree, depth, 0))
        tl.atomic_add(num_drafts_ptr, is_tree.to(tl.int64))
        if ADAPTIVE:
            active = tl.load(active_nodes_ptr + slot)
            tl.atomic_add(active_sum_ptr, tl.where(is_tree, tl.minimum(active, num_drafts), 0))
        if NUM_ARMS > 0:
            # What a tree of its first s nodes would have accepted: the path's nodes
            # below s (a parent precedes its children, so they are a prefix of it).
            arms = tl.arange(0, BLOCK_A)
            sizes = tl.load(arm_sizes_ptr + arms, mask=arms < NUM_ARMS, other=0)
            inside = (path[:, None] >= 0) & (path[:, None] < sizes[None, :])
            within = tl.sum(inside.to(tl.int64), axis=0)
            tl.atomic_add(arm_accepted_ptr + arms, tl.where(is_tree, within, 0),
                          mask=arms < NUM_ARMS)

    # vLLM's get_num_sampled_and_rejected: a chunked prefill samples and rejects nothing.
    chunked = tl.load(seq_lens_ptr + r) < tl.load(prefill_len_ptr + slot)
    num_sampled = tl.where(chunked, 0, depth + 1)
    tl.store(num_sampled_ptr + r, num_sampled.to(tl.int32))
    tl.store(num_rejected_ptr + r, tl.where(chunked, 0, num_logits - num_sampled).to(tl.int32))


def _interpreted() -> bool:
    return type(_walk_path).__name__ == "InterpretedFunction"


def verify_walk_triton(
    input_ids: torch.Tensor,
    logits_indices: torch.Tensor,
    drawn: torch.Tensor,
    cu_num_logits: torch.Tensor,
    idx_mapping: torch.Tensor,
    state_parents: torch.Tensor,
    max_depth: int,
    budget: int,
    walk_rows_out: torch.Tensor,
    seq_lens: torch.Tensor,
    prefill_len: torch.Tensor,
    active_nodes: torch.Tensor | None = None,
    counters: tuple[torch.Tensor, torch.Tensor] | None = None,
    active_sum: torch.Tensor | None = None,
    arm_counters: tuple[torch.Tensor, torch.Tensor] | None = None,
    *,
    block_b: int | None = None,
) -> tuple[WalkResult, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The verifier's whole round after the draw in one launch: the walk's inputs
    (``verifier.tree_inputs_from_rows``, the slot gathers, ``budget.mask_inactive_nodes``),
    ``walk.follow.follow_tree``, the finish (``verify_batch.sampled_rows_from_walk``,
    ``DDTreeVerifier._update_stats``, ``DDTreeRuntimeState.record_walk_``) and vLLM's
    ``get_num_sampled_and_rejected`` (four launches and their allocations before).

    Args:
        input_ids: int ``[T]``; logits_indices: int ``[num_logits]`` (the input token of
            logit row ``i`` is ``input_ids[logits_indices[i]]``: the root, then the
            verified nodes); drawn: int ``[num_logits]``, the target's token per row.
        cu_num_logits: int32 ``[R + 1]``; idx_mapping: int32 ``[R]`` (state slots).
        state_parents: int64 ``[max_reqs, B]``, slot-indexed parents (last stride 1).
        active_nodes: int64 ``[max_reqs]`` (``ddtree_budget: "auto"``): the walk ignores
            nodes from ``active_nodes[slot]`` on, and the counters add each tree's
            verified nodes to ``active_sum``.
        max_depth: ``L_max >= 0``, the number of walk steps and the pad width, as in
            ``follow_tree`` (a deeper tree is cut at ``max_depth`` accepted nodes).
        budget: B, the width of vLLM's sampled rows minus one.
        walk_rows_out: int64 ``[>= R, W >= L]``: row ``r`` gets the walk's
            ``kv_src_rows[r]``, -1 past ``L`` (for the next ``propose``).
        counters: ``(accepted_sum, num_drafts)`` int64 ``[1]`` to add this batch's
            accepted nodes and tree count to, or None.
        active_sum: int64 ``[1]``, with counters and ``active_nodes``: the sum of each
            tree's verified nodes.
        arm_counters: with counters, ``(sizes, accepted)`` int64 ``[A]`` each: adds to
            ``accepted[a]`` the accepted nodes each tree would have had cut to its first
            ``sizes[a]`` nodes (the accepted path's nodes below ``sizes[a]``), or None.
            For ``auto``'s step gate: the committed tokens of every smaller arm from the
            very trees the step verified.
        seq_lens: int32 ``[R]``; prefill_len: int32 ``[max_reqs]`` (slot-indexed): a
            request with ``seq_len < prefill_len`` is mid chunked prefill and samples
            nothing (vLLM's rule).

    Returns:
        ``(walk, sampled_token_ids int64 [R, B + 1], num_sampled int32 [R],
        num_rejected int32 [R])``, each equal to what the four-launch path returns;
        ``walk``'s six int64 fields are contiguous chunks of one buffer. No host sync.
    """
    if isinstance(max_depth, bool) or not isinstance(max_depth, int) or max_depth < 0:
        raise ValueError(f"max_depth must be an int >= 0, got {max_depth!r}")
    if state_parents.stride(1) != 1:
        raise ValueError("state_parents must be contiguous in its last dim")
    if walk_rows_out.shape[1] < max_depth or walk_rows_out.stride(1) != 1:
        raise ValueError(f"walk_rows_out must be [>= R, >= {max_depth}], last dim contiguous")
    num_reqs, num_nodes = idx_mapping.shape[0], state_parents.shape[1]
    device = drawn.device
    if device.type == "cpu" and not _interpreted():
        raise ValueError("the Triton walk needs GPU tensors (or TRITON_INTERPRET=1)")
    if block_b is None:
        block_b = min(triton.next_power_of_2(max(num_nodes, 1)), MAX_BLOCK_B)
    if block_b < 1 or block_b & (block_b - 1):
        raise ValueError(f"block_b must be a power of two, got {block_b}")
    shapes = [(max_depth,), (), (max_depth + 1,), (), (), (max_depth,)]
    numels = [num_reqs * (shape[0] if shape else 1) for shape in shapes]
    buffer = torch.empty(sum(numels), dtype=torch.int64, device=device)
    accepted, depth, committed, num_committed, bonus, src = (
        chunk.view(num_reqs, *shape)
        for chunk, shape in zip(buffer.split(numels), shapes, strict=True)
    )
    sampled = torch.empty(num_reqs, budget + 1, dtype=torch.int64, device=device)
    counts = torch.empty(2, num_reqs, dtype=torch.int32, device=device)
    num_sampled, num_rejected = counts[0], counts[1]
    if num_reqs:
        count, adaptive = counters is not None, active_nodes is not None
        if count and adaptive and active_sum is None:
            raise ValueError("active_sum is needed with counters and active_nodes")
        accepted_sum, num_drafts = counters if count else (buffer, buffer)
        if arm_counters is not None and not count:
            raise ValueError("arm_counters need counters")
        arm_sizes, arm_accepted = arm_counters if arm_counters is not None else (buffer, buffer)
        num_arms = 0 if arm_counters is None else arm_sizes.shape[0]
        _verify_walk_kernel[(num_reqs,)](
            input_ids, logits_indices, drawn, cu_num_logits, idx_mapping, state_parents,
            active_nodes if adaptive else buffer, seq_lens, prefill_len, buffer, sampled,
            num_sampled, num_rejected, walk_rows_out, accepted_sum, num_drafts,
            active_sum if count and adaptive else buffer, arm_sizes, arm_accepted,
            num_reqs, num_nodes, max_depth, budget, walk_rows_out.shape[1],
            state_parents.stride(0), walk_rows_out.stride(0),
            ADAPTIVE=adaptive,
            COUNT=count,
            NUM_ARMS=num_arms,
            BLOCK_B=block_b,
            BLOCK_L=triton.next_power_of_2(max_depth + 1),
            BLOCK_S=triton.next_power_of_2(max(budget, max_depth) + 1),
            BLOCK_W=triton.next_power_of_2(max(walk_rows_out.shape[1], 1)),
            BLOCK_A=triton.next_power_of_2(max(num_arms, 1)),
            num_warps=4 if block_b >= 256 else 1,
        )  # fmt: skip
    walk = WalkResult(accepted_nodes=accepted, accepted_depth=depth,
                      committed_tokens=committed, num_committed=num_committed,
                      bonus_tokens=bonus, kv_src_rows=src)
    return walk, sampled, num_sampled, num_rejected
