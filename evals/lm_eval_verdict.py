"""The verdict of ``evals/validate.py``: a paired bootstrap of the per-document metric
difference, DDTree minus plain decoding, against an equivalence margin.

Per task, the decision metric is ``PRIMARY_METRIC[task]`` (a task's first metric when
absent). For every document both runs scored, ``d_i = m_spec_i - m_base_i``; the
two-sided ``confidence`` bootstrap interval of their mean (``scipy.stats.bootstrap``,
percentile method, ``resamples`` resamples of the documents, fixed seed) is computed and
the task **PASSES** when its lower bound is above ``-margin`` (non-inferiority: DDTree
loses less than ``margin`` of the metric's 0..1 scale, at the one-sided level
``(1 + confidence) / 2``). Identical runs give ``d_i = 0``, an interval ``[0, 0]`` and a
PASS; a verifier that commits wrong tokens lowers exact answers and FAILS once the loss
is clearly above the margin. Documents whose generations part at a bf16 tie of plain
decoding (``evals/lm_eval_ties.py``, a fixed rule with a cap) are ``excused``: their
difference is set to 0 before the bootstrap, the document count unchanged.

Beside the interval, the verdict states how large a loss the sample can rule out: the
Stringer bound (as in statistical auditing) on the mean loss, at the same one-sided
level, from the documents DDTree made worse and not excused, each weighed by its loss
(``loss_bound``): ``1 - ((1 - confidence) / 2) ** (1 / n)`` when none is worse, 0.17 at
20 documents, below 0.05 from 72. A PASS whose bound is above the margin (``bounded``
false) with none worse says that no loss was seen, not that none larger than the margin
could hide in so few documents (the report names the documents needed); with some worse
it says how many. A task whose baseline sits at
its floor (HumanEval's pass@1 0 on the embedded pair) cannot show a loss at all, and a
graded metric against the ground truth (edit similarity) can move either way under a
lossy verifier; ``ddtree_target_agreement`` (exact match of plain decoding's own
continuation, 96 documents) is the task that catches one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

DEFAULT_MARGIN = 0.05
DEFAULT_CONFIDENCE = 0.95
DEFAULT_RESAMPLES = 2000
# The metric each task is judged on: exact answers where the pair scores well, a graded
# one (edit similarity) where exact matches are rare.
PRIMARY_METRIC = {
    "ddtree_humaneval": "pass@1",
    "ddtree_stdlib_completion": "edit_similarity",
    "ddtree_long_context": "edit_similarity",
    "ddtree_target_agreement": "exact_match",
    "ddtree_target_agreement_16k": "exact_match",
    "ddtree_synthetic": "exact_match",
    "ddtree_synthetic_16k": "exact_match",
    "ddtree_copy": "exact_match",
    "ddtree_copy_16k": "exact_match",
}


@dataclass
class PairedVerdict:
    """``metric``; ``docs`` paired; mean baseline / speculative metric (as scored); the
    mean difference and its bootstrap interval ``[low, high]`` after the ``excused``
    documents' differences are set to 0; ``changed`` documents whose metric differs
    (as scored); ``passed``."""

    metric: str
    docs: int
    baseline: float
    speculative: float
    mean_difference: float
    low: float
    high: float
    changed: int
    margin: float
    confidence: float
    passed: bool
    excused: int = 0
    loss_bound: float = float("nan")
    worse: int = 0  # documents made worse and not excused

    @property
    def bounded(self) -> bool:
        """Whether the documents rule out a loss as large as the margin
        (``loss_bound < margin``)."""
        return self.loss_bound < self.margin

    def docs_needed(self) -> int | None:
        """Documents, none worse, that bound the loss below the margin."""
        return docs_to_bound(self.margin, self.confidence)

    def bound_text(self) -> str:
        """The loss bound's clause: ``bounded below the margin`` or ``not bounded ...``
        (with none worse: no loss seen, and the documents that would bound it)."""
        if math.isnan(self.loss_bound):
            return ""
        level = (1 + self.confidence) / 2
        head = f"; the loss is at most {self.loss_bound:.3f} at {level:.1%} (Stringer bound; "
        if self.bounded:
            return head + "bounded below the margin)"
        if self.worse:
            return head + f"not bounded below the margin: {self.worse} documents worse)"
        needed = self.docs_needed()
        return head + ("not bounded below the margin: no loss seen" + (
            f", {needed} documents none worse would bound it)" if needed else ")"))

    def text(self) -> str:
        return (f"{self.metric} {self.baseline:.4f} -> {self.speculative:.4f}, difference "
                f"{self.mean_difference:+.4f} [{self.low:+.4f}, {self.high:+.4f}] "
                f"({self.confidence:.0%} bootstrap, {self.docs} docs, {self.changed} changed, "
                f"{self.excused} excused at ties; "
                f"PASS needs the lower bound > -{self.margin}){self.bound_text()}")


def docs_to_bound(margin: float, confidence: float = DEFAULT_CONFIDENCE) -> int | None:
    """The fewest documents, none worse, whose Stringer bound is below ``margin`` (None
    for a margin or confidence at the ends of 0..1, where no count does)."""
    alpha = (1 - confidence) / 2
    if not (0 < margin < 1 and 0 < alpha < 1):
        return None
    return math.floor(math.log(alpha) / math.log1p(-margin)) + 1


def stringer_bound(losses: np.ndarray, docs: int,
                   confidence: float = DEFAULT_CONFIDENCE) -> float:
    """Upper confidence bound, at the one-sided level ``(1 + confidence) / 2``, on the mean
    per-document loss of ``docs`` documents of which those in ``losses`` (float, each in
    (0, 1]: how much the metric fell) got worse: the Stringer bound,
    ``p(0) + sum_i (p(i) - p(i - 1)) * t_i`` over the losses ``t_i`` in decreasing order,
    ``p(i)`` the Clopper-Pearson upper bound of a rate with ``i`` events in ``docs``."""
    from scipy.stats import beta

    if docs < 1:
        raise ValueError(f"stringer_bound: docs={docs} is not allowed: at least 1")
    losses = np.sort(np.clip(np.asarray(losses, np.float64), 0.0, 1.0))[::-1]
    losses = losses[losses > 0]
    if losses.size > docs:
        raise ValueError(f"stringer_bound: {losses.size} losses among docs={docs} documents "
                         "is not allowed: at most one a document")
    level = (1 + confidence) / 2

    def upper(events: int) -> float:
        return 1.0 if events >= docs else float(beta.ppf(level, events + 1, docs - events))

    bound, previous = upper(0), upper(0)
    for i, loss in enumerate(losses, start=1):
        current = upper(i)
        bound += (current - previous) * float(loss)
        previous = current
    return min(bound, 1.0)


def bootstrap_interval(differences: np.ndarray, confidence: float = DEFAULT_CONFIDENCE,
                       resamples: int = DEFAULT_RESAMPLES, seed: int = 0
                       ) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of ``differences`` (float ``[n]``, n >= 1).
    All-equal differences have no spread: the interval is that value."""
    differences = np.asarray(differences, dtype=np.float64)
    if differences.size == 0:
        raise ValueError("bootstrap_interval: no paired documents")
    if np.all(differences == differences[0]):
        return float(differences[0]), float(differences[0])
    from scipy.stats import bootstrap

    result = bootstrap((differences,), np.mean, confidence_level=confidence,
                       n_resamples=resamples, method="percentile",
                       rng=np.random.default_rng(seed))
    ci = result.confidence_interval
    return float(ci.low), float(ci.high)


def primary_metric(task: str, metrics: list[str]) -> str:
    """The metric ``task`` is judged on."""
    metric = PRIMARY_METRIC.get(task, metrics[0] if metrics else None)
    if metric not in metrics:
        raise ValueError(f"task {task}: metric {metric!r} not among its metrics {metrics}")
    return metric


def paired_verdict(task: str, baseline: dict[int, dict[str, float]],
                   speculative: dict[int, dict[str, float]], margin: float = DEFAULT_MARGIN,
                   confidence: float = DEFAULT_CONFIDENCE,
                   resamples: int = DEFAULT_RESAMPLES,
                   excused: set[int] | frozenset[int] = frozenset()) -> PairedVerdict:
    """The verdict from per-document metrics ``{doc_id: {metric: value}}`` of both runs.
    Documents missing from either run FAIL the task (they cannot be paired). The
    ``excused`` doc ids (parted at a tie, ``lm_eval_ties.tie_divergences``) count with a
    difference of 0."""
    metrics = sorted({m for values in baseline.values() for m in values})
    metric = primary_metric(task, metrics)
    docs = sorted(baseline)
    unknown = set(excused) - set(docs)
    if unknown:
        raise ValueError(f"paired_verdict: excused={sorted(unknown)} is not allowed: "
                         f"doc ids of the baseline run ({len(docs)} documents)")
    missing = set(docs) ^ set(speculative)
    base = np.array([baseline[d][metric] for d in docs], dtype=np.float64)
    spec = np.array([speculative.get(d, {}).get(metric, np.nan) for d in docs], np.float64)
    if missing or not docs or np.isnan(spec).any():
        return PairedVerdict(metric, len(docs), float(np.mean(base)) if docs else np.nan,
                             np.nan, np.nan, np.nan, np.nan, len(missing), margin,
                             confidence, False)
    diff = spec - base
    changed = int(np.count_nonzero(diff))
    diff[[i for i, d in enumerate(docs) if d in excused]] = 0.0
    low, high = bootstrap_interval(diff, confidence, resamples)
    losses = -diff[diff < 0]
    bound = stringer_bound(losses, len(docs), confidence)
    return PairedVerdict(metric, len(docs), float(base.mean()), float(spec.mean()),
                         float(diff.mean()), low, high, changed, margin, confidence,
                         low > -margin, len(excused), bound, int(losses.size))
