"""vLLM 0.26 V2 runner with ``method: ddtree`` on the embedded pair (GPU).

Greedy DDTree tokens must equal vLLM's plain AR tokens (a mismatch is allowed only
where AR's top-2 logprob gap shows a bf16 tie; nothing after it is compared, as in
test_mla_backend_vllm.py), and trees must be accepted beyond the root (mean
acceptance length > 1). Runs vLLM in subprocesses (evals/check_*_vllm.py) that exit
without the interpreter's shutdown.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vllm_ddtree.budget.policy import candidate_budgets
from vllm_ddtree.demo.reference_engine import CHECKPOINTS
from vllm_ddtree.testing.compare import (
    TIE_GAP,
    eager_graphable_steps,
    first_mismatch,
    mismatch_problems,
    non_full_verify_steps,
)

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(not (CHECKPOINTS / "target" / "config.json").exists(),
                       reason="embedded pair not trained yet"),
]
ROOT = Path(__file__).resolve().parents[2]


# vLLM's start-up memory profiling fails when another engine on the same GPU allocates or
# frees meanwhile (gpu_worker.py:529-545), as when suites run side by side on one GPU.
SHARED_GPU_RACE = ("Error in memory profiling", "on startup is less than desired GPU memory",
                   "No available memory for the cache blocks")


def run_script(script: str, args: list[str], out: Path, attempts: int = 3) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'evals'}:{ROOT}:" +
           os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, str(ROOT / "evals" / script), *args, "--out", str(out)]
    for attempt in range(1, attempts + 1):
        proc = subprocess.run(cmd, timeout=900, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
        print(proc.stdout[-20000:])
        if proc.returncode == 0:
            return json.loads(out.read_text())
        if attempt == attempts or not any(s in proc.stdout for s in SHARED_GPU_RACE):
            raise subprocess.CalledProcessError(proc.returncode, cmd)
        print(f"{script}: GPU shared with another engine at start-up; retrying")


def unexplained_mismatches(got: dict, ref: dict, witnesses: tuple[dict, ...] = ()) -> list[str]:
    """``mismatch_problems`` of two runs' outputs; ``witnesses``: runs of the reference
    itself at another batch shape (``vllm_ddtree.testing.compare``), fp8 caches in bf16."""
    for run in (got, *witnesses):
        for a, b in zip(run["outputs"], ref["outputs"], strict=True):
            assert a["prompt"] == b["prompt"]
    return mismatch_problems(got["outputs"], ref["outputs"],
                             witnesses=[w["outputs"] for w in witnesses])


def first_mismatches(got: dict, ref: dict) -> list[int | None]:
    """First differing token index per request (a length difference counts), None if equal."""
    for a, b in zip(got["outputs"], ref["outputs"], strict=True):
        assert a["prompt"] == b["prompt"]
    return [first_mismatch(a["tokens"], b["tokens"])
            for a, b in zip(got["outputs"], ref["outputs"], strict=True)]


def unexplained_sampled_mismatches(got: dict, ref: dict,
                                   witnesses: tuple[dict, ...] = ()) -> list[str]:
    """Seeded sampled outputs: a first mismatch must be a tie of vLLM's Gumbel-perturbed
    scores (``sampled_ties``) within the fixed bf16 tie gap (``compare.TIE_GAP``), or
    within the spread of a witness (AR at another batch shape) against ``ref``."""
    from vllm_ddtree.testing.sampled_ties import sampled_mismatch_problems

    return sampled_mismatch_problems(got["outputs"], ref["outputs"], TIE_GAP,
                                     [w["outputs"] for w in witnesses])


def split_by_temperature(result: dict) -> tuple[dict, dict]:
    greedy = [o for o in result["outputs"] if o["temperature"] == 0.0]
    sampled = [o for o in result["outputs"] if o["temperature"] > 0.0]
    return {**result, "outputs": greedy}, {**result, "outputs": sampled}


# The embedded pair's KV-cache groups: one with disable_hybrid_kv_cache_manager (DDTree's
# default here: 1.07x the hybrid manager's KV bytes per context token), else one per
# layer (4 MLA target layers, 2 sliding and 1 full drafter layer).
KV_CACHE_GROUPS = {"one": 1, "hybrid": 7}


@pytest.fixture(scope="module")
def ar_mixed(tmp_path_factory):
    """AR on the same V2 runner and attention backend (CUSTOM): 12 requests of 16..3000
    prompt tokens, 8 running at a time (later ones arrive while others decode),
    8 greedy and 4 seeded-sampled."""
    return run_script("check_ddtree_vllm.py", ["--mixed", "--method", "ar"],
                      tmp_path_factory.mktemp("ar") / "ar.json")


@pytest.fixture(scope="module", params=[32, 8])
def ddtree_mixed(request, tmp_path_factory):
    """B=32 > L=15: trees wider than the drafter block; B=8 < L: the lookahead patch
    and trees shallower than the block."""
    budget = request.param
    return run_script("check_ddtree_vllm.py", ["--mixed", "--budget", str(budget)],
                      tmp_path_factory.mktemp(f"ddtree{budget}") / "ddtree.json")


def test_ddtree_greedy_equals_ar_and_accepts(ar_mixed, ddtree_mixed):
    assert "tree_positions" in ddtree_mixed["patches"]
    # DDTree's default on this pair (no --kv-cache-groups): one KV-cache group
    assert ddtree_mixed["kv_cache_groups"] == KV_CACHE_GROUPS["one"]
    assert len(ddtree_mixed["outputs"]) == len(ar_mixed["outputs"])
    for out in ddtree_mixed["outputs"]:  # output lengths are compared by mismatch_problems
        assert out["logprobs_len"] == len(out["tokens"])
    got, _ = split_by_temperature(ddtree_mixed)
    ref, _ = split_by_temperature(ar_mixed)
    problems = unexplained_mismatches(got, ref)
    mal = ddtree_mixed["ddtree_mean_acceptance_length"]
    vllm_mal = ddtree_mixed["vllm_metrics"].get("mean_acceptance_length")
    print(f"B={ddtree_mixed['budget']}: greedy first mismatch per request "
          f"{first_mismatches(got, ref)}; mean acceptance length {mal:.3f} (DDTree counters), "
          f"{vllm_mal} (vLLM metrics)")
    assert not problems, "\n".join(problems)
    assert mal > 1.0
    if vllm_mal is not None:
        # The same rounds counted twice; they may differ only where a request ends
        # (max_tokens) inside an accepted path, if vLLM counts before truncating.
        assert vllm_mal == pytest.approx(mal, rel=0.02)


def test_ddtree_acceptance_matches_reference_engine(ddtree_mixed):
    """Same greedy requests, same B, same text: the reference engine (fp32) is replayed
    along vLLM's own output tokens (bf16 ties make free-running texts part after ~25
    tokens), and vLLM's committed tokens per round must be within 3 % of the replay's.
    A gap means a wiring bug (target-layer offset, LM head, window, RoPE)."""
    from transformers import AutoModelForCausalLM

    from vllm_ddtree.reference import clip_rounds, compare_rounds, replay
    from vllm_ddtree.training.common import load_drafter

    target = AutoModelForCausalLM.from_pretrained(CHECKPOINTS / "target",
                                                  dtype=torch.float32).cuda().eval()
    drafter = load_drafter(CHECKPOINTS / "drafter", device="cuda")
    budget = ddtree_mixed["budget"]
    greedy, _ = split_by_temperature(ddtree_mixed)
    vllm_rounds, ref_rounds, same_rounds, firsts, uncovered = [], [], 0, [], []
    for i, out in enumerate(greedy["outputs"]):
        # vLLM counts a round before the output is cut (max_tokens, EOS, stop strings):
        # keep the rounds that cover the returned tokens, the last one clipped, as
        # replay counts them. Outputs of 0 or 1 tokens have no round.
        got = clip_rounds(out["committed_per_round"], len(out["tokens"]))
        if sum(got) != max(0, len(out["tokens"]) - 1):
            uncovered.append(i)  # vLLM rounds missing: the per-round alignment is off
        want = replay(target, drafter, out["prompt"], out["tokens"], "ddtree", budget=budget)
        same, first = compare_rounds(got, want)
        vllm_rounds += got
        ref_rounds += want
        same_rounds += same
        firsts.append(first)
    assert vllm_rounds and ref_rounds
    got_mean = sum(vllm_rounds) / len(vllm_rounds)
    want_mean = sum(ref_rounds) / len(ref_rounds)
    print(f"B={budget}: committed per round on vLLM's tokens: vLLM {got_mean:.3f} "
          f"({len(vllm_rounds)} rounds), reference replay {want_mean:.3f} "
          f"({len(ref_rounds)} rounds); identical rounds {same_rounds}/{len(vllm_rounds)} "
          f"= {same_rounds / len(vllm_rounds):.1%}; first differing round per request "
          f"{firsts}; requests whose vLLM rounds do not cover their tokens {uncovered}")
    assert got_mean == pytest.approx(want_mean, rel=0.03)


def test_ddtree_sampling_draws_what_ar_draws(ar_mixed, ddtree_mixed):
    """Same request seeds: DDTree's target draws are keyed by (seed, position) exactly
    as plain decoding keys them, so the sampled tokens must agree up to a tie of the
    perturbed scores (a bug in the keys or the distribution flips far more)."""
    _, got = split_by_temperature(ddtree_mixed)
    _, ref = split_by_temperature(ar_mixed)
    firsts = first_mismatches(got, ref)
    print(f"B={ddtree_mixed['budget']}: sampled first mismatch per request {firsts}")
    problems = unexplained_sampled_mismatches(got, ref)
    assert not problems, "\n".join(problems)
    # Ties are rare on the trained pair: most sampled requests must match in full.
    assert sum(f is None for f in firsts) >= len(firsts) - 1


# 1 + s rows per request for the verify shapes of B = 32, and 1 for auto's plain steps
ADAPTIVE_QUERY_LENS = tuple(1 + s for s in [0, *candidate_budgets(32)])


def run_mixed_vs_ar(ar_mixed: dict, args: list[str], out, label: str,
                    verify_query_lens: tuple[int, ...] = (33,),
                    ar_witness: dict | None = None) -> dict:
    """Run ``check_ddtree_vllm.py args`` and assert its greedy and seeded sampled
    tokens equal ``ar_mixed`` up to measured ties (and, greedy, where ``ar_witness``,
    AR at another batch shape, parts from ``ar_mixed`` too), and (with ``--graphs``)
    that every uniform verify step of ``verify_query_lens`` rows per request replayed a
    FULL graph; returns the run's JSON."""
    got = run_script("check_ddtree_vllm.py", args, out)
    greedy, sampled = split_by_temperature(got)
    ref_greedy, ref_sampled = split_by_temperature(ar_mixed)
    ours = got["ddtree_mean_acceptance_length"]  # None where workers are other processes
    print(f"{label}: greedy first mismatch {first_mismatches(greedy, ref_greedy)}, sampled "
          f"{first_mismatches(sampled, ref_sampled)}, mean acceptance length "
          f"{'n/a' if ours is None else f'{ours:.3f}'} (DDTree counters), "
          f"{got['vllm_metrics'].get('mean_acceptance_length')} (vLLM metrics)")
    witnesses = (split_by_temperature(ar_witness)[0],) if ar_witness else ()
    problems = unexplained_mismatches(greedy, ref_greedy, witnesses)
    problems += unexplained_sampled_mismatches(
        sampled, ref_sampled, (split_by_temperature(ar_witness)[1],) if ar_witness else ())
    assert not problems, "\n".join(problems)
    if got.get("verify_dispatches") is not None:  # --graphs at TP = 1
        missed = non_full_verify_steps(got["verify_dispatches"], verify_query_lens)
        print(f"{label}: {len(got['verify_dispatches'])} target dispatches, "
              f"{len(missed)} uniform verify steps without a FULL graph")
        assert not missed, f"verify steps that missed their FULL graph: {missed[:5]}"
        eager = eager_graphable_steps(got["verify_dispatches"], got.get("graph_config"))
        print(f"{label}: graphs {got.get('graph_config')}, {len(eager)} steps eager where a "
              f"graph holds them")
        assert not eager, f"steps that ran eagerly where a CUDA graph holds them: {eager[:5]}"
    return got


@pytest.mark.parametrize(("graphs", "shape"), [(False, "adaptive"), (True, "adaptive"),
                                               (True, "fixed")],
                         ids=["eager", "graphs", "graphs-fixed-shape"])
def test_ddtree_auto_budget_equals_ar(ar_mixed, graphs, shape, tmp_path):
    """``ddtree_budget: "auto"`` (B = 32 at most): each round verifies only the first
    b nodes (kernels skip the rest, the verifier ignores them); with adaptive verify
    shapes the runner also verifies only ``1 + s`` rows (drafts cut to a prefix, FULL
    graphs per shape). Tokens still equal AR up to measured ties, and the chosen
    budgets stay within 1..32."""
    args = ["--mixed", "--budget", "32", "--auto", "--verify-shape", shape]
    args += ["--graphs"] if graphs else []
    lens = ADAPTIVE_QUERY_LENS if shape == "adaptive" else (33,)
    got = run_mixed_vs_ar(ar_mixed, args, tmp_path / "auto.json",
                          f"auto ({'graphs' if graphs else 'eager'}, {shape} shape)", lens)
    nodes = got["mean_active_nodes"]
    print(f"mean active nodes {nodes:.2f}")
    assert 1.0 <= nodes <= 32.0
    assert got["ddtree_mean_acceptance_length"] > 1.0


def test_ddtree_auto_cycled_verify_shapes_equal_ar(ar_mixed, tmp_path):
    """Adaptive verify shapes below B and plain steps: the budget choice is forced
    through 1, 4, 0, 3, 16, 2, 0, 32, 8 in turn (``--cycle-budgets``), so steps verify
    1 .. 33 rows per request in FULL graphs of each shape, trees are cut to the (lagged)
    shape, the active budget differs from the shape (3 in a 4-node shape; 32 in a
    smaller one), and b = 0 makes plain decoding steps (the propose before them runs no
    drafter pass) while the batch grows and drains. Tokens must still equal AR up to
    measured ties. (On this pair the policy itself picks b = 32 every round, which
    never cuts a tree.)"""
    args = ["--mixed", "--budget", "32", "--auto", "--verify-shape", "adaptive",
            "--graphs", "--cycle-budgets", "1,4,0,3,16,2,0,32,8", "--record-steps"]
    got = run_mixed_vs_ar(ar_mixed, args, tmp_path / "cycled.json", "auto, cycled shapes",
                          ADAPTIVE_QUERY_LENS)
    nodes = got["mean_active_nodes"]
    print(f"mean active nodes {nodes:.2f}")
    assert nodes < 16  # the trees' mean is 9.4 (the last round of a request may cut it)
    # Several verify shapes ran, each in its own FULL graph (run_mixed_vs_ar checks FULL),
    # one of them the plain steps' single row.
    shapes = {d["uniform_token_count"] for d in got["verify_dispatches"]
              if d["mode"] == "FULL"}
    assert len(shapes) >= 4 and 1 in shapes, f"verify shapes seen: {sorted(shapes)}"
    steps = got["step_plan"]["steps"]
    assert all(s["shape"] == 0 for s in steps if not s["drafted_before"])
    plain = [s for s in steps if s["uniform"] and s["shape"] == 0]
    print(f"{len(plain)} plain steps at batch sizes {sorted({s['num_reqs'] for s in plain})}")
    assert len(plain) >= 10 and len({s["num_reqs"] for s in plain}) >= 3
    assert got["ddtree_mean_acceptance_length"] > 1.0


@pytest.mark.parametrize("kv_groups", ["one", "hybrid"])
@pytest.mark.parametrize("budget", [32])
def test_ddtree_with_cuda_graphs_equals_ar(ar_mixed, budget, kv_groups, tmp_path):
    """The same mixed batch with CUDA graphs (drafter FULL graph, target verify steps in
    FULL graphs of uniform ``1 + B`` rows through the CUSTOM tree backend), in one
    KV-cache group (target and drafter layers together, the drafter's sliding layers on
    the target's 64-token blocks: ``patches/unify_kv_block_size.py``; vLLM 0.26 alone
    refuses to start) and in vLLM's hybrid manager (a group per layer, the drafter's
    16-token sliding blocks stretched to the MLA page): greedy and seeded sampled
    tokens equal AR up to measured ties, and acceptance stays that of trees (a graph
    replaying stale tree buffers would accept almost nothing)."""
    got = run_mixed_vs_ar(ar_mixed, ["--mixed", "--budget", str(budget), "--graphs",
                                     "--kv-cache-groups", kv_groups],
                          tmp_path / f"g-{kv_groups}.json",
                          f"graphs B={budget}, KV-cache groups: {kv_groups}")
    assert got["disable_hybrid_kv_cache_manager"] is (kv_groups == "one")
    assert got["kv_cache_groups"] == KV_CACHE_GROUPS[kv_groups]
    mal = got["ddtree_mean_acceptance_length"]
    # Eager B=32 on this batch commits 1.93 tokens per round.
    assert mal > 1.5


def _to_cuda(ns):
    from types import SimpleNamespace

    return SimpleNamespace(**{k: v.cuda() if isinstance(v, torch.Tensor) else v
                              for k, v in vars(ns).items()})


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_verifier_with_vllm_kernels(temperature):
    """DDTreeVerifier on CUDA with vLLM's own gumbel_sample and
    get_num_sampled_and_rejected (the CPU test injects stand-ins for both)."""
    from types import SimpleNamespace as NS

    from test_ddtree_integration_units import BUDGET, DEPTHS, make_scenario
    from vllm.v1.worker.gpu.sample.gumbel import gumbel_sample

    from vllm_ddtree.runtime_state import DDTreeRuntimeState
    from vllm_ddtree.verify.verifier import DDTreeVerifier

    sc = make_scenario(temperature)
    state = DDTreeRuntimeState()
    state.allocate(6, 512, BUDGET, DEPTHS, 1 + 2 * BUDGET, "cuda")
    for name in ("parents", "depths", "ancestor_bits"):
        getattr(state, name).copy_(getattr(sc.state, name))
    fake = sc.sampler
    sampler = NS(
        compute_nans=False, logprobs_mode="raw_logprobs", use_fp64_gumbel=False,
        req_states=NS(prefill_len=NS(gpu=fake.req_states.prefill_len.gpu.cuda())),
        sampling_states=NS(temperature=NS(gpu=fake.temperature.cuda()),
                           seeds=NS(gpu=fake.seeds.cuda()),
                           get_top_k_top_p=lambda *a: (None, None),
                           max_num_logprobs=lambda idx: -1),
        penalties_state=fake.penalties_state, bad_words_state=fake.bad_words_state,
        apply_sampling_params=lambda logits, eim, *a, **k: fake.apply_sampling_params(
            logits.cpu(), eim.cpu(), *[x.cpu() if isinstance(x, torch.Tensor) else x
                                       for x in a], **k).cuda(),
    )
    batch = _to_cuda(sc.batch)
    verifier = DDTreeVerifier(sampler, NS(num_speculative_tokens=BUDGET), "cuda", DEPTHS,
                              state=state)
    logits = sc.logits.cuda()
    out = verifier(logits.clone(), batch)
    assert out.sampled_token_ids.is_cuda and out.num_rejected.dtype == torch.int32
    # every committed token is vLLM's own draw at its row's tree position
    drawn, processed, positions = verifier.draw_target_tokens(logits.clone(), batch)
    want = gumbel_sample(processed, batch.expanded_idx_mapping,
                         sampler.sampling_states.temperature.gpu,
                         sampler.sampling_states.seeds.gpu, positions,
                         apply_temperature=False)
    assert torch.equal(drawn, want)
    walk = state.take_walk(4)
    assert walk is not None
    for r in range(2):
        n = int(out.num_sampled[r])
        start = int(batch.cu_num_logits[r])
        rows = [start] + [start + int(c) for c in walk[r, : n - 1]]
        assert out.sampled_token_ids[r, :n].tolist() == want[rows].tolist()
    assert out.num_sampled[2:].tolist() == [1, 0]


@pytest.mark.parametrize("pair", ["qwen3", "deepseek_v3"])
def test_tiny_random_pairs_equal_ar(pair, tmp_path):
    """GQA (Qwen3, GQA tree backend) and MLA (DeepSeek-V3) tiny random targets with a
    random mixed sliding/full DFlash drafter: the mixed batch (greedy and seeded
    sampling, requests arriving while others run) equals AR on the same runner. The
    random drafter is rarely right, so this mostly exercises rejected trees; the
    oracle test drives deep acceptance."""
    common = ["--mixed", "--pair", pair]
    ar = run_script("check_ddtree_vllm.py", [*common, "--method", "ar"], tmp_path / "ar.json")
    got = run_script("check_ddtree_vllm.py", [*common, "--budget", "16"], tmp_path / "dd.json")
    greedy, sampled = split_by_temperature(got)
    ref_greedy, ref_sampled = split_by_temperature(ar)
    problems = unexplained_mismatches(greedy, ref_greedy)
    print(f"{pair}: greedy first mismatch {first_mismatches(greedy, ref_greedy)}, sampled "
          f"{first_mismatches(sampled, ref_sampled)}, mean acceptance length "
          f"{got['ddtree_mean_acceptance_length']:.3f}")
    assert not problems, "\n".join(problems)
    problems = unexplained_sampled_mismatches(sampled, ref_sampled)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_tiny_mla_pair_cascade_equals_ar(kv_cache_dtype, tmp_path, monkeypatch):
    """DDTree verifying through the cascade (``VLLM_DDTREE_MLA_KERNEL=cascade``: FlashMLA
    over the context, our kernel over the tree; sm_90), CUDA graphs, bf16 and fp8 caches:
    the tiny MLA pair's mixed batch equals AR's greedy tokens (AR through the same
    backend, its single-token decodes through the cascade too)."""
    from vllm_ddtree.attention_backends.mla_tree.cascade import flashmla_dense_available

    if not flashmla_dense_available(torch.device("cuda")):
        pytest.skip("the cascade needs FlashMLA's dense decode (sm_90)")
    monkeypatch.setenv("VLLM_DDTREE_MLA_KERNEL", "cascade")
    common = ["--mixed", "--pair", "deepseek_v3", "--kv-cache-dtype", kv_cache_dtype]
    ar = run_script("check_ddtree_vllm.py", [*common, "--method", "ar"], tmp_path / "ar.json")
    got = run_script("check_ddtree_vllm.py", [*common, "--budget", "16", "--graphs"],
                     tmp_path / "dd.json")
    witnesses = ()
    if kv_cache_dtype == "fp8":  # e4m3 rounding moves with the batch shape: AR's own
        witnesses = (split_by_temperature(run_script(  # answer at one request a step
            "check_ddtree_vllm.py", [*common, "--method", "ar", "--max-num-seqs", "1"],
            tmp_path / "ar1.json"))[0],)
    assert "cascade" in got["mla_kernels"] and "cascade" in ar["mla_kernels"], (
        got["mla_kernels"], ar["mla_kernels"])  # the cascade did run
    greedy, _ = split_by_temperature(got)
    ref_greedy, _ = split_by_temperature(ar)
    print(f"cascade {kv_cache_dtype}: greedy first mismatch "
          f"{first_mismatches(greedy, ref_greedy)}; AR at one request a step: "
          f"{[first_mismatches(w, ref_greedy) for w in witnesses]}")
    problems = unexplained_mismatches(greedy, ref_greedy, witnesses)
    assert not problems, "\n".join(problems)


def test_gumbel_flip_margin_matches_vllm_draws():
    """``gumbel_flip_margin`` against vLLM's own draw of a full row: the drawn token
    leads every other token (margin > 0), and moving the closest rival's logit just
    past its margin makes vLLM draw the rival instead."""
    from vllm.v1.worker.gpu.sample.gumbel import gumbel_sample

    from vllm_ddtree.testing.sampled_ties import gumbel_flip_margin

    gen = torch.Generator().manual_seed(0)
    for trial in range(4):
        logits = torch.randn(64, generator=gen) * 2
        seed, pos, temp = 1000 + trial, 37 + trial, 0.8

        def draw(row: torch.Tensor, seed=seed, pos=pos, temp=temp) -> int:
            return int(gumbel_sample(
                row.view(1, -1).cuda(), torch.zeros(1, dtype=torch.int32, device="cuda"),
                torch.tensor([temp], device="cuda"),
                torch.tensor([seed], dtype=torch.int64, device="cuda"),
                torch.tensor([pos], dtype=torch.int64, device="cuda"),
                apply_temperature=True)[0])

        won = draw(logits)
        margins = {v: gumbel_flip_margin(won, v, float(logits[won]), float(logits[v]),
                                         seed, pos, temp) for v in range(64) if v != won}
        assert all(m > 0 for m in margins.values())
        rival, margin = min(margins.items(), key=lambda kv: kv[1])
        if margin < 0.9:  # within the resolved range
            moved = logits.clone()
            moved[rival] += margin + 2e-3
            assert draw(moved) == rival
            moved[rival] -= 4e-3
            assert draw(moved) == won
