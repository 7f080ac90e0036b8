"""DDTree's acceptance metrics, derived from vLLM's spec-decode counters.

The verifier reports, per request and round, ``num_sampled = a + 1`` committed tokens
(``a`` = accepted tree depth) against ``B`` scheduled tree nodes, so vLLM's
``SpecDecodingStats`` (``v1/spec_decode/metrics.py``) already hold DDTree's round
data: ``num_accepted_tokens`` sums the depths, ``num_accepted_tokens_per_pos[i]``
counts rounds of depth > i (vLLM fills positions ``0..a-1``), ``num_draft_tokens``
sums the tree nodes. Everything below is computed from those same counters, so
"committed = accepted depth + 1" holds by construction in every report.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# vLLM's scalar spec-decode counters (Prometheus names, without the _total suffix).
SPEC_DECODE_COUNTERS = (
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_accepted_tokens",
    "vllm:spec_decode_num_draft_tokens",
)


def read_spec_decode_counters(llm) -> dict[str, float]:
    """Current values of ``SPEC_DECODE_COUNTERS`` of an in-process ``vllm.LLM``
    (``llm.get_metrics()``, summed over label sets; 0 where absent, e.g. without
    speculation). Counters are cumulative over the engine's life."""
    totals = dict.fromkeys(SPEC_DECODE_COUNTERS, 0.0)
    for metric in llm.get_metrics():
        if metric.name in totals:
            totals[metric.name] += float(getattr(metric, "value", 0) or 0)
    return totals


@dataclass(frozen=True)
class DDTreeRoundSummary:
    """DDTree acceptance over a set of rounds (one round = one verified tree)."""

    rounds: int
    committed_tokens: int  # accepted depth + 1 per round, summed
    tree_nodes: int  # scheduled tree nodes, summed
    depth_histogram: tuple[int, ...]  # rounds with accepted depth 0, 1, 2, ...

    @property
    def mean_committed(self) -> float:
        """Tokens committed per round (vLLM's "mean acceptance length")."""
        return self.committed_tokens / self.rounds if self.rounds else float("nan")

    @property
    def mean_accepted_depth(self) -> float:
        """Accepted tree depth per round (= ``mean_committed - 1``)."""
        return (self.committed_tokens - self.rounds) / self.rounds if self.rounds else float("nan")

    @property
    def mean_tree_nodes(self) -> float:
        return self.tree_nodes / self.rounds if self.rounds else float("nan")

    def log_line(self) -> str:
        hist = ", ".join(f"{d}:{n}" for d, n in enumerate(self.depth_histogram) if n)
        return (f"DDTree metrics: rounds {self.rounds}, mean committed length "
                f"{self.mean_committed:.2f}, mean accepted depth {self.mean_accepted_depth:.2f}, "
                f"tree nodes/round {self.mean_tree_nodes:.1f}, accepted-depth histogram "
                f"{{{hist}}}")


def summarize_rounds(
    num_drafts: int,
    num_draft_tokens: int,
    num_accepted_tokens: int,
    accepted_per_pos: Sequence[int],
) -> DDTreeRoundSummary:
    """DDTree summary from vLLM's spec-decode counters (summed over any interval).

    Args:
        num_drafts: rounds (verified trees).
        num_draft_tokens: tree nodes scheduled, summed over rounds.
        num_accepted_tokens: accepted depths, summed over rounds.
        accepted_per_pos: ``[B]`` ints, rounds whose accepted depth exceeds each index.

    Raises:
        ValueError: if the counters are inconsistent (a depth count that grows with
            depth, or one that disagrees with ``num_accepted_tokens``): a wiring bug.
    """
    survivors = [num_drafts, *accepted_per_pos]
    histogram = [survivors[d] - survivors[d + 1] for d in range(len(accepted_per_pos))]
    histogram.append(survivors[-1])
    while len(histogram) > 1 and histogram[-1] == 0:
        histogram.pop()
    if any(n < 0 for n in histogram) or sum(accepted_per_pos) != num_accepted_tokens:
        raise ValueError(
            f"inconsistent spec-decode counters: drafts {num_drafts}, accepted "
            f"{num_accepted_tokens}, accepted per position {list(accepted_per_pos)}"
        )
    return DDTreeRoundSummary(
        rounds=num_drafts,
        committed_tokens=num_accepted_tokens + num_drafts,
        tree_nodes=num_draft_tokens,
        depth_histogram=tuple(histogram),
    )
