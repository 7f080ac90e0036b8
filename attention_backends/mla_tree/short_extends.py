"""Which short extends the MLA tree backend computes with its decode kernel.

An extend is a request still prefilling: ``q`` new tokens after ``c`` cached ones (a
refill whose prompt prefix came from the prefix cache, a later prefill chunk). vLLM's
MLA layer has two paths for it. The prefill path gathers the cached latent context,
up-projects it to per-head keys and values (``kv_b_proj``) and runs FlashAttention over
the context and over the new tokens, then merges the two: about ten launches a layer,
each eager in a step that holds an extend (such a batch is not a uniform decode, so no
FULL CUDA graph). The decode path reads the latent context as it is (the absorbed
form) in the one launch of the tree kernel that the step's decodes and trees take
anyway. vLLM's FLASH_ATTN_MLA sends extends of up to 512 tokens down its decode path
whatever the context (``flashattn_mla.py:118``), FlashMLA up to 128 (``flashmla.py:121``).

Per head and cached token the absorbed form costs ``2q(2L + R)`` FLOPs (L = kv_lora_rank,
R = rope dims), the prefill path ``2L(N + V) + 2q(N + R + V)`` (N, V: the per-head
nope and value dims): at DeepSeek's dims the decode path is cheaper up to q ~ 170 and
up to 2x dearer at 512. At a short context that is a few GFLOPs a layer against the
prefill path's launches on the host (measured on an H100, V2-Lite shape, batch 32, 1k
context: the prefill path took a quarter of a refill step's host time,
``evals/refill_profile.py``); at 32k+ tokens with many heads it is tens of
milliseconds. So each step an extend takes the decode path while its extra FLOPs a
layer stay under ``EXTRA_FLOPS_PER_LAYER``, up to ``MLA_MAX_EXTEND_TOKENS`` new tokens
(``tree_mask_state``: the mask words are sized for that many).
"""

from __future__ import annotations

import numpy as np

# Extra work of the absorbed form a layer may take on to save the prefill path's
# launches: ~0.2 ms of the tree kernel on an H100 (an estimate, not yet measured),
# against the prefill path's 0.78 ms a layer under cProfile in the measurement above.
EXTRA_FLOPS_PER_LAYER = 32e9


def extra_decode_flops(query_len: np.ndarray, context_len: np.ndarray, num_heads: int,
                       kv_lora_rank: int, rope_dim: int, nope_dim: int,
                       v_dim: int) -> np.ndarray:
    """FLOPs a layer the decode path spends beyond the prefill path on extends of
    ``query_len`` new tokens after ``context_len`` cached ones (int arrays of one
    shape; the new tokens' own attention is alike on both paths and left out)."""
    q = query_len.astype(np.float64)
    absorbed = 2.0 * q * (2 * kv_lora_rank + rope_dim)
    prefill = 2.0 * kv_lora_rank * (nope_dim + v_dim) + 2.0 * q * (nope_dim + rope_dim + v_dim)
    return num_heads * context_len.astype(np.float64) * (absorbed - prefill)


def decode_limit(query_start_loc: np.ndarray, seq_lens: np.ndarray | None, floor: int,
                 ceiling: int, num_heads: int, kv_lora_rank: int, rope_dim: int,
                 nope_dim: int, v_dim: int) -> int:
    """The step's ``reorder_batch_threshold``: the longest query computed by the
    decode kernel.

    Args:
        query_start_loc: int ``[R + 1]`` (host), the batch in the runner's order
            (uniform decodes first, then by query length, ``model_runner.py:1652``):
            vLLM splits it at the first query longer than the threshold.
        seq_lens: int ``[R]`` (host, exact for prefilling rows:
            ``seq_lens_cpu_upper_bound``), or None (no extend then takes the decode path).
        floor: queries up to this many tokens are decodes whatever their context
            (vLLM's threshold: 1 + 2B with DFlash drafts, 1 without speculation).
        ceiling: the most any step may take (``decode_query_limit``: at least
            ``MLA_MAX_EXTEND_TOKENS``).
    Returns:
        An int in ``[floor, ceiling]``: ``floor`` raised to each longer query in turn
        while it fits ``ceiling`` and ``EXTRA_FLOPS_PER_LAYER``, and kept below the
        first that does not (vLLM treats every query up to the threshold as a decode).
    """
    query_lens = np.diff(query_start_loc)
    longer = query_lens > floor
    if not longer.any():
        return ceiling
    if seq_lens is None:
        return floor
    first = int(np.argmax(longer))
    q = query_lens[first:]
    extra = extra_decode_flops(q, seq_lens[first:first + len(q)] - q, num_heads,
                               kv_lora_rank, rope_dim, nope_dim, v_dim)
    fits = (q <= ceiling) & (extra <= EXTRA_FLOPS_PER_LAYER)
    if fits.all():
        return int(q.max())
    failing = int(np.argmin(fits))
    taken = int(q[:failing].max()) if failing else floor
    return max(floor, min(taken, int(q[failing]) - 1))
