# SPDX-License-Identifier: Apache-2.0
"""The batch sweep of ``evals/bench_e2e.py --sweep``: continuous batching at a fixed
concurrency, requests of mixed lengths (the load generator and one cell's measurement).

A cell (context C, batch b, prompt kind) has a pool of ``pool_factor x b`` requests
(at least ``--min-pool``; :func:`request_pool`, seeded): every prompt is one shared
prefix of ``C - tail_max`` tokens (a document many requests read: vLLM's prefix cache
holds it once, so 64 requests at 32k fit beside the other runs' engines on one GPU)
followed by the request's own tail of
``tail_min..tail_max`` tokens; each request asks for ``out_min..out_max`` new tokens
(uniform, seeded). The pool's prompts are prefilled into the prefix cache first
(``max_tokens=1`` generates, the shared prefix first), then :func:`drive` keeps b
requests in flight through vLLM's engine API (``LLM.llm_engine``: ``add_request`` /
``step``), adding the next request of
the pool whenever one finishes, and stops the clock at the first step after which it
cannot refill (the pool is spent): tokens/s is over that steady window, at concurrency
b throughout. Attention still reads each request's whole context every step.

Run names (``e2e_runs.RunSpec``) take ``+perbatch`` for vLLM's
``num_speculative_tokens_per_batch_size``: ``e2e_runs.chain_schedule`` for the chain,
``e2e_runs.ddtree_schedule`` (scaled to B) for DDTree, where the front end may refuse
it (the cell is then skipped with the refusal as its note).
"""

from __future__ import annotations

import os
import statistics
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass

SWEEP_BATCHES = [1, 4, 8, 16, 32, 64]
DEFAULT_POOL_FACTOR = 3
DEFAULT_TAILS = (64, 256)
DEFAULT_OUTPUTS = (32, 256)
MIN_POOL = 6  # requests per cell at least, by default (--min-pool)
CRC_TOKENS = 16  # the report compares each request's first tokens with AR's by CRC
# Contexts a setup serves honestly (and why), used when --contexts is not given.
SWEEP_CONTEXTS: dict[str, tuple[list[int], str]] = {
    "trained": ([384], "the embedded target is trained on 512-token windows: prompts up "
                "to 384 tokens plus at most 128 new ones stay inside it (--output-lengths "
                "32 128)"),
    "trained_yarn": ([512, 1024], "the embedded target with YaRN x4 has 2,048 positions: "
                     "1k prompts + up to 256 new tokens + the speculative margin fit, 32k "
                     "would be nonsense for a model trained on 512-token windows"),
    "v2lite": ([1024, 32768], "DeepSeek-V2-Lite serves 32k; dummy weights make any "
               "length valid"),
    "v2lite_moe": ([1024, 32768], "as v2lite"),
    "kimi8": ([1024, 32768], "dummy weights: nothing accepted, step cost only"),
    "kimi64": ([1024, 32768], "dummy weights: nothing accepted, step cost only"),
}


@dataclass(frozen=True)
class PoolSpec:
    """How a cell's request pool is drawn (``--pool-factor``, ``--prompt-tails``,
    ``--output-lengths``, seed)."""

    pool_factor: int = DEFAULT_POOL_FACTOR
    tails: tuple[int, int] = DEFAULT_TAILS
    outputs: tuple[int, int] = DEFAULT_OUTPUTS
    seed: int = 0
    min_pool: int = MIN_POOL

    def to_json(self) -> dict:
        return {"pool_factor": self.pool_factor, "min_pool": self.min_pool,
                "tails": list(self.tails), "outputs": list(self.outputs), "seed": self.seed}

    @classmethod
    def from_json(cls, data: dict) -> PoolSpec:
        return cls(int(data["pool_factor"]), tuple(data["tails"]), tuple(data["outputs"]),
                   int(data.get("seed", 0)), int(data.get("min_pool", MIN_POOL)))


def check_range(field: str, value, lo_min: int = 1) -> tuple[int, int]:
    """``(lo, hi)`` ints with ``lo_min <= lo <= hi``, else a ValueError naming ``field``."""
    if (not isinstance(value, list | tuple) or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)
            or not lo_min <= value[0] <= value[1]):
        raise ValueError(f"{field}={value!r} is not allowed: two integers LO HI with "
                         f"{lo_min} <= LO <= HI")
    return int(value[0]), int(value[1])


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    max_tokens: int


def request_pool(setup, context: int, batch: int, kind: str, pool: PoolSpec,
                 tokenizer=None) -> list[Request]:
    """The seeded pool of one cell (module docstring): ``pool_factor x batch`` requests
    (at least ``min_pool``),
    one shared prefix of ``context - tails[1]`` tokens, tails and outputs uniform in
    their ranges. ``code`` prompts need ``tokenizer`` (``e2e_models.code_prompts``)."""
    import numpy as np
    from e2e_models import code_prompts, parse_prompt_kind

    lo, hi = check_range("--prompt-tails", pool.tails)
    out_lo, out_hi = check_range("--output-lengths", pool.outputs, lo_min=2)
    if context <= hi:
        raise ValueError(f"context={context} is not allowed with --prompt-tails {lo} {hi}: "
                         f"a context longer than the longest tail ({hi})")
    base, index = parse_prompt_kind(kind)
    n = max(pool.pool_factor * batch, pool.min_pool)
    rng = np.random.default_rng([pool.seed, context, batch, index])
    tails = rng.integers(lo, hi + 1, n).tolist()
    outputs = rng.integers(out_lo, out_hi + 1, n).tolist()
    prefix_len = context - hi
    total = prefix_len + n * hi
    if base == "random":  # the prefix depends on the context only: cached across batches
        prefix_rng = np.random.default_rng([pool.seed, context, index, 1])
        stream = (prefix_rng.integers(*setup.random_ids, size=prefix_len).tolist()
                  + rng.integers(*setup.random_ids, size=total - prefix_len).tolist())
    else:
        if tokenizer is None:
            raise ValueError(f"setup {setup.name} has no tokenizer: 'code' prompts need one")
        stream = code_prompts(tokenizer, index + 1, total)[index]
    prefix = stream[:prefix_len]
    return [Request(prefix + stream[prefix_len + i * hi: prefix_len + i * hi + tails[i]],
                    outputs[i]) for i in range(n)]


PRIMES = ("cache", "prefix")  # --prime choices of a sweep


def priming_groups(pool: list[Request], prime: str, prefix_len: int) -> list[list[list[int]]]:
    """The prompts a cell prefills (one new token each) before its window, in groups run
    one after another. ``"cache"``: the first prompt alone (requests prefilled side by
    side would each compute the shared blocks none of them has cached yet), then the whole
    pool, so that a request joining the window prefills only its last partial page;
    ``"prefix"``: the shared prefix (``prefix_len`` tokens) alone, so that each request
    prefills its own tail when it joins, as a server's new request does."""
    if prime not in PRIMES:
        raise ValueError(f"prime={prime!r} is not allowed with a sweep: one of {PRIMES}")
    if prime == "prefix":
        return [[pool[0].prompt[:prefix_len]]]
    return [[pool[0].prompt], [r.prompt for r in pool]]


def drive(engine, pool: list[Request], batch: int, params_of: Callable[[Request], object],
          prompt_of: Callable[[Request], object] = lambda r: r.prompt, tag: str = "sweep-",
          clock: Callable[[], float] = time.perf_counter,
          pause: Callable[[float], float] | None = None) -> dict:
    """Keep ``batch`` requests of ``pool`` in flight on ``engine`` (``add_request(id,
    prompt, params)``, ``step()`` -> outputs with ``request_id``, ``finished`` and
    ``outputs[0].token_ids`` holding the step's new tokens, ``abort_request(ids)``,
    ``has_unfinished_requests()``), refilling from the pool in order; the window ends
    after the first step at which a finished request cannot be replaced. Returns
    ``wall_s`` and ``steps`` of the window, ``tokens`` generated in it, ``finished``
    requests, ``mean_in_flight`` (requests per step), ``outputs`` (token ids per pool
    request, as far as it got), ``step_ms_median`` (the median ``step()`` call, in ms:
    a step without a refill's prefill where most steps have none) and
    ``refill_excess_ms``: the window's time beyond ``steps x step_ms_median``, per
    request added within it (a refill's prefill lands in whichever step runs it, and a
    speculative method, finishing requests in fewer steps, holds a prefill in more of
    its steps; this charges each run's prefills to the requests that caused them; None
    without a refill). The requests still in flight are aborted.

    ``pause(stepped_s)``, between steps (``--interleave-s``: the lockstep child hands the
    GPU to the next run's engine there): gets the window's stepping time so far and
    returns the seconds it spent away, which the window does not count; ``slices`` is
    then the number of pauses that handed over, plus one."""
    if not pool or batch < 1 or len(pool) < batch:
        raise ValueError(f"batch={batch} is not allowed with a pool of {len(pool)} "
                         "requests: 1 <= batch <= pool size")
    index_of: dict[str, int] = {}
    outputs: list[list[int]] = [[] for _ in pool]
    in_flight: set[int] = set()
    added = 0

    def add() -> None:
        nonlocal added
        i, added = added, added + 1
        name = f"{tag}{i}"
        index_of[name] = i
        got = engine.add_request(name, prompt_of(pool[i]), params_of(pool[i]))
        if isinstance(got, str):
            index_of[got] = i
        in_flight.add(i)

    for _ in range(batch):
        add()
    start = clock()
    steps = finished = in_flight_sum = 0
    away = 0.0
    slices = 1
    step_s: list[float] = []
    while True:
        if pause is not None and steps:
            gone = pause(clock() - start - away)
            away += gone
            slices += gone > 0
        in_flight_sum += len(in_flight)
        step_start = clock()
        outs = engine.step()
        step_s.append(clock() - step_start)
        steps += 1
        for out in outs:
            i = index_of.get(out.request_id)
            if i is None:
                continue
            outputs[i].extend(int(t) for t in out.outputs[0].token_ids)
            if out.finished and i in in_flight:
                in_flight.discard(i)
                finished += 1
        while len(in_flight) < batch and added < len(pool):
            add()
        if len(in_flight) < batch:
            break
    wall = clock() - start - away
    median_s = statistics.median(step_s)
    refills = added - batch
    if in_flight:
        engine.abort_request([f"{tag}{i}" for i in sorted(in_flight)])
    while engine.has_unfinished_requests():
        engine.step()
    return {"wall_s": wall, "steps": steps, "tokens": sum(len(o) for o in outputs),
            "finished": finished, "mean_in_flight": in_flight_sum / steps,
            "outputs": outputs, "slices": slices, "step_ms_median": 1000 * median_s,
            "refill_excess_ms": (1000 * (wall - steps * median_s) / refills if refills
                                 else None)}


def output_crcs(outputs: list[list[int]], n: int = CRC_TOKENS) -> list[int | None]:
    """CRC32 of each request's first ``n`` tokens (None when it made fewer)."""
    return [zlib.crc32(repr(o[:n]).encode()) if len(o) >= n else None for o in outputs]


def chain_mismatches(pool: list[Request], outputs: list[list[int]], perm) -> dict:
    """Oracle setups: requests whose tokens are not the structured target's chain
    (``e2e_oracle.chain_of``) and the earliest differing output index."""
    from e2e_oracle import chain_of

    bad, first = 0, None
    for req, out in zip(pool, outputs, strict=True):
        want = chain_of(perm, req.prompt[-1], len(out))
        diff = next((k for k, (a, b) in enumerate(zip(out, want, strict=True)) if a != b),
                    None)
        if diff is not None:
            bad += 1
            first = diff if first is None else min(first, diff)
    return {"requests_off_chain": bad, "first_off_chain_index": first}


def sweep_kv_bytes(models, max_context: int, batch: int, pool: PoolSpec, margin: int,
                   factor: float = 2.0) -> int:
    """``kv_cache_memory_bytes`` of each ``--lockstep`` sweep engine: ``factor x`` the
    KV cache of the shared prefix + ``batch`` requests' tails, outputs and ``margin``
    (the prefix cache keeps the primed pool's tails while it has room), + 1 GiB."""
    from e2e_models import kv_cache_bytes, read_config

    tokens = max_context + batch * (pool.tails[1] + pool.outputs[1] + margin)
    kv = kv_cache_bytes(read_config(models.target), read_config(models.drafter), tokens, 1)
    return int(factor * kv["total"]) + 2**30


def fake_sweep_row(base: dict, num_spec: int,
                   pause: Callable[[float], float] | None = None) -> dict:
    """Synthetic sweep figures (``--fake``: the plumbing without a GPU): AR gains with
    the batch, speculation pays at small batches only. ``pause``: :func:`drive`'s, called
    as if 3 s of steps were taken in 1 s strides."""
    from e2e_runs import STATUS_OK

    slices = 1
    for stepped in (1.0, 2.0, 3.0) if pause is not None else ():
        slices += pause(stepped) > 0
    batch, method = base["batch"], base["method"]
    ar = 100.0 * batch / (1 + batch / 32)
    gain = 1.0 if method == "ar" else (2.5 - 1.6 * min(batch, 64) / 64) * (
        1 + min(num_spec, 64) / 640)
    tps = ar * gain
    if base["budget"] == "auto":
        tps = max(tps, ar) * 0.99
    tokens = 100 * batch
    row = dict(base, status=STATUS_OK, pool=3 * batch, tokens=tokens, decode_s=tokens / tps,
               tokens_per_s=tps, steps=tokens // batch, finished=2 * batch,
               mean_in_flight=float(batch), prime_s=0.1, python_ms=2.0, python_ms_after=2.2,
               slices=slices,
               acceptance_length=None if method == "ar" else 3.0,
               output_crc=[7] * (3 * batch), note="")
    if base["budget"] == "auto":
        row["active_nodes_per_round"] = num_spec / 2
        from vllm_ddtree.budget.gate import batch_bucket, bucket_batches

        arms = [{"arm": a, "chosen": c, "residual_ms": 0.5, "residual_samples": 15,
                 "committed": 1.0 if a == 0 else 3.0, "committed_samples": c}
                for a, c in ((num_spec, 90), (0, 10))]
        row["gate"] = {bucket_batches(batch_bucket(batch)): {"settled": num_spec,
                                                             "arms": arms}}
    return row


def measure_sweep_cell(llm, engine, spec: dict, cell: tuple[int, int, str], tokenizer,
                       pause: Callable[[float], float] | None = None) -> dict:
    """One sweep cell in a child (GPU): prime the prefix cache (:func:`priming_groups`),
    then :func:`drive` through ``llm.llm_engine`` (``pause``: :func:`drive`'s); the row
    has the window's tokens/s, acceptance from vLLM's spec-decode counters and the
    correctness figures."""
    from e2e_engine import (
        engine_active_counters,
        engine_batch_count_start,
        engine_batch_count_take,
        engine_gate_skip_gap,
        engine_gate_snapshot,
        engine_gate_trace_start,
        engine_gate_trace_take,
        engine_host_speed,
        engine_timer_begin,
        engine_timer_end,
    )
    from e2e_models import SETUPS
    from e2e_runs import STATUS_OK, RunSpec, counter_delta, spec_base_row
    from e2e_timing import host_cpu_delta, host_cpu_state, split_by_prefill
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    from vllm_ddtree.metrics import read_spec_decode_counters

    def spec_counters(llm) -> dict:
        try:
            return read_spec_decode_counters(llm)
        except Exception:  # noqa: BLE001 - AR engines: no counters
            return {}

    context, batch, kind = cell
    setup = SETUPS[spec["setup"]]
    run = RunSpec.parse(spec["run"])
    pool_spec = PoolSpec.from_json(spec["sweep"])
    pool = request_pool(setup, context, batch, kind, pool_spec, tokenizer)
    temperature = spec["temperature"]

    def params(req: Request, max_tokens: int | None = None):
        return SamplingParams(temperature=temperature, max_tokens=max_tokens or req.max_tokens,
                              ignore_eos=True, detokenize=False,
                              output_kind=RequestOutputKind.DELTA)

    t0 = time.perf_counter()
    for group in priming_groups(pool, spec["prime"], context - pool_spec.tails[1]):
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in group],
                     [params(pool[0], 1)] * len(group), use_tqdm=False)
    prime_s = time.perf_counter() - t0
    before = spec_counters(llm)
    active_before = engine.call(engine_active_counters) if run.budget == "auto" else None
    tag = f"sweep-{context}x{batch}-{spec.get('repeat', 0)}-"
    trace_dir = os.environ.get("BENCH_E2E_GATE_TRACE") if run.budget == "auto" else None
    if trace_dir:
        llm.collective_rpc(engine_gate_trace_start)
    gate_before = (llm.collective_rpc(engine_gate_snapshot)[0] if run.budget == "auto"
                   else None)
    # steps here are mostly host-bound: the interpreter's speed and the CPU it ran on,
    # before and after, and the machine's load over the window
    python_ms, cpu, _ = engine.call(engine_host_speed)
    engine.call(engine_batch_count_start)
    cpu_before = host_cpu_state()
    if pause is not None and run.budget == "auto":
        hand_over = pause

        def pause(stepped_s: float) -> float:  # the gate times no step across a turn
            away = hand_over(stepped_s)
            if away > 0:
                llm.collective_rpc(engine_gate_skip_gap)
            return away
    # CUDA events around the runner's stages (evals/e2e_timing.py; read once at the end):
    # where the steps that prefill a refill spend their time, beside the decode steps
    engine.call(engine_timer_begin, None)
    try:
        got = drive(llm.llm_engine, pool, batch, params,
                    prompt_of=lambda r: TokensPrompt(prompt_token_ids=r.prompt), tag=tag,
                    pause=pause)
    finally:
        timed_steps = engine.call(engine_timer_end)
    host_cpu = host_cpu_delta(cpu_before, host_cpu_state())
    engine_mean_reqs = engine.call(engine_batch_count_take)
    python_ms_after, cpu_after, _ = engine.call(engine_host_speed)
    if trace_dir:
        from gate_trace import write

        write(llm.collective_rpc(engine_gate_trace_take)[0], trace_dir, spec["run"],
              context, batch, spec.get("repeat", 0))
    counters = counter_delta(before, spec_counters(llm))
    row = dict(spec_base_row(spec, cell), status=STATUS_OK, pool=len(pool),
               tokens=got["tokens"], decode_s=got["wall_s"], steps=got["steps"],
               finished=got["finished"], mean_in_flight=got["mean_in_flight"],
               slices=got["slices"], step_ms_median=got["step_ms_median"],
               refill_excess_ms=got["refill_excess_ms"],
               engine_mean_reqs=engine_mean_reqs,
               prime_s=prime_s, sweep=pool_spec.to_json(), python_ms=python_ms,
               python_ms_after=python_ms_after, cpu=cpu, cpu_after=cpu_after,
               **{f"host_{k}": v for k, v in host_cpu.items()})
    row["tokens_per_s"] = got["tokens"] / got["wall_s"] if got["wall_s"] else None
    row.update(split_by_prefill(timed_steps))
    drafts = counters.get("vllm:spec_decode_num_drafts", 0.0)
    accepted = counters.get("vllm:spec_decode_num_accepted_tokens", 0.0)
    row.update(drafts=drafts, accepted=accepted,
               draft_tokens=counters.get("vllm:spec_decode_num_draft_tokens", 0.0),
               acceptance_length=(1 + accepted / drafts) if drafts else None)
    if active_before is not None:
        after = engine.call(engine_active_counters)
        if after is not None:
            trees = after[1] - active_before[1]
            row["active_nodes_per_round"] = (after[0] - active_before[0]) / trees if trees \
                else None
        from e2e_sweep_report import gate_in_cell

        after_gate = llm.collective_rpc(engine_gate_snapshot)[0]
        row["gate"] = (gate_in_cell(gate_before, after_gate)
                       if gate_before is not None and after_gate is not None else after_gate)
    row["output_crc"] = output_crcs(got["outputs"])
    notes = []
    if setup.oracle:
        from e2e_oracle import next_token_permutation

        perm = next_token_permutation(llm.llm_engine.model_config.get_vocab_size())
        row.update(chain_mismatches(pool, got["outputs"], perm))
        if row["requests_off_chain"]:
            notes.append(f"{row['requests_off_chain']} requests left the target's own "
                         f"greedy chain (from output index {row['first_off_chain_index']})")
    row["note"] = "; ".join(notes)
    return row
