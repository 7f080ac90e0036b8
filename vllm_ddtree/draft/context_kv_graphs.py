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
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence

import torch

__all__ = [
    "ContextKVGraphs",
    "capture_for_speculator",
    "context_lengths_to_capture",
    "decode_context_lengths",
]

# (context_states [n, H], context_positions int64 [n], slots: int64 [n] or one per layer)
PrecomputeFn = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | list[torch.Tensor]"],
                        None]


# Graphs per speculator at most: R * (1 + s) for every request count R and verify shape
# s would be thousands with ``auto`` at a large max_num_seqs; small batches come first.
MAX_CONTEXT_GRAPHS = 128
# Longest captured context: the graphs' private memory pool keeps the precompute's
# intermediates of the longest one for good (about 75 KB a row for a Kimi-K2.6-shaped
# drafter: 7168 hidden, 6 layers of 8 x 128 K/V), allocated after vLLM sized its KV
# cache. Longer contexts (large batches, where the GPU work outweighs the launches)
# stay eager.
MAX_CONTEXT_GRAPH_TOKENS = 2048


def context_lengths_to_capture(request_counts: Iterable[int], rows_per_request: Iterable[int],
                               max_num_tokens: int,
                               max_graphs: int = MAX_CONTEXT_GRAPHS) -> list[int]:
    """Context lengths ``r * q`` of full-tree decode batches: ``r`` requests of ``q``
    verify rows each (``q = 1 + B``, and ``1 + s`` for every adaptive verify shape
    ``s``), at most ``max_num_tokens`` and ``MAX_CONTEXT_GRAPH_TOKENS``. Fewest
    requests first until ``max_graphs``
    lengths; returned largest first (the first capture sizes the shared memory pool)."""
    lengths: set[int] = set()
    max_num_tokens = min(max_num_tokens, MAX_CONTEXT_GRAPH_TOKENS)
    rows = sorted(set(rows_per_request), reverse=True)
    for r in sorted(set(request_counts)):
        for q in rows:
            if r > 0 and r * q <= max_num_tokens and len(lengths) < max_graphs:
                lengths.add(r * q)
    return sorted(lengths, reverse=True)


def decode_context_lengths(drafter_descs: Iterable, query_per_request: int,
                           max_num_reqs: int, rows_per_request: Iterable[int],
                           max_num_tokens: int) -> list[int]:
    """:func:`context_lengths_to_capture` for request counts ``1..R_max``, ``R_max`` the
    most requests a FULL drafter graph takes (``drafter_descs``: vLLM's
    ``BatchExecutionDescriptor`` list, ``num_reqs`` or ``num_tokens //
    query_per_request`` requests each), capped at ``max_num_reqs``. Empty when the
    drafter has no FULL graph (it runs eagerly, and so does its precompute)."""
    counts = [d.num_reqs or d.num_tokens // query_per_request for d in drafter_descs]
    if not counts:
        return []
    most = min(max(counts), max_num_reqs)
    return context_lengths_to_capture(range(1, most + 1), rows_per_request, max_num_tokens)


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


def capture_for_speculator(spec, rows_per_request: Sequence[int]) -> ContextKVGraphs | None:
    """Capture the context K/V graphs of a ``DDTreeSpeculator`` (after its drafter
    graphs) for ``rows_per_request`` verify rows a request, and hand them to its drafter
    (the attribute ``vllm_ddtree.patches.dflash_context_kv`` reads). Returns them, or
    None when nothing is captured: no CUDA, the drafter has no FULL graph, or its class
    is not routed by the patch."""
    if spec.device.type != "cuda":
        return None
    from vllm.config.compilation import CUDAGraphMode

    manager = spec.query_cudagraph_manager
    lengths = decode_context_lengths(
        getattr(manager, "_capture_descs", {}).get(CUDAGraphMode.FULL, []),
        spec.num_query_per_req, spec.max_num_reqs, rows_per_request, spec.max_num_tokens)
    method = type(spec.model).precompute_and_store_context_kv
    if not lengths or not getattr(method, "_ddtree_patched", False):
        return None
    from vllm.distributed.parallel_state import graph_capture

    # vLLM's eager method, not the patch's wrapper (which would replay graphs of an
    # earlier capture).
    eager = functools.partial(method._ddtree_original, spec.model)
    graphs = ContextKVGraphs(eager, spec.hidden_states, spec.context_positions,
                             spec._context_slot_mappings, spec._layer_group_idx)
    with graph_capture(device=spec.device):
        graphs.capture(lengths)
    # Read by vllm_ddtree.patches.dflash_context_kv (a plain attribute, not a submodule).
    spec.model._ddtree_context_kv_graphs = graphs
    return graphs
