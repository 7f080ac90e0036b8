"""The end-to-end benchmark's runs, cells, rows and plumbing (evals/bench_e2e.py,
e2e_runs.py, e2e_child.py, e2e_children.py, e2e_report.py): argument parsing, the
cell arithmetic, the markdown/PNG writer and the parent/child plumbing (``--fake``,
``--lockstep``)."""

import inspect
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "evals"))
import bench_e2e  # noqa: E402
import e2e_child  # noqa: E402
import e2e_children  # noqa: E402
import e2e_models  # noqa: E402
import e2e_report  # noqa: E402
import e2e_runs  # noqa: E402
import e2e_timing  # noqa: E402
from bench_e2e import parse_args  # noqa: E402
from e2e_runs import RunSpec  # noqa: E402

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
    rows = [e2e_runs.base_row("kimi8", r, (1024, 1, "random"), 16) for r in (chain, plain)]
    assert e2e_report.run_label(rows[0]) == "DFlash chain, FA-MLA, no common-prefix scan"
    assert sorted(rows, key=e2e_report.run_sort_key)[0]["run"] == plain.name
    assert e2e_runs.row_key(rows[0]) != e2e_runs.row_key(rows[1])
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
    e2e_child.apply_run_variants(plain, engine_process=False)
    assert scheduler_answer() == [7, 7]
    with pytest.raises(ValueError, match="--engine-process"):
        e2e_child.apply_run_variants(chain, engine_process=True)
    e2e_child.apply_run_variants(chain, engine_process=False)
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
    base = e2e_runs.base_row("kimi64", runs[0], (1024, 1, "random"), 16)
    row = e2e_runs.fake_row(base, 96)
    assert row["budget"] == "auto" and row["active_nodes_per_round"] == 48
    assert "active_nodes_per_round" not in e2e_runs.fake_row(
        e2e_runs.base_row("kimi64", RunSpec.parse("ddtree-96"), (1024, 1, "random"), 16), 96)


def test_plan_cells_skips_what_cannot_run():
    trained, kimi = e2e_models.SETUPS["trained"], e2e_models.SETUPS["kimi8"]
    runs = [RunSpec.parse("ddtree-128")]
    margin = e2e_runs.sequence_margin(runs, trained)
    cells, skipped = e2e_runs.plan_cells(trained, [1024, 16384], [1, 8], ["code", "random"],
                                          128, margin)
    assert cells == [(1024, 1, "code"), (1024, 8, "code"), (1024, 1, "random"),
                     (1024, 8, "random")]
    assert {s[0] for s in skipped} == {16384}
    assert all("max_position_embeddings (4096)" in s[3] for s in skipped)
    cells, skipped = e2e_runs.plan_cells(kimi, [131072], [8], ["code", "random"], 128, margin)
    assert cells == [(131072, 8, "random")] and "no tokenizer" in skipped[0][3]


def test_llm_kwargs_for_each_method():
    spec = {"setup": "kimi64", "run": "ddtree-128", "target": "/t", "drafter": "/d",
            "max_model_len": 140000, "max_num_seqs": 8, "gpu_mem": 0.85, "eager": False,
            "prime": "cache", "llm_kwargs": {}}
    kw = e2e_child.llm_kwargs(spec)
    assert "attention_backend" not in kw and kw["load_format"] == "dummy"
    assert kw["speculative_config"]["method"] == "ddtree" and kw["enable_prefix_caching"]
    # 8 x (1 + 128) = 1032 verify tokens: graphs must be captured past vLLM's 512 default
    assert kw["compilation_config"]["max_cudagraph_capture_size"] == 1040
    # a sweep's steps also prefill refilled requests beside the full batch
    kw = e2e_child.llm_kwargs(dict(spec, sweep={"pool_factor": 8}))
    assert kw["compilation_config"]["max_cudagraph_capture_size"] == 1552
    kw = e2e_child.llm_kwargs(dict(spec, run="ar@TRITON_MLA", prime="none",
                                   llm_kwargs={"compilation_config": {"mode": 0}}))
    assert kw["attention_backend"] == "TRITON_MLA" and kw["speculative_config"] is None
    assert kw["compilation_config"] == {"mode": 0} and not kw["enable_prefix_caching"]
    kw = e2e_child.llm_kwargs(dict(spec, setup="trained", run="dflash@FLASH_ATTN_MLA",
                                   eager=True))
    assert "load_format" not in kw and kw["enforce_eager"]
    assert kw["speculative_config"]["num_speculative_tokens"] == 15
    assert "compilation_config" not in kw


def test_hybrid_variant_keeps_vllms_kv_cache_manager():
    """+hybrid: a DDTree run with vLLM's hybrid KV-cache manager
    (``disable_hybrid_kv_cache_manager=False``, what ``--no-disable-hybrid-kv-cache-manager``
    sets) beside the plain run, which leaves the grouping to DDTree; its own column."""
    plain, hybrid = RunSpec.parse("ddtree-64"), RunSpec.parse("ddtree-64+hybrid")
    assert hybrid.variants == ("+hybrid",) and hybrid.name == "ddtree-64+hybrid"
    assert RunSpec.parse(hybrid.name) == hybrid  # the child re-parses the name
    assert RunSpec.parse("ddtree-auto-32+perbatch+hybrid").variants == ("+perbatch", "+hybrid")
    kimi = e2e_models.SETUPS["kimi8"]
    assert hybrid.speculative_config(kimi, "/d") == plain.speculative_config(kimi, "/d")
    spec = {"setup": "trained", "run": hybrid.name, "target": "/t", "drafter": "/d",
            "max_model_len": 4096, "max_num_seqs": 8, "gpu_mem": 0.85, "eager": True,
            "prime": "cache", "llm_kwargs": {}}
    assert e2e_child.llm_kwargs(spec)["disable_hybrid_kv_cache_manager"] is False
    assert "disable_hybrid_kv_cache_manager" not in e2e_child.llm_kwargs(
        dict(spec, run=plain.name))
    rows = [e2e_runs.base_row("trained", r, (1024, 1, "code"), 16) for r in (hybrid, plain)]
    assert e2e_report.run_label(rows[0]).endswith("hybrid KV-cache manager")
    assert e2e_runs.row_key(rows[0]) != e2e_runs.row_key(rows[1])
    with pytest.raises(ValueError, match="applies to ddtree runs only"):
        RunSpec.parse("dflash@FLASH_ATTN_MLA+hybrid")


def test_cell_row_acceptance_and_throughput():
    base = {"setup": "trained", "run": "ddtree-32", "method": "ddtree", "backend": "CUSTOM",
            "budget": 32, "context": 1024, "batch": 2, "kind": "code", "max_tokens": 65}
    summary = e2e_timing.split_step(40.0, 20, 0.5, 1.0) | {
        "sample_ms": 0.2, "compact_ms": 0.1, "step_ms_median": 2.0, "step_ms_max": 2.5,
        "prefill_steps": 1, "prefill_tokens": 128}
    counters = {"vllm:spec_decode_num_drafts": 40.0,
                "vllm:spec_decode_num_accepted_tokens": 88.0,
                "vllm:spec_decode_num_draft_tokens": 40.0 * 32}
    row = e2e_runs.cell_row(base, summary, counters, wall_s=0.05, produced=[65, 65])
    assert row["status"] == "ok" and row["note"] == ""
    assert row["acceptance_length"] == pytest.approx(3.2)
    assert row["accepted_depth"] == pytest.approx(2.2)
    assert row["rounds_per_request"] == pytest.approx(20.0)
    assert row["tokens_per_s"] == pytest.approx(2 * 64 / 0.040)
    assert row["draft_ms"] + row["verify_ms"] + row["other_ms"] == pytest.approx(row["step_ms"])

    ar = dict(base, run="ar@CUSTOM", method="ar", budget=None)
    row = e2e_runs.cell_row(ar, None, {}, wall_s=0.128, produced=[65, 60])
    assert row["acceptance_length"] == 1.0 and row["step_ms"] == pytest.approx(2.0)
    assert "no runner events" in row["note"] and "produced" in row["note"]
    missed = dict(summary, prefill_tokens=2048, step_ms_max=50.0)
    note = e2e_runs.cell_row(base, missed, counters, wall_s=0.05)["note"]
    assert "prefix cache missed" in note and "slowest step" in note


# ---------------------------------------------------------------------------------------
# Writer and plumbing


def _synthetic_store(setup: str) -> dict:
    rows = []
    for run in ("ar@FLASH_ATTN_MLA", "dflash@FLASH_ATTN_MLA", "ddtree-64"):
        spec = RunSpec.parse(run)
        for context in (1024, 131072):
            base = e2e_runs.base_row(setup, spec, (context, 1, "random"), 128)
            rows.append(e2e_runs.fake_row(base, spec.num_spec_tokens(
                e2e_models.SETUPS[setup])))
    base = e2e_runs.base_row(setup, RunSpec.parse("ddtree-64"), (65536, 1, "random"), 128)
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
    assert "against the reference figures" in md and "1.86" in md  # vLLM's own anchor figure
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
    assert e2e_runs.merge_rows([ok], [not_run]) == [ok]
    assert e2e_runs.merge_rows([ok], [failed]) == [failed]
    assert len(e2e_runs.merge_rows([ok], [dict(ok, batch=8)])) == 2


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


def test_repeats_run_interleaved_and_report_the_median(tmp_path):
    """``--repeats 3``: children start A B B A A B; every cell keeps one row per repeat;
    the tables show the median repeat's figures and a min-max spread table."""
    from e2e_report import collapse_repeats

    runs = [RunSpec.parse("ddtree-32"), RunSpec.parse("ar@CUSTOM")]
    order = [(r, run.name) for r, run in e2e_runs.interleaved(runs, 3)]
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
    row = e2e_runs.spec_base_row(spec, cell)
    assert row["repeat"] == 2
    assert e2e_runs.row_key(row) == e2e_runs.row_key(
        e2e_runs.base_row("kimi8", RunSpec.parse("ddtree-64"), cell, 128, 2))
    src = inspect.getsource(e2e_child.measure_cell)
    assert "spec_base_row(spec, cell)" in src and "base_row(spec[" not in src


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
    row = e2e_child.measure_cell(FakeLLM(), engine, spec, (64, batch, "random"), None)
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
    row = e2e_child.measure_cell(FakeRemoteLLM(), remote, dict(spec, engine_process=True),
                                 (64, batch, "random"), None)
    assert row["status"] == "ok" and row["engine_process"] is True
    profile = tmp_path / "profiles" / "host_profile_ddtree-64_64x2_random_engine.md"
    assert "(engine-core process)" in profile.read_text()


def test_measure_cell_writes_auto_gate_trace_per_prompt_set(tmp_path, monkeypatch):
    """``BENCH_E2E_GATE_TRACE`` outside ``--sweep``: an auto cell starts the gate's trace
    before its measured generate and writes what it took, named by run and prompt set;
    a fixed-budget cell traces nothing."""
    import e2e_engine
    import gate_trace

    calls = []
    monkeypatch.setattr(gate_trace, "install", lambda: calls.append("install"))
    monkeypatch.setattr(gate_trace, "take", lambda: calls.append("take") or [["d", 1.0]])

    class FakeLLM:
        def generate(self, inputs, params, use_tqdm=False):
            calls.append("generate")
            return [type("Output", (), {"outputs": [type("C", (), {"token_ids": [1] * 4})()],
                                        "num_cached_tokens": 64, "metrics": None})()
                    for _ in inputs]

        def get_metrics(self):
            return []

    monkeypatch.setattr(e2e_engine, "_TIMER", None)
    monkeypatch.setattr(e2e_timing.StepTimer, "install_vllm", lambda self: self.installed)
    monkeypatch.setattr(e2e_timing.StepTimer, "install_graph_modes", lambda self: None)
    monkeypatch.setenv("BENCH_E2E_GATE_TRACE", str(tmp_path / "traces"))
    spec = {"setup": "kimi8", "run": "ddtree-auto", "max_tokens": 4, "prime": "cache",
            "temperature": 0.0, "repeat": 1}
    e2e_child.measure_cell(FakeLLM(), e2e_engine.LocalEngine(), spec, (64, 1, "random@1"), None)
    assert calls == ["generate", "install", "generate", "take"]  # prime, traced generate
    saved = json.loads((tmp_path / "traces" / "gate_trace_ddtree-auto-random_1_64x1_r1.json")
                       .read_text())
    assert saved["records"] == [["d", 1.0]] and saved["batch"] == 1
    calls.clear()
    e2e_child.measure_cell(FakeLLM(), e2e_engine.LocalEngine(), dict(spec, run="ddtree-64"),
                           (64, 1, "random"), None)
    assert calls == ["generate", "generate"]


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


def test_sampled_rows_sit_beside_greedy_ones(tmp_path):
    """``--temperature``: rows keep it, so a sampled run never replaces the greedy row of
    the same cell; labels and the AR reference are per temperature, and sampled rows are
    not compared token by token with AR."""
    run = RunSpec.parse("ddtree-64")
    greedy = e2e_runs.base_row("trained", run, (1024, 1, "code"), 16)
    sampled = e2e_runs.base_row("trained", run, (1024, 1, "code"), 16, temperature=1.0)
    assert "temperature" not in greedy and sampled["temperature"] == 1.0
    assert e2e_runs.row_key(greedy) != e2e_runs.row_key(sampled)
    merged = e2e_runs.merge_rows([dict(greedy, status="ok")], [dict(sampled, status="ok")])
    assert len(merged) == 2
    assert e2e_report.run_label(sampled) == "DDTree B=64, T = 1"
    ar = RunSpec.parse("ar@FLASH_ATTN_MLA")
    rows = [dict(e2e_runs.base_row("trained", ar, (1024, 1, "code"), 16, temperature=t),
                 status="ok", tokens_per_s=tps, output_token_ids=[[1, 2, 3]])
            for t, tps in ((0.0, 500.0), (1.0, 400.0))]
    refs = e2e_report.reference_ar(rows)
    assert refs[e2e_report.ar_key(greedy)] == 500.0 and refs[e2e_report.ar_key(sampled)] == 400.0
    outputs = e2e_report.ar_outputs(rows)
    assert e2e_report.tokens_vs_ar(dict(sampled, output_token_ids=[[1, 2, 4]]),
                                   outputs) == "sampled"
    assert e2e_report.tokens_vs_ar(dict(greedy, output_token_ids=[[1, 2, 4]]),
                                   outputs) == "0/1 same, first diff at token 2"


# ---------------------------------------------------------------------------------------
# --lockstep


LOCKSTEP_RUNS = ["ar@FLASH_ATTN_MLA", "ddtree-64", "ddtree-auto"]


def _lockstep(tmp_path, *extra):
    """``--lockstep --fake`` on kimi8, 2 contexts, batch 1, :data:`LOCKSTEP_RUNS`,
    2 repeats; returns the result JSON."""
    assert bench_e2e.main(["--fake", "--lockstep", "--setup", "kimi8", "--batches", "1",
                           "--contexts", "1k", "16k", "--runs", *LOCKSTEP_RUNS,
                           "--repeats", "2", "--out-dir", str(tmp_path), "--model-dir",
                           str(tmp_path / "models"), *extra]) == 0
    return json.loads((tmp_path / "e2e_kimi8.json").read_text())


def test_lockstep_order_alternates_runs_per_round_and_rotates_them_per_cell():
    runs = [RunSpec.parse(r) for r in ("ar@CUSTOM", "ddtree-32", "ddtree-64")]
    cells = [(1024, 1, "random"), (16384, 1, "random")]
    order = [(c[0], r, run.name) for c, r, run in e2e_children.lockstep_order(cells, runs, 2)]
    assert order == [(1024, 0, "ar@CUSTOM"), (1024, 0, "ddtree-32"), (1024, 0, "ddtree-64"),
                     (1024, 1, "ddtree-64"), (1024, 1, "ddtree-32"), (1024, 1, "ar@CUSTOM"),
                     (16384, 0, "ddtree-32"), (16384, 0, "ddtree-64"),
                     (16384, 0, "ar@CUSTOM"), (16384, 1, "ar@CUSTOM"),
                     (16384, 1, "ddtree-64"), (16384, 1, "ddtree-32")]
    # one round per cell: over as many cells as runs, each run is measured first once
    cells = [(1024, b, "random") for b in (1, 2, 3)]
    firsts = [run.name for _, _, run in e2e_children.lockstep_order(cells, runs, 1)][::3]
    assert sorted(firsts) == sorted(r.name for r in runs)


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
    rotated = {1024: names, 16384: names[1:] + names[:1]}  # one step further per cell
    assert [(r["context"], r["repeat"], r["run"]) for r in by_time] == [
        (c, rep, n) for c in (1024, 16384) for rep in (0, 1)
        for n in (rotated[c] if rep == 0 else rotated[c][::-1])]
    inv = data["invocations"][-1]
    assert inv["lockstep"] is True
    setup = e2e_models.SETUPS["kimi8"]
    models = e2e_models.prepare_setup(setup, tmp_path / "models")
    margin = e2e_runs.sequence_margin(parse_args(["--runs", *LOCKSTEP_RUNS]).run_specs, setup)
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


def test_lockstep_starts_auto_alone_before_the_other_engines(tmp_path, monkeypatch):
    """``auto`` times its graphs at start-up: each auto engine starts, and is ready,
    alone, before the next and before the other runs' engines start (together); the
    children keep the runs' order."""
    specs = parse_args(["--runs", "ar@FLASH_ATTN_MLA", "ddtree-auto", "ddtree-64",
                        "ddtree-auto-32"]).run_specs
    waves = e2e_children.start_waves(specs)
    assert [[i for i, _ in wave] for wave in waves] == [[1], [3], [0, 2]]
    assert e2e_children.start_waves(specs[:1]) == [[(0, specs[0])]]
    events = []
    real_start, real_wait = e2e_children.start_lockstep_child, e2e_children.wait_lockstep_ready

    def start(spec, tmp, index, log_path):
        events.append(("start", index))
        return real_start(spec, tmp, index, log_path)

    def wait(children, *args):
        events.append(("ready", sorted(c.run.name for c in children)))
        return real_wait(children, *args)

    monkeypatch.setattr(e2e_children, "start_lockstep_child", start)
    monkeypatch.setattr(e2e_children, "wait_lockstep_ready", wait)
    data = _lockstep(tmp_path)
    assert events == [("start", 2), ("ready", ["ddtree-auto-64"]), ("start", 0),
                      ("start", 1), ("ready", ["ar@FLASH_ATTN_MLA", "ddtree-64"])]
    assert all(r["status"] == "ok" for r in data["rows"])


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
    kv = e2e_children.lockstep_kv_bytes(models, 132000, 8)
    total = e2e_models.kv_cache_bytes(e2e_models.read_config(models.target),
                                      e2e_models.read_config(models.drafter), 132000,
                                      8)["total"]
    assert kv == 3 * total + 2**30
    assert e2e_children.lockstep_kv_bytes(models, 132000, 8, 2.5) == int(2.5 * 2**30)
    kw = e2e_child.llm_kwargs(e2e_children.child_spec(setup, args, run, cells, models, 132000,
                                                   None, kv_bytes=kv))
    assert kw["kv_cache_memory_bytes"] == kv and kw["gpu_memory_utilization"] == 0.05
    assert kw["max_num_seqs"] == 8 and kw["max_model_len"] == 132000
    kw = e2e_child.llm_kwargs(e2e_children.child_spec(setup, args, run, cells, models, 132000,
                                                   None))
    assert "kv_cache_memory_bytes" not in kw and kw["gpu_memory_utilization"] == 0.85
    assert parse_args(["--lockstep", "--lockstep-kv-gib", "6"]).lockstep_kv_gib == 6.0
    with pytest.raises(SystemExit):
        parse_args(["--lockstep-kv-gib", "6"])
    assert "--lockstep-kv-gib needs --lockstep" in capsys.readouterr().err


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
        return {"status": e2e_runs.STATUS_OK, "repeat": cell_spec["repeat"]}

    result = {"meta": {}, "rows": []}
    e2e_child.serve_commands(
        spec, result, measure,
        after_cell=lambda: rows_at_release.append(len(json.loads(out.read_text())["rows"])))
    assert rows_at_release == [1, 2, 3]
    assert [r["status"] for r in result["rows"]] == [
        e2e_runs.STATUS_OK, e2e_runs.STATUS_FAILED, e2e_runs.STATUS_NOT_RUN]


def test_dflash2_variants_pick_the_shipped_drafter_and_its_tree_kind():
    """+dflash2: the DFlash2 drafter shipped for the embedded target (trained setups only);
    +marginals: its trees over the marginals (the child stops the selector drafting);
    +top1: ddtree_top_k 1 (at B = 15 the selector's chain walk)."""
    import vllm_ddtree.draft.speculator as speculator

    trained = e2e_models.SETUPS["trained"]
    selector = RunSpec.parse("ddtree-64+dflash2")
    config = selector.speculative_config(trained, "/dflash")
    assert config["model"].endswith("checkpoints/dflash2_drafter")
    assert config["num_speculative_tokens"] == 64 and "ddtree_top_k" not in config
    walk = RunSpec.parse("ddtree-15+top1+dflash2")
    assert walk.variants == ("+dflash2", "+top1") and walk.name == "ddtree-15+dflash2+top1"
    assert walk.speculative_config(trained, "/dflash")["ddtree_top_k"] == 1
    marginals = RunSpec.parse("ddtree-64+dflash2+marginals")
    row = e2e_runs.base_row("trained", marginals, (384, 1, "code"), 16)
    assert e2e_report.run_label(row).endswith("DFlash2 selector, over its marginals")
    with pytest.raises(ValueError, match=r"\+dflash2 is for the setups trained, "
                                         r"trained_dflash2, trained_yarn .* not kimi8"):
        selector.speculative_config(e2e_models.SETUPS["kimi8"], "/dflash")
    with pytest.raises(ValueError, match=r"\+marginals needs \+dflash2"):
        RunSpec.parse("ddtree-64+marginals").speculative_config(trained, "/dflash")
    with pytest.raises(ValueError, match="applies to ddtree runs only"):
        RunSpec.parse("dflash@FLASH_ATTN_MLA+dflash2")
    original = speculator.selector_drafting_for
    try:
        with pytest.raises(ValueError, match="drop --engine-process"):
            e2e_child.apply_run_variants(marginals, engine_process=True)
        e2e_child.apply_run_variants(selector, engine_process=False)
        assert speculator.selector_drafting_for is original
        e2e_child.apply_run_variants(marginals, engine_process=False)
        assert speculator.selector_drafting_for(None, None, None) is None
    finally:
        speculator.selector_drafting_for = original


def test_extends512_variant_raises_the_tree_backends_decode_limit(monkeypatch):
    """``+extends512``: the MLA tree backend and the speculator's mask take queries of up
    to 512 tokens as decodes in bf16 (FLASH_ATTN_MLA's limit); a larger limit (1 + 2B
    above 512, fp32's every query) is kept."""
    from types import SimpleNamespace as NS

    import torch

    import vllm_ddtree.attention_backends.mla_tree.backend as backend
    import vllm_ddtree.draft.speculator as speculator

    monkeypatch.setattr(backend, "decode_query_limit", backend.decode_query_limit)
    monkeypatch.setattr(speculator, "decode_query_limit", speculator.decode_query_limit)
    run = RunSpec.parse("ddtree-64+extends512")
    assert run.variants == ("+extends512",)
    with pytest.raises(ValueError, match="applies to ddtree runs only"):
        RunSpec.parse("ar@FLASH_ATTN_MLA+extends512")

    def config(dtype):
        return NS(model_config=NS(dtype=dtype),
                  scheduler_config=NS(max_num_batched_tokens=8192))

    assert backend.decode_query_limit(config(torch.bfloat16), 129) == 129
    e2e_child.apply_run_variants(run, engine_process=False)
    for module in (backend, speculator):
        assert module.decode_query_limit(config(torch.bfloat16), 129) == 512
        assert module.decode_query_limit(config(torch.bfloat16), 1025) == 1025
        assert module.decode_query_limit(config(torch.float32), 129) == 8192
