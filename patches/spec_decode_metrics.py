"""Patch ``vllm.v1.metrics.loggers.LoggingStatLogger.__init__`` and
``vllm.v1.metrics.loggers.PrometheusStatLogger._spec_decoding_cls`` (vLLM 0.26.0):
DDTree's metrics beside vLLM's spec-decode metrics.

With a DDTree speculative config, the periodic log line of ``SpecDecodingLogging``
is followed by DDTree's (mean committed length, mean accepted depth, tree nodes per
round, accepted-depth histogram) and ``/metrics`` gains ``vllm:ddtree_*`` counters.
Both are derived from the same ``SpecDecodingStats`` as vLLM's own figures
(``vllm_ddtree.metrics``). Without DDTree nothing changes.
"""

from __future__ import annotations

from vllm_ddtree.patches._guard import mark_patched, require_vllm_version

PATCHED_FUNCTION = (
    "vllm.v1.metrics.loggers.LoggingStatLogger.__init__ / "
    "PrometheusStatLogger._spec_decoding_cls"
)


def _ddtree_logging_cls():
    import numpy as np
    from vllm.v1.spec_decode.metrics import SpecDecodingLogging, logger

    from vllm_ddtree.metrics import summarize_rounds

    class DDTreeSpecDecodingLogging(SpecDecodingLogging):
        """vLLM's spec-decode log line, then DDTree's for the same interval."""

        def log(self, log_fn=logger.info):
            if not self.num_drafts:
                return super().log(log_fn=log_fn)
            try:
                line = summarize_rounds(
                    int(np.sum(self.num_drafts)),
                    int(np.sum(self.num_draft_tokens)),
                    int(np.sum(self.num_accepted_tokens)),
                    np.sum(np.array(self.accepted_tokens_per_pos_lists), axis=0).tolist(),
                ).log_line()
            except ValueError as e:  # report a wiring bug, never kill the logger
                line = f"DDTree metrics: {e}"
            super().log(log_fn=log_fn)
            log_fn("%s", line)

    return DDTreeSpecDecodingLogging


def _ddtree_prom_cls(base):
    from vllm_ddtree.metrics import summarize_rounds
    from vllm_ddtree.runtime_state import ddtree_config_of

    class DDTreeSpecDecodingProm(base):
        """vLLM's spec-decode counters plus ``vllm:ddtree_*`` ones under DDTree."""

        def __init__(self, speculative_config, labelnames, per_engine_labelvalues,
                     *args, **kwargs):
            super().__init__(speculative_config, labelnames, per_engine_labelvalues,
                             *args, **kwargs)
            self.ddtree_enabled = ddtree_config_of(speculative_config) is not None
            if not self.ddtree_enabled:
                return
            counter = self._counter_cls

            def per_engine(name, doc):
                metric = counter(name=name, documentation=doc, labelnames=labelnames)
                return {idx: metric.labels(*lv) for idx, lv in per_engine_labelvalues.items()}

            self.ddtree_rounds = per_engine("vllm:ddtree_rounds", "Verified DDTree trees.")
            self.ddtree_committed = per_engine(
                "vllm:ddtree_committed_tokens",
                "Tokens committed by DDTree rounds (accepted depth + 1 per round).")
            self.ddtree_nodes = per_engine("vllm:ddtree_tree_nodes",
                                           "Tree nodes verified by DDTree rounds.")
            by_depth = counter(name="vllm:ddtree_rounds_by_accepted_depth",
                               documentation="DDTree rounds per accepted tree depth.",
                               labelnames=[*labelnames, "depth"])
            max_depth = speculative_config.num_speculative_tokens
            self.ddtree_by_depth = {
                idx: [by_depth.labels(*lv, str(d)) for d in range(max_depth + 1)]
                for idx, lv in per_engine_labelvalues.items()
            }

        def observe(self, spec_decoding_stats, engine_idx: int = 0):
            if not self.ddtree_enabled:
                return super().observe(spec_decoding_stats, engine_idx)
            # vLLM increments all B per-position counters every step (B = 64-512 for a
            # tree) though no accepted depth passes the drafter's L: hand it only the
            # positions up to the last non-zero count (the others would add 0). The
            # in-process engine runs this on the engine's thread.
            per_pos = self.counter_spec_decode_num_accepted_tokens_per_pos
            counters = per_pos.get(engine_idx)
            counts = spec_decoding_stats.num_accepted_tokens_per_pos
            used = max((i + 1 for i, n in enumerate(counts) if n), default=0)
            if counters is not None:
                per_pos[engine_idx] = counters[:used]
            try:
                super().observe(spec_decoding_stats, engine_idx)
            finally:
                if counters is not None:
                    per_pos[engine_idx] = counters
            if not spec_decoding_stats.num_drafts:
                return
            summary = summarize_rounds(
                spec_decoding_stats.num_drafts,
                spec_decoding_stats.num_draft_tokens,
                spec_decoding_stats.num_accepted_tokens,
                counts[:used],  # the zeros past it add nothing to the histogram
            )
            self.ddtree_rounds[engine_idx].inc(summary.rounds)
            self.ddtree_committed[engine_idx].inc(summary.committed_tokens)
            self.ddtree_nodes[engine_idx].inc(summary.tree_nodes)
            for depth, rounds in enumerate(summary.depth_histogram):
                if rounds:
                    self.ddtree_by_depth[engine_idx][depth].inc(rounds)

    return DDTreeSpecDecodingProm


def apply() -> None:
    require_vllm_version(PATCHED_FUNCTION)
    from vllm.v1.metrics import loggers

    original_init = loggers.LoggingStatLogger.__init__
    if getattr(original_init, "_ddtree_patched", False):
        return
    logging_cls = _ddtree_logging_cls()

    def __init__(self, vllm_config, *args, **kwargs):
        original_init(self, vllm_config, *args, **kwargs)
        from vllm_ddtree.runtime_state import ddtree_config_of

        if ddtree_config_of(vllm_config.speculative_config) is not None:
            self.spec_decoding_logging = logging_cls(
                is_diffusion=self.spec_decoding_logging.is_diffusion
            )

    mark_patched(__init__, original_init)
    loggers.LoggingStatLogger.__init__ = __init__
    prom_base = loggers.PrometheusStatLogger._spec_decoding_cls
    loggers.PrometheusStatLogger._spec_decoding_cls = _ddtree_prom_cls(prom_base)
