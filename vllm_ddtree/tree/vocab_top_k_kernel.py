# SPDX-License-Identifier: Apache-2.0
"""The vocabulary ranking of the tree build (``tree._ranked_top_k_by_depth``) as two
Triton launches.

``tree._ranked_top_k`` builds unique int64 sort keys over the whole ``[R, L, V]``
log-prob tensor (~9 elementwise kernels), then a multi-pass radix ``topk`` over them
and a gather: some 30-40 kernels inside the drafter's CUDA graph, about 0.1-0.2 ms at
V = 152k-164k on the H200 (``evals/results/tree_build.md``). Here:

1. ``_chunk_top_k_kernel``, grid ``(R * L, ceil(V / CHUNK))``: each program loads one
   chunk of a row's log-probs, applies ``tree._draft_logprobs``' clean-up (NaN ->
   -inf, clamp to <= 0, -0.0 -> +0.0), makes the same sort keys in registers and keeps
   the chunk's best ``K`` with ``tl.topk`` (a bitonic top-k);
2. ``_merge_top_k_kernel``, grid ``(R * L,)``: the best ``k`` of the row's chunk
   winners; log-prob and token id are decoded from the key.

The keys are unique (score, then token id), so the result equals ``_ranked_top_k``
bit for bit: the same tokens in the same order and the same fp32 values.
``log_softmax`` itself stays PyTorch's (its values are the tree's scores, which the
reference builds compare bit for bit).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["MAX_MERGE_BLOCK", "ranked_top_k_fits", "ranked_top_k_triton"]

# Vocabulary entries one program of the first pass ranks.
_CHUNK = 4096
# Largest candidate block the merge program ranks (chunks x K int64 keys); beyond it
# (very large top-k) the PyTorch ranking is used.
MAX_MERGE_BLOCK = 8192


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


@triton.jit
def _key_score(key):
    """The (+0.0-normalised) fp32 ``score`` a :func:`_sort_key` key was made with."""
    ordered = (key >> 32).to(tl.int32)
    return tl.where(ordered < 0, ordered ^ 0x7FFFFFFF, ordered).to(tl.float32, bitcast=True)


@triton.jit
def _logprob_sort_key(logprob, index):
    """:func:`_sort_key` of ``tree._draft_logprobs``' clean-up of ``logprob`` (NaN ->
    -inf, clamped to <= 0)."""
    score = tl.where(logprob != logprob, float("-inf"), logprob)
    return _sort_key(tl.minimum(score, 0.0), index)


@triton.jit
def _chunk_top_k_kernel(
    LogProbs, Keys, vocab_size, stride_row, num_chunks,
    CHUNK: tl.constexpr, K: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    in_vocab = offs < vocab_size
    logprob = tl.load(LogProbs + row * stride_row + offs, mask=in_vocab, other=0.0)
    key = tl.where(in_vocab, _logprob_sort_key(logprob, offs), -9223372036854775807)
    best = tl.topk(key, K)  # descending
    tl.store(Keys + (row * num_chunks + chunk) * K + tl.arange(0, K), best)


@triton.jit
def _merge_top_k_kernel(
    Keys, OutLogProbs, OutTokens, num_cands, k, stride_out_row,
    BLOCK: tl.constexpr, K: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    key = tl.load(Keys + row * num_cands + offs, mask=offs < num_cands, other=-9223372036854775807)
    best = tl.topk(key, K)
    offs_k = tl.arange(0, K)
    out = row * stride_out_row + offs_k
    tl.store(OutLogProbs + out, _key_score(best), mask=offs_k < k)
    tl.store(OutTokens + out, _key_index(best), mask=offs_k < k)


def _plan(vocab_size: int, k: int) -> tuple[int, int, int, int] | None:
    """``(CHUNK, num_chunks, K, BLOCK)`` for ``(V, k)``, or None past the merge block."""
    k_block = max(2, triton.next_power_of_2(k))  # tl.topk needs k >= 2
    chunk = max(min(_CHUNK, triton.next_power_of_2(vocab_size)), k_block)
    num_chunks = triton.cdiv(vocab_size, chunk)
    block = triton.next_power_of_2(num_chunks * k_block)
    if block > MAX_MERGE_BLOCK:
        return None
    return chunk, num_chunks, k_block, block


def ranked_top_k_fits(vocab_size: int, k: int) -> bool:
    """Whether :func:`ranked_top_k_triton` ranks a ``V``-token vocabulary for ``k``
    (its merge block holds the chunks' candidates)."""
    return _plan(vocab_size, k) is not None


def ranked_top_k_triton(logprobs: torch.Tensor, k: int
                        ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The best ``k`` tokens of each row of ``logprobs`` fp32 ``[R, L, V]`` (PyTorch's
    ``log_softmax``), by descending cleaned log-prob then ascending token id, as
    ``tree._ranked_top_k(tree._draft_logprobs-cleaned logprobs, k)``.

    Returns (log-probs fp32 ``[R, L, k]``, token ids int64 ``[R, L, k]``), or None when
    ``k`` is too large for the merge block (the caller ranks with PyTorch). No host
    sync; two launches.
    """
    if logprobs.dtype != torch.float32 or logprobs.dim() != 3:
        raise ValueError(f"logprobs must be fp32 [R, L, V], got {logprobs.dtype} "
                         f"{tuple(logprobs.shape)}")
    num_requests, num_depths, vocab_size = logprobs.shape
    if not 1 <= k <= vocab_size:
        raise ValueError(f"k must be in [1, V={vocab_size}], got {k}")
    plan = _plan(vocab_size, k)
    if plan is None:
        return None
    chunk, num_chunks, k_block, block = plan
    rows = num_requests * num_depths
    device = logprobs.device
    out_logprobs = torch.empty(num_requests, num_depths, k, dtype=torch.float32,
                               device=device)
    out_tokens = torch.empty(num_requests, num_depths, k, dtype=torch.int64, device=device)
    if rows == 0:
        return out_logprobs, out_tokens
    flat = logprobs.reshape(rows, vocab_size)
    if flat.stride(1) != 1:
        flat = flat.contiguous()
    keys = torch.empty(rows, num_chunks * k_block, dtype=torch.int64, device=device)
    _chunk_top_k_kernel[(rows, num_chunks)](
        flat, keys, vocab_size, flat.stride(0), num_chunks,
        CHUNK=chunk, K=k_block, num_warps=8 if chunk >= 4096 else 4,
    )  # fmt: skip
    _merge_top_k_kernel[(rows,)](
        keys, out_logprobs, out_tokens, num_chunks * k_block, k, k,
        BLOCK=block, K=k_block, num_warps=8 if block >= 4096 else 4,
    )  # fmt: skip
    return out_logprobs, out_tokens
