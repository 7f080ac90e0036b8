"""``ddtree_budget: "auto"``'s b = 0 gate on CPU (``vllm_ddtree.budget.gate``): the
start-up cost model by batch size, and the host's choice between speculative and
plain steps in a simulated engine whose steps take known times: it turns to plain
decoding where that is faster (a large batch, a drafter that is rarely right) and comes
back when speculation pays again, without a host sync."""

import numpy as np
import pytest
import torch

from vllm_ddtree.budget.gate import PROBE_STEPS, SpeculationGate, batch_bucket
from vllm_ddtree.budget.step_cost import StepCostModel
from vllm_ddtree.verify.shape import StepPlan


def cost_model(num_layers=2, graphs=True) -> StepCostModel:
    """Attention 1 us a request and layer at one row, +0.1 us a row, doubling from 1k to
    2k context; verify forward 100 us + 1 us a row; drafter 200 us + 10 us a request."""
    contexts = [1024, 2048]
    budgets = [1, 2, 4, 8]
    tree = [[1e-6 + 1e-7 * (1 + b) for b in budgets], [2e-6 + 2e-7 * (1 + b) for b in budgets]]
    model = StepCostModel(num_layers, contexts, [1e-6, 2e-6], tree, budgets)
    if graphs:
        model.set_graph_costs({n: 1e-4 + 1e-6 * n for n in (1, 2, 4, 9, 16, 36)},
                              {r: 2e-4 + 1e-5 * r for r in (1, 2, 4)})
    return model


def test_buckets():
    assert [batch_bucket(r) for r in (1, 2, 3, 4, 5, 8, 9, 64, 65)] == [0, 1, 2, 2, 3, 3, 4,
                                                                        6, 7]


class Clock:
    """A fake GPU timeline: events stamp the time when made; every step adds its true
    duration."""

    def __init__(self):
        self.now = 0.0

    def event(self):
        clock = self

        class Event:
            t = clock.now

            def query(self):
                return True

            def elapsed_time(self, end):
                return 1e3 * (end.t - self.t)

        return Event()


class Engine:
    """A simulated engine: a speculative step of R requests takes
    ``host_spec + per_req_spec * R`` seconds and commits ``committed`` tokens a request;
    a plain step ``host_plain + per_req_plain * R`` and commits one. Drives a StepPlan
    with a gate as vLLM drives it: step_shape at execute_model, then (after the walk)
    the acceptance counters and draft_next at propose."""

    def __init__(self, committed=3.0, host_spec=3e-3, per_req_spec=4e-4, host_plain=2e-3,
                 per_req_plain=5e-5):
        self.clock = Clock()
        self.gate = SpeculationGate(cost_model(graphs=False), "cpu",
                                    make_event=self.clock.event)
        self.plan = StepPlan(8, [0, 1, 2, 4, 8], gate=self.gate)
        self.committed = committed
        self.spec = (host_spec, per_req_spec)
        self.plain = (host_plain, per_req_plain)
        self.accepted = torch.zeros(1, dtype=torch.int64)
        self.trees = torch.zeros(1, dtype=torch.int64)
        self.tokens = 0.0

    def run(self, num_reqs: int, steps: int) -> list[bool]:
        """``steps`` steps at batch ``num_reqs``; returns whether each step verified trees."""
        kinds = []
        for _ in range(steps):
            shape = self.plan.step_shape(num_reqs, uniform=True)
            if shape > 0:
                self.trees += num_reqs
                self.accepted += round(num_reqs * (self.committed - 1))
                self.gate.record_acceptance_(self.accepted, self.trees, num_reqs)
                self.tokens += num_reqs * self.committed
            else:
                self.tokens += num_reqs
            draft = self.plan.draft_next(num_reqs, np.full(num_reqs, 1024))
            # the step's own verify and the drafter's pass it ran at its end
            host, per_req = self.spec if shape > 0 else self.plain
            seconds = host + per_req * num_reqs * (1 + 0.5 * (shape > 0))
            self.clock.now += seconds / 2 + (self.spec[0] / 2 if draft else self.plain[0] / 2)
            kinds.append(shape > 0)
        return kinds


def test_gate_decodes_plainly_at_large_batches_and_comes_back_when_speculation_pays():
    """Batch 1: speculation (3 tokens a step for 1.5x the time) pays, the gate keeps
    it after one calibration probe of plain steps. Batch 64: a speculative step takes
    about 3.8x a plain one for 3x the tokens, so the gate turns to plain decoding and
    probes speculation rarely. Back at batch 2 it speculates again."""
    engine = Engine()
    kinds = engine.run(1, 200)
    assert sum(kinds[-150:]) >= 150 - PROBE_STEPS  # speculating, at most one probe
    assert not all(kinds)  # the plain steps were measured once
    kinds = engine.run(64, 400)
    assert sum(kinds[-300:]) <= 2 * PROBE_STEPS  # plain, probing at most twice
    kinds = engine.run(2, 200)
    assert sum(kinds[-150:]) >= 150 - PROBE_STEPS
    # The measured residuals reflect the simulated host times per kind.
    stats = engine.gate.stats[batch_bucket(64)]
    assert stats.plain.count > 0 and stats.spec.count > 0
    assert stats.committed.value == pytest.approx(3.0, rel=0.01)


@pytest.mark.parametrize("committed, speculating", [(1.05, False), (4.0, True)])
def test_gate_follows_the_measured_acceptance(committed, speculating):
    """At batch 4 a speculative step costs about 2x a plain one: a drafter that is
    rarely right (1.05 tokens a tree) loses to plain decoding, one whose trees commit
    4 tokens wins."""
    engine = Engine(committed=committed, host_spec=4e-3, per_req_spec=2e-4,
                    host_plain=2e-3, per_req_plain=1e-4)
    kinds = engine.run(4, 300)
    tail = kinds[-200:]
    if speculating:
        assert sum(tail) >= 200 - 2 * PROBE_STEPS
    else:
        assert sum(tail) <= 2 * PROBE_STEPS


def test_schedule_zero_skips_the_gate_and_probes():
    from vllm_ddtree.budget.schedule import BatchSchedule

    engine = Engine()
    engine.plan.schedule = BatchSchedule([(1, 2, 8), (3, 64, 0)], 64, 8)
    assert not any(engine.run(16, 50))  # cap 0: never drafts, never probes
    assert engine.gate.probe_left == 0


def test_gate_steps_have_no_host_sync():
    """step_started, record_acceptance_ and decide read only host memory: the counters
    are copied to (pinned) host slots without a sync, events are only queried."""
    from vllm_ddtree.testing.sync_guard import assert_no_host_sync

    engine = Engine()
    engine.run(2, 20)
    accepted = torch.zeros(1, dtype=torch.int64)
    trees = torch.ones(1, dtype=torch.int64)
    with assert_no_host_sync(host_tensors=[engine.gate._accept_host]):
        engine.plan.step_shape(2, uniform=True)
        engine.gate.record_acceptance_(accepted, trees, 2)
        engine.plan.draft_next(2, np.full(2, 1024))


def test_one_stalled_step_does_not_keep_the_gate_off_speculation():
    """One speculative step stretched by a host stall (a GC pause, a log flush: 0.3 s,
    under MAX_STEP_SECONDS) must not turn a batch where speculation pays ~2x to plain
    decoding for good: with an EMA residual the stall made speculation look slower than
    the probe threshold, so it was never probed (nor measured) again."""
    engine = Engine()
    assert sum(engine.run(4, 100)[-50:]) == 50
    engine.clock.now += 0.3  # the stall, inside the last speculative step's interval
    kinds = engine.run(4, 300)
    assert sum(kinds[-200:]) >= 200 - 2 * PROBE_STEPS


def test_plain_decoding_probes_speculation_again_when_acceptance_was_low():
    """Requests the drafter rarely gets right (1.05 tokens a tree) turn the gate to plain
    decoding; when later requests would commit 4 tokens a tree (speculation then pays
    ~2x), the scheduled probes must still run: plain steps measure no acceptance, so
    the stale figure predicted speculation below the probe ratio and it never came
    back."""
    engine = Engine(committed=1.05, host_spec=4e-3, per_req_spec=2e-4, host_plain=2e-3,
                    per_req_plain=1e-4)
    assert sum(engine.run(4, 300)[-200:]) <= 2 * PROBE_STEPS
    engine.committed = 4.0
    kinds = engine.run(4, 2000)
    assert sum(kinds[-500:]) >= 500 - 2 * PROBE_STEPS


def test_scheduled_probes_also_run_in_a_bucket_that_never_measured_speculation():
    """The same at a batch size of another bucket (6 requests, bucket 5-8) that never ran
    a tree: its first probe is skipped (speculation, measured at 4 requests, predicted
    far slower), and the scheduled probes must not be skipped with it."""
    engine = Engine(committed=1.05, host_spec=4e-3, per_req_spec=2e-4, host_plain=2e-3,
                    per_req_plain=1e-4)
    engine.run(4, 300)
    engine.committed = 4.0
    kinds = engine.run(6, 2000)
    assert sum(kinds[-500:]) >= 500 - 2 * PROBE_STEPS
