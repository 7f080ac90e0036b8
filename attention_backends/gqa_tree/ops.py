# SPDX-License-Identifier: Apache-2.0
"""Launcher of GQA tree-verify attention: validation, config choice, kernel launch."""

from __future__ import annotations

import math

import torch

from vllm_ddtree.attention_backends.mla_tree.configs import (
    resolve_num_kv_splits,
)
from vllm_ddtree.attention_backends.mla_tree.ops import (
    compact_partials,
    merge_splits,
    tree_launch_options,
)
from vllm_ddtree.attention_backends.mla_tree.tree_mask import check_tree_batch

from . import kernels
from .configs import GQATileConfig, block_head_dim, select_config

_SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check_gqa_inputs(q, k_cache, v_cache, scale, sliding_window) -> None:
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ValueError(f"q must be a 3-D tensor [T, Hq, Dh], got {getattr(q, 'shape', q)}")
    if q.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"q must be bf16, fp16 or fp32, got {q.dtype}")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(cache, torch.Tensor) or cache.dim() != 4:
            raise ValueError(
                f"{name} must be a 4-D paged cache [num_blocks, page_size, Hkv, Dh], "
                f"got {getattr(cache, 'shape', cache)}"
            )
        if cache.dtype != q.dtype:
            raise ValueError(f"{name} dtype {cache.dtype} must equal q dtype {q.dtype}")
        if cache.device != q.device:
            raise ValueError(f"{name} is on {cache.device}, q on {q.device}")
        if cache.stride(3) != 1:
            raise ValueError(f"{name} must be contiguous along the head dim")
    if k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ in shape"
        )
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"k_cache head dim {k_cache.shape[3]} must equal q's {head_dim}")
    if num_kv_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(
            f"q's {num_q_heads} heads must be a multiple of the caches' {num_kv_heads} KV heads"
        )
    if head_dim > 256:
        raise ValueError(f"head dim {head_dim} is not supported (at most 256)")
    if q.stride(2) != 1:
        raise ValueError("q must be contiguous along the head dim")
    if not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite float, got {scale!r}")
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")


def gqa_tree_verify(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    ancestor_bits: torch.Tensor,
    scale: float,
    *,
    sliding_window: int | None = None,
    num_kv_splits: int | None = None,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    validate_values: bool = True,
    config: GQATileConfig | None = None,
    out: torch.Tensor | None = None,
    active_query_lens: torch.Tensor | None = None,
) -> torch.Tensor:
    """GQA attention of tree-verify query tokens against vLLM's paged K/V caches.

    The new tokens of request ``r`` are q rows ``query_start_loc[r]:query_start_loc[r+1]``
    and the last ``qlen_r`` keys of its sequence. Context keys are visible; new key ``j``
    is visible to new token ``t`` iff bit ``j`` of ``ancestor_bits[t]`` is set (``j <= t``).

    Args:
        q: ``[T, Hq, Dh]`` bf16/fp16/fp32, Dh <= 256.
        k_cache, v_cache: ``[num_blocks, page_size, Hkv, Dh]`` (vLLM's flash-attn layout,
            ``kv_cache[0]`` / ``kv_cache[1]``), q's dtype; ``Hq % Hkv == 0``.
        block_table: int32 ``[R, max_blocks]``.
        seq_lens: int32 ``[R]``: context + new tokens.
        query_start_loc: int32 ``[R + 1]``.
        ancestor_bits: int64 ``[>= T, W]`` (row t: query token t; extra rows are
            ignored), ``W >= ceil(max_query_len / 64)``, last dim contiguous.
        scale: softmax scale.
        sliding_window: if set, a token at position ``p`` sees only keys at positions
            ``> p - sliding_window``. A new token's position is ``ctx_len + depth``
            (depth = number of ancestors, from its bit row), so tree nodes see the same
            window as in autoregressive decoding; context keys' positions are their
            indices.
        num_kv_splits: CTAs per (request, KV head) along the keys (flash-decoding);
            None picks it from the context length and the SM count.
        max_query_len, max_seq_len: host-side maxima; required with
            ``validate_values=False`` (no device sync).
        validate_values: check the metadata values on the host (one sync).
        config: force a tile config.
        out: optional ``[T, Hq, Dh]`` output buffer in q's dtype.
        active_query_lens: optional int32 ``[R]``, ``1 <= active_query_lens[r] <= qlen_r``
            (adaptive tree budget): only the first ``active_query_lens[r]`` new tokens of
            request ``r`` are real; the others (inactive rows) cost no K/V loads and are
            0. The active tokens must not see an inactive one (they form a prefix-closed
            tree in topological order); their results are those without
            ``active_query_lens`` up to rounding (their keys are split over the idle
            CTAs too, so the splits differ). None: every row is active.

    Returns:
        ``[T, Hq, Dh]`` in q's dtype. Rows that see no key, and inactive rows, are 0;
        rows not covered by ``query_start_loc`` are left unwritten.
    """
    _check_gqa_inputs(q, k_cache, v_cache, scale, sliding_window)
    num_tokens, num_q_heads, head_dim = q.shape
    num_blocks, page_size, num_kv_heads, _ = k_cache.shape
    stats = check_tree_batch(
        num_tokens=num_tokens,
        device=q.device,
        block_table=block_table,
        seq_lens=seq_lens,
        query_start_loc=query_start_loc,
        ancestor_bits=ancestor_bits,
        page_size=page_size,
        num_blocks=num_blocks,
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        validate_values=validate_values,
        active_query_lens=active_query_lens,
    )
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(2) != 1:
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype}, contiguous in the last dim")
    num_reqs = seq_lens.shape[0]
    if num_reqs == 0 or stats.max_query_len == 0 or num_tokens == 0:
        return out

    group = num_q_heads // num_kv_heads
    rows = stats.max_query_len * group
    if config is None:
        config = select_config(rows, head_dim, q.dtype)
    row_blocks = -(-rows // config.block_m)
    keys = stats.max_seq_len
    if sliding_window is not None:
        keys = min(keys, sliding_window + stats.max_query_len + config.block_n)
    num_kv_splits = resolve_num_kv_splits(
        num_kv_splits, num_requests=num_reqs * num_kv_heads, row_blocks=row_blocks,
        max_keys=keys, block_n=config.block_n, device=q.device, ctas_per_sm=config.ctas_per_sm,
    )

    block_d = block_head_dim(head_dim)
    has_active = active_query_lens is not None
    merge_base = merge_count = seq_lens  # dummies, never read without active rows
    if has_active:
        # Active rows re-split their keys over the CTAs of inactive ones (kernels.py):
        # compact partials, one BLOCK_M-row slab per CTA, and a per-row split index.
        out_buf, lse_buf, merge_base, merge_count = compact_partials(
            num_reqs * num_kv_heads * row_blocks * num_kv_splits * config.block_m, head_dim,
            num_tokens, num_q_heads, q.device)
        out_strides = (out_buf.stride(0), 0, 0)
        lse_strides = (lse_buf.stride(0), 0, 0)
    else:
        lse_buf = torch.empty(
            num_tokens, num_q_heads, num_kv_splits, dtype=torch.float32, device=q.device
        )
        lse_strides = (lse_buf.stride(0), lse_buf.stride(1), lse_buf.stride(2))
        if num_kv_splits == 1:
            out_buf, out_strides = out, (out.stride(0), out.stride(1), 0)
        else:
            out_buf = torch.empty(num_tokens, num_q_heads, num_kv_splits, head_dim,
                                  dtype=torch.float32, device=q.device)
            out_strides = (out_buf.stride(0), out_buf.stride(1), out_buf.stride(2))
    grid = (row_blocks, num_kv_heads * num_kv_splits, num_reqs)
    kernels._gqa_tree_fwd_kernel[grid](
        q, k_cache, v_cache, block_table, seq_lens, query_start_loc, ancestor_bits,
        out_buf, lse_buf,
        scale * kernels.LOG2E,
        sliding_window or 0,
        num_kv_splits,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_table.stride(0),
        ancestor_bits.stride(0), ancestor_bits.shape[1],
        *out_strides,
        *lse_strides,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        PAGE_SIZE=page_size,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        HAS_WINDOW=sliding_window is not None,
        **tree_launch_options(q, config, seq_lens, active_query_lens, merge_base,
                              merge_count, num_q_heads),
    )  # fmt: skip
    if has_active or num_kv_splits > 1:
        lse = torch.empty(num_tokens, num_q_heads, dtype=torch.float32, device=q.device)
        merge_splits(out_buf, lse_buf, out, lse, num_kv_splits, row_blocks, merge_base,
                     merge_count, config.block_m, block_d, has_active)
    return out
