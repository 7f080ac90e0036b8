"""OpenAI-client requests of the ``vllm serve`` GPU suites (tests/gpu/test_ddtree_serve.py,
tests/gpu/test_serve_faults.py): one completion with a token-id prompt, read back as
token ids, text, finish reason and (optionally) logprobs, streamed or not."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

__all__ = ["choice_problems", "complete", "extra_field", "logprob_problems", "memory_args",
           "openai_client", "serving"]


def memory_args(default_utilization: float, kv_gib: str | None) -> list[str]:
    """``vllm serve`` memory arguments: a fixed KV cache of ``kv_gib`` GiB when given
    (the GPU suites pass their fixed-KV-cache size: no start-up memory profiling, so suites
    can share a GPU), else ``--gpu-memory-utilization default_utilization``."""
    if kv_gib:
        return ["--gpu-memory-utilization", "0.05",
                "--kv-cache-memory-bytes", str(int(float(kv_gib) * 2**30))]
    return ["--gpu-memory-utilization", str(default_utilization)]


@contextmanager
def serving(model: str | Path, log: Path, root: Path, *, speculative_config: dict | None,
            served_model_name: str, extra_args: Sequence[str],
            startup_timeout: float = 900.0) -> Iterator:
    """A started ``vllm serve`` (:func:`vllm_ddtree.testing.serve.start_server`) with
    ``root`` on ``PYTHONPATH``; stopped on exit, its log tail printed."""
    from vllm_ddtree.testing.serve import start_server

    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": f"{root}:" + os.environ.get("PYTHONPATH", "")}
    srv = start_server(model, log, speculative_config=speculative_config,
                       served_model_name=served_model_name, extra_args=extra_args, env=env,
                       startup_timeout=startup_timeout)
    print(f"server up on {srv.base_url}; log {log}")
    try:
        yield srv
    finally:
        srv.stop()
        print(f"--- server log tail ---\n{srv.log_tail(40)}")


@contextmanager
def openai_client(base_url: str, concurrency: int, timeout: float) -> Iterator:
    """An ``openai.OpenAI`` client of ``base_url`` (``.../v1``) with no retries, no
    HTTP(S)_PROXY between it and 127.0.0.1, and connections for ``concurrency`` threads
    plus a metrics watcher."""
    import httpx
    import openai

    http = httpx.Client(trust_env=False, timeout=timeout,
                        limits=httpx.Limits(max_connections=4 * concurrency,
                                            max_keepalive_connections=concurrency))
    with http:
        yield openai.OpenAI(base_url=base_url, api_key="EMPTY", max_retries=0,
                            timeout=timeout, http_client=http)


def extra_field(obj, name):
    """A vLLM field the OpenAI models do not declare (kept as a pydantic extra)."""
    value = getattr(obj, name, None)
    if value is None:
        value = (getattr(obj, "model_extra", None) or {}).get(name)
    return value


def complete(client, model: str, prompt: list[int], max_tokens: int, *,
             temperature: float = 0.0, seed: int | None = None, ignore_eos: bool = True,
             logprobs: int | None = None, stream: bool = False, n: int = 1,
             stop: list[str] | None = None, top_p: float | None = None,
             top_k: int | None = None, extra: dict | None = None,
             max_chunks: int | None = None) -> list[dict]:
    """One completion request to ``model`` with a token-id prompt; per choice:
    ``token_ids``, ``text``, ``finish_reason``, (non-streamed with logprobs)
    ``token_logprobs``, ``top_logprobs`` and ``tokens``, (streamed) ``chunks``,
    ``max_chunk_tokens`` and ``usage_tokens`` (whole request). ``extra`` adds vLLM
    request fields. ``max_chunks`` (streamed only): close the stream after that many
    chunks, which makes vLLM abort the request; the choices read so far are returned."""
    body = {"ignore_eos": ignore_eos, "return_token_ids": True, **(extra or {})}
    if top_k is not None:
        body["top_k"] = top_k
    if logprobs is not None:
        body["return_tokens_as_token_ids"] = True
    kwargs = dict(model=model, prompt=prompt, max_tokens=max_tokens,
                  temperature=temperature, n=n, extra_body=body)
    for name, value in (("seed", seed), ("logprobs", logprobs), ("stop", stop),
                        ("top_p", top_p)):
        if value is not None:
            kwargs[name] = value
    if not stream:
        resp = client.completions.create(**kwargs)
        out = []
        for choice in sorted(resp.choices, key=lambda c: c.index):
            item = {"token_ids": list(extra_field(choice, "token_ids") or []),
                    "text": choice.text, "finish_reason": choice.finish_reason}
            if logprobs is not None:
                item["token_logprobs"] = list(choice.logprobs.token_logprobs)
                item["top_logprobs"] = list(choice.logprobs.top_logprobs)
                item["tokens"] = list(choice.logprobs.tokens)
            out.append(item)
        return out
    chunks = client.completions.create(stream=True, stream_options={"include_usage": True},
                                       **kwargs)
    choices: dict[int, dict] = {}
    usage_tokens = None
    received = 0
    try:
        for chunk in chunks:
            received += 1
            if chunk.usage is not None:
                usage_tokens = chunk.usage.completion_tokens
            for choice in chunk.choices:
                item = choices.setdefault(choice.index, {"token_ids": [], "text": "",
                                                         "finish_reason": None, "chunks": 0,
                                                         "max_chunk_tokens": 0})
                ids = list(extra_field(choice, "token_ids") or [])
                item["token_ids"] += ids
                item["text"] += choice.text or ""
                item["chunks"] += 1
                item["max_chunk_tokens"] = max(item["max_chunk_tokens"], len(ids))
                if choice.finish_reason is not None:
                    item["finish_reason"] = choice.finish_reason
            if max_chunks is not None and received >= max_chunks:
                break
    finally:
        if max_chunks is not None:
            chunks.close()
    out = [choices[i] for i in sorted(choices)]
    for item in out:
        item["usage_tokens"] = usage_tokens
    return out


def logprob_problems(item: dict) -> list[str]:
    """Greedy: each committed token is the argmax of the logit row that drew it, so its
    logprob must be the largest of that position's top logprobs (DDTree maps each
    committed token to its tree row, ``verifier.committed_logit_rows``)."""
    problems = []
    for pos, (tok, lp, top) in enumerate(zip(item["token_ids"], item["token_logprobs"],
                                             item["top_logprobs"], strict=True)):
        best = max(top.values())
        if lp < best - 1e-3:
            problems.append(f"pos {pos}: token {tok} logprob {lp:.4f} < row max {best:.4f}")
        if item["tokens"][pos] != f"token_id:{tok}":
            problems.append(f"pos {pos}: logprobs token {item['tokens'][pos]} != {tok}")
    return problems


def choice_problems(req: dict, choices: list[dict], label: str,
                    check_logprobs: bool = True) -> list[str]:
    """What is wrong with the finished ``choices`` of ``req`` (:func:`complete`'s
    arguments: ``max_tokens``, ``n``, ``ignore_eos``, ``stop``, ``stream``, ``logprobs``,
    ``temperature``): the choice count, finish reasons, token counts (exactly
    ``max_tokens`` when EOS is ignored and no stop string is set), a streamed request's
    usage count and, greedy with logprobs and ``check_logprobs``, each token being its
    row's argmax. ``label`` starts each problem."""
    problems = []
    if len(choices) != req.get("n", 1):
        problems.append(f"{label}: {len(choices)} choices")
    for item in choices:
        count = len(item["token_ids"])
        if item["finish_reason"] not in ("length", "stop"):
            problems.append(f"{label}: finish_reason {item['finish_reason']}")
        if count > req["max_tokens"]:
            problems.append(f"{label}: {count} tokens")
        fixed_length = req.get("ignore_eos", True) and not req.get("stop")
        if fixed_length and (item["finish_reason"] != "length" or count != req["max_tokens"]):
            problems.append(f"{label}: ignore_eos gave {count} tokens, finish "
                            f"{item['finish_reason']}")
        if req.get("stream") and item["usage_tokens"] != sum(
                len(c["token_ids"]) for c in choices):
            problems.append(f"{label}: usage {item['usage_tokens']} tokens")
        if check_logprobs and req.get("logprobs") and not req.get("temperature"):
            problems += [f"{label}: {p}" for p in logprob_problems(item)]
    return problems
