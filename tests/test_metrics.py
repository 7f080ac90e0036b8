"""DDTree's metrics from vLLM's spec-decode counters: the summary, the log line and
the Prometheus counters (vllm_ddtree.patches.spec_decode_metrics)."""

import functools
from types import SimpleNamespace as NS

import prometheus_client
import pytest
from vllm.v1.spec_decode.metrics import SpecDecodingProm, SpecDecodingStats

from vllm_ddtree.metrics import summarize_rounds

DEPTHS = [3, 0, 7, 3, 1]  # accepted depth per round
BUDGET = 16


def stats_for(depths, budget=BUDGET) -> SpecDecodingStats:
    stats = SpecDecodingStats.new(budget)
    for depth in depths:
        stats.observe_draft(num_draft_tokens=budget, num_accepted_tokens=depth)
    return stats


def test_summary_committed_is_depth_plus_one():
    s = stats_for(DEPTHS)
    summary = summarize_rounds(s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens,
                               s.num_accepted_tokens_per_pos)
    assert summary.rounds == 5 and summary.tree_nodes == 5 * BUDGET
    assert summary.depth_histogram == (1, 1, 0, 2, 0, 0, 0, 1)
    assert summary.mean_accepted_depth == pytest.approx(sum(DEPTHS) / 5)
    assert summary.mean_committed == pytest.approx(1 + sum(DEPTHS) / 5)
    # vLLM's own "mean acceptance length" is the same number
    assert summary.mean_committed == pytest.approx(1 + s.num_accepted_tokens / s.num_drafts)
    assert "mean committed length 3.80, mean accepted depth 2.80" in summary.log_line()
    with pytest.raises(ValueError, match="inconsistent"):
        summarize_rounds(2, 32, 5, [1, 2] + [0] * 14)


def test_patched_loggers_report_ddtree(monkeypatch):
    from vllm_ddtree.patches import spec_decode_metrics

    logging_cls = spec_decode_metrics._ddtree_logging_cls()
    log = logging_cls()
    log.observe(stats_for(DEPTHS[:2]))
    log.observe(stats_for(DEPTHS[2:]))
    lines = []
    log.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
    assert "Mean acceptance length: 3.80" in lines[0]
    assert lines[1].startswith("DDTree metrics: rounds 5, mean committed length 3.80")

    def prom_cls_on(registry):
        base = type("Base", (SpecDecodingProm,), {
            "_counter_cls": functools.partial(prometheus_client.Counter, registry=registry)})
        return spec_decode_metrics._ddtree_prom_cls(base)

    registry = prometheus_client.CollectorRegistry()
    prom_cls = prom_cls_on(registry)
    spec = NS(num_speculative_tokens=BUDGET, ddtree={"budget": BUDGET, "top_k": None})
    prom = prom_cls(spec, ["model_name", "engine"], {0: ["m", "0"]})
    prom.observe(stats_for(DEPTHS))
    labels = {"model_name": "m", "engine": "0"}
    assert registry.get_sample_value("vllm:ddtree_rounds_total", labels) == 5
    assert registry.get_sample_value("vllm:ddtree_committed_tokens_total", labels) == 19
    assert registry.get_sample_value("vllm:spec_decode_num_accepted_tokens_total", labels) == 14
    assert registry.get_sample_value("vllm:ddtree_rounds_by_accepted_depth_total",
                                     {**labels, "depth": "3"}) == 2
    # vLLM's per-position counters: the same values as vLLM's own observe gives, every
    # position still exported, though only those up to the deepest accepted one are
    # incremented
    want = stats_for(DEPTHS).num_accepted_tokens_per_pos
    assert want[7:] == [0] * (BUDGET - 7)
    for pos in range(BUDGET):
        assert registry.get_sample_value("vllm:spec_decode_num_accepted_tokens_per_pos_total",
                                         {**labels, "position": str(pos)}) == want[pos], pos
    assert len(prom.counter_spec_decode_num_accepted_tokens_per_pos[0]) == BUDGET
    incremented = []
    for counter in prom.counter_spec_decode_num_accepted_tokens_per_pos[0]:
        monkeypatch.setattr(counter, "inc", lambda n, c=counter: incremented.append(n))
    prom.observe(stats_for([2, 0]))
    assert incremented == [1, 1]  # positions 0 and 1; the 14 zeros are skipped
    # without DDTree the class is vLLM's own
    plain_cls = prom_cls_on(prometheus_client.CollectorRegistry())
    plain = plain_cls(NS(num_speculative_tokens=4, ddtree=None), ["model_name", "engine"],
                      {1: ["m", "1"]})
    assert not plain.ddtree_enabled


def test_read_spec_decode_counters_sums_label_sets():
    from vllm_ddtree.metrics import SPEC_DECODE_COUNTERS, read_spec_decode_counters

    drafts, accepted, _ = SPEC_DECODE_COUNTERS
    llm = NS(get_metrics=lambda: [NS(name=drafts, value=3), NS(name=drafts, value=2),
                                  NS(name=accepted, value=7), NS(name="vllm:other", value=9)])
    got = read_spec_decode_counters(llm)
    assert got == {drafts: 5.0, accepted: 7.0, "vllm:spec_decode_num_draft_tokens": 0.0}
