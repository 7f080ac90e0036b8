# SPDX-License-Identifier: Apache-2.0
"""The beam selection of :func:`vllm_ddtree.tree.draft_tree.build_ddtree` as one Triton kernel.

``build_ddtree`` ranks each depth's vocabulary (one batched log-softmax + top-k over
all depths), then walks the depths in Python: per depth an index, an add, int64 sort
keys (~9 ops), a top-k and 4 gathers, then a merge of the beams (~15 ops). Inside the
drafter's CUDA graph each of those ~250 small kernels still costs a few microseconds;
on the H200 the draft step of DDTree took 3.1 ms against 0.9 ms for vLLM's DFlash
chain with the same drafter (``evals/results/e2e_trained.md``).

``_build_tree_kernel``: grid ``(R,)``, one program per request, after the same
vocabulary ranking (``tree._ranked_top_k_by_depth``'s result, ranked by
``vocab_top_k_kernel.ranked_top_k_triton`` in two launches after PyTorch's
log-softmax):

1. depth 1's beam is its first ``W_1 = min(B, k)`` ranked tokens;
2. for each next depth, the candidates ``(parent position p, rank j)`` that can reach
   the depth's top ``B`` (``tree._beam_candidates``, a host table cached per shape)
   get the score ``beam[p] + logprob[j]`` (the same fp32 add as ``build_ddtree``) and
   the same unique int64 sort key (score, then candidate order); ``tl.sort`` ranks
   them and the first ``W_d`` form the depth's beam, written to a per-request scratch
   row in depth-major order (a barrier before the next depth reads it);
3. the merge sorts every beam node by (score, depth-major position) and keeps the
   first ``B``; parents become indices into the chosen nodes through a scratch map;
4. each kept node follows its parents (at most L steps) to set its row of the packed
   ancestor bits (``DraftTree.ancestor_bits``, ~30 small kernels in PyTorch).

:func:`build_ddtree_fast` uses it for CUDA tensors and ``build_ddtree`` for CPU ones.
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

from vllm_ddtree.tree.draft_tree import (
    DraftTree,
    _beam_candidates,
    _ranked_top_k_by_depth,
    _validate_build_args,
    build_ddtree,
    num_mask_words,
)
from vllm_ddtree.tree.vocab_top_k_kernel import (
    _key_index,
    _sort_key,
    ranked_top_k_fits,
    ranked_top_k_triton,
)
from vllm_ddtree.triton_path import use_triton

__all__ = ["MAX_BLOCK", "build_ddtree_fast", "build_ddtree_triton", "beam_plan"]

# Largest candidate / node block one program sorts in registers (int64 keys).
MAX_BLOCK = 4096


@triton.jit(do_not_specialize=["num_depths", "budget", "top_k"])
def _build_tree_kernel(
    LogProbs, Tokens, Cands, Widths, Offsets, DepthOf,
    BeamScores, BeamTokens, BeamParents, NodeIndex, NodeParents,
    OutTokens, OutParents, OutDepths, OutScores, OutBits,
    num_depths, budget, top_k, num_words,
    stride_lp_r, stride_lp_d, stride_tok_r, stride_tok_d,
    stride_tokens_r, stride_parents_r, stride_depths_r, stride_scores_r,
    stride_bits_r, stride_bits_q,
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
    tl.store(OutTokens + r * stride_tokens_r + offs_n, tl.load(beam_tokens + node, mask=keep),
             mask=keep)
    tl.store(OutParents + r * stride_parents_r + offs_n, parent_node.to(tl.int64), mask=keep)
    tl.store(OutDepths + r * stride_depths_r + offs_n,
             tl.load(DepthOf + node, mask=keep).to(tl.int64), mask=keep)
    tl.store(OutScores + r * stride_scores_r + offs_n, tl.load(beam_scores + node, mask=keep),
             mask=keep)

    # Ancestor bits (DraftTree.ancestor_bits): verify row i + 1 holds the bits of node
    # i and of every node above it, found by following the parents (a node at depth d
    # has d of them, itself included), and bit 0, the root.
    node_parents = NodeParents + r * BLOCK_N
    tl.store(node_parents + offs_n, parent_node, mask=keep)
    tl.debug_barrier()
    bits_row = OutBits + r * stride_bits_r
    for w in range(num_words):
        root_bit = tl.where(offs_n * 0 + w == 0, 1, 0).to(tl.int64)  # bit 0 of word 0
        word = root_bit
        cur = tl.where(keep, offs_n, -1)
        for _ in range(num_depths):
            verify_row = cur + 1
            bit = tl.full((BLOCK_N,), 1, tl.int64) << (verify_row % 64).to(tl.int64)
            word = word | tl.where((cur >= 0) & (verify_row // 64 == w), bit, 0)
            cur = tl.load(node_parents + tl.maximum(cur, 0), mask=cur >= 0, other=-1)
        tl.store(bits_row + w + offs_n * 0, root_bit, mask=offs_n == 0)  # the root's row
        tl.store(bits_row + (1 + offs_n) * stride_bits_q + w, word, mask=keep)


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


def _ranked_top_k(draft_logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``tree._ranked_top_k_by_depth(draft_logits, k)`` (fp32 / int64 ``[R, L, k]``, bit
    for bit) with each depth batch ranked by :func:`ranked_top_k_triton`'s two launches
    after PyTorch's log-softmax (its fp32 log-probs are what the batches are sized by);
    the PyTorch ranking when ``k`` is past the merge block."""
    if not ranked_top_k_fits(draft_logits.shape[-1], k):
        return _ranked_top_k_by_depth(draft_logits, k)
    return _ranked_top_k_by_depth(
        draft_logits, k,
        rank_batch=lambda logits: ranked_top_k_triton(
            torch.log_softmax(logits.float(), dim=-1), k),
        bytes_per_entry=4,
    )  # fmt: skip


@functools.lru_cache(maxsize=64)
def _tree_layout(num_requests: int, budget: int) -> tuple:
    """``(field, dtype, shape)`` of every tensor of a built tree (packed bits included)."""
    nodes = (num_requests, budget)
    return (("tokens", torch.int64, nodes), ("parents", torch.int64, nodes),
            ("depths", torch.int64, nodes), ("scores", torch.float32, nodes),
            ("packed_bits", torch.int64,
             (num_requests, 1 + budget, num_mask_words(1 + budget))))


def _empty_tree(num_requests: int, budget: int, device: torch.device) -> DraftTree:
    return DraftTree(**{name: torch.empty(shape, dtype=dtype, device=device)
                        for name, dtype, shape in _tree_layout(num_requests, budget)})


def _check_out(out: DraftTree, num_requests: int, budget: int) -> None:
    for name, dtype, shape in _tree_layout(num_requests, budget):
        t = getattr(out, name)
        if t is None or t.dtype != dtype or tuple(t.shape) != shape or t.stride(-1) != 1:
            got = None if t is None else (t.dtype, tuple(t.shape), t.stride())
            raise ValueError(f"out.{name} must be {dtype} {shape} with unit last stride, "
                             f"got {got}")


def build_ddtree_triton(draft_logits: torch.Tensor, budget: int,
                        top_k: int | None = None, *, out: DraftTree | None = None
                        ) -> DraftTree | None:
    """``build_ddtree(draft_logits, budget, top_k)`` with the vocabulary ranking in two
    Triton launches (``vocab_top_k_kernel``) and the beam selection, merge and ancestor
    bits in one; None when the blocks would exceed :data:`MAX_BLOCK`.

    Args and result as :func:`vllm_ddtree.tree.draft_tree.build_ddtree` (``[R, L, V]`` logits;
    int64 / fp32 ``[R, B]`` tree), plus ``packed_bits`` (``DraftTree.ancestor_bits``,
    int64 ``[R, 1 + B, W]``). ``out``: a tree of those shapes and dtypes (rows may be
    strided) the launch writes into instead of new tensors (the speculator's
    persistent buffers). Raises ``build_ddtree``'s ``ValueError`` on bad arguments.
    """
    k = _validate_build_args(draft_logits, budget, top_k)
    num_requests, num_depths, _ = draft_logits.shape
    device = draft_logits.device
    plan = beam_plan(budget, k, num_depths, device)
    if plan is None:
        return None
    if out is None:
        out = _empty_tree(num_requests, budget, device)
    else:
        _check_out(out, num_requests, budget)
    if not num_requests:
        return out
    cands, widths, offsets, depth_of, block_c, block_n = plan
    logprobs, tokens = _ranked_top_k(draft_logits, k)  # [R, L, k]
    scratch_f32 = torch.empty(num_requests, block_n, dtype=torch.float32, device=device)
    beam_tokens = torch.empty(num_requests, block_n, dtype=torch.int64, device=device)
    scratch_i32 = torch.empty(3, num_requests, block_n, dtype=torch.int32, device=device)
    beam_parents, node_index, node_parents = scratch_i32.unbind(0)
    bits = out.packed_bits
    _build_tree_kernel[(num_requests,)](
        logprobs, tokens, cands, widths, offsets, depth_of,
        scratch_f32, beam_tokens, beam_parents, node_index, node_parents,
        out.tokens, out.parents, out.depths, out.scores, bits,
        num_depths, budget, k, bits.shape[-1],
        logprobs.stride(0), logprobs.stride(1), tokens.stride(0), tokens.stride(1),
        out.tokens.stride(0), out.parents.stride(0), out.depths.stride(0),
        out.scores.stride(0), bits.stride(0), bits.stride(1),
        BLOCK_C=block_c, BLOCK_N=block_n,
        num_warps=8 if block_n >= 1024 else 4,
    )  # fmt: skip
    return out


def build_ddtree_fast(draft_logits: torch.Tensor, budget: int, top_k: int | None = None,
                      *, out: DraftTree | None = None, force_triton: bool = False
                      ) -> DraftTree:
    """The tree build of the speculator: :func:`build_ddtree_triton` on CUDA tensors for a
    budget within the kernel's blocks, ``draft_tree.build_ddtree`` otherwise. Same
    arguments and result; with ``out`` (as :func:`build_ddtree_triton`'s) the tree and
    its ``packed_bits`` are written there and ``out`` is returned. ``force_triton`` runs
    the kernel on CPU tensors too (tests, with ``TRITON_INTERPRET=1``)."""
    if force_triton or use_triton(draft_logits):
        tree = build_ddtree_triton(draft_logits, budget, top_k, out=out)
        if tree is not None:
            return tree
    tree = build_ddtree(draft_logits, budget, top_k)
    if out is None:
        return tree
    _check_out(out, *tree.tokens.shape)
    for name in ("tokens", "parents", "depths", "scores"):
        getattr(out, name).copy_(getattr(tree, name))
    out.packed_bits.copy_(tree.ancestor_bits())
    return out
