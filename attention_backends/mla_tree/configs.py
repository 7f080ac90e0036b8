# SPDX-License-Identifier: Apache-2.0
"""Tile configurations of the MLA tree-verify kernel, their shared-memory cost, and the
launch heuristics (which config, how many KV splits).

Every config in :data:`MLA_TILE_CONFIGS` must fit in the shared memory of one block on
consumer Blackwell (sm_120: 99 KiB, no TMA/wgmma) for the DeepSeek/Kimi shape
(kv_lora_rank 512 + rope 64) in 16-bit dtypes; tests/test_mla_tree_kernel.py checks it.
fp32 (tests, debugging) uses the same table through :func:`fit_config`, which shrinks
the KV tile until it fits.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

SM120_SHARED_MEMORY_BYTES = 99 * 1024


@dataclass(frozen=True)
class MLATileConfig:
    """One launch configuration of ``_mla_tree_fwd_kernel``.

    Attributes:
        block_m: flattened ``(token, head)`` rows per CTA (token-major).
        block_n: keys per KV tile (at most 64).
        num_warps: warps per CTA.
        num_stages: software-pipelining depth of the KV tile loads
            (``num_stages - 1`` tiles in flight).
        min_rows: picked for requests with at least this many rows
            (``max_query_len * num_heads``), largest qualifying ``min_rows`` wins.
        ctas_per_sm: resident CTAs per SM (registers / shared memory), for the split
            heuristic.
        fp8_transposed: the fp8-cache kernel with transposed products
            (``fp8_transposed.py``; fp8 caches only; sm_90's dispatch rule, else by config).
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    min_rows: int = 0
    ctas_per_sm: int = 2
    fp8_transposed: bool = False


# Register budget: the fp32 accumulator [block_m, kv_lora_rank] costs
# block_m * 512 / (32 * num_warps) registers per thread (64 and 128 here). Triton's
# mma.sync layout spreads the warps along the V dim, so block_n >= 8 * num_warps keeps
# QK^T free of duplicated work. A 64-row tile would halve the L2 re-reads of the latent
# KV at large H * qlen, but it does not fit: 64 x 576 query staging plus a 32-key tile
# is ~115 KB on sm_120 and ~148 KB with Hopper's wgmma lowering (a 16-key tile: 95 KB on
# sm_120, 131 KB on Hopper). evals/bench_verify_attention.py --sweep-configs times them.
MLA_TILE_CONFIGS: tuple[MLATileConfig, ...] = (
    MLATileConfig(block_m=16, block_n=32, num_warps=4, num_stages=2, min_rows=0),
    MLATileConfig(block_m=32, block_n=32, num_warps=4, num_stages=2, min_rows=32),
)


# Tiles for GPUs with more shared memory per block than sm_120 (Hopper: 227 KB). A
# 64-row tile halves the L2 re-reads of the latent KV at large H * qlen; measured on
# the H200 (evals/results/verify_attention_sweep.md) 25-35 % faster than the 32-row
# tile from 64 rows per request up. Never picked where it does not fit.
LARGE_SMEM_TILE_CONFIGS: tuple[MLATileConfig, ...] = (
    MLATileConfig(block_m=64, block_n=64, num_warps=8, num_stages=2, min_rows=64,
                  ctas_per_sm=1),
)


# fp8 caches: the transposed-products kernel (``fp8_transposed.py``): 64 keys a tile as the
# wgmma M dimension (one 4-warp warpgroup), 16 / 32 query rows as its N. sm_90's rule for
# an fp8 cache (``dispatch.fp8_transposed_method``: 0.55-0.84x the fp8 kernel above at
# 128k, ``evals/results/README.md``, the grid's entry); sm_120 has not run it (it spills
# there), so its fp8 rule stays the kernel above. At DeepSeek's dims the 16-row tile fits
# sm_120 (72 KB compiled); the 32-row one is estimated at 111 KB (Hopper's compile), so on
# sm_120 ``fit_config`` shrinks it to 32 keys.
FP8_TRANSPOSED_TILE_CONFIGS: tuple[MLATileConfig, ...] = (
    MLATileConfig(block_m=16, block_n=64, num_warps=4, num_stages=2, fp8_transposed=True),
    MLATileConfig(block_m=32, block_n=64, num_warps=4, num_stages=2, fp8_transposed=True),
)


def mma_dtype_of(q_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the kernels' query operand, which the tile estimates size: an e4m3
    q (an fp8 cache's) is widened to fp16 (exact)."""
    return torch.float16 if q_dtype == torch.float8_e4m3fn else q_dtype

def next_pow2(x: int) -> int:
    """The smallest power of two >= ``x`` (1 for ``x <= 1``); plain Python, as the
    launchers call it per launch (Triton's host helpers are constexpr functions, a few
    microseconds a call)."""
    return 1 if x <= 1 else 1 << (x - 1).bit_length()


def padded_dims(head_dim: int, kv_lora_rank: int) -> tuple[int, int]:
    """``(BLOCK_L, BLOCK_R)``: the power-of-two tile widths of the nope and rope parts."""
    rope = head_dim - kv_lora_rank
    block_r = max(16, next_pow2(rope)) if rope > 0 else 16
    return next_pow2(kv_lora_rank), block_r


def estimate_shared_memory_bytes(
    config: MLATileConfig, head_dim: int, kv_lora_rank: int, dtype: torch.dtype
) -> int:
    """Upper estimate of one CTA's shared memory, in bytes.

    What Triton 3.6 allocates for this kernel (checked against compiled sm_120 kernels,
    tests/test_mla_tree_kernel.py): the query block ``[block_m, head_dim]`` staged once
    for the QK^T MMA operand, ``num_stages - 1`` KV tiles of ``block_n`` latent rows,
    the probabilities ``[block_m, block_n]`` re-laid out as the PV operand (counted at
    4 bytes), and 1 KiB of reduction/page-id scratch. This models the mma.sync lowering
    (sm_80/sm_89/sm_120, and Hopper for block_m < 64, which is all of the table); a
    64-row tile on Hopper is lowered to wgmma and keeps ``num_stages`` KV tiles.

    ``config.fp8_transposed`` (``dtype`` is q's): the fp16 query block, ``num_stages - 1``
    fp8 KV tiles and as many fp8 V tiles (its latent part, loaded apart) and the fp16
    probabilities (checked against compiled sm_90 / sm_120 kernels,
    tests/test_mla_fp8_transposed_kernel.py).
    """
    block_l, block_r = padded_dims(head_dim, kv_lora_rank)
    width = block_l + (block_r if head_dim > kv_lora_rank else 0)
    elem = dtype.itemsize
    q_block = config.block_m * width * elem
    if config.fp8_transposed:
        kv_tiles = max(config.num_stages - 1, 1) * config.block_n * (width + block_l)
        probs = config.block_m * config.block_n * 2
    else:
        kv_tiles = max(config.num_stages - 1, 1) * config.block_n * width * elem
        probs = config.block_m * config.block_n * 4
    return q_block + kv_tiles + probs + 1024


@functools.lru_cache(maxsize=256)
def fit_config(
    config: MLATileConfig,
    head_dim: int,
    kv_lora_rank: int,
    dtype: torch.dtype,
    budget: int = SM120_SHARED_MEMORY_BYTES,
) -> MLATileConfig:
    """``config`` shrunk (fewer stages, then smaller KV and row tiles) to fit ``budget``."""
    cfg = config
    while estimate_shared_memory_bytes(cfg, head_dim, kv_lora_rank, dtype) > budget:
        if cfg.num_stages > 2:
            cfg = replace(cfg, num_stages=cfg.num_stages - 1)
        elif cfg.block_n > 16:
            cfg = replace(cfg, block_n=cfg.block_n // 2)
        elif cfg.block_m > 16:
            cfg = replace(cfg, block_m=cfg.block_m // 2)
        else:
            raise ValueError(
                f"no tile config fits {budget} bytes of shared memory for head_dim={head_dim}, "
                f"kv_lora_rank={kv_lora_rank}, dtype={dtype}"
            )
    return cfg


@functools.lru_cache(maxsize=256)
def select_config(
    rows_per_request: int,
    head_dim: int,
    kv_lora_rank: int,
    dtype: torch.dtype,
    max_shared_memory: int = SM120_SHARED_MEMORY_BYTES,
) -> MLATileConfig:
    """The config for requests of up to ``rows_per_request = max_query_len * H`` rows.

    ``max_shared_memory`` is the device's shared memory per block; the large-tile
    configs are candidates only where they fit it. Cached (as :func:`fit_config`): an
    eager step asks it once per MLA layer with the same arguments.
    """
    candidates = list(MLA_TILE_CONFIGS)
    candidates += [
        c for c in LARGE_SMEM_TILE_CONFIGS
        if estimate_shared_memory_bytes(c, head_dim, kv_lora_rank, dtype) <= max_shared_memory
    ]
    config = candidates[0]
    for cand in candidates:
        if rows_per_request >= cand.min_rows:
            config = cand
    return fit_config(config, head_dim, kv_lora_rank, dtype, budget=max_shared_memory)


# A KV split keeps at least this many tiles; no request is split more ways than
# MAX_KV_SPLITS (the host's choice and the kernel's re-split of active rows alike).
MIN_TILES_PER_SPLIT = 8
MAX_KV_SPLITS = 128
# KV tiles' worth of per-split cost (query load, partial write, merge).
SPLIT_OVERHEAD_TILES = 2


def select_num_kv_splits(
    *,
    num_requests: int,
    row_blocks: int,
    max_seq_len: int,
    block_n: int,
    num_sms: int,
    ctas_per_sm: int = 2,
    min_tiles_per_split: int = MIN_TILES_PER_SPLIT,
    max_splits: int = MAX_KV_SPLITS,
    split_overhead_tiles: int = SPLIT_OVERHEAD_TILES,
) -> int:
    """Number of CTAs that share one request's keys (flash-decoding).

    Minimises ``waves * (tiles per split + overhead)``: ``waves`` counts rounds of
    ``num_sms * ctas_per_sm`` resident CTAs, the overhead (query load, partial result and
    merge, in KV-tile units) keeps splits from becoming tiny. Each split keeps at least
    ``min_tiles_per_split`` tiles.
    """
    base_ctas = max(1, num_requests * row_blocks)
    tiles = max(1, -(-max_seq_len // block_n))
    limit = max(1, min(max_splits, tiles // min_tiles_per_split))
    slots = max(1, num_sms * ctas_per_sm)
    best, best_cost = 1, None
    for splits in range(1, limit + 1):
        waves = -(-base_ctas * splits // slots)
        cost = waves * (-(-tiles // splits) + split_overhead_tiles)
        if best_cost is None or cost < best_cost:
            best, best_cost = splits, cost
    return best


@functools.lru_cache(maxsize=512)
def max_num_kv_splits(
    *,
    num_requests: int,
    row_blocks: int,
    max_seq_len: int,
    block_n: int,
    num_sms: int,
    ctas_per_sm: int,
) -> int:
    """The most splits :func:`select_num_kv_splits` picks for any request length up to
    ``max_seq_len``: the grid of a launch whose requests choose their own split count
    at run time (CUDA graphs). Not the choice at ``max_seq_len`` itself, which is not
    monotone in the length: 8 heads x 65 tokens (9 row blocks, 132 SMs) take 44 splits
    at 85k keys but 29 at 160k. Vectorized over every tile count (cached: once per
    captured shape)."""
    base_ctas = max(1, num_requests * row_blocks)
    slots = max(1, num_sms * ctas_per_sm)
    max_tiles = max(1, -(-max_seq_len // block_n))
    tiles = torch.arange(1, max_tiles + 1, dtype=torch.int64)[:, None]
    splits = torch.arange(1, MAX_KV_SPLITS + 1, dtype=torch.int64)[None, :]
    limit = (tiles // MIN_TILES_PER_SPLIT).clamp(1, MAX_KV_SPLITS)
    waves = -(-base_ctas * splits // slots)
    cost = waves * (-(-tiles // splits) + SPLIT_OVERHEAD_TILES)
    cost = torch.where(splits <= limit, cost, torch.iinfo(torch.int64).max)
    return int(cost.argmin(dim=1).max()) + 1  # argmin: the first minimum, as the host


@functools.lru_cache(maxsize=16)
def device_num_sms(device: torch.device) -> int:
    """SMs of ``device`` (8 off CUDA); cached: asked at every launch."""
    if device.type != "cuda":
        return 8
    return torch.cuda.get_device_properties(device).multi_processor_count


def split_slots(device: torch.device, ctas_per_sm: int) -> int:
    """Resident CTA slots of the device: its SMs times ``ctas_per_sm``."""
    return device_num_sms(device) * ctas_per_sm


def resolve_num_kv_splits(
    num_kv_splits: int | None,
    *,
    num_requests: int,
    row_blocks: int,
    max_keys: int,
    block_n: int,
    device: torch.device,
    ctas_per_sm: int,
    runtime: bool = False,
) -> int:
    """The KV split count of a launch: ``num_kv_splits`` when given (validated), else
    :func:`select_num_kv_splits` for the device's SM count (with ``runtime``, requests
    choosing their own count: :func:`max_num_kv_splits`, the grid every length fits);
    never more splits than ``block_n``-key tiles in ``max_keys``.

    Raises:
        ValueError: ``num_kv_splits`` is not a positive int or None.
    """
    if num_kv_splits is not None and (
        isinstance(num_kv_splits, bool) or not isinstance(num_kv_splits, int) or num_kv_splits < 1
    ):
        raise ValueError(f"num_kv_splits must be a positive int or None, got {num_kv_splits!r}")
    if num_kv_splits is None:
        choose = max_num_kv_splits if runtime else select_num_kv_splits
        num_kv_splits = choose(
            num_requests=num_requests, row_blocks=row_blocks, max_seq_len=max_keys,
            block_n=block_n, num_sms=device_num_sms(device), ctas_per_sm=ctas_per_sm,
        )
    return min(num_kv_splits, max(1, -(-max_keys // block_n)))
