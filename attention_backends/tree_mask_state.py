"""Per-token ancestor bits of the verify batch, shared by the speculator and backends.

The DDTree speculator (GPU runner) writes the tree mask of the next target forward
into ``TreeMaskState.ancestor_bits`` (a persistent buffer, so FULL CUDA graphs
replay it) and sets ``active``; attention metadata builders read rows
``[:num_decode_tokens]``. Without an active tree, builders use causal bits.

Adaptive tree budget (``ddtree_budget: "auto"``): the verify batch keeps a uniform
``1 + B`` query rows per tree request (one CUDA graph per batch shape), but only the
first ``b_r`` rows of request ``r`` are real nodes (best-first topological order, so
they form a prefix-closed tree). The speculator sets ``adaptive = True`` once at engine
init (before CUDA graph capture, which bakes the kernel variant into the graphs),
allocates ``active_query_lens`` with :meth:`TreeMaskState.allocate_active`, and writes
``b_r`` into it every verify step: int32 ``[max_num_reqs]``, batch order (entry ``i``
is the ``i``-th request of the batch; the tree requests come first), in place, as
device ops only. While ``adaptive`` and ``active`` are both set, the tree backends
(MLA and GQA) pass the view ``active_query_lens[:num_decode_reqs]`` to the tree-verify
kernels, which skip the inactive rows (no KV loads for a tile of inactive rows) and
write ``out = 0`` (MLA: ``lse = -inf``) for them. Otherwise every row is computed.
"""

from __future__ import annotations

import torch

BITS_PER_WORD = 64


ALL_ROWS_ACTIVE = torch.iinfo(torch.int32).max


def decode_query_limit(vllm_config, threshold: int) -> int:
    """The longest query the tree kernel takes (vLLM's ``reorder_batch_threshold``):
    ``threshold`` (vLLM's, ``1 + 2B`` with DFlash drafts), or in fp32 the batch's token
    budget. vLLM's MLA prefill backends are bf16 / fp16 only, so in fp32 (exactness
    checks) every request is a "decode" and the tree kernel computes prefill chunks
    too, in the absorbed form (``patches/mla_fp32_prefill.py``). The speculator sizes
    the per-token mask words by the same limit."""
    if vllm_config.model_config.dtype == torch.float32:
        return max(threshold, vllm_config.scheduler_config.max_num_batched_tokens)
    return threshold


class TreeMaskState:
    """Holder of the batch's tree-verify state, shared by the speculator and backends.

    Attributes:
        ancestor_bits: int64 ``[max_num_tokens, max_words]`` (see the module docstring).
        active: the verify batch has a tree (set per step by the speculator).
        active_query_lens: int32 ``[max_num_reqs]``, batch order: the number of real
            (active) leading query rows of each request; allocated by
            :meth:`allocate_active`, filled per verify step by the speculator.
        adaptive: the backends pass ``active_query_lens`` to the kernels (set once at
            engine init, ``ddtree_budget: "auto"``).
        mostly_active: more than half of each request's verify rows are active (adaptive
            verify shapes cut the rows to ``1 + s`` with ``s < 2 b``); the MLA backend
            then lets the Gluon kernel compute every row (set once at engine init).
    """

    def __init__(self) -> None:
        self.ancestor_bits: torch.Tensor | None = None
        self.active = False
        self.active_query_lens: torch.Tensor | None = None
        self.adaptive = False
        self.mostly_active = False

    def clear_unless_ddtree(self, vllm_config) -> None:
        """At a tree backend's builder: an engine without DDTree (its target alone on the
        tree backend) clears what an earlier DDTree engine of this process left set,
        which would apply that engine's tree mask to this one's batches."""
        spec = getattr(vllm_config, "speculative_config", None)
        if getattr(spec, "ddtree", None) is None:
            self.reset_modes()

    def reset_modes(self) -> None:
        """No tree mask, no active-row cut: what an engine starts from before its own
        DDTree state (if any) sets them."""
        self.active = self.adaptive = self.mostly_active = False

    def allocate(self, max_num_tokens: int, max_query_len: int, device) -> torch.Tensor:
        words = max(1, -(-max_query_len // BITS_PER_WORD))
        if (
            self.ancestor_bits is None
            or self.ancestor_bits.shape[0] < max_num_tokens
            or self.ancestor_bits.shape[1] < words
        ):
            self.ancestor_bits = torch.zeros(
                max_num_tokens, words, dtype=torch.int64, device=device
            )
        return self.ancestor_bits

    def allocate_active(self, max_num_reqs: int, device) -> torch.Tensor:
        """The persistent ``active_query_lens`` buffer, int32 ``[>= max_num_reqs]``.

        Allocated once (kept if already large enough: its address is baked into CUDA
        graphs). A new buffer holds ``ALL_ROWS_ACTIVE`` (int32 max, larger than any
        query length), so a step the speculator has not filled computes every row.
        """
        if self.active_query_lens is None or self.active_query_lens.shape[0] < max_num_reqs:
            self.active_query_lens = torch.full(
                (max_num_reqs,), ALL_ROWS_ACTIVE, dtype=torch.int32, device=device
            )
        return self.active_query_lens

    def decode_active_query_lens(self, num_decode_reqs: int) -> torch.Tensor | None:
        """What the backends pass to the kernels as ``active_query_lens``.

        The view ``active_query_lens[:num_decode_reqs]`` (the batch's first, tree-verify
        requests) while ``adaptive`` and ``active`` are set and the buffer exists, else
        None (every row active). No device work, so safe during CUDA graph capture.
        """
        if self.adaptive and self.active and self.active_query_lens is not None:
            return self.active_query_lens[:num_decode_reqs]
        return None


TREE_MASK_STATE = TreeMaskState()


def causal_bits_(out: torch.Tensor, query_start_loc: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Write causal ancestor bits for ``num_tokens`` rows into ``out [>= num_tokens, W]``.

    Row t (local index i within its request, from ``query_start_loc`` int32
    ``[R+1]``) gets bits ``0..i``. Pure device ops, no host sync. Returns the view
    ``out[:num_tokens]`` (int64).
    """
    rows = out[:num_tokens]
    tokens = torch.arange(num_tokens, device=out.device, dtype=torch.int64)
    starts = query_start_loc.to(torch.int64)
    req = torch.searchsorted(starts[1:], tokens, right=True)
    local = tokens - starts[req]  # 0-based index inside the request
    words = torch.arange(rows.shape[1], device=out.device, dtype=torch.int64)
    # number of set bits in each word: clamp(local + 1 - 64 w, 0, 64)
    count = (local[:, None] + 1 - BITS_PER_WORD * words[None, :]).clamp(0, BITS_PER_WORD)
    full = count == BITS_PER_WORD
    partial = torch.where(full, torch.zeros_like(count), count)
    value = torch.bitwise_left_shift(torch.ones_like(count), partial) - 1
    rows.copy_(torch.where(full, torch.full_like(count, -1), value))
    return rows
