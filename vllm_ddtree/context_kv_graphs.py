"""CUDA graphs of the DFlash drafter's context K/V precompute, one per context length.

Every round, ``DFlashSpeculator.propose`` runs the drafter's
``precompute_and_store_context_kv`` eagerly (``dflash/speculator.py:391-409``): an RMS
norm, one fused K/V GEMM, a transposing copy, the K norm, a position repeat, RoPE and
one cache write per drafter layer, about 10 + L launches of host time each round
(vLLM keeps it eager because the context length varies from step to step). A DDTree
decode step verifies ``1 + B`` rows per request, so in steady decoding the context is
``R * (1 + B)`` rows, a handful of lengths. For those lengths this module replays one
CUDA graph instead: the inputs are the speculator's persistent buffers
(``hidden_states``, ``context_positions``, the rows of ``_context_slot_mappings``) and
the outputs the drafter's KV caches, so a graph captured once reads each round's
values. Any other call (a prefill chunk, a partial tree, a dummy run, other buffers)
runs eagerly, as before.

``VLLM_DDTREE_CONTEXT_KV_GRAPH``: ``1`` (default) or ``0`` (always eager).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence

import torch

__all__ = [
    "CONTEXT_KV_GRAPH_ENV",
    "ContextKVGraphs",
    "context_kv_graph_enabled",
    "context_lengths_to_capture",
]

CONTEXT_KV_GRAPH_ENV = "VLLM_DDTREE_CONTEXT_KV_GRAPH"

# (context_states [n, H], context_positions int64 [n], slots: int64 [n] or one per layer)
PrecomputeFn = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | list[torch.Tensor]"],
                        None]


def context_kv_graph_enabled() -> bool:
    """``VLLM_DDTREE_CONTEXT_KV_GRAPH`` is ``1`` or unset (raises ``ValueError`` naming
    the variable on any other value)."""
    raw = os.environ.get(CONTEXT_KV_GRAPH_ENV)
    if raw is None:
        return True
    if raw.strip() not in ("0", "1"):
        raise ValueError(f"{CONTEXT_KV_GRAPH_ENV}={raw!r}: use 1 (capture the drafter's "
                         "context K/V precompute in CUDA graphs) or 0 (run it eagerly)")
    return raw.strip() == "1"


def context_lengths_to_capture(request_counts: Iterable[int], rows_per_request: int,
                               max_num_tokens: int) -> list[int]:
    """Context lengths ``r * rows_per_request`` of full-tree decode batches of ``r``
    requests (``rows_per_request = 1 + B``), those within ``max_num_tokens``, sorted
    largest first (the first capture sizes the shared memory pool)."""
    lengths = {r * rows_per_request for r in request_counts if r > 0}
    return sorted((n for n in lengths if n <= max_num_tokens), reverse=True)


class ContextKVGraphs:
    """Captured ``precompute(states[:n], positions[:n], slots)`` per context length n.

    Args:
        precompute: the drafter's eager ``precompute_and_store_context_kv``.
        states: the speculator's ``hidden_states`` ``[max_num_tokens, H]``.
        positions: its ``context_positions`` int64 ``[max_num_tokens]``.
        slot_rows: int64 ``[num_groups, max_num_tokens]``, ``_context_slot_mappings``.
        layer_group_idx: row of ``slot_rows`` per drafter layer (DFlash's
            ``_layer_group_idx``), or None when every layer reads row 0 as one tensor.
    """

    def __init__(self, precompute: PrecomputeFn, states: torch.Tensor,
                 positions: torch.Tensor, slot_rows: torch.Tensor,
                 layer_group_idx: Sequence[int] | None) -> None:
        self.precompute = precompute
        self.states = states
        self.positions = positions
        self.slot_rows = slot_rows
        self.layer_group_idx = None if layer_group_idx is None else list(layer_group_idx)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._states_ptr = states.data_ptr()
        self._positions_ptr = positions.data_ptr()
        rows = [0] if self.layer_group_idx is None else self.layer_group_idx
        self._slot_ptrs = [slot_rows[i].data_ptr() for i in rows]

    def slots(self, n: int, source: torch.Tensor | None = None):
        """The slot argument DFlash passes for context length ``n``: one ``[n]`` row,
        or one per layer; ``source`` replaces ``slot_rows`` (same shape)."""
        rows = self.slot_rows if source is None else source
        if self.layer_group_idx is None:
            return rows[0][:n]
        return [rows[i][:n] for i in self.layer_group_idx]

    def matches(self, states: torch.Tensor, positions: torch.Tensor, slots) -> bool:
        """Whether a call reads exactly the buffers a graph was captured on: states and
        positions are the first ``n`` rows of the persistent buffers and ``slots`` the
        first ``n`` of the expected slot rows (a dummy run's ``None`` never matches)."""
        n = states.shape[0]
        if (states.data_ptr() != self._states_ptr
                or positions.data_ptr() != self._positions_ptr or positions.shape[0] != n):
            return False
        if slots is None:
            return False
        if self.layer_group_idx is None:
            if isinstance(slots, (list, tuple)):
                return False
            slots = (slots,)
        elif not isinstance(slots, (list, tuple)) or len(slots) != len(self._slot_ptrs):
            return False
        return all(s is not None and s.data_ptr() == p and s.shape[0] == n
                   for s, p in zip(slots, self._slot_ptrs, strict=True))

    def replay(self, states: torch.Tensor, positions: torch.Tensor, slots) -> bool:
        """Replay the graph of ``states.shape[0]`` rows if the call matches it
        (:meth:`matches`); returns whether it did (else the caller runs eagerly).
        No host sync."""
        graph = self.graphs.get(states.shape[0])
        if graph is None or not self.matches(states, positions, slots):
            return False
        graph.replay()
        return True

    def capture(self, lengths: Iterable[int], pool=None) -> None:
        """Capture one graph per context length (CUDA). Each length first runs once
        eagerly with every slot ``-1`` (vLLM's cache writes skip negative slots, so no
        cache row changes) to initialise lazy state outside the capture."""
        pad_slots = torch.full_like(self.slot_rows, -1)
        for n in lengths:
            if n in self.graphs:
                continue
            states, positions = self.states[:n], self.positions[:n]
            self.precompute(states, positions, self.slots(n, pad_slots))
            torch.cuda.synchronize(self.states.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.precompute(states, positions, self.slots(n))
            self.graphs[n] = graph
            if pool is None:
                pool = graph.pool()
