# SPDX-License-Identifier: Apache-2.0
"""Tile configurations of the GQA tree-verify kernel and their shared-memory cost."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from vllm_ddtree.attention_backends.mla_tree.configs import SM120_SHARED_MEMORY_BYTES


@dataclass(frozen=True)
class GQATileConfig:
    """One launch configuration of ``_gqa_tree_fwd_kernel``.

    Attributes:
        block_m: rows ``(token, q head of the group)`` per CTA.
        block_n: keys per K/V tile (at most 64).
        num_warps: warps per CTA.
        num_stages: pipelining depth (``num_stages - 1`` K/V tiles in flight).
        min_rows: picked for requests with at least this many rows per KV head
            (``max_query_len * group``); the largest qualifying ``min_rows`` wins.
        ctas_per_sm: resident CTAs per SM, for the split heuristic.
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    min_rows: int = 0
    ctas_per_sm: int = 2


GQA_TILE_CONFIGS: tuple[GQATileConfig, ...] = (
    GQATileConfig(block_m=16, block_n=64, num_warps=4, num_stages=3, min_rows=0),
    GQATileConfig(block_m=64, block_n=32, num_warps=8, num_stages=3, min_rows=32),
)


def block_head_dim(head_dim: int) -> int:
    """Power-of-two tile width (at least 16) for ``head_dim``."""
    return max(16, 1 << (head_dim - 1).bit_length())


def estimate_shared_memory_bytes(config: GQATileConfig, head_dim: int, dtype: torch.dtype) -> int:
    """Upper estimate of one CTA's shared memory on mma.sync GPUs (sm_80, sm_120), bytes.

    The query block, ``num_stages - 1`` K and V tiles, the probabilities re-laid out as
    the PV operand (counted at 4 bytes) and 1 KiB of scratch.
    """
    width = block_head_dim(head_dim)
    elem = torch.empty((), dtype=dtype).element_size()
    q_block = config.block_m * width * elem
    kv_tiles = max(config.num_stages - 1, 1) * 2 * config.block_n * width * elem
    return q_block + kv_tiles + config.block_m * config.block_n * 4 + 1024


def select_config(
    rows_per_kv_head: int,
    head_dim: int,
    dtype: torch.dtype,
    budget: int = SM120_SHARED_MEMORY_BYTES,
) -> GQATileConfig:
    """The config for requests of up to ``rows_per_kv_head`` rows, shrunk to ``budget``."""
    config = GQA_TILE_CONFIGS[0]
    for cand in GQA_TILE_CONFIGS:
        if rows_per_kv_head >= cand.min_rows:
            config = cand
    while estimate_shared_memory_bytes(config, head_dim, dtype) > budget:
        if config.num_stages > 2:
            config = replace(config, num_stages=config.num_stages - 1)
        elif config.block_n > 16:
            config = replace(config, block_n=config.block_n // 2)
        elif config.block_m > 16:
            config = replace(config, block_m=config.block_m // 2)
        else:
            raise ValueError(f"no GQA tile config fits head_dim={head_dim} in {budget} bytes")
    return config
