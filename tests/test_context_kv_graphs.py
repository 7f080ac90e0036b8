"""vllm_ddtree.draft.context_kv_graphs and patches/dflash_context_kv.py: which precompute calls a
captured graph stands in for (CPU: graphs are stand-ins that count replays; the capture
itself runs in tests/gpu/test_context_kv_graphs_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from vllm_ddtree.draft import context_kv_graphs as ckv


class _CountingGraph:
    def __init__(self):
        self.replays = 0

    def replay(self):
        self.replays += 1


def _graphs(layer_group_idx=None, groups=1, max_tokens=64, lengths=(17,)):
    calls = []
    graphs = ckv.ContextKVGraphs(
        lambda *args: calls.append(args),
        torch.zeros(max_tokens, 8), torch.zeros(max_tokens, dtype=torch.int64),
        torch.zeros(groups, max_tokens, dtype=torch.int64), layer_group_idx)
    for n in lengths:
        graphs.graphs[n] = _CountingGraph()
    return graphs, calls


def test_lengths_are_full_tree_batches_within_the_token_budget():
    assert ckv.context_lengths_to_capture(range(1, 5), [65], 200) == [195, 130, 65]
    assert ckv.context_lengths_to_capture([2, 2, 0], [17], 100) == [34]
    # auto's verify shapes: every request count with every shape, small batches first
    assert ckv.context_lengths_to_capture(range(1, 4), [65, 9, 17], 140) == [
        130, 65, 51, 34, 27, 18, 17, 9]
    assert ckv.context_lengths_to_capture(range(1, 100), [65, 9], 10_000, max_graphs=3) == [
        130, 65, 9]
    # the longest capture is capped whatever vLLM's token budget
    longest = max(ckv.context_lengths_to_capture(range(1, 1000), [65], 1 << 20))
    assert longest == ckv.MAX_CONTEXT_GRAPH_TOKENS // 65 * 65


def test_request_counts_come_from_the_drafters_full_graphs():
    from types import SimpleNamespace as NS

    descs = [NS(num_reqs=4, num_tokens=64), NS(num_reqs=None, num_tokens=32)]
    assert ckv.decode_context_lengths(descs, 16, 8, [65], 1_000) == [260, 195, 130, 65]
    assert ckv.decode_context_lengths(descs, 16, 2, [65, 9], 1_000) == [130, 65, 18, 9]
    assert ckv.decode_context_lengths([], 16, 8, [65], 10_000) == []


def test_the_speculators_own_views_replay_one_slot_row():
    graphs, _ = _graphs()
    n = 17
    assert graphs.replay(graphs.states[:n], graphs.positions[:n], graphs.slots(n))
    assert graphs.graphs[n].replays == 1


def test_per_layer_slot_rows_replay_only_in_layer_order():
    graphs, _ = _graphs(layer_group_idx=[0, 1, 0], groups=2)
    n = 17
    slots = graphs.slots(n)
    assert [s.data_ptr() for s in slots] == [graphs.slot_rows[i].data_ptr() for i in (0, 1, 0)]
    assert graphs.replay(graphs.states[:n], graphs.positions[:n], slots)
    swapped = [slots[1], slots[0], slots[2]]
    assert not graphs.replay(graphs.states[:n], graphs.positions[:n], swapped)
    assert not graphs.replay(graphs.states[:n], graphs.positions[:n], slots[:2])
    assert not graphs.replay(graphs.states[:n], graphs.positions[:n], slots[0])
    assert graphs.graphs[n].replays == 1


@pytest.mark.parametrize("case", ["length", "states", "positions", "slots", "offset",
                                  "dummy", "list"])
def test_other_calls_run_eagerly(case):
    graphs, _ = _graphs(lengths=(17, 20))
    n = 17
    states, positions, slots = graphs.states[:n], graphs.positions[:n], graphs.slots(n)
    if case == "length":  # a context length without a graph (a prefill chunk)
        states, positions, slots = graphs.states[:9], graphs.positions[:9], graphs.slots(9)
    elif case == "states":  # another buffer of the same shape
        states = states.clone()
    elif case == "positions":
        positions = positions.clone()
    elif case == "slots":
        slots = slots.clone()
    elif case == "offset":  # same length, shifted view
        slots = graphs.slot_rows[0][1 : n + 1]
    elif case == "dummy":  # DFlash's dummy runs pass no slots (no cache write)
        slots = None
    elif case == "list":  # one row given as a per-layer list
        slots = [slots]
    assert not graphs.replay(states, positions, slots)
    assert graphs.graphs[17].replays == 0 and graphs.graphs[20].replays == 0


def test_mismatched_slot_length_runs_eagerly():
    graphs, _ = _graphs(lengths=(17, 20))
    assert not graphs.replay(graphs.states[:17], graphs.positions[:17], graphs.slots(20))


def test_the_patch_routes_only_drafters_that_carry_graphs():
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM

    from vllm_ddtree.patches import dflash_context_kv

    dflash_context_kv.apply()
    dflash_context_kv.apply()  # idempotent
    method = DFlashQwen3ForCausalLM.precompute_and_store_context_kv
    assert method._ddtree_patched and not getattr(method._ddtree_original,
                                                  "_ddtree_patched", False)

    class _Inner:
        def __init__(self):
            self.calls = 0

        def precompute_and_store_context_kv(self, *args):
            self.calls += 1

    class _Drafter:  # stands in for the module: the original delegates to .model
        def __init__(self, graphs=None):
            self.model = _Inner()
            if graphs is not None:
                setattr(self, dflash_context_kv.GRAPHS_ATTR, graphs)

    graphs, _ = _graphs()
    n = 17
    args = (graphs.states[:n], graphs.positions[:n], graphs.slots(n))
    chain = _Drafter()  # vLLM's own DFlash: never routed
    method(chain, *args)
    assert chain.model.calls == 1
    ddtree = _Drafter(graphs)
    method(ddtree, *args)
    assert ddtree.model.calls == 0 and graphs.graphs[n].replays == 1
    method(ddtree, graphs.states[:9], graphs.positions[:9], graphs.slots(9))
    assert ddtree.model.calls == 1 and graphs.graphs[n].replays == 1


def test_the_speculator_captures_full_tree_lengths_and_hands_the_graphs_to_the_drafter(
        monkeypatch):
    """DDTreeSpeculator.capture after DFlash's: lengths R * (1 + B) and, with auto's
    verify shapes or a batch schedule, R * (1 + s) (s = 0: plain steps), for R up to
    the drafter's largest FULL graph; the graphs go to the drafter only when its class
    is routed by the patch."""
    import contextlib
    from types import SimpleNamespace as NS

    import vllm.distributed.parallel_state as parallel_state
    from vllm.config.compilation import CUDAGraphMode
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM
    from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator

    from vllm_ddtree.draft.speculator import DDTreeSpeculator
    from vllm_ddtree.patches import dflash_context_kv

    dflash_context_kv.apply()
    captured = []
    monkeypatch.setattr(DFlashSpeculator, "capture", lambda self: None)
    monkeypatch.setattr(parallel_state, "graph_capture", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(ckv.ContextKVGraphs, "capture",
                        lambda self, lengths, pool=None: captured.append(list(lengths)))

    def speculator(model, shapes=None):
        spec = DDTreeSpeculator.__new__(DDTreeSpeculator)
        spec.device = NS(type="cuda")
        spec.budget, spec.num_query_per_req, spec.max_num_reqs = 8, 16, 4
        spec.max_num_tokens = 1024
        spec.step_plan = None if shapes is None else NS(shapes=shapes)
        spec.query_cudagraph_manager = NS(_capture_descs={CUDAGraphMode.FULL: [
            NS(num_reqs=2, num_tokens=32), NS(num_reqs=1, num_tokens=16)]})
        spec.model = model
        spec.hidden_states = torch.zeros(1024, 8)
        spec.context_positions = torch.zeros(1024, dtype=torch.int64)
        spec._context_slot_mappings = torch.zeros(1, 1024, dtype=torch.int64)
        spec._layer_group_idx = None
        return spec

    drafter = DFlashQwen3ForCausalLM.__new__(DFlashQwen3ForCausalLM)
    object.__setattr__(drafter, "__dict__", {})  # no nn.Module __init__: a bare instance
    spec = speculator(drafter)
    spec.capture()
    assert captured == [[18, 9]]
    graphs = drafter.__dict__[dflash_context_kv.GRAPHS_ATTR]
    original = DFlashQwen3ForCausalLM.precompute_and_store_context_kv._ddtree_original
    assert isinstance(graphs, ckv.ContextKVGraphs) and graphs.precompute.func is original

    speculator(drafter, shapes=[1, 4, 8]).capture()  # auto: every verify shape
    assert captured[-1] == [18, 10, 9, 5, 4, 2]
    speculator(drafter, shapes=[0, 1, 4, 8]).capture()  # and plain steps: 1 row each
    assert captured.pop() == [18, 10, 9, 5, 4, 2, 1]

    class OtherDrafter:  # a DFlash drafter class the patch does not route
        def precompute_and_store_context_kv(self, *args):
            pass

    other = OtherDrafter()
    speculator(other).capture()
    assert len(captured) == 2 and not hasattr(other, dflash_context_kv.GRAPHS_ATTR)
    # B = 8 over a block of 4: tree decodes draft from 4 context rows a request
    small_block = speculator(drafter, shapes=[1, 4, 8])
    small_block.num_query_per_req = 4
    small_block.capture()
    assert captured[-1] == [8, 4, 2]
    on_cpu = speculator(drafter)
    on_cpu.device = NS(type="cpu")
    on_cpu.capture()
    assert len(captured) == 3 and ckv.capture_for_speculator(on_cpu, [9]) is None  # no CUDA
