# SPDX-License-Identifier: Apache-2.0
"""Tree verify as cached context + tree tail, merged by log-sum-exp (experimental).

Every tree row of a request sees all of its cached context and, among the ``Q = 1 + B``
tree keys at the end of its sequence, only its ancestors. The context part therefore
needs no mask: at long context it can go through FlashMLA (``causal=False``,
``cache_seqlens`` = the context length), which took 0.276 ms per layer against our Gluon
v2 kernel's 0.313 at 8 heads / 128k / 65 rows on the H200. The ``Q x Q`` tail with the
ancestor mask is small: :func:`tree_tail_attention` computes it in PyTorch and
:func:`merge_partial_attention` combines the two halves exactly (softmax over a union
of disjoint key sets); ``split_kernels.tree_tail_merge`` does both in one Triton launch.

The backend takes it with ``VLLM_DDTREE_MLA_KERNEL=split`` for launches that
:func:`split_ineligible_reason` allows. :func:`mla_tree_verify_split` is tested on CPU
with the PyTorch context (:func:`context_attention_reference`) against
:func:`~.reference.mla_tree_verify_reference`, and on the GPU with FlashMLA
(``tests/gpu/test_mla_split_gpu.py``, not yet run); ``evals/bench_verify_attention.py
--methods ours_split`` times it. FlashMLA needs 64-token pages and sm_90.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .reference import gather_request_kv
from .tree_mask import dense_new_token_masks

ContextFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def merge_partial_attention(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the union of two disjoint key sets from each set's result.

    Args:
        out_a, out_b: ``[T, H, Dv]`` softmax-weighted values over each key set.
        lse_a, lse_b: fp32 ``[T, H]`` natural-log softmax denominators; ``-inf`` where a
            row saw no key of that set (its ``out`` is then ignored).

    Returns:
        ``out [T, H, Dv]`` fp32 and ``lse [T, H]`` fp32; rows that saw no key in either
        set get ``0`` / ``-inf``.
    """
    lse_max = torch.maximum(lse_a, lse_b)
    safe_max = torch.where(torch.isfinite(lse_max), lse_max, torch.zeros_like(lse_max))
    weight_a = torch.exp(lse_a - safe_max)  # exp(-inf) = 0 for an empty half
    weight_b = torch.exp(lse_b - safe_max)
    total = weight_a + weight_b
    denom = torch.where(total > 0, total, torch.ones_like(total))
    out = (weight_a[..., None] * out_a.float() + weight_b[..., None] * out_b.float())
    out = out / denom[..., None]
    lse = torch.where(total > 0, safe_max + torch.log(denom), torch.full_like(total,
                                                                             float("-inf")))
    return out, lse


def tail_slots(block_table: torch.Tensor, seq_lens: torch.Tensor, query_len: int,
               page_size: int) -> torch.Tensor:
    """Flat cache slots ``[R, Q]`` of each request's last ``query_len`` keys (its tree)."""
    offsets = torch.arange(query_len, device=seq_lens.device)
    start = (seq_lens.to(torch.long) - query_len).clamp(min=0)  # padding requests: slot 0..
    positions = start[:, None] + offsets[None, :]  # [R, Q]
    pages = torch.gather(block_table.to(torch.long), 1, positions // page_size)
    return pages * page_size + positions % page_size


def tree_tail_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_len: int,
    ancestor_bits: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of every tree row to its request's tree keys only (ancestor mask).

    Args:
        q: ``[R * Q, H, D]``, each request's ``Q = query_len`` rows back to back.
        kv_cache: ``[num_blocks, page_size, D]`` latent cache holding the tree's keys.
        block_table: int32 ``[R, max_blocks]``; seq_lens: int32 ``[R]`` (context + Q).
        ancestor_bits: int64 ``[R * Q, W]``.
        scale: softmax scale of ``q . k``; kv_lora_rank: V = the first entries of a row.

    Returns:
        ``out [R * Q, H, kv_lora_rank]`` fp32 and ``lse [R * Q, H]`` fp32. No host sync:
        capturable in a CUDA graph.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_reqs = num_tokens // query_len
    slots = tail_slots(block_table, seq_lens, query_len, kv_cache.shape[1])
    keys = kv_cache.reshape(-1, head_dim)[slots.reshape(-1)].view(num_reqs, query_len,
                                                                  head_dim).float()
    queries = q.reshape(num_reqs, query_len, num_heads, head_dim).float()
    scores = torch.einsum("rthd,rkd->rthk", queries, keys) * scale
    visible = dense_new_token_masks(ancestor_bits, num_reqs, query_len)  # [R, Q(t), Q(k)]
    # a CUDA-graph padding request (seq_len < Q) sees no key
    visible &= (seq_lens >= query_len)[:, None, None]
    scores = scores.masked_fill(~visible[:, :, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [R, Q, H]
    seen = torch.isfinite(lse)
    probs = torch.exp(scores - torch.where(seen, lse, 0.0)[..., None])
    out = torch.einsum("rthk,rkd->rthd", probs, keys[..., :kv_lora_rank])
    return out.reshape(num_tokens, num_heads, kv_lora_rank), lse.reshape(num_tokens, num_heads)


def context_attention_reference(
    q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
    context_lens: torch.Tensor, query_len: int, scale: float, kv_lora_rank: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unmasked attention of every row to its request's first ``context_lens[r]`` keys,
    fp32 PyTorch (the oracle of :func:`context_attention_flashmla`; syncs the host).
    Shapes as :func:`tree_tail_attention`; a request without context gets ``0`` /
    ``-inf``."""
    num_tokens, num_heads, _ = q.shape
    out = torch.zeros(num_tokens, num_heads, kv_lora_rank, dtype=torch.float32,
                      device=q.device)
    lse = torch.full((num_tokens, num_heads), float("-inf"), dtype=torch.float32,
                     device=q.device)
    for r, ctx in enumerate(context_lens.tolist()):
        if ctx <= 0:
            continue
        rows = slice(r * query_len, (r + 1) * query_len)
        kv = gather_request_kv(kv_cache, block_table[r], ctx).float()
        scores = torch.einsum("thd,sd->ths", q[rows].float(), kv) * scale
        lse[rows] = torch.logsumexp(scores, dim=-1)
        out[rows] = torch.einsum("ths,sd->thd", torch.softmax(scores, dim=-1),
                                 kv[:, :kv_lora_rank])
    return out, lse


def context_attention_flashmla(
    q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
    context_lens: torch.Tensor, query_len: int, scale: float, kv_lora_rank: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`context_attention_reference` through vLLM's FlashMLA (sm_90, 64-token
    pages, bf16 / fp16): ``causal=False`` over ``cache_seqlens = context_lens``.

    Raises:
        RuntimeError: FlashMLA is unavailable here, or the page size is not 64.
    """
    from vllm.v1.attention.ops import flashmla as fm

    supported, reason = fm.is_flashmla_dense_supported()
    if not supported:
        raise RuntimeError(f"FlashMLA dense unsupported: {reason}")
    if kv_cache.shape[1] != 64:
        raise RuntimeError(f"FlashMLA needs 64-token pages, the cache has {kv_cache.shape[1]}")
    num_tokens, num_heads, head_dim = q.shape
    num_reqs = num_tokens // query_len
    # A CUDA-graph padding request has no context; FlashMLA is not known to accept a
    # zero length, so it reads one key (its output is discarded with the request's).
    context_lens = context_lens.clamp(min=1)
    meta, _ = fm.get_mla_metadata(context_lens, query_len * num_heads, 1,
                                  is_fp8_kvcache=False)
    out, lse = fm.flash_mla_with_kvcache(
        q=q.reshape(num_reqs, query_len, num_heads, head_dim),
        k_cache=kv_cache.unsqueeze(-2),
        block_table=block_table,
        cache_seqlens=context_lens,
        head_dim_v=kv_lora_rank,
        tile_scheduler_metadata=meta,
        softmax_scale=scale,
        causal=False,
        is_fp8_kvcache=False,
    )
    # out [R, Q, H, Dv]; lse [R, H, Q] -> [T, H]
    return (out.reshape(num_tokens, num_heads, kv_lora_rank),
            lse.transpose(1, 2).reshape(num_tokens, num_heads).float())


FLASHMLA_PAGE_SIZE = 64
FLASHMLA_DIMS = (576, 512)  # head dim (kv_lora 512 + rope 64), value dim


def split_ineligible_reason(q: torch.Tensor, kv_cache: torch.Tensor, num_reqs: int,
                            max_query_len: int, kv_lora_rank: int,
                            active_query_lens: torch.Tensor | None,
                            capability_major: int | None = None) -> str | None:
    """Why a verify launch cannot take :func:`mla_tree_verify_split` with FlashMLA and
    the fused tail (None when it can): host-side facts only, no sync.
    ``capability_major``: the GPU's (default: read from ``q``'s device)."""
    from .split_kernels import MAX_TAIL_KEYS

    if capability_major is None and q.is_cuda:
        capability_major = torch.cuda.get_device_capability(q.device)[0]
    if capability_major != 9:
        return "FlashMLA needs an sm_90 GPU"
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"FlashMLA takes bf16 / fp16, not {q.dtype}"
    if kv_cache.shape[1] != FLASHMLA_PAGE_SIZE:
        return f"FlashMLA needs {FLASHMLA_PAGE_SIZE}-token pages, not {kv_cache.shape[1]}"
    if (q.shape[2], kv_lora_rank) != FLASHMLA_DIMS:
        return f"FlashMLA needs dims {FLASHMLA_DIMS}, not {(q.shape[2], kv_lora_rank)}"
    if active_query_lens is not None:
        return "active query rows (adaptive budget) are not supported by the split"
    if q.shape[0] != num_reqs * max_query_len:
        return "query lengths differ between requests"
    if max_query_len > MAX_TAIL_KEYS:
        return f"more than {MAX_TAIL_KEYS} tree rows"
    return None


def mla_tree_verify_split(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_len: int,
    ancestor_bits: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
    context_fn: ContextFn = context_attention_reference,
    fused_tail: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA tree verify for requests of one query length ``Q`` (DDTree's uniform 1 + B
    rows): the context part by ``context_fn`` (FlashMLA: :func:`context_attention_flashmla`),
    the tree tail by :func:`tree_tail_attention`, merged by log-sum-exp; ``fused_tail``:
    tail and merge in one Triton launch (``split_kernels.tree_tail_merge``).

    Args and shapes as :func:`tree_tail_attention`; ``seq_lens`` include the ``Q`` tree
    keys, which are the last ``Q`` of each request's sequence.

    Returns:
        ``out [R * Q, H, kv_lora_rank]`` in q's dtype and ``lse [R * Q, H]`` fp32, as
        :func:`~.ops.mla_tree_verify` returns them.

    Raises:
        ValueError: ``q`` does not hold a whole number of ``query_len`` rows per request.
    """
    num_reqs = seq_lens.shape[0]
    if query_len < 1 or q.shape[0] != num_reqs * query_len:
        raise ValueError(f"q has {q.shape[0]} rows: query_len ({query_len}) x requests "
                         f"({num_reqs}) expected (uniform tree rows only)")
    context_lens = (seq_lens - query_len).clamp(min=0).to(torch.int32)
    ctx_out, ctx_lse = context_fn(q, kv_cache, block_table, context_lens, query_len, scale,
                                  kv_lora_rank)
    if fused_tail:
        from .split_kernels import tree_tail_merge

        return tree_tail_merge(q, kv_cache, block_table, seq_lens, query_len, ancestor_bits,
                               scale, kv_lora_rank, ctx_out, ctx_lse)
    tail_out, tail_lse = tree_tail_attention(q, kv_cache, block_table, seq_lens, query_len,
                                             ancestor_bits, scale, kv_lora_rank)
    out, lse = merge_partial_attention(ctx_out, ctx_lse, tail_out, tail_lse)
    return out.to(q.dtype), lse
