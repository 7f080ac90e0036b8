# SPDX-License-Identifier: Apache-2.0
"""DFlash's draft inputs for every drafter KV-cache group in one Triton launch.

vLLM 0.26's ``DFlashSpeculator.propose`` calls ``prepare_dflash_inputs``
(``vllm/v1/worker/gpu/spec_decode/dflash/speculator.py``) once per drafter KV-cache
group, every round. The launches differ only in the block table and kernel block size
behind the two slot mappings (the group's row of ``block_tables.slot_mappings`` and of
``_context_slot_mappings``); the input ids, positions, ``query_start_loc``,
``seq_lens``, context positions and sample buffers come out the same from each. With
a drafter of 6 groups that is 5 launches of host time a round (steps at small batch
are host-bound) spent rewriting equal values. :func:`prepare_dflash_inputs_groups`
writes what those launches write, bit for bit, in one: vLLM's program layout (one
program per request and block of its context + query span), the shared outputs
written once, the slots once per group. vLLM's last request program also pads the
query slots to ``max_num_tokens`` (and the per-request buffers to ``max_num_reqs``) in
a serial loop; a launch per group repeats that loop (0.051 ms a round for 6 groups at
1k on the H200), and one program doing it for every group took
0.104 ms. Here an extra row of programs writes the padding in ``_PAD_BLOCK``-entry
chunks, all groups at once.

The block tables are separate tensors (``BlockTables.input_block_tables`` is a list,
one allocation per group), so up to :data:`MAX_GROUPS` of them travel as separate
pointer arguments, the unused ones repeating the first (as
:mod:`vllm_ddtree.draft.hidden_rows_kernel` does with its hidden-state tensors).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from vllm.v1.attention.backends.utils import PAD_SLOT_ID

__all__ = ["MAX_GROUPS", "prepare_dflash_inputs_groups"]

MAX_GROUPS = 8  # drafter KV-cache groups per launch; more fall back to vLLM's calls
# Tokens of one request a program handles: vLLM's largest block, for every round.
BLOCK_TOKENS = 256
# Entries of each padded buffer one program of the padding row writes.
_PAD_BLOCK = 1024


@triton.jit
def _group_slots(
    bt_ptr,  # int32 [max_num_reqs, bt_stride], the group's input block table
    bt_stride,
    block_size,  # the group's kernel block size
    q_slots_ptr,  # int64 [max_num_tokens], the group's query slot mapping row
    ctx_slots_ptr,  # int64 [max_num_tokens], the group's context slot mapping row
    req_idx,
    ctx_pos,
    ctx_offs,
    is_ctx,
    query_pos,
    query_idx,
    is_query,
):
    # vLLM's expressions, operand for operand (same types, same clamps).
    row_ptr = bt_ptr + req_idx * bt_stride
    ctx_block_num = tl.minimum(ctx_pos // block_size, bt_stride - 1)
    ctx_block_id = tl.load(row_ptr + ctx_block_num, mask=is_ctx, other=0).to(tl.int64)
    ctx_slot = ctx_block_id * block_size + (ctx_pos % block_size)
    tl.store(ctx_slots_ptr + ctx_offs, ctx_slot, mask=is_ctx)
    q_block_num = tl.minimum(query_pos // block_size, bt_stride - 1)
    q_block_id = tl.load(row_ptr + q_block_num, mask=is_query, other=0).to(tl.int64)
    q_slot = q_block_id * block_size + (query_pos % block_size)
    tl.store(q_slots_ptr + query_idx, q_slot, mask=is_query)


# One variant for every round: num_sampled / num_rejected may be the rows of one [2, R]
# allocation (the fused walk's), whose alignment follows R (see BLOCK_TOKENS too).
@triton.jit(do_not_specialize=["num_reqs", "num_blocks"],
            do_not_specialize_on_alignment=["num_sampled_ptr", "num_rejected_ptr"])
def _prepare_dflash_inputs_groups_kernel(
    # Outputs
    out_input_ids_ptr,
    out_query_positions_ptr,
    out_query_start_loc_ptr,
    out_seq_lens_ptr,
    out_query_slots_ptr,  # int64 [num_kv_cache_groups, >= max_num_tokens]
    out_context_positions_ptr,
    out_context_slots_ptr,  # int64 [>= NUM_GROUPS, >= max_num_tokens]
    out_sample_indices_ptr,
    out_sample_pos_ptr,
    out_sample_idx_mapping_ptr,
    # Inputs from target batch
    target_positions_ptr,
    target_query_start_loc_ptr,
    idx_mapping_ptr,
    last_sampled_ptr,
    next_prefill_tokens_ptr,
    num_sampled_ptr,
    num_rejected_ptr,
    # Per group g: block table, its row stride, kernel block size, and the offset
    # of its query slot row in out_query_slots (ctx slot rows: g * ctx_row_stride)
    bt0_ptr, bt1_ptr, bt2_ptr, bt3_ptr, bt4_ptr, bt5_ptr, bt6_ptr, bt7_ptr,
    bt_stride0, bt_stride1, bt_stride2, bt_stride3,
    bt_stride4, bt_stride5, bt_stride6, bt_stride7,
    block_size0, block_size1, block_size2, block_size3,
    block_size4, block_size5, block_size6, block_size7,
    q_off0, q_off1, q_off2, q_off3, q_off4, q_off5, q_off6, q_off7,
    ctx_row_stride,
    # Scalars
    parallel_drafting_token_id,
    num_query_per_req,
    num_speculative_steps,
    max_num_reqs,
    max_num_tokens,
    max_model_len,
    num_reqs,
    num_blocks,  # programs per request (the rest of axis 1 serves the padding row)
    NUM_GROUPS: tl.constexpr,
    SAMPLE_FROM_ANCHOR: tl.constexpr,
    PAD_SLOT_ID: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    PAD_BLOCK: tl.constexpr,
):
    req_idx = tl.program_id(0)
    block_idx = tl.program_id(1)
    if req_idx == num_reqs:
        # The padding row: vLLM's last request pads every buffer to its maximum (for
        # CUDA-graph safety) in a serial loop, once per group; here chunk ``block_idx``
        # of every padded range, all groups at once, so no program loops over
        # max_num_tokens.
        chunk = block_idx * PAD_BLOCK + tl.arange(0, PAD_BLOCK)
        last_query_end = num_reqs * num_query_per_req
        q_pad = last_query_end + chunk
        q_mask = q_pad < max_num_tokens
        tl.store(out_query_slots_ptr + q_off0 + q_pad, PAD_SLOT_ID, mask=q_mask)
        if NUM_GROUPS > 1:
            tl.store(out_query_slots_ptr + q_off1 + q_pad, PAD_SLOT_ID, mask=q_mask)
        if NUM_GROUPS > 2:
            tl.store(out_query_slots_ptr + q_off2 + q_pad, PAD_SLOT_ID, mask=q_mask)
        if NUM_GROUPS > 3:
            tl.store(out_query_slots_ptr + q_off3 + q_pad, PAD_SLOT_ID, mask=q_mask)
        if NUM_GROUPS > 4:
            tl.store(out_query_slots_ptr + q_off4 + q_pad, PAD_SLOT_ID, mask=q_mask)
        if NUM_GROUPS > 5:
            tl.store(out_query_slots_ptr + q_off5 + q_pad, PAD_SLOT_ID, mask=q_mask)
        if NUM_GROUPS > 6:
            tl.store(out_query_slots_ptr + q_off6 + q_pad, PAD_SLOT_ID, mask=q_mask)
        if NUM_GROUPS > 7:
            tl.store(out_query_slots_ptr + q_off7 + q_pad, PAD_SLOT_ID, mask=q_mask)
        req_pad = num_reqs + chunk
        tl.store(out_query_start_loc_ptr + req_pad, last_query_end,
                 mask=req_pad < max_num_reqs + 1)
        tl.store(out_seq_lens_ptr + req_pad, 0, mask=req_pad < max_num_reqs)
        sample_pad = num_reqs * num_speculative_steps + chunk
        sample_mask = sample_pad < max_num_reqs * num_speculative_steps
        tl.store(out_sample_indices_ptr + sample_pad, 0, mask=sample_mask)
        tl.store(out_sample_pos_ptr + sample_pad, 0, mask=sample_mask)
        tl.store(out_sample_idx_mapping_ptr + sample_pad, -1, mask=sample_mask)
    elif block_idx < num_blocks:
        req_state_idx = tl.load(idx_mapping_ptr + req_idx)

        ctx_start = tl.load(target_query_start_loc_ptr + req_idx)
        ctx_end = tl.load(target_query_start_loc_ptr + req_idx + 1)
        num_ctx = ctx_end - ctx_start

        num_rejected = tl.load(num_rejected_ptr + req_idx)
        valid_ctx_end = ctx_end - num_rejected

        num_sampled = tl.load(num_sampled_ptr + req_idx)
        if num_sampled > 0:
            bonus_token = tl.load(last_sampled_ptr + req_state_idx).to(tl.int32)
        else:
            # Chunked prefilling: splice in the next prefill token.
            bonus_token = tl.load(next_prefill_tokens_ptr + req_state_idx).to(tl.int32)

        last_valid_pos = tl.load(target_positions_ptr + valid_ctx_end - 1)
        query_base = req_idx * num_query_per_req

        j = block_idx * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        is_ctx = j < num_ctx
        is_query = (j >= num_ctx) & (j < num_ctx + num_query_per_req)
        query_off = j - num_ctx

        # --- Context positions (slots per group below) ---
        ctx_pos_idx = ctx_start + tl.where(is_ctx, j, 0)
        ctx_pos = tl.load(target_positions_ptr + ctx_pos_idx, mask=is_ctx, other=0)
        tl.store(out_context_positions_ptr + ctx_start + j, ctx_pos, mask=is_ctx)

        # --- Query positions / input_ids ---
        query_pos = last_valid_pos + 1 + query_off
        query_idx = query_base + query_off
        is_bonus = is_query & (query_off == 0)
        input_id = tl.where(is_bonus, bonus_token, parallel_drafting_token_id)
        tl.store(out_input_ids_ptr + query_idx, input_id, mask=is_query)
        clamped_query_pos = tl.minimum(query_pos, max_model_len - 1)
        tl.store(out_query_positions_ptr + query_idx, clamped_query_pos, mask=is_query)

        # --- Sample indices / positions / idx_mapping (see vLLM's kernel) ---
        sample_off = 0 if SAMPLE_FROM_ANCHOR else 1
        is_sample = is_query & (query_off >= sample_off)
        sample_idx = req_idx * num_speculative_steps + (query_off - sample_off)
        sample_pos = query_pos + 1 if SAMPLE_FROM_ANCHOR else query_pos
        tl.store(out_sample_indices_ptr + sample_idx, query_idx, mask=is_sample)
        tl.store(out_sample_pos_ptr + sample_idx, sample_pos, mask=is_sample)
        tl.store(out_sample_idx_mapping_ptr + sample_idx, req_state_idx, mask=is_sample)

        # --- Context / query slots, per group ---
        ctx_offs = ctx_start + j
        ctx_slots_ptr = out_context_slots_ptr
        _group_slots(bt0_ptr, bt_stride0, block_size0,
                     out_query_slots_ptr + q_off0, ctx_slots_ptr,
                     req_idx, ctx_pos, ctx_offs, is_ctx, query_pos, query_idx,
                     is_query)  # fmt: skip
        if NUM_GROUPS > 1:
            ctx_slots_ptr += ctx_row_stride
            _group_slots(bt1_ptr, bt_stride1, block_size1,
                         out_query_slots_ptr + q_off1, ctx_slots_ptr,
                         req_idx, ctx_pos, ctx_offs, is_ctx, query_pos, query_idx,
                         is_query)  # fmt: skip
        if NUM_GROUPS > 2:
            ctx_slots_ptr += ctx_row_stride
            _group_slots(bt2_ptr, bt_stride2, block_size2,
                         out_query_slots_ptr + q_off2, ctx_slots_ptr,
                         req_idx, ctx_pos, ctx_offs, is_ctx, query_pos, query_idx,
                         is_query)  # fmt: skip
        if NUM_GROUPS > 3:
            ctx_slots_ptr += ctx_row_stride
            _group_slots(bt3_ptr, bt_stride3, block_size3,
                         out_query_slots_ptr + q_off3, ctx_slots_ptr,
                         req_idx, ctx_pos, ctx_offs, is_ctx, query_pos, query_idx,
                         is_query)  # fmt: skip
        if NUM_GROUPS > 4:
            ctx_slots_ptr += ctx_row_stride
            _group_slots(bt4_ptr, bt_stride4, block_size4,
                         out_query_slots_ptr + q_off4, ctx_slots_ptr,
                         req_idx, ctx_pos, ctx_offs, is_ctx, query_pos, query_idx,
                         is_query)  # fmt: skip
        if NUM_GROUPS > 5:
            ctx_slots_ptr += ctx_row_stride
            _group_slots(bt5_ptr, bt_stride5, block_size5,
                         out_query_slots_ptr + q_off5, ctx_slots_ptr,
                         req_idx, ctx_pos, ctx_offs, is_ctx, query_pos, query_idx,
                         is_query)  # fmt: skip
        if NUM_GROUPS > 6:
            ctx_slots_ptr += ctx_row_stride
            _group_slots(bt6_ptr, bt_stride6, block_size6,
                         out_query_slots_ptr + q_off6, ctx_slots_ptr,
                         req_idx, ctx_pos, ctx_offs, is_ctx, query_pos, query_idx,
                         is_query)  # fmt: skip
        if NUM_GROUPS > 7:
            ctx_slots_ptr += ctx_row_stride
            _group_slots(bt7_ptr, bt_stride7, block_size7,
                         out_query_slots_ptr + q_off7, ctx_slots_ptr,
                         req_idx, ctx_pos, ctx_offs, is_ctx, query_pos, query_idx,
                         is_query)  # fmt: skip

        if block_idx == 0:
            tl.store(out_query_start_loc_ptr + req_idx, query_base)
            # seq_lens is the absolute sequence length the draft attention
            # reads up to (context + query).
            tl.store(out_seq_lens_ptr + req_idx, last_valid_pos + 1 + num_query_per_req)


def prepare_dflash_inputs_groups(
    input_buffers: Any,
    query_slot_mappings: torch.Tensor,
    group_rows: list[int],
    context_positions: torch.Tensor,
    context_slot_mappings: torch.Tensor,
    sample_indices: torch.Tensor,
    sample_pos: torch.Tensor,
    sample_idx_mapping: torch.Tensor,
    input_batch: Any,
    num_sampled: torch.Tensor,
    num_rejected: torch.Tensor,
    last_sampled: torch.Tensor,
    next_prefill_tokens: torch.Tensor,
    block_tables: list[torch.Tensor],
    block_sizes: list[int],
    parallel_drafting_token_id: int,
    num_query_per_req: int,
    num_speculative_steps: int,
    max_num_reqs: int,
    max_num_tokens: int,
    max_model_len: int,
    sample_from_anchor: bool = False,
) -> bool:
    """vLLM's ``prepare_dflash_inputs`` for groups ``g = 0..G-1`` in one launch: what
    ``prepare_dflash_inputs(..., query_slot_mappings[group_rows[g]], ...,
    context_slot_mappings[g], ..., block_tables[g], block_sizes[g], ...)`` for every
    ``g`` in turn writes, bit for bit.

    Args:
        input_buffers: the drafter's ``InputBuffers`` (``input_ids`` int32, ``positions``
            int64 ``[max_num_tokens]``, ``query_start_loc`` int32 ``[max_num_reqs + 1]``,
            ``seq_lens`` int32 ``[max_num_reqs]``).
        query_slot_mappings: int64 ``[num_kv_cache_groups, >= max_num_tokens]``
            (``BlockTables.slot_mappings``), last dim contiguous.
        group_rows: the G rows of ``query_slot_mappings`` to write (the drafter's KV-cache
            group ids).
        context_positions: int64 ``[max_num_tokens]``.
        context_slot_mappings: int64 ``[>= G, >= max_num_tokens]``, row ``g`` for group
            ``g``, last dim contiguous.
        sample_indices, sample_pos: int64 ``[max_num_reqs * num_speculative_steps]``;
            sample_idx_mapping: int32, same size.
        input_batch: the target's ``InputBatch`` (``positions``, ``query_start_loc``,
            ``idx_mapping``, ``num_reqs``, ``num_scheduled_tokens`` (numpy)).
        num_sampled, num_rejected: int32 ``[num_reqs]``; last_sampled,
            next_prefill_tokens: ``[max_num_reqs]``.
        block_tables: G tensors ``[max_num_reqs, max_num_blocks_g]`` (the groups'
            ``input_block_tables``), last dim contiguous; block_sizes: their G kernel
            block sizes.
        The other arguments are ``prepare_dflash_inputs``'s.

    Returns:
        False (nothing written) when the inputs do not fit one launch (more than
        :data:`MAX_GROUPS` groups, rows out of range, non-contiguous rows): the caller
        then calls ``prepare_dflash_inputs`` once per group. No host sync.
    """
    num_groups = len(block_tables)
    if not 1 <= num_groups <= MAX_GROUPS or len(block_sizes) != num_groups \
            or len(group_rows) != num_groups:
        return False
    if query_slot_mappings.dim() != 2 or context_slot_mappings.dim() != 2 \
            or query_slot_mappings.stride(1) != 1 or context_slot_mappings.stride(1) != 1 \
            or query_slot_mappings.shape[1] < max_num_tokens \
            or context_slot_mappings.shape[1] < max_num_tokens \
            or context_slot_mappings.shape[0] < num_groups \
            or any(not 0 <= r < query_slot_mappings.shape[0] for r in group_rows) \
            or len(set(group_rows)) != num_groups \
            or any(bt.dim() != 2 or bt.stride(1) != 1 for bt in block_tables):
        return False
    num_reqs = input_batch.num_reqs
    assert num_reqs > 0
    # vLLM's grid: the longest per-request span (ctx + query), in blocks of one size for
    # every round (vLLM sizes them to the span: each verify shape of auto, a prefill
    # chunk and a tree decode compiled a variant of their own, mid-serving).
    max_target_query_len = int(input_batch.num_scheduled_tokens.max())
    max_tokens_per_req = max_target_query_len + num_query_per_req
    num_blocks = triton.cdiv(max_tokens_per_req, BLOCK_TOKENS)
    pad = MAX_GROUPS - num_groups
    q_offs = [row * query_slot_mappings.stride(0) for row in group_rows]
    longest_pad = max(max_num_tokens - num_reqs * num_query_per_req,
                      (max_num_reqs - num_reqs) * num_speculative_steps,
                      max_num_reqs + 1 - num_reqs, 1)
    pad_chunks = triton.cdiv(longest_pad, _PAD_BLOCK)
    # Rows 0..R-1: vLLM's programs; row R: the padding (see the kernel).
    _prepare_dflash_inputs_groups_kernel[(num_reqs + 1, max(num_blocks, pad_chunks))](
        input_buffers.input_ids, input_buffers.positions, input_buffers.query_start_loc,
        input_buffers.seq_lens, query_slot_mappings, context_positions,
        context_slot_mappings, sample_indices, sample_pos, sample_idx_mapping,
        input_batch.positions, input_batch.query_start_loc, input_batch.idx_mapping,
        last_sampled, next_prefill_tokens, num_sampled, num_rejected,
        *block_tables, *[block_tables[0]] * pad,
        *[bt.stride(0) for bt in block_tables], *[block_tables[0].stride(0)] * pad,
        *block_sizes, *[block_sizes[0]] * pad,
        *q_offs, *[q_offs[0]] * pad, context_slot_mappings.stride(0),
        parallel_drafting_token_id, num_query_per_req, num_speculative_steps,
        max_num_reqs, max_num_tokens, max_model_len, num_reqs, num_blocks,
        NUM_GROUPS=num_groups, SAMPLE_FROM_ANCHOR=sample_from_anchor,
        PAD_SLOT_ID=PAD_SLOT_ID, BLOCK_SIZE=BLOCK_TOKENS, PAD_BLOCK=_PAD_BLOCK,
    )  # fmt: skip
    return True
