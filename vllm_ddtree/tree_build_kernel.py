# SPDX-License-Identifier: Apache-2.0
"""The beam selection of :func:`vllm_ddtree.tree.build_ddtree` as one Triton kernel.

``build_ddtree`` ranks each depth's vocabulary (one batched log-softmax + top-k over
all depths), then walks the depths in Python: per depth an index, an add, int64 sort
keys (~9 ops), a top-k and 4 gathers, then a merge of the beams (~15 ops). Inside the
drafter's CUDA graph each of those ~250 small kernels still costs a few microseconds;
on the H200 the draft step of DDTree took 3.1 ms against 0.9 ms for vLLM's DFlash
chain with the same drafter (``evals/results/e2e_trained.md``).

``_build_tree_kernel``: grid ``(R,)``, one program per request, after the same
vocabulary ranking (:func:`vllm_ddtree.tree._ranked_top_k_by_depth`):

1. depth 1's beam is its first ``W_1 = min(B, k)`` ranked tokens;
2. for each next depth, the candidates ``(parent position p, rank j)`` that can reach
   the depth's top ``B`` (``tree._beam_candidates``, a host table cached per shape)
   get the score ``beam[p] + logprob[j]`` (the same fp32 add as ``build_ddtree``) and
   the same unique int64 sort key (score, then candidate order); ``tl.sort`` ranks
   them and the first ``W_d`` form the depth's beam, written to a per-request scratch
   row in depth-major order (a barrier before the next depth reads it);
3. the merge sorts every beam node by (score, depth-major position) and keeps the
   first ``B``; parents become indices into the chosen nodes through a scratch map.

:func:`build_ddtree_fast` uses it on CUDA by default (``VLLM_DDTREE_TREE_BUILD=torch``
goes back to ``build_ddtree``); the mixed-batch GPU suite passed with it on the H200.
The result equals ``build_ddtree`` bit for bit (same keys, same tie order), which
``tests/test_tree_build_kernel.py`` checks against it and against the heapq reference.
Shapes depend only on (R, L, V, B, top_k): no host sync; the host tables are built on
first use (``speculator.warm_tree_caches`` runs one build before the drafter's graph
is captured). Candidate and node counts above :data:`MAX_BLOCK` (very large budgets)
use ``build_ddtree``.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from vllm_ddtree.round_kernels import use_triton_tree_build
from vllm_ddtree.tree import (
    DraftTree,
    _beam_candidates,
    _ranked_top_k_by_depth,
    _validate_build_args,
    build_ddtree,
)

__all__ = ["MAX_BLOCK", "build_ddtree_fast", "build_ddtree_triton", "beam_plan"]

# Largest candidate / node block one program sorts in registers (int64 keys).
MAX_BLOCK = 4096


@triton.jit
def _sort_key(score, index):
    """Unique int64 key: larger for a larger fp32 ``score``, or an equal score at a
    smaller ``index`` (as ``tree._sort_keys``; -0.0 counts as +0.0)."""
    bits = (score + 0.0).to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return ordered.to(tl.int64) * 4294967296 + (4294967295 - index.to(tl.int64))


@triton.jit
def _key_index(key):
    """The ``index`` a :func:`_sort_key` key was made with."""
    return 4294967295 - (key & 4294967295)


@triton.jit(do_not_specialize=["num_depths", "budget", "top_k"])
def _build_tree_kernel(
    LogProbs, Tokens, Cands, Widths, Offsets, DepthOf,
    BeamScores, BeamTokens, BeamParents, NodeIndex,
    OutTokens, OutParents, OutDepths, OutScores,
    num_depths, budget, top_k,
    stride_lp_r, stride_lp_d, stride_tok_r, stride_tok_d, stride_out_r,
    BLOCK_C: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0).to(tl.int64)
    lp_row = LogProbs + r * stride_lp_r
    tok_row = Tokens + r * stride_tok_r
    beam_scores = BeamScores + r * BLOCK_N
    beam_tokens = BeamTokens + r * BLOCK_N
    beam_parents = BeamParents + r * BLOCK_N
    offs_c = tl.arange(0, BLOCK_C)
    offs_n = tl.arange(0, BLOCK_N)

    # Depth 1: the first W_1 ranked tokens, children of the root.
    width = tl.load(Widths)
    first = offs_c < width
    tl.store(beam_scores + offs_c, tl.load(lp_row + offs_c, mask=first), mask=first)
    tl.store(beam_tokens + offs_c, tl.load(tok_row + offs_c, mask=first), mask=first)
    tl.store(beam_parents + offs_c, tl.full((BLOCK_C,), -1, tl.int32), mask=first)
    tl.debug_barrier()

    for d in range(1, num_depths):
        prev = tl.load(Offsets + d - 1)
        start = tl.load(Offsets + d)
        width = tl.load(Widths + d)
        cand = tl.load(Cands + d * BLOCK_C + offs_c)  # p * top_k + j, -1: padding
        valid = cand >= 0
        parent = tl.where(valid, cand // top_k, 0)
        rank = tl.where(valid, cand % top_k, 0)
        score = (tl.load(beam_scores + prev + parent, mask=valid, other=0.0)
                 + tl.load(lp_row + d * stride_lp_d + rank, mask=valid, other=0.0))
        key = tl.where(valid, _sort_key(score, offs_c), -9223372036854775807)
        chosen = _key_index(tl.sort(key, descending=True))  # candidate positions, best first
        take = offs_c < width
        cand = tl.load(Cands + d * BLOCK_C + chosen, mask=take, other=0)
        parent = cand // top_k
        rank = cand % top_k
        score = (tl.load(beam_scores + prev + parent, mask=take, other=0.0)
                 + tl.load(lp_row + d * stride_lp_d + rank, mask=take, other=0.0))
        token = tl.load(tok_row + d * stride_tok_d + rank, mask=take, other=0)
        tl.store(beam_scores + start + offs_c, score, mask=take)
        tl.store(beam_tokens + start + offs_c, token, mask=take)
        tl.store(beam_parents + start + offs_c, (prev + parent).to(tl.int32), mask=take)
        tl.debug_barrier()

    # Merge: every beam node by (score, depth-major position); the first B are the tree.
    num_nodes = tl.load(Offsets + num_depths)
    in_beam = offs_n < num_nodes
    key = tl.where(in_beam, _sort_key(tl.load(beam_scores + offs_n, mask=in_beam, other=0.0),
                                      offs_n), -9223372036854775807)
    node = _key_index(tl.sort(key, descending=True))  # beam positions, tree order
    keep = offs_n < budget
    node_index = NodeIndex + r * BLOCK_N
    tl.store(node_index + node, offs_n.to(tl.int32), mask=keep)
    tl.debug_barrier()
    parent = tl.load(beam_parents + node, mask=keep, other=-1)
    parent_node = tl.load(node_index + tl.maximum(parent, 0), mask=keep & (parent >= 0),
                          other=-1)
    out = r * stride_out_r + offs_n
    tl.store(OutTokens + out, tl.load(beam_tokens + node, mask=keep), mask=keep)
    tl.store(OutParents + out, parent_node.to(tl.int64), mask=keep)
    tl.store(OutDepths + out, tl.load(DepthOf + node, mask=keep).to(tl.int64), mask=keep)
    tl.store(OutScores + out, tl.load(beam_scores + node, mask=keep), mask=keep)


def _beam_widths(budget: int, top_k: int, num_depths: int) -> list[int]:
    """Beam width per depth, as ``build_ddtree``: ``min(B, k)``, then
    ``min(B, W_prev * k)``."""
    widths = [min(budget, top_k)]
    for _ in range(1, num_depths):
        widths.append(min(budget, widths[-1] * top_k))
    return widths


@functools.lru_cache(maxsize=64)
def beam_plan(budget: int, top_k: int, num_depths: int, device: torch.device):
    """Host-made tables of one (B, k, L), cached (built before any graph capture):
    ``(cands int32 [L, BLOCK_C], widths int32 [L], offsets int32 [L + 1], depth_of
    int32 [BLOCK_N], BLOCK_C, BLOCK_N)`` or None when a block would exceed
    :data:`MAX_BLOCK`. ``cands[d]`` lists depth ``d``'s candidates ``p * k + j`` in
    ``_beam_candidates`` order, -1 after them."""
    widths = _beam_widths(budget, top_k, num_depths)
    offsets = [0]
    for w in widths:
        offsets.append(offsets[-1] + w)
    rows = [list(range(widths[0]))]  # depth 1: rank j of the root (unused table row)
    for d in range(1, num_depths):
        parent, rank = _beam_candidates(budget, top_k, widths[d - 1], torch.device("cpu"))
        rows.append((parent * top_k + rank).tolist())
    block_c = triton.next_power_of_2(max(len(row) for row in rows))
    block_n = triton.next_power_of_2(offsets[-1])
    if max(block_c, block_n) > MAX_BLOCK:
        return None
    # Depth 1's beam is written through the candidate block: W_1 <= C_2 <= BLOCK_C
    # (the first parent alone has min(k, B) = W_1 candidates).
    block_c = max(block_c, triton.next_power_of_2(widths[0]))
    cands = torch.full((num_depths, block_c), -1, dtype=torch.int32)
    for d, row in enumerate(rows):
        cands[d, : len(row)] = torch.tensor(row, dtype=torch.int32)
    depth_of = torch.zeros(block_n, dtype=torch.int32)
    for d in range(num_depths):
        depth_of[offsets[d] : offsets[d + 1]] = d + 1
    return (cands.to(device), torch.tensor(widths, dtype=torch.int32).to(device),
            torch.tensor(offsets, dtype=torch.int32).to(device), depth_of.to(device),
            block_c, block_n)


def build_ddtree_triton(draft_logits: torch.Tensor, budget: int,
                        top_k: int | None = None) -> DraftTree | None:
    """``build_ddtree(draft_logits, budget, top_k)`` with the beam selection and merge
    in one Triton launch; None when the blocks would exceed :data:`MAX_BLOCK`.

    Args and result as :func:`vllm_ddtree.tree.build_ddtree` (``[R, L, V]`` logits;
    int64 / fp32 ``[R, B]`` tree). Raises its ``ValueError`` on bad arguments.
    """
    k = _validate_build_args(draft_logits, budget, top_k)
    num_requests, num_depths, _ = draft_logits.shape
    device = draft_logits.device
    plan = beam_plan(budget, k, num_depths, device)
    if plan is None:
        return None
    cands, widths, offsets, depth_of, block_c, block_n = plan
    logprobs, tokens = _ranked_top_k_by_depth(draft_logits, k)  # [R, L, k]
    beam_scores = torch.empty(num_requests, block_n, dtype=torch.float32, device=device)
    beam_tokens = torch.empty(num_requests, block_n, dtype=torch.int64, device=device)
    beam_parents = torch.empty(num_requests, block_n, dtype=torch.int32, device=device)
    node_index = torch.empty(num_requests, block_n, dtype=torch.int32, device=device)
    out_tokens = torch.empty(num_requests, budget, dtype=torch.int64, device=device)
    out_parents = torch.empty_like(out_tokens)
    out_depths = torch.empty_like(out_tokens)
    out_scores = torch.empty(num_requests, budget, dtype=torch.float32, device=device)
    if num_requests:
        _build_tree_kernel[(num_requests,)](
            logprobs, tokens, cands, widths, offsets, depth_of,
            beam_scores, beam_tokens, beam_parents, node_index,
            out_tokens, out_parents, out_depths, out_scores,
            num_depths, budget, k,
            logprobs.stride(0), logprobs.stride(1), tokens.stride(0), tokens.stride(1),
            out_tokens.stride(0),
            BLOCK_C=block_c, BLOCK_N=block_n,
            num_warps=8 if block_n >= 1024 else 4,
        )  # fmt: skip
    return DraftTree(tokens=out_tokens, parents=out_parents, depths=out_depths,
                     scores=out_scores)


def build_ddtree_fast(draft_logits: torch.Tensor, budget: int, top_k: int | None = None,
                      *, force_triton: bool = False) -> DraftTree:
    """The tree build of the speculator: :func:`build_ddtree_triton` on CUDA tensors
    (unless ``VLLM_DDTREE_TREE_BUILD=torch``, ``vllm_ddtree.round_kernels``) for a
    budget within the kernel's blocks, :func:`vllm_ddtree.tree.build_ddtree` otherwise. Same
    arguments and result; ``force_triton`` runs the kernel on CPU tensors too (tests,
    with ``TRITON_INTERPRET=1``)."""
    if force_triton or use_triton_tree_build(draft_logits):
        tree = build_ddtree_triton(draft_logits, budget, top_k)
        if tree is not None:
            return tree
    return build_ddtree(draft_logits, budget, top_k)
