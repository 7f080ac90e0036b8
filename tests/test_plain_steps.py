"""Plain decoding steps (b = 0) inside the DDTree speculator on CPU: a ``propose`` whose
next step verifies no trees runs no block pass, yet writes the drafter's context K/V of
the tokens the step committed (so the drafter's cache is complete when speculation
resumes), stores no trees, and makes no host sync; V2 warm-up batches always draft."""

from types import SimpleNamespace as NS

import pytest
import torch
from test_no_host_sync import make_scenario, snapshot_before_round

from vllm_ddtree.budget.schedule import BatchSchedule
from vllm_ddtree.testing.sync_guard import HostSyncDetector
from vllm_ddtree.verify.shape import StepPlan

HIDDEN = 16


def plain_speculator(sc, monkeypatch, schedule):
    """The scenario's speculator with a step plan on ``schedule`` and the drafter parts
    a plain step touches: ``combine_hidden_states`` (the ``fc``), the context buffers,
    a stand-in for the fused input preparation (CUDA's one launch: context positions
    are the batch's) and a recording context K/V precompute."""
    from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator

    spec = sc.spec
    spec.step_plan = StepPlan(sc.budget, [0, sc.budget],
                              BatchSchedule(schedule, 64, sc.budget))
    weight = torch.randn(3 * HIDDEN, HIDDEN, generator=sc.gen)
    calls = {"precompute": [], "block": 0}
    spec.model.combine_hidden_states = lambda h: h @ weight
    spec.model.precompute_and_store_context_kv = (
        lambda states, positions, slots: calls["precompute"].append(
            (states.clone(), positions.clone(), slots.clone())))
    spec.hidden_states = torch.zeros(1024, HIDDEN)
    spec.context_positions = torch.zeros(1024, dtype=torch.int64)
    spec._context_slot_mappings = torch.full((1, 1024), -1, dtype=torch.int64)
    spec._layer_group_idx = None
    spec.draft_kv_cache_group_ids = [0]

    def fused_prepare(self, input_batch, *args):
        n = input_batch.num_tokens
        self.context_positions[:n] = input_batch.positions[:n]
        self._context_slot_mappings[0, :n] = 5000 + input_batch.positions[:n]
        return True

    monkeypatch.setattr(type(spec), "_prepare_inputs_in_one_launch", fused_prepare)
    block = DFlashSpeculator.propose

    def counting_block(self, *args, **kwargs):
        calls["block"] += 1
        return block(self, *args, **kwargs)

    monkeypatch.setattr(DFlashSpeculator, "propose", counting_block)
    return calls, weight


def test_plain_propose_writes_context_kv_and_no_tree(monkeypatch):
    """A batch size whose scheduled budget is 0: the walk's KV is still compacted and
    the path rows moved next to their roots, the drafter's context K/V of every row
    is written (the committed path at its linear positions), the block pass does not
    run, the stored trees stay, and none of it syncs the host."""
    sc = make_scenario(8, None, -1, monkeypatch)
    calls, weight = plain_speculator(sc, monkeypatch, [(1, 64, 0)])
    b = sc.batch
    sc.step_inputs()
    snapshot_before_round(sc)
    parents_before = sc.state.parents.clone()
    compacted = []
    compact = type(sc.spec)._compact_target_kv
    monkeypatch.setattr(type(sc.spec), "_compact_target_kv",
                        lambda self, *a: compacted.append(1) or compact(self, *a))
    positions_before = b.positions.clone()
    from vllm_ddtree.runtime_state import verify_inputs_

    verify_inputs_(sc.state, b.positions, b.query_start_loc, b.cu_num_logits,
                   b.idx_mapping, b.num_tokens, b.num_tokens_after_padding)
    out = sc.verifier(sc.logits, b)
    walk = sc.state.walk_kv_src_rows[: b.num_reqs].clone()
    aux = [h.clone() for h in sc.aux]
    with HostSyncDetector() as detector:
        draft = sc.spec.propose(b, None, sc.slot_mappings, None, sc.aux, out.num_sampled,
                                out.num_rejected, None, None, None, None)
    assert detector.count() == 0, detector.report()
    assert calls["block"] == 0 and sc.spec.step_plan.drafted is False
    assert draft.shape == (b.num_reqs, sc.budget)
    assert torch.equal(sc.state.parents, parents_before)  # no tree stored
    assert compacted == [1]  # the accepted paths' target KV moved into place
    (states, positions, slots), = calls["precompute"]
    n = b.num_tokens
    assert states.shape == (n, HIDDEN) and torch.equal(positions, positions_before[:n])
    assert torch.equal(slots, 5000 + positions_before[:n])
    # each tree request's rows start with its root, then its accepted path's rows
    for r, kind in enumerate(sc.kinds):
        if kind != "tree":
            continue
        start, a = int(b.query_start_loc[r]), int(out.num_sampled[r]) - 1
        src = [start] + [start + int(c) for c in walk[r, :a]]
        want = torch.cat([h[src] for h in aux], dim=-1) @ weight
        assert torch.allclose(states[start:start + a + 1], want, atol=1e-5)


def test_plan_drafts_again_when_the_batch_size_pays(monkeypatch):
    """A schedule with budget 0 at 6 requests and B at 5 or fewer: the batch of 6 runs
    its propose without the block pass; the same speculator drafts (block pass, trees
    stored) for a batch of 5, and warm-up batches always draft."""
    sc = make_scenario(8, None, -1, monkeypatch)
    calls, _ = plain_speculator(sc, monkeypatch, [(1, 5, 8), (6, 64, 0)])
    plan = sc.spec.step_plan
    sc.step_inputs()
    b = sc.batch
    sc.spec.propose(b, None, sc.slot_mappings, None, sc.aux, torch.ones(6, dtype=torch.int32),
                    torch.zeros(6, dtype=torch.int32), None, None, None, None)
    assert calls["block"] == 0 and plan.step_shape(6) == 0
    small = NS(**{**vars(b), "num_reqs": 5, "idx_mapping": b.idx_mapping[:5]})
    sc.spec.propose(small, None, sc.slot_mappings, None, sc.aux,
                    torch.ones(5, dtype=torch.int32), torch.zeros(5, dtype=torch.int32),
                    None, None, None, None)
    assert calls["block"] == 1 and plan.drafted and plan.step_shape(5) == 8
    warmup = NS(**{**vars(b), "req_ids": [f"_warmup_{i}_" for i in range(6)]})
    sc.spec.propose(warmup, None, sc.slot_mappings, None, sc.aux,
                    torch.ones(6, dtype=torch.int32), torch.zeros(6, dtype=torch.int32),
                    None, None, None, None)
    assert calls["block"] == 2 and plan.drafted


@pytest.mark.parametrize("dummy", [True])
def test_dummy_runs_leave_the_plan_alone(monkeypatch, dummy):
    sc = make_scenario(8, None, -1, monkeypatch)
    calls, _ = plain_speculator(sc, monkeypatch, [(1, 64, 0)])
    sc.step_inputs()
    sc.spec.step_plan.drafted = False
    sc.spec.propose(sc.batch, None, sc.slot_mappings, None, sc.aux,
                    torch.ones(6, dtype=torch.int32), torch.zeros(6, dtype=torch.int32),
                    None, None, None, None, dummy_run=dummy)
    assert calls["block"] == 1 and sc.spec.step_plan.drafted is False


@pytest.mark.parametrize("arm", [0, 32])
def test_a_drafting_propose_hands_the_gates_hidden_time_to_the_device_choice(arm):
    """auto: after the gate decides, a propose that drafts passes the gate's
    ``device_hidden`` to ``BudgetPolicy.hide_`` (the device's choice of active nodes
    that runs next); a plain one (arm 0) does not."""
    from vllm_ddtree.draft.speculator import DDTreeSpeculator

    class Gate:
        device_hidden = (64, 3e-4)
        holding = False

        def decide(self, num_reqs, contexts, cap):
            return arm

    hidden = []
    spec = object.__new__(DDTreeSpeculator)
    spec.step_plan = StepPlan(64, [0, 32, 64], gate=Gate())
    spec.budget_policy = NS(hide_=lambda *pair: hidden.append(pair))
    spec.state = NS(accepted_sum=None)
    batch = NS(req_ids=["a", "b"], num_reqs=2, num_computed_tokens_np=None)
    assert spec._draft_next(batch, None) is (arm > 0)
    assert hidden == ([(64, 3e-4)] if arm else [])
