"""Host synchronisations per decode step of DDTree under vLLM, with DFlash and AR
baselines (GPU; torch.profiler trace of a window of decode steps).

    python evals/count_host_syncs.py [--methods ddtree dflash ar] [--budget 32]
        [--top-k K] [--auto [--pin-arm S]] [--steps 20] [--warmup-steps 8] [--prompts 4] [--graphs]
        [--with-stack/--no-with-stack] [--out evals/results/host_syncs.md]
        [--setup trained|kimi8|kimi64|v2lite [--context 16384] [--gpu-mem 0.6]]
        [--refill-every N [--refill-tail T]]

``--setup kimi8`` / ``kimi64``: the Kimi-K2-shaped target and drafter of
``evals/bench_e2e.py`` with dummy weights and random prompts of ``--context`` tokens
(where does a long-context round's time go); ``--setup v2lite`` the DeepSeek-V2-Lite-
shaped target with the rank oracle's drafter (acceptance as the embedded drafter's);
default: the embedded trained pair.

``--refill-every N``: continuous batching's refills inside the window: every N profiled
steps the oldest request is aborted and a new one added (the first prompt's tokens but
its last ``--refill-tail``, which are new: a shared prefix from the prefix cache and a
tail to prefill, as ``bench_e2e.py --sweep`` serves them); the steps right after an
add are counted apart (``REFILL_STEP_NAME``), a second row per method: where the steps
that prefill a refill spend their host and GPU time, beside the decode steps.

Each method runs in its own child process (a fresh ``LLM``; vLLM does not free a GPU
engine reliably inside one process) with the engine in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, uni-process executor): the model runner, the
DDTree speculator and verifier run in the process that profiles. The child adds the
prompts to ``llm.llm_engine``, runs ``--warmup-steps`` engine steps (prefill, first
rounds, Triton JIT), then profiles ``--steps`` engine steps with ``torch.profiler``
(CPU + CUDA activities), each inside a ``count_host_syncs::step`` range. (vLLM's own
``LLM.start_profile`` with a ``profiler_config`` profiles the same process here, but
cannot mark step boundaries or DDTree's functions.)

Counted from the Chrome trace, per step:

* host syncs: CUDA runtime / driver calls that block the host on the device
  (``cudaStreamSynchronize``, ``cudaDeviceSynchronize``, ``cudaEventSynchronize``,
  their ``cu*`` driver forms, the synchronous ``cudaMemcpy*`` calls, and the implicitly
  synchronizing ``cudaFree`` / pinned-host allocations). ``.item()``
  and blocking copies show up as a ``cudaMemcpyAsync`` + ``cudaStreamSynchronize``;
* device-to-host copies: GPU ``Memcpy DtoH`` activities (``Device -> Pageable``
  ones block the host; ``Device -> Pinned`` ones are vLLM's asynchronous output
  copies);
* kernel launches: ``cudaLaunchKernel`` / ``cudaLaunchKernelExC`` / ``cuLaunchKernel``
  / ``cuLaunchKernelEx`` and CUDA-graph replays (``cudaGraphLaunch``,
  ``cuGraphLaunch``), by API: many individual launches where one graph launch was
  expected mean a region runs eagerly;
* GPU time: the summed duration of GPU activities (kernels, memcpys, memsets), each
  charged to the runtime call that launched it (``args.correlation``; the kernels of
  a graph replay to its ``cudaGraphLaunch``), and the kernels that take the most.

Each event is attributed to the innermost range of this script's annotations
(``ddtree::propose``, ``ddtree::verify``, ``ddtree::verify_inputs``, ...,
``vllm::execute_model``, ``vllm::sample_tokens``, ``vllm::dflash_propose``,
``vllm::rejection_sampler``) and, with ``--with-stack``, to the innermost Python
frame outside torch. vLLM copies the sampled tokens to the host once per step and
waits for them: the DFlash and AR rows are that baseline. A DDTree round without
host syncs of its own shows the same per-step syncs as DFlash and none attributed
to ``ddtree::*`` ranges.

The CPU-side complement is ``tests/test_no_host_sync.py`` (a dispatch-mode detector
over the round's functions). The trace counting is ``host_sync_trace.py`` (pure
Python, tested on CPU: ``evals/tests/test_host_sync_trace.py``).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from host_sync_trace import (
    REFILL_STEP_NAME,
    STEP_NAME,
    TOP_REGION_KERNELS,
    count_trace,
    format_markdown,
    load_trace_events,
)

# ----------------------------------------------------------------------------------
# GPU run (child process per method)
# ----------------------------------------------------------------------------------

_MLA_TREE = "vllm_ddtree.attention_backends.mla_tree."
# Functions wrapped in a record_function range: (module, class or None, attribute, label);
# the "class" may be any module attribute (a Triton kernel, whose ``run`` is wrapped).
ANNOTATED = [
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner", "execute_model",
     "vllm::execute_model"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner", "sample_tokens",
     "vllm::sample_tokens"),
    ("vllm.v1.worker.gpu.spec_decode.dflash.speculator", "DFlashSpeculator", "propose",
     "vllm::dflash_propose"),
    ("vllm.v1.worker.gpu.spec_decode.rejection_sampler", "RejectionSampler", "__call__",
     "vllm::rejection_sampler"),
    ("vllm_ddtree.draft.speculator", "DDTreeSpeculator", "propose", "ddtree::propose"),
    ("vllm_ddtree.draft.speculator", "DDTreeSpeculator", "_compact_target_kv",
     "ddtree::compact_kv"),
    ("vllm_ddtree.draft.speculator", "DDTreeSpeculator", "_generate_draft",
     "ddtree::generate_draft"),
    ("vllm_ddtree.verify.verifier", "DDTreeVerifier", "__call__", "ddtree::verify"),
    ("vllm_ddtree.verify.verifier", "DDTreeVerifier", "draw_target_tokens", "ddtree::draw"),
    ("vllm_ddtree.verify.verifier", "DDTreeVerifier", "walk", "ddtree::walk"),
    ("vllm_ddtree.runtime_state", None, "verify_inputs_", "ddtree::verify_inputs"),
    ("vllm_ddtree.runtime_state", "DDTreeRuntimeState", "store_trees_",
     "ddtree::store_trees"),
    # An MLA target's attention layers, eager in a step that prefills a refill: vLLM's
    # prefill path (a cached context gathered and up-projected) and each backend's
    # decode / verify launch (FLASH_ATTN_MLA also takes short extends there).
    ("vllm.model_executor.layers.attention.mla_attention", "MLAAttention", "forward_impl",
     "vllm::mla_attention"),
    ("vllm.model_executor.layers.attention.mla_attention", "MLACommonBaseImpl", "forward_mha",
     "vllm::mla_prefill"),
    ("vllm.v1.attention.backends.mla.flashattn_mla", "FlashAttnMLAImpl", "forward_mqa",
     "vllm::mla_decode"),
    ("vllm_ddtree.attention_backends.mla_tree.backend", "TreeMLAImpl", "forward_mqa",
     "ddtree::mla_decode"),
    # inside it: the launcher's checks and buffers, and Triton's launch of each kernel
    # (its JIT's argument binding and cache lookup, then the driver's launch)
    (_MLA_TREE + "ops", None, "prepare_outputs", "ddtree::mla_prepare"),
    (_MLA_TREE + "ops", None, "_launch_gluon", "ddtree::mla_gluon"),
    (_MLA_TREE + "cascade", None, "mla_tree_verify_cascade", "ddtree::mla_cascade"),
    (_MLA_TREE + "gluon_kernel", "_mla_tree_fwd_gluon_kernel", "run", "triton::gluon_run"),
    (_MLA_TREE + "kernels", "_mla_tree_fwd_kernel", "run", "triton::tree_run"),
    (_MLA_TREE + "kernels", "_mla_tree_merge_kernel", "run", "triton::merge_run"),
    # ddtree_budget: "auto" only: what it adds to a round on the host.
    ("vllm_ddtree.budget.policy", "BudgetPolicy", "observe_round", "ddtree::observe_round"),
    ("vllm_ddtree.budget.policy", "BudgetPolicy", "choose", "ddtree::budget_choice"),
    ("vllm_ddtree.verify.shape", "VerifyShapeChooser", "record_", "ddtree::shape_record"),
    ("vllm_ddtree.verify.shape", "VerifyShapeChooser", "next_shape", "ddtree::next_shape"),
]
# --methods: "ddtree-auto" is DDTree with ddtree_budget "auto" (--budget the maximum),
# beside fixed-budget "ddtree" in one run; --auto turns every "ddtree" into it.
METHODS = ("ddtree", "ddtree-auto", "dflash", "ar")



def install_annotations(clock=None) -> list[str]:
    """Wrap ``ANNOTATED`` functions in ``torch.profiler.record_function`` ranges, or with
    ``clock`` (``refill_profile.RangeClock``) in its host timers instead (no profiler
    op a call: the unprofiled window's split); returns the labels installed (a missing
    module or attribute is skipped)."""
    import importlib

    import torch

    installed = []
    for module_name, class_name, attr, label in ANNOTATED:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        owner = getattr(module, class_name, None) if class_name else module
        original = getattr(owner, attr, None) if owner is not None else None
        if original is None or getattr(original, "_count_host_syncs", False):
            continue

        if clock is not None:
            wrapper = clock.wrap(original, label)
        else:
            def wrapper(*args, _original=original, _label=label, **kwargs):
                with torch.profiler.record_function(_label):
                    return _original(*args, **kwargs)

        functools.update_wrapper(wrapper, original)
        wrapper._count_host_syncs = True
        setattr(owner, attr, wrapper)
        installed.append(label)
    return installed


def speculative_config(method: str, budget: int, top_k: int | None, drafter: str,
                       auto: bool = False, drafter_block: int = 16):
    """vLLM's ``speculative_config`` for ``method`` (``METHODS``; None for AR)."""
    if method == "ddtree-auto":
        method, auto = "ddtree", True
    if method == "ar":
        return None
    if method == "dflash":
        # vLLM's chain drafts block_size - 1 tokens.
        return {"method": "dflash", "model": drafter,
                "num_speculative_tokens": drafter_block - 1}
    spec = {"method": "ddtree", "model": drafter, "num_speculative_tokens": budget}
    if top_k is not None:
        spec["ddtree_top_k"] = top_k
    if auto:
        spec["ddtree_budget"] = "auto"
    return spec


def method_label(spec: str, args: argparse.Namespace, block_size: int) -> str:
    """A report's name for ``--methods`` entry ``spec`` (``METHOD[@BACKEND]``)."""
    method, _, backend = spec.partition("@")
    auto = args.auto or method == "ddtree-auto"
    label = {"ar": "AR", "dflash": f"DFlash (vLLM, {block_size - 1} drafts)"}.get(
        method, (f"DDTree auto (B <= {args.budget})" if auto else f"DDTree B={args.budget}")
        + (f" top_k={args.top_k}" if args.top_k else "")
        + (f", gate pinned to {args.pin_arm}" if args.pin_arm is not None else ""))
    return f"{label}, {backend}" if backend else label


def method_spec(text: str) -> str:
    """``--methods`` entry: ``METHOD`` or ``METHOD@BACKEND`` (an attention backend for
    ``ar`` / ``dflash``, e.g. ``ar@FLASH_ATTN_MLA``)."""
    method, at, backend = text.partition("@")
    if method not in METHODS:
        raise argparse.ArgumentTypeError(
            f"{text!r}: the method must be one of {', '.join(METHODS)}")
    if at and (method not in ("ar", "dflash") or not backend):
        raise argparse.ArgumentTypeError(
            f"{text!r}: '@BACKEND' names the attention backend of ar or dflash "
            "(DDTree picks its own), e.g. ar@FLASH_ATTN_MLA")
    return text


def refill_prompt(first: list[int], tail: int, ids: tuple[int, int]):
    """``i -> prompt``: ``first`` with its last ``tail`` tokens replaced by seeded tokens
    in ``[ids[0], ids[1])`` (seed ``i``): the prefix is cached, the tail is prefilled."""
    if not 0 < tail < len(first):
        raise ValueError(f"--refill-tail {tail} is not allowed: 1 .. {len(first) - 1} "
                         f"(the prompts have {len(first)} tokens)")

    def prompt(i: int) -> list[int]:
        import random

        rng = random.Random(i)
        return list(first[:-tail]) + [rng.randrange(*ids) for _ in range(tail)]

    return prompt


def run_child(args: argparse.Namespace) -> None:
    """Profile ``args.child`` and write ``count_trace``'s dict to ``args.child_out``."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
    import torch

    import vllm_ddtree

    vllm_ddtree.register()
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_ddtree.demo.reference_engine import CHECKPOINTS

    clock = None
    if args.cprofile:
        from refill_profile import RangeClock

        clock = RangeClock()
    labels = install_annotations(clock)
    method, _, backend_choice = args.child.partition("@")
    if args.pin_arm is not None:
        from gate_variants import apply_pinned_gate

        apply_pinned_gate(args.pin_arm)
    from e2e_models import SETUPS, prepare_setup, random_prompts

    setup = SETUPS[args.setup]
    tokens_per_step = {"ar": 1, "dflash": setup.block_size}.get(method, args.budget + 1)
    steps_tokens = (args.warmup_steps + args.steps + 4) * tokens_per_step
    extra = {}
    if setup.dummy:  # Kimi-shaped pair, dummy weights: random prompts of --context tokens
        models = prepare_setup(setup, Path(args.model_dir),
                               min_positions=args.context + steps_tokens + 64)
        target, drafter = models.target, str(models.drafter)
        prompts = random_prompts(args.prompts, args.context, setup.random_ids, seed=0)
        max_model_len = args.context + steps_tokens + 64
        extra.update(load_format="dummy", skip_tokenizer_init=True)
    else:
        target, drafter = CHECKPOINTS / "target", str(CHECKPOINTS / "drafter")
        tokenizer = AutoTokenizer.from_pretrained(target)
        from check_pair_vllm import PROMPTS

        prompts = [tokenizer.encode(PROMPTS[i % len(PROMPTS)]) for i in range(args.prompts)]
        max_model_len = 4096
    backend = backend_choice or {"ar": args.ar_backend,
                                 "dflash": args.dflash_backend}.get(method, "auto")
    if backend != "auto":
        extra["attention_backend"] = backend
    if setup.oracle:  # the rank oracle's structured target and drafter logits
        from drafter_ranks import load_table
        from e2e_oracle import install_rank_oracle

        install_rank_oracle(load_table())
    num_seqs = max(8, args.prompts)
    need = num_seqs * tokens_per_step + (args.refill_tail if args.refill_every else 0)
    if args.graphs and need > 512:
        # vLLM captures decode graphs up to min(2 x max_num_seqs x (1 + spec), 512) tokens:
        # a larger verify batch (and one beside a refill's prefill) would run without
        # them, as evals/e2e_child.py raises it for the sweep
        extra["compilation_config"] = {"max_cudagraph_capture_size": -(-need // 16) * 16}
        if need > 8192:
            extra["max_num_batched_tokens"] = -(-need // 16) * 16
    llm = LLM(model=str(target),
              speculative_config=speculative_config(method, args.budget, args.top_k, drafter,
                                                   args.auto, setup.block_size),
              enforce_eager=not args.graphs, dtype="bfloat16",
              gpu_memory_utilization=args.gpu_mem, max_model_len=max_model_len,
              max_num_seqs=num_seqs, seed=0, **extra)
    engine = llm.llm_engine
    max_tokens = min(max_model_len - max(map(len, prompts)) - 1, steps_tokens)
    for i, prompt in enumerate(prompts):
        params = SamplingParams(temperature=args.temperature, max_tokens=max_tokens,
                                ignore_eos=True, detokenize=not setup.dummy,
                                seed=1000 + i if args.temperature else None)
        engine.add_request(f"sync-{i}", TokensPrompt(prompt_token_ids=prompt), params)
    for _ in range(args.warmup_steps):
        engine.step()
    torch.cuda.synchronize()

    refill = refill_prompt(prompts[0], args.refill_tail, setup.random_ids if setup.dummy
                           else (0, 1000))
    running = [f"sync-{i}" for i in range(len(prompts))]

    def next_step(i: int) -> str:
        """Add step ``i``'s refill (every ``--refill-every`` steps); the step's kind."""
        if not (args.refill_every and i and i % args.refill_every == 0):
            return STEP_NAME
        engine.abort_request([running.pop(0)])
        running.append(f"refill-{i}")
        params = SamplingParams(temperature=args.temperature, max_tokens=max_tokens,
                                ignore_eos=True, detokenize=not setup.dummy)
        engine.add_request(running[-1], TokensPrompt(prompt_token_ids=refill(i)), params)
        return REFILL_STEP_NAME

    label = method_label(args.child, args, setup.block_size)
    if args.cprofile:
        from refill_profile import profile_steps

        results = profile_steps(engine, next_step, args.steps, Path(args.child_out).parent,
                                args.child, label, clock)
        Path(args.child_out).write_text(json.dumps(results))
        sys.stdout.flush()
        os._exit(0)  # vLLM engines can hang at interpreter exit
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities, with_stack=args.with_stack) as prof:
        for i in range(args.steps):
            with torch.profiler.record_function(next_step(i)):
                engine.step()
    unfinished = engine.get_num_unfinished_requests()
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(args.keep_trace) if args.keep_trace else Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = load_trace_events(trace)
        result = count_trace(events, region_top=args.region_kernels)
        refills = (count_trace(events, REFILL_STEP_NAME, region_top=args.region_kernels)
                   if args.refill_every else None)
    result["method"] = method
    result["label"] = label
    if refills is not None:
        refills.update(method=method, label=result["label"] + ", steps that prefill a refill")
        result["label"] += ", decode steps"
    notes = [f"setup: {setup.name}" + (f", {args.context}-token prompts" if setup.dummy else ""),
             f"attention backend: {backend}", f"annotations: {len(labels)}"]
    if unfinished < len(prompts):
        notes.append(f"only {unfinished}/{len(prompts)} requests still running at the end "
                     "of the window: later steps had smaller batches")
    result["note"] = "; ".join(notes)
    if refills is not None:
        refills["note"] = (f"every {args.refill_every} steps a request aborted and one added: "
                           f"a {len(prompts[0]) - args.refill_tail}-token prefix from the "
                           f"prefix cache, {args.refill_tail} new tokens")
    Path(args.child_out).write_text(json.dumps([result] + ([refills] if refills else [])))
    sys.stdout.flush()
    os._exit(0)  # vLLM engines can hang at interpreter exit


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", nargs="+", type=method_spec,
                   default=["ddtree", "dflash", "ar"],
                   help=f"any of {', '.join(METHODS)}; ar@BACKEND / dflash@BACKEND with an "
                        "attention backend of their own (else --ar-backend / "
                        "--dflash-backend)")
    p.add_argument("--budget", type=int, default=32, help="DDTree tree nodes B")
    p.add_argument("--top-k", type=int, default=None, help="DDTree children per node")
    p.add_argument("--auto", action="store_true",
                   help='DDTree with ddtree_budget "auto" (--budget is the maximum)')
    p.add_argument("--pin-arm", type=int, default=None, metavar="S",
                   help="with --auto: the step gate pinned to its largest arm <= S every "
                        "step (evals/gate_variants.py): auto's steps below its maximum")
    p.add_argument("--steps", type=int, default=20, help="profiled engine steps")
    p.add_argument("--warmup-steps", type=int, default=8,
                   help="engine steps before the window (prefill, JIT, first rounds)")
    p.add_argument("--prompts", type=int, default=4, help="concurrent requests")
    p.add_argument("--temperature", type=float, default=0.0)
    graphs = p.add_mutually_exclusive_group()
    graphs.add_argument("--graphs", dest="graphs", action="store_true",
                        help="CUDA graphs (vLLM's default mode)")
    graphs.add_argument("--enforce-eager", dest="graphs", action="store_false",
                        help="eager (default): every launch and sync is visible")
    p.set_defaults(graphs=False)
    p.add_argument("--with-stack", action=argparse.BooleanOptionalAction, default=True,
                   help="record Python stacks to attribute syncs to call sites")
    p.add_argument("--ar-backend", default="CUSTOM",
                   help="AR attention backend ('auto' = vLLM's choice; default CUSTOM, the "
                   "tree MLA backend DDTree's target uses)")
    p.add_argument("--dflash-backend", default="auto",
                   help="DFlash attention backend ('auto' = vLLM's choice)")
    p.add_argument("--setup", choices=["trained", "kimi8", "kimi64", "v2lite"],
                   default="trained",
                   help="model pair (evals/e2e_models.py): the embedded pair, or a "
                   "Kimi-K2-shaped target with dummy weights")
    p.add_argument("--context", type=int, default=1024,
                   help="prompt tokens of the Kimi-shaped setups (random ids)")
    p.add_argument("--gpu-mem", type=float, default=0.3, help="gpu_memory_utilization")
    p.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(),
                                                       "ddtree_e2e_models"),
                   help="where the Kimi-shaped config files are written")
    p.add_argument("--region-kernels", type=int, default=TOP_REGION_KERNELS,
                   help="kernels listed per region (costliest first)")
    p.add_argument("--refill-every", type=int, default=0, metavar="N",
                   help="abort the oldest request and add one every N profiled steps (0: "
                        "never); those steps are counted apart")
    p.add_argument("--refill-tail", type=int, default=128, metavar="T",
                   help="new tokens of a refilled prompt (the rest: the prefix cache's)")
    p.add_argument("--cprofile", action="store_true",
                   help="cProfile instead of torch.profiler: each step's wall time in an "
                        "unprofiled window (with the host ms inside each annotated range), "
                        "then host time by Python function, decode steps apart from steps "
                        "that prefill a refill (refill_profile.py; the .prof files beside "
                        "--out)")
    p.add_argument("--out", default="evals/results/host_syncs.md")
    p.add_argument("--keep-trace", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child", type=method_spec, help=argparse.SUPPRESS)
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.pin_arm is not None and not args.auto:
        p.error(f"--pin-arm {args.pin_arm} pins auto's step gate: add --auto")
    if args.refill_every < 0:
        p.error(f"--refill-every must be >= 0 (0: no refills), got {args.refill_every}")
    if args.pin_arm is not None and args.pin_arm < 0:
        p.error(f"--pin-arm must be >= 0 (0: plain decoding), got {args.pin_arm}")
    return args


def child_command(args: argparse.Namespace, method: str, out: Path) -> list[str]:
    """Command line of the child process that profiles ``method``."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", method,
           "--child-out", str(out), "--budget", str(args.budget), "--steps", str(args.steps),
           "--warmup-steps", str(args.warmup_steps), "--prompts", str(args.prompts),
           "--temperature", str(args.temperature), "--ar-backend", args.ar_backend,
           "--dflash-backend", args.dflash_backend, "--setup", args.setup,
           "--context", str(args.context), "--gpu-mem", str(args.gpu_mem),
           "--model-dir", args.model_dir, "--region-kernels", str(args.region_kernels),
           "--refill-every", str(args.refill_every), "--refill-tail", str(args.refill_tail),
           "--graphs" if args.graphs else "--enforce-eager",
           "--with-stack" if args.with_stack else "--no-with-stack"]
    if args.cprofile:
        cmd.append("--cprofile")
    if args.top_k is not None:
        cmd += ["--top-k", str(args.top_k)]
    if args.auto:
        cmd.append("--auto")
    if args.pin_arm is not None:
        cmd += ["--pin-arm", str(args.pin_arm)]
    return cmd


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        run_child(args)
        return
    command = "python evals/count_host_syncs.py " + shlex.join(
        sys.argv[1:] if argv is None else argv)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for method in args.methods:
            out = Path(tmp) / f"{method.replace('@', '_')}.json"
            proc = subprocess.run(child_command(args, method, out), timeout=1800)
            if proc.returncode != 0 or not out.exists():
                results.append({"method": method, "label": method, "steps": 0, "syncs": 0,
                                "dtoh": 0, "dtoh_pageable": 0, "ddtree_syncs": 0,
                                "ddtree_dtoh": 0, "per_step_syncs": [], "per_step_dtoh": [],
                                "outside_steps": {}, "sites": [], "launches": [],
                                "gpu_time": [], "top_kernels": [], "region_top_kernels": [],
                                "step_gpu_us": 0.0,
                                "note": f"child failed (exit code {proc.returncode})"})
            else:
                got = json.loads(out.read_text())
                results += got if isinstance(got, list) else [got]
            # Written after every run: a stage cut short keeps the runs it finished.
            if args.cprofile:
                from refill_profile import format_report

                report = format_report(results, command, Path(args.out).parent)
            else:
                report = format_markdown(results, command)
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(report + "\n")
    print(report)

if __name__ == "__main__":
    main()
