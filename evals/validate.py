"""lm-eval validation: each task without speculation, then with DDTree; compare.

    python evals/validate.py --tasks ddtree_humaneval --limit 8 --max-gen-toks 64   # CPU
    python evals/validate.py                                   # the four default tasks, CPU
    python evals/validate.py --backend vllm \\
        --model-args '{"pretrained": "PATH/target", "dtype": "bfloat16"}' \\
        --speculative-config '{"method": "ddtree", "model": "PATH/drafter",
                               "num_speculative_tokens": 32}'             # GPU

Backends: ``ddtree-ref`` (reference engine, ``vllm_ddtree.evaluation.ref_lm``;
baseline ``method=ar``, then ``--method`` ddtree (or dflash) with ``--budget``),
and ``vllm`` (lm-eval's own ``vllm`` model; baseline without, then with
``speculative_config`` in its model args). Both runs go through
``lm_eval.simple_evaluate`` on the task YAMLs of ``evals/tasks``.

Per task: metrics of both runs, how many generations are identical, acceptance of
the speculative run (reference engine: mean committed tokens per round, mean
accepted depth, accepted-depth histogram from its ``RoundStats``; vLLM: its
spec-decode counters, see ``vllm_spec_decode_stats``), written to
``<out-dir>/lm_eval_<task>.md`` (``lm_eval_<task>_lossy<R>.md`` with
``--inject-lossy-rate R``); one ``PASS``/``FAIL`` line per task on stdout.
The verdict is a paired statistic (``evals/lm_eval_verdict.py``): the bootstrap
interval of the per-document metric difference, speculative minus baseline, on the
task's decision metric; PASS when its lower bound is above ``-margin``. Documents
whose generations part at a bf16 / fp16 tie of plain decoding count as unchanged, by a
fixed rule with a cap (``evals/lm_eval_ties.py``; vllm backend: the engines' own
generated token ids, recorded while lm-eval runs, and plain decoding's log-probs from one
prefill of its generated ids on the baseline engine; ddtree-ref: the reference engine's
token ids, and the prefill through its target; fp32 excuses nothing). Exit status 1
when a task fails.

``--inject-lossy-rate R`` (fault injection, evals only): the speculative run's verifier
commits the drafter's token instead of the target's in a fraction R of its rounds
(``vllm_ddtree.testing.lossy_verifier``); a correct validation FAILS it at 0.02.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO / "evals") not in sys.path:
    sys.path.insert(0, str(REPO / "evals"))

from cli_args import (  # noqa: E402
    device_arg,
    fraction,
    int_arg,
    json_object,
    positive_int,
)
from lm_eval_generated_ids import GenerationRecorder  # noqa: E402
from lm_eval_ties import (  # noqa: E402
    PlainLogprobs,
    TieExcusal,
    lm_eval_prompts,
    plain_reference,
    reference_logprobs,
    tie_divergences,
    ties_markdown,
)
from lm_eval_verdict import (  # noqa: E402
    DEFAULT_CONFIDENCE,
    DEFAULT_MARGIN,
    DEFAULT_RESAMPLES,
    PairedVerdict,
    paired_verdict,
)

from vllm_ddtree.config import MAX_BUDGET  # noqa: E402

TASKS_DIR = REPO / "evals" / "tasks"
TASKS = tuple(sorted(p.stem for p in TASKS_DIR.glob("*.yaml")))
DEFAULT_TASKS = ["ddtree_humaneval", "ddtree_stdlib_completion", "ddtree_long_context",
                 "ddtree_target_agreement"]
DEFAULT_OUT_DIR = REPO / "evals" / "results"
DEFAULT_BUDGET = 32
DTYPES = ("float32", "bfloat16", "float16")  # vllm_ddtree.evaluation.ref_args.DTYPES
METADATA_KEYS = {
    "long_context_tokens": "prompt length(s) of ddtree_long_context: an int, a list of "
    "ints or a comma-separated string of them",
    "long_context_docs": "documents per length of ddtree_long_context: an int >= 1",
    "synthetic_context_tokens": "prompt length of ddtree_synthetic_16k and "
    "ddtree_copy_16k: an int >= 1",
    "tokenizer": "the tokenizer that sizes long prompts (default: the target's)",
    "pretrained": "the target model (the vllm backend sets it from --model-args)",
}


@dataclass
class TaskRun:
    """One task under one configuration."""

    label: str
    metrics: dict[str, float]
    generations: dict[int, str]
    seconds: float
    acceptance: dict | None = None
    contexts: dict[int, str] = field(default_factory=dict)
    gen_kwargs: dict[int, dict] = field(default_factory=dict)
    # per doc id: the task's metrics of that document
    items: dict[int, dict[str, float]] = field(default_factory=dict)
    # vllm backend: the engine's generated token ids per doc id (lm_eval_generated_ids)
    generated_ids: dict[int, list[int]] = field(default_factory=dict)
    # plain decoding (vllm backend): its log-probs over its own generations, per doc id
    reference: dict[int, PlainLogprobs] = field(default_factory=dict)
    # the speculative run: where its generations part from plain decoding's, and the
    # documents the tie rule excuses
    ties: TieExcusal | None = None
    # per doc id: its kind where the task's documents have one (ddtree_synthetic*,
    # ddtree_copy*)
    kinds: dict[int, str] = field(default_factory=dict)


@dataclass
class TaskReport:
    """Baseline vs speculative run of one task, and the verdict."""

    task: str
    backend: str
    baseline: TaskRun
    speculative: TaskRun
    identical: int
    verdict: PairedVerdict
    settings: dict = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.verdict.passed

    @property
    def docs(self) -> int:
        return len(self.baseline.generations)

    def line(self) -> str:
        """The one-line verdict printed per task."""
        acc = self.speculative.acceptance or {}
        mean = acc.get("mean_committed_per_round") or acc.get("mean_acceptance_length")
        acc_text = f", {mean:.2f} tokens/round" if mean else ""
        return (f"{'PASS' if self.passed else 'FAIL'} {self.task} [{self.backend}]: "
                f"{self.verdict.text()}; {self.identical}/{self.docs} identical "
                f"generations{acc_text}")


def run_task(lm, task: str, limit: int | None, metadata: dict, gen_kwargs: dict | None,
             label: str) -> TaskRun:
    """``lm_eval.simple_evaluate`` of one task on the local task folder."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=False,
                          metadata=metadata)
    start = time.perf_counter()
    out = simple_evaluate(model=lm, tasks=[task], limit=limit, task_manager=manager,
                          log_samples=True, bootstrap_iters=0, gen_kwargs=gen_kwargs,
                          confirm_run_unsafe_code=True)
    seconds = time.perf_counter() - start
    metrics = {k.split(",")[0]: float(v) for k, v in out["results"][task].items()
               if k not in ("alias", "sample_len") and "_stderr" not in k
               and isinstance(v, (int, float))}
    generations = {s["doc_id"]: s["resps"][0][0] for s in out["samples"][task]}
    contexts = {s["doc_id"]: s["arguments"][0][0] for s in out["samples"][task]}
    gen_kwargs = {s["doc_id"]: dict(s["arguments"][0][1] or {}) for s in out["samples"][task]}
    items = {s["doc_id"]: {m: float(s[m]) for m in metrics if m in s}
             for s in out["samples"][task]}
    kinds = {s["doc_id"]: str(s["doc"]["kind"]) for s in out["samples"][task]
             if isinstance(s.get("doc"), dict) and "kind" in s["doc"]}
    return TaskRun(label, metrics, generations, seconds, contexts=contexts,
                   gen_kwargs=gen_kwargs, items=items, kinds=kinds)


def by_kind_markdown(baseline: TaskRun, speculative: TaskRun) -> list[str]:
    """Each metric's mean per document kind, both runs (a task whose documents have
    kinds: one kind can score well while the task's mean does not); no lines without
    kinds."""
    if not baseline.kinds:
        return []
    metrics = list(baseline.metrics)
    lines = ["", "## By kind", "",
             "| kind | docs | " + " | ".join(f"{m} ({run.label})" for m in metrics
                                            for run in (baseline, speculative)) + " |",
             "|---|---|" + "---|" * (2 * len(metrics))]
    for kind in dict.fromkeys(baseline.kinds.values()):
        docs = [d for d, k in baseline.kinds.items() if k == kind]
        cells = []
        for m in metrics:
            for run in (baseline, speculative):
                vals = [run.items[d][m] for d in docs if m in run.items.get(d, {})]
                cells.append(f"{sum(vals) / len(vals):.4f}" if vals else "n/a")
        lines.append(f"| {kind} | {len(docs)} | " + " | ".join(cells) + " |")
    return lines


def vllm_spec_decode_stats(lm) -> dict:
    """vLLM's spec-decode counters of lm-eval's ``vllm`` model (``lm.model`` is the
    ``vllm.LLM``; needs ``disable_log_stats: false``, which ``validate`` sets). Mean
    acceptance length = 1 + accepted / drafts; ``accepted_per_position[i]`` = drafts
    whose position ``i`` was accepted. Also DDTree's own counters (trees verified,
    accepted nodes) when the engine runs in this process. Counters are cumulative over
    the engine's life: ``validate`` takes differences per task (:func:`_stats_delta`)
    and forms the ratios from those."""
    stats: dict = {}
    try:
        for metric in lm.model.get_metrics():
            if metric.name.startswith("vllm:spec_decode_"):
                value = getattr(metric, "value", None)
                stats[metric.name] = value if value is not None else list(
                    getattr(metric, "values", []))
    except Exception as e:  # the hook must never fail a run
        stats["error"] = repr(e)
    try:
        from vllm_ddtree.runtime_state import DDTREE_STATE

        if DDTREE_STATE.enabled:
            stats["ddtree_num_drafts"] = int(DDTREE_STATE.num_drafts.item())
            stats["ddtree_accepted_sum"] = int(DDTREE_STATE.accepted_sum.item())
    except Exception as e:
        stats["ddtree_state_error"] = repr(e)
    return stats


def _stats_delta(before: dict, after: dict) -> dict:
    delta = {}
    for key, value in after.items():
        old = before.get(key)
        if isinstance(value, (int, float)) and isinstance(old, (int, float)):
            delta[key] = value - old
        elif isinstance(value, list) and isinstance(old, list) and len(old) == len(value):
            delta[key] = [a - b for a, b in zip(value, old, strict=True)]
        else:
            delta[key] = value
    drafts = delta.get("vllm:spec_decode_num_drafts")
    accepted = delta.get("vllm:spec_decode_num_accepted_tokens")
    if isinstance(drafts, (int, float)) and drafts and isinstance(accepted, (int, float)):
        delta["mean_acceptance_length"] = 1 + accepted / drafts
    ddtree_drafts = delta.get("ddtree_num_drafts")
    if isinstance(ddtree_drafts, int) and ddtree_drafts:
        delta["ddtree_mean_acceptance_length"] = 1 + delta["ddtree_accepted_sum"] / ddtree_drafts
    if "vllm:spec_decode_num_accepted_tokens_per_pos" in delta:
        delta["accepted_per_position"] = delta.pop("vllm:spec_decode_num_accepted_tokens_per_pos")
    return delta


def _free(lm) -> None:
    del lm
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:
        pass


def _record_ids(records: list[dict], key: str) -> dict[int, list[int]]:
    """``key``'s token ids per doc id from a ``DDTreeRefLM``'s ``records``."""
    return {r["doc_id"]: list(r[key]) for r in records}


def _run_ref(args, tasks: list[str], metadata: dict, gen_kwargs: dict | None):
    """Plain decoding, then the speculative method, per task on the reference engine;
    in bf16 / fp16 plain decoding's log-probs come from one prefill of each of its
    generations through the target (``hf_prompt_logprobs``), for the tie rule."""
    from hf_prompt_logprobs import HFPromptLogprobLLM

    from vllm_ddtree.evaluation.ref_lm import DDTreeRefLM, acceptance_summary, load_pair
    from vllm_ddtree.testing.compare import tie_gap_of
    from vllm_ddtree.testing.lossy_verifier import lossy_reference

    pair = load_pair(args.pretrained, args.drafter, args.dtype, args.device)
    tie_gap = tie_gap_of(args.dtype)
    common = {"pair": pair, "seed": args.seed, "threads": args.threads}
    spec_label = args.method if args.method != "ddtree" else f"ddtree B={args.budget}"
    runs = {"baseline": {}, "speculative": {}}
    for task in tasks:
        # Both models first: a bad speculative setting fails before the baseline runs.
        base_lm = DDTreeRefLM(method="ar", **common)
        spec_lm = DDTreeRefLM(method=args.method, budget=args.budget, top_k=args.top_k,
                              **common)
        base = run_task(base_lm, task, args.limit, metadata, gen_kwargs, "ar (no speculation)")
        base.acceptance = acceptance_summary(base_lm.records)
        base.generated_ids = _record_ids(base_lm.records, "generated_ids")
        if tie_gap > 0:  # fp32 excuses nothing: no prefill needed
            base.reference = reference_logprobs(
                HFPromptLogprobLLM(pair.target), pair.tokenizer,
                _record_ids(base_lm.records, "prompt_ids"), base.generations,
                base_lm.max_length, base.generated_ids)
        runs["baseline"][task] = base
        with lossy_reference(args.inject_lossy_rate, args.lossy_seed) as lossy:
            run = run_task(spec_lm, task, args.limit, metadata, gen_kwargs, spec_label)
        run.acceptance = acceptance_summary(spec_lm.records)
        run.generated_ids = _record_ids(spec_lm.records, "generated_ids")
        if args.inject_lossy_rate:
            run.acceptance["lossy_rounds_corrupted"] = lossy["corrupted"]
        run.ties = tie_divergences(pair.tokenizer, base.generations, run.generations,
                                   base.reference, tie_gap, base.generated_ids,
                                   run.generated_ids)
        runs["speculative"][task] = run
    return runs, {"pair": pair.label.replace(f"{REPO}/", ""), "method": args.method,
                  "budget": args.budget, "top_k": args.top_k, "dtype": args.dtype,
                  "device": args.device, "tie_gap": tie_gap}


def _run_vllm(args, tasks: list[str], metadata: dict, gen_kwargs: dict | None):
    """Baseline engine for every task, then the speculative engine (two engines
    in turn; the first is freed before the second starts). While the baseline engine
    lives, it prefills each of its own generations for plain decoding's log-probs
    (``lm_eval_ties.plain_reference``), which the tie rule judges divergences by. Both
    engines' generated token ids are recorded while lm-eval runs (``GenerationRecorder``):
    the tie rule compares, and the prefill takes, those rather than re-encoded text."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # The baseline on DDTree's runner too: the paired difference is then speculation's
    # alone. On vLLM's V1 runner the plain run's prefill already parted from the V2
    # DDTree run's first token at 16k in bf16 (3 of 24 documents).
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
    from lm_eval.api.registry import get_model
    from vllm.compilation.monitor import set_cudagraph_capturing_enabled

    from vllm_ddtree.patches import apply_all
    from vllm_ddtree.testing.compare import tie_gap_of
    from vllm_ddtree.testing.lossy_verifier import apply_in_worker, apply_lossy_verifier

    applied = apply_all()
    model_args = {"disable_log_stats": False, **args.model_args}
    spec = speculative_config_of(args)
    tie_gap = None
    # Only DDTree's verifier is patched: the baseline engine does not use it.
    apply_lossy_verifier(args.inject_lossy_rate, args.lossy_seed)
    runs = {"baseline": {}, "speculative": {}}
    for key, extra, label in (("baseline", {}, "no speculation"),
                              ("speculative", {"speculative_config": spec},
                               f"speculative_config {json.dumps(spec)}")):
        # vLLM's V1 runner leaves capturing disabled when it is done
        # (gpu_model_runner.py:6831) and the V2 runner never enables it, so a second
        # engine in this process could not capture its CUDA graphs. (Two `lm_eval`
        # commands, as users run them, are two processes.)
        set_cudagraph_capturing_enabled(True)
        lm = get_model("vllm").create_from_arg_obj({**model_args, **extra})
        if extra and args.inject_lossy_rate:  # an engine core in its own process too
            lm.model.collective_rpc(apply_in_worker,
                                    args=(args.inject_lossy_rate, args.lossy_seed))
        if tie_gap is None:  # the dtype the engine resolved ("auto" included)
            tie_gap = tie_gap_of(lm.model.llm_engine.model_config.dtype)
        for task in tasks:
            before = vllm_spec_decode_stats(lm) if extra else {}
            with GenerationRecorder(lm.model) as recorder:
                run = run_task(lm, task, args.limit, metadata, gen_kwargs, label)
            prompts = lm_eval_prompts(lm, run.contexts, run.gen_kwargs, run.generations)
            run.generated_ids = recorder.doc_ids(lm.tokenizer, prompts, run.generations)
            if extra:
                run.acceptance = _stats_delta(before, vllm_spec_decode_stats(lm))
                base = runs["baseline"][task]
                run.ties = tie_divergences(lm.tokenizer, base.generations, run.generations,
                                           base.reference, tie_gap, base.generated_ids,
                                           run.generated_ids)
            elif tie_gap > 0:  # fp32 excuses nothing: no prefill needed
                run.reference = plain_reference(lm, run.contexts, run.gen_kwargs,
                                                run.generations, run.generated_ids)
            runs[key][task] = run
        _free(lm)
    return runs, {"model_args": model_args, "speculative_config": spec,
                  "patches_applied": applied, "tie_gap": tie_gap}


def compare(task: str, backend: str, baseline: TaskRun, speculative: TaskRun,
            settings: dict, margin: float = DEFAULT_MARGIN,
            confidence: float = DEFAULT_CONFIDENCE,
            resamples: int = DEFAULT_RESAMPLES) -> TaskReport:
    """The paired verdict (:func:`lm_eval_verdict.paired_verdict`) on the documents'
    metrics, the documents ``speculative.ties`` excuses counted as unchanged; identical
    generations (per doc id) are counted for the report."""
    identical = sum(baseline.generations[d] == speculative.generations.get(d)
                    for d in baseline.generations)
    excused = speculative.ties.excused if speculative.ties else set()
    verdict = paired_verdict(task, baseline.items, speculative.items, margin, confidence,
                             resamples, excused)
    settings = {**settings, "margin": margin, "confidence": confidence,
                "resamples": resamples}
    return TaskReport(task, backend, baseline, speculative, identical, verdict, settings)


def _short(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[:limit] + " ..."


def report_markdown(report: TaskReport, command: str) -> str:
    """The ``lm_eval_<task>.md`` text of one task."""
    b, s = report.baseline, report.speculative
    lines = [f"# lm-eval validation: `{report.task}` ({report.backend})", "",
             f"**{'PASS' if report.passed else 'FAIL'}**: {report.verdict.text()}. "
             f"{report.identical}/{report.docs} generations identical. Baseline "
             f"{report.verdict.metric}: {report.verdict.baseline:.4f}.", "",
             f"command: `{command}`", "",
             "settings: `" + json.dumps(report.settings, default=str) + "`", "",
             "| run | " + " | ".join(b.metrics) + " | seconds |",
             "|---|" + "---|" * (len(b.metrics) + 1)]
    for run in (b, s):
        values = " | ".join(f"{run.metrics.get(k, float('nan')):.4f}" for k in b.metrics)
        lines.append(f"| {run.label} | {values} | {run.seconds:.1f} |")
    lines += by_kind_markdown(b, s)
    acc = s.acceptance or {}
    lines += ["", "## Acceptance of the speculative run", ""]
    if "depth_histogram" in acc:
        mean_c, mean_d = acc["mean_committed_per_round"], acc["mean_accepted_depth"]
        lines += [
            "Reference engine `RoundStats`, prefill excluded, rounds up to the stop "
            "sequence only.", "",
            f"- mean committed tokens per round: {mean_c:.3f}" if mean_c is not None
            else "- mean committed tokens per round: n/a (no rounds)",
            f"- mean accepted depth: {mean_d:.3f}" if mean_d is not None
            else "- mean accepted depth: n/a",
            f"- rounds: {acc['rounds']}, tokens: {acc['tokens']}, requests: {acc['requests']} "
            f"(longest prompt: {acc['prompt_tokens_max']} tokens)",
            f"- decode seconds: {acc['seconds']:.1f} (no speculation: "
            f"{(b.acceptance or {}).get('seconds', float('nan')):.1f})", "",
            "| accepted depth | rounds |", "|---|---|",
            *[f"| {d} | {n} |" for d, n in acc["depth_histogram"].items()],
        ]
    elif acc:
        lines += ["vLLM's spec-decode counters and DDTree's own (`vllm_spec_decode_stats`), "
                  "differences over this task:", "", "```", json.dumps(acc, indent=1, default=str),
                  "```"]
    else:
        lines.append("none recorded")
    differing = [d for d in b.generations if b.generations[d] != s.generations.get(d)]
    lines += ["", f"## Differing generations ({len(differing)})", ""]
    if s.ties is not None:
        lines += ties_markdown(s.ties)
    for d in differing[:5]:
        lines += [f"doc {d}, baseline:", "````", _short(b.generations[d]), "````",
                  "speculative:", "````", _short(s.generations.get(d, "<missing>")), "````"]
    if b.generations:
        first = min(b.generations)
        lines += ["", f"## Generation of doc {first} (baseline)", "", "````",
                  _short(b.generations[first], 1000), "````"]
    return "\n".join(lines) + "\n"


def validate(tasks: list[str], backend: str = "ddtree-ref", args=None,
             out_dir: Path | None = DEFAULT_OUT_DIR, command: str = "") -> list[TaskReport]:
    """Check the arguments (:func:`check_args`), then run, compare and (with
    ``out_dir``) write the reports; returns them."""
    args = args or parse_args([])
    args = argparse.Namespace(**{**vars(args), "tasks": tasks, "backend": backend,
                                 "out_dir": args.out_dir if out_dir is None else out_dir})
    check_args(args)
    metadata = dict(args.metadata or {})
    gen_kwargs = {"max_gen_toks": args.max_gen_toks} if args.max_gen_toks else None
    if backend == "ddtree-ref":
        if args.pretrained:
            metadata.setdefault("tokenizer", args.pretrained)
        runs, settings = _run_ref(args, tasks, metadata, gen_kwargs)
    elif backend == "vllm":
        metadata.setdefault("pretrained", args.model_args.get("pretrained"))
        runs, settings = _run_vllm(args, tasks, metadata, gen_kwargs)
    settings.update(limit=args.limit, max_gen_toks=args.max_gen_toks, metadata=metadata,
                    inject_lossy_rate=args.inject_lossy_rate)
    reports = []
    for task in tasks:
        report = compare(task, backend, runs["baseline"][task], runs["speculative"][task],
                         settings, args.margin, args.confidence, args.resamples)
        reports.append(report)
        if out_dir is not None:
            out_dir.mkdir(parents=True, exist_ok=True)
            # A fault-injection run keeps the exact run's report beside its own.
            suffix = f"_lossy{args.inject_lossy_rate:g}" if args.inject_lossy_rate else ""
            (out_dir / f"lm_eval_{task}{suffix}.md").write_text(
                report_markdown(report, command))
    return reports


def _bad(option: str, value, allowed: str) -> ValueError:
    """The error for ``option value``, saying what is allowed."""
    return ValueError(f"argument {option}: {value!r} is not allowed: {allowed}")


def check_args(args: argparse.Namespace) -> None:
    """What argparse types cannot see: the tasks (local task YAMLs), ``--metadata``,
    the output folder, and per backend the models and their fit (ddtree-ref: the
    reference model's arguments; vllm: ``--model-args`` and the speculative config,
    DDTree keys included). Fills the ``--budget`` default. Raises ``ValueError``
    naming the option and the value; reads config files only."""
    for task in args.tasks:
        if task not in TASKS:
            raise _bad("--tasks", task, "one of " + ", ".join(TASKS))
    _check_metadata(args.metadata or {})
    _check_out_dir(Path(args.out_dir))
    if args.backend == "ddtree-ref":
        _check_ref_backend(args)
    elif args.backend == "vllm":
        _check_vllm_backend(args)
    else:
        raise _bad("--backend", args.backend, "'ddtree-ref' or 'vllm'")


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _check_metadata(metadata: dict) -> None:
    """Known keys only (``METADATA_KEYS``); long-context lengths and counts >= 1."""
    for key in metadata:
        if key not in METADATA_KEYS:
            raise _bad("--metadata", key, "keys " + ", ".join(METADATA_KEYS))
    lengths = metadata.get("long_context_tokens")
    if lengths is not None:
        items = lengths.replace(" ", "").split(",") if isinstance(lengths, str) else (
            lengths if isinstance(lengths, list) else [lengths])
        items = [int(v) if isinstance(v, str) and v.isdigit() else v for v in items]
        if not items or not all(_is_count(v) for v in items):
            raise _bad("--metadata", {"long_context_tokens": lengths},
                       METADATA_KEYS["long_context_tokens"] + ", each >= 1")
    for key in ("long_context_docs", "synthetic_context_tokens"):
        value = metadata.get(key)
        if value is not None and not _is_count(value):
            raise _bad("--metadata", {key: value}, "an int >= 1")


def _check_out_dir(path: Path) -> None:
    """A directory, or a path that can become one, where files can be written."""
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        raise _bad("--out-dir", str(path), f"a directory ({existing} is a file)")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise _bad("--out-dir", str(path), f"a writable directory ({existing} is not)")


def _check_ref_backend(args: argparse.Namespace) -> None:
    """No vllm-only options; the reference model's arguments
    (:func:`vllm_ddtree.evaluation.ref_args.check_ref_lm_args`); a CUDA device that
    exists."""
    for option, value in (("--model-args", args.model_args),
                          ("--speculative-config", args.speculative_config)):
        if value:
            raise _bad(option, value, "only with --backend vllm (ddtree-ref takes "
                       "--pretrained, --drafter, --method, --budget, --top-k)")
    if args.budget is None:
        args.budget = DEFAULT_BUDGET
    if args.device.startswith("cuda"):
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = int(args.device.partition(":")[2] or 0)
        if index >= count:
            raise _bad("--device", args.device, f"'cpu' (this machine has {count} CUDA "
                       "devices)" if not count else f"cpu or cuda:0..{count - 1}")
    from vllm_ddtree.evaluation.ref_args import check_ref_lm_args

    check_ref_lm_args({"pretrained": args.pretrained, "drafter": args.drafter,
                       "method": args.method, "budget": args.budget, "top_k": args.top_k,
                       "seed": args.seed, "dtype": args.dtype, "device": args.device,
                       "threads": args.threads})


def _check_vllm_backend(args: argparse.Namespace) -> None:
    """``--model-args`` with ``pretrained`` and without ``speculative_config``; no
    ddtree-ref options; the speculative config (:func:`speculative_config_of`)
    parsed as vLLM's front end will (:func:`vllm_ddtree.config.split_ddtree_spec`)
    and its drafter checked against the target's config.json when both are local."""
    pretrained = args.model_args.get("pretrained")
    if not isinstance(pretrained, str) or not pretrained:
        raise _bad("--model-args", args.model_args,
                   'a JSON object with "pretrained" (the target model)')
    if "speculative_config" in args.model_args:
        raise _bad("--model-args", args.model_args, "no speculative_config: give it as "
                   "--speculative-config (the baseline runs without it)")
    for option, value, instead in (("--pretrained", args.pretrained, '"pretrained" in '
                                    "--model-args"),
                                   ("--top-k", args.top_k, '"ddtree_top_k" in '
                                    "--speculative-config")):
        if value is not None:
            raise _bad(option, value, f"left out with --backend vllm: give {instead}")
    spec = speculative_config_of(args)
    _check_speculative_config(spec, pretrained)
    if args.inject_lossy_rate and spec.get("method") != "ddtree":
        raise _bad("--inject-lossy-rate", args.inject_lossy_rate, "0 unless the speculative "
                   "method is 'ddtree' (the lossy hook patches DDTree's verifier)")


def speculative_config_of(args: argparse.Namespace) -> dict:
    """The speculative run's ``speculative_config``: ``--speculative-config``, else
    DDTree with ``--drafter`` and ``--budget``."""
    if args.speculative_config is not None:
        for option, value in (("--drafter", args.drafter), ("--budget", args.budget)):
            if value is not None:
                raise _bad(option, value, "left out when --speculative-config is given "
                           "(its `model` and `num_speculative_tokens`)")
        return dict(args.speculative_config)
    if not args.drafter:
        raise ValueError("argument --speculative-config: required with --backend vllm "
                         "unless --drafter is given")
    budget = DEFAULT_BUDGET if args.budget is None else args.budget
    return {"method": "ddtree", "model": args.drafter, "num_speculative_tokens": budget}


def _check_speculative_config(spec: dict, pretrained: str) -> None:
    """A ``method``; DDTree keys as the plugin's front end parses them; for DFlash and
    DDTree a drafter whose config.json fits the target's (both local directories)."""
    from vllm_ddtree.config import DDTreeConfigError, check_drafter_for_target, split_ddtree_spec
    from vllm_ddtree.drafter_config import DrafterConfigError

    method = spec.get("method")
    if not isinstance(method, str) or not method:
        raise _bad("--speculative-config", spec, 'a JSON object with a "method" string')
    try:
        split_ddtree_spec(spec)
        model = spec.get("model")
        local = isinstance(model, str) and (method == "ddtree" or Path(model).is_dir())
        if method in ("ddtree", "dflash") and local and Path(pretrained, "config.json").is_file():
            from transformers import AutoConfig

            check_drafter_for_target(model, AutoConfig.from_pretrained(pretrained))
    except (DDTreeConfigError, DrafterConfigError) as err:
        raise ValueError(f"argument --speculative-config: {err}") from None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (also the defaults of ``validate``), every one checked here
    (:func:`check_args`): a bad value exits with status 2 before any model loads."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", nargs="+", choices=TASKS, default=DEFAULT_TASKS)
    p.add_argument("--backend", choices=["ddtree-ref", "vllm"], default="ddtree-ref")
    p.add_argument("--limit", type=positive_int, default=None,
                   help="first N documents per task")
    p.add_argument("--max-gen-toks", type=positive_int, default=None,
                   help="override the tasks' value")
    p.add_argument("--metadata", type=json_object, default=None,
                   help='task metadata as JSON, e.g. \'{"long_context_tokens": 16384}\'; '
                   "keys: " + ", ".join(METADATA_KEYS))
    p.add_argument("--method", choices=["ddtree", "dflash"], default="ddtree",
                   help="speculative method of the ddtree-ref run")
    p.add_argument("--budget", type=int_arg(1, MAX_BUDGET), default=None,
                   help=f"DDTree tree nodes per round, 1..{MAX_BUDGET} (default "
                   f"{DEFAULT_BUDGET}; vllm backend: only with --drafter)")
    p.add_argument("--top-k", type=positive_int, default=None)
    p.add_argument("--pretrained", default=None, help="target dir (default: embedded pair)")
    p.add_argument("--drafter", default=None, help="DFlash drafter dir (default: embedded)")
    p.add_argument("--dtype", choices=DTYPES, default="float32")
    p.add_argument("--device", type=device_arg, default="cpu")
    p.add_argument("--threads", type=positive_int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-args", type=json_object, default={},
                   help="vllm backend: lm-eval model args, a JSON object with `pretrained`")
    p.add_argument("--speculative-config", type=json_object, default=None,
                   help="vllm backend: JSON (default: ddtree with --drafter and --budget)")
    p.add_argument("--margin", type=fraction, default=DEFAULT_MARGIN,
                   help="equivalence margin on the decision metric (0..1): PASS when the "
                   "bootstrap interval of speculative minus baseline lies above -margin")
    p.add_argument("--confidence", type=fraction, default=DEFAULT_CONFIDENCE,
                   help="two-sided level of the bootstrap interval")
    p.add_argument("--resamples", type=positive_int, default=DEFAULT_RESAMPLES,
                   help="bootstrap resamples")
    p.add_argument("--inject-lossy-rate", type=fraction, default=0.0,
                   help="fault injection: fraction of the speculative run's rounds whose "
                   "verifier commits the drafter's token (validation must FAIL at 0.02)")
    p.add_argument("--lossy-seed", type=int, default=0,
                   help="seed of the rounds --inject-lossy-rate corrupts")
    p.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    p.add_argument("--verbose", action="store_true", help="lm-eval's warnings and info")
    args = p.parse_args(argv)
    try:
        check_args(args)
    except ValueError as err:
        p.error(str(err))
    return args


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    args = parse_args(argv)
    if not args.verbose:
        logging.getLogger("lm_eval").setLevel(logging.ERROR)
    command = "python evals/validate.py " + " ".join(sys.argv[1:] if argv is None else argv)
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))  # `patches` for the vllm backend
    reports = validate(args.tasks, args.backend, args, args.out_dir, command)
    for report in reports:
        print(report.line())
    return 0 if all(r.passed for r in reports) else 1


if __name__ == "__main__":
    raise SystemExit(main())
