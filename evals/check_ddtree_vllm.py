"""Tokens of a target + DFlash drafter under vLLM with ``method: ddtree`` (GPU), as JSON.

    python evals/check_ddtree_vllm.py --out tokens.json [--budget 32] [--graphs]
        [--temperature 0.8] [--method ar] [--extra-tokens 16] [--mixed]
        [--pair embedded|qwen3|deepseek_v3] [--kv-cache-groups one|hybrid] [--trace N]

``--method ar`` runs the target alone on the same runner (V2: its Sampler keys Gumbel
noise by (request seed, position); V1's per-request generators do not) and the same
attention backend (CUSTOM), the reference for sampled runs. Prompts: the code prompts
of ``check_pair_vllm.py``, or with ``--mixed`` 12 requests of 16..3000 tokens.

Runs the engine in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, one GPU:
uni-process executor) so that DDTree's counters (``DDTREE_STATE``) and the per-round
and trace hooks live where the model runner does; the front-end patch applies the
runner patches when ``LLM()`` builds a DDTree config (AR runs keep vLLM's own runner).
Records the mean acceptance length from DDTree's counters and from vLLM's
spec-decode metrics, per request the tokens committed per round, and the engine's
KV-cache grouping (``--kv-cache-groups``: one group or vLLM's hybrid manager; default
DDTree's choice, ``vllm_ddtree/kv_group_choice.py``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def spec_decode_metrics(llm) -> dict:
    """vLLM's counters (``vllm:spec_decode_*``); mean acceptance length is
    ``1 + accepted / drafts`` (``v1/spec_decode/metrics.py:113-114``)."""
    from vllm_ddtree.metrics import read_spec_decode_counters

    try:
        values: dict = read_spec_decode_counters(llm)
    except Exception as e:  # metrics are a cross-check only; DDTree's counters decide
        return {"error": repr(e), "mean_acceptance_length": None}
    drafts = values["vllm:spec_decode_num_drafts"]
    accepted = values["vllm:spec_decode_num_accepted_tokens"]
    values["mean_acceptance_length"] = 1 + accepted / drafts if drafts else None
    return values


def kv_cache_grouping(llm) -> dict:
    """The engine's ``disable_hybrid_kv_cache_manager`` as vLLM resolved it and the
    number of KV-cache groups its scheduler allocates (the engine core is in this
    process)."""
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    return {"disable_hybrid_kv_cache_manager":
            engine.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager,
            "kv_cache_groups": len(scheduler.kv_cache_config.kv_cache_groups)}


MIXED_PROMPT_TOKENS = [16, 40, 200, 600, 1200, 2000, 2600, 3000,  # greedy
                       24, 700, 1800, 2900]  # sampled (temperature MIXED_TEMPERATURE)
MIXED_MAX_TOKENS = [64, 48, 96, 32, 80, 64, 40, 72, 64, 56, 48, 64]
MIXED_SAMPLED_FROM = 8
MIXED_TEMPERATURE = 0.8


def mixed_prompts(tokenizer) -> tuple[list[list[int]], list[int]]:
    """12 prompts cut from standard-library source (present on every machine) to
    ``MIXED_PROMPT_TOKENS`` tokens, with ``MIXED_MAX_TOKENS`` new tokens each; requests
    ``MIXED_SAMPLED_FROM`` and later are sampled with a per-request seed."""
    import argparse as argparse_module
    import inspect
    import json as json_module

    text = "".join(inspect.getsource(m) for m in (argparse_module, json_module, inspect))
    ids = tokenizer.encode(text)
    prompts = [ids[1000 * i: 1000 * i + n] for i, n in enumerate(MIXED_PROMPT_TOKENS)]
    assert all(len(p) == n for p, n in zip(prompts, MIXED_PROMPT_TOKENS, strict=True))
    return prompts, list(MIXED_MAX_TOKENS)


def record_rounds() -> dict[str, list[int]]:
    """Tokens committed per verified tree, per vLLM request id (a host sync per step:
    for this check only)."""
    from vllm_ddtree.verify import verifier as verifier_mod

    rounds: dict[str, list[int]] = {}
    original_call = verifier_mod.DDTreeVerifier.__call__

    def recording_call(self, logits, input_batch, draft_logits=None):
        out = original_call(self, logits, input_batch, draft_logits)
        cu = input_batch.cu_num_logits[: input_batch.num_reqs + 1].tolist()
        sampled = out.num_sampled.tolist()
        for i, req_id in enumerate(input_batch.req_ids[: input_batch.num_reqs]):
            if cu[i + 1] - cu[i] > 1 and not req_id.startswith("_warmup_"):
                rounds.setdefault(req_id, []).append(sampled[i])
        return out

    verifier_mod.DDTreeVerifier.__call__ = recording_call
    return rounds


def install_trace(max_steps: int) -> list:
    """Record the first ``max_steps`` verify steps (debugging aid): per step the batch
    rows, linear and tree positions, ancestor bits, row tokens, the target's draws, the
    walk, and what the MLA backend saw (decode/prefill split, whose bits)."""
    from vllm_ddtree.attention_backends.mla_tree import backend as mla_backend
    from vllm_ddtree.attention_backends.tree_mask_state import TREE_MASK_STATE
    from vllm_ddtree.runtime_state import DDTREE_STATE
    from vllm_ddtree.verify import verifier as verifier_mod

    steps: list = []
    attn_calls: list = []
    original_call = verifier_mod.DDTreeVerifier.__call__
    original_mqa = mla_backend.TreeMLAImpl.forward_mqa

    def as_list(t):
        return t.detach().cpu().tolist()

    def traced_call(self, logits, input_batch, draft_logits=None):
        out = original_call(self, logits, input_batch, draft_logits)
        if len(steps) < max_steps:
            n = input_batch.num_tokens
            drawn, _, row_pos = self.draw_target_tokens(logits, input_batch)
            steps.append({
                "num_reqs": input_batch.num_reqs, "num_tokens": n,
                "query_start_loc": as_list(input_batch.query_start_loc[: input_batch.num_reqs + 1]),
                "cu_num_logits": as_list(input_batch.cu_num_logits),
                "idx_mapping": as_list(input_batch.idx_mapping),
                "input_ids": as_list(input_batch.input_ids[:n]),
                "linear_positions": as_list(input_batch.positions[:n]),
                "tree_positions": as_list(DDTREE_STATE.positions[:n]),
                "bits": as_list(TREE_MASK_STATE.ancestor_bits[:n]),
                "logits_indices": as_list(input_batch.logits_indices),
                "drawn": as_list(drawn), "row_positions": as_list(row_pos),
                "parents": as_list(DDTREE_STATE.parents[input_batch.idx_mapping.long()]),
                "depths": as_list(DDTREE_STATE.depths[input_batch.idx_mapping.long()]),
                "sampled": as_list(out.sampled_token_ids),
                "num_sampled": as_list(out.num_sampled),
                "attn": attn_calls[-1] if attn_calls else None,
            })
        return out

    def traced_mqa(self, q, kv_cache, attn_metadata, layer):
        if len(steps) < max_steps:
            d = attn_metadata.decode
            attn_calls.append({
                "q_rows": int((q[0] if isinstance(q, tuple) else q).shape[0]),
                "num_decodes": attn_metadata.num_decodes,
                "num_prefills": attn_metadata.num_prefills,
                "max_query_len": d.max_query_len,
                "bits_is_tree_state": d.ancestor_bits.data_ptr()
                == TREE_MASK_STATE.ancestor_bits.data_ptr(),
                "seq_lens": as_list(d.seq_lens),
            })
        return original_mqa(self, q, kv_cache, attn_metadata, layer)

    from vllm_ddtree.compact.reference import page_index
    from vllm_ddtree.draft import speculator as speculator_mod

    def slot_distance(pages, src, dst) -> float:
        """Summed |row(src) - row(dst)| over moves, in a [num_blocks, page, *row] view."""
        return float((pages[page_index(pages, src)].float()
                      - pages[page_index(pages, dst)].float()).abs().sum())

    compactions: list = []
    original_compact = speculator_mod.DDTreeSpeculator._compact_target_kv

    def traced_compact(self, slot_mappings, query_start_loc, kv_src_rows):
        record = None
        if len(compactions) < max_steps:
            groups = self.kv_cache_config.kv_cache_groups
            record = {
                "groups": [[type(g.kv_cache_spec).__name__, len(g.layer_names)] for g in groups],
                "target_layers_by_group": {str(k): v[:2] + [len(v)] for k, v in
                                           self._target_layers_by_group.items()},
                "kv_src_rows": as_list(kv_src_rows[:2]),
            }
            if self._target_layers_by_group:
                names = next(iter(self._target_layers_by_group.values()))
                src, dst = speculator_mod.path_compaction_slots(
                    slot_mappings[names[0]], query_start_loc, kv_src_rows)
                cache = self.vllm_config.compilation_config.static_forward_context[
                    names[0]].kv_cache
                rows = speculator_mod.kv_page_views(cache)[0]
                ok = src >= 0
                record.update(src=as_list(src[:8]), dst=as_list(dst[:8]),
                              cache_shape=list(cache.shape), cache_stride=list(cache.stride()))
                record["src_minus_dst_before"] = slot_distance(rows, src[ok], dst[ok])
        original_compact(self, slot_mappings, query_start_loc, kv_src_rows)
        if record is not None and "src" in record:
            record["src_minus_dst_after"] = slot_distance(rows, src[ok], dst[ok])
        if record is not None:
            compactions.append(record)

    speculator_mod.DDTreeSpeculator._compact_target_kv = traced_compact
    steps.append({"compactions": compactions})
    verifier_mod.DDTreeVerifier.__call__ = traced_call
    mla_backend.TreeMLAImpl.forward_mqa = traced_mqa
    return steps


def record_step_plan() -> dict[str, list]:
    """From now on, record the host's step plan (``vllm_ddtree.verify.shape.StepPlan``):
    per served verify step ``{num_reqs, drafted_before, cap, shape, uniform, prefill}``
    (``shape``: the drafts each request verifies, 0 after a propose without the
    drafter's pass; ``prefill``: the step's ``(requests, tokens, pairs)`` that are not
    decodes, ``uniform``: no such request), per propose ``{num_reqs, draft}``, and
    vLLM's kernel warm-up steps apart (``warm_up_steps``: ``{num_reqs, shape}``; they
    verify B whatever a schedule says), in order."""
    from vllm_ddtree.verify.shape import StepPlan

    seen: dict[str, list] = {"steps": [], "drafts": [], "warm_up_steps": []}
    step_shape, draft_next = StepPlan.step_shape, StepPlan.draft_next

    def recording_step_shape(self, num_reqs, prefill=(0, 0, 0), warm_up=False):
        before = self.drafted
        shape = step_shape(self, num_reqs, prefill, warm_up)
        if warm_up:  # vLLM's kernel warm-up verifies B whatever the schedule: not served
            seen["warm_up_steps"].append({"num_reqs": num_reqs, "shape": shape})
            return shape
        seen["steps"].append({"num_reqs": num_reqs, "drafted_before": before,
                              "cap": self.cap(num_reqs), "shape": shape,
                              "uniform": prefill[0] == 0, "prefill": list(prefill)})
        return shape

    def recording_draft_next(self, num_reqs, contexts=None):
        draft = draft_next(self, num_reqs, contexts)
        seen["drafts"].append({"num_reqs": num_reqs, "draft": draft})
        return draft

    StepPlan.step_shape, StepPlan.draft_next = recording_step_shape, recording_draft_next
    return seen


def gpu_memory_args() -> dict:
    """0.3 of the GPU by default. ``VLLM_DDTREE_TEST_KV_GIB`` fixes the KV cache size
    instead, which skips vLLM's start-up memory profiling: that profiling counts what
    other engines on the same GPU allocate meanwhile as its own (gpu_worker.py:529),
    so runs of several suites side by side on one GPU set it."""
    kv_gib = os.environ.get("VLLM_DDTREE_TEST_KV_GIB")
    if kv_gib:
        return {"kv_cache_memory_bytes": int(float(kv_gib) * 2**30),
                "gpu_memory_utilization": 0.05}
    return {"gpu_memory_utilization": 0.3}


def record_verify_dispatches() -> list[dict]:
    """From now on, append ``{num_reqs, num_tokens, uniform_token_count, mode}`` for
    every dispatch of the target's ``ModelCudaGraphManager`` (the verify forward's CUDA
    graph: FULL, PIECEWISE or NONE) to the returned list."""
    from e2e_timing import mode_name, wrap_inherited_dispatch
    from vllm.v1.worker.gpu.cudagraph_utils import ModelCudaGraphManager

    seen: list[dict] = []

    def note(desc, args, kwargs) -> None:
        num_reqs, num_tokens, uniform = args[:3]
        seen.append({"num_reqs": num_reqs, "num_tokens": num_tokens,
                     "uniform_token_count": uniform, "mode": mode_name(desc)})

    wrap_inherited_dispatch(ModelCudaGraphManager, note, owner=seen)
    return seen


def graph_config(llm) -> dict | None:
    """The engine's CUDA-graph setup as ``compare.eager_graphable_steps`` reads it:
    ``mode``, ``mixed_mode`` (the mode of batches that are not uniform decodes) and
    ``max_capture_size``; None where the engine has no such config."""
    config = getattr(getattr(getattr(llm, "llm_engine", None), "vllm_config", None),
                     "compilation_config", None)
    mode = getattr(config, "cudagraph_mode", None)
    if mode is None:
        return None
    return {"mode": mode.name, "mixed_mode": mode.mixed_mode().name,
            "max_capture_size": config.max_cudagraph_capture_size}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--budget", type=int, default=32, help="tree nodes B")
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--tp", type=int, default=1,
                        help="tensor_parallel_size (> 1: workers in their own processes, "
                             "so DDTree's in-process counters and per-round records are "
                             "empty; vLLM's metrics still count)")
    parser.add_argument("--auto", action="store_true",
                        help='ddtree_budget "auto": --budget is the maximum B')
    parser.add_argument("--cycle-budgets", default=None,
                        help="with --auto, a test of the adaptive machinery: the device "
                        "choice is replaced by these budgets in turn (comma-separated, "
                        "e.g. 1,4,0,3,16; 0: a plain decoding step), so verify shapes "
                        "below B, plain steps, shape changes and choices that differ "
                        "from the lagged shape all occur")
    parser.add_argument("--schedule", default=None,
                        help="num_speculative_tokens_per_batch_size as JSON, e.g. "
                        "'[[1, 2, 32], [3, 8, 0]]' (the tree budget per batch size)")
    parser.add_argument("--record-steps", action="store_true",
                        help="record the step plan: drafts verified per step, and whether "
                        "each propose drafted (the JSON's step_plan)")
    parser.add_argument("--verify-shape", choices=["adaptive", "fixed"], default=None,
                        help="with --auto: ddtree_verify_shape (default: vLLM-ddtree's, "
                        "adaptive at TP = 1)")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--extra-tokens", type=int, default=0,
                        help="generate this many tokens more than asked for (every prompt): "
                        "an AR reference that reaches past the end of the compared output, "
                        "for check_ddtree_oracle_vllm.py's oracle drafts")
    parser.add_argument("--graphs", action="store_true", help="CUDA graphs (default eager)")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--method", choices=["ddtree", "ar"], default="ddtree")
    parser.add_argument("--mixed", action="store_true",
                        help="12 prompts of 16..3000 tokens (stdlib source), varied max_tokens, "
                        "8 greedy then 4 seeded-sampled, max_num_seqs 8: requests arrive "
                        "while others run")
    parser.add_argument("--max-num-seqs", type=int, default=8,
                        help="vLLM's max_num_seqs (1: each request alone, the batch shape "
                        "of a witness run; tests/gpu/test_fp8_kv_vllm.py)")
    parser.add_argument("--pair", choices=["embedded", "qwen3", "deepseek_v3"],
                        default="embedded",
                        help="embedded trained pair, or a tiny random target (GQA Qwen3 / MLA "
                        "DeepSeek-V3) with a random mixed sliding/full DFlash drafter "
                        "(evals/tiny_pairs.py; token-id prompts, no tokenizer)")
    parser.add_argument("--kv-cache-groups", choices=["one", "hybrid"], default=None,
                        help="one: disable_hybrid_kv_cache_manager, all layers in one "
                        "KV-cache group (patches/unify_kv_block_size.py); hybrid: vLLM's "
                        "hybrid manager, a group per layer beside a sliding-window drafter "
                        "(default: DDTree's choice, vllm_ddtree/kv_group_choice.py)")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                        help="the models' dtype (float32: with the CUSTOM backend, eager; "
                        "greedy and seeded tokens then equal AR's exactly)")
    parser.add_argument("--kv-cache-dtype", default="auto",
                        help="vLLM's --kv-cache-dtype for target and drafter (fp8: e4m3)")
    parser.add_argument("--trace", type=int, default=0,
                        help="record the first N verify steps (rows, positions, bits, draws)")
    args = parser.parse_args()

    import vllm_ddtree
    from vllm_ddtree.patches import apply_all

    vllm_ddtree.register()

    from check_pair_vllm import PROMPTS
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_ddtree.demo.reference_engine import CHECKPOINTS
    from vllm_ddtree.runtime_state import DDTREE_STATE
    from vllm_ddtree.testing.compare import vllm_top2_gaps, vllm_top_logprobs

    trace = install_trace(args.trace) if args.trace else None
    rounds_by_req = record_rounds() if args.method == "ddtree" else {}
    step_plan = record_step_plan() if args.record_steps else None
    forced_budgets = None
    if args.cycle_budgets:
        # The test hook, applied here before LLM() builds the engine in this process
        # (at TP = 1 the in-graph choice is captured with it); TP workers get it below.
        from vllm_ddtree.testing.forced_budgets import force_budget_choices, parse_budgets

        forced_budgets = parse_budgets(args.cycle_budgets)
        force_budget_choices(forced_budgets)

    extra = {}
    max_num_seqs = args.max_num_seqs
    if args.pair == "embedded":
        target, drafter = CHECKPOINTS / "target", CHECKPOINTS / "drafter"
        tokenizer = AutoTokenizer.from_pretrained(target)
        prompts = [tokenizer.encode(p) for p in PROMPTS[: args.prompts]]
        max_tokens = [args.max_tokens] * len(prompts)
        if args.mixed:
            prompts, max_tokens = mixed_prompts(tokenizer)
    else:
        import tempfile
        from pathlib import Path

        from tiny_pairs import make_tiny_pair, random_prompts

        target, drafter = make_tiny_pair(args.pair, Path(tempfile.mkdtemp()))
        lengths = MIXED_PROMPT_TOKENS if args.mixed else [24] * args.prompts
        prompts = random_prompts(lengths)
        max_tokens = list(MIXED_MAX_TOKENS) if args.mixed else [args.max_tokens] * len(prompts)
        extra["skip_tokenizer_init"] = True
    max_tokens = [n + args.extra_tokens for n in max_tokens]
    if args.kv_cache_groups is not None:
        extra["disable_hybrid_kv_cache_manager"] = args.kv_cache_groups == "one"
    if args.kv_cache_dtype != "auto":
        extra["kv_cache_dtype"] = args.kv_cache_dtype
    spec = {"method": "ddtree", "model": str(drafter), "num_speculative_tokens": args.budget}
    if args.top_k is not None:
        spec["ddtree_top_k"] = args.top_k
    if args.schedule is not None:
        spec["num_speculative_tokens_per_batch_size"] = json.loads(args.schedule)
    if args.auto:
        spec["ddtree_budget"] = "auto"
        if args.verify_shape is not None:
            spec["ddtree_verify_shape"] = args.verify_shape
    if args.method == "ar":
        spec = None
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
        extra["attention_backend"] = "CUSTOM"
        if args.pair == "qwen3":  # CUSTOM = the GQA tree backend (set before register)
            from vllm_ddtree import settings
            from vllm_ddtree.attention_backends.registration import register_tree_backend

            settings.set_for_children("VLLM_DDTREE_TREE_BACKEND", "gqa")
            register_tree_backend("gqa")
    if args.tp > 1 and os.environ.get("VLLM_DDTREE_TP_NCCL_ONLY") == "1":
        # Machines with NVLink multicast off: vLLM's custom / symmetric-memory
        # all-reduce dies there with an illegal memory access in the TP=2 forward;
        # plain NCCL works.
        extra["disable_custom_all_reduce"] = True
        os.environ["VLLM_ALLREDUCE_USE_SYMM_MEM"] = "0"
        # vLLM 0.26 turns on FlashInfer's fused all-reduce + RMSNorm for TP > 1 on sm_90
        # (config/vllm.py enable_allreduce_rms_fusion); its IPC all-reduce faults there
        # too (the first op of the compiled forward).
        extra["compilation_config"] = {"pass_config": {"fuse_allreduce_rms": False}}
    # The MLA launcher's debug record of each distinct launch (its kernel kind first):
    # which kernels the target's verify took, for the JSON (engine in this process).
    logging.getLogger("vllm_ddtree.attention_backends.mla_tree.ops").setLevel(logging.DEBUG)
    llm = LLM(model=str(target), speculative_config=spec, enforce_eager=not args.graphs,
              dtype=args.dtype, max_model_len=4096, **gpu_memory_args(),
              max_num_seqs=max_num_seqs, seed=0, disable_log_stats=False,
              tensor_parallel_size=args.tp, **extra)
    if forced_budgets is not None and args.tp > 1:
        # TP workers run in their own processes and choose eagerly (BudgetPolicy.choose,
        # looked up every round): patch it there before the first generate.
        from vllm_ddtree.testing.forced_budgets import apply_in_worker

        llm.collective_rpc(apply_in_worker, args=(forced_budgets,))
    applied = apply_all()  # names of the patches active in this process
    # The target's graph dispatch of every step (engine in this process at TP = 1).
    verify_dispatches = record_verify_dispatches() if args.graphs and args.tp == 1 else None
    temperatures = [args.temperature] * len(prompts)
    if args.mixed:
        temperatures = [0.0 if i < MIXED_SAMPLED_FROM else MIXED_TEMPERATURE
                        for i in range(len(prompts))]
    def stops(i: int) -> dict:
        # Stops inside accepted paths: in the embedded mixed batch every third request
        # may end at EOS or at a blank line, not before its 4th token (min_tokens).
        if args.mixed and args.pair == "embedded" and i % 3 == 0:
            return dict(ignore_eos=False, min_tokens=4, stop=["\n\n"])
        return dict(ignore_eos=True)

    params = [SamplingParams(temperature=t, seed=1000 + i if t else None,
                             max_tokens=n, logprobs=5, **stops(i))
              for i, (n, t) in enumerate(zip(max_tokens, temperatures, strict=True))]
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
    result = []
    for prompt, out in zip(prompts, outputs, strict=True):
        completion = out.outputs[0]
        gaps = vllm_top2_gaps(completion.logprobs)
        # vLLM's internal request id is "<external id>-<8 hex>" (input_processor.py:240)
        committed = [n for rid, rounds in rounds_by_req.items()
                     if rid.rsplit("-", 1)[0] == out.request_id for n in rounds]
        result.append({"prompt": prompt, "tokens": list(completion.token_ids),
                       "committed_per_round": committed,
                       "temperature": params[len(result)].temperature,
                       "seed": params[len(result)].seed,
                       "text": completion.text, "stop_reason": completion.stop_reason,
                       "top2_gap": gaps,
                       "top_logprobs": vllm_top_logprobs(completion.logprobs),
                       "logprobs_len": len(completion.logprobs or [])})
    with open(args.out, "w") as f:
        json.dump({"mode": args.method, "budget": args.budget, "graphs": args.graphs,
                   "dtype": args.dtype,
                   "tp": args.tp,
                   "mixed": args.mixed, "max_num_seqs": max_num_seqs,
                   "extra_tokens": args.extra_tokens, "patches": applied, "outputs": result,
                   "ddtree_mean_acceptance_length": (
                       DDTREE_STATE.mean_acceptance_length() if DDTREE_STATE.enabled else None),
                   "auto": args.auto,
                   "mean_active_nodes": (
                       DDTREE_STATE.mean_active_nodes() if args.auto and DDTREE_STATE.enabled
                       else None),
                   "verify_dispatches": verify_dispatches, "step_plan": step_plan,
                   "graph_config": graph_config(llm) if args.graphs else None,
                   "schedule": json.loads(args.schedule) if args.schedule else None,
                   **kv_cache_grouping(llm),
                   "vllm_metrics": spec_decode_metrics(llm), "trace": trace,
                   "mla_kernels": mla_kernels_launched()}, f)
    from check_mla_backend import exit_now

    exit_now()


def mla_kernels_launched() -> list[str]:
    """The MLA tree-verify kernel kinds launched in this process ("gluon", "triton",
    "cascade"), from the launcher's once-per-launch debug record."""
    from vllm_ddtree.attention_backends.mla_tree import ops

    return sorted({key[0] for key in ops._LOGGED_LAUNCHES})


if __name__ == "__main__":
    main()
