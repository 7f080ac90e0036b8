# SPDX-License-Identifier: Apache-2.0
"""Which kernel ``mla_tree_verify`` launches: Gluon where ``gluon_supported`` says so
(sm_90), with active rows only when most rows are active; Triton otherwise or when
forced (``config``, ``kernel="triton"``, ``VLLM_DDTREE_MLA_KERNEL=triton``).
CPU: ``gluon_supported`` is stubbed."""

import logging

import pytest
import torch
from test_mla_tree_kernel import make_batch

from vllm_ddtree.attention_backends.mla_tree import (
    MLA_TILE_CONFIGS,
    gluon_kernel,
    mla_tree_verify,
    ops,
)
from vllm_ddtree.settings import SettingError

KERNEL_ENV = "VLLM_DDTREE_MLA_KERNEL"


@pytest.fixture
def gluon_calls(monkeypatch):
    """Pretend every launch is Gluon-eligible; record the launches routed to Gluon."""
    calls = []

    def fake_gluon(q, *args, **kwargs):
        calls.append(kwargs)
        return torch.full(q.shape[:2] + (args[6],), 7.0), torch.zeros(q.shape[:2])

    monkeypatch.setattr(gluon_kernel, "gluon_supported", lambda *a: True)
    monkeypatch.setattr(ops, "_launch_gluon", fake_gluon)
    monkeypatch.delenv(KERNEL_ENV, raising=False)
    return calls


def _batch():
    return make_batch([(5, [-1, 0, 0]), (0, [-1])], page_size=4)


def test_auto_takes_gluon_with_the_launch_arguments(gluon_calls):
    out, _ = mla_tree_verify(**_batch(), max_query_len=3, max_seq_len=8,
                             validate_values=False, num_kv_splits=2)
    assert len(gluon_calls) == 1 and bool((out == 7.0).all())
    assert gluon_calls[0]["num_kv_splits"] == 2 and gluon_calls[0]["max_seq_len"] == 8
    assert gluon_calls[0]["validate_values"] is False


@pytest.mark.parametrize("how", ["kernel", "env", "config"])
def test_forcing_triton(gluon_calls, monkeypatch, how):
    batch, kwargs = _batch(), {}
    if how == "kernel":
        kwargs["kernel"] = "triton"
    elif how == "env":
        monkeypatch.setenv(KERNEL_ENV, "triton")
    else:
        kwargs["config"] = MLA_TILE_CONFIGS[0]
    out, _ = mla_tree_verify(**batch, **kwargs)
    assert gluon_calls == [] and not bool((out == 7.0).all())


def test_mostly_active_rows_take_gluon(gluon_calls):
    """With active rows (``ddtree_budget: "auto"``) and adaptive verify shapes (most rows
    active) an eligible launch takes the Gluon kernel, which computes every row (the walk
    reads only the active ones); without ``mostly_active`` the Triton kernel skips them."""
    active = torch.tensor([2, 1], dtype=torch.int32)
    out, _ = mla_tree_verify(**_batch(), active_query_lens=active, mostly_active=True)
    assert len(gluon_calls) == 1 and bool((out == 7.0).all())
    out, _ = mla_tree_verify(**_batch(), active_query_lens=active)
    assert len(gluon_calls) == 1 and not bool((out == 7.0).all())


def test_active_rows_are_skipped_by_the_triton_kernel(gluon_calls):
    """Where the Triton kernel runs, the rows past each request's active count get no
    KV loads: ``out = 0, lse = -inf``."""
    active = torch.tensor([2, 1], dtype=torch.int32)
    out, lse = mla_tree_verify(**_batch(), active_query_lens=active, kernel="triton")
    assert gluon_calls == []
    assert bool((out[2] == 0).all()) and bool(torch.isneginf(lse[2]).all())
    assert bool(torch.isfinite(lse[:2]).all()) and bool(torch.isfinite(lse[3]).all())


def test_bad_choices_name_the_field(gluon_calls, monkeypatch):
    with pytest.raises(ValueError, match="kernel must be one of"):
        mla_tree_verify(**_batch(), kernel="cuda")
    for bad in ("flashmla", "split", "Triton"):
        monkeypatch.setenv(KERNEL_ENV, bad)
        with pytest.raises(SettingError, match=f"{KERNEL_ENV}='{bad}'.*auto, triton"):
            mla_tree_verify(**_batch())


def test_gluon_supported_is_false_off_hopper():
    batch = make_batch([(5, [-1, 0])], kv_lora=512, rope=64, page_size=4,
                       dtype=torch.bfloat16)
    assert not gluon_kernel.gluon_supported(batch["q"], batch["kv_cache"], 512)


def test_gluon_launcher_refuses_unsupported_launches():
    batch = make_batch([(5, [-1, 0])], kv_lora=512, rope=64, page_size=4,
                       dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="unsupported launch"):
        ops.mla_tree_fwd_gluon(**batch)


def test_debug_log_names_each_distinct_launch_once(caplog):
    ops._LOGGED_LAUNCHES.clear()
    with caplog.at_level(logging.DEBUG, logger=ops.logger.name):
        for _ in range(2):
            mla_tree_verify(**_batch(), kernel="triton", num_kv_splits=2)
    lines = [r.getMessage() for r in caplog.records if "mla_tree launch" in r.getMessage()]
    assert len(lines) == 1
    # The resolved split count: 2 asked, 1 launched (8 keys fit one 32-key tile).
    assert "triton" in lines[0] and "splits=1" in lines[0] and "max_query_len=3" in lines[0]


def test_runtime_splits_reach_the_gluon_launch(gluon_calls):
    mla_tree_verify(**_batch(), max_query_len=3, max_seq_len=8, validate_values=False,
                    runtime_kv_splits=True)
    assert gluon_calls[0]["runtime_kv_splits"] is True


def test_a_gluon_launch_checks_its_inputs_once(monkeypatch):
    """``mla_tree_verify`` checks a launch's tensors and the Gluon kernel's support once,
    then launches (an eager step launches once per MLA layer: each check is host time);
    ``mla_tree_fwd_gluon`` called directly still checks for itself."""
    counts = {"checks": 0, "supported": 0, "launches": 0}
    real_check = ops._check_mla_inputs

    def check(*args, **kwargs):
        counts["checks"] += 1
        return real_check(*args, **kwargs)

    def supported(q, kv, rank):
        counts["supported"] += 1
        return True

    class Kernel:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                counts["launches"] += 1
            return launch

    monkeypatch.setattr(ops, "_check_mla_inputs", check)
    monkeypatch.setattr(gluon_kernel, "gluon_supported", supported)
    monkeypatch.setattr(gluon_kernel, "_mla_tree_fwd_gluon_kernel", Kernel())
    monkeypatch.delenv(KERNEL_ENV, raising=False)
    batch = make_batch([(5, [-1, 0, 0]), (0, [-1])], kv_lora=512, rope=64, page_size=4,
                       dtype=torch.bfloat16)
    mla_tree_verify(**batch, max_query_len=3, max_seq_len=8, validate_values=False,
                    num_kv_splits=1)
    assert counts == {"checks": 1, "supported": 1, "launches": 1}
    ops.mla_tree_fwd_gluon(**batch, num_kv_splits=1)
    assert counts == {"checks": 2, "supported": 2, "launches": 2}
