"""Adaptive verify shapes on CPU: the draft cut of a ``SchedulerOutput``, the host-side
shape choice, the config key, and the two patch points (``execute_model`` cuts the
drafts; the target's graph manager plans FULL graphs for every ``1 + s`` through
vLLM's own ``_init_candidates``)."""

import subprocess
import sys
from types import SimpleNamespace as NS

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from vllm_ddtree.config import DDTreeConfig, DDTreeConfigError, split_ddtree_spec
from vllm_ddtree.verify.shape import VerifyShapeChooser, truncate_drafts

SPEC = {"method": "ddtree", "model": "/drafter", "num_speculative_tokens": 64}


def scheduler_output():
    from vllm.v1.core.sched.output import SchedulerOutput

    out = SchedulerOutput.make_empty()
    out.num_scheduled_tokens = {"tree": 9, "short": 4, "prefill": 100}
    out.total_num_scheduled_tokens = 113
    out.scheduled_spec_decode_tokens = {"tree": [-1] * 8, "short": [-1] * 3}
    return out


def test_truncate_drafts_cuts_each_request_and_leaves_the_original():
    original = scheduler_output()
    cut = truncate_drafts(original, 4)
    assert cut is not original
    assert cut.scheduled_spec_decode_tokens == {"tree": [-1] * 4, "short": [-1] * 3}
    assert cut.num_scheduled_tokens == {"tree": 5, "short": 4, "prefill": 100}
    assert cut.total_num_scheduled_tokens == sum(cut.num_scheduled_tokens.values()) == 109
    # The scheduler reads its own object after the step: it must be untouched.
    assert original.num_scheduled_tokens == {"tree": 9, "short": 4, "prefill": 100}
    assert original.total_num_scheduled_tokens == 113
    assert len(original.scheduled_spec_decode_tokens["tree"]) == 8


def test_truncate_drafts_without_excess_is_the_same_object():
    original = scheduler_output()
    assert truncate_drafts(original, 8) is original
    with pytest.raises(ValueError, match="num_drafts"):
        truncate_drafts(original, -1)


def test_chooser_follows_the_newest_choice_rounded_up_to_a_shape():
    chooser = VerifyShapeChooser(64, "cpu")
    assert chooser.shapes == [1, 2, 4, 8, 16, 32, 64]
    assert chooser.next_shape() == 64  # nothing chosen yet: the full tree
    chooser.record_(torch.tensor(4))
    assert chooser.next_shape() == 4
    chooser.record_(torch.tensor([3]))
    assert chooser.next_shape() == 4
    chooser.record_(torch.tensor(1))
    chooser.record_(torch.tensor(16))
    assert chooser.next_shape() == 16
    for b in [2, 8, 1, 32, 2, 4, 8, 1, 2, 64, 8]:  # more rounds than slots
        chooser.record_(torch.tensor(b))
    assert chooser.next_shape() == 8


def test_lagged_chooser_reads_the_same_round_on_every_rank():
    """TP > 1: the shape comes from the choice of exactly ``lag`` rounds before, not
    from whichever copy completed, so ranks that record the same (broadcast) choices
    cut the same drafts."""
    ranks = [VerifyShapeChooser(64, "cpu", lag=2) for _ in range(2)]
    seen = []
    for b in [4, 8, 16, 1, 2, 32, 64, 8, 4, 2, 1, 16]:  # more rounds than slots
        shapes = [rank.next_shape() for rank in ranks]
        assert shapes[0] == shapes[1]
        seen.append(shapes[0])
        for rank in ranks:
            rank.record_(torch.tensor(b))
    assert seen == [64, 64, 4, 8, 16, 1, 2, 32, 64, 8, 4, 2]
    with pytest.raises(ValueError, match="lag"):
        VerifyShapeChooser(64, "cpu", lag=0)


def test_chooser_with_a_budget_that_is_not_a_power_of_two():
    chooser = VerifyShapeChooser(24, "cpu")
    assert chooser.shapes == [1, 2, 4, 8, 16, 24]
    chooser.record_(torch.tensor(17))
    assert chooser.next_shape() == 24


class TorchOps(TorchDispatchMode):
    """The aten ops dispatched inside the block (``ops``: their names)."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


class FakeEvent:
    """A CUDA event's stand-in: counts the events made and their records; complete
    unless ``done`` is cleared."""

    made = 0

    def __init__(self):
        FakeEvent.made += 1
        self.records, self.done = 0, True

    def record(self, stream=None):
        self.records += 1

    def query(self):
        return self.done

    def synchronize(self):
        self.done = True


def test_a_shape_round_dispatches_one_torch_op():
    """record_ of the device's choice (int64 [1], as ``BudgetPolicy.chosen``) and
    next_shape cost one torch op a round, the copy: the slot's view and the read back
    (a NumPy view of the pinned slots) dispatch none (five ops a round before: a slice,
    the copy, a select and the scalar read, microseconds each of the host's round)."""
    chooser = VerifyShapeChooser(64, "cpu")
    chosen = torch.tensor([8])
    for b in (4, 8):
        chooser.record_(torch.tensor([b]))
    with TorchOps() as counted:
        chooser.record_(chosen)
        assert chooser.next_shape() == 8
    assert counted.ops == ["aten.copy_.default"]


def test_chooser_records_each_slots_event_again():
    """One event a slot, made with the chooser and recorded again at each use (an event
    made per round cost its creation and destruction); a copy whose event has not
    completed holds the shape at the last completed one."""
    FakeEvent.made = 0
    chooser = VerifyShapeChooser(64, "cpu", make_event=FakeEvent)
    for b in [2, 8, 1, 32, 2, 4, 8, 1, 2, 64, 8, 16]:  # more rounds than slots
        chooser.record_(torch.tensor(b))
        assert chooser.next_shape() == b
    assert FakeEvent.made == len(chooser._events) < 12
    assert sum(e.records for e in chooser._events) == 12
    chooser.record_(torch.tensor(4))
    chooser._events[(chooser._next_slot - 1) % len(chooser._events)].done = False
    assert chooser.next_shape() == 16
    lagged = VerifyShapeChooser(64, "cpu", lag=1, make_event=FakeEvent)
    lagged.record_(torch.tensor(4))
    lagged._events[0].done = False
    assert lagged.next_shape() == 4 and lagged._events[0].done  # waited on its event


def test_current_stream_is_built_again_only_when_it_changed(monkeypatch):
    """``torch.cuda.current_stream`` builds a Stream object at each call; the chooser's
    events take it from ``_CurrentStream``, which compares the raw handle."""
    from vllm_ddtree.verify import shape

    handle, built = [1], []
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: handle[0],
                        raising=False)
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda index: built.append(index) or f"stream {handle[0]}")
    current = shape._CurrentStream(torch.device("cuda", 3))
    assert [current() for _ in range(5)] == ["stream 1"] * 5 and built == [3]
    handle[0] = 2  # e.g. a side stream
    assert current() == "stream 2" and built == [3, 3]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (pinned slots, events)")
def test_chooser_on_cuda_never_waits_and_catches_up():
    chooser = VerifyShapeChooser(64, "cuda")
    for b in [4, 8, 2]:
        chooser.record_(torch.tensor(b, device="cuda"))
    torch.cuda.synchronize()
    assert chooser.next_shape() == 2


def test_config_key_values_and_defaults():
    _, auto = split_ddtree_spec({**SPEC, "ddtree_budget": "auto"})
    assert auto.verify_shape is None
    assert auto.resolved_verify_shape(1) == "adaptive"
    assert auto.resolved_verify_shape(2) == "fixed"
    _, fixed = split_ddtree_spec({**SPEC, "ddtree_budget": "auto",
                                  "ddtree_verify_shape": "fixed"})
    assert fixed.resolved_verify_shape(1) == "fixed"
    _, plain = split_ddtree_spec(SPEC)
    assert plain.resolved_verify_shape(1) is None


def test_config_key_errors_name_the_field_and_the_fix():
    with pytest.raises(DDTreeConfigError, match="ddtree_verify_shape.*adaptive.*fixed"):
        split_ddtree_spec({**SPEC, "ddtree_budget": "auto", "ddtree_verify_shape": "small"})
    with pytest.raises(DDTreeConfigError, match='ddtree_budget": "auto"'):
        split_ddtree_spec({**SPEC, "ddtree_verify_shape": "adaptive"})
    _, cfg = split_ddtree_spec({**SPEC, "ddtree_budget": "auto",
                                "ddtree_verify_shape": "adaptive"})
    assert cfg.resolved_verify_shape(2) == "adaptive"  # explicit: honoured at TP > 1


class FakeSpecConfig:
    """The parts of ``SpeculativeConfig`` vLLM's ``_init_candidates`` reads."""

    def __init__(self, ddtree: DDTreeConfig | None):
        self.ddtree = None if ddtree is None else ddtree.to_dict()
        self.num_speculative_tokens = 8
        self.num_speculative_tokens_per_batch_size = None

    def uses_dynamic_speculative_decoding(self) -> bool:
        return self.num_speculative_tokens_per_batch_size is not None


def graph_manager(ddtree: DDTreeConfig | None):
    """A target ``ModelCudaGraphManager`` with only the attributes ``_init_candidates``
    uses (its ``__init__`` needs a distributed setup), B = 8, FULL decode graphs."""
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.worker.gpu.cudagraph_utils import ModelCudaGraphManager

    spec = FakeSpecConfig(ddtree)
    manager = object.__new__(ModelCudaGraphManager)
    manager.vllm_config = NS(speculative_config=spec, num_speculative_tokens=8,
                             parallel_config=NS(tensor_parallel_size=1))
    manager.compilation_config = NS(cudagraph_capture_sizes=[1, 2, 4, 8, 16, 32],
                                    max_cudagraph_capture_size=32)
    manager.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    manager.max_num_reqs = 4
    manager.decode_query_len = 9
    manager.lora_capture_cases = [0]
    manager.use_breakable_cg = False
    manager._candidates, manager._capture_descs = {}, {}
    return manager, spec


def full_decode_lengths(manager) -> set[int]:
    from vllm.config.compilation import CUDAGraphMode

    return {d.uniform_token_count for d in manager._capture_descs[CUDAGraphMode.FULL]}


def mark_captured(manager) -> None:
    """As after ``capture``: every planned FULL graph exists (a stand-in), no LoRA."""
    from vllm.config.compilation import CUDAGraphMode

    manager.graphs = dict.fromkeys(manager._capture_descs[CUDAGraphMode.FULL], "graph")
    manager._graphs_captured = True
    manager._lora_dispatch_map, manager._max_lora_case = {}, 0


@pytest.fixture
def shape_patch(monkeypatch):
    """``vllm_ddtree.patches.verify_shapes`` applied over this test's own copies of the two vLLM
    functions (monkeypatch restores vLLM's afterwards)."""
    from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    import vllm_ddtree.patches.verify_shapes as verify_shapes

    calls = []
    def vllms(fn):
        return getattr(fn, "_ddtree_original", fn)

    monkeypatch.setattr(GPUModelRunner, "execute_model",
                        lambda self, so, *a, **k: calls.append(so) or "ran")
    monkeypatch.setattr(CudaGraphManager, "_init_candidates",
                        vllms(CudaGraphManager._init_candidates))
    monkeypatch.setattr(CudaGraphManager, "dispatch", vllms(CudaGraphManager.dispatch))
    verify_shapes.apply()
    return GPUModelRunner, calls


def test_graph_manager_plans_every_verify_shape(shape_patch):
    auto = DDTreeConfig(budget=8, adaptive=True)
    manager, spec = graph_manager(auto)
    manager._init_candidates()
    assert full_decode_lengths(manager) == {1, 2, 3, 5, 9}  # 1: plain steps (b = 0)
    # The scheduler must never see vLLM's dynamic-SD list.
    assert spec.num_speculative_tokens_per_batch_size is None
    # Every 1 + s shape dispatches to a FULL graph of its own query length, also where
    # vLLM's lookup lands on a token count captured for another length (3 x 5 = 15
    # tokens -> vLLM's candidates at 16 are 2-row graphs; 2 x 3 = 6 -> 8).
    from vllm.config.compilation import CUDAGraphMode

    full = manager._capture_descs[CUDAGraphMode.FULL]
    mark_captured(manager)
    vllm_dispatch = manager.dispatch._ddtree_original.__get__(manager)
    rescued = 0
    for reqs in (1, 2, 3, 4):
        for rows in (2, 3, 5, 9):
            desc = manager.dispatch(reqs, reqs * rows, rows, 0)
            holds = [d for d in full if d.uniform_token_count == rows
                     and d.num_reqs >= reqs and d.num_tokens >= reqs * rows]
            if not holds:  # past the capture sizes (e.g. 3 x 9 > 2 x 9 = 18 < 32 < 36)
                assert desc.cg_mode.name != "FULL"
                continue
            assert desc == min(holds, key=lambda d: d.num_tokens)
            rescued += vllm_dispatch(reqs, reqs * rows, rows, 0).cg_mode.name != "FULL"
    assert rescued >= 2  # 3 x 5 and 2 x 3 at least
    # A mixed batch (no uniform length) keeps vLLM's choice.
    assert manager.dispatch(2, 10, None, 0).cg_mode.name != "FULL"


@pytest.mark.parametrize("ddtree", [DDTreeConfig(budget=8, adaptive=True), DDTreeConfig(budget=8)],
                         ids=["auto", "fixed-budget"])
def test_batches_with_a_prefill_replay_the_smallest_piecewise_graph(shape_patch, ddtree,
                                                                    monkeypatch):
    """vLLM looks only at the smallest captured count >= the batch's; where that count
    was captured for uniform decodes alone (``round_up(size, 1 + s)``), a batch holding
    a prefill found no graph and ran eagerly. Every such batch now replays the smallest
    PIECEWISE graph that holds it (``add_mixed_candidates``)."""
    from vllm.config.compilation import CUDAGraphMode

    import vllm_ddtree.patches.verify_shapes as verify_shapes

    manager, _ = graph_manager(ddtree)
    manager._init_candidates()
    mark_captured(manager)
    with monkeypatch.context() as m:  # vLLM's candidates alone: the witness
        m.setattr(verify_shapes, "add_mixed_candidates", lambda manager: None)
        witness, _ = graph_manager(ddtree)
        witness._init_candidates()
        mark_captured(witness)
    sizes = manager.compilation_config.cudagraph_capture_sizes
    eager_in_vllm = 0
    for tokens in range(2, max(sizes) + 1):
        desc = manager.dispatch(2, tokens, None, 0)
        assert desc.cg_mode == CUDAGraphMode.PIECEWISE
        assert desc.num_tokens == min(n for n in sizes if n >= tokens)
        eager_in_vllm += witness.dispatch(2, tokens, None, 0).cg_mode == CUDAGraphMode.NONE
    assert eager_in_vllm >= 3  # 9 (-> 9: 9-row decodes only), 10, 17-18 at least
    # past the largest capture size a batch still runs eagerly
    assert manager.dispatch(2, max(sizes) + 1, None, 0).cg_mode == CUDAGraphMode.NONE


def test_other_methods_keep_vllms_mixed_batch_dispatch(shape_patch):
    """Without DDTree the candidates are vLLM's own (its chain's decode counts are
    capture sizes here, so no mixed batch is left without a graph)."""
    manager, _ = graph_manager(None)
    manager._init_candidates()
    mark_captured(manager)
    vllm_dispatch = manager.dispatch._ddtree_original.__get__(manager)
    for tokens in range(2, 33):
        assert manager.dispatch(2, tokens, None, 0) == vllm_dispatch(2, tokens, None, 0)


@pytest.mark.parametrize("ddtree", [None, DDTreeConfig(budget=8),
                                    DDTreeConfig(budget=8, adaptive=True, verify_shape="fixed")],
                         ids=["no-ddtree", "fixed-budget", "fixed-shape"])
def test_graph_manager_keeps_one_shape_otherwise(shape_patch, ddtree):
    manager, _ = graph_manager(ddtree)
    manager._init_candidates()
    assert full_decode_lengths(manager) == {9}


def test_execute_model_cuts_drafts_to_the_chosen_shape(shape_patch):
    from vllm_ddtree.verify.shape import StepPlan

    runner_cls, calls = shape_patch
    chooser = VerifyShapeChooser(8, "cpu")
    chooser.record_(torch.tensor(2))
    runner = NS(speculator=NS(step_plan=StepPlan(8, chooser.shapes, chooser=chooser)))
    original = scheduler_output()
    assert runner_cls.execute_model(runner, original) == "ran"
    assert calls[-1].num_scheduled_tokens == {"tree": 3, "short": 3, "prefill": 100}
    assert calls[-1].total_num_scheduled_tokens == 106
    # Without a plan (fixed shapes, other methods) the runner gets the object as is.
    runner_cls.execute_model(NS(speculator=NS()), original)
    assert calls[-1] is original


def test_vllms_warm_up_batch_verifies_b_where_the_schedule_decodes_plainly(shape_patch):
    """vLLM's kernel warm-up decodes with many requests (``_warmup_{i}_``), where a
    batch schedule is often at 0: its step must still verify B, so that the walk and
    the compaction kernels compile at start-up, not at the first request. A real batch
    of that size follows the schedule."""
    from vllm.v1.core.sched.output import SchedulerOutput

    from vllm_ddtree.budget.schedule import BatchSchedule
    from vllm_ddtree.verify.shape import StepPlan, warm_up_batch

    runner_cls, calls = shape_patch
    schedule = BatchSchedule([[1, 1, 8], [2, 4, 0]], max_num_reqs=4, max_budget=8)
    runner = NS(speculator=NS(step_plan=StepPlan(8, [0, 8], schedule)))

    def decode_step(prefix):
        out = SchedulerOutput.make_empty()
        ids = [f"{prefix}{i}_" for i in range(3)]
        out.num_scheduled_tokens = dict.fromkeys(ids, 9)
        out.total_num_scheduled_tokens = 27
        out.scheduled_spec_decode_tokens = {r: [-1] * 8 for r in ids}
        return out

    assert warm_up_batch(["_warmup_0_"]) and not warm_up_batch(["req-0"])
    assert not warm_up_batch([])
    runner_cls.execute_model(runner, decode_step("_warmup_"))
    assert calls[-1].total_num_scheduled_tokens == 27  # B = 8 drafts kept
    runner_cls.execute_model(runner, decode_step("req-"))
    assert calls[-1].total_num_scheduled_tokens == 3  # the schedule's 0: plain
    assert calls[-1].scheduled_spec_decode_tokens == {}


def test_shape_choice_has_no_host_sync():
    """record_ (the copy of the chosen budget to pinned host memory) and next_shape
    (reading it back once its event completed) do not make the host wait: the read is
    of host memory, not of the device tensor (the detector treats CPU tensors as
    device tensors, except the chooser's host slots)."""
    from vllm_ddtree.testing.sync_guard import assert_no_host_sync

    chooser = VerifyShapeChooser(64, "cpu")
    chosen = torch.tensor(8)  # a device tensor on a GPU run
    with assert_no_host_sync(host_tensors=[chooser._host]):
        chooser.record_(chosen)
        shape = chooser.next_shape()
        truncate_drafts(scheduler_output(), shape)
    assert shape == 8


def test_forced_budget_hook(monkeypatch):
    """The GPU tests' hook (``vllm_ddtree.testing.forced_budgets``, applied by the check
    script itself): choose returns the listed non-zero budgets in turn, capped at B; the
    step gate takes a plain step for each 0 in turn; bad lists are refused."""
    from vllm_ddtree.budget.attention_timing import measure_attention_table
    from vllm_ddtree.budget.gate import SpeculationGate
    from vllm_ddtree.budget.policy import BudgetPolicy
    from vllm_ddtree.testing import forced_budgets

    monkeypatch.setattr(BudgetPolicy, "choose", BudgetPolicy.choose)  # restored after
    monkeypatch.setattr(SpeculationGate, "_choose", SpeculationGate._choose)
    # The in-graph choice needs CUDA; a stand-in writes the policy's own pick (B).
    monkeypatch.setattr(BudgetPolicy, "choose_in_graph",
                        lambda self, *args: self.chosen.fill_(self.max_budget))
    forced_budgets.apply_in_worker(None, forced_budgets.parse_budgets("1,4,0,99"))
    table = measure_attention_table(lambda c, q: 1e-6 * q, [1024], [1, 2, 4, 8])
    policy = BudgetPolicy(table, num_layers=2)
    scores, ctx = torch.zeros(2, 8), torch.tensor([100, 200])
    assert [int(policy.choose(scores, ctx)) for _ in range(4)] == [1, 4, 8, 1]
    # In the graph: the forced budget lands in ``chosen`` from a device counter (a
    # replayed graph has no host iterator), overriding the policy's own pick.
    rows = torch.zeros(2, dtype=torch.int32)
    picks = [int(policy.choose_in_graph(scores, ctx, rows, 1)) for _ in range(4)]
    assert picks == [1, 4, 8, 1]
    assert int(policy.chosen) == 1 and int(policy._forced_turn) == 4
    # The host's arm follows the whole list: plain (0) for a 0, else the cap, so that
    # the device budgets apply (a zero budget cap stays 0).
    gate = SpeculationGate(policy.cost_model(), "cpu", arms=[0, 1, 2, 4, 8])
    import numpy as np

    # Through ``decide``, the worker's call, so the patch keeps ``_choose``'s signature.
    contexts = np.array([100, 200])
    arms = [gate.decide(2, contexts, 8) for _ in range(5)]
    assert arms == [8, 8, 0, 8, 8]
    assert gate.decide(2, contexts, 4) == 4
    assert gate.decide(2, contexts, 0) == 0
    for bad in ("", "-1,2", "0,0", "a"):
        with pytest.raises(ValueError, match="forced budgets"):
            forced_budgets.parse_budgets(bad)


def test_register_leaves_the_forced_budget_hook_out():
    """The plugin entry point neither imports the test hook nor patches the policy."""
    code = ("import sys, vllm_ddtree; vllm_ddtree.register(); "
            "from vllm_ddtree.budget.policy import BudgetPolicy; "
            "assert 'vllm_ddtree.testing.forced_budgets' not in sys.modules; "
            "assert not hasattr(BudgetPolicy.choose, '_forced_original')")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


class FakeGraph:
    """A captured graph whose replay notes which shape's inputs were in the buffers."""

    def __init__(self, desc, buffers):
        self.desc, self.buffers, self.replays = desc, buffers, []

    def replay(self):
        self.replays.append(self.buffers["inputs_of"])


def fake_vllm_capture(self, create_forward_fn, progress_bar_desc="x"):
    """vLLM 0.26's capture loop order (cudagraph_utils.py:320-357) for FULL descs:
    prepare (warm-up), run, prepare again, capture, store the graph."""
    for desc in self._capture_descs_for_test:
        create_forward_fn(desc, warmup=True)()
        create_forward_fn(desc, warmup=False)
        self.graphs[desc] = FakeGraph(desc, self.buffers)


@pytest.mark.parametrize("verify_shape", ["adaptive", "fixed"])
def test_capture_times_each_shape_graph_with_its_own_inputs(monkeypatch, verify_shape):
    """The capture patch replays verify graphs right after their capture, before the
    next shape's inputs are prepared, and capture_model hands the one-request times to
    the auto policy as row costs. With auto's step gate (adaptive shapes at TP = 1)
    graphs of 2, 4, ... requests are timed too and go to the gate's cost model by total
    rows, with the drafter's block-pass graphs by requests. Fixed verify shapes time
    nothing."""
    from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor as Desc
    from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner
    from vllm.v1.worker.gpu.spec_decode.dflash.cudagraph import DFlashCudaGraphManager

    import vllm_ddtree.patches.verify_shapes as verify_shapes
    from vllm_ddtree.budget import verify_costs as verify_shape_costs
    from vllm_ddtree.budget.attention_timing import measure_attention_table
    from vllm_ddtree.budget.gate import SpeculationGate
    from vllm_ddtree.budget.policy import BudgetPolicy

    for cls, name in ((CudaGraphManager, "capture"), (GPUModelRunner, "capture_model"),
                      (GPUModelRunner, "execute_model")):
        fn = getattr(cls, name)
        monkeypatch.setattr(cls, name, getattr(fn, "_ddtree_original", fn))
    monkeypatch.setattr(CudaGraphManager, "capture", fake_vllm_capture)
    monkeypatch.setattr(GPUModelRunner, "capture_model", lambda self: (
        self.cudagraph_manager.capture(lambda d, w: None),
        self.speculator.query_cudagraph_manager.capture(lambda d, w: None), 7)[-1])
    verify_shapes.apply()

    timed = []

    def time_fn(run):
        run()
        desc = run.__self__.desc
        timed.append(desc)
        return 1e-3 * desc.num_reqs + 1e-5 * desc.num_tokens

    real_timer = verify_shape_costs.ShapeGraphTimer
    monkeypatch.setattr(verify_shape_costs, "ShapeGraphTimer",
                        lambda graphs, shapes, request_counts=(1,): real_timer(
                            graphs, shapes, time_fn, request_counts))

    # B = 8, max_num_seqs 4, the adaptive shapes with b = 0 (auto at TP = 1) or fixed
    ddtree = DDTreeConfig(budget=8, adaptive=True, verify_shape=verify_shape)
    config = NS(parallel_config=NS(tensor_parallel_size=1),
                speculative_config=FakeSpecConfig(ddtree))
    gate = verify_shape == "adaptive"

    def manager_of(cls, shapes, descs, query_len):
        manager = object.__new__(cls)
        manager.vllm_config, manager.max_num_reqs = config, 4
        manager.decode_query_len = query_len
        manager.graphs, manager.buffers = {}, {"inputs_of": None}
        manager._ddtree_shapes = shapes
        manager._capture_descs_for_test = descs

        def create(desc, warmup):
            manager.buffers["inputs_of"] = desc
            return lambda: None

        manager.capture = lambda fn: CudaGraphManager.capture(manager, create)
        manager.create = create
        return manager

    target_descs = [Desc("FULL", 9 * r, r, 9) for r in (3, 2, 1)] + [
        Desc("FULL", 1 + s, 1, 1 + s) for s in (4, 2, 1, 0)] + [Desc("FULL", 4, 4, 1)]
    target = manager_of(CudaGraphManager, [0, 1, 2, 4, 8] if gate else None, target_descs, 9)
    drafter_descs = [Desc("FULL", 16 * r, r, 16) for r in (4, 3, 1)]
    drafter = manager_of(DFlashCudaGraphManager, None, drafter_descs, 16)
    table = measure_attention_table(lambda c, q: 1e-6, [1024], [1, 2, 4, 8])
    policy = BudgetPolicy(table, 2)
    plan = NS(gate=SpeculationGate(policy.cost_model(), "cpu", [0, 1, 2, 4, 8])
              if gate else None)
    runner = NS(cudagraph_manager=target,
                speculator=NS(budget_policy=policy, step_plan=plan,
                              query_cudagraph_manager=drafter))
    assert GPUModelRunner.capture_model(runner) == 7
    for manager in (target, drafter):  # each replay saw its graph's own inputs
        for desc, graph in manager.graphs.items():
            assert set(graph.replays) <= {desc}
    if not gate:  # fixed shapes: nothing to time (no row costs, no gate)
        assert timed == [] and policy.row_seconds is None
        return
    # one request of every shape, and 2 and 4 requests (3 is no power of two)
    assert sorted((d.num_reqs, d.uniform_token_count) for d in timed) == [
        (1, 1), (1, 2), (1, 3), (1, 5), (1, 9), (1, 16), (2, 9), (4, 1), (4, 16)]
    assert target._ddtree_shape_timer.seconds == pytest.approx(
        {s: 1e-3 + 1e-5 * (1 + s) for s in (0, 1, 2, 4, 8)})
    rows = policy.row_seconds.tolist()  # one request, over the smallest candidate (b = 1)
    assert rows == pytest.approx([0.0, 1e-5, 3e-5, 7e-5], abs=1e-9)
    model = plan.gate.model
    assert model.verify_rows.tolist() == [1, 2, 3, 4, 5, 9, 18]
    assert model.draft_reqs.tolist() == [1, 4]
    assert model.draft_seconds.tolist() == pytest.approx([1e-3 + 16e-5, 4e-3 + 64e-5])
    # TP > 1: no replays inside vLLM's capture context (custom all-reduce buffers)
    timed.clear()
    target.graphs, target._ddtree_shape_timer = {}, None
    config.parallel_config = NS(tensor_parallel_size=2)
    CudaGraphManager.capture(target, target.create)
    assert timed == [] and target._ddtree_shape_timer is None


def test_shape_timer_failure_leaves_auto_without_row_costs():
    from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor as Desc

    from vllm_ddtree.budget.verify_costs import ShapeGraphTimer

    def broken(run):
        raise RuntimeError("replay failed")

    graphs = {Desc("FULL", 2, 1, 2): NS(replay=lambda: None)}
    timer = ShapeGraphTimer(graphs, [1], broken)
    timer.time_new_graphs()
    assert timer.failed and "replay failed" in timer.failed and timer.seconds == {}


def test_shape_timer_lowers_one_request_times_above_larger_graphs():
    """One request's 33 and 65 rows timed at 7.2 and 7.4 ms while two requests' 130 rows
    took 3.6 ms (the V2-Lite-shaped target beside six starting engines, H100): the row
    costs auto budgets by keep each shape at most what any graph of as many tokens or
    more took; the consistent readings stay, and so does the device's choice input."""
    from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor as Desc

    from vllm_ddtree.budget.attention_timing import measure_attention_table
    from vllm_ddtree.budget.policy import BudgetPolicy
    from vllm_ddtree.budget.verify_costs import ShapeGraphTimer

    read = {(1, 0): 3.05e-3, (1, 16): 3.22e-3, (1, 32): 7.23e-3, (1, 64): 7.40e-3,
            (2, 64): 3.64e-3}
    graphs = {Desc("FULL", r * (1 + s), r, 1 + s): NS(replay=(r, s)) for r, s in read}
    timer = ShapeGraphTimer(graphs, [0, 16, 32, 64], lambda run: read[run],
                            request_counts=(1, 2))
    timer.time_new_graphs()
    assert timer.seconds == pytest.approx({0: 3.05e-3, 16: 3.22e-3, 32: 3.64e-3,
                                           64: 3.64e-3})
    policy = BudgetPolicy(measure_attention_table(lambda c, q: 1e-6, [1024], [16, 32, 64]),
                          64)
    policy.set_row_costs({16: 3.22e-3, 32: 7.23e-3, 64: 3.64e-3})  # 32 read slow
    assert policy.row_seconds.tolist() == pytest.approx([0.0, 0.42e-3, 0.42e-3])
