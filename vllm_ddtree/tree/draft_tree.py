# SPDX-License-Identifier: Apache-2.0
"""DDTree draft trees: best-first tree construction and tree-mask bits.

One decoding round (see docs/design.md): the drafter gives logits for depths
1..L; :func:`build_ddtree` keeps the ``budget`` most probable prefixes under the
factorized draft distribution; the target verifies ``[root, nodes...]`` with the
mask of :meth:`DraftTree.ancestor_bits`; :func:`vllm_ddtree.walk.follow.follow_tree` walks the
tree with the target's tokens and returns what to commit and which KV rows to keep.

Node order (a total order, identical in the batched builder and in the heapq
reference):

* nodes are sorted by descending score (cumulative fp32 log-prob);
* among equal scores, the shallower node comes first;
* then the node whose parent comes first (the root counts as -1);
* then the node whose token has the better rank at its depth, where a depth's
  tokens are ranked by descending log-prob and, among equal log-probs, by
  ascending token id.

This is exactly the pop order of the classic best-first enumeration (frontier
starts with the root's best child; popping a node pushes its next sibling and its
first child) with heap key ``(-score, depth, parent index, rank)``. Because
log-probs are <= 0, a child never precedes its parent: the order is topological
and every prefix of it is prefix-closed.

All functions are pure PyTorch and work on CPU and CUDA tensors.
"""

from __future__ import annotations

import functools
import heapq
import math
import struct
from dataclasses import dataclass

import torch

from vllm_ddtree.config import tree_capacity

__all__ = [
    "DraftTree",
    "build_ddtree",
    "build_ddtree_reference",
    "num_mask_words",
    "pack_ancestor_mask",
    "unpack_ancestor_bits",
]

_BITS_PER_WORD = 64


def num_mask_words(n: int) -> int:
    """Number of int64 words that hold ``n`` mask bits: ``ceil(n / 64)``."""
    return (n + _BITS_PER_WORD - 1) // _BITS_PER_WORD


@functools.lru_cache(maxsize=16)
def _bit_values(device: torch.device) -> torch.Tensor:
    # int64 value of each single bit 0..63; bit 63 is INT64_MIN (two's complement).
    values = [1 << j for j in range(_BITS_PER_WORD - 1)] + [-(1 << (_BITS_PER_WORD - 1))]
    return torch.tensor(values, dtype=torch.int64, device=device)


def pack_ancestor_mask(mask: torch.Tensor) -> torch.Tensor:
    """Pack a boolean mask into little-endian int64 words.

    Args:
        mask: bool ``[..., n]``.

    Returns:
        int64 ``[..., ceil(n / 64)]``: bit ``j`` of the mask is bit ``j % 64`` of
        word ``j // 64`` (bit 63 is the sign bit, so such words are negative).
    """
    if mask.dtype != torch.bool:
        raise ValueError(f"mask must be a bool tensor, got {mask.dtype}")
    n = mask.shape[-1]
    num_words = num_mask_words(n)
    pad = num_words * _BITS_PER_WORD - n
    if pad:
        mask = torch.nn.functional.pad(mask, (0, pad))
    mask = mask.reshape(*mask.shape[:-1], num_words, _BITS_PER_WORD)
    # The bits are distinct, so the int64 sum is an exact OR (no overflow, even
    # with bit 63 = INT64_MIN).
    return (mask.to(torch.int64) * _bit_values(mask.device)).sum(dim=-1)


def unpack_ancestor_bits(bits: torch.Tensor, n: int) -> torch.Tensor:
    """Unpack little-endian int64 mask words (inverse of :func:`pack_ancestor_mask`).

    Args:
        bits: int64 ``[..., W]``.
        n: number of bits to return, ``n <= 64 * W``.

    Returns:
        bool ``[..., n]``: element ``j`` is bit ``j % 64`` of word ``j // 64``.
    """
    if bits.dtype != torch.int64:
        raise ValueError(f"bits must be an int64 tensor, got {bits.dtype}")
    num_words = bits.shape[-1]
    if n < 0 or n > num_words * _BITS_PER_WORD:
        raise ValueError(f"n={n} does not fit in {num_words} int64 words")
    shifts = torch.arange(_BITS_PER_WORD, dtype=torch.int64, device=bits.device)
    # Arithmetic right shift of negative words is fine: we only keep the low bit.
    unpacked = (bits.unsqueeze(-1) >> shifts) & 1
    unpacked = unpacked.reshape(*bits.shape[:-1], num_words * _BITS_PER_WORD)
    return unpacked[..., :n].to(torch.bool)


@dataclass
class DraftTree:
    """A batch of draft trees, one per request, each with ``B`` nodes plus the root.

    Nodes are in the order documented in this module (topological: a node's
    parent always has a smaller index). The root (the bonus token of the last
    round) is implicit: it is row 0 of the verify batch, node ``i`` is row
    ``i + 1``.

    Attributes:
        tokens: int64 ``[R, B]``, token id of each node.
        parents: int64 ``[R, B]``, parent node index, ``-1`` for the root.
        depths: int64 ``[R, B]``, 1-based depth (children of the root have depth 1).
        scores: float32 ``[R, B]``, cumulative draft log-prob of the node's prefix.
        packed_bits: int64 ``[R, 1 + B, W]`` or None: :meth:`ancestor_bits` when the
            builder already made them (the Triton build writes them in its launch).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    scores: torch.Tensor
    packed_bits: torch.Tensor | None = None

    def __post_init__(self) -> None:
        shape = self.tokens.shape
        if len(shape) != 2:
            raise ValueError(f"tokens must be [R, B], got shape {tuple(shape)}")
        for name in ("parents", "depths", "scores"):
            other = getattr(self, name).shape
            if other != shape:
                raise ValueError(
                    f"{name} must have the shape of tokens {tuple(shape)}, got {tuple(other)}"
                )

    @property
    def num_requests(self) -> int:
        """R, the number of requests (trees)."""
        return self.tokens.shape[0]

    @property
    def budget(self) -> int:
        """B, the number of nodes per tree (the root excluded)."""
        return self.tokens.shape[1]

    @property
    def device(self) -> torch.device:
        return self.tokens.device

    def ancestor_bits(self) -> torch.Tensor:
        """Packed tree-attention mask of the verify batch ``[root, nodes...]``.

        Returns:
            int64 ``[R, 1 + B, W]``, ``W = ceil((1 + B) / 64)``. Row 0 (the root)
            has bit 0 only; row ``i + 1`` (node ``i``) has bit 0 (the root), bit
            ``p + 1`` for every ancestor node ``p`` and bit ``i + 1`` (itself).
            Bits are little-endian as in :func:`pack_ancestor_mask`.
        """
        if self.packed_bits is not None:
            return self.packed_bits
        num_rows = 1 + self.budget
        num_words = num_mask_words(num_rows)
        device = self.device
        rows = torch.arange(num_rows, device=device)
        self_bits = torch.zeros(num_rows, num_words, dtype=torch.int64, device=device)
        self_bits[rows, rows // _BITS_PER_WORD] = _bit_values(device)[rows % _BITS_PER_WORD]
        bits = self_bits.unsqueeze(0).repeat(self.num_requests, 1, 1)

        # Verify-batch row of each row's parent; the root is its own parent.
        root = torch.zeros(self.num_requests, 1, dtype=torch.int64, device=device)
        jump = torch.cat([root, self.parents.to(torch.int64) + 1], dim=1)
        # Pointer doubling: after s steps a row holds its ancestors at distances
        # 0 .. 2^s - 1 and `jump` points 2^s levels up. Depth <= B, so
        # B.bit_length() steps cover every ancestor without reading the depths
        # on the host.
        for _ in range(self.budget.bit_length()):
            bits = bits | torch.gather(bits, 1, jump.unsqueeze(-1).expand(-1, -1, num_words))
            jump = torch.gather(jump, 1, jump)
        return bits

    def ancestor_mask(self) -> torch.Tensor:
        """Unpacked :meth:`ancestor_bits`: bool ``[R, 1 + B, 1 + B]``, ``[r, q, k]``
        is True iff verify row ``q`` may attend verify row ``k``."""
        return unpack_ancestor_bits(self.ancestor_bits(), 1 + self.budget)

    def positions_offsets(self) -> torch.Tensor:
        """Position of each verify row relative to the root's position.

        Returns:
            int64 ``[R, 1 + B]`` = ``[0, depths...]``.
        """
        root = torch.zeros(self.num_requests, 1, dtype=torch.int64, device=self.device)
        return torch.cat([root, self.depths.to(torch.int64)], dim=1)


# ----------------------------------------------------------------------------------
# Tree construction
# ----------------------------------------------------------------------------------


def _validate_build_args(draft_logits: torch.Tensor, budget: int, top_k: int | None) -> int:
    """Check the arguments of the builders; returns the effective top_k."""
    if not isinstance(draft_logits, torch.Tensor) or draft_logits.dim() != 3:
        shape = tuple(draft_logits.shape) if isinstance(draft_logits, torch.Tensor) else None
        raise ValueError(f"draft_logits must be [R, L, V], got shape {shape}")
    if not draft_logits.is_floating_point():
        raise ValueError(f"draft_logits must be a floating-point tensor, got {draft_logits.dtype}")
    if isinstance(budget, bool) or not isinstance(budget, int):
        raise ValueError(f"budget must be an int, got {type(budget).__name__}")
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int)):
        raise ValueError(f"top_k must be an int or None, got {type(top_k).__name__}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")

    _, num_depths, vocab_size = draft_logits.shape
    k = min(budget, vocab_size) if top_k is None else min(top_k, vocab_size)
    num_nodes = tree_capacity(k, num_depths)
    if num_nodes < budget:
        raise ValueError(
            f"budget={budget} exceeds the number of draft prefixes the tree can hold "
            f"({num_nodes} with L={num_depths}, V={vocab_size}, top_k={k})"
        )
    # A token of rank >= budget at any depth has at least `budget` better
    # prefixes, so ranks beyond the budget are never selected.
    return min(k, budget)


def _draft_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """fp32 log-softmax over the last dim, made safe for ordering: NaN -> -inf
    (a NaN row, e.g. all -inf logits, then ranks by token id), values clamped
    to <= 0 (so a child never outscores its parent) and -0.0 -> +0.0 (so the
    integer sort keys agree with float comparison)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    logprobs = torch.where(torch.isnan(logprobs), float("-inf"), logprobs)
    return logprobs.clamp(max=0.0) + 0.0


def _sort_keys(scores: torch.Tensor) -> torch.Tensor:
    """Unique int64 keys for ``scores`` fp32 ``[..., N]`` (no NaN): a larger key
    means a larger score, or an equal score at a smaller index along the last dim.
    ``topk`` on the keys is therefore deterministic and tie-broken by index."""
    assert scores.dtype == torch.float32
    # + 0.0 turns -0.0 into +0.0, which float comparison treats as equal.
    bits = (scores + 0.0).contiguous().view(torch.int32)
    # Flip the magnitude bits of negative floats: signed int order == float order.
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    n = scores.shape[-1]
    index = torch.arange(n, dtype=torch.int64, device=scores.device)
    return ordered.to(torch.int64) * (1 << 32) + ((1 << 32) - 1 - index)


def _ranked_top_k(logprobs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Best ``k`` tokens of ``logprobs`` fp32 ``[..., V]``, by descending log-prob
    then ascending token id. Returns (log-probs fp32 ``[..., k]``, ids int64
    ``[..., k]``)."""
    tokens = torch.topk(_sort_keys(logprobs), k, dim=-1, sorted=True).indices
    return torch.gather(logprobs, -1, tokens), tokens


# Temporary int64 sort keys of one batched top-k over depths stay under this size (the
# fp32 log-probs and their temporaries come on top, inside the drafter graph's pool);
# more depths are split into several batches.
_RANK_BATCH_BYTES = 64 << 20


def _ranked_top_k_by_depth(draft_logits: torch.Tensor, k: int, rank_batch=None,
                           bytes_per_entry: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_ranked_top_k` of :func:`_draft_logprobs` for every depth of
    ``draft_logits`` ``[R, L, V]``: fp32 / int64 ``[R, L, k]``. Depths go through in
    as few batches as the temporary budget allows (one launch sequence for all L
    depths instead of L: the tree build runs inside the drafter's CUDA graph, where
    each small kernel costs a few microseconds).

    ``rank_batch``: ranks one ``[R, l, V]`` batch of depths the same way (default the
    PyTorch ops above); ``bytes_per_entry``: its temporary bytes per logit (8: the int64
    sort keys)."""
    if rank_batch is None:
        def rank_batch(logits):
            return _ranked_top_k(_draft_logprobs(logits), k)
    num_requests, num_depths, vocab_size = draft_logits.shape
    per_depth = max(1, num_requests * vocab_size * bytes_per_entry)
    step = max(1, min(num_depths, _RANK_BATCH_BYTES // per_depth))
    parts = [rank_batch(draft_logits[:, d : d + step]) for d in range(0, num_depths, step)]
    if len(parts) == 1:
        return parts[0]
    return (torch.cat([p[0] for p in parts], dim=1), torch.cat([p[1] for p in parts], dim=1))


@functools.lru_cache(maxsize=256)
def _beam_candidates(
    budget: int, top_k: int, prev_width: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(parent position, rank) pairs, parent-major, that can reach a depth's top
    ``budget``: candidate (p, k) is beaten by every (p', k') with p' <= p, k' <= k,
    so it needs (p + 1) * (k + 1) <= budget. Returns two int64 ``[C]`` tensors."""
    pairs = [(p, k) for p in range(prev_width) for k in range(min(top_k, budget // (p + 1)))]
    table = torch.tensor(pairs, dtype=torch.int64).reshape(-1, 2).to(device)
    return table[:, 0].contiguous(), table[:, 1].contiguous()


def build_ddtree(draft_logits: torch.Tensor, budget: int, top_k: int | None = None) -> DraftTree:
    """Build the DDTree draft trees of a batch (batched over requests).

    The tree of each request holds the ``budget`` most probable prefixes under
    the factorized draft distribution: a node at depth ``d`` with tokens
    ``t_1..t_d`` has score ``sum_k log_softmax(draft_logits[r, k - 1])[t_k]``
    (fp32, accumulated from depth 1 down). Children of a node are the ``top_k``
    best tokens of the next depth. Nodes come in the order documented in this
    module; the result equals :func:`build_ddtree_reference` exactly.

    Implementation: the top ``budget`` nodes of each depth (a beam) are exactly
    the children of the previous depth's beam, so one ``topk`` per depth plus a
    final merge of the beams selects the nodes; there is one Python loop over
    the depths and none over requests or nodes.

    Args:
        draft_logits: ``[R, L, V]`` drafter logits for depths 1..L, any float
            dtype (computed in fp32).
        budget: B >= 1, the number of nodes per tree (the root excluded).
        top_k: children per node; default ``min(budget, V)``; capped at V.

    Returns:
        A :class:`DraftTree` with ``[R, B]`` tensors on ``draft_logits.device``.

    Raises:
        ValueError: on a bad shape, dtype, ``budget`` or ``top_k``, or if the
            trees cannot hold ``budget`` nodes (sum over d of top_k**d < budget).
    """
    k = _validate_build_args(draft_logits, budget, top_k)
    num_requests, num_depths, _ = draft_logits.shape
    device = draft_logits.device

    beam_scores: list[torch.Tensor] = []  # fp32 [R, W_d], sorted by node order
    beam_tokens: list[torch.Tensor] = []  # int64 [R, W_d]
    beam_parents: list[torch.Tensor] = []  # int64 [R, W_d], position in beam d - 1
    width = 1  # the root
    ranked_logprobs, ranked_tokens = _ranked_top_k_by_depth(draft_logits, k)
    for d in range(num_depths):
        top_logprobs, top_tokens = ranked_logprobs[:, d], ranked_tokens[:, d]
        if d == 0:
            new_width = min(budget, k)
            scores = top_logprobs[:, :new_width]
            tokens = top_tokens[:, :new_width]
            parents = torch.full_like(tokens, -1)
        else:
            parent_pos, rank = _beam_candidates(budget, k, width, device)
            new_width = min(budget, width * k)
            cand_scores = beam_scores[-1][:, parent_pos] + top_logprobs[:, rank]
            # Candidates are parent-major, so the index tie-break of the keys
            # is (parent position, rank): the documented order within a depth.
            chosen = torch.topk(_sort_keys(cand_scores), new_width, dim=-1, sorted=True).indices
            scores = torch.gather(cand_scores, 1, chosen)
            tokens = torch.gather(top_tokens, 1, rank[chosen])
            parents = parent_pos[chosen]
        beam_scores.append(scores)
        beam_tokens.append(tokens)
        beam_parents.append(parents)
        width = new_width

    return merge_beams(beam_scores, beam_tokens, beam_parents, budget)


def merge_beams(beam_scores: list[torch.Tensor], beam_tokens: list[torch.Tensor],
                beam_parents: list[torch.Tensor], budget: int) -> DraftTree:
    """The best ``budget`` nodes of per-depth beams, as a :class:`DraftTree`.

    Beam ``d`` (depth ``d + 1``) holds ``[num_requests, width_d]`` float32 path scores,
    int64 tokens and int64 parents (indices into beam ``d - 1``; -1 at depth 1). Ties
    break on the index of the depth-major concatenation, i.e. (depth, parent, rank).
    A parent scores at least its children, so every chosen node's parent is chosen."""
    num_requests = beam_scores[0].shape[0]
    device = beam_scores[0].device
    widths = [s.shape[1] for s in beam_scores]
    offsets = [0]
    for w in widths[:-1]:
        offsets.append(offsets[-1] + w)
    all_scores = torch.cat(beam_scores, dim=1)
    all_tokens = torch.cat(beam_tokens, dim=1)
    all_parents = torch.cat(
        [p if d == 0 else p + offsets[d - 1] for d, p in enumerate(beam_parents)], dim=1
    )
    all_depths = torch.cat(
        [torch.full((w,), d + 1, dtype=torch.int64, device=device) for d, w in enumerate(widths)]
    )
    chosen = torch.topk(_sort_keys(all_scores), budget, dim=-1, sorted=True).indices

    # Parents as indices into the chosen nodes (a parent is always chosen).
    node_index = torch.full_like(all_tokens, -1)
    node_ids = torch.arange(budget, dtype=torch.int64, device=device)
    node_index.scatter_(1, chosen, node_ids.expand(num_requests, -1))
    parent_flat = torch.gather(all_parents, 1, chosen)
    parents = torch.where(
        parent_flat >= 0,
        torch.gather(node_index, 1, parent_flat.clamp(min=0)),
        -1,
    )
    return DraftTree(
        tokens=torch.gather(all_tokens, 1, chosen),
        parents=parents,
        depths=all_depths[chosen],
        scores=torch.gather(all_scores, 1, chosen),
    )


def _add_f32(a: float, b: float) -> float:
    """fp32 addition of two fp32 values held in Python floats. Rounding the exact
    double sum to fp32 equals the fp32 sum (double has > 2 * 24 + 2 bits)."""
    try:
        return struct.unpack("f", struct.pack("f", a + b))[0]
    except OverflowError:
        return math.copysign(math.inf, a + b)


def build_ddtree_reference(
    draft_logits: torch.Tensor, budget: int, top_k: int | None = None
) -> DraftTree:
    """Readable per-request heapq version of :func:`build_ddtree` (the test oracle).

    Same arguments, result and errors as :func:`build_ddtree`.
    """
    k = _validate_build_args(draft_logits, budget, top_k)
    num_requests, num_depths, vocab_size = draft_logits.shape
    out = {name: [] for name in ("tokens", "parents", "depths", "scores")}
    for r in range(num_requests):
        # ranked[d] = [(log-prob, token)] of the k best tokens at depth d + 1.
        ranked = []
        for d in range(num_depths):
            logprobs = _draft_logprobs(draft_logits[r, d]).tolist()
            order = sorted(range(vocab_size), key=lambda t, lp=logprobs: (-lp[t], t))
            ranked.append([(logprobs[t], t) for t in order[:k]])

        tokens, parents, depths, scores = [], [], [], []
        # Entries: (-score, depth, parent index, rank, parent score).
        frontier = [(-ranked[0][0][0], 1, -1, 0, 0.0)]
        while len(tokens) < budget:
            neg_score, depth, parent, rank, parent_score = heapq.heappop(frontier)
            node = len(tokens)
            tokens.append(ranked[depth - 1][rank][1])
            parents.append(parent)
            depths.append(depth)
            scores.append(-neg_score)
            if rank + 1 < k:
                sibling = _add_f32(parent_score, ranked[depth - 1][rank + 1][0])
                heapq.heappush(frontier, (-sibling, depth, parent, rank + 1, parent_score))
            if depth < num_depths:
                child = _add_f32(-neg_score, ranked[depth][0][0])
                heapq.heappush(frontier, (-child, depth + 1, node, 0, -neg_score))
        out["tokens"].append(tokens)
        out["parents"].append(parents)
        out["depths"].append(depths)
        out["scores"].append(scores)

    device = draft_logits.device

    def as_tensor(rows: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(rows, dtype=dtype, device=device).reshape(num_requests, budget)

    return DraftTree(
        tokens=as_tensor(out["tokens"], torch.int64),
        parents=as_tensor(out["parents"], torch.int64),
        depths=as_tensor(out["depths"], torch.int64),
        scores=as_tensor(out["scores"], torch.float32),
    )
