"""One compiled variant per run for the kernels launched outside CUDA graphs.

Triton compiles a kernel again for every new specialization of its arguments: a
constexpr's value, an int equal to 1 or divisible by 16, a pointer's 16-byte alignment.
vLLM's JIT monitor named ``_verify_walk_kernel`` and ``_move_path_rows_kernel`` compiling
during inference on the H100 (one took 477 ms inside ``auto``'s first batch-1 cell).
These tests compute each launch's specialization as Triton keys it and require one
variant across batch sizes and between vLLM's warm-up batches and counted ones. On CPU
the kernels run in Triton's interpreter (tests/conftest.py); the keys do not depend on it.
"""

import inspect

import pytest
import torch

triton = pytest.importorskip("triton")

from test_ddtree_integration_units import (  # noqa: E402
    BUDGET,
    DEPTHS,
    _restore_tree_mask_state,  # noqa: F401 - autouse fixture
    make_scenario,
)

from vllm_ddtree.verify import verifier  # noqa: E402
from vllm_ddtree.walk import walk_kernel  # noqa: E402


def specialization(kernel, args: tuple, kwargs: dict) -> tuple:
    """The parts of a launch that pick its compiled variant (``JITFunction`` or, under
    ``TRITON_INTERPRET=1``, ``InterpretedFunction`` with its decorator options)."""
    opts = getattr(kernel, "kwargs", None)
    if opts is None:
        opts = {"do_not_specialize": kernel.do_not_specialize,
                "do_not_specialize_on_alignment": kernel.do_not_specialize_on_alignment}
    no_value = set(opts.get("do_not_specialize") or ())
    no_align = set(opts.get("do_not_specialize_on_alignment") or ())
    params = list(inspect.signature(kernel.fn).parameters.values())
    bound = {p.name: p.default for p in params}
    bound.update(zip((p.name for p in params), args, strict=False))  # defaults stay
    bound.update(kwargs)
    key = []
    for p in params:
        value = bound[p.name]
        if "constexpr" in str(p.annotation):
            key.append((p.name, value))
        elif isinstance(value, torch.Tensor):
            aligned = None if p.name in no_align else value.data_ptr() % 16 == 0
            key.append((p.name, str(value.dtype), aligned))
        elif isinstance(value, bool) or not isinstance(value, int):
            key.append((p.name, type(value).__name__))
        else:
            key.append((p.name, None if p.name in no_value else (value == 1, value % 16 == 0)))
    return tuple(key)


class Recorder:
    """Stands for a kernel: records each launch's specialization, then launches it."""

    def __init__(self, kernel):
        self.kernel, self.keys = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.keys.append(specialization(self.kernel, args, kwargs))
            return self.kernel[grid](*args, **kwargs)
        return launch


def differences(keys: list[tuple]) -> list:
    return [(a, b) for a, b in zip(keys[0], keys[-1], strict=True) if a != b] + [
        (a, b) for k in keys[1:-1] for a, b in zip(keys[0], k, strict=True) if a != b]


@pytest.mark.skipif(not walk_kernel._interpreted(),
                    reason="CPU tensors: needs Triton's interpreter")
def test_the_walk_compiles_once_for_every_batch_size(monkeypatch):
    recorder = Recorder(walk_kernel._verify_walk_kernel)
    monkeypatch.setattr(walk_kernel, "_verify_walk_kernel", recorder)
    budget, max_depth, max_reqs = 9, 6, 8
    parents = torch.full((max_reqs, budget), -1, dtype=torch.int64)
    walk_rows = torch.full((max_reqs, max_depth), -1, dtype=torch.int64)
    counters = (torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64))
    for num_reqs in range(1, 7):
        cu = torch.arange(num_reqs + 1, dtype=torch.int32) * (1 + budget)
        num_logits = int(cu[-1])
        walk_kernel.verify_walk_triton(
            torch.zeros(num_logits, dtype=torch.int32), torch.arange(num_logits),
            torch.zeros(num_logits, dtype=torch.int64), cu,
            torch.arange(num_reqs, dtype=torch.int32), parents, max_depth, budget, walk_rows,
            torch.full((num_reqs,), 100, dtype=torch.int32),
            torch.zeros(max_reqs, dtype=torch.int32), None, counters)
    assert len(recorder.keys) == 6
    assert not differences(recorder.keys)


@pytest.mark.skipif(not walk_kernel._interpreted(),
                    reason="the verifier scenario is on CPU tensors: needs Triton's interpreter")
@pytest.mark.parametrize("adaptive", [False, True])
def test_a_warm_up_batch_launches_the_walk_a_counted_batch_launches(adaptive, monkeypatch):
    """vLLM's V2 warm-up batches (requests ``_warmup_*``) do not count; they launch the
    counting walk into scratch counters, so the variant real batches need is compiled at
    start-up. DDTree's own counters keep only the counted batch's trees."""
    recorder = Recorder(walk_kernel._verify_walk_kernel)
    monkeypatch.setattr(walk_kernel, "_verify_walk_kernel", recorder)
    monkeypatch.setattr(verifier, "use_triton", lambda tensor: True)
    sc = make_scenario(0.0)
    if adaptive:
        sc.state.enable_adaptive_(6, "cpu")
        sc.state.enable_arm_counters_([1, 2, 4, 8, 16], "cpu")
    vf = verifier.DDTreeVerifier(sc.sampler, verifier_config(), "cpu", DEPTHS,
                                 state=sc.state, draw_fn=sc.sampler.draw_fn)
    sc.batch.req_ids = [f"_warmup_{i}_" for i in range(sc.batch.num_reqs)]
    vf(sc.logits.clone(), sc.batch)
    assert int(sc.state.num_drafts) == 0 and int(sc.state.accepted_sum) == 0
    sc.batch.req_ids = [f"r{i}" for i in range(sc.batch.num_reqs)]
    vf(sc.logits.clone(), sc.batch)
    assert int(sc.state.num_drafts) > 0
    assert len(recorder.keys) == 2
    assert not differences(recorder.keys)


def verifier_config():
    from types import SimpleNamespace

    return SimpleNamespace(num_speculative_tokens=BUDGET)


def test_the_path_row_move_compiles_once_for_every_batch_size(monkeypatch):
    from vllm_ddtree.draft import hidden_rows_kernel

    recorder = Recorder(hidden_rows_kernel._move_path_rows_kernel)
    monkeypatch.setattr(hidden_rows_kernel, "_move_path_rows_kernel", recorder)
    hidden, width, max_reqs = 32, DEPTHS, 6
    walk_rows = torch.full((max_reqs, width), -1, dtype=torch.int64)
    states = [torch.zeros(64, hidden) for _ in range(3)]
    for num_reqs in range(1, max_reqs + 1):
        qsl = torch.arange(num_reqs + 1, dtype=torch.int32) * 3
        hidden_rows_kernel.move_path_rows_triton(
            [s[: int(qsl[-1])] for s in states], qsl, walk_rows[:num_reqs])
    assert len(recorder.keys) == max_reqs
    assert not differences(recorder.keys)


def test_the_drafter_inputs_compile_once_for_every_round(monkeypatch):
    """Tree decodes, a prefill chunk beside them, a single request; ``num_rejected`` as
    the fused walk returns it (the second row of one ``[2, R]`` int32 allocation)."""
    from test_dflash_inputs_kernel import make_case, run_ours, to_device

    from vllm_ddtree.draft import inputs_kernel

    recorder = Recorder(inputs_kernel._prepare_dflash_inputs_groups_kernel)
    monkeypatch.setattr(inputs_kernel, "_prepare_dflash_inputs_groups_kernel", recorder)
    rounds = [("tree",), ("tree", "tree", "tree"), ("tree", "prefill", "edge", "tree"),
              ("tree",) * 4, ("prefill",)]
    for seed, kinds in enumerate(rounds):
        inputs, block_tables = make_case(kinds, [16], False, seed)
        counts = torch.empty(2, len(kinds), dtype=torch.int32)
        counts[0], counts[1] = inputs["num_sampled"], inputs["num_rejected"]
        inputs["num_sampled"], inputs["num_rejected"] = counts[0], counts[1]
        done, _ = run_ours(*to_device(inputs, block_tables), [16], [0])
        assert done
    assert len(recorder.keys) == len(rounds)
    assert not differences(recorder.keys)


def test_the_context_row_compaction_compiles_once_for_every_batch_size(monkeypatch):
    """``num_sampled`` as the fused walk returns it (the first row of one ``[2, R]``
    allocation); the rows of every round of ``tests/test_context_rows.py``."""
    from test_context_rows import CASES, random_round

    from vllm_ddtree.draft import hidden_rows_kernel

    recorder = Recorder(hidden_rows_kernel._compact_path_rows_kernel)
    monkeypatch.setattr(hidden_rows_kernel, "_compact_path_rows_kernel", recorder)
    out_positions = torch.zeros(40 * 8, dtype=torch.int64)
    out_rejected = torch.zeros(40, dtype=torch.int32)
    for qlens, accepted in CASES:
        xs, qsl, src, positions, num_sampled = random_round(qlens, accepted)
        counts = torch.empty(2, len(qlens), dtype=torch.int32)
        counts[0] = num_sampled
        assert hidden_rows_kernel.compact_path_rows_triton(
            xs, qsl, src, positions, counts[0], 8, out_positions, out_rejected)
    assert len(recorder.keys) == len(CASES)
    assert not differences(recorder.keys)


def test_warm_up_scratch_counters_follow_the_state(monkeypatch):
    """Counters enabled after a warm-up batch (arm counters of a step gate) get scratch
    copies of their own shape at the next one, never the state's."""
    monkeypatch.setattr(verifier, "use_triton", lambda tensor: True)
    sc = make_scenario(0.0)
    vf = verifier.DDTreeVerifier(sc.sampler, verifier_config(), "cpu", DEPTHS,
                                 state=sc.state, draw_fn=sc.sampler.draw_fn)
    sc.batch.req_ids = [f"_warmup_{i}_" for i in range(sc.batch.num_reqs)]
    vf(sc.logits.clone(), sc.batch)
    assert vf._scratch_counters.arm_accepted_sum is None
    sc.state.enable_adaptive_(6, "cpu")
    sc.state.enable_arm_counters_([1, 2, 4, 8, 16], "cpu")
    counters, active_sum, arms = vf._walk_counters(sc.batch)
    assert arms[1].shape == sc.state.arm_accepted_sum.shape
    assert arms[1] is not sc.state.arm_accepted_sum and active_sum is not None
    assert active_sum is not sc.state.active_nodes_sum
    assert all(c is not getattr(sc.state, n)
               for c, n in zip(counters, ("accepted_sum", "num_drafts"), strict=True))
