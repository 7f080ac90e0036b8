"""CPU tests of the pure-PyTorch parts of the V2-runner integration (speculator,
verifier, runtime state, runner patches). The runner itself needs a GPU:
tests/gpu/test_ddtree_vllm.py."""

from types import SimpleNamespace as NS

import numpy as np
import pytest
import torch

from vllm_ddtree.attention_backends.tree_mask_state import TREE_MASK_STATE
from vllm_ddtree.reference.sampling import keyed_uniform
from vllm_ddtree.runtime_state import (
    DDTreeRuntimeState,
    ddtree_lookahead_tokens,
    logit_row_positions,
    verify_inputs_,
)
from vllm_ddtree.tree.draft_tree import build_ddtree, unpack_ancestor_bits
from vllm_ddtree.verify.verifier import (
    DDTreeVerifier,
    UnsupportedForTreeError,
    committed_logit_rows,
    flatten_committed,
    num_sampled_and_rejected_torch,
)
from vllm_ddtree.walk.follow import follow_tree_reference

VOCAB, BUDGET, DEPTHS, MAX_REQS = 5, 24, 4, 6
NO_LOGPROBS = -1  # vllm.v1.worker.gpu.sample.states.NO_LOGPROBS


@pytest.fixture(autouse=True)
def _restore_tree_mask_state():
    saved = (TREE_MASK_STATE.ancestor_bits, TREE_MASK_STATE.active)
    yield
    TREE_MASK_STATE.ancestor_bits, TREE_MASK_STATE.active = saved


def new_state(max_tokens: int = 512) -> DDTreeRuntimeState:
    TREE_MASK_STATE.ancestor_bits = None
    state = DDTreeRuntimeState()
    state.allocate(MAX_REQS, max_tokens, BUDGET, DEPTHS, 1 + 2 * BUDGET, "cpu")
    return state


# -- a toy target: logits are a pure function of the token prefix --------------------


def target_logits(prefix: tuple[int, ...]) -> torch.Tensor:
    gen = torch.Generator().manual_seed(hash(prefix) % (2**31))
    return torch.randn(VOCAB, generator=gen) * 2


def draw(logits: torch.Tensor, temperature: float, seed: int, pos: int) -> int:
    """vLLM's rule on one row: argmax, or Gumbel-max keyed by (seed, pos) of the
    temperature-scaled logits (a CPU stand-in for gumbel_sample's keyed noise)."""
    if temperature == 0.0:
        return int(logits.argmax())
    u = keyed_uniform(seed, torch.tensor([pos]), VOCAB)[0]
    return int((logits.double() + (-torch.log(-torch.log(u)))).argmax())


class FakeSampler:
    """The parts of vLLM's V2 ``Sampler`` the verifier uses (temperature only)."""

    def __init__(self, temperature, seeds, prefill_len, use_penalty=None):
        self.compute_nans = False
        self.logprobs_mode = "raw_logprobs"
        self.use_fp64_gumbel = False
        self.temperature = torch.tensor(temperature, dtype=torch.float32)
        self.seeds = torch.tensor(seeds, dtype=torch.int64)
        self.req_states = NS(prefill_len=NS(gpu=torch.tensor(prefill_len, dtype=torch.int32)))
        self.sampling_states = NS(get_top_k_top_p=lambda *a: (None, None),
                                  max_num_logprobs=lambda idx: NO_LOGPROBS)
        n = len(temperature)
        self.penalties_state = NS(use_penalty=np.zeros(n, bool) if use_penalty is None
                                  else np.array(use_penalty))
        self.bad_words_state = NS(num_bad_words=NS(np=np.zeros(n, np.int32)))
        self.seen_positions = None

    def apply_sampling_params(self, logits, expanded_idx_mapping, idx_mapping_np, pos,
                              input_ids, expanded_local_pos, skip_top_k_top_p=False):
        self.seen_positions = pos.clone()
        temp = self.temperature[expanded_idx_mapping.long()][:, None]
        return torch.where(temp > 0, logits / temp.clamp(min=1e-6), logits)

    def draw_fn(self, logits, expanded_idx_mapping, pos):
        out = []
        for row, req in enumerate(expanded_idx_mapping.tolist()):
            out.append(draw(logits[row], float(self.temperature[req]), int(self.seeds[req]),
                            int(pos[row])))
        return torch.tensor(out, dtype=torch.int64)


def make_scenario(temperature: float):
    """A verify batch of 4 requests (batch order):

    0: full tree, request state 3;  1: tree truncated to 5 nodes, state 0;
    2: last prefill chunk (1 logit), state 5;  3: middle prefill chunk, state 1.
    """
    gen = torch.Generator().manual_seed(1)
    state = new_state()
    idx_mapping = torch.tensor([3, 0, 5, 1], dtype=torch.int32)
    trees = build_ddtree(torch.randn(2, DEPTHS, VOCAB, generator=gen), BUDGET)
    state.store_trees_(idx_mapping[:2], trees.parents, trees.depths, trees.ancestor_bits())
    contexts = [tuple(torch.randint(2, VOCAB, (n,), generator=gen).tolist()) for n in (9, 6)]
    num_drafts = [BUDGET, 5]
    prefill_qlens = [7, 12]  # requests 2, 3 (prefill_len 20 and 50, set below)

    rows, positions, input_ids, qlens = [], [], [], []
    for r in range(2):
        ctx, n = contexts[r], num_drafts[r]
        root_pos = len(ctx) - 1
        qlens.append(1 + n)
        for i in range(1 + n):
            path, node = [], i - 1
            while node >= 0:
                path.append(int(trees.tokens[r, node]))
                node = int(trees.parents[r, node])
            rows.append(target_logits(ctx + tuple(reversed(path))))
            positions.append(root_pos + i)  # linear positions, as vLLM keeps them
            input_ids.append(ctx[-1] if i == 0 else int(trees.tokens[r, i - 1]))
    for r, q in enumerate(prefill_qlens):
        start = 13 if r == 0 else 0
        qlens.append(q)
        positions.extend(range(start, start + q))
        input_ids.extend([2] * q)
        rows.append(torch.randn(VOCAB, generator=gen))  # its single logit row
    qsl = torch.tensor([0] + np.cumsum(qlens).tolist(), dtype=torch.int32)
    num_logits = [1 + n for n in num_drafts] + [1, 1]
    cu = torch.tensor([0] + np.cumsum(num_logits).tolist(), dtype=torch.int32)
    logits_indices = torch.cat([torch.arange(int(qsl[r + 1]) - k, int(qsl[r + 1]))
                                for r, k in enumerate(num_logits)])
    local = torch.cat([torch.arange(k) for k in num_logits]).to(torch.int32)
    expanded = torch.repeat_interleave(idx_mapping, torch.tensor(num_logits))
    seq_lens = torch.tensor([len(contexts[0]) + BUDGET, len(contexts[1]) + 5, 20, 12],
                            dtype=torch.int32)
    batch = NS(
        num_reqs=4, num_tokens=int(qsl[-1]), req_ids=[f"r{i}" for i in range(4)],
        idx_mapping=idx_mapping, idx_mapping_np=idx_mapping.numpy(),
        query_start_loc=qsl, cu_num_logits=cu, cu_num_logits_np=cu.numpy(),
        logits_indices=logits_indices, positions=torch.tensor(positions),
        input_ids=torch.tensor(input_ids), expanded_idx_mapping=expanded,
        expanded_local_pos=local, seq_lens=seq_lens, has_structured_output_reqs=False,
    )
    prefill_len = [0] * MAX_REQS
    prefill_len[3], prefill_len[0], prefill_len[5], prefill_len[1] = 1, 1, 20, 50
    temps = [temperature] * MAX_REQS
    sampler = FakeSampler(temps, [11, 22, 33, 44, 55, 66], prefill_len)
    return NS(state=state, trees=trees, batch=batch, logits=torch.stack(rows),
              contexts=contexts, num_drafts=num_drafts, sampler=sampler)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_verifier_commits_what_autoregressive_decoding_draws(temperature):
    sc = make_scenario(temperature)
    verifier = DDTreeVerifier(sc.sampler, NS(num_speculative_tokens=BUDGET), "cpu", DEPTHS,
                              state=sc.state, draw_fn=sc.sampler.draw_fn)
    out = verifier(sc.logits.clone(), sc.batch)
    assert out.sampled_token_ids.shape == (4, BUDGET + 1)
    depths = []
    for r in range(2):
        ctx, seed = list(sc.contexts[r]), int(sc.sampler.seeds[[3, 0][r]])
        num_sampled = int(out.num_sampled[r])
        ar = []
        for _ in range(num_sampled):  # AR: key = position of the last input token
            tok = draw(target_logits(tuple(ctx)) / (temperature or 1.0), temperature, seed,
                       len(ctx) - 1)
            ar.append(tok)
            ctx.append(tok)
        assert out.sampled_token_ids[r, :num_sampled].tolist() == ar
        assert (out.sampled_token_ids[r, num_sampled:] == -1).all()
        assert int(out.num_rejected[r]) == sc.num_drafts[r] - (num_sampled - 1)
        depths.append(num_sampled - 1)
    assert max(depths) >= 1, "scenario should accept part of a tree"
    # last prefill chunk samples its token; a middle chunk samples nothing
    assert out.num_sampled[2:].tolist() == [1, 0] and out.num_rejected[2:].tolist() == [0, 0]
    # Gumbel keys: tree rows at root + depth, other rows at their linear position
    want = logit_row_positions(sc.batch.positions[sc.batch.logits_indices],
                               sc.batch.expanded_local_pos, sc.batch.expanded_idx_mapping,
                               sc.state.depths)
    assert torch.equal(sc.sampler.seen_positions, want)
    root0 = len(sc.contexts[0]) - 1
    assert want[1 : 1 + BUDGET].tolist() == [root0 + int(d) for d in sc.trees.depths[0]]
    # the walk is recorded for the next propose, and only once
    walk = sc.state.take_walk(4)
    assert walk is not None and sc.state.take_walk(4) is None
    assert (walk[:, 0] >= 0).sum() == sum(d > 0 for d in depths)
    assert int(sc.state.num_drafts) == 2 and int(sc.state.accepted_sum) == sum(depths)


def test_verifier_walk_matches_reference_walk():
    sc = make_scenario(0.0)
    verifier = DDTreeVerifier(sc.sampler, NS(num_speculative_tokens=BUDGET), "cpu", DEPTHS,
                              state=sc.state, draw_fn=sc.sampler.draw_fn)
    drawn, _, _ = verifier.draw_target_tokens(sc.logits.clone(), sc.batch)
    walk = verifier.walk(drawn, sc.batch)
    for r in range(2):
        n = sc.num_drafts[r]
        start = int(sc.batch.cu_num_logits[r])
        tree = build_ddtree(torch.zeros(1, 1, 1), 1)  # placeholder, replaced below
        tree.tokens = sc.trees.tokens[r : r + 1, :n]
        tree.parents = sc.trees.parents[r : r + 1, :n]
        tree.depths = sc.trees.depths[r : r + 1, :n]
        tree.scores = sc.trees.scores[r : r + 1, :n]
        ref = follow_tree_reference(tree, drawn[start : start + 1 + n][None], DEPTHS)
        assert walk.accepted_depth[r] == ref.accepted_depth[0]
        assert torch.equal(walk.committed_tokens[r], ref.committed_tokens[0])
        assert torch.equal(walk.kv_src_rows[r], ref.kv_src_rows[0])


def test_verifier_rejects_chain_features_except_for_warmup():
    sc = make_scenario(0.0)
    sc.sampler.penalties_state.use_penalty[0] = True
    verifier = DDTreeVerifier(sc.sampler, NS(num_speculative_tokens=BUDGET), "cpu", DEPTHS,
                              state=sc.state, draw_fn=sc.sampler.draw_fn)
    with pytest.raises(UnsupportedForTreeError, match="penalties"):
        verifier(sc.logits.clone(), sc.batch)
    sc.batch.req_ids = [f"_warmup_{i}_" for i in range(4)]
    verifier(sc.logits.clone(), sc.batch)
    sc.batch.has_structured_output_reqs = True
    sc.batch.req_ids = ["a", "b", "c", "d"]
    sc.sampler.penalties_state.use_penalty[0] = False
    with pytest.raises(UnsupportedForTreeError, match="structured outputs"):
        verifier(sc.logits.clone(), sc.batch)
    with pytest.raises(UnsupportedForTreeError, match="greedily"):
        verifier(sc.logits.clone(), sc.batch, draft_logits=torch.zeros(1))


def test_verify_inputs_follow_request_state_trees():
    sc = make_scenario(0.0)
    b = sc.batch
    padded = b.num_tokens + 3
    linear = torch.cat([b.positions, torch.tensor([0, 0, 0])])
    pos = verify_inputs_(sc.state, linear, b.query_start_loc, b.cu_num_logits, b.idx_mapping,
                         b.num_tokens, padded)
    assert pos.shape == (padded,) and pos.data_ptr() == sc.state.positions.data_ptr()
    # The logit rows' Gumbel keys are their tokens' RoPE positions (full and truncated
    # trees, prefill chunks), so the verifier may gather them from this buffer.
    assert sc.state.positions_num_tokens == b.num_tokens
    want = logit_row_positions(b.positions[b.logits_indices], b.expanded_local_pos,
                               b.expanded_idx_mapping, sc.state.depths)
    assert torch.equal(pos[b.logits_indices], want)
    verifier = DDTreeVerifier(sc.sampler, NS(num_speculative_tokens=BUDGET), "cpu", DEPTHS,
                              state=sc.state, draw_fn=sc.sampler.draw_fn)
    sc.state.positions[padded:].fill_(-7)  # a gather outside the batch would show
    _, _, row_positions = verifier.draw_target_tokens(sc.logits.clone(), b)
    assert torch.equal(row_positions, want) and torch.equal(sc.sampler.seen_positions, want)
    bits = unpack_ancestor_bits(TREE_MASK_STATE.ancestor_bits[: b.num_tokens], 1 + 2 * BUDGET)
    masks = sc.trees.ancestor_mask()
    qsl = b.query_start_loc.tolist()
    for r in range(4):
        for i in range(qsl[r + 1] - qsl[r]):
            t = qsl[r] + i
            if r < 2:
                depth = 0 if i == 0 else int(sc.trees.depths[r, i - 1])
                assert int(pos[t]) == int(b.positions[qsl[r]]) + depth
                assert bits[t, : 1 + BUDGET].tolist() == masks[r, i].tolist()
            else:
                assert int(pos[t]) == int(b.positions[t])
                assert bits[t].tolist() == [j <= i for j in range(1 + 2 * BUDGET)]


def test_default_trees_are_chains_and_store_scatters_by_request_state():
    state = new_state()
    assert state.parents[2].tolist() == list(range(-1, BUDGET - 1))
    assert state.depths[2].tolist() == list(range(1, BUDGET + 1))
    chain = unpack_ancestor_bits(state.ancestor_bits[2], 1 + BUDGET)
    assert torch.equal(chain, torch.ones(1 + BUDGET, 1 + BUDGET, dtype=torch.bool).tril())
    trees = build_ddtree(torch.randn(2, DEPTHS, VOCAB), BUDGET)
    state.store_trees_(torch.tensor([4, 1], dtype=torch.int32), trees.parents, trees.depths,
                       trees.ancestor_bits())
    assert torch.equal(state.parents[4], trees.parents[0])
    assert torch.equal(state.depths[1], trees.depths[1])
    assert state.parents[0].tolist() == list(range(-1, BUDGET - 1))
    assert TREE_MASK_STATE.active and TREE_MASK_STATE.ancestor_bits.shape[1] == 1
    assert ddtree_lookahead_tokens(16) == 16


def test_logprob_layout_helpers_follow_the_path():
    kv_src_rows = torch.tensor([[3, 7, -1], [-1, -1, -1], [1, 2, 5]])
    cu = torch.tensor([0, 9, 11, 18], dtype=torch.int32)
    rows = committed_logit_rows(kv_src_rows, cu, 18)
    want = list(range(18))
    want[1], want[2] = 3, 7
    want[12], want[13], want[14] = 12, 13, 16
    assert rows.tolist() == want
    sampled = torch.tensor([[5, 6, 7, -1], [8, -1, -1, -1], [1, 2, 3, 4]])
    flat = flatten_committed(sampled, torch.tensor([3, 1, 4], dtype=torch.int32), cu, 18)
    want = [0] * 18
    want[0:3], want[9], want[11:15] = [5, 6, 7], 8, [1, 2, 3, 4]
    assert flat.tolist() == want


def test_num_sampled_and_rejected_matches_vllm_rule():
    num_sampled = torch.tensor([3, 1, 1, 1], dtype=torch.int32)
    seq_lens = torch.tensor([40, 12, 20, 9], dtype=torch.int32)
    cu = torch.tensor([0, 25, 31, 32, 33], dtype=torch.int32)
    idx = torch.tensor([2, 0, 3, 1], dtype=torch.int32)
    prefill_len = torch.tensor([5, 50, 1, 20], dtype=torch.int32)
    sampled, rejected = num_sampled_and_rejected_torch(num_sampled, seq_lens, cu, idx,
                                                       prefill_len)
    assert sampled.tolist() == [3, 1, 1, 0] and rejected.tolist() == [22, 5, 0, 0]


def fake_speculator(state):
    from vllm_ddtree.draft.speculator import DDTreeSpeculator

    spec = DDTreeSpeculator.__new__(DDTreeSpeculator)
    spec.state = state
    spec.budget, spec.top_k, spec.num_draft_depths = BUDGET, None, DEPTHS
    spec.max_num_reqs = MAX_REQS
    spec.draft_tokens = torch.zeros(MAX_REQS, BUDGET, dtype=torch.int64)
    spec.batch_parents = torch.zeros(MAX_REQS, BUDGET, dtype=torch.int64)
    spec.batch_depths = torch.ones(MAX_REQS, BUDGET, dtype=torch.int64)
    spec.batch_ancestor_bits = torch.zeros(MAX_REQS, 1 + BUDGET, 1, dtype=torch.int64)
    spec.batch_scores = torch.zeros(MAX_REQS, BUDGET)
    spec.sample_indices = torch.zeros(MAX_REQS * DEPTHS, dtype=torch.int64)
    return spec


def feed_drafter_step(spec, hidden, num_reqs, logit_scale=1.0):
    """Stand-ins for the drafter forward of ``spec._generate_draft``: ``_run_model``
    returns ``hidden`` (fp32 ``[R * (L + 1), V]``), logits are ``hidden * logit_scale``,
    and the sample rows are query offsets 1..L of each request (prepare_dflash_inputs'
    layout)."""
    block = DEPTHS + 1
    spec._run_model = lambda *args: hidden
    spec.model = NS(compute_logits=lambda h: h * logit_scale)
    spec.sample_indices[: num_reqs * DEPTHS] = torch.tensor(
        [r * block + k for r in range(num_reqs) for k in range(1, block)])


def test_generate_draft_builds_trees_from_drafter_logits():
    state = new_state()
    spec = fake_speculator(state)
    num_reqs, block = 2, DEPTHS + 1
    hidden = torch.randn(num_reqs * block, VOCAB)
    feed_drafter_step(spec, hidden, num_reqs, logit_scale=3)
    spec._generate_draft(num_reqs, num_reqs * block, None, None, None)
    want = build_ddtree((hidden * 3).view(num_reqs, block, VOCAB)[:, 1:], BUDGET)
    assert torch.equal(spec.draft_tokens[:num_reqs], want.tokens)
    assert torch.equal(spec.batch_parents[:num_reqs], want.parents)
    assert torch.equal(spec.batch_depths[:num_reqs], want.depths)
    assert torch.equal(spec.batch_ancestor_bits[:num_reqs], want.ancestor_bits())
    assert torch.equal(spec.batch_scores[:num_reqs], want.scores)


def test_generate_draft_stores_trees_in_the_step():
    """The in-graph tree store (CUDA): the draft step itself scatters the trees to the
    rows of DFlash's sample_idx_mapping (L entries per request; -1 = a CUDA-graph
    padding request, which writes nothing), as propose's eager store does for live
    rows; propose then stores nothing (Triton's interpreter on CPU)."""
    state = new_state()
    spec = fake_speculator(state)
    spec.store_trees_in_graph = True
    num_reqs, block = 3, DEPTHS + 1  # the third request pads a captured batch of 3
    hidden = torch.randn(num_reqs * block, VOCAB)
    feed_drafter_step(spec, hidden, num_reqs, logit_scale=3)
    spec.sample_idx_mapping = torch.tensor([4] * DEPTHS + [1] * DEPTHS + [-1] * DEPTHS
                                           + [0] * DEPTHS * (MAX_REQS - num_reqs),
                                           dtype=torch.int32)
    before = [state.parents.clone(), state.depths.clone(), state.ancestor_bits.clone()]
    spec._generate_draft(num_reqs, num_reqs * block, None, None, None)
    want = build_ddtree((hidden * 3).view(num_reqs, block, VOCAB)[:, 1:], BUDGET)
    for r, row in ((0, 4), (1, 1)):
        assert torch.equal(state.parents[row], want.parents[r])
        assert torch.equal(state.depths[row], want.depths[r])
        assert torch.equal(state.ancestor_bits[row], want.ancestor_bits()[r])
    untouched = [i for i in range(MAX_REQS) if i not in (1, 4)]
    for now, was in zip((state.parents, state.depths, state.ancestor_bits), before,
                        strict=True):
        assert torch.equal(now[untouched], was[untouched])
    # __init__'s compile-before-capture call: a -1 row writes nothing
    after = [state.parents.clone(), state.depths.clone(), state.ancestor_bits.clone()]
    spec._store_trees_in_step(1, torch.full((1,), -1, dtype=torch.int32))
    assert all(torch.equal(a, b) for a, b in zip(
        after, (state.parents, state.depths, state.ancestor_bits), strict=True))

    from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator

    stored = state.parents.clone()
    spec.batch_parents[:2] = 7  # what an eager store in propose would write
    batch = NS(num_reqs=2, query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32),
               idx_mapping=torch.tensor([4, 1], dtype=torch.int32))
    with pytest.MonkeyPatch.context() as m:
        m.setattr(DFlashSpeculator, "propose",
                  lambda self, input_batch, *a, **k: self.draft_tokens[:input_batch.num_reqs])
        ones = torch.ones(2, dtype=torch.int32)
        spec.propose(batch, None, {}, None, None, ones, ones, None, None, None, None)
    assert torch.equal(state.parents, stored)


def _auto_policy():
    from vllm_ddtree.budget.choice import BudgetCostTable
    from vllm_ddtree.budget.policy import BudgetPolicy, candidate_budgets

    budgets = torch.tensor(candidate_budgets(BUDGET))
    contexts = torch.tensor([1024.0, 16384.0, 131072.0])
    seconds = (2e-6 + contexts[:, None] * 1e-10 * budgets[None, :].float()).float()
    policy = BudgetPolicy(BudgetCostTable(contexts, budgets, seconds, True), num_layers=4,
                          ema_weight=0.3)
    policy.set_row_costs({int(b): 1e-4 + 3e-6 * int(b) for b in budgets})
    return policy


def test_auto_chooses_and_stores_inside_the_draft_step(monkeypatch):
    """``auto`` in the graph (CUDA, TP = 1): the draft step chooses the batch's budget from the
    live requests' trees and context lengths (a padding request, state row -1, does not
    count, however confident its tree), folds the host's pending wall sample, and
    stores each live tree with that budget; propose then only hands the choice to the
    verify-shape chooser. Reference: the PyTorch policy on the live requests alone."""
    state = new_state()
    state.enable_adaptive_(MAX_REQS, "cpu")
    spec = fake_speculator(state)
    spec.adaptive = spec.store_trees_in_graph = True
    policy, reference = _auto_policy(), _auto_policy()
    policy.in_graph = True  # enable_in_graph_ refuses CPU tensors
    spec.budget_policy = policy
    num_reqs, block = 3, DEPTHS + 1
    gen = torch.Generator().manual_seed(11)
    hidden = torch.randn(num_reqs * block, VOCAB, generator=gen)
    hidden[2 * block:] = 0.0
    hidden[2 * block:, 0] = 50.0  # the padding request: a certain chain
    feed_drafter_step(spec, hidden, num_reqs)
    spec.sample_idx_mapping = torch.tensor([4] * DEPTHS + [1] * DEPTHS + [-1] * DEPTHS
                                           + [0] * DEPTHS * (MAX_REQS - num_reqs),
                                           dtype=torch.int32)
    seq_lens = torch.tensor([900, 120_000, 5, 0, 0, 0], dtype=torch.int32)
    spec.target_input_buffers = NS(seq_lens=seq_lens)
    policy.observe_round(now=1.0)
    policy.observe_round(now=1.004)  # a 4 ms round, pending on the "device"
    reference.update_base_(torch.tensor([0.004]))
    active_before = state.active_nodes.clone()

    spec._generate_draft(num_reqs, num_reqs * block, None, None, None)

    want = reference.choose(spec.batch_scores[:2].clone(), seq_lens[:2])
    assert int(policy.chosen[0]) == int(want)
    torch.testing.assert_close(policy.base_seconds, reference.base_seconds, rtol=1e-6, atol=0)
    assert float(policy._wall_flagged[1]) == 0.0  # the sample was consumed
    assert int(state.active_nodes[4]) == int(state.active_nodes[1]) == int(want)
    untouched = [i for i in range(MAX_REQS) if i not in (1, 4)]
    assert torch.equal(state.active_nodes[untouched], active_before[untouched])
    # Counting the padding request would have chosen otherwise.
    counted = _auto_policy()
    counted.update_base_(torch.tensor([0.004]))
    assert int(counted.choose(spec.batch_scores[:3].clone(), seq_lens[:3])) != int(want)

    from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator

    recorded = []
    spec.verify_shape = NS(record_=lambda b: recorded.append(int(b.reshape(-1)[0])))
    stored = state.active_nodes.clone()
    batch = NS(num_reqs=2, query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32),
               idx_mapping=torch.tensor([4, 1], dtype=torch.int32),
               seq_lens=seq_lens[:2])
    monkeypatch.setattr(DFlashSpeculator, "propose",
                        lambda self, input_batch, *a, **k: self.draft_tokens[:2])
    ones = torch.ones(2, dtype=torch.int32)
    spec.propose(batch, None, {}, None, None, ones, ones, None, None, None, None)
    assert recorded == [int(want)] and torch.equal(state.active_nodes, stored)


@pytest.mark.parametrize("in_graph", [True, False])
def test_propose_of_a_held_gate_decision_skips_the_shape_copy_and_the_round_sample(
        monkeypatch, in_graph):
    """While auto's step gate holds its decision (``StepPlan.holding``), propose neither
    copies the device's budget choice to the verify-shape chooser nor samples the
    round's wall time (it restarts the round clock); at a propose where the gate
    decides, both happen, as before the gate held."""
    from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator

    state = new_state()
    state.enable_adaptive_(MAX_REQS, "cpu")
    spec = fake_speculator(state)
    spec.adaptive = spec.store_trees_in_graph = in_graph
    policy = _auto_policy()
    observed, recorded = [], []
    monkeypatch.setattr(policy, "observe_round",
                        lambda now, verified=True, sample=True: observed.append(sample))
    spec.budget_policy = policy
    spec.verify_shape = NS(record_=lambda b: recorded.append(int(b.reshape(-1)[0])))
    if not in_graph:
        monkeypatch.setattr(spec.state, "store_trees_", lambda *a, **k: None)
    finished = []  # every propose ends the gate's step after its last launch
    plan = NS(holding=True, gate=None, draft_next=lambda num_reqs, contexts: True,
              step_finished=lambda: finished.append(True))
    spec.step_plan = plan
    monkeypatch.setattr(DFlashSpeculator, "propose",
                        lambda self, input_batch, *a, **k: self.draft_tokens[:2])
    batch = NS(num_reqs=2, query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32),
               idx_mapping=torch.tensor([4, 1], dtype=torch.int32),
               seq_lens=torch.tensor([900, 1000], dtype=torch.int32))
    ones = torch.ones(2, dtype=torch.int32)
    for holding in (True, True, False, True):
        plan.holding = holding
        spec.propose(batch, None, {}, None, None, ones, ones, None, None, None, None)
    assert observed == [False, False, True, False]
    assert len(recorded) == 1 and len(finished) == 4


def test_the_in_graph_choice_refuses_cpu_tensors():
    with pytest.raises(NotImplementedError, match="CUDA"):
        _auto_policy().enable_in_graph_()


def test_propose_compacts_before_drafting_and_stores_trees(monkeypatch):
    from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator

    state = new_state()
    spec = fake_speculator(state)
    qlens = [1 + BUDGET, 1 + BUDGET]
    qsl = torch.tensor([0, qlens[0], sum(qlens)], dtype=torch.int32)
    total = sum(qlens)
    slots = torch.arange(100, 100 + total)
    cache = torch.zeros(200, 1, 2)
    cache[slots, 0] = torch.arange(total, dtype=torch.float32)[:, None]
    spec._target_layers_by_group = {0: ["target.0"]}
    spec.vllm_config = NS(compilation_config=NS(
        static_forward_context={"target.0": NS(kv_cache=cache)}))
    state.record_walk_(torch.tensor([[3, 8, -1, -1], [-1, -1, -1, -1]]))
    seen = {}

    def fake_propose(self, input_batch, attn_metadata, slot_mappings, last_hidden, aux,
                     *args, **kwargs):
        seen["aux"] = aux
        seen["kv_at_propose"] = cache[slots, 0, 0].clone()
        self.batch_parents[:2] = 5
        return self.draft_tokens[: input_batch.num_reqs]

    monkeypatch.setattr(DFlashSpeculator, "propose", fake_propose)
    aux = [torch.arange(total + 2, dtype=torch.float32)[:, None] * (k + 1) for k in range(3)]
    batch = NS(num_reqs=2, query_start_loc=qsl, idx_mapping=torch.tensor([4, 2],
                                                                          dtype=torch.int32))
    ones = torch.ones(2, dtype=torch.int32)
    spec.propose(batch, None, {"target.0": slots}, None, aux, ones, ones, None, None, None,
                 None)
    path = [0, 3, 8] + list(range(3, total + 2))
    assert seen["aux"][1][:, 0].tolist() == [2.0 * i for i in path]
    assert seen["kv_at_propose"].tolist()[:3] == [0.0, 3.0, 8.0]
    assert state.parents[4].tolist() == [5] * BUDGET and state.parents[2].tolist() == [5] * BUDGET
    # no walk recorded (e.g. an all-prefill step): nothing moves
    cache_before = cache.clone()
    spec.propose(batch, None, {"target.0": slots}, None, aux, ones, ones, None, None, None,
                 None)
    assert torch.equal(cache, cache_before) and seen["aux"] is aux


def test_propose_drafts_tree_decodes_from_one_block_of_context_rows(monkeypatch):
    """A batch of tree decodes: the drafter sees 1 + L context rows a request (the
    accepted path first), their linear positions, num_rejected = 1 + L - num_sampled
    and the same requests; the target KV compaction still reads the verify layout. A
    batch with a prefill chunk keeps every row (vllm_ddtree.draft.context_rows)."""
    from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator

    state = new_state()
    spec = fake_speculator(state)
    rows = DEPTHS + 1
    spec.context_query_start_loc = rows * torch.arange(MAX_REQS + 1, dtype=torch.int32)
    spec.context_positions_compact = torch.zeros(MAX_REQS * rows, dtype=torch.int64)
    spec.context_num_rejected = torch.zeros(MAX_REQS, dtype=torch.int32)
    q = 1 + BUDGET
    qsl = torch.tensor([0, q, 2 * q], dtype=torch.int32)
    slots = torch.arange(100, 100 + 2 * q)
    cache = torch.zeros(200, 1, 2)
    cache[slots, 0] = torch.arange(2 * q, dtype=torch.float32)[:, None]
    spec._target_layers_by_group = {0: ["target.0"]}
    spec.vllm_config = NS(compilation_config=NS(
        static_forward_context={"target.0": NS(kv_cache=cache)}))
    seen = {}

    def fake_propose(self, input_batch, attn_metadata, slot_mappings, last_hidden, aux,
                     num_sampled, num_rejected, *args, **kwargs):
        seen.update(batch=input_batch, aux=[h.clone() for h in aux],
                    rejected=num_rejected.clone(), kv=cache[slots, 0, 0].clone())
        return self.draft_tokens[: input_batch.num_reqs]

    monkeypatch.setattr(DFlashSpeculator, "propose", fake_propose)

    def run(prefilling):
        state.record_walk_(torch.tensor([[3, 8, -1, -1], [2, 5, 11, 20]]))
        aux = [torch.arange(2 * q + 3, dtype=torch.float32)[:, None] * (k + 1)
               for k in range(3)]
        batch = NS(num_reqs=2, query_start_loc=qsl, idx_mapping=torch.tensor(
            [4, 2], dtype=torch.int32), num_tokens=2 * q, num_tokens_after_padding=2 * q,
            num_scheduled_tokens=np.array([q, q], dtype=np.int32),
            num_draft_tokens_per_req=np.array([BUDGET, BUDGET], dtype=np.int32),
            is_prefilling_np=np.array(prefilling), query_start_loc_np=qsl.numpy(),
            positions=torch.cat([500 + torch.arange(q), 900 + torch.arange(q)]))
        num_sampled = torch.tensor([3, 5], dtype=torch.int32)
        num_rejected = q - num_sampled
        spec.propose(batch, None, {"target.0": slots}, None, aux, num_sampled, num_rejected,
                     None, None, None, None)
        return batch

    batch = run([False, False])
    proxy = seen["batch"]
    assert proxy is not batch and proxy.num_tokens == 2 * rows
    assert proxy.query_start_loc.tolist() == [0, rows, 2 * rows]
    assert proxy.positions.tolist() == [500, 501, 502, 503, 504, 900, 901, 902, 903, 904]
    assert seen["rejected"].tolist() == [rows - 3, rows - 5]
    assert [h.shape[0] for h in seen["aux"]] == [2 * rows] * 3
    # request 0: root, nodes 3 and 8, then its rows 3, 4; request 1: root row q and
    # its path nodes 2, 5, 11, 20
    want = [0, 3, 8, 3, 4, q, q + 2, q + 5, q + 11, q + 20]
    assert seen["aux"][1][:, 0].tolist() == [2.0 * i for i in want]
    assert seen["kv"].tolist()[:3] == [0.0, 3.0, 8.0]  # verify layout, as before
    assert seen["kv"].tolist()[q:q + 5] == [q, q + 2, q + 5, q + 11, q + 20]
    assert batch.num_tokens == 2 * q  # the runner's batch is left as it was

    run([False, True])  # a prefill chunk: every verify row stays context
    assert seen["batch"].num_tokens == 2 * q and [h.shape[0] for h in seen["aux"]] == [
        2 * q + 3] * 3
    assert seen["rejected"].tolist() == [q - 3, q - 5]


def test_fused_prepare_replaces_dflashs_per_group_loop(monkeypatch):
    """A CUDA round: propose prepares every drafter KV-cache group in one call
    (draft.inputs_kernel) with the groups' rows, block tables and block sizes, and
    DFlash's per-group loop sees no group; the group ids come back afterwards, also
    when drafting raises. A refused launch (False) and rounds without CUDA tensors
    leave DFlash's loop in charge."""
    from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator

    import vllm_ddtree.draft.speculator as speculator_module

    spec = fake_speculator(new_state())
    spec.draft_kv_cache_group_ids = [1, 3]
    tables = {1: torch.zeros(2, 4, dtype=torch.int32), 3: torch.ones(2, 8, dtype=torch.int32)}
    spec.block_tables = NS(slot_mappings=torch.zeros(4, 16, dtype=torch.int64),
                           input_block_tables=tables, kernel_block_sizes={1: 16, 3: 64})
    for name in ("input_buffers", "context_positions", "_context_slot_mappings",
                 "sample_pos", "sample_idx_mapping"):
        setattr(spec, name, object())
    spec.parallel_drafting_token_id, spec.num_query_per_req = 9, DEPTHS + 1
    spec.num_speculative_steps, spec.max_num_tokens, spec.max_model_len = DEPTHS, 64, 512
    spec.sample_from_anchor = False
    calls, seen = [], {}
    accept = [True]

    def fake_groups(*args):
        calls.append(args)
        return accept[0]

    def fake_propose(self, input_batch, *args, **kwargs):
        seen["ids"] = list(self.draft_kv_cache_group_ids)
        if kwargs.get("is_profile"):
            raise RuntimeError("drafting failed")
        return self.draft_tokens[: input_batch.num_reqs]

    monkeypatch.setattr(speculator_module, "prepare_dflash_inputs_groups", fake_groups)
    monkeypatch.setattr(DFlashSpeculator, "propose", fake_propose)
    batch = NS(num_reqs=1, idx_mapping=torch.tensor([0], dtype=torch.int32))
    ones = torch.ones(1, dtype=torch.int32)

    def propose(**kwargs):
        spec.propose(batch, None, {}, None, None, ones, ones, None, None, None, None, **kwargs)

    propose()  # CPU tensors: DFlash's per-group loop
    assert not calls and seen["ids"] == [1, 3]
    assert not spec._prepare_inputs_in_one_launch(batch, None, None, None, None)  # a fake
    # The test stands in for a CUDA round.
    monkeypatch.setattr(speculator_module, "use_triton", lambda t: True)
    propose()
    assert len(calls) == 1 and seen["ids"] == [] and spec.draft_kv_cache_group_ids == [1, 3]
    args = calls[0]
    assert args[2] == [1, 3] and args[8] is batch
    assert [t is tables[g] for t, g in zip(args[13], [1, 3], strict=True)] == [True, True]
    assert args[14] == [16, 64]
    with pytest.raises(RuntimeError, match="drafting failed"):
        propose(is_profile=True)
    assert spec.draft_kv_cache_group_ids == [1, 3]
    accept[0] = False  # the kernel refused: DFlash's own loop prepares the groups
    propose()
    assert seen["ids"] == [1, 3]
    propose(dummy_run=True)  # dummy runs keep DFlash's path
    assert len(calls) == 3


def test_tree_caches_warm_before_graph_capture():
    """After warm_tree_caches, building trees of any batch size needs no new host-made
    index table (a host-to-device copy would break CUDA-graph capture)."""
    from vllm_ddtree.draft.speculator import warm_tree_caches
    from vllm_ddtree.tree import draft_tree as tree_mod

    tree_mod._beam_candidates.cache_clear()
    tree_mod._bit_values.cache_clear()
    warm_tree_caches(DEPTHS, VOCAB, BUDGET, None, torch.device("cpu"))
    beams, bits = tree_mod._beam_candidates.cache_info(), tree_mod._bit_values.cache_info()
    assert beams.currsize > 0 and bits.currsize == 1
    for num_reqs in (1, 3, 8):
        logits = torch.randn(num_reqs, DEPTHS, VOCAB)
        build_ddtree(logits, BUDGET).ancestor_bits()
    assert tree_mod._beam_candidates.cache_info().misses == beams.misses
    assert tree_mod._bit_values.cache_info().misses == bits.misses


def test_a_second_engine_in_the_process_starts_from_clean_tree_state():
    """Engines built one after another in one process (``LLM`` twice,
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) share the module-level state: a fixed-budget
    engine after an ``auto`` one must not keep its adaptive buffers (sized for the first
    engine's batch), and a tree backend without DDTree must not apply the first
    engine's tree mask."""
    saved = (TREE_MASK_STATE.active, TREE_MASK_STATE.adaptive, TREE_MASK_STATE.mostly_active)
    try:
        state = DDTreeRuntimeState()
        state.allocate(4, 64, 8, 3, 9, "cpu")
        state.enable_adaptive_(4, "cpu")
        TREE_MASK_STATE.mostly_active = True
        state.allocate(16, 256, 8, 3, 9, "cpu")  # the next engine: fixed budget, 16 seqs
        assert not state.adaptive and state.active_nodes is None
        assert state.active_nodes_sum is None
        assert not TREE_MASK_STATE.adaptive and not TREE_MASK_STATE.mostly_active
        assert TREE_MASK_STATE.decode_active_query_lens(16) is None  # every row computed
        assert TREE_MASK_STATE.active
        TREE_MASK_STATE.clear_unless_ddtree(NS(speculative_config=NS(ddtree={"budget": 8})))
        assert TREE_MASK_STATE.active  # a DDTree engine's builder keeps the tree state
        TREE_MASK_STATE.clear_unless_ddtree(NS(speculative_config=None))
        assert not TREE_MASK_STATE.active  # its target alone: causal bits again
    finally:
        (TREE_MASK_STATE.active, TREE_MASK_STATE.adaptive,
         TREE_MASK_STATE.mostly_active) = saved
