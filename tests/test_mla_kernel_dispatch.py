# SPDX-License-Identifier: Apache-2.0
"""Which kernel ``mla_tree_verify`` launches: Gluon where ``gluon_supported`` says so
(sm_90), Triton otherwise or when forced (``config``, active rows, ``kernel="triton"``,
``VLLM_DDTREE_MLA_KERNEL=triton``). CPU: ``gluon_supported`` is stubbed."""

import pytest
import torch
from test_mla_tree_kernel import make_batch
from vllm_ddtree.attention_backends.mla_tree import MLA_TILE_CONFIGS, gluon_kernels, mla_tree_verify
from vllm_ddtree.attention_backends.mla_tree.ops import INACTIVE_ROWS_ENV, KERNEL_ENV


@pytest.fixture
def gluon_calls(monkeypatch):
    """Pretend every launch is Gluon-eligible; record the launches routed to Gluon."""
    calls = []

    def fake_gluon(q, *args, **kwargs):
        calls.append(kwargs)
        return torch.full(q.shape[:2] + (args[6],), 7.0), torch.zeros(q.shape[:2])

    monkeypatch.setattr(gluon_kernels, "gluon_supported", lambda *a: True)
    monkeypatch.setattr(gluon_kernels, "mla_tree_fwd_gluon", fake_gluon)
    monkeypatch.delenv(KERNEL_ENV, raising=False)
    monkeypatch.delenv(INACTIVE_ROWS_ENV, raising=False)
    return calls


def _batch():
    return make_batch([(5, [-1, 0, 0]), (0, [-1])], page_size=4)


def test_auto_takes_gluon_with_the_launch_arguments(gluon_calls):
    out, _ = mla_tree_verify(**_batch(), max_query_len=3, max_seq_len=8,
                             validate_values=False, num_kv_splits=2)
    assert len(gluon_calls) == 1 and bool((out == 7.0).all())
    assert gluon_calls[0]["num_kv_splits"] == 2 and gluon_calls[0]["max_seq_len"] == 8
    assert gluon_calls[0]["validate_values"] is False


@pytest.mark.parametrize("how", ["kernel", "env", "config", "active"])
def test_forcing_triton(gluon_calls, monkeypatch, how):
    batch, kwargs = _batch(), {}
    if how == "kernel":
        kwargs["kernel"] = "triton"
    elif how == "env":
        monkeypatch.setenv(KERNEL_ENV, "Triton")
    elif how == "config":
        kwargs["config"] = MLA_TILE_CONFIGS[0]
    else:
        kwargs["active_query_lens"] = torch.tensor([3, 1], dtype=torch.int32)
        monkeypatch.setattr(gluon_kernels, "gluon_supported",
                            lambda *a: a[3] is None)  # the real rule: no active rows
    out, _ = mla_tree_verify(**batch, **kwargs)
    assert gluon_calls == [] and not bool((out == 7.0).all())


def test_compute_inactive_rows_sends_active_launches_to_gluon(gluon_calls, monkeypatch):
    """VLLM_DDTREE_MLA_INACTIVE_ROWS=compute: a launch with active rows takes Gluon
    (asked without them, the rule it must pass) and Gluon gets no active rows; an
    explicit kernel="triton" or the global switch still wins."""
    seen = []

    def rule(*args):
        seen.append(args[3])
        return args[3] is None

    monkeypatch.setattr(gluon_kernels, "gluon_supported", rule)
    monkeypatch.setenv(INACTIVE_ROWS_ENV, "compute")
    active = torch.tensor([3, 1], dtype=torch.int32)
    out, _ = mla_tree_verify(**_batch(), active_query_lens=active)
    assert len(gluon_calls) == 1 and bool((out == 7.0).all()) and seen == [None]
    assert "active_query_lens" not in gluon_calls[0]
    mla_tree_verify(**_batch(), active_query_lens=active, kernel="triton")
    monkeypatch.setenv(KERNEL_ENV, "triton")
    mla_tree_verify(**_batch(), active_query_lens=active)
    assert len(gluon_calls) == 1
    monkeypatch.setenv(INACTIVE_ROWS_ENV, "skip")
    monkeypatch.delenv(KERNEL_ENV)
    mla_tree_verify(**_batch(), active_query_lens=active)
    assert len(gluon_calls) == 1 and seen[-1] is active


def test_bad_choices_name_the_field(gluon_calls, monkeypatch):
    with pytest.raises(ValueError, match="kernel must be one of"):
        mla_tree_verify(**_batch(), kernel="cuda")
    monkeypatch.setenv(KERNEL_ENV, "flashmla")
    with pytest.raises(ValueError, match=KERNEL_ENV):
        mla_tree_verify(**_batch())
    monkeypatch.delenv(KERNEL_ENV)
    monkeypatch.setenv(INACTIVE_ROWS_ENV, "all")
    with pytest.raises(ValueError, match=INACTIVE_ROWS_ENV):
        mla_tree_verify(**_batch(), active_query_lens=torch.tensor([3, 1], dtype=torch.int32))


def test_gluon_supported_is_false_off_hopper():
    batch = make_batch([(5, [-1, 0])], kv_lora=512, rope=64, page_size=4,
                       dtype=torch.bfloat16)
    assert not gluon_kernels.gluon_supported(batch["q"], batch["kv_cache"], 512)


def test_debug_log_names_each_distinct_launch_once(caplog):
    import logging

    from vllm_ddtree.attention_backends.mla_tree import ops

    ops._LOGGED_LAUNCHES.clear()
    with caplog.at_level(logging.DEBUG, logger=ops.logger.name):
        for _ in range(2):
            mla_tree_verify(**_batch(), kernel="triton", num_kv_splits=2)
    lines = [r.getMessage() for r in caplog.records if "mla_tree launch" in r.getMessage()]
    assert len(lines) == 1
    # The resolved split count: 2 asked, 1 launched (8 keys fit one 32-key tile).
    assert "triton" in lines[0] and "splits=1" in lines[0] and "max_query_len=3" in lines[0]


def test_launch_log_env_switch(monkeypatch, capsys):
    import logging

    from vllm_ddtree.attention_backends.mla_tree import ops

    ops._LOGGED_LAUNCHES.clear()
    monkeypatch.setattr(ops.logger, "handlers", [])
    monkeypatch.setattr(ops.logger, "level", logging.NOTSET)
    monkeypatch.setenv(ops.LOG_LAUNCHES_ENV, "1")
    mla_tree_verify(**_batch(), kernel="triton")
    assert "mla_tree launch triton" in capsys.readouterr().err


def test_gluon_version_defaults_to_v2(monkeypatch):
    monkeypatch.delenv(gluon_kernels.GLUON_VERSION_ENV, raising=False)
    assert gluon_kernels.gluon_version() == "v2"
    monkeypatch.setenv(gluon_kernels.GLUON_VERSION_ENV, "V1")
    assert gluon_kernels.gluon_version() == "v1"
    monkeypatch.setenv(gluon_kernels.GLUON_VERSION_ENV, "v3")
    with pytest.raises(ValueError, match=gluon_kernels.GLUON_VERSION_ENV):
        gluon_kernels.gluon_version()


def test_runtime_splits_switch(monkeypatch):
    from vllm_ddtree.attention_backends.mla_tree.ops import (
        RUNTIME_SPLITS_ENV,
        runtime_splits_enabled,
    )

    monkeypatch.delenv(RUNTIME_SPLITS_ENV, raising=False)
    assert runtime_splits_enabled()
    monkeypatch.setenv(RUNTIME_SPLITS_ENV, "0")
    assert not runtime_splits_enabled()
    monkeypatch.setenv(RUNTIME_SPLITS_ENV, "yes")
    with pytest.raises(ValueError, match=RUNTIME_SPLITS_ENV):
        runtime_splits_enabled()


def test_runtime_splits_reach_the_gluon_launch(gluon_calls):
    mla_tree_verify(**_batch(), max_query_len=3, max_seq_len=8, validate_values=False,
                    runtime_kv_splits=True)
    assert gluon_calls[0]["runtime_kv_splits"] is True
