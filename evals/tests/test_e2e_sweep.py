"""The batch sweep's tooling on CPU: the load generator, the request pool, the rank
table, the rank oracle, the v2lite configs, ``--sweep``'s argument checks and the
report (``--fake`` children end to end, a refused configuration as skipped cells)."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import bench_e2e
import pytest
import torch
from drafter_ranks import (
    CALIBRATION_BUDGETS,
    RANK_CAP,
    calibration,
    chain_accepted,
    decode_ranks,
    encode_ranks,
    load_table,
    summarize,
)
from e2e_child import refused_config
from e2e_models import SETUPS
from e2e_oracle import (
    RankOracle,
    chain_of,
    next_token_permutation,
    structure_target_,
    vector_index,
)
from e2e_runs import RunSpec, chain_schedule, ddtree_schedule
from e2e_sweep import (
    PoolSpec,
    chain_mismatches,
    check_range,
    drive,
    output_crcs,
    request_pool,
)
from e2e_v2lite import active_params_per_token, v2lite_target_config

# -- the load generator ----------------------------------------------------------------


class FakeEngine:
    """vLLM's engine API as ``drive`` uses it: each step gives every running request
    one token (``token = 1000 * pool index + k``), a request finishes at its
    ``max_tokens``; records the requests running at each step."""

    def __init__(self):
        self.running: dict[str, list] = {}
        self.per_step: list[int] = []
        self.aborted: list[str] = []

    def add_request(self, name, prompt, params):
        self.running[name] = [params, 0]
        return name + "-internal"

    def step(self):
        self.per_step.append(len(self.running))
        outs = []
        for name, state in list(self.running.items()):
            state[1] += 1
            done = state[1] >= state[0]
            index = int(name.rsplit("-", 1)[1])
            outs.append(SimpleNamespace(request_id=name + "-internal", finished=done,
                                        outputs=[SimpleNamespace(
                                            token_ids=[1000 * index + state[1]])]))
            if done:
                del self.running[name]
        return outs

    def abort_request(self, names):
        self.aborted += names
        for n in names:
            self.running.pop(n, None)

    def has_unfinished_requests(self):
        return bool(self.running)


def test_drive_keeps_the_batch_in_flight_until_the_pool_is_spent():
    lengths = [3, 5, 2, 4, 6, 1, 3, 2, 5]
    pool = [SimpleNamespace(prompt=[1, 2], max_tokens=n) for n in lengths]
    engine = FakeEngine()
    ticks = iter(range(100))
    got = drive(engine, pool, 3, params_of=lambda r: r.max_tokens, tag="t-",
                clock=lambda: float(next(ticks)))
    window = engine.per_step[:got["steps"]]
    assert window == [3] * got["steps"]  # concurrency 3 at every step of the window
    # every request was added, the window ended with the first finish it could not refill
    assert all(got["outputs"][i] for i in range(len(pool)))
    assert got["tokens"] == sum(len(o) for o in got["outputs"])
    assert got["finished"] + len(engine.aborted) == len(pool)
    assert engine.aborted and not engine.running
    for i, out in enumerate(got["outputs"]):  # outputs mapped by the internal ids
        assert out == [1000 * i + k for k in range(1, len(out) + 1)]
        assert len(out) <= lengths[i]
    # the clock ticks at each reading: the window's start, before and after each step
    assert got["mean_in_flight"] == 3.0 and got["wall_s"] == 2 * got["steps"] + 1


def test_drive_pauses_between_steps_and_leaves_the_time_away_out():
    """``pause`` (``--interleave-s``) gets the stepping time so far before every step
    but the first; the seconds it reports away are not the window's, and every pause
    that handed over starts a slice."""
    pool = [SimpleNamespace(prompt=[1], max_tokens=n) for n in (4, 4, 4, 4)]
    now = [0.0]

    def clock():
        return now[0]

    seen = []

    def pause(stepped):
        seen.append(stepped)
        if len(seen) % 2:  # every other step: away for 10 s
            now[0] += 10.0
            return 10.0
        return 0.0

    class Ticking(FakeEngine):
        def step(self):
            now[0] += 1.0  # one second a step
            return super().step()

    got = drive(Ticking(), pool, 2, params_of=lambda r: r.max_tokens, clock=clock,
                pause=pause)
    assert got["steps"] == len(seen) + 1
    assert seen == [float(k) for k in range(1, got["steps"])]  # stepping time only
    assert got["wall_s"] == float(got["steps"])
    assert got["slices"] == 1 + (len(seen) + 1) // 2


def test_drive_charges_the_time_beyond_the_median_step_to_the_refills():
    """Steps that run a refill's prefill cost more; the median step is a steady one and
    the window's surplus over it, per request added in the window, is the refills'."""
    pool = [SimpleNamespace(prompt=[1], max_tokens=n) for n in (2, 2, 2, 2, 2, 2)]
    now = [0.0]
    engine_ref = []

    class Refilling(FakeEngine):
        def add_request(self, name, prompt, params):
            self.fresh = getattr(self, "fresh", 0) + 1
            return super().add_request(name, prompt, params)

        def step(self):
            # 1 s a step, plus 5 s for each request added since the last step (prefill)
            now[0] += 1.0 + 5.0 * (self.fresh if engine_ref else 0)
            self.fresh = 0
            engine_ref.append(1)
            return super().step()

    got = drive(Refilling(), pool, 2, params_of=lambda r: r.max_tokens,
                clock=lambda: now[0])
    # steps: 1 (first, its requests counted before the window), 1, 6 (2 refills' 10 s
    # land in it), 1, 11, 1: the window adds 4 requests and ends when the pool is spent
    assert got["step_ms_median"] == 1000.0
    added = len(pool) - 2
    assert got["refill_excess_ms"] == pytest.approx(
        1000 * (got["wall_s"] - got["steps"]) / added)
    assert got["refill_excess_ms"] == pytest.approx(5000.0)
    assert drive(FakeEngine(), pool[:2], 2, lambda r: 2)["refill_excess_ms"] is None


def test_drive_refuses_a_pool_smaller_than_the_batch():
    with pytest.raises(ValueError, match="batch=4 is not allowed with a pool of 2"):
        drive(FakeEngine(), [SimpleNamespace(prompt=[1], max_tokens=2)] * 2, 4, lambda r: 2)


def test_request_pool_shares_a_prefix_and_draws_seeded_lengths():
    setup = SETUPS["v2lite"]
    spec = PoolSpec(3, (8, 32), (4, 40), seed=5)
    pool = request_pool(setup, 128, 4, "random", spec)
    assert len(pool) == 12
    prefix = pool[0].prompt[:96]
    for r in pool:
        assert r.prompt[:96] == prefix and 8 <= len(r.prompt) - 96 <= 32
        assert 4 <= r.max_tokens <= 40
        assert all(setup.random_ids[0] <= t < setup.random_ids[1] for t in r.prompt)
    assert len({tuple(r.prompt[96:]) for r in pool}) == 12  # tails differ
    assert pool == request_pool(setup, 128, 4, "random", spec)  # seeded
    other = request_pool(setup, 128, 2, "random", spec)  # another batch: same prefix
    assert len(other) == 6 and other[0].prompt[:96] == prefix  # at least MIN_POOL
    assert other[0].prompt[96:] != pool[0].prompt[96:]
    assert pool != request_pool(setup, 128, 4, "random", PoolSpec(3, (8, 32), (4, 40), 6))
    # --min-pool: small batches draw more requests (about a second of decoding is noise)
    longer = PoolSpec(3, (8, 32), (4, 40), seed=5, min_pool=16)
    assert len(request_pool(setup, 128, 1, "random", longer)) == 16
    assert len(request_pool(setup, 128, 8, "random", longer)) == 24
    assert PoolSpec.from_json(longer.to_json()) == longer
    with pytest.raises(ValueError, match="context=32 is not allowed"):
        request_pool(setup, 32, 4, "random", spec)
    with pytest.raises(ValueError, match="'code' prompts need one"):
        request_pool(setup, 128, 4, "code", spec)
    with pytest.raises(ValueError, match=r"--prompt-tails=\(9, 3\) is not allowed"):
        check_range("--prompt-tails", (9, 3))


def test_lossless_checks_of_the_oracle_chain_and_the_crcs():
    perm = next_token_permutation(50, seed=1)
    pool = [SimpleNamespace(prompt=[3, 7]), SimpleNamespace(prompt=[9])]
    good = [chain_of(perm, 7, 5), chain_of(perm, 9, 3)]
    assert chain_mismatches(pool, good, perm)["requests_off_chain"] == 0
    bad = [good[0][:2] + [int(perm[good[0][1]]) ^ 1], good[1]]
    assert chain_mismatches(pool, bad, perm) == {"requests_off_chain": 1,
                                                 "first_off_chain_index": 2}
    crcs = output_crcs([list(range(20)), list(range(5))])
    assert crcs[0] is not None and crcs[1] is None


# -- the rank table and the oracle -----------------------------------------------------


def test_rank_vectors_encode_decode_and_refuse_bad_input():
    assert decode_ranks(encode_ranks([0, 5, 31, 32, 900])) == [0, 5, 31, RANK_CAP, RANK_CAP]
    with pytest.raises(ValueError, match="ranks\\[1\\]=-1 is not allowed"):
        encode_ranks([0, -1])
    with pytest.raises(ValueError, match="characters \\['!'\\] are not allowed"):
        decode_ranks("0!")
    assert chain_accepted([0, 0, 3, 0]) == 2 and chain_accepted([1, 0]) == 0


def test_stored_rank_table_is_consistent():
    table = load_table()
    assert table["depths"] == 15 and table["rank_cap"] == RANK_CAP
    assert table["rounds"] == len(table["vectors"]) >= 100
    assert table["command"].startswith("python evals/drafter_ranks.py")
    vectors = [decode_ranks(v) for v in table["vectors"]]
    for d in range(15):  # histograms and rank-0 shares are the vectors'
        assert sum(table["rank_hist"][d]) == len(vectors)
        assert table["rank_hist"][d][0] == sum(v[d] == 0 for v in vectors)
    chain = sum(chain_accepted(v) + 1 for v in vectors) / len(vectors)
    assert table["tokens_per_round"]["chain (leading rank-0 depths + 1)"] == round(chain, 3)
    promised = [[1.0 + b / 64 for b in CALIBRATION_BUDGETS]] * len(vectors)
    again = summarize({"vectors": vectors, "probs": [[0.5] * 15] * len(vectors),
                       "committed": [2], "promised": promised,
                       "got": [[1] * len(CALIBRATION_BUDGETS)] * len(vectors)},
                      "cmd", 256, 128, 64)
    assert again["vectors"] == table["vectors"]
    assert again["calibration"]["committed"] == [1.0] * len(CALIBRATION_BUDGETS)
    # the top-1 probability split: rounds the drafter got right, the others
    assert all(p == 0.5 for p in again["top1_prob_rank0"] + again["top1_prob_missed"])
    for d in range(15):
        assert table["top1_prob_rank0"][d] > table["top1_prob_missed"][d]
    curve = table["calibration"]
    assert curve["budgets"] == list(CALIBRATION_BUDGETS)
    assert curve["committed"] == sorted(curve["committed"])  # nested trees


def test_calibration_of_one_round_promises_the_top_probabilities_and_walks_the_truth():
    """A drafter sure of one token per depth: the tree of b nodes promises 1 + b x p
    (a chain while b <= L) and commits up to the first depth whose true token it lacks."""
    vocab, depths, p = 50, 4, 0.9
    logits = torch.full((depths, vocab), -1e4)
    logits[:, 7] = 0.0  # the sure token at every depth
    logits[:, 8] = float(torch.log(torch.tensor((1 - p) / p)))  # the runner-up
    promised, got = calibration(logits, [7, 7, 8, 7], budgets=(1, 2, 3, 4))
    # node probabilities: p, p^2, p^3, (1 - p)... : the b largest
    assert promised == pytest.approx([1 + p, 1 + p + p * p, 1 + p + p * p + p ** 3,
                                      1 + p + p * p + p ** 3 + p ** 4])
    assert got == [2, 3, 3, 3]  # depth 3's true token (8) is never in the chain of 7s


def test_oracle_logits_put_the_true_token_at_the_drawn_rank():
    table = load_table()
    vocab, n_req = 3000, 24
    oracle = RankOracle(next_token_permutation(vocab), table, vocab, seed=3)
    depths = oracle.depths
    gen = torch.Generator().manual_seed(0)
    bonus = torch.randint(0, vocab, (n_req,), generator=gen)
    pos = torch.randint(0, 5000, (n_req,), generator=gen)
    logits = 0.01 * torch.randn(n_req * depths, vocab, generator=gen)
    oracle.apply_(logits, bonus.repeat_interleave(depths), pos.repeat_interleave(depths),
                  torch.arange(depths).repeat(n_req))
    logits = logits.view(n_req, depths, vocab)
    perm = next_token_permutation(vocab)
    for r in range(n_req):
        which = vector_index(bonus[r:r + 1], pos[r:r + 1], 3, oracle.vectors.shape[0])
        ranks = oracle.vectors[int(which)].tolist()
        truth = chain_of(perm, int(bonus[r]), depths)
        for d in range(depths):
            rank = int((logits[r, d] > logits[r, d, truth[d]]).sum())
            if ranks[d] < RANK_CAP:
                assert rank == ranks[d]
            else:
                assert rank >= RANK_CAP
        argmax = logits[r].argmax(-1).tolist()
        greedy = next((d for d in range(depths) if argmax[d] != truth[d]), depths)
        assert greedy == chain_accepted(ranks)  # the chain accepts the leading rank-0s
    # the same (bonus, position) draws the same vector in every run
    assert torch.equal(vector_index(bonus, pos, 3, 200), vector_index(bonus, pos, 3, 200))


def test_structured_target_greedy_output_is_the_permutation():
    vocab, hidden = 700, 256
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.embed_tokens = torch.nn.Embedding(vocab, hidden)
    model.model.norm = torch.nn.Module()
    model.model.norm.weight = torch.nn.Parameter(torch.full((hidden,), 1e-3))
    model.model.layers = torch.nn.ModuleList([torch.nn.Module()])
    model.model.layers[0].o_proj = torch.nn.Linear(hidden, hidden, bias=False)
    model.model.layers[0].down_proj = torch.nn.Linear(hidden, hidden, bias=False)
    model.lm_head = torch.nn.Linear(hidden, vocab, bias=False)
    with torch.device("meta"):  # vLLM loads under a default device other than the CPU
        perm = next_token_permutation(vocab)
        assert structure_target_(model, perm) == 2
    assert not model.model.layers[0].o_proj.weight.any()
    with torch.no_grad():  # residual = embedding; final RMSNorm; LM head, in bf16
        x = model.model.embed_tokens.weight
        x = x / x.pow(2).mean(-1, keepdim=True).sqrt() * model.model.norm.weight
        greedy = (x.bfloat16() @ model.lm_head.weight.bfloat16().T).argmax(-1)
    assert torch.equal(greedy, perm)


def test_v2lite_dense_variant_keeps_the_active_parameters():
    moe = json.loads(v2lite_target_config(True).to_json_string(use_diff=False))
    dense = json.loads(v2lite_target_config(False).to_json_string(use_diff=False))
    assert (moe["num_hidden_layers"], moe["hidden_size"], moe["kv_lora_rank"],
            moe["n_routed_experts"], moe["num_experts_per_tok"]) == (27, 2048, 512, 64, 6)
    assert dense["first_k_dense_replace"] == 27 and dense["intermediate_size"] == 11264
    a, b = active_params_per_token(moe), active_params_per_token(dense)
    assert abs(a - b) / a < 0.002


# -- runs, arguments, refusals ---------------------------------------------------------


def test_perbatch_runs_carry_vllms_schedule():
    setup = SETUPS["trained_yarn"]
    chain = RunSpec.parse("dflash@FLASH_ATTN_MLA+perbatch")
    config = chain.speculative_config(setup, "d")
    assert config["num_speculative_tokens_per_batch_size"] == chain_schedule(16)
    assert chain_schedule(16)[0] == [1, 4, 15] and chain_schedule(16)[-1][2] == 0
    tree = RunSpec.parse("ddtree-auto-64+perbatch")
    config = tree.speculative_config(setup, "d")
    assert config["ddtree_budget"] == "auto"
    assert config["num_speculative_tokens_per_batch_size"] == ddtree_schedule(64)
    assert "num_speculative_tokens_per_batch_size" not in RunSpec.parse(
        "ddtree-64").speculative_config(setup, "d")
    with pytest.raises(ValueError, match="applies to dflash / ddtree runs only"):
        RunSpec.parse("ar@FLASH_ATTN_MLA+perbatch")


def test_refusals_of_optional_keys_are_skips_other_errors_fail():
    auto = RunSpec.parse("ddtree-auto-64")
    assert refused_config(ValueError("ddtree_budget 'auto' is not allowed"), auto)
    assert refused_config(ValueError("num_speculative_tokens_per_batch_size: no"),
                          RunSpec.parse("ddtree-64+perbatch"))
    assert not refused_config(RuntimeError("ddtree_budget: CUDA error"), auto)
    assert not refused_config(ValueError("ddtree_budget"), RunSpec.parse("ddtree-64"))


@pytest.mark.parametrize("extra, message", [
    (["--prime", "none"], "--prime none is not allowed with --sweep"),
    (["--engine-process"], "--engine-process is not allowed with the rank-oracle setups"),
    (["--contexts", "200"], "--contexts \\[200\\] are not allowed"),
    (["--prompt-tails", "9", "3"], "--prompt-tails=\\[9, 3\\] is not allowed"),
    (["--output-lengths", "1", "3"], "--output-lengths=\\[1, 3\\] is not allowed"),
])
def test_sweep_arguments_are_checked(extra, message, capsys):
    with pytest.raises(SystemExit):
        bench_e2e.parse_args(["--sweep", "--setup", "v2lite", "--runs", "ddtree-64"] + extra)
    assert __import__("re").search(message, capsys.readouterr().err)


def test_interleave_needs_a_lockstep_sweep(capsys):
    with pytest.raises(SystemExit):
        bench_e2e.parse_args(["--sweep", "--setup", "v2lite", "--runs", "ddtree-64",
                              "--interleave-s", "0.2"])
    assert "--interleave-s 0.2 needs --sweep and --lockstep" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_e2e.parse_args(["--sweep", "--lockstep", "--setup", "trained", "--runs",
                              "ddtree-64", "--interleave-s", "0.2", "--engine-process"])
    assert "not allowed with --engine-process" in capsys.readouterr().err


def test_fake_sweep_runs_take_turns_within_a_cell(tmp_path):
    """``--interleave-s``: every run of a cell starts before any finishes, each hands
    over after each slice (the fake cell: 3 s of steps in 1 s strides, slices of 0.5 s:
    4 slices), and cells still come one after another."""
    runs = ["ar@FLASH_ATTN_MLA", "ddtree-64", "ddtree-auto"]
    assert bench_e2e.main(["--fake", "--sweep", "--lockstep", "--interleave-s", "0.5",
                           "--setup", "v2lite", "--batches", "1", "4", "--contexts", "1k",
                           "--runs", *runs, "--repeats", "2", "--out-dir", str(tmp_path),
                           "--model-dir", str(tmp_path / "m")]) == 0
    data = json.loads((tmp_path / "e2e_batch_sweep_v2lite.json").read_text())
    rows = [r for r in data["rows"] if r["status"] == "ok"]
    assert len(rows) == 12 and {r["slices"] for r in rows} == {4}
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["batch"], r["repeat"]), []).append(r)
    spans = []
    for group in groups.values():
        assert len(group) == 3
        # turns: the last run started before the first one finished
        assert max(r["measure_start"] for r in group) < min(r["measured_at"] for r in group)
        spans.append((min(r["measure_start"] for r in group),
                      max(r["measured_at"] for r in group)))
    spans.sort()
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))  # one by one
    md = (tmp_path / "e2e_batch_sweep_v2lite.md").read_text()
    assert "taking turns of 0.5 s of steps (`--interleave-s`)" in md


def test_fake_sweep_cell_starts_for_every_run_or_none(tmp_path, monkeypatch):
    """--max-minutes passing as a cell's first run starts (inside the grace): the cell's
    other runs still take their turns (every row of the cell is measured), and the
    next cell, started after the deadline, is not run by any run."""
    import e2e_children

    offset = [0.0]
    clock = SimpleNamespace(**{n: getattr(time, n) for n in dir(time)
                                     if not n.startswith("_")})
    clock.time = lambda: time.time() + offset[0]
    monkeypatch.setattr(e2e_children, "time", clock)
    real_send = e2e_children._send

    def send(child, line):  # the deadline passes as batch 4's first run starts
        if '"cell": [1024, 4,' in line and not offset[0]:
            offset[0] = 0.5 * 60 + 5.0  # past --max-minutes 0.5, inside the 2-minute grace
        return real_send(child, line)

    monkeypatch.setattr(e2e_children, "_send", send)
    runs = ["ar@FLASH_ATTN_MLA", "ddtree-64"]
    assert bench_e2e.main(["--fake", "--sweep", "--lockstep", "--interleave-s", "0.5",
                           "--setup", "v2lite", "--batches", "1", "4", "8", "--contexts",
                           "1k", "--runs", *runs, "--max-minutes", "0.5",
                           "--min-child-minutes", "0", "--out-dir", str(tmp_path),
                           "--model-dir", str(tmp_path / "m")]) == 0
    data = json.loads((tmp_path / "e2e_batch_sweep_v2lite.json").read_text())
    status = {(r["run"], r["batch"]): r["status"] for r in data["rows"]}
    assert offset[0] > 0
    assert {status[(run, b)] for run in runs for b in (1, 4)} == {"ok"}
    assert {status[(run, 8)] for run in runs} == {"not run"}


def test_sweep_only_flags_need_sweep(capsys):
    with pytest.raises(SystemExit):
        bench_e2e.parse_args(["--setup", "kimi8", "--prompt-tails", "8", "16"])
    assert "--prompt-tails needs --sweep" in capsys.readouterr().err
    args = bench_e2e.parse_args(["--sweep", "--setup", "v2lite", "--runs", "ar@FLASH_ATTN_MLA"])
    assert args.batches == [1, 4, 8, 16, 32, 64] and args.contexts is None
    assert args.max_tokens == 256 and args.pool_spec.tails == (64, 256)
    assert bench_e2e.setup_contexts(SETUPS["v2lite"], args) == [1024, 32768]


# -- end to end with fake children -----------------------------------------------------


def test_fake_sweep_end_to_end_with_a_refused_run(tmp_path, monkeypatch):
    """``--sweep --lockstep --fake``: every run's child at once; the refused ddtree
    schedule becomes skipped cells naming the refusal; markdown (auto's ratios, the
    command), PNG and JSON; --from-json re-renders the same markdown."""
    monkeypatch.setenv("BENCH_E2E_FAKE_REFUSE", "ddtree-64+perbatch")
    runs = ["ar@FLASH_ATTN_MLA", "dflash@FLASH_ATTN_MLA+perbatch", "ddtree-64",
            "ddtree-64+perbatch", "ddtree-auto"]
    assert bench_e2e.main(["--fake", "--sweep", "--lockstep", "--setup", "v2lite",
                           "--batches", "1", "64", "--contexts", "1k", "--runs", *runs,
                           "--out-dir", str(tmp_path), "--model-dir",
                           str(tmp_path / "m")]) == 0
    data = json.loads((tmp_path / "e2e_batch_sweep_v2lite.json").read_text())
    assert data["sweep"]["pool_factor"] == 3
    status = {(r["run"], r["batch"]): (r["status"], r.get("note", "")) for r in data["rows"]}
    assert status[("ddtree-64+perbatch", 64)][0] == "skipped"
    assert "refused by the front end" in status[("ddtree-64+perbatch", 64)][1]
    assert status[("ddtree-auto-64", 1)][0] == "ok"
    md = (tmp_path / "e2e_batch_sweep_v2lite.md").read_text()
    assert "## Tokens per second, 1k context" in md and "/ best other" in md
    assert "--sweep --lockstep" in md and "refused by the front end" in md
    assert "Host speed: ms of a fixed Python loop" in md and "| 2.10 |" in md
    assert "the step gate in each cell's batch-size bucket" in md
    assert "| 64 | 64 | 64: 90 %, 0: 10 % | 64: 0.50 (15), 0: 0.50 (15) | 64: 3.00, 0: 1.00 |" \
        in md
    assert (tmp_path / "e2e_batch_sweep_v2lite.png").stat().st_size > 1000
    out = tmp_path / "again"
    out.mkdir()
    assert bench_e2e.main(["--from-json", str(tmp_path / "e2e_batch_sweep_v2lite.json"),
                           "--out-dir", str(out)]) == 0
    assert (out / "e2e_batch_sweep_v2lite.md").read_text() == md


def test_oracle_tokens_per_round_chain_matches_the_table_and_trees_go_deeper():
    """The chain's figure is the table's (leading rank-0 depths, exactly); a tree of 64
    nodes accepts at least what one of 16 does; the stored figures came from the
    stored vectors."""
    from e2e_oracle import oracle_tokens_per_round

    table = load_table()
    small = dict(table, vectors=table["vectors"][:12])
    got = oracle_tokens_per_round(small, 2048, [16, 64])
    vectors = [decode_ranks(v) for v in small["vectors"]]
    assert got["chain"] == round(sum(chain_accepted(v) + 1 for v in vectors) / 12, 3)
    assert got["ddtree-64"] >= got["ddtree-16"] >= got["chain"]
    stored = table["oracle_tokens_per_round"]
    assert stored["chain"] == table["tokens_per_round"]["chain (leading rank-0 depths + 1)"]
    assert stored["command"].startswith("python evals/e2e_oracle.py")


def test_the_gate_tests_recorded_rounds_are_the_oracles():
    """``tests/data/drafter_round_cuts.json`` (what the step gate's CPU tests replay) is
    ``round_cuts`` of the stored table: its first rounds recomputed, every round's cuts
    never fewer at a larger budget, at most the budget."""
    from pathlib import Path

    from e2e_oracle import round_cuts

    path = Path(__file__).resolve().parents[2] / "tests" / "data" / "drafter_round_cuts.json"
    stored = json.loads(path.read_text())
    table = load_table()
    assert len(stored["accepted"]) == len(table["vectors"])
    assert round_cuts(table, 102400, stored["arms"], rounds=4) == stored["accepted"][:4]
    for row in stored["accepted"]:
        assert row == sorted(row) and all(a <= b for a, b in zip(row, stored["arms"], strict=True))
    assert stored["command"].startswith("python evals/e2e_oracle.py --round-cuts")


def test_oracle_trees_are_calibrated_like_the_embedded_drafters():
    """What the oracle's trees promise (their own node probabilities: what auto's device
    cut and gate trust) and what they commit, budget by budget, stay near the embedded
    drafter's measured curve. The oracle that placed decoys above the true token with
    more confidence the deeper it ranked promised 2.72 tokens at B = 64 and committed
    4.88 (the drafter: 4.51 and 4.09), so the cut dropped the branches that held it."""
    from e2e_oracle import calibration_distance, oracle_tokens_per_round

    table = load_table()
    measured = table["calibration"]
    curve = oracle_tokens_per_round(table, 102400, [])["calibration"]
    assert curve == table["oracle_calibration"]  # the stored curve is this oracle's
    for key in ("promised", "committed"):
        for got, want in zip(curve[key], measured[key], strict=True):
            assert abs(got - want) <= 0.12 * want, (key, curve, measured)
    assert calibration_distance(curve, measured) < 0.5


def test_gate_table_counts_the_cells_own_decisions_and_marks_older_residuals():
    """The gate lives through the warm-up and every earlier cell: a cell's table counts
    its own decisions and marks residuals with no sample in the cell."""
    from e2e_sweep_report import gate_in_cell, gate_tables

    def arm(a, chosen, ms, samples):
        return {"arm": a, "chosen": chosen, "residual_ms": ms, "residual_samples": samples,
                "committed": 3.0 if a else 1.0, "committed_samples": 5}

    before = {"1": {"settled": 64, "arms": [arm(0, 12, 3.1, 8), arm(64, 50, 3.0, 40)]}}
    after = {"1": {"settled": 64, "arms": [arm(0, 12, 3.1, 8), arm(64, 150, 2.5, 130),
                                            arm(0 + 32, 0, 0.0, 0)]}}
    cell = gate_in_cell(before, after)
    counts = {a["arm"]: (a["chosen_in_cell"], a["samples_in_cell"]) for a in cell["1"]["arms"]}
    assert counts == {0: (0, 0), 64: (100, 90), 32: (0, 0)}
    row = {"run": "ddtree-auto-64", "context": 1024, "kind": "code", "batch": 1,
           "gate": cell}
    md = "\n".join(gate_tables([row], ["ddtree-auto-64"], {"ddtree-auto-64": "auto"},
                               1024, "code"))
    assert "| 1 | 64 | 64: 100 %, 0: 0 %, 32: 0 % |" in md
    assert "64: 2.50 (90), 0: 3.10 (before), 32: —" in md


def test_engine_batch_counter_counts_requests_per_scheduled_step():
    """The engine's own batch per step (the client's in-flight count is the batch by
    construction): steps without tokens are not counted; installing twice wraps once."""
    from types import SimpleNamespace as NS

    import e2e_engine

    class Runner:
        def execute_model(self, scheduler_output, dummy_run=False):
            return "ran"

    e2e_engine.install_batch_counter(Runner)
    e2e_engine.install_batch_counter(Runner)
    e2e_engine._BATCH = [0, 0]
    runner = Runner()
    for reqs in (4, 4, 3):
        assert runner.execute_model(NS(total_num_scheduled_tokens=reqs * 9,
                                       num_scheduled_tokens=dict.fromkeys(range(reqs), 9)))
    runner.execute_model(NS(total_num_scheduled_tokens=0, num_scheduled_tokens={}))
    assert e2e_engine.engine_batch_count_take() == pytest.approx(11 / 3)
    assert e2e_engine.engine_batch_count_take() is None  # stopped


def test_auto_ratio_spread_over_repeats():
    """With repeats, auto's ratio to the best other run is also given repeat by repeat:
    the median of a few noisy cells hides a repeat below the bar."""
    from e2e_sweep_report import repeat_ratio_ranges

    def row(run, repeat, speed):
        return {"run": run, "context": 1024, "kind": "code", "batch": 1, "repeat": repeat,
                "status": "ok", "tokens_per_s": speed}

    rows = [row("ddtree-64", 0, 100.0), row("ddtree-auto-64", 0, 99.0),
            row("ddtree-64", 1, 120.0), row("ddtree-auto-64", 1, 90.0),
            row("ar@FLASH_ATTN_MLA", 1, 130.0), row("ddtree-auto-64", 2, 50.0)]
    got = repeat_ratio_ranges(rows, ["ar@FLASH_ATTN_MLA", "ddtree-64", "ddtree-auto-64"],
                              1024, "code", 1)
    assert got["ddtree-auto-64"] == pytest.approx((90 / 130, 0.99))
    assert repeat_ratio_ranges(rows[:2], ["ddtree-64", "ddtree-auto-64"], 1024, "code",
                               1) == {}


def test_auto_ratio_at_equal_host_speed():
    """Auto's rows are held only to rows whose fixed Python loop agreed with theirs
    (within 1.25x): a fixed run measured while the host ran twice as fast is not the
    yardstick of an auto row on the slow host; an auto row gives no ratio where the
    cell's best other run (by the medians) has no row on its host speed."""
    from e2e_sweep_report import equal_host_ratios, lossless_lines

    def row(run, repeat, speed, host):
        return {"run": run, "context": 1024, "kind": "code", "batch": 1, "repeat": repeat,
                "status": "ok", "tokens_per_s": speed, "python_ms": host,
                "python_ms_after": host}

    runs = ["ar@FLASH_ATTN_MLA", "ddtree-64", "ddtree-auto-64"]
    rows = [row("ar@FLASH_ATTN_MLA", 0, 50.0, 3.6), row("ddtree-64", 0, 150.0, 1.8),
            row("ddtree-auto-64", 0, 80.0, 3.6),    # slow host: against 110 (repeat 1)
            row("ar@FLASH_ATTN_MLA", 1, 60.0, 1.9), row("ddtree-64", 1, 110.0, 3.5),
            row("ddtree-auto-64", 1, 140.0, 1.7),   # fast host: against 150 (repeat 0)
            row("ddtree-auto-64", 2, 100.0, 3.3),   # slow: against 110
            row("ddtree-auto-64", 3, 400.0, 5.0)]   # no run on so slow a host
    got = equal_host_ratios(rows, runs, 1024, "code", 1)
    assert got["ddtree-auto-64"] == pytest.approx([80 / 110, 140 / 150, 100 / 110])
    rows[1]["python_ms_after"] = 3.6  # its loop toggled within the window: no match
    rows.append(row("ar@FLASH_ATTN_MLA", 2, 200.0, 5.0))  # the only run on that host
    assert equal_host_ratios(rows, runs, 1024, "code", 1)["ddtree-auto-64"] == \
        pytest.approx([80 / 110, 100 / 110])
    crc = {"ar@FLASH_ATTN_MLA": [1, 2], "ddtree-64": [1, 3]}
    checks = lossless_lines([dict(r, output_crc=crc.get(r["run"], [1, 2])) for r in rows])
    assert checks == ["- ddtree-64, 1k, batch 1: 1 of 2 requests differ from AR in their "
                      "first 16 tokens (bf16: batch shapes differ, ties can flip) "
                      "(in 2 repeats)"]
    other_kind = [dict(r, kind="random") for r in rows]  # two prompt kinds: kept apart
    checks = lossless_lines([dict(r, output_crc=crc.get(r["run"], [1, 2]))
                             for r in rows + other_kind])
    assert [c.split(": ")[0] for c in checks] == ["- ddtree-64, 1k, batch 1, code prompts",
                                                  "- ddtree-64, 1k, batch 1, random prompts"]
    rows[1] = {k: v for k, v in rows[1].items() if k != "python_ms"}  # no host timing:
    # the yardstick is still ddtree-64, the best by all its rows
    assert equal_host_ratios(rows, runs, 1024, "code", 1)["ddtree-auto-64"] == \
        pytest.approx([80 / 110, 100 / 110])


def test_sweep_markdown_splits_speed_into_tokens_and_ms_per_step(tmp_path):
    """Tokens per engine step (the drafts chosen and accepted) and ms per step (also the
    host) are tabled apart, medians over repeats, so a ratio below the bar shows which
    of the two lost it."""
    from e2e_sweep_report import write_sweep_markdown

    def row(run, repeat, tokens, steps, seconds):
        return {"run": run, "method": "ar" if run.startswith("ar@") else "ddtree",
                "backend": "FLASH_ATTN_MLA", "budget": None, "context": 1024,
                "kind": "code", "batch": 4, "repeat": repeat, "status": "ok",
                "tokens": tokens, "steps": steps, "decode_s": seconds,
                "tokens_per_s": tokens / seconds}

    rows = [row("ar@FLASH_ATTN_MLA", 0, 400, 100, 0.2), row("ddtree-auto-64", 0, 400, 40, 0.16),
            row("ddtree-auto-64", 1, 400, 50, 0.2), row("ddtree-auto-64", 2, 400, 25, 0.1)]
    for r, (median, excess) in zip(rows, [(1.5, 4.0), (3.0, 20.0), (3.5, 30.0), (2.5, None)],
                                   strict=True):
        r.update(step_ms_median=median, refill_excess_ms=excess, decode_verify_ms=median,
                 prefill_verify_ms=10 * median)
    path = tmp_path / "sweep.md"
    write_sweep_markdown({"rows": rows, "invocations": [], "sweep": {}}, str(path))
    text = path.read_text()
    tables = text.split("Tokens per engine step")[1].split("\n\n")
    assert "| 4 | 4.0 | 10.0 |" in tables[1]   # 400 / 40: the median of 8, 10, 16
    assert "| 4 | 2.00 | 4.00 |" in tables[2]  # 1000 * 0.16 / 40, of 4.0, 4.0, 4.0
    where = text.split("Where the ms per step go")[1].split("\n\n")
    assert "| 4 | 1.50 | 3.00 |" in where[1]  # the median step, median over repeats
    assert "| 4 | 4.0 | 25.0 |" in where[2]  # per refill; a repeat without refills left out
    split = text.split("those that also prefill a refill")[1].split("\n\n")
    assert "| 4 | 1.5 / 15.0 | 3.0 / 30.0 |" in split[1]  # decode / prefill, by run
    assert "ran without a CUDA graph" not in text  # no graph modes noted
    for r, share in zip(rows, [0.0, 0.5, 0.5, 1.0], strict=True):
        r.update(decode_eager_share=0.0, prefill_eager_share=share)
    write_sweep_markdown({"rows": rows, "invocations": [], "sweep": {}}, str(path))
    eager = path.read_text().split("ran without a CUDA graph")[1].split("\n\n")
    assert "| 4 | 0.00 / 0.00 | 0.00 / 0.50 |" in eager[1]  # AR / auto's median of 3


def test_a_turn_is_never_a_timed_step_of_autos_gate():
    """``--interleave-s``: at a hand-over the gate's last step mark loses its modeled
    time, so the interval that spans the other runs' turn is never a sample
    (``SpeculationGate._drain_marks`` skips marks without one)."""
    from collections import deque

    from e2e_engine import engine_gate_skip_gap

    def worker(gate):
        return SimpleNamespace(model_runner=SimpleNamespace(
            speculator=SimpleNamespace(step_plan=SimpleNamespace(gate=gate))))

    marks = deque([SimpleNamespace(model=0.004), SimpleNamespace(model=0.005)])
    assert engine_gate_skip_gap(worker(SimpleNamespace(marks=marks)))
    assert [m.model for m in marks] == [0.004, None]
    assert not engine_gate_skip_gap(worker(SimpleNamespace(marks=deque())))
    assert not engine_gate_skip_gap(worker(None))
    import inspect

    from vllm_ddtree.budget.gate import SpeculationGate

    assert "first.model is None" in inspect.getsource(SpeculationGate._drain_marks)


def test_turn_groups_never_hold_a_run_twice():
    """Two equal cells in a row (``--prompts random random`` at one context and batch)
    are two groups of turns: a child mid-cell never gets another cell."""
    from e2e_children import turn_groups

    cell = (1024, 1, "random")
    order = [(cell, 0, "a"), (cell, 0, "b"), (cell, 0, "a"), (cell, 0, "b"),
             (cell, 1, "b"), ((1024, 4, "random"), 1, "b")]
    got = [[seq for seq, _ in group] for group in turn_groups(order)]
    assert got == [[0, 1], [2, 3], [4], [5]]


def test_a_child_stops_a_cell_the_parent_aborts_between_turns(tmp_path, monkeypatch):
    """Past --max-minutes and its grace the parent answers a turn with ``abort``: the
    cell becomes a not-run row (its requests are left in flight, so the child's later
    cells are not run either), and each hand-over first runs ``after_cell`` (the GPU
    child empties its CUDA cache there)."""
    import io

    from e2e_child import serve_commands, slice_path

    out = tmp_path / "result.json"
    spec = {"out": str(out), "interleave_s": 0.5, "run": "ddtree-64", "setup": "v2lite",
            "max_tokens": 8, "temperature": 0.0}
    commands = [json.dumps({"cell": [1024, 1, "random"], "repeat": 0, "seq": 0}), "continue",
                "abort", json.dumps({"cell": [1024, 4, "random"], "repeat": 0, "seq": 1})]
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(commands) + "\n"))
    emptied = []

    def measure(cell_spec, cell, pause):
        for stepped in (1.0, 2.0, 3.0):
            pause(stepped)
        return {"status": "ok"}

    result = {"meta": {}, "rows": []}
    settled = []
    serve_commands(spec, result, measure, after_cell=lambda: emptied.append(1),
                   settle=lambda: settled.append(1))
    assert len(settled) == 2  # each hand-over, inside the window
    assert [r["status"] for r in result["rows"]] == ["not run", "not run"]
    assert "--max-minutes reached within the cell" in result["rows"][0]["note"]
    assert "an earlier cell failed" in result["rows"][1]["note"]
    assert json.loads((tmp_path / "result.json.slice").read_text())["n"] == 2
    assert slice_path(str(out)).endswith(".slice") and len(emptied) >= 2


def test_priming_the_prefix_alone_leaves_each_tail_to_its_request(capsys):
    """``--prime cache`` prefills the first prompt, then the pool's whole prompts (a
    request joining the window prefills its last partial page only); ``--prime prefix``
    only the shared prefix, so each request prefills its own tail when it joins, as on a
    server. ``prefix`` needs ``--sweep``; other values are refused by name."""
    from e2e_sweep import PoolSpec, priming_groups, request_pool

    pool_spec = PoolSpec(pool_factor=2, tails=(8, 16), outputs=(4, 8))
    pool = request_pool(SETUPS["kimi8"], 64, 3, "random", pool_spec)
    prefix_len = 64 - 16
    groups = priming_groups(pool, "cache", prefix_len)
    assert groups == [[pool[0].prompt], [r.prompt for r in pool]]
    (only,), = priming_groups(pool, "prefix", prefix_len)
    assert only == pool[0].prompt[:prefix_len]
    assert all(r.prompt[:prefix_len] == only and len(r.prompt) > prefix_len for r in pool)
    with pytest.raises(ValueError, match="prime='none' is not allowed with a sweep"):
        priming_groups(pool, "none", prefix_len)
    args = bench_e2e.parse_args(["--sweep", "--setup", "v2lite", "--runs", "ar@FLASH_ATTN_MLA",
                                 "--prime", "prefix"])
    assert args.prime == "prefix"
    with pytest.raises(SystemExit):
        bench_e2e.parse_args(["--setup", "kimi8", "--prime", "prefix"])
    assert "--prime prefix needs --sweep" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_e2e.parse_args(["--sweep", "--setup", "v2lite", "--prime", "none"])
    assert "--prime none is not allowed with --sweep" in capsys.readouterr().err


def test_fake_sweep_report_says_what_was_primed(tmp_path):
    for prime, said in (("cache", "the pool's prompts are prefilled first"),
                        ("prefix", "each request prefills its own tail when it joins")):
        out = tmp_path / prime
        assert bench_e2e.main(["--fake", "--sweep", "--setup", "v2lite", "--batches", "1",
                               "--contexts", "1k", "--runs", "ar@FLASH_ATTN_MLA", "--prime",
                               prime, "--out-dir", str(out), "--model-dir",
                               str(tmp_path / "m")]) == 0
        assert said in (out / "e2e_batch_sweep_v2lite.md").read_text()
