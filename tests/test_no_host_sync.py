"""No host synchronisation inside a DDTree round (CPU stand-in for the GPU path).

A round on the GPU is: ``verify_inputs_`` (tree positions and per-token ancestor
bits, before the target's forward), ``DDTreeVerifier.__call__`` (draw the target's
tokens, walk the trees, sampled rows, stats, logprobs), then
``DDTreeSpeculator.propose`` (KV compaction of the accepted paths, hidden-row
gather, the drafter step ``_generate_draft`` with ``build_ddtree`` and the ancestor
bits, the scatter of the trees to request-state rows). The tests run those
functions on CPU tensors of realistic shapes under
``vllm_ddtree.testing.sync_guard.HostSyncDetector``, which treats every tensor the
round touches as a device tensor, and require zero flagged ops. vLLM's own pieces
(``DFlashSpeculator.propose``'s input preparation and the drafter forward, the
Triton sampling kernels) are replaced by sync-free fakes; the GPU run of
``evals/count_host_syncs.py`` covers them.

Also here: unit tests of the detector itself and of the reference / test-only paths
it must flag. The trace counting of ``evals/count_host_syncs.py`` is tested in
``evals/tests/test_count_host_syncs.py``.
"""

import contextlib
import inspect
from types import SimpleNamespace as NS

import numpy as np
import pytest
import torch
from test_ddtree_integration_units import FakeSampler  # noqa: E402

from vllm_ddtree.attention_backends.tree_mask_state import TREE_MASK_STATE, causal_bits_
from vllm_ddtree.compact.reference import compact_kv_cache_, compaction_slots
from vllm_ddtree.runtime_state import (
    DDTreeRuntimeState,
    hidden_row_gather_index,
    logit_row_positions,
    verify_inputs_,
)
from vllm_ddtree.testing.sync_guard import (
    HostSyncDetector,
    HostSyncError,
    assert_no_host_sync,
)
from vllm_ddtree.tree import draft_tree as tree_mod
from vllm_ddtree.tree.draft_tree import (
    DraftTree,
    build_ddtree,
    build_ddtree_reference,
    num_mask_words,
)
from vllm_ddtree.verify.batch import sampled_rows_from_walk, tree_verify_positions_and_bits
from vllm_ddtree.verify.verifier import (
    DDTreeVerifier,
    committed_logit_rows,
    flatten_committed,
    num_sampled_and_rejected_torch,
    tree_inputs_from_rows,
)
from vllm_ddtree.walk.follow import follow_tree, follow_tree_reference

THIS_FILE = "tests/test_no_host_sync.py"


# ----------------------------------------------------------------------------------
# The detector
# ----------------------------------------------------------------------------------


def detect(fn, **kwargs) -> HostSyncDetector:
    with HostSyncDetector(**kwargs) as detector:
        fn()
    return detector


def _bool_mask_setitem(t, m):
    t[m] = 0


SYNCING = {  # name: (fn(t, m), kind); t int64 [10], m bool [10], made before the region
    "item": (lambda t, m: t[0].item(), "sync"),
    "int": (lambda t, m: int(t.max()), "sync"),
    "float": (lambda t, m: float(t.sum()), "sync"),
    "if_any": (lambda t, m: 1 if (t > 3).any() else 0, "sync"),
    "zero_dim_tensor_index": (lambda t, m: t[t.argmax()], "sync"),
    "nonzero": (lambda t, m: torch.nonzero(t), "sync"),
    "where_one_arg": (lambda t, m: torch.where(m), "sync"),
    "bool_mask_index": (lambda t, m: t[m], "sync"),
    "bool_mask_setitem": (_bool_mask_setitem, "sync"),
    "masked_select": (lambda t, m: torch.masked_select(t, m), "sync"),
    "unique": (lambda t, m: torch.unique(t), "sync"),
    "unique_consecutive": (lambda t, m: torch.unique_consecutive(t), "sync"),
    "repeat_interleave": (lambda t, m: torch.repeat_interleave(t[:3], t[:3]), "sync"),
    "equal": (lambda t, m: torch.equal(t, t), "sync"),
    "tolist": (lambda t, m: t.tolist(), "d2h"),
    "numpy": (lambda t, m: t.numpy(), "d2h"),
    "np_asarray": (lambda t, m: np.asarray(t), "d2h"),
    "cpu": (lambda t, m: t.cpu(), "d2h"),
    "to_cpu": (lambda t, m: t.to("cpu"), "d2h"),
    "tensor_from_list": (lambda t, m: torch.tensor([1, 2, 3]), "h2d"),
    "python_list_index": (lambda t, m: t[[1, 2]], "h2d"),
}

CLEAN = {
    "arithmetic": lambda t, m: (t * 2 + 1) // 3 - (t & 1),
    "compare_and_reduce": lambda t, m: ((t > 3) & m).any(),
    "topk": lambda t, m: torch.topk(t, 3),
    "sort_cumsum": lambda t, m: torch.sort(t).values.cumsum(0),
    "gather": lambda t, m: torch.gather(t, 0, t[:4].flip(0)),
    "scatter": lambda t, m: t.clone().scatter_(0, t[:3], t[3:6]),
    "searchsorted": lambda t, m: torch.searchsorted(t, t[:4] + 1, right=True),
    "where_three_args": lambda t, m: torch.where(m, t, -1),
    "masked_fill": lambda t, m: t.masked_fill(m, 0),
    "argmax_as_1d_index": lambda t, m: t[t.argmax().view(1)],
    "long_index_and_setitem": lambda t, m: t.clone().__setitem__(t[:2], 0),
    "repeat_interleave_output_size": lambda t, m: torch.repeat_interleave(
        t[:3], t[:3], output_size=3),
    "dtype_cast": lambda t, m: t.to(torch.int32).float(),
    "factories": lambda t, m: torch.arange(4) + torch.full((4,), 2),
    "shapes": lambda t, m: t.new_zeros(t.shape[0], len(t)),
    "numpy_tolist": lambda t, m: np.arange(5).tolist(),
}


@pytest.fixture
def t_and_m():
    t = torch.arange(10)
    return t, t % 3 == 0


GRAD_MODES = {"grad": contextlib.nullcontext, "no_grad": torch.no_grad,
              # Autograd off: composite ops (item, where(cond), ...) reach the detector
              # undecomposed. DDTreeSpeculator.propose runs in inference mode.
              "inference_mode": torch.inference_mode}


@pytest.mark.parametrize("grad_mode", list(GRAD_MODES))
@pytest.mark.parametrize("name", list(SYNCING))
def test_detector_flags(name, grad_mode, t_and_m):
    fn, kind = SYNCING[name]

    def body():
        with GRAD_MODES[grad_mode]():
            fn(*t_and_m)

    detector = detect(body)
    assert detector.count() == 1, detector.report()
    event = detector.syncs[0]
    assert event.kind == kind
    assert event.site.startswith(f"{THIS_FILE}:"), event.site
    assert event.op in detector.report()


@pytest.mark.parametrize("grad_mode", list(GRAD_MODES))
@pytest.mark.parametrize("name", list(CLEAN))
def test_detector_does_not_flag(name, grad_mode, t_and_m):
    def body():
        with GRAD_MODES[grad_mode]():
            CLEAN[name](*t_and_m)

    detector = detect(body)
    assert detector.count() == 0, detector.report()


def test_host_tensors_and_their_results_are_not_device_tensors():
    """vLLM keeps some tensors on the host (``query_start_loc_cpu``, pinned staging
    buffers): reading them, or tensors computed only from them, is no sync."""
    qsl_cpu, device = torch.tensor([0, 4, 9]), torch.arange(9)

    def body():
        int((qsl_cpu[1:] - qsl_cpu[:-1]).max())
        qsl_cpu.tolist()
        int(device.max())

    detector = detect(body, host_tensors=[qsl_cpu])
    assert [e.op for e in detector.syncs] == ["aten._local_scalar_dense.default"]
    assert detector.syncs[0].site.endswith("in body")


def test_copies_between_host_and_device_buffers():
    """Blocking copies are syncs; ``non_blocking`` ones (vLLM's pinned-buffer
    copies) are recorded as ``async_copy`` and not counted."""
    pinned, gpu = torch.zeros(6), torch.arange(6.0)

    def body():
        pinned.copy_(gpu)  # d2h
        pinned.copy_(gpu, non_blocking=True)
        gpu.copy_(pinned)  # h2d: ends with a stream synchronize
        gpu.copy_(pinned, non_blocking=True)
        gpu.copy_(gpu * 2)  # device to device

    detector = detect(body, host_tensors=[pinned])
    assert [e.kind for e in detector.events] == ["d2h", "async_copy", "h2d", "async_copy"]
    assert detector.count() == 2


def test_explicit_synchronize_is_flagged():
    def body():
        with contextlib.suppress(Exception):  # no CUDA here: the call itself may fail
            torch.cuda.synchronize()

    assert detect(body).count("explicit") == 1


def test_cpu_as_device_false_only_flags_real_device_tensors(t_and_m):
    t, m = t_and_m
    assert detect(lambda: (t.tolist(), int(t.max()), t[m]), cpu_as_device=False).count() == 0


def test_assert_no_host_sync_raises_with_the_report_and_restores_tensor_methods(t_and_m):
    t, _ = t_and_m
    with pytest.raises(HostSyncError, match=r"aten\._local_scalar_dense.*test_no_host_sync"):
        with assert_no_host_sync():
            t.max().item()
    with assert_no_host_sync() as detector:
        t + 1
    assert detector.events == []
    for name in ("tolist", "numpy", "cpu", "to"):
        assert name not in vars(torch.Tensor)
    assert torch.cuda.synchronize.__name__ == "synchronize"
    assert t.tolist() == list(range(10))


def test_numpy_reads_are_host_work_but_tensor_reads_are_not():
    """The verifier passes ``input_batch.cu_num_logits_np.tolist()`` (a NumPy array
    the runner keeps on the host) to vLLM's logprobs code: no sync. The same read of
    the device tensor ``cu_num_logits`` would be one."""
    cu = torch.tensor([0, 3, 4], dtype=torch.int32)
    cu_np = cu.numpy().copy()
    assert detect(lambda: cu_np.tolist()).count() == 0
    assert detect(lambda: cu.tolist()).count("d2h") == 1


# ----------------------------------------------------------------------------------
# A realistic DDTree round on CPU tensors
# ----------------------------------------------------------------------------------

VOCAB, DEPTHS, MAX_REQS = 48, 7, 8  # drafter block 8: depths 1..7
BLOCK = DEPTHS + 1
NO_LOGPROBS = -1  # vllm.v1.worker.gpu.sample.states.NO_LOGPROBS
PAD_TOKENS = 3  # CUDA-graph padding of the verify batch


@pytest.fixture(autouse=True)
def _restore_tree_mask_state():
    saved = (TREE_MASK_STATE.ancestor_bits, TREE_MASK_STATE.active)
    yield
    TREE_MASK_STATE.ancestor_bits, TREE_MASK_STATE.active = saved


class SyncFreeSampler(FakeSampler):
    """``FakeSampler`` (test_ddtree_integration_units.py) with the parts that read
    values on the host rewritten with device ops only, and logprobs configurable."""

    def __init__(self, temperature, seeds, prefill_len, num_logprobs):
        super().__init__(temperature, seeds, prefill_len)
        self.sampling_states = NS(get_top_k_top_p=lambda *a: (None, None),
                                  max_num_logprobs=lambda idx: num_logprobs)

    def apply_sampling_params(self, logits, expanded_idx_mapping, idx_mapping_np, pos,
                              input_ids, expanded_local_pos, skip_top_k_top_p=False):
        temp = self.temperature[expanded_idx_mapping.long()][:, None]
        return torch.where(temp > 0, logits / temp.clamp(min=1e-6), logits)

    def draw(self, logits, expanded_idx_mapping, pos):
        """Gumbel-max keyed by (seed, position), argmax for greedy rows (a stand-in
        for ``gumbel_sample``)."""
        idx = expanded_idx_mapping.long()
        key = (self.seeds[idx][:, None] * 1_000_003 + pos.long()[:, None] * 7919
               + torch.arange(logits.shape[1]))
        u = (((key * 2654435761) % (2**31)) + 1).double() / (2**31 + 2)
        noisy = logits.double() - torch.log(-torch.log(u))
        return torch.where(self.temperature[idx][:, None] > 0, noisy, logits.double()).argmax(-1)


def fake_topk_scores(logits, num_logprobs, sampled_token_ids, cu_num_logits=None, **kwargs):
    """Torch stand-in for vLLM's ``compute_topk_scores`` (a Triton rank kernel)."""
    assert cu_num_logits is None or isinstance(cu_num_logits, list)
    ids = torch.cat([sampled_token_ids.long()[:, None],
                     torch.topk(logits, num_logprobs, dim=-1).indices], dim=1)
    scores = torch.log_softmax(logits.float(), dim=-1).gather(1, ids)
    return NS(logprob_token_ids=ids, logprobs=scores, cu_num_generated_tokens=cu_num_logits)


# Batch order: (kind, request-state row, drafts n or prefill query length, computed).
REQUESTS = [
    ("tree", 5, "full", 120),
    ("tree", 0, "half", 37),
    ("decode", 3, 0, 64),  # no drafts this step (e.g. near max_model_len)
    ("tree", 7, "full", 900),
    ("prefill_mid", 1, 9, 16),  # chunked prefill, not the last chunk: samples nothing
    ("prefill_last", 2, 5, 40),
]


def make_scenario(budget: int, top_k: int | None, num_logprobs: int, monkeypatch):
    """State, speculator, verifier and a verify batch of ``REQUESTS`` (host-side setup,
    outside any detector). ``sc.step_inputs()`` refreshes the batch's draft tokens and
    target logits from the trees the previous ``propose`` stored."""
    from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator

    from vllm_ddtree.draft import speculator as speculator_mod

    gen = torch.Generator().manual_seed(budget * 31 + (top_k or 0))
    TREE_MASK_STATE.ancestor_bits = None
    state = DDTreeRuntimeState()
    state.allocate(MAX_REQS, 1024, budget, DEPTHS, 1 + 2 * budget, "cpu")
    # What DDTreeSpeculator.__init__ does before any CUDA-graph capture.
    speculator_mod.warm_tree_caches(DEPTHS, VOCAB, budget, top_k, torch.device("cpu"))

    kinds = [k for k, _, _, _ in REQUESTS]
    idx_list = [s for _, s, _, _ in REQUESTS]
    num_reqs = len(REQUESTS)
    drafts = [budget if n == "full" else budget // 2 if n == "half" else 0
              for k, _, n, _ in REQUESTS]
    qlens = [1 + d if k in ("tree", "decode") else n
             for (k, _, n, _), d in zip(REQUESTS, drafts, strict=True)]
    num_logits = [1 + d if k in ("tree", "decode") else 1
                  for k, d in zip(kinds, drafts, strict=True)]
    computed = [c for _, _, _, c in REQUESTS]
    qsl = np.concatenate([[0], np.cumsum(qlens)])
    cu = np.concatenate([[0], np.cumsum(num_logits)])
    num_tokens = int(qsl[-1])
    padded = num_tokens + PAD_TOKENS
    positions = torch.zeros(padded, dtype=torch.int64)
    for r in range(num_reqs):
        positions[qsl[r]:qsl[r + 1]] = torch.arange(computed[r], computed[r] + qlens[r])
    logits_indices = torch.cat([torch.arange(qsl[r + 1] - num_logits[r], qsl[r + 1])
                                for r in range(num_reqs)])
    idx_mapping = torch.tensor(idx_list, dtype=torch.int32)
    prefill_len = [1] * MAX_REQS
    prefill_len[1], prefill_len[2] = 200, computed[5] + qlens[5]
    seq_lens = torch.tensor([c + q for c, q in zip(computed, qlens, strict=True)],
                            dtype=torch.int32)
    batch = NS(
        num_reqs=num_reqs, num_tokens=num_tokens, num_tokens_after_padding=padded,
        req_ids=[f"req-{i}" for i in range(num_reqs)],
        idx_mapping=idx_mapping, idx_mapping_np=idx_mapping.numpy().copy(),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        cu_num_logits=torch.tensor(cu, dtype=torch.int32),
        cu_num_logits_np=cu.astype(np.int32),
        logits_indices=logits_indices, positions=positions,
        input_ids=torch.randint(2, VOCAB, (padded,), generator=gen),
        expanded_idx_mapping=torch.repeat_interleave(idx_mapping, torch.tensor(num_logits)),
        expanded_local_pos=torch.cat([torch.arange(n) for n in num_logits]).to(torch.int32),
        seq_lens=seq_lens, has_structured_output_reqs=False,
    )
    temperature = [0.0, 0.8, 0.0, 0.7, 0.0, 0.0, 0.0, 1.0]  # by request-state row
    sampler = SyncFreeSampler(temperature, [11 * (i + 1) for i in range(MAX_REQS)],
                              prefill_len, num_logprobs)
    verifier = DDTreeVerifier(sampler, NS(num_speculative_tokens=budget), "cpu", DEPTHS,
                              state=state, draw_fn=sampler.draw)
    monkeypatch.setattr("vllm.v1.worker.gpu.sample.logprob.compute_topk_scores",
                        fake_topk_scores)

    # The speculator, without vLLM's DFlash internals (see fake_dflash_propose).
    spec = speculator_mod.DDTreeSpeculator.__new__(speculator_mod.DDTreeSpeculator)
    spec.state = state
    spec.budget, spec.top_k, spec.num_draft_depths = budget, top_k, DEPTHS
    spec.max_num_reqs = MAX_REQS
    spec.draft_tokens = torch.zeros(MAX_REQS, budget, dtype=torch.int64)
    spec.batch_parents = torch.zeros(MAX_REQS, budget, dtype=torch.int64)
    spec.batch_depths = torch.ones(MAX_REQS, budget, dtype=torch.int64)
    spec.batch_ancestor_bits = torch.zeros(MAX_REQS, 1 + budget, num_mask_words(1 + budget),
                                           dtype=torch.int64)
    spec.batch_scores = torch.zeros(MAX_REQS, budget)
    spec.sample_indices = torch.tensor(
        [r * BLOCK + k for r in range(MAX_REQS) for k in range(1, BLOCK)])
    spec.model = NS(compute_logits=lambda h: h * 3)
    hidden = {"value": None}
    spec._run_model = lambda *args: hidden["value"]

    def fake_dflash_propose(self, input_batch, *args, **kwargs):
        # DFlash's propose: prepare_dflash_inputs (Triton), then the draft step.
        n = input_batch.num_reqs
        self._generate_draft(n, n * BLOCK, None, None, None)
        return self.draft_tokens[:n]

    monkeypatch.setattr(DFlashSpeculator, "propose", fake_dflash_propose)

    # Target KV caches: two FlashAttention-layout layers in group 0, one MLA layer in
    # group 1 (slot rows 1000.. and 200.. of the verify batch; padding slots -1).
    pad = torch.full((PAD_TOKENS,), -1, dtype=torch.int64)
    slots = {0: torch.cat([1000 + torch.arange(num_tokens), pad]),
             1: torch.cat([200 + torch.arange(num_tokens), pad])}
    caches = {"t.0": torch.randn(2, 160, 16, 2, 8, generator=gen),
              "t.1": torch.randn(2, 160, 16, 2, 8, generator=gen),
              "t.2": torch.randn(80, 16, 12, generator=gen)}
    spec._target_layers_by_group = {0: ["t.0", "t.1"], 1: ["t.2"]}
    spec.vllm_config = NS(compilation_config=NS(static_forward_context={
        name: NS(kv_cache=cache) for name, cache in caches.items()}))
    slot_mappings = {"t.0": slots[0], "t.1": slots[0], "t.2": slots[1]}
    aux = [torch.randn(padded, 16, generator=gen) for _ in range(3)]

    # Trees of the previous round, in request-state rows.
    tokens_by_state = torch.zeros(MAX_REQS, budget, dtype=torch.int64)
    first = build_ddtree(torch.randn(num_reqs, DEPTHS, VOCAB, generator=gen), budget, top_k)
    state.store_trees_(idx_mapping, first.parents, first.depths, first.ancestor_bits())
    tokens_by_state[idx_mapping.long()] = first.tokens

    sc = NS(budget=budget, top_k=top_k, state=state, batch=batch, sampler=sampler,
            verifier=verifier, spec=spec, slot_mappings=slot_mappings, aux=aux,
            caches=caches, hidden=hidden, tokens_by_state=tokens_by_state, kinds=kinds,
            drafts=drafts, qsl=qsl, cu=cu, gen=gen, logits=None)

    def step_inputs():
        """Host-side: the batch's draft tokens are the stored trees' tokens; the
        target prefers each node's first child, so the walk accepts a path."""
        idx = idx_mapping.long()
        parents = state.parents[idx]
        tokens = tokens_by_state[idx]
        rows = []
        for r, kind in enumerate(kinds):
            n = drafts[r]
            start = qsl[r]
            if kind in ("tree", "decode"):
                batch.input_ids[start + 1:start + 1 + n] = tokens[r, :n]
            for i in range(cu[r + 1] - cu[r]):
                want = int(torch.randint(2, VOCAB, (1,), generator=gen))
                if kind == "tree":
                    children = (parents[r, :n] == i - 1).nonzero().flatten()
                    if len(children):
                        want = int(tokens[r, int(children[0])])
                row = torch.randn(VOCAB, generator=gen) * 0.1
                row[want] += 8.0
                rows.append(row)
        sc.logits = torch.stack(rows)
        hidden["value"] = torch.randn(num_reqs * BLOCK, VOCAB, generator=gen)

    sc.step_inputs = step_inputs
    step_inputs()
    return sc


def run_round(sc):
    """One round as the runner calls it (``patches/tree_positions.py`` before the
    target's forward, the verifier, then the speculator)."""
    b = sc.batch
    positions = verify_inputs_(sc.state, b.positions, b.query_start_loc, b.cu_num_logits,
                               b.idx_mapping, b.num_tokens, b.num_tokens_after_padding)
    out = sc.verifier(sc.logits, b)
    draft = sc.spec.propose(b, None, sc.slot_mappings, None, sc.aux, out.num_sampled,
                            out.num_rejected, None, None, None, None)
    return positions, out, draft


def check_round_outputs(sc, out, draft) -> None:
    """Outside the detector: the round did real work (paths accepted, trees built)."""
    b, budget = sc.batch, sc.budget
    accepted = []
    for r, kind in enumerate(sc.kinds):
        n = sc.drafts[r]
        if kind != "tree":
            continue
        rows = slice(int(sc.cu[r]), int(sc.cu[r]) + 1 + n)
        tree = DraftTree(tokens=b.input_ids[b.logits_indices[rows]][None, 1:],
                         parents=sc.state_parents_before[r: r + 1, :n],
                         depths=sc.state_depths_before[r: r + 1, :n],
                         scores=torch.zeros(1, n))
        drawn = sc.sampler.draw(sc.sampler.apply_sampling_params(
            sc.logits[rows], b.expanded_idx_mapping[rows], None, sc.row_positions[rows],
            None, None), b.expanded_idx_mapping[rows], sc.row_positions[rows])
        ref = follow_tree_reference(tree, drawn[None], DEPTHS)
        a = int(ref.accepted_depth[0])
        accepted.append(a)
        assert int(out.num_sampled[r]) == a + 1
        assert torch.equal(out.sampled_token_ids[r, : a + 1], ref.committed_tokens[0, : a + 1])
    assert max(accepted) >= 1
    assert int(out.num_sampled[sc.kinds.index("prefill_mid")]) == 0
    assert int(out.num_sampled[sc.kinds.index("prefill_last")]) == 1
    if out.logprobs_tensors is not None:  # laid out per logit row, cu from the host array
        assert out.logprobs_tensors.logprobs.shape[0] == int(sc.cu[-1])
        assert out.logprobs_tensors.cu_num_generated_tokens == sc.cu.tolist()
    logits = (sc.hidden["value"] * 3).view(b.num_reqs, BLOCK, VOCAB)[:, 1:]
    want = build_ddtree(logits, budget, sc.top_k)
    assert torch.equal(draft, want.tokens)
    assert torch.equal(sc.state.parents[b.idx_mapping.long()], want.parents)


def snapshot_before_round(sc) -> None:
    b = sc.batch
    idx = b.idx_mapping.long()
    sc.state_parents_before = sc.state.parents[idx].clone()
    sc.state_depths_before = sc.state.depths[idx].clone()
    sc.row_positions = logit_row_positions(b.positions[b.logits_indices], b.expanded_local_pos,
                                           b.expanded_idx_mapping, sc.state.depths)


ROUND_CONFIGS = [(8, None, NO_LOGPROBS), (32, 4, 2), (32, None, 0)]


@pytest.mark.parametrize("budget,top_k,num_logprobs", ROUND_CONFIGS)
def test_rounds_have_no_host_sync(budget, top_k, num_logprobs, monkeypatch):
    """Three consecutive rounds, a fresh detector each: zero host syncs per step."""
    sc = make_scenario(budget, top_k, num_logprobs, monkeypatch)
    counts, reports = [], []
    for _ in range(3):
        sc.step_inputs()
        snapshot_before_round(sc)
        with HostSyncDetector() as detector:
            _, out, draft = run_round(sc)
        counts.append(detector.count())
        reports.append(detector.report())
        check_round_outputs(sc, out, draft)
        sc.tokens_by_state[sc.batch.idx_mapping.long()] = draft
    assert counts == [0, 0, 0], "\n".join(reports)


def round_components(sc) -> dict:
    """Every device-side function of a round, as zero-argument calls on the state a
    first (undetected) round left behind."""
    b, state, spec, budget = sc.batch, sc.state, sc.spec, sc.budget
    from vllm_ddtree.draft.speculator import kv_page_views, path_compaction_slots

    idx = b.idx_mapping.long()
    drawn, _, _ = sc.verifier.draw_target_tokens(sc.logits, b)
    walk = sc.verifier.walk(drawn, b)
    tree = build_ddtree(torch.randn(b.num_reqs, DEPTHS, VOCAB, generator=sc.gen), budget,
                        sc.top_k)
    src, dst = path_compaction_slots(sc.slot_mappings["t.0"], b.query_start_loc,
                                     walk.kv_src_rows)
    rows = kv_page_views(sc.caches["t.0"])[0]
    targets = torch.randint(0, VOCAB, (b.num_reqs, 1 + budget), generator=sc.gen)
    is_tree = torch.tensor([k == "tree" for k in sc.kinds])
    drafter_logits = torch.randn(b.num_reqs, DEPTHS, VOCAB, generator=sc.gen)
    sampled, num_sampled, _ = sampled_rows_from_walk(walk.committed_tokens,
                                                     walk.accepted_depth, budget)
    num_logits = int(sc.cu[-1])

    def generate_draft():
        spec._generate_draft(b.num_reqs, b.num_reqs * BLOCK, None, None, None)

    def propose():
        state.record_walk_(walk.kv_src_rows)
        spec.propose(b, None, sc.slot_mappings, None, sc.aux, num_sampled, num_sampled,
                     None, None, None, None)

    return {
        "tree.build_ddtree": lambda: build_ddtree(drafter_logits, budget, sc.top_k),
        "tree.DraftTree.ancestor_bits": tree.ancestor_bits,
        "tree.DraftTree.positions_offsets": tree.positions_offsets,
        "tree.follow_tree(max_depth=L)": lambda: follow_tree(tree, targets, max_depth=DEPTHS),
        "verifier.DDTreeVerifier.walk": lambda: sc.verifier.walk(drawn, b),
        "verify_batch.tree_verify_positions_and_bits": lambda: tree_verify_positions_and_bits(
            b.positions[: b.num_tokens], b.query_start_loc, is_tree, state.depths[idx],
            state.ancestor_bits[idx], TREE_MASK_STATE.ancestor_bits.shape[1]),
        "verify_batch.sampled_rows_from_walk": lambda: sampled_rows_from_walk(
            walk.committed_tokens, walk.accepted_depth, budget),
        "compact.reference.compaction_slots": lambda: compaction_slots(
            sc.slot_mappings["t.0"], b.query_start_loc, walk.kv_src_rows),
        "speculator.path_compaction_slots": lambda: path_compaction_slots(
            sc.slot_mappings["t.0"], b.query_start_loc, walk.kv_src_rows),
        "compact.reference.compact_kv_cache_": lambda: compact_kv_cache_(rows, src, dst),
        "runtime_state.verify_inputs_": lambda: verify_inputs_(
            state, b.positions, b.query_start_loc, b.cu_num_logits, b.idx_mapping,
            b.num_tokens, b.num_tokens_after_padding),
        "runtime_state.logit_row_positions": lambda: logit_row_positions(
            b.positions[b.logits_indices], b.expanded_local_pos, b.expanded_idx_mapping,
            state.depths),
        "runtime_state.hidden_row_gather_index": lambda: hidden_row_gather_index(
            b.query_start_loc, walk.kv_src_rows, b.num_tokens_after_padding),
        "runtime_state.store_trees_": lambda: state.store_trees_(
            b.idx_mapping, tree.parents, tree.depths, tree.ancestor_bits()),
        "runtime_state.record_walk_+take_walk": lambda: (
            state.record_walk_(walk.kv_src_rows), state.take_walk(b.num_reqs)),
        "tree_mask_state.causal_bits_": lambda: causal_bits_(
            torch.empty(b.num_tokens, 2, dtype=torch.int64), b.query_start_loc, b.num_tokens),
        "verifier.tree_inputs_from_rows": lambda: tree_inputs_from_rows(
            b.input_ids[b.logits_indices], drawn, b.cu_num_logits, budget),
        "verifier.committed_logit_rows": lambda: committed_logit_rows(
            walk.kv_src_rows, b.cu_num_logits, num_logits),
        "verifier.flatten_committed": lambda: flatten_committed(
            sampled, num_sampled, b.cu_num_logits, num_logits),
        "verifier.num_sampled_and_rejected_torch": lambda: num_sampled_and_rejected_torch(
            num_sampled, b.seq_lens, b.cu_num_logits, b.idx_mapping,
            sc.sampler.req_states.prefill_len.gpu),
        "verifier.DDTreeVerifier.draw_target_tokens": lambda: sc.verifier.draw_target_tokens(
            sc.logits, b),
        "verifier.DDTreeVerifier.__call__": lambda: sc.verifier(sc.logits, b),
        "speculator.DDTreeSpeculator._generate_draft": generate_draft,
        "speculator.DDTreeSpeculator.propose": propose,
    }


COMPONENT_NAMES = [
    "tree.build_ddtree", "tree.DraftTree.ancestor_bits", "tree.DraftTree.positions_offsets",
    "tree.follow_tree(max_depth=L)", "verify_batch.tree_verify_positions_and_bits",
    "verify_batch.sampled_rows_from_walk", "compact.reference.compaction_slots",
    "speculator.path_compaction_slots", "compact.reference.compact_kv_cache_",
    "runtime_state.verify_inputs_", "runtime_state.logit_row_positions",
    "runtime_state.hidden_row_gather_index", "runtime_state.store_trees_",
    "runtime_state.record_walk_+take_walk", "tree_mask_state.causal_bits_",
    "verifier.tree_inputs_from_rows", "verifier.committed_logit_rows",
    "verifier.flatten_committed", "verifier.num_sampled_and_rejected_torch",
    "verifier.DDTreeVerifier.draw_target_tokens", "verifier.DDTreeVerifier.walk",
    "verifier.DDTreeVerifier.__call__",
    "speculator.DDTreeSpeculator._generate_draft", "speculator.DDTreeSpeculator.propose",
]


@pytest.mark.parametrize("name", COMPONENT_NAMES)
def test_round_component_has_no_host_sync(name, monkeypatch):
    sc = make_scenario(16, None, 3, monkeypatch)
    snapshot_before_round(sc)
    run_round(sc)  # leaves a walk, trees, stats: the state of a running engine
    sc.step_inputs()
    components = round_components(sc)
    assert set(components) == set(COMPONENT_NAMES)
    with assert_no_host_sync():
        components[name]()


# ----------------------------------------------------------------------------------
# Off the round path: the detector sees their syncs
# ----------------------------------------------------------------------------------


def _line_of(fn, text: str) -> int:
    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, line in enumerate(lines) if text in line)


def test_follow_tree_without_max_depth_syncs_once():
    """``follow_tree``'s default ``max_depth`` reads the trees' depth on the host; the
    verifier always passes ``max_depth = L``, so the round never takes that branch."""
    tree = build_ddtree(torch.randn(3, DEPTHS, VOCAB), 16)
    targets = torch.randint(0, VOCAB, (3, 17))
    detector = detect(lambda: follow_tree(tree, targets))
    line = _line_of(follow_tree, "int(tree.depths.max().item())")
    assert [(e.op, e.site) for e in detector.syncs] == [
        ("aten._local_scalar_dense.default", f"vllm_ddtree/walk/follow.py:{line} in follow_tree")]
    assert detect(lambda: follow_tree(tree, targets, max_depth=DEPTHS)).count() == 0


def test_reference_helpers_sync_and_are_not_on_the_round_path():
    logits = torch.randn(2, 4, 10)
    assert detect(lambda: build_ddtree_reference(logits, 8)).count("d2h") > 0
    tree = build_ddtree(logits, 8)
    assert detect(lambda: follow_tree_reference(tree, torch.zeros(2, 9, dtype=torch.long))
                  ).count() > 0
    state = DDTreeRuntimeState()
    TREE_MASK_STATE.ancestor_bits = None
    state.allocate(2, 16, 4, 3, 9, "cpu")
    assert detect(state.mean_acceptance_length).count("sync") == 2  # tests / benchmarks


def test_cold_tree_caches_copy_host_tables_once():
    """``build_ddtree`` and ``ancestor_bits`` build small index tables on the host and
    cache them per device: the first call copies them to the device (a blocking
    copy), which is why ``DDTreeSpeculator.__init__`` calls ``warm_tree_caches``
    before CUDA-graph capture. Warm, the same call is sync-free."""
    from vllm_ddtree.draft.speculator import warm_tree_caches

    logits = torch.randn(3, DEPTHS, VOCAB)
    tree_mod._beam_candidates.cache_clear()
    tree_mod._bit_values.cache_clear()
    cold = detect(lambda: build_ddtree(logits, 24).ancestor_bits())
    assert cold.count("h2d") > 0 and cold.count() == cold.count("h2d")
    sites = {e.site.split(":")[0] for e in cold.syncs}
    assert sites == {"vllm_ddtree/tree/draft_tree.py"}, cold.report()
    tree_mod._beam_candidates.cache_clear()
    tree_mod._bit_values.cache_clear()
    warm_tree_caches(DEPTHS, VOCAB, 24, None, torch.device("cpu"))
    assert detect(lambda: build_ddtree(logits, 24).ancestor_bits()).count() == 0
