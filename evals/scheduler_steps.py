"""Host time of vLLM 0.26's scheduler per decode step, by KV-cache grouping.

Every step the engine core runs ``Scheduler.schedule`` and ``update_from_output`` on
the host before and after the GPU's work; at a large batch on a small or fast model
that host time bounds the step. This drives vLLM's own ``AsyncScheduler`` (as the V2
runner's engines use it) without a model: requests of ``prompt_len`` tokens are
prefilled, then decoded with ``num_spec_tokens`` drafts a step (placeholders, as with
async scheduling) of which ``accepted`` are accepted, over the KV-cache groups vLLM forms
for a target + drafter pair (``kv_cache_groups.vllm_groups``). CPU only; the times are
this machine's.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

__all__ = ["scheduler_step_ms"]

_CONFIG_MODEL = Path(__file__).resolve().parents[1] / "vllm_ddtree" / "checkpoints" / "target"


def _scheduler(groups: list, num_spec_tokens: int, max_num_reqs: int, max_model_len: int):
    """vLLM's ``AsyncScheduler`` over ``groups`` (prefix caching on, V2 runner), and
    the block hasher its requests take."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.structured_output import StructuredOutputManager

    # The method only sets num_spec_tokens; the scheduler treats drafts alike.
    spec = ({"method": "ngram", "num_speculative_tokens": num_spec_tokens,
             "prompt_lookup_max": 2} if num_spec_tokens else None)
    config = EngineArgs(model=str(_CONFIG_MODEL), max_num_seqs=max_num_reqs,
                        max_model_len=max_model_len, block_size=64,
                        max_num_batched_tokens=max(8192, max_num_reqs * max_model_len),
                        speculative_config=spec).create_engine_config()
    # What a GPU engine of this pair runs with (the CPU platform turns them off for MLA).
    config.cache_config.enable_prefix_caching = True
    config.scheduler_config.async_scheduling = True
    sizes = [g.kv_cache_spec.block_size for g in groups]
    # one pool for every group: room for every request's context in each
    blocks = 2 * len(groups) * max_num_reqs * (max_model_len // min(sizes) + 2)
    config.cache_config.num_gpu_blocks = blocks
    kv_config = kv_cache_utils.generate_scheduler_kv_cache_config([KVCacheConfig(
        num_blocks=blocks, kv_cache_tensors=[], kv_cache_groups=groups)])
    scheduler = AsyncScheduler(
        vllm_config=config, kv_cache_config=kv_config,
        structured_output_manager=StructuredOutputManager(config),
        block_size=math.lcm(*sizes), hash_block_size=math.gcd(*sizes), log_stats=True)
    scheduler.use_v2_model_runner = True
    kv_cache_utils.init_none_hash(sha256)
    return scheduler, kv_cache_utils.get_request_block_hasher(math.gcd(*sizes), sha256)


def scheduler_step_ms(groups: list, num_spec_tokens: int, num_reqs: int, steps: int = 120,
                      warmup: int = 40, prompt_len: int = 900, accepted: int = 2) -> float:
    """Median host milliseconds of ``schedule()`` + ``update_from_output()`` over
    ``steps`` decode steps of ``num_reqs`` requests (after ``warmup`` steps, which
    include the prefills), each step verifying ``num_spec_tokens`` drafts a request
    and accepting ``accepted`` of them (0 drafts: plain decoding)."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    new_tokens = (warmup + steps) * (1 + accepted) + num_spec_tokens + 1
    scheduler, hasher = _scheduler(groups, num_spec_tokens, num_reqs,
                                   prompt_len + new_tokens + num_spec_tokens + 64)
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    for i in range(num_reqs):
        prompt = [2 + (i * 7919 + j) % 4000 for j in range(prompt_len)]
        scheduler.add_request(Request(f"r{i}", prompt, params, pooling_params=None,
                                      block_hasher=hasher))
    times = []
    for _ in range(warmup + steps):
        start = time.perf_counter()
        out = scheduler.schedule()
        req_ids = list(out.num_scheduled_tokens)
        if len(times) >= warmup:  # the timed steps must be the decodes they claim
            counts = {len(out.scheduled_spec_decode_tokens.get(r, ())) for r in req_ids}
            if len(req_ids) != num_reqs or counts != {num_spec_tokens}:
                raise RuntimeError(
                    f"a timed step scheduled {len(req_ids)} of {num_reqs} requests with "
                    f"{sorted(counts)} drafts each, not {num_spec_tokens} (too few "
                    "warm-up steps for the prefills, or KV blocks)")
        sampled = []
        for req_id in req_ids:
            drafts = out.scheduled_spec_decode_tokens.get(req_id, ())
            if scheduler.requests[req_id].is_prefill_chunk:
                sampled.append([])
            else:
                sampled.append([7] * (1 + min(accepted, len(drafts))))
        scheduler.update_from_output(out, ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled))
        times.append(time.perf_counter() - start)
    decode = sorted(times[warmup:])
    return 1e3 * decode[len(decode) // 2]
