# SPDX-License-Identifier: Apache-2.0
"""``ddtree_budget: "auto"``'s choice in one launch (vllm_ddtree.budget.choice_kernel)
against ``BudgetPolicy.choose``'s PyTorch ops: the same budget and the same modeled
attention, over batches larger than one block of rows, node counts that are not powers
of two, one- and many-point cost tables (clamped or extrapolated), with and without a
base-time sample. Without a GPU the kernel runs in Triton's interpreter."""

import pytest
import torch

pytest.importorskip("triton")

from kernel_testing import (  # noqa: E402
    DEVICE,
    compiled_shared_memory,
    skip_unless_kernels_run_here,
)

from vllm_ddtree.budget import choice_kernel as budget_choice_kernel  # noqa: E402
from vllm_ddtree.budget.choice import BudgetCostTable  # noqa: E402
from vllm_ddtree.budget.choice_kernel import choose_budget_triton  # noqa: E402
from vllm_ddtree.budget.policy import BudgetPolicy, candidate_budgets  # noqa: E402

pytestmark = skip_unless_kernels_run_here(budget_choice_kernel._choose_budget_kernel)


def make_policy(budget, contexts, extrapolate, base, gen):
    budgets = candidate_budgets(budget)
    ctx = torch.tensor(contexts)
    # cost grows with the context and the budget, steeply at long context
    seconds = (1e-5 + ctx[:, None] * 2e-9 * torch.tensor(budgets)[None, :] ** 0.7
               * (1 + 0.1 * torch.rand(len(contexts), len(budgets), generator=gen)))
    seconds = seconds.cummax(dim=1).values.float()
    policy = BudgetPolicy(BudgetCostTable(ctx, torch.tensor(budgets), seconds, extrapolate),
                          num_layers=7)
    policy.base_seconds.fill_(base)
    return policy


@pytest.mark.parametrize("case", range(8))
def test_kernel_chooses_what_the_pytorch_policy_chooses(case):
    gen = torch.Generator().manual_seed(case)
    budget = (48, 64, 32, 100, 16, 64, 128, 7)[case]
    contexts = [[1024, 4096, 16384, 65536, 131072], [2048], [1024, 8192]][case % 3]
    policy = make_policy(budget, contexts, extrapolate=case % 2 == 0,
                         base=(-1.0, 3e-3, 5e-4, 2e-2)[case % 4], gen=gen)
    num_reqs = (1, 5, 37, 16, 2, 23, 9, 40)[case]
    # peaked trees (confident drafter) in some rows, flat ones in others
    scores = torch.randn(num_reqs, budget, generator=gen) * 2 - torch.rand(
        num_reqs, 1, generator=gen) * 6
    scores = scores.sort(dim=1, descending=True).values.clamp(max=0).float()
    context_lens = torch.randint(10, 200_000, (num_reqs,), generator=gen, dtype=torch.int32)

    want = policy.choose(scores, context_lens)  # CPU tensors: the PyTorch ops
    want_attention = policy.last_attention.clone()
    policy.last_attention.fill_(-1.0)
    table = policy.table
    got = choose_budget_triton(
        scores.to(DEVICE), context_lens.to(DEVICE), table.contexts.to(DEVICE),
        table.seconds.to(DEVICE), policy.budgets.to(DEVICE), policy.base_seconds.to(DEVICE),
        last_attention := policy.last_attention.to(DEVICE), policy.num_layers,
        table.extrapolate)
    assert got.dim() == 0 and int(got) == int(want), (int(got), int(want))
    torch.testing.assert_close(last_attention.cpu(), want_attention, rtol=1e-5, atol=0)


def test_choices_span_small_and_large_budgets():
    """The cases above are not all one answer: a confident drafter at a short context
    takes the largest tree, a flat one at a long context a small one."""
    gen = torch.Generator().manual_seed(0)
    policy = make_policy(64, [1024, 4096, 16384, 65536, 131072], True, 1e-3, gen)
    table = policy.table
    args = (table.contexts, table.seconds, policy.budgets, policy.base_seconds,
            policy.last_attention, policy.num_layers, True)
    confident = torch.zeros(4, 64)
    confident[:, 1:] = -0.01 * torch.arange(1, 64)
    flat = torch.full((4, 64), -12.0)
    short, long = torch.full((4,), 1024, dtype=torch.int32), torch.full((4,), 131072,
                                                                       dtype=torch.int32)
    dev = [t.to(DEVICE) for t in (confident, flat, short, long)]
    big = choose_budget_triton(dev[0], dev[2], *[a.to(DEVICE) if torch.is_tensor(a) else a
                                                 for a in args])
    small = choose_budget_triton(dev[1], dev[3], *[a.to(DEVICE) if torch.is_tensor(a) else a
                                                   for a in args])
    assert int(big) == 64 and int(small) == 1


@pytest.mark.parametrize(("base", "wall", "last"), [
    (-1.0, 4e-3, 5e-4),  # first sample: base = wall - last attention
    (3e-3, 5e-3, 1e-3),  # EMA
    (1e-3, 9e-3, 1e-3),  # an outlier, capped at 2 x base + 0.1 ms
    (2e-3, 1e-4, 1e-3),  # wall below the modeled attention: a zero sample
])
def test_kernel_folds_the_wall_sample_as_update_base_(base, wall, last):
    """``choose`` with a recorded wall sample: the launch first folds it into the base
    EMA exactly as ``update_base_`` does, then chooses with the new base."""
    gen = torch.Generator().manual_seed(3)
    policy = make_policy(64, [1024, 16384, 131072], True, base, gen)
    policy.ema_weight = 0.3
    policy.last_attention.fill_(last)
    scores = (torch.randn(6, 64, generator=gen) - 3).sort(dim=1, descending=True).values
    scores = scores.clamp(max=0).float()
    ctx = torch.randint(1000, 150_000, (6,), generator=gen, dtype=torch.int32)
    wall = torch.tensor([wall])

    policy.update_base_(wall)  # the PyTorch reference
    want_base = policy.base_seconds.clone()
    want = policy.choose(scores, ctx)
    want_attention = policy.last_attention.clone()

    table = policy.table
    base_dev = torch.tensor([base], device=DEVICE)
    last_dev = torch.tensor([last], device=DEVICE)
    got = choose_budget_triton(
        scores.to(DEVICE), ctx.to(DEVICE), table.contexts.to(DEVICE),
        table.seconds.to(DEVICE), policy.budgets.to(DEVICE), base_dev, last_dev,
        policy.num_layers, table.extrapolate, wall_seconds=wall.to(DEVICE), ema_weight=0.3)
    torch.testing.assert_close(base_dev.cpu(), want_base, rtol=1e-6, atol=0)
    assert int(got) == int(want)
    torch.testing.assert_close(last_dev.cpu(), want_attention, rtol=1e-5, atol=0)


def _choose_with_row_costs(policy, scores, ctx, **kwargs):
    """The kernel on ``policy``'s table, base time and row costs (copies on DEVICE):
    ``(b, the modeled time it recorded)``."""
    table = policy.table
    last = torch.zeros(1, device=DEVICE)
    got = choose_budget_triton(
        scores.to(DEVICE), ctx.to(DEVICE), table.contexts.to(DEVICE),
        table.seconds.to(DEVICE), policy.budgets.to(DEVICE),
        policy.base_seconds.to(DEVICE), last, policy.num_layers, table.extrapolate,
        row_seconds=policy.row_seconds.to(DEVICE), **kwargs)
    return got, last


@pytest.mark.parametrize("num_reqs", [1, 3, 40])
def test_kernel_adds_the_row_cost_as_the_pytorch_policy_does(num_reqs):
    """With measured row costs (adaptive verify shapes) the modeled round time adds
    the cost of ``R * (1 + b)`` verified rows (interpolated, extended past the largest
    one-request shape): same choice and same recorded modeled time as PyTorch."""
    gen = torch.Generator().manual_seed(num_reqs)
    policy = make_policy(64, [1024, 16384, 131072], True, 2e-3, gen)
    times = {b: 1e-3 + 4e-6 * b + 1e-7 * b * b for b in candidate_budgets(64)}
    policy.set_row_costs(times)
    scores = (torch.randn(num_reqs, 64, generator=gen) - 1).sort(dim=1, descending=True)
    scores = scores.values.clamp(max=0).float()
    ctx = torch.randint(1000, 150_000, (num_reqs,), generator=gen, dtype=torch.int32)
    want = policy.choose(scores, ctx)
    want_modeled = policy.last_attention.clone()
    got, last = _choose_with_row_costs(policy, scores, ctx)
    assert int(got) == int(want)
    torch.testing.assert_close(last.cpu(), want_modeled, rtol=1e-5, atol=0)


@pytest.mark.parametrize("num_reqs", [1, 5])
@pytest.mark.parametrize("hidden", [0.0, 1e-5, 1e-3])
def test_hidden_gpu_time_counts_as_the_pytorch_policy_counts_it(num_reqs, hidden):
    """``BudgetPolicy.hide_(64, s)``: every candidate's modeled cost is at least 64's
    plus ``s`` (the host's step outlasts the GPU's by ``s`` after 64-node steps, so a
    smaller tree saves nothing): the kernel makes PyTorch's choice and records the
    same modeled time; these trees, cut to 32 or 16 nodes when every row costs, keep
    all 64 once any time is hidden, and none hidden changes nothing."""
    gen = torch.Generator().manual_seed(10 + num_reqs)
    policy = make_policy(64, [1024, 16384, 131072], True, 2e-3, gen)
    policy.set_row_costs({b: 1e-3 + 4e-6 * b + 1e-7 * b * b for b in candidate_budgets(64)})
    scores = (torch.randn(num_reqs, 64, generator=gen) - 2).sort(dim=1, descending=True)
    scores = scores.values.clamp(max=0).float()
    ctx = torch.randint(1000, 20_000, (num_reqs,), generator=gen, dtype=torch.int32)
    free = int(policy.choose(scores, ctx))
    policy.hide_(64, hidden)
    np_hidden = policy.hidden.tolist()
    assert np_hidden == ([64.0, pytest.approx(hidden)] if hidden else [0.0, 0.0])
    want = policy.choose(scores, ctx)
    want_modeled = policy.last_attention.clone()
    got, last = _choose_with_row_costs(policy, scores, ctx, hidden=policy.hidden.to(DEVICE))
    assert int(got) == int(want)
    torch.testing.assert_close(last.cpu(), want_modeled, rtol=1e-5, atol=0)
    assert free < 64
    assert int(want) == (64 if hidden else free)
    modeled = policy.modeled_seconds(ctx)
    if hidden:
        torch.testing.assert_close(want_modeled, modeled[-1:] + hidden)


def test_hide_copies_only_a_changed_pair():
    """The gate calls ``hide_`` at every drafting propose: a pinned copy only when the
    pair changed; a time of 0 or below is none (the arm is then dropped too)."""
    policy = make_policy(64, [1024], False, 1e-3, torch.Generator().manual_seed(0))
    policy.hide_(32, 2e-4)
    slot = policy._hidden_slot
    policy.hide_(32, 2e-4)
    assert policy._hidden_slot == slot
    policy.hide_(64, -1.0)
    assert policy.hidden.tolist() == [0.0, 0.0] and policy._hidden_slot != slot


def _policy_args(policy):
    table = policy.table
    return (table.contexts.to(DEVICE), table.seconds.to(DEVICE), policy.budgets.to(DEVICE))


@pytest.mark.parametrize("num_reqs", [3, 21])
def test_padding_rows_of_a_graph_batch_do_not_count(num_reqs):
    """Inside the drafter's CUDA graph the batch is padded: rows whose state row
    (``sample_idx_mapping[r * L]``) is -1 must not move the choice, the modeled
    attention or the row cost (which counts the valid requests)."""
    gen = torch.Generator().manual_seed(num_reqs)
    policy = make_policy(64, [1024, 16384, 131072], True, 2e-3, gen)
    policy.set_row_costs({b: 1e-3 + 4e-6 * b + 1e-7 * b * b for b in candidate_budgets(64)})
    depths = 15
    scores = (torch.randn(num_reqs, 64, generator=gen) - 1).sort(dim=1, descending=True)
    scores = scores.values.clamp(max=0).float()
    ctx = torch.randint(1000, 150_000, (num_reqs,), generator=gen, dtype=torch.int32)
    valid = torch.rand(num_reqs, generator=gen) < 0.6
    valid[0] = True
    want = policy.choose(scores[valid], ctx[valid])  # the valid requests alone
    want_modeled = policy.last_attention.clone()

    rows = torch.full((num_reqs * depths,), -1, dtype=torch.int32)
    rows[::depths] = torch.where(valid, torch.arange(num_reqs, dtype=torch.int32), -1)
    padded = scores.clone()
    padded[~valid] = 0.0  # the most confident trees: would pull the choice up
    last = torch.zeros(1, device=DEVICE)
    out = torch.full((1,), -7, dtype=torch.int64, device=DEVICE)
    got = choose_budget_triton(
        padded.to(DEVICE), ctx.to(DEVICE), *_policy_args(policy),
        policy.base_seconds.to(DEVICE), last, policy.num_layers, policy.table.extrapolate,
        row_seconds=policy.row_seconds.to(DEVICE), row_of_sample=rows.to(DEVICE),
        idx_stride=depths, out=out)
    assert int(got) == int(want) == int(out[0].cpu())
    torch.testing.assert_close(last.cpu(), want_modeled, rtol=1e-5, atol=0)


@pytest.mark.parametrize("pending", [True, False])
def test_the_device_flag_says_whether_a_sample_is_folded_and_is_cleared(pending):
    """``sample_flag``: a graph replayed every round folds the wall sample only when the
    host recorded one (pending != 0), then clears the flag."""
    gen = torch.Generator().manual_seed(5)
    policy = make_policy(64, [1024, 16384, 131072], True, 3e-3, gen)
    policy.ema_weight = 0.3
    policy.last_attention.fill_(1e-3)
    scores = (torch.randn(4, 64, generator=gen) - 3).sort(dim=1, descending=True).values
    scores = scores.clamp(max=0).float()
    ctx = torch.randint(1000, 150_000, (4,), generator=gen, dtype=torch.int32)
    if pending:
        policy.update_base_(torch.tensor([5e-3]))
    want_base = policy.base_seconds.clone()
    want = policy.choose(scores, ctx)

    base = torch.tensor([3e-3], device=DEVICE)
    wall = torch.tensor([5e-3, 1.0 if pending else 0.0], device=DEVICE)
    got = choose_budget_triton(
        scores.to(DEVICE), ctx.to(DEVICE), *_policy_args(policy), base,
        torch.tensor([1e-3], device=DEVICE), policy.num_layers, policy.table.extrapolate,
        wall_seconds=wall, ema_weight=0.3, sample_flag=True)
    torch.testing.assert_close(base.cpu(), want_base, rtol=1e-6, atol=0)
    assert int(got) == int(want)
    assert wall.cpu().tolist() == [torch.tensor(5e-3).item(), 0.0]  # the flag only
    with pytest.raises(ValueError, match="two entries"):
        choose_budget_triton(scores.to(DEVICE), ctx.to(DEVICE), *_policy_args(policy), base,
                             base, 1, True, wall_seconds=base, sample_flag=True)


_COMPILE_SCRIPT = """
import json, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from vllm_ddtree.budget.choice_kernel import _choose_budget_kernel as fn

ptrs = {"ctx_ptr": "*i32", "budgets_ptr": "*i64", "chosen_ptr": "*i64", "idx_ptr": "*i32"}
result = []
for arch in (90, 120):
    for block_r, block_b in ((16, 64), (8, 512)):
        consts = dict(EXTRAPOLATE=True, BLOCK_R=block_r, BLOCK_B=block_b, BLOCK_K=16,
                      BLOCK_C=8, HAS_IDX=block_r == 8, SAMPLE_FLAG=block_r == 8)
        floats = ("num_layers", "ema_weight", "rate_tolerance")
        sig = {n: "constexpr" if n in consts else ptrs.get(n, "*fp32")
               if n.endswith("_ptr") else "fp32" if n in floats else "i32"
               for n in fn.arg_names}
        k = triton.compile(ASTSource(fn, sig, constexprs=consts),
                           target=GPUTarget("cuda", arch, 32), options={"num_warps": 4})
        result.append(k.metadata.shared)
print(json.dumps(result))
"""


def test_kernel_compiles_for_sm90_and_sm120():
    shared = compiled_shared_memory(_COMPILE_SCRIPT)
    assert len(shared) == 4 and max(shared) <= 99 * 1024, shared
