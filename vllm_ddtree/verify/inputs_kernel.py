# SPDX-License-Identifier: Apache-2.0
"""A verify batch's RoPE positions, ancestor bits and active rows in one Triton launch.

:func:`vllm_ddtree.runtime_state.verify_inputs_` prepares every verify step's inputs
eagerly, before the target's graph replays: tree rows get ``bonus position + depth``
as RoPE position and their tree's ancestor bits, other rows (prefill chunks, plain
decode) linear positions and causal bits, and with ``ddtree_budget: "auto"`` each
request its active query rows. Its PyTorch path
(:func:`vllm_ddtree.verify.batch.tree_verify_positions_and_bits` and friends) is about
50 small kernels a step, all launched one by one on the host's critical path;
:func:`verify_inputs_triton` writes the same buffers in one launch.

``_verify_inputs_kernel``: grid ``(R + 1,)``. Program ``r < R`` walks request ``r``'s
token rows in blocks of ``BLOCK_T`` (its request index and row offset are known, no
search over ``query_start_loc``); program ``R`` fills the CUDA-graph padding rows'
positions and the active-row entries past the batch (``ALL_ROWS_ACTIVE``). No host
sync; the launch shape depends only on ``R`` and the buffers' shapes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_ddtree.attention_backends.tree_mask_state import ALL_ROWS_ACTIVE

__all__ = ["verify_inputs_triton"]

BLOCK_T = 64
MAX_BLOCK_W = 8  # mask words per inner block ([BLOCK_T, BLOCK_W] int64 in registers)


@triton.jit(do_not_specialize=["num_reqs", "num_tokens", "num_tokens_padded",
                                "num_active_entries"])
def _verify_inputs_kernel(
    linear_ptr,  # int64 [>= T_pad]
    qsl_ptr,  # int32 [R + 1]
    cu_logits_ptr,  # int32 [R + 1]
    idx_ptr,  # int32 [R]
    depths_ptr,  # int64 [max_reqs, B]
    tree_bits_ptr,  # int64 [max_reqs, 1 + B, W_tree]
    active_nodes_ptr,  # int64 [max_reqs]; read only with ADAPTIVE
    positions_ptr,  # int64 [>= T_pad]
    bits_ptr,  # int64 [>= T, W]
    active_lens_ptr,  # int32 [num_active_entries]; written only with ADAPTIVE
    num_reqs,
    num_tokens,
    num_tokens_padded,
    num_active_entries,
    stride_dep_r,
    stride_tb_r,
    stride_tb_n,
    stride_bits_t,
    NUM_NODES: tl.constexpr,
    TREE_WORDS: tl.constexpr,
    NUM_WORDS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_W: tl.constexpr,
    ADAPTIVE: tl.constexpr,
    ALL_ACTIVE: tl.constexpr,
):
    r = tl.program_id(0)
    offs_t = tl.arange(0, BLOCK_T)
    if r == num_reqs:
        for start in range(num_tokens, num_tokens_padded, BLOCK_T):
            t = start + offs_t
            pad = t < num_tokens_padded
            tl.store(positions_ptr + t, tl.load(linear_ptr + t, mask=pad), mask=pad)
        if ADAPTIVE:
            for start in range(num_reqs, num_active_entries, BLOCK_T):
                e = start + offs_t
                tl.store(active_lens_ptr + e, tl.full([BLOCK_T], ALL_ACTIVE, tl.int32),
                         mask=e < num_active_entries)
        return

    q_start = tl.load(qsl_ptr + r)
    q_end = tl.load(qsl_ptr + r + 1)
    # A tree request has draft rows: more than one logit row.
    is_tree = (tl.load(cu_logits_ptr + r + 1) - tl.load(cu_logits_ptr + r)) > 1
    slot = tl.load(idx_ptr + r).to(tl.int64)
    for start in range(q_start, q_end, BLOCK_T):
        t = start + offs_t
        valid = t < q_end
        local = t - q_start
        linear = tl.load(linear_ptr + t, mask=valid, other=0)
        tree_row = is_tree & (local > 0) & (local <= NUM_NODES)
        node = tl.minimum(tl.maximum(local - 1, 0), NUM_NODES - 1)
        depth = tl.load(depths_ptr + slot * stride_dep_r + node, mask=valid & tree_row, other=0)
        tl.store(positions_ptr + t, tl.where(tree_row, linear - local + depth, linear),
                 mask=valid)

        in_tree = is_tree & (local < NUM_NODES + 1)
        row = tl.minimum(local, NUM_NODES)
        # Words in blocks: in fp32 (every query a decode) a row may have hundreds.
        for first_word in tl.static_range(0, NUM_WORDS, BLOCK_W):
            offs_w = first_word + tl.arange(0, BLOCK_W)
            # Causal bits: row i sees new tokens 0..i.
            count = tl.minimum(tl.maximum(local[:, None] + 1 - 64 * offs_w[None, :], 0), 64)
            full = count == 64
            one = tl.full([BLOCK_T, BLOCK_W], 1, tl.int64)
            causal = tl.where(full, -1, (one << tl.where(full, 0, count).to(tl.int64)) - 1)
            tree_bits = tl.load(
                tree_bits_ptr + slot * stride_tb_r + row[:, None] * stride_tb_n
                + offs_w[None, :],
                mask=(valid & in_tree)[:, None] & (offs_w[None, :] < TREE_WORDS),
                other=0,
            )
            bits = tl.where(in_tree[:, None], tree_bits, causal)
            tl.store(bits_ptr + t[:, None].to(tl.int64) * stride_bits_t + offs_w[None, :],
                     bits, mask=valid[:, None] & (offs_w[None, :] < NUM_WORDS))

    if ADAPTIVE:
        q_len = q_end - q_start
        active = tl.load(active_nodes_ptr + slot).to(tl.int32) + 1
        tl.store(active_lens_ptr + r, tl.where(is_tree, tl.minimum(active, q_len), q_len))


def verify_inputs_triton(
    linear_positions: torch.Tensor,
    query_start_loc: torch.Tensor,
    cu_num_logits: torch.Tensor,
    idx_mapping: torch.Tensor,
    depths: torch.Tensor,
    tree_bits: torch.Tensor,
    positions_out: torch.Tensor,
    bits_out: torch.Tensor,
    num_tokens: int,
    num_tokens_padded: int,
    active_nodes: torch.Tensor | None = None,
    active_lens_out: torch.Tensor | None = None,
) -> None:
    """Write a verify batch's positions, ancestor bits and (adaptive) active rows.

    Same results as ``verify_inputs_``'s PyTorch path (``runtime_state.py``).

    Args:
        linear_positions: int64 ``[>= num_tokens_padded]``, vLLM's positions.
        query_start_loc: int32 ``[R + 1]``; cu_num_logits: int32 ``[R + 1]`` (a request
            with more than one logit row is a tree request).
        idx_mapping: int32 ``[R]``, batch row -> request-state slot.
        depths: int64 ``[max_reqs, B]``; tree_bits: int64 ``[max_reqs, 1 + B, W_tree]``
            (slot-indexed trees of the last draft).
        positions_out: int64 ``[>= num_tokens_padded]``: tree rows ``bonus position +
            depth``, other and padding rows their linear position.
        bits_out: int64 ``[>= num_tokens, W]``, last dim contiguous: tree rows their
            ancestor bits (words past ``W_tree`` zero), other rows causal bits.
        num_tokens / num_tokens_padded: real and CUDA-graph padded token counts.
        active_nodes: int64 ``[max_reqs]`` (``auto``: ``b`` per slot) and
            active_lens_out: int32 ``[>= R]``: ``min(1 + b, query_len)`` for a tree
            request, the query length otherwise, ``ALL_ROWS_ACTIVE`` past ``R``.
    """
    num_reqs = idx_mapping.shape[0]
    num_nodes = depths.shape[1]
    num_words = bits_out.shape[1]
    if bits_out.stride(1) != 1 or depths.stride(1) != 1 or tree_bits.stride(2) != 1:
        raise ValueError("bits_out, depths and tree_bits must be contiguous in the last dim")
    adaptive = active_nodes is not None
    if adaptive and active_lens_out is None:
        raise ValueError("active_nodes needs active_lens_out")
    _verify_inputs_kernel[(num_reqs + 1,)](
        linear_positions, query_start_loc, cu_num_logits, idx_mapping,
        depths, tree_bits, active_nodes if adaptive else depths,
        positions_out, bits_out, active_lens_out if adaptive else query_start_loc,
        num_reqs, num_tokens, num_tokens_padded,
        active_lens_out.shape[0] if adaptive else 0,
        depths.stride(0), tree_bits.stride(0), tree_bits.stride(1), bits_out.stride(0),
        NUM_NODES=num_nodes,
        TREE_WORDS=tree_bits.shape[2],
        NUM_WORDS=num_words,
        BLOCK_T=BLOCK_T,
        BLOCK_W=min(triton.next_power_of_2(max(num_words, 1)), MAX_BLOCK_W),
        ADAPTIVE=adaptive,
        ALL_ACTIVE=ALL_ROWS_ACTIVE,
    )  # fmt: skip
