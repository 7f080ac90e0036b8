"""The end-to-end benchmark's CPU parts (evals/bench_e2e.py and its helpers): model
configs, argument parsing, prompts, the step-split arithmetic, the runner hooks (on fake
runner classes), the markdown/PNG writer and the parent/child plumbing (``--fake``)."""

import gc
import inspect
import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "evals"))
import bench_e2e  # noqa: E402
import e2e_models  # noqa: E402
import e2e_report  # noqa: E402
import e2e_timing  # noqa: E402
from bench_e2e import RunSpec, parse_args  # noqa: E402

# ---------------------------------------------------------------------------------------
# Model configs


@pytest.mark.parametrize("heads", [8, 64])
def test_kimi_configs_have_the_anchor_shapes_and_pass_the_drafter_checks(heads, tmp_path):
    from transformers import AutoConfig

    from vllm_ddtree.config import check_drafter_for_target
    from vllm_ddtree.drafter_config import resolve_layer_attention

    target_dir, drafter_dir = e2e_models.write_kimi_pair(tmp_path, heads)
    assert sorted(p.name for p in target_dir.iterdir()) == ["config.json"]  # dummy load
    target = AutoConfig.from_pretrained(target_dir)
    assert target.architectures == ["DeepseekV3ForCausalLM"]
    assert (target.hidden_size, target.num_attention_heads, target.q_lora_rank,
            target.kv_lora_rank, target.qk_rope_head_dim, target.vocab_size) == (
        7168, heads, 1536, 512, 64, 163840)
    assert target.num_hidden_layers == target.first_k_dense_replace == 4  # dense only
    assert target.max_position_embeddings >= 131072 + 4096

    check_drafter_for_target(str(drafter_dir), target)
    drafter = AutoConfig.from_pretrained(drafter_dir)
    assert drafter.architectures == ["DFlashDraftModel"]
    assert (drafter.num_hidden_layers, drafter.hidden_size, drafter.num_attention_heads,
            drafter.num_key_value_heads, drafter.block_size) == (6, 7168, 64, 8, 8)
    windows = [resolve_layer_attention(drafter, i)[0] for i in range(6)]
    assert windows == [4096] * 5 + [None]
    ids = drafter.dflash_config["target_layer_ids"]
    assert len(set(ids)) == len(ids) and max(ids) < target.num_hidden_layers


def test_trained_yarn_takes_a_pair_that_is_scaled_already(tmp_path, monkeypatch):
    """A pair carried with E2E_PAIR whose target already has YaRN (a `trainyarn`
    fine-tune) is used as it is, not scaled twice."""
    from vllm_ddtree.long_context import write_rope_scaled, yarn_parameters

    pair = tmp_path / "pair"
    write_rope_scaled(e2e_models.CHECKPOINTS / "target", pair / "target", yarn_parameters())
    monkeypatch.setattr(e2e_models, "CHECKPOINTS", pair)
    paths = e2e_models.prepare_setup(e2e_models.SETUPS["trained_yarn"], tmp_path / "root")
    assert paths.target == pair / "target"


def test_prepare_setup_paths_and_positions(tmp_path):
    trained = e2e_models.prepare_setup(e2e_models.SETUPS["trained"], tmp_path)
    assert (trained.target / "config.json").exists() and trained.tokenizer_file.exists()
    assert e2e_models.read_config(trained.target)["max_position_embeddings"] == 4096
    yarn = e2e_models.prepare_setup(e2e_models.SETUPS["trained_yarn"], tmp_path)
    config = e2e_models.read_config(yarn.target)
    assert config["rope_parameters"]["rope_type"] == "yarn"
    assert config["max_position_embeddings"] == yarn.max_positions == 2048
    assert yarn.tokenizer_file.exists() and yarn.drafter == trained.drafter
    assert yarn.target != trained.target  # the embedded checkpoint is left alone
    kimi = e2e_models.prepare_setup(e2e_models.SETUPS["kimi8"], tmp_path,
                                    min_positions=300_000)
    assert kimi.max_positions == 524288 and kimi.tokenizer_file is None
    assert e2e_models.read_config(kimi.target)["max_position_embeddings"] == 524288
    assert e2e_models.read_config(kimi.drafter)["max_position_embeddings"] == 524288
    kv = e2e_models.kv_cache_bytes(e2e_models.read_config(kimi.target),
                                   e2e_models.read_config(kimi.drafter), 131072, 8)
    assert kv["target"] == 4 * 576 * 2 * 131072 * 8  # MLA latent + rope, 4 layers, bf16
    assert kv["drafter"] == 2 * 8 * 128 * 2 * (5 * 4096 + 131072) * 8  # 5 windows + 1 full


# ---------------------------------------------------------------------------------------
# Arguments, runs, cells


def test_run_specs_parse_and_speculative_configs():
    kimi, trained = e2e_models.SETUPS["kimi64"], e2e_models.SETUPS["trained"]
    assert RunSpec.parse("ar@flash_attn_mla") == RunSpec("ar", "FLASH_ATTN_MLA")
    assert RunSpec.parse("ddtree-64").name == "ddtree-64"
    assert RunSpec.parse("ddtree-64@CUSTOM") == RunSpec("ddtree", "CUSTOM", 64)
    with pytest.raises(ValueError, match="tree backend"):
        RunSpec.parse("ddtree-64@FLASH_ATTN_MLA")
    with pytest.raises(ValueError):
        RunSpec.parse("eagle@X")
    assert RunSpec.parse("ar@TRITON_MLA").speculative_config(kimi, "/d") is None
    assert RunSpec.parse("dflash@TRITON_MLA").speculative_config(kimi, "/d") == {
        "method": "dflash", "model": "/d", "num_speculative_tokens": 7}
    assert RunSpec.parse("dflash@TRITON_MLA").num_spec_tokens(trained) == 15
    assert RunSpec.parse("ddtree-32").speculative_config(trained, "/d") == {
        "method": "ddtree", "model": "/d", "num_speculative_tokens": 32}
    assert RunSpec.parse("ddtree-auto").speculative_config(kimi, "/d") == {
        "method": "ddtree", "model": "/d", "num_speculative_tokens": 64,
        "ddtree_budget": "auto"}
    auto = RunSpec.parse("ddtree-auto-128")
    assert auto == RunSpec("ddtree", "CUSTOM", "auto", 128) and auto.name == "ddtree-auto-128"
    assert RunSpec.parse(auto.name) == auto  # the child re-parses the name
    fixed = RunSpec.parse("ddtree-autofixed-64")
    assert fixed.fixed_shape and fixed.name == "ddtree-autofixed-64"
    assert RunSpec.parse(fixed.name) == fixed
    assert fixed.speculative_config(kimi, "/d")["ddtree_verify_shape"] == "fixed"
    assert "ddtree_verify_shape" not in auto.speculative_config(kimi, "/d")
    runs = parse_args(["--runs", "ddtree-autofixed", "--auto-max", "32"]).run_specs
    assert runs[0].name == "ddtree-autofixed-32"
    assert auto.speculative_config(trained, "/d")["num_speculative_tokens"] == 128
    with pytest.raises(ValueError, match="1..512"):
        RunSpec.parse("ddtree-auto-1000")


def test_skipprefix_gives_vllms_methods_ddtrees_scheduler(monkeypatch, capsys):
    """+skipprefix: vLLM's chain (and AR) without the scheduler's common-prefix scan, as
    DDTree engines run, in its own column; the run's child patches the scheduler in its
    own process (so not with --engine-process). The plain chain stays the x-chain
    reference (it sorts first)."""
    from types import SimpleNamespace as NS

    from vllm.v1.core.sched.scheduler import Scheduler

    chain = RunSpec.parse("dflash@FLASH_ATTN_MLA+skipprefix")
    assert chain.method == "dflash" and chain.variants == ("+skipprefix",)
    assert chain.name == "dflash@FLASH_ATTN_MLA+skipprefix"
    assert RunSpec.parse(chain.name) == chain  # the child re-parses the name
    plain = RunSpec.parse("dflash@FLASH_ATTN_MLA")
    kimi = e2e_models.SETUPS["kimi8"]
    assert chain != plain
    assert chain.speculative_config(kimi, "/d") == plain.speculative_config(kimi, "/d")
    assert RunSpec.parse("ar@TRITON_MLA+skipprefix").variants == ("+skipprefix",)
    rows = [bench_e2e.base_row("kimi8", r, (1024, 1, "random"), 16) for r in (chain, plain)]
    assert e2e_report.run_label(rows[0]) == "DFlash chain, FA-MLA, no common-prefix scan"
    assert sorted(rows, key=e2e_report.run_sort_key)[0]["run"] == plain.name
    assert bench_e2e.row_key(rows[0]) != bench_e2e.row_key(rows[1])
    with pytest.raises(ValueError, match="applies to ar / dflash runs only"):
        RunSpec.parse("ddtree-64+skipprefix")  # DDTree engines always skip the scan

    class Manager:
        def get_num_common_prefix_blocks(self, running_request_id):
            return [7, 7]

    def fake_init(self, vllm_config, *args, **kwargs):
        self.use_v2_model_runner = True
        self.kv_cache_config = NS(kv_cache_groups=[object(), object()])
        self.kv_cache_manager = Manager()

    def scheduler_answer() -> list[int]:
        scheduler = Scheduler.__new__(Scheduler)
        Scheduler.__init__(scheduler, NS(speculative_config=None))
        return scheduler.kv_cache_manager.get_num_common_prefix_blocks("req-0")

    monkeypatch.setattr(Scheduler, "__init__", fake_init)
    bench_e2e.apply_run_variants(plain, engine_process=False)
    assert scheduler_answer() == [7, 7]
    with pytest.raises(ValueError, match="--engine-process"):
        bench_e2e.apply_run_variants(chain, engine_process=True)
    bench_e2e.apply_run_variants(chain, engine_process=False)
    assert scheduler_answer() == [0, 0]
    with pytest.raises(SystemExit):
        parse_args(["--runs", chain.name, "--engine-process"])
    assert "drop --engine-process" in capsys.readouterr().err


def test_parse_args_defaults_quick_and_errors(capsys):
    args = parse_args([])
    assert args.setups == ["trained", "kimi64", "kimi8"]
    assert args.contexts == [1024, 16384, 65536, 131072] and args.batches == [1, 8]
    names = [r.name for r in args.run_specs]
    assert names == ["ar@FLASH_ATTN_MLA", "ar@TRITON_MLA", "ar@CUSTOM",
                     "dflash@FLASH_ATTN_MLA", "dflash@TRITON_MLA",
                     "ddtree-16", "ddtree-32", "ddtree-64", "ddtree-128"]

    quick = parse_args(["--quick"])
    assert quick.setups == ["kimi64"] and quick.contexts == [1024, 32768]
    assert quick.batches == [1]
    assert [r.name for r in quick.run_specs] == bench_e2e.QUICK["runs"]
    custom = parse_args(["--quick", "--setup", "trained", "--contexts", "2k", "512",
                         "--budgets", "8"])
    assert custom.setups == ["trained"] and custom.contexts == [512, 2048]
    assert [r.name for r in custom.run_specs][-1] == "ddtree-8"

    for bad in (["--runs", "nope"], ["--contexts", "12x"], ["--max-tokens", "1"],
                ["--runs", "ddtree-auto", "--auto-max", "0"]):
        with pytest.raises(SystemExit):
            parse_args(bad)
    assert "--auto-max must be in 1..512" in capsys.readouterr().err


def test_auto_runs_take_the_largest_budget_of_the_grid():
    names = [r.name for r in parse_args(["--budgets", "16", "auto", "32"]).run_specs]
    assert names[-3:] == ["ddtree-16", "ddtree-auto-32", "ddtree-32"]
    names = [r.name for r in parse_args(["--methods", "ddtree", "--budgets", "auto"]).run_specs]
    assert names == ["ddtree-auto-64"]
    runs = parse_args(["--runs", "ddtree-48", "ddtree-auto", "ar@TRITON_MLA"]).run_specs
    assert [r.name for r in runs] == ["ddtree-48", "ddtree-auto-48", "ar@TRITON_MLA"]
    runs = parse_args(["--runs", "ddtree-auto", "--auto-max", "96"]).run_specs
    assert runs[0].name == "ddtree-auto-96"
    assert runs[0].num_spec_tokens(e2e_models.SETUPS["kimi64"]) == 96
    assert parse_args(["--runs", "ddtree-auto-8"]).run_specs[0].auto_max == 8
    base = bench_e2e.base_row("kimi64", runs[0], (1024, 1, "random"), 16)
    row = bench_e2e.fake_row(base, 96)
    assert row["budget"] == "auto" and row["active_nodes_per_round"] == 48
    assert "active_nodes_per_round" not in bench_e2e.fake_row(
        bench_e2e.base_row("kimi64", RunSpec.parse("ddtree-96"), (1024, 1, "random"), 16), 96)


def test_plan_cells_skips_what_cannot_run():
    trained, kimi = e2e_models.SETUPS["trained"], e2e_models.SETUPS["kimi8"]
    runs = [RunSpec.parse("ddtree-128")]
    margin = bench_e2e.sequence_margin(runs, trained)
    cells, skipped = bench_e2e.plan_cells(trained, [1024, 16384], [1, 8], ["code", "random"],
                                          128, margin)
    assert cells == [(1024, 1, "code"), (1024, 8, "code"), (1024, 1, "random"),
                     (1024, 8, "random")]
    assert {s[0] for s in skipped} == {16384}
    assert all("max_position_embeddings (4096)" in s[3] for s in skipped)
    cells, skipped = bench_e2e.plan_cells(kimi, [131072], [8], ["code", "random"], 128, margin)
    assert cells == [(131072, 8, "random")] and "no tokenizer" in skipped[0][3]


def test_llm_kwargs_for_each_method():
    spec = {"setup": "kimi64", "run": "ddtree-128", "target": "/t", "drafter": "/d",
            "max_model_len": 140000, "max_num_seqs": 8, "gpu_mem": 0.85, "eager": False,
            "prime": "cache", "llm_kwargs": {}}
    kw = bench_e2e.llm_kwargs(spec)
    assert "attention_backend" not in kw and kw["load_format"] == "dummy"
    assert kw["speculative_config"]["method"] == "ddtree" and kw["enable_prefix_caching"]
    # 8 x (1 + 128) = 1032 verify tokens: graphs must be captured past vLLM's 512 default
    assert kw["compilation_config"]["max_cudagraph_capture_size"] == 1040
    kw = bench_e2e.llm_kwargs(dict(spec, run="ar@TRITON_MLA", prime="none",
                                   llm_kwargs={"compilation_config": {"mode": 0}}))
    assert kw["attention_backend"] == "TRITON_MLA" and kw["speculative_config"] is None
    assert kw["compilation_config"] == {"mode": 0} and not kw["enable_prefix_caching"]
    kw = bench_e2e.llm_kwargs(dict(spec, setup="trained", run="dflash@FLASH_ATTN_MLA",
                                   eager=True))
    assert "load_format" not in kw and kw["enforce_eager"]
    assert kw["speculative_config"]["num_speculative_tokens"] == 15
    assert "compilation_config" not in kw


# ---------------------------------------------------------------------------------------
# Prompts


def test_random_prompts_have_exact_lengths_and_range():
    prompts = e2e_models.random_prompts(3, 777, (1000, 163584), seed=5)
    assert [len(p) for p in prompts] == [777] * 3
    assert min(min(p) for p in prompts) >= 1000 and max(max(p) for p in prompts) < 163584
    assert prompts != e2e_models.random_prompts(3, 777, (1000, 163584), seed=6)
    assert prompts == e2e_models.random_prompts(3, 777, (1000, 163584), seed=5)
    assert e2e_models.cell_seed(1024, 1) != e2e_models.cell_seed(1024, 8)


def test_code_prompts_are_disjoint_slices_of_stdlib_source():
    tokenizer = e2e_models.load_tokenizer(e2e_models.CHECKPOINTS / "target" / "tokenizer.json")
    setup = e2e_models.SETUPS["trained"]
    prompts = e2e_models.make_prompts("code", 8, 1000, setup, tokenizer)
    assert [len(p) for p in prompts] == [1000] * 8
    assert len({tuple(p) for p in prompts}) == 8
    text = tokenizer.decode(prompts[0])
    assert "argparse" in text or "import" in text
    assert [len(p) for p in e2e_models.make_prompts("random", 2, 33, setup)] == [33, 33]
    with pytest.raises(ValueError, match="tokenizer"):
        e2e_models.make_prompts("code", 1, 10, e2e_models.SETUPS["kimi8"])


def test_prompt_sets_are_the_next_disjoint_slices(capsys):
    """``code@k``: the k-th set of ``batch`` slices (``code`` = ``code@0``), so batch-1
    cells can run on several prompts; ``random@k`` another seed."""
    tokenizer = e2e_models.load_tokenizer(e2e_models.CHECKPOINTS / "target" / "tokenizer.json")
    setup = e2e_models.SETUPS["trained"]
    eight = e2e_models.code_prompts(tokenizer, 8, 300)
    assert e2e_models.make_prompts("code@0", 1, 300, setup, tokenizer) == eight[:1]
    assert e2e_models.make_prompts("code@3", 1, 300, setup, tokenizer) == eight[3:4]
    assert e2e_models.make_prompts("code@1", 2, 300, setup, tokenizer) == eight[2:4]
    first = e2e_models.make_prompts("random", 2, 40, setup, seed=5)
    assert e2e_models.make_prompts("random@0", 2, 40, setup, seed=5) == first
    assert e2e_models.make_prompts("random@1", 2, 40, setup, seed=5) != first
    assert e2e_models.parse_prompt_kind("code@12") == ("code", 12)
    for bad, why in (("prose", "unknown prompt kind"), ("code@x", "integer"),
                     ("code@-1", "integer")):
        with pytest.raises(ValueError, match=why):
            e2e_models.parse_prompt_kind(bad)
    assert parse_args(["--prompts", "code", "code@1"]).prompts == ["code", "code@1"]
    with pytest.raises(SystemExit):
        parse_args(["--prompts", "code@one"])
    assert "the set after '@' must be an integer" in capsys.readouterr().err
    kimi = e2e_models.SETUPS["kimi8"]
    _, skipped = bench_e2e.plan_cells(kimi, [1024], [1], ["code@2"], 64, 32)
    assert skipped and "no tokenizer" in skipped[0][3]


# ---------------------------------------------------------------------------------------
# Step split


def _step(decode, start, end, verify, sample_tokens=0.0, draft=0.0, compact=0.0, tokens=1):
    return {"decode": decode, "tokens": tokens, "start": start, "end": end,
            "verify": verify, "sample_tokens": sample_tokens, "draft": draft,
            "compact": compact}


def test_summarize_steps_split_adds_up():
    steps = [_step(False, 0.0, 50.0, 45.0, 5.0, 2.0, tokens=4096),
             _step(True, 51.0, 55.0, 2.0, 1.5, 1.0, 0.1),
             _step(True, 56.0, 60.5, 2.5, 1.5, 1.0, 0.1),
             _step(True, 61.0, 65.0, 2.0, 1.8, 1.2, 0.1)]
    s = e2e_timing.summarize_steps(steps)
    assert s["steps"] == 3 and s["decode_ms"] == pytest.approx(14.0)
    assert s["step_ms"] == pytest.approx(14.0 / 3)
    assert s["draft_ms"] + s["verify_ms"] + s["other_ms"] == pytest.approx(s["step_ms"])
    assert s["verify_ms"] == pytest.approx(6.5 / 3) and s["draft_ms"] == pytest.approx(3.2 / 3)
    assert s["sample_ms"] == pytest.approx((4.8 - 3.2) / 3)
    assert s["compact_ms"] == pytest.approx(0.1)
    assert s["step_ms_median"] == pytest.approx(5.0) and s["step_ms_max"] == pytest.approx(5.0)
    assert (s["prefill_steps"], s["prefill_tokens"]) == (1, 4096)
    assert e2e_timing.summarize_steps([steps[0]]) is None
    split = e2e_timing.split_step(10.0, 4, 1.0, 0.75)
    assert split["other_ms"] == pytest.approx(0.75)


def test_cell_row_acceptance_and_throughput():
    base = {"setup": "trained", "run": "ddtree-32", "method": "ddtree", "backend": "CUSTOM",
            "budget": 32, "context": 1024, "batch": 2, "kind": "code", "max_tokens": 65}
    summary = e2e_timing.split_step(40.0, 20, 0.5, 1.0) | {
        "sample_ms": 0.2, "compact_ms": 0.1, "step_ms_median": 2.0, "step_ms_max": 2.5,
        "prefill_steps": 1, "prefill_tokens": 128}
    counters = {"vllm:spec_decode_num_drafts": 40.0,
                "vllm:spec_decode_num_accepted_tokens": 88.0,
                "vllm:spec_decode_num_draft_tokens": 40.0 * 32}
    row = bench_e2e.cell_row(base, summary, counters, wall_s=0.05, produced=[65, 65])
    assert row["status"] == "ok" and row["note"] == ""
    assert row["acceptance_length"] == pytest.approx(3.2)
    assert row["accepted_depth"] == pytest.approx(2.2)
    assert row["rounds_per_request"] == pytest.approx(20.0)
    assert row["tokens_per_s"] == pytest.approx(2 * 64 / 0.040)
    assert row["draft_ms"] + row["verify_ms"] + row["other_ms"] == pytest.approx(row["step_ms"])

    ar = dict(base, run="ar@CUSTOM", method="ar", budget=None)
    row = bench_e2e.cell_row(ar, None, {}, wall_s=0.128, produced=[65, 60])
    assert row["acceptance_length"] == 1.0 and row["step_ms"] == pytest.approx(2.0)
    assert "no runner events" in row["note"] and "produced" in row["note"]
    missed = dict(summary, prefill_tokens=2048, step_ms_max=50.0)
    note = bench_e2e.cell_row(base, missed, counters, wall_s=0.05)["note"]
    assert "prefix cache missed" in note and "slowest step" in note


# ---------------------------------------------------------------------------------------
# Runner hooks on fake vLLM classes


class FakeEvent:
    clock = [0.0]

    def __init__(self):
        FakeEvent.clock[0] += 1.0
        self.t = FakeEvent.clock[0]

    def elapsed_time(self, other):
        return other.t - self.t


class FakeSchedulerOutput:
    def __init__(self, new, computed):
        self.scheduled_new_reqs = ["r0"] if new else []
        self.num_scheduled_tokens = {f"r{i}": 1 for i in range(len(computed))}
        self.total_num_scheduled_tokens = len(computed)
        self.scheduled_cached_reqs = type("C", (), {
            "req_ids": [f"r{i}" for i in range(len(computed))],
            "num_computed_tokens": computed})()


class FakeRunner:
    def __init__(self, speculator):
        self.speculator = speculator

    def execute_model(self, scheduler_output, intermediate_tensors=None, dummy_run=False):
        return None

    def sample_tokens(self, grammar_output):
        if self.speculator is not None:
            self.speculator.propose(None, dummy_run=False)


class FakeChain:
    def propose(self, input_batch, dummy_run=False):
        return "chain"


class FakeTree(FakeChain):
    def propose(self, input_batch, dummy_run=False):
        self._compact_target_kv()
        return super().propose(input_batch, dummy_run=dummy_run)

    def _compact_target_kv(self):
        pass


def test_step_timer_hooks_count_nested_propose_once():
    ticks = iter(range(10**6))  # host clock: one second per call
    timer = e2e_timing.StepTimer(event_factory=FakeEvent, capturing=lambda: False,
                                 synchronize=lambda: None, clock=lambda: float(next(ticks)))
    timer.wrap_step(FakeRunner, "execute_model")
    timer.wrap_span(FakeRunner, "sample_tokens", e2e_timing.SAMPLE_TOKENS)
    timer.wrap_span(FakeChain, "propose", e2e_timing.DRAFT)
    timer.wrap_span(FakeTree, "propose", e2e_timing.DRAFT)
    timer.wrap_span(FakeTree, "_compact_target_kv", e2e_timing.COMPACT)
    timer.wrap_span(FakeTree, "propose", e2e_timing.DRAFT)  # idempotent
    assert len(timer.installed) == 5

    runner = FakeRunner(FakeTree())
    runner.execute_model(FakeSchedulerOutput(True, [0]))  # inactive: nothing recorded
    runner.sample_tokens(None)
    timer.begin(prompt_len=100)
    runner.execute_model(FakeSchedulerOutput(False, [100]), dummy_run=True)  # skipped
    runner.execute_model(FakeSchedulerOutput(True, [0]))  # prefill step
    runner.sample_tokens(None)
    for _ in range(3):
        runner.execute_model(FakeSchedulerOutput(False, [100, 120]))
        runner.sample_tokens(None)
    assert runner.speculator.propose(None, dummy_run=True) == "chain"  # outside a step
    steps = timer.end()
    assert [s["decode"] for s in steps] == [False, True, True, True]
    for s in steps:
        # events: exec start/end (2), sample start (1), draft start (1), compact (2),
        # draft end, sample end: one draft span of 4 ticks holding a 1-tick compact span
        assert s["verify"] == 1.0 and s["draft"] == 3.0 and s["compact"] == 1.0
        assert s["sample_tokens"] == 5.0 and s["end"] - s["start"] == 7.0
    summary = e2e_timing.summarize_steps(steps)
    assert summary["steps"] == 3 and summary["sample_ms"] == pytest.approx(2.0)
    # Host clock reads per step: execute_model 2 (1 s apart), sample_tokens 2 around
    # propose 2 around compact 2 (the nested propose / compact read their own): propose
    # spans 3 ticks (start, compact's 2, end), execute_model 1 tick.
    for s in steps:
        assert s["host_verify"] == 1000.0 and s["host_draft"] == 3000.0
    assert summary["host_draft_ms"] == 3000.0 and summary["host_verify_ms"] == 1000.0
    assert FakeTree.propose.__wrapped__ is not None


def test_is_decode_step_rules():
    so = FakeSchedulerOutput(False, [1024, 1030])
    assert e2e_timing.is_decode_step(so, 1024)
    assert not e2e_timing.is_decode_step(FakeSchedulerOutput(False, [1024, 512]), 1024)
    assert not e2e_timing.is_decode_step(FakeSchedulerOutput(True, [1024]), 1024)
    so.scheduled_spec_decode_tokens = {"r0": [5, 6], "r1": [7, 8]}
    so.num_scheduled_tokens = {"r0": 3, "r1": 3}
    assert e2e_timing.is_decode_step(so, None)
    so.num_scheduled_tokens = {"r0": 3, "r1": 64}
    assert not e2e_timing.is_decode_step(so, None)


# ---------------------------------------------------------------------------------------
# Writer and plumbing


def _synthetic_store(setup: str) -> dict:
    rows = []
    for run in ("ar@FLASH_ATTN_MLA", "dflash@FLASH_ATTN_MLA", "ddtree-64"):
        spec = RunSpec.parse(run)
        for context in (1024, 131072):
            base = bench_e2e.base_row(setup, spec, (context, 1, "random"), 128)
            rows.append(bench_e2e.fake_row(base, spec.num_spec_tokens(
                e2e_models.SETUPS[setup])))
    base = bench_e2e.base_row(setup, RunSpec.parse("ddtree-64"), (65536, 1, "random"), 128)
    rows.append(dict(base, status="failed", note="out of memory"))
    return {"setup": setup, "setup_title": "t", "setup_description": "d",
            "invocations": [{"command": "python evals/bench_e2e.py", "gpu": "NVIDIA H200",
                             "versions": {"vllm": "0.26.0"}, "max_tokens": 128,
                             "graphs": True, "prime": "cache", "temperature": 0.0}],
            "rows": rows}


def test_from_json_writes_markdown_and_png(tmp_path):
    path = tmp_path / "e2e_kimi64.json"
    path.write_text(json.dumps(_synthetic_store("kimi64")))
    out = tmp_path / "out"
    assert bench_e2e.main(["--from-json", str(path), "--out-dir", str(out)]) == 0
    md = (out / "e2e_kimi64.md").read_text()
    assert (out / "e2e_kimi64.png").stat().st_size > 10_000
    assert "against `anchors.md`" in md and "1.86" in md  # vLLM's own anchor figure
    assert "| DDTree B=64 | 64k | 1 | random |" in md and "out of memory" in md
    assert "x1." in md or "x2." in md  # generated reading of the growth
    table = [line for line in md.splitlines() if line.startswith("| DFlash chain, FA-MLA | 128k")]
    cells = table[0].split(" | ")
    step, draft, verify, other = (float(cells[i]) for i in (6, 10, 11, 12))
    assert draft + verify + other == pytest.approx(step, abs=0.02)


def test_merge_keeps_measured_rows():
    ok = {"run": "a", "context": 1, "batch": 1, "kind": "random", "status": "ok", "x": 1}
    not_run = dict(ok, status="not run", x=2)
    failed = dict(ok, status="failed", x=3)
    assert bench_e2e.merge_rows([ok], [not_run]) == [ok]
    assert bench_e2e.merge_rows([ok], [failed]) == [failed]
    assert len(bench_e2e.merge_rows([ok], [dict(ok, batch=8)])) == 2


def test_fake_children_end_to_end(tmp_path, monkeypatch):
    """The parent plans, spawns one child per run (``--fake``: synthetic figures),
    merges and renders; later invocations merge into the same JSON; a child that dies
    keeps the rows it wrote and the others name its error; a spent --max-minutes starts
    no child."""
    common = ["--fake", "--batches", "1", "--out-dir", str(tmp_path), "--model-dir",
              str(tmp_path / "models")]
    assert bench_e2e.main(common + ["--setup", "kimi8", "trained", "--contexts", "1k", "128k",
                                    "--runs", "ddtree-32"]) == 0
    trained = json.loads((tmp_path / "e2e_trained.json").read_text())
    status = {(r["run"], r["context"], r["kind"]): r["status"] for r in trained["rows"]}
    assert status[("ddtree-32", 1024, "code")] == "ok"
    assert status[("ddtree-32", 131072, "random")] == "skipped"

    monkeypatch.setenv("BENCH_E2E_FAKE_CRASH_AFTER", "1")
    assert bench_e2e.main(common + ["--setup", "kimi8", "--contexts", "1k", "16k",
                                    "--runs", "ar@FLASH_ATTN_MLA"]) == 0
    monkeypatch.delenv("BENCH_E2E_FAKE_CRASH_AFTER")
    assert bench_e2e.main(common + ["--setup", "kimi8", "--contexts", "1k", "--runs",
                                    "ar@CUSTOM", "--max-minutes", "0.001"]) == 0
    kimi = json.loads((tmp_path / "e2e_kimi8.json").read_text())
    assert len(kimi["invocations"]) == 3
    status = {(r["run"], r["context"]): (r["status"], r.get("note", "")) for r in kimi["rows"]}
    assert {k: v[0] for k, v in status.items()} == {
        ("ddtree-32", 1024): "ok", ("ddtree-32", 131072): "ok",
        ("ar@FLASH_ATTN_MLA", 1024): "ok", ("ar@FLASH_ATTN_MLA", 16384): "failed",
        ("ar@CUSTOM", 1024): "not run"}
    note = status[("ar@FLASH_ATTN_MLA", 16384)][1]
    assert "child exited 1" in note and "fake crash" in note
    md = (tmp_path / "e2e_kimi8.md").read_text()
    assert "x AR" in md and "fake crash" in md
    for name in ("e2e_kimi8.png", "e2e_trained.md", "e2e_kimi8.log"):
        assert (tmp_path / name).exists()


LOCKSTEP_RUNS = ["ar@FLASH_ATTN_MLA", "ddtree-64", "ddtree-auto"]


def _lockstep(tmp_path, *extra):
    """``--lockstep --fake`` on kimi8, 2 contexts, batch 1, :data:`LOCKSTEP_RUNS`,
    2 repeats; returns the result JSON."""
    assert bench_e2e.main(["--fake", "--lockstep", "--setup", "kimi8", "--batches", "1",
                           "--contexts", "1k", "16k", "--runs", *LOCKSTEP_RUNS,
                           "--repeats", "2", "--out-dir", str(tmp_path), "--model-dir",
                           str(tmp_path / "models"), *extra]) == 0
    return json.loads((tmp_path / "e2e_kimi8.json").read_text())


def test_lockstep_order_alternates_runs_per_round_within_each_cell():
    runs = [RunSpec.parse(r) for r in ("ar@CUSTOM", "ddtree-32", "ddtree-64")]
    cells = [(1024, 1, "random"), (16384, 1, "random")]
    order = [(c[0], r, run.name) for c, r, run in bench_e2e.lockstep_order(cells, runs, 2)]
    assert order == [(1024, 0, "ar@CUSTOM"), (1024, 0, "ddtree-32"), (1024, 0, "ddtree-64"),
                     (1024, 1, "ddtree-64"), (1024, 1, "ddtree-32"), (1024, 1, "ar@CUSTOM"),
                     (16384, 0, "ar@CUSTOM"), (16384, 0, "ddtree-32"),
                     (16384, 0, "ddtree-64"), (16384, 1, "ddtree-64"),
                     (16384, 1, "ddtree-32"), (16384, 1, "ar@CUSTOM")]


def test_lockstep_measures_each_cell_by_every_run_in_turn(tmp_path):
    """``--lockstep``: one child per run, all alive at once; each cell is measured by
    every run before the next cell, round 1 in the reverse order of round 0, one child
    at a time (a child's measurement starts after the previous child's row came); every
    (run, cell, repeat) is an ok row; the invocation and the report say lockstep."""
    data = _lockstep(tmp_path)
    rows = data["rows"]
    names = [r.name for r in parse_args(["--runs", *LOCKSTEP_RUNS]).run_specs]
    assert len(rows) == 2 * 2 * len(names)
    assert all(r["status"] == "ok" for r in rows)
    assert sorted((r["run"], r["context"], r["repeat"]) for r in rows) == sorted(
        (n, c, rep) for n in names for c in (1024, 16384) for rep in (0, 1))
    by_time = sorted(rows, key=lambda r: r["measure_start"])
    assert [r["measured_seq"] for r in by_time] == list(range(len(rows)))
    for before, after in zip(by_time[:-1], by_time[1:], strict=True):  # one at a time
        assert after["measure_start"] >= before["measured_at"]
    assert [(r["context"], r["repeat"], r["run"]) for r in by_time] == [
        (c, rep, n) for c in (1024, 16384) for rep in (0, 1)
        for n in (names if rep == 0 else names[::-1])]
    inv = data["invocations"][-1]
    assert inv["lockstep"] is True
    setup = e2e_models.SETUPS["kimi8"]
    models = e2e_models.prepare_setup(setup, tmp_path / "models")
    margin = bench_e2e.sequence_margin(parse_args(["--runs", *LOCKSTEP_RUNS]).run_specs, setup)
    kv = e2e_models.kv_cache_bytes(e2e_models.read_config(models.target),
                                   e2e_models.read_config(models.drafter),
                                   16384 + 128 + margin, 1)["total"]
    assert inv["lockstep_kv_cache_gib"] == round((3 * kv + 2**30) / 2**30, 2)
    assert set(inv["startup_s"]) == set(names)
    md = (tmp_path / "e2e_kimi8.md").read_text()
    assert "engines were alive at once on the GPU" in md
    assert "measured by every run in turn" in md
    log = (tmp_path / "e2e_kimi8.log").read_text()
    assert all(f"kimi8 {n} (lockstep)" in log for n in names)
    assert not list(tmp_path.glob("*.lockstep*.log"))  # merged into the setup's log


def test_lockstep_child_that_dies_fails_only_its_remaining_cells(tmp_path, monkeypatch):
    """A lockstep child that crashes on its second command: its later (cell, repeat)s
    are failed rows naming the crash, the other runs measure every cell; a spent
    --max-minutes starts no child (not-run rows)."""
    monkeypatch.setenv("BENCH_E2E_FAKE_CRASH_RUN", "ddtree-64")
    monkeypatch.setenv("BENCH_E2E_FAKE_CRASH_AFTER", "1")
    data = _lockstep(tmp_path)
    status = {(r["run"], r["context"], r["repeat"]): (r["status"], r.get("note", ""))
              for r in data["rows"]}
    assert len(status) == 12
    crashed = {k: v for k, v in status.items() if k[0] == "ddtree-64"}
    assert crashed.pop(("ddtree-64", 1024, 0))[0] == "ok"
    assert len(crashed) == 3
    for state, note in crashed.values():
        assert state == "failed" and "child exited 1" in note and "fake crash" in note
    assert all(v[0] == "ok" for k, v in status.items() if k[0] != "ddtree-64")

    monkeypatch.delenv("BENCH_E2E_FAKE_CRASH_RUN")
    monkeypatch.delenv("BENCH_E2E_FAKE_CRASH_AFTER")
    data = _lockstep(tmp_path / "late", "--max-minutes", "0.001")
    assert {r["status"] for r in data["rows"]} == {"not run"} and len(data["rows"]) == 12
    assert "startup_s" not in data["invocations"][-1]


def test_lockstep_fixes_every_engines_kv_cache(tmp_path, capsys):
    """The lockstep spec carries kv_cache_memory_bytes (3 x the largest cell's KV cache
    + 1 GiB, or --lockstep-kv-gib) into LLM(...) with a low gpu_memory_utilization;
    the sequential spec carries neither."""
    args = parse_args(["--setup", "kimi8", "--contexts", "128k", "--batches", "1", "8",
                       "--runs", "ddtree-64", "--lockstep"])
    setup, run = e2e_models.SETUPS["kimi8"], args.run_specs[0]
    models = e2e_models.prepare_setup(setup, tmp_path, min_positions=140000)
    cells = [(131072, 1, "random"), (131072, 8, "random")]
    kv = bench_e2e.lockstep_kv_bytes(models, 132000, 8)
    total = e2e_models.kv_cache_bytes(e2e_models.read_config(models.target),
                                      e2e_models.read_config(models.drafter), 132000,
                                      8)["total"]
    assert kv == 3 * total + 2**30
    assert bench_e2e.lockstep_kv_bytes(models, 132000, 8, 2.5) == int(2.5 * 2**30)
    kw = bench_e2e.llm_kwargs(bench_e2e.child_spec(setup, args, run, cells, models, 132000,
                                                   None, kv_bytes=kv))
    assert kw["kv_cache_memory_bytes"] == kv and kw["gpu_memory_utilization"] == 0.05
    assert kw["max_num_seqs"] == 8 and kw["max_model_len"] == 132000
    kw = bench_e2e.llm_kwargs(bench_e2e.child_spec(setup, args, run, cells, models, 132000,
                                                   None))
    assert "kv_cache_memory_bytes" not in kw and kw["gpu_memory_utilization"] == 0.85
    assert parse_args(["--lockstep", "--lockstep-kv-gib", "6"]).lockstep_kv_gib == 6.0
    with pytest.raises(SystemExit):
        parse_args(["--lockstep-kv-gib", "6"])
    assert "--lockstep-kv-gib needs --lockstep" in capsys.readouterr().err


class FakeMode:
    def __init__(self, name):
        self.name = name


class FakeDesc:
    def __init__(self, mode):
        self.cg_mode = FakeMode(mode)


class FakeManagerBase:
    modes = iter(())

    def dispatch(self, num_reqs, num_tokens, uniform_token_count, num_active_loras=0):
        return FakeDesc(next(FakeManagerBase.modes))


class FakeTargetManager(FakeManagerBase):
    pass


class FakeDrafterManager(FakeManagerBase):
    pass


class GraphRunner(FakeRunner):
    def __init__(self, speculator):
        super().__init__(speculator)
        self.cudagraph_manager = FakeTargetManager()

    def execute_model(self, scheduler_output, intermediate_tensors=None, dummy_run=False):
        self.cudagraph_manager.dispatch(1, 9, 9)

    def sample_tokens(self, grammar_output):
        self.speculator.propose(None, dummy_run=False)


class GraphChain(FakeChain):
    manager = FakeDrafterManager()

    def propose(self, input_batch, dummy_run=False):
        self.manager.dispatch(1, 16, 16)
        return "chain"


def test_step_timer_counts_full_graph_steps_and_keeps_later_base_patches():
    timer = e2e_timing.StepTimer(event_factory=FakeEvent, capturing=lambda: False,
                                 synchronize=lambda: None)
    timer.wrap_step(GraphRunner, "execute_model")
    timer.wrap_span(GraphRunner, "sample_tokens", e2e_timing.SAMPLE_TOKENS)
    timer.wrap_span(GraphChain, "propose", e2e_timing.DRAFT)
    timer.wrap_dispatch(FakeTargetManager, e2e_timing.VERIFY)
    timer.wrap_dispatch(FakeDrafterManager, e2e_timing.DRAFT)
    timer.wrap_dispatch(FakeDrafterManager, e2e_timing.DRAFT)  # idempotent
    with pytest.raises(TypeError, match="defines dispatch itself"):
        timer.wrap_dispatch(FakeManagerBase, e2e_timing.VERIFY)
    # A patch of the base class after the timer was installed (as the plugin's
    # verify_shapes patch is) must still decide the mode: FULL for every 9-row verify.
    original = FakeManagerBase.dispatch

    def patched(self, num_reqs, num_tokens, uniform_token_count, num_active_loras=0):
        desc = original(self, num_reqs, num_tokens, uniform_token_count, num_active_loras)
        return FakeDesc("FULL") if num_tokens == 9 else desc

    FakeManagerBase.dispatch = patched
    try:
        # per step: verify dispatch (overridden to FULL by the patch), draft dispatch
        FakeManagerBase.modes = iter(["PIECEWISE", "FULL", "NONE", "FULL", "NONE", "NONE"])
        runner = GraphRunner(GraphChain())
        timer.begin(prompt_len=100)
        for _ in range(3):
            runner.execute_model(FakeSchedulerOutput(False, [100]))
            runner.sample_tokens(None)
        steps = timer.end()
    finally:
        FakeManagerBase.dispatch = original
    assert [s["graphs"] for s in steps] == [
        {"verify": ["FULL"], "draft": ["FULL"]},
        {"verify": ["FULL"], "draft": ["FULL"]},
        {"verify": ["FULL"], "draft": ["NONE"]},
    ]
    summary = e2e_timing.summarize_steps(steps)
    assert summary["full_graph_steps"] == {"verify": [3, 3], "draft": [2, 3]}
    row = {"full_graph_steps": summary["full_graph_steps"]}
    assert e2e_report._graph_steps(row) == "3/3 / 2/3"
    assert e2e_report._graph_steps({}) == "—"
    base = {"method": "ddtree", "batch": 1, "max_tokens": 4, "context": 1024}
    note = bench_e2e.cell_row(base, summary, {}, wall_s=0.01)["note"]
    assert "1 of 3 decode steps ran the draft forward outside a FULL CUDA graph" in note
    assert "verify forward" not in note


def test_vllm_internals_the_timer_relies_on():
    """Read (without importing vLLM) the 0.26 sources whose call order the step split
    assumes: execute_model(scheduler_output, ..., dummy_run) runs the target forward;
    sample_tokens samples / verifies, then calls speculator.propose; the engine core
    calls execute_model then sample_tokens for each step."""
    import ast
    import importlib.util

    root = Path(importlib.util.find_spec("vllm").submodule_search_locations[0])

    def functions(path: Path, cls: str) -> dict:
        tree = ast.parse(path.read_text())
        node = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls)
        return {f.name: f for f in node.body if isinstance(f, ast.FunctionDef)}

    def params(fn) -> list[str]:
        return [a.arg for a in fn.args.args + fn.args.kwonlyargs]

    runner_src = root / "v1/worker/gpu/model_runner.py"
    runner = functions(runner_src, "GPUModelRunner")
    assert params(runner["execute_model"])[:2] == ["self", "scheduler_output"]
    assert "dummy_run" in params(runner["execute_model"])
    body = ast.get_source_segment(runner_src.read_text(), runner["sample_tokens"])
    assert 0 <= body.index("self.sample(") < body.index("self.speculator.propose(")
    dflash = functions(root / "v1/worker/gpu/spec_decode/dflash/speculator.py",
                       "DFlashSpeculator")
    assert "dummy_run" in params(dflash["propose"])
    core = (root / "v1/engine/core.py").read_text()
    step = core[core.index("def step_with_batch_queue"):]
    assert step.index("model_executor.execute_model(") < step.index(
        "model_executor.sample_tokens(")
    output = (root / "v1/core/sched/output.py").read_text()
    assert "num_computed_tokens: list[int]" in output  # CachedRequestData, is_decode_step
    # StepTimer.wrap_dispatch wraps the graph managers' inherited dispatch
    graphs = root / "v1/worker/gpu/cudagraph_utils.py"
    assert "dispatch" in functions(graphs, "CudaGraphManager")
    assert "dispatch" not in functions(graphs, "ModelCudaGraphManager")
    assert "dispatch" not in functions(root / "v1/worker/gpu/spec_decode/dflash/cudagraph.py",
                                       "DFlashCudaGraphManager")


def test_repeats_run_interleaved_and_report_the_median(tmp_path):
    """``--repeats 3``: children start A B B A A B; every cell keeps one row per repeat;
    the tables show the median repeat's figures and a min-max spread table."""
    from e2e_report import collapse_repeats

    runs = [RunSpec.parse("ddtree-32"), RunSpec.parse("ar@CUSTOM")]
    order = [(r, run.name) for r, run in bench_e2e.interleaved(runs, 3)]
    assert order == [(0, "ddtree-32"), (0, "ar@CUSTOM"), (1, "ar@CUSTOM"),
                     (1, "ddtree-32"), (2, "ddtree-32"), (2, "ar@CUSTOM")]
    common = ["--fake", "--batches", "1", "--out-dir", str(tmp_path), "--model-dir",
              str(tmp_path / "models"), "--setup", "kimi8", "--contexts", "1k"]
    assert bench_e2e.main(common + ["--runs", "ddtree-32", "--repeats", "3"]) == 0
    data = json.loads((tmp_path / "e2e_kimi8.json").read_text())
    assert sorted(r["repeat"] for r in data["rows"]) == [0, 1, 2]
    # Three repeats with different step times: the median one is shown.
    for r, step in zip(data["rows"], [5.0, 9.0, 6.0], strict=True):
        r["step_ms"] = step
    (row,) = collapse_repeats(data["rows"])
    assert (row["step_ms"], row["repeats"], row["step_ms_min"], row["step_ms_max"]) == (
        6.0, 3, 5.0, 9.0)
    bench_e2e.render(data, tmp_path / "r.md", tmp_path / "r.png")
    md = (tmp_path / "r.md").read_text()
    assert "6.00 (5.00-9.00, n=3)" in md and (tmp_path / "r.png").exists()
    with pytest.raises(SystemExit):
        parse_args(["--repeats", "0"])


def test_every_child_row_keeps_its_repeat():
    """Measured, skipped and failed rows of a child all start from ``spec_base_row``, so
    the parent finds repeat N's rows under repeat N (the measured path once dropped the
    repeat and every repeat after the first read as a failed child)."""
    spec = {"setup": "kimi8", "run": "ddtree-64", "max_tokens": 128, "repeat": 2}
    cell = (1024, 1, "random")
    row = bench_e2e.spec_base_row(spec, cell)
    assert row["repeat"] == 2
    assert bench_e2e.row_key(row) == bench_e2e.row_key(
        bench_e2e.base_row("kimi8", RunSpec.parse("ddtree-64"), cell, 128, 2))
    src = inspect.getsource(bench_e2e.measure_cell)
    assert "spec_base_row(spec, cell)" in src and "base_row(spec[" not in src


class FakeState:
    def store_trees_(self):
        HostClock.now += 0.5


class HostClock:
    now = 0.0


class FakeHostChain:
    def propose(self, input_batch, dummy_run=False):
        HostClock.now += 2.0
        return "chain"


class FakeHostTree(FakeHostChain):
    state = FakeState()

    def propose(self, input_batch, dummy_run=False):
        out = super().propose(input_batch, dummy_run=dummy_run)
        self.state.store_trees_()
        return out


class FakeHostRunner(FakeRunner):
    def execute_model(self, scheduler_output, intermediate_tensors=None, dummy_run=False):
        HostClock.now += 1.0

    def sample_tokens(self, grammar_output):
        HostClock.now += 0.25
        self.speculator.propose(None, dummy_run=False)


def test_step_timer_host_regions_split_a_steps_host_time(tmp_path):
    """``wrap_host``: host time of nested calls (vLLM's DFlash propose inside DDTree's,
    the tree scatter) per step, outermost call per label, no events; summarized as
    ``host_regions_ms`` and rendered as the host table."""
    timer = e2e_timing.StepTimer(event_factory=FakeEvent, capturing=lambda: False,
                                 synchronize=lambda: None, clock=lambda: HostClock.now)
    timer.wrap_step(FakeHostRunner, "execute_model")
    timer.wrap_span(FakeHostRunner, "sample_tokens", e2e_timing.SAMPLE_TOKENS)
    timer.wrap_span(FakeHostChain, "propose", e2e_timing.DRAFT)
    timer.wrap_span(FakeHostTree, "propose", e2e_timing.DRAFT)
    timer.wrap_host(FakeHostChain, "propose", e2e_timing.HOST_DFLASH)
    timer.wrap_host(FakeState, "store_trees_", e2e_timing.HOST_STORE)
    timer.wrap_host(FakeState, "store_trees_", e2e_timing.HOST_STORE)  # idempotent
    assert len(timer.installed) == 6

    runner = FakeHostRunner(FakeHostTree())
    timer.begin(prompt_len=100)
    for _ in range(2):
        runner.execute_model(FakeSchedulerOutput(False, [100]))
        runner.sample_tokens(None)
    assert runner.speculator.propose(None, dummy_run=True) == "chain"  # outside a step
    steps = timer.end()
    assert len(steps) == 2
    for s in steps:
        assert s["host_verify"] == 1000.0 and s["host_sample_tokens"] == 2750.0
        assert s["host_draft"] == 2500.0 and s["host_dflash_propose"] == 2000.0
        assert s["host_store_trees"] == 500.0 and s["host_budget"] == 0.0
    regions = e2e_timing.summarize_steps(steps)["host_regions_ms"]
    assert regions["dflash_propose"] == 2000.0 and regions["store_trees"] == 500.0

    row = {"run": "ddtree-64", "method": "ddtree", "budget": 64, "context": 1024,
           "batch": 1, "kind": "random", "status": "ok", "step_ms": 5.0,
           "host_regions_ms": regions}
    lines = e2e_report._host_table([row])
    assert "runner host / step" in lines[4]
    # runner host = execute_model + sample_tokens; empty regions read "—"
    assert "| 3750 | 1000 | 2750 | 2500 | 2000 | — | 500 | — | — | — | — |" in lines[6]
    assert e2e_report._host_table([dict(row, host_regions_ms=None)]) == []
    threaded = e2e_report._host_table([dict(row, engine_threads=["MainThread", "output"])])
    assert "Python threads" in threaded[4] and "| — | 2 |" in threaded[6]
    timed = e2e_report._host_table([dict(row, python_ms=1.234)])
    assert "Python ms (fixed loop" in timed[4] and timed[6].endswith("| 1.23 | — |")
    placed = e2e_report._host_table([dict(row, python_ms=1.234, cpu=5, numa_node=1)])
    assert placed[6].endswith("| 1.23 (cpu 5, node 1) | — |")
    machine = e2e_report._host_table([dict(row, python_ms=1.234, python_ms_after=2.5,
                                           host_steal_pct=12.34, host_busy_pct=20.4,
                                           host_mhz=2100.0)])
    assert "machine steal % / busy % / MHz" in machine[4]
    assert machine[6].endswith("| 1.23 -> 2.50 | 12.3 / 20 / 2100 |")


class GcRunner(FakeRunner):
    def execute_model(self, scheduler_output, intermediate_tensors=None, dummy_run=False):
        gc.collect()


def test_step_timer_counts_gc_pauses_inside_steps_only():
    timer = e2e_timing.StepTimer(event_factory=FakeEvent, capturing=lambda: False,
                                 synchronize=lambda: None)
    timer.wrap_step(GcRunner, "execute_model")
    runner = GcRunner(None)
    timer.begin(prompt_len=100)
    assert timer._on_gc in gc.callbacks
    runner.execute_model(FakeSchedulerOutput(False, [100]))
    gc.collect()  # after the step (output handling): still the last step's
    timer._current = None
    gc.collect()  # outside any step: not counted
    steps = timer.end()
    assert timer._on_gc not in gc.callbacks
    assert steps[0]["host_gc"] > 0.0
    summary = e2e_timing.summarize_steps(steps)
    assert summary["host_regions_ms"]["gc"] == steps[0]["host_gc"]


def test_allocator_calls_during_a_cell_are_reported():
    """Device frees of the caching allocator inside the measured generate synchronize the
    device: the row keeps the counts and notes them."""
    assert e2e_timing.allocator_delta({}, {"num_device_free": 1}) is None
    delta = e2e_timing.allocator_delta(
        {"num_device_alloc": 5, "num_device_free": 1, "num_alloc_retries": 0},
        {"num_device_alloc": 7, "num_device_free": 3, "num_alloc_retries": 1})
    assert delta == {"num_device_alloc": 2, "num_device_free": 2, "num_alloc_retries": 1}
    base = {"setup": "kimi8", "run": "ddtree-64", "method": "ddtree", "backend": "CUSTOM",
            "budget": 64, "context": 1024, "batch": 1, "kind": "random", "max_tokens": 65}
    summary = e2e_timing.split_step(40.0, 20, 0.5, 1.0) | {
        "sample_ms": 0.2, "compact_ms": 0.1, "step_ms_median": 2.0, "step_ms_max": 2.5,
        "prefill_steps": 1, "prefill_tokens": 0}
    row = bench_e2e.cell_row(base, summary, {}, wall_s=0.05, allocator=delta)
    assert row["allocator_calls"] == delta
    assert "freed device memory 2 times and retried 1" in row["note"]
    quiet = dict(delta, num_device_free=0, num_alloc_retries=0)
    assert "allocator" not in bench_e2e.cell_row(base, summary, {}, wall_s=0.05,
                                                 allocator=quiet)["note"]


# ---------------------------------------------------------------------------------------
# Host profile (BENCH_E2E_HOST_PROFILE)


def test_host_profile_reports_per_step_calls_of_a_fake_engine(tmp_path):
    import host_profile  # noqa: E402

    runner_file = tmp_path / "model_runner.py"
    runner_file.write_text(
        "def propose():\n    return sum(range(50))\n\n"
        "def execute_model():\n    propose()\n    propose()\n"
    )
    sys.path.insert(0, str(tmp_path))
    try:
        import model_runner  # the fake runner: 2 propose calls per engine step
    finally:
        sys.path.remove(str(tmp_path))

    class FakeLLM:
        def generate(self, inputs, params, use_tqdm=False):
            for _ in range(params):
                model_runner.execute_model()

    out = host_profile.profile_generate(FakeLLM(), [], 5, tmp_path / "p" / "x.md", "fake")
    text = out.read_text()
    assert text.startswith("# Host profile: fake")
    assert "5 engine steps" in text
    row = next(line for line in text.splitlines() if "model_runner.py:1 propose" in line)
    assert row.split("|")[2].strip() == "2.0"  # calls per step
    assert "## Threads: CPU time" in text and "| thread id |" in text  # psutil is there


def test_python_speed_is_a_positive_median_and_cpus_parse():
    before = e2e_timing.host_cpu_state()
    sum(i * i for i in range(200000))
    delta = e2e_timing.host_cpu_delta(before, e2e_timing.host_cpu_state())
    if delta:  # {} when the clock ticks did not advance (10 ms resolution)
        assert 0 <= delta["steal_pct"] <= 100 and 0 <= delta["busy_pct"] <= 100
    fake = {"times": {"user": 10.0, "system": 0.0, "idle": 10.0, "steal": 0.0}, "mhz": None}
    later = {"times": {"user": 13.0, "system": 1.0, "idle": 14.0, "steal": 2.0}, "mhz": 1800.0}
    assert e2e_timing.host_cpu_delta(fake, later) == {"steal_pct": 20.0, "busy_pct": 40.0,
                                                      "mhz": 1800.0}
    assert e2e_timing.host_cpu_delta(None, later) == {}
    ms = e2e_timing.python_speed_ms(repeats=3, n=2000)
    assert 0 < ms < 1000
    assert bench_e2e.parse_cpus("0-2,5") == {0, 1, 2, 5}
    cpu, node = e2e_timing.current_cpu_and_node()
    assert cpu is None or cpu in os.sched_getaffinity(0)
    assert node is None or node >= 0
    with pytest.raises(Exception, match="pin-cpus"):
        bench_e2e.parse_cpus("a-b")
    with pytest.raises(SystemExit):  # a CPU this machine lacks is refused up front
        parse_args(["--setup", "kimi8", "--pin-cpus", "100000", "--fake"])


def test_host_speed_report_normalises_steps_by_the_profiled_interpreter_speed(tmp_path):
    import host_speed_report

    run_dir = tmp_path / "call1"
    (run_dir / "profiles").mkdir(parents=True)
    rows = [{"run": "ddtree-64", "status": "ok", "step_ms": 4.0, "context": 1024, "batch": 1},
            {"run": "ddtree-64", "status": "ok", "step_ms": 9.0, "context": 131072, "batch": 1},
            {"run": "ddtree-auto-64", "status": "ok", "step_ms": 6.0, "context": 1024,
             "batch": 1}]
    (run_dir / "e2e_trained.json").write_text(json.dumps(
        {"invocations": [{"runs": ["ddtree-64", "ddtree-auto-64"]}], "rows": rows}))
    for name, us in (("ddtree-64", 0.2), ("ddtree-auto-64", 0.3)):
        calls = 200.0
        (run_dir / "profiles" / f"host_profile_{name}.md").write_text(
            f"# Host profile: {name}, trained, context 1024, batch 1\n\n## By own time\n\n"
            f"| `builtin:0 <built-in method builtins.isinstance>` | {calls} | "
            f"{calls * us / 1000:.3f} | 0.1 |\n")
    entries = host_speed_report.collect([run_dir])
    assert [(e["run"], e["order"]) for e in entries] == [("ddtree-64", 1),
                                                          ("ddtree-auto-64", 2)]
    assert [round(e["us_per_call"], 3) for e in entries] == [0.2, 0.3]
    # an --engine-process cell of the same run: its own row and profile are paired
    data = json.loads((run_dir / "e2e_trained.json").read_text())
    data["rows"].append({"run": "ddtree-64", "status": "ok", "step_ms": 3.0,
                         "engine_process": True, "context": 1024, "batch": 1})
    (run_dir / "e2e_trained.json").write_text(json.dumps(data))
    (run_dir / "profiles" / "host_profile_ddtree-64_engine.md").write_text(
        "# Host profile: ddtree-64, trained, context 1024, batch 1 (engine-core process)\n\n"
        "## By own time\n\n| `builtin:0 <built-in method builtins.isinstance>` | 100.0 | "
        "0.015 | 0.1 |\n")
    remote = [e for e in host_speed_report.collect([run_dir]) if "engine" in e["run"]]
    assert [(e["run"], e["step_ms"], round(e["us_per_call"], 3)) for e in remote] == [
        ("ddtree-64 (engine process)", 3.0, 0.15)]
    entries = host_speed_report.collect([run_dir])
    assert [e["step_ms"] for e in entries if e["run"] == "ddtree-64"] == [4.0]
    entries = [e for e in entries if "engine" not in e["run"]]
    host_speed_report.write(entries, tmp_path / "out", "cmd")
    table = (tmp_path / "out.md").read_text()
    assert "| call1 | 2 | ddtree-auto-64 | 1024 | 6.00 | 0.300 | — | 20.0 |" in table
    assert (tmp_path / "out.png").stat().st_size > 0


def test_remote_engine_runs_the_probes_through_collective_rpc(tmp_path, monkeypatch):
    """``--engine-process``: every probe goes through ``llm.collective_rpc(fn, args=...)``
    with the worker first (here a fake that runs it in this process) and rank 0's result
    comes back; the profile is started and stopped there around the generate."""
    import e2e_engine

    calls = []

    class FakeLLM:
        def collective_rpc(self, method, args=()):
            calls.append(method.__name__)
            return [method("worker", *args), "rank 1 ignored"]

        def generate(self, inputs, params, use_tqdm=False):
            calls.append("generate")

    monkeypatch.setattr(e2e_engine, "_TIMER", None)
    monkeypatch.setattr(e2e_timing.StepTimer, "install_vllm", lambda self: self.installed)
    monkeypatch.setattr(e2e_timing.StepTimer, "install_graph_modes", lambda self: None)
    engine = e2e_engine.RemoteEngine(FakeLLM())
    assert engine.remote and engine.hooks == [] and calls == ["engine_install_timer"]
    speed, _cpu, _node = engine.call(e2e_engine.engine_host_speed)
    assert speed > 0
    engine.call(e2e_engine.engine_timer_begin, 128)
    assert e2e_engine._TIMER.active and e2e_engine._TIMER.prompt_len == 128
    assert engine.call(e2e_engine.engine_timer_end) == []  # no step ran
    engine.profile(FakeLLM(), [], None, tmp_path / "p.md", "fake")
    assert calls[-3:] == ["engine_profile_start", "generate", "engine_profile_stop"]
    assert "(engine-core process)" in (tmp_path / "p.md").read_text()
    local = e2e_engine.LocalEngine()  # the in-process default: the same functions, direct
    assert not local.remote and local.call(e2e_engine.engine_active_counters) is None


def test_engine_process_rows_sit_beside_the_in_process_ones(tmp_path):
    """The same run measured in-process and with ``--engine-process`` keeps two rows
    (merge key), two table lines and its own AR reference."""
    common = ["--fake", "--batches", "1", "--out-dir", str(tmp_path), "--model-dir",
              str(tmp_path / "models"), "--setup", "kimi8", "--contexts", "1k",
              "--runs", "ar@FLASH_ATTN_MLA", "ddtree-64"]
    assert bench_e2e.main(common) == 0
    assert bench_e2e.main(common + ["--engine-process"]) == 0
    data = json.loads((tmp_path / "e2e_kimi8.json").read_text())
    keys = sorted((r["run"], bool(r.get("engine_process"))) for r in data["rows"])
    assert keys == [("ar@FLASH_ATTN_MLA", False), ("ar@FLASH_ATTN_MLA", True),
                    ("ddtree-64", False), ("ddtree-64", True)]
    assert [bool(i.get("engine_process")) for i in data["invocations"]] == [False, True]
    md = (tmp_path / "e2e_kimi8.md").read_text()
    assert "| DDTree B=64 (engine process) |" in md and "| DDTree B=64 |" in md
    assert "engine core in its own process" in md
    refs = e2e_report.reference_ar(data["rows"])
    assert {k[3] for k in refs} == {False, True}


def test_measure_cell_in_process_reads_the_local_engine(tmp_path, monkeypatch):
    """The default layout end to end on a fake LLM: the cell primes the cache, times the
    measured generate with the local step timer, records the host speed and placement,
    and (with BENCH_E2E_HOST_PROFILE) writes a profile of one more generate."""
    import e2e_engine

    max_tokens, batch = 6, 2

    class FakeLLM:
        generates = 0

        def generate(self, inputs, params, use_tqdm=False):
            FakeLLM.generates += 1
            return [SimpleOutput(params[i].max_tokens) for i in range(len(inputs))]

        def get_metrics(self):
            return []

    class SimpleOutput:
        def __init__(self, n):
            self.outputs = [type("Completion", (), {"token_ids": list(range(n))})()]
            self.num_cached_tokens = 64
            self.metrics = None

    monkeypatch.setattr(e2e_engine, "_TIMER", None)
    monkeypatch.setattr(e2e_timing.StepTimer, "install_vllm", lambda self: self.installed)
    monkeypatch.setattr(e2e_timing.StepTimer, "install_graph_modes", lambda self: None)
    monkeypatch.setenv("BENCH_E2E_HOST_PROFILE", str(tmp_path / "profiles"))
    engine = e2e_engine.LocalEngine()
    spec = {"setup": "kimi8", "run": "ddtree-64", "max_tokens": max_tokens, "prime": "cache",
            "temperature": 0.0, "repeat": 0}
    row = bench_e2e.measure_cell(FakeLLM(), engine, spec, (64, batch, "random"), None)
    assert FakeLLM.generates == 3  # prime, measured, profiled
    assert row["status"] == "ok" and row["tokens"] == batch * (max_tokens - 1)
    assert row["python_ms"] > 0 and row["python_ms_after"] > 0 and "engine_process" not in row
    assert "no runner events" in row["note"]  # the fake LLM ran no runner step
    assert row["output_token_ids"] == [list(range(max_tokens))] * batch
    assert "MainThread" in row["engine_threads"]
    assert (tmp_path / "profiles" / "host_profile_ddtree-64_64x2_random.md").exists()

    class FakeRemoteLLM(FakeLLM):  # --engine-process: the same cell through collective_rpc
        def collective_rpc(self, method, args=()):
            return [method("worker", *args)]

    remote = e2e_engine.RemoteEngine(FakeRemoteLLM())
    row = bench_e2e.measure_cell(FakeRemoteLLM(), remote, dict(spec, engine_process=True),
                                 (64, batch, "random"), None)
    assert row["status"] == "ok" and row["engine_process"] is True
    profile = tmp_path / "profiles" / "host_profile_ddtree-64_64x2_random_engine.md"
    assert "(engine-core process)" in profile.read_text()


def test_report_compares_tokens_with_ar_and_totals_prompt_sets(tmp_path):
    """Every cell's generated ids against AR's in the same cell (same / how many / the
    first differing token), the share of distinct 4-grams (low = looping text), and
    tokens/s over a prompt set weighted by each prompt's decode time."""
    import e2e_report

    def row(run, method, kind, tps, ids, drafts=0.0, accepted=0.0):
        return {"run": run, "method": method, "backend": "FLASH_ATTN_MLA" if method != "ddtree"
                else None, "budget": 64 if method == "ddtree" else None, "context": 1024,
                "batch": 1, "kind": kind, "status": "ok", "tokens": 100,
                "decode_s": 100 / tps, "tokens_per_s": tps, "drafts": drafts,
                "accepted": accepted, "output_token_ids": ids, "python_ms": 1.8}

    looping = [[1, 2, 3, 4] * 8]
    varied = [list(range(32))]
    rows = [row("ar@FLASH_ATTN_MLA", "ar", "code", 500, varied),
            row("ar@FLASH_ATTN_MLA", "ar", "code@1", 500, looping),
            row("dflash@FLASH_ATTN_MLA", "dflash", "code", 1000, varied, 10, 20),
            row("dflash@FLASH_ATTN_MLA", "dflash", "code@1", 500, looping, 10, 0),
            row("ddtree-64", "ddtree", "code", 2000, [list(range(31)) + [99]], 10, 40),
            row("ddtree-64", "ddtree", "code@1", 1000, looping, 10, 10)]
    ref = e2e_report.ar_outputs(rows)
    assert [e2e_report.tokens_vs_ar(r, ref) for r in rows] == [
        "ref", "ref", "same", "same", "0/1 same, first diff at token 31", "same"]
    assert e2e_report.first_mismatch([1, 2], [1, 2, 3]) == 2
    assert e2e_report.distinct_ngrams(varied) == 1.0
    assert e2e_report.distinct_ngrams(looping) == pytest.approx(4 / 29)
    table = "\n".join(e2e_report._prompt_set_table(rows))
    assert "### code prompts (code, code@1), 1k, batch 1" in table
    # AR: 200 tokens in 0.4 s = 500; chain: 200 / 0.3 s = 667; DDTree 200 / 0.15 s = 1333.
    assert "| AR, FA-MLA | 500 | 1.00 | 0.75 | 1.00 | 1.80-1.80 |" in table
    assert "| DDTree B=64 | 1333 | 2.67 | 2.00 | 3.50 |" in table
    # A run missing one prompt of the set is left out; a lone prompt makes no table.
    assert "DFlash" not in "\n".join(e2e_report._prompt_set_table(rows[:2] + rows[3:4] + rows[4:]))
    assert e2e_report._prompt_set_table(rows[::2]) == []
    data = {"setup": "trained", "rows": rows, "invocations": []}
    e2e_report.write_markdown(data, str(tmp_path / "r.md"))
    md = (tmp_path / "r.md").read_text()
    assert "## Over each prompt set" in md and "first diff at token 31" in md


def test_code_prompts_come_from_the_python_311_snapshot(monkeypatch):
    """The ``code`` prompts read the shipped Python 3.11 text of the listed modules, so
    the device's 3.12 decodes the prompts the CPU reference engine measured; modules
    past the snapshot come from the running Python."""
    snapshot = e2e_models.code_source_snapshot()
    names = list(snapshot)
    assert names[0] == e2e_models.CODE_MODULES[0]
    assert sum(map(len, snapshot.values())) >= e2e_models.CODE_SOURCE_SNAPSHOT_CHARS
    if sys.version_info[:2] == (3, 11):
        assert snapshot[names[0]] == e2e_models.live_module_source(names[0])
    monkeypatch.setattr(e2e_models, "live_module_source", lambda name: f"# {name}\n")
    assert e2e_models.stdlib_source(1000) == snapshot[names[0]]
    total = sum(map(len, snapshot.values()))
    past = e2e_models.stdlib_source(total + 1)
    assert past == "".join(snapshot.values()) + f"# {e2e_models.CODE_MODULES[len(names)]}\n"


def test_sampled_rows_sit_beside_greedy_ones(tmp_path):
    """``--temperature``: rows keep it, so a sampled run never replaces the greedy row of
    the same cell; labels and the AR reference are per temperature, and sampled rows are
    not compared token by token with AR."""
    run = RunSpec.parse("ddtree-64")
    greedy = bench_e2e.base_row("trained", run, (1024, 1, "code"), 16)
    sampled = bench_e2e.base_row("trained", run, (1024, 1, "code"), 16, temperature=1.0)
    assert "temperature" not in greedy and sampled["temperature"] == 1.0
    assert bench_e2e.row_key(greedy) != bench_e2e.row_key(sampled)
    merged = bench_e2e.merge_rows([dict(greedy, status="ok")], [dict(sampled, status="ok")])
    assert len(merged) == 2
    assert e2e_report.run_label(sampled) == "DDTree B=64, T = 1"
    ar = RunSpec.parse("ar@FLASH_ATTN_MLA")
    rows = [dict(bench_e2e.base_row("trained", ar, (1024, 1, "code"), 16, temperature=t),
                 status="ok", tokens_per_s=tps, output_token_ids=[[1, 2, 3]])
            for t, tps in ((0.0, 500.0), (1.0, 400.0))]
    refs = e2e_report.reference_ar(rows)
    assert refs[e2e_report.ar_key(greedy)] == 500.0 and refs[e2e_report.ar_key(sampled)] == 400.0
    outputs = e2e_report.ar_outputs(rows)
    assert e2e_report.tokens_vs_ar(dict(sampled, output_token_ids=[[1, 2, 4]]),
                                   outputs) == "sampled"
    assert e2e_report.tokens_vs_ar(dict(greedy, output_token_ids=[[1, 2, 4]]),
                                   outputs) == "0/1 same, first diff at token 2"


def test_paired_rounds_table_compares_runs_within_each_lockstep_round():
    """e2e_report._paired_table: per round, tok/s over the same round's chain and AR;
    median (min-max), rounds ahead, and the equal-host median over pairs whose fixed
    Python loop agreed within EQUAL_HOST_SPREAD; sequential rows give no table."""
    def row(run, method, repeat, tps, py, seq):
        return {"status": "ok", "run": run, "method": method, "backend": "FLASH_ATTN_MLA",
                "budget": 64 if method == "ddtree" else None, "context": 1024, "batch": 1,
                "kind": "code", "repeat": repeat, "tokens_per_s": tps, "python_ms": py,
                "python_ms_after": py, "measured_seq": seq}

    rows = [row("ar@FLASH_ATTN_MLA", "ar", 0, 500.0, 2.0, 0),
            row("dflash@FLASH_ATTN_MLA", "dflash", 0, 800.0, 2.0, 1),
            row("ddtree-64", "ddtree", 0, 1200.0, 2.1, 2),   # x1.5 chain, equal host
            row("ddtree-64", "ddtree", 1, 700.0, 3.8, 3),    # x0.875, host 2x apart
            row("dflash@FLASH_ATTN_MLA", "dflash", 1, 800.0, 1.9, 4),
            row("ar@FLASH_ATTN_MLA", "ar", 1, 400.0, 3.8, 5)]
    lines = e2e_report._paired_table(rows)
    table = "\n".join(lines)
    tree = next(line for line in lines if "DDTree B=64" in line)
    cols = [c.strip() for c in tree.strip("|").split("|")]
    assert cols[4:7] == ["1.19 (0.88-1.50)", "1/2", "1.50 (n=1)"], cols
    # x AR: 2.40 and 1.75, both at equal host (round 1's pair both ran slow)
    assert cols[7:10] == ["2.08 (1.75-2.40)", "2/2", "2.08 (n=2)"], cols
    assert "Paired rounds" in table
    assert e2e_report._paired_table([dict(r, measured_seq=None) for r in rows]) == []


def test_lockstep_child_releases_cached_memory_after_each_written_row(tmp_path, monkeypatch):
    """``serve_commands`` calls ``after_cell`` once per command, after the row reached the
    result file (outside the measurement), failed cells included."""
    import io

    out = tmp_path / "child.json"
    spec = {"out": str(out), "run": "ddtree-64", "setup": "kimi8", "max_tokens": 128}
    commands = [{"cell": [1024, 1, "random"], "repeat": r, "seq": r} for r in range(3)]
    monkeypatch.setattr(sys, "stdin", io.StringIO(
        "".join(json.dumps(c) + "\n" for c in commands) + "quit\n"))
    rows_at_release = []

    def measure(cell_spec, cell):
        if cell_spec["repeat"] == 1:
            raise RuntimeError("boom")
        return {"status": bench_e2e.STATUS_OK, "repeat": cell_spec["repeat"]}

    result = {"meta": {}, "rows": []}
    bench_e2e.serve_commands(
        spec, result, measure,
        after_cell=lambda: rows_at_release.append(len(json.loads(out.read_text())["rows"])))
    assert rows_at_release == [1, 2, 3]
    assert [r["status"] for r in result["rows"]] == [
        bench_e2e.STATUS_OK, bench_e2e.STATUS_FAILED, bench_e2e.STATUS_NOT_RUN]
