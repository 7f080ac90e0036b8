"""vllm_ddtree.patches.scheduler_common_prefix: which engines skip vLLM's common-prefix scan, and
that the patched scheduler answers zeros per KV-cache group without walking blocks."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest

from vllm_ddtree.patches import scheduler_common_prefix as patch


@pytest.mark.parametrize(
    ("v2", "ddtree", "expected"),
    [
        (True, True, True),  # DDTree engines on the V2 runner
        (True, False, False),  # vLLM's own methods keep the scan
        (False, True, False),  # the V1 runner reads the result (cascade attention)
        (False, False, False),
    ],
)
def test_which_engines_skip_the_scan(v2, ddtree, expected):
    assert patch.skips_common_prefix(v2, ddtree) is expected


class _Manager:
    """Stands in for vLLM's KVCacheManager: counts the scans it is asked for."""

    def __init__(self):
        self.scans = 0

    def get_num_common_prefix_blocks(self, running_request_id):
        self.scans += 1
        return [7, 7, 7]


def _fake_init(self, vllm_config, *args, **kwargs):
    self.use_v2_model_runner = vllm_config.use_v2
    self.kv_cache_config = NS(kv_cache_groups=[object(), object(), object()])
    self.kv_cache_manager = _Manager()


def _scheduler(monkeypatch, *, use_v2: bool, ddtree: bool):
    from vllm.v1.core.sched.scheduler import Scheduler

    monkeypatch.setattr(Scheduler, "__init__", _fake_init)
    patch.apply()
    patch.apply()  # idempotent
    assert Scheduler.__init__._ddtree_original is _fake_init
    spec = NS(ddtree={"budget": 8, "top_k": None}) if ddtree else None
    config = NS(use_v2=use_v2, speculative_config=spec)
    scheduler = Scheduler.__new__(Scheduler)
    Scheduler.__init__(scheduler, config)
    return scheduler


def test_a_ddtree_engine_gets_zeros_without_a_scan(monkeypatch):
    scheduler = _scheduler(monkeypatch, use_v2=True, ddtree=True)
    manager = scheduler.kv_cache_manager
    assert manager.get_num_common_prefix_blocks("req-0") == [0, 0, 0]
    assert manager.scans == 0


@pytest.mark.parametrize(("use_v2", "ddtree"), [(True, False), (False, True)])
def test_other_engines_keep_vllms_scan(monkeypatch, use_v2, ddtree):
    scheduler = _scheduler(monkeypatch, use_v2=use_v2, ddtree=ddtree)
    manager = scheduler.kv_cache_manager
    assert manager.get_num_common_prefix_blocks("req-0") == [7, 7, 7]
    assert manager.scans == 1


def test_the_lookahead_patch_still_wraps_it_once(monkeypatch):
    """Applied before scheduler_lookahead (RUNNER_PATCHES order): both stay idempotent
    and the lookahead wrapper is the outer one, carrying _ddtree_patched."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from vllm_ddtree import patches
    from vllm_ddtree.patches import scheduler_lookahead

    monkeypatch.setattr(Scheduler, "__init__", _fake_init)
    order = patches.RUNNER_PATCHES
    assert order.index("scheduler_common_prefix") < order.index("scheduler_lookahead")
    for _ in range(2):
        patch.apply()
        scheduler_lookahead.apply()
    outer = Scheduler.__init__
    assert outer._ddtree_patched
    assert outer._ddtree_original._ddtree_common_prefix_patched
    assert outer._ddtree_original._ddtree_original is _fake_init


def test_a_process_without_ddtree_keeps_vllms_scheduler(monkeypatch):
    from vllm.v1.core.sched.scheduler import Scheduler

    from vllm_ddtree import patches

    monkeypatch.setattr(Scheduler, "__init__", _fake_init)
    monkeypatch.setenv(patches.RUNNER_ENV, "0")
    assert patches.apply_all() == patches.PATCH_MODULES
    assert Scheduler.__init__ is _fake_init


def test_skip_common_prefix_scan_answers_zeros_per_group():
    """The helper the patch (and bench_e2e's +skipprefix) applies to one scheduler."""
    scheduler = NS(kv_cache_config=NS(kv_cache_groups=[object(), object()]),
                   kv_cache_manager=_Manager())
    patch.skip_common_prefix_scan(scheduler)
    assert scheduler.kv_cache_manager.get_num_common_prefix_blocks("req-0") == [0, 0]
    assert scheduler.kv_cache_manager.scans == 0


def test_the_scan_benchmark_times_vllms_scan_over_the_whole_context():
    """evals/bench_common_prefix_scan.py calls vLLM's own FullAttentionManager scan; it
    asserts the batch-1 answer (every block common) before timing."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "evals"))
    import bench_common_prefix_scan as bench

    assert bench.scan_us(4096, 64, repeats=3) > 0
    assert bench.scan_us(1000, 16, repeats=1) > 0  # a partial last block
