# SPDX-License-Identifier: Apache-2.0
"""``mla_tree_verify``'s measured dispatch (``attention_backends/mla_tree/dispatch.py``):
buckets, the table lookup (one architecture only), and which kernel and tile config a
launch takes with a table entry, without one, on another architecture and when forced.
CPU: the architecture and ``gluon_supported`` are stubbed; Triton runs interpreted."""

import pytest
import torch
from test_mla_fp8_kernel import check as check_fp8
from test_mla_fp8_kernel import fp8_batch
from test_mla_tree_kernel import MIXED, make_batch

from vllm_ddtree.attention_backends.mla_tree import (
    SM120_SHARED_MEMORY_BYTES,
    dispatch,
    dispatch_table,
    gluon_kernel,
    mla_tree_verify,
    mla_tree_verify_reference,
    ops,
)

KERNEL_ENV = "VLLM_DDTREE_MLA_KERNEL"


def test_buckets():
    assert [dispatch.row_bucket(n) for n in (1, 2, 3, 16, 17, 18, 64, 65, 257)] == [
        2, 2, 5, 17, 17, 33, 65, 65, 257]
    assert dispatch.row_bucket(258) is None
    assert dispatch.ctx_bucket(4095) is None
    assert [dispatch.ctx_bucket(n) for n in (4096, 8192, 16000, 16500, 65536, 70000, 10**6)] == [
        8192, 8192, 8192, 32768, 32768, 131072, 131072]
    assert dispatch.cache_class(torch.bfloat16) == dispatch.cache_class(torch.float16) == "bf16"
    assert dispatch.cache_class(torch.float8_e4m3fn) == "fp8"
    assert dispatch.device_arch(torch.device("cpu")) is None


def test_shipped_table_is_well_formed():
    """Only sm_90 is measured (sm_120 and others keep the rule); keys are grid buckets;
    an fp8 cache never names the 16-bit-only Gluon kernel."""
    assert set(dispatch_table.TABLE) <= {"sm_90"}
    for caches in dispatch_table.TABLE.values():
        assert set(caches) <= {"bf16", "fp8"}
        for cache, entries in caches.items():
            for (heads, rows, ctx), method in entries.items():
                assert heads > 0 and rows in dispatch.ROW_BUCKETS
                assert ctx in dispatch.CTX_BUCKETS and method in dispatch.METHODS
                assert not (cache == "fp8" and method == "gluon")


TABLE = {"sm_90": {"bf16": {(2, 5, 8192): "triton_m32", (2, 17, 8192): "gluon"},
                   "fp8": {(2, 5, 8192): "triton_m64"}}}


def test_lookup(monkeypatch):
    monkeypatch.setattr(dispatch, "TABLE", TABLE)
    assert dispatch.lookup("sm_90", "bf16", 2, 3, 9000) == "triton_m32"  # 3 rows -> 5
    assert dispatch.lookup("sm_90", "bf16", 2, 16, 6000) == "gluon"
    assert dispatch.lookup("sm_90", "fp8", 2, 5, 8192) == "triton_m64"
    assert dispatch.lookup("sm_90", "bf16", 4, 3, 9000) is None  # heads not measured
    assert dispatch.lookup("sm_90", "bf16", 2, 3, 1000) is None  # context too short
    assert dispatch.lookup("sm_120", "bf16", 2, 3, 9000) is None
    assert dispatch.lookup(None, "bf16", 2, 3, 9000) is None
    assert dispatch.dispatch_method("sm_120", "bf16", 2, 3, 9000) == "triton_m16"  # rule
    assert dispatch.dispatch_method("sm_90", "bf16", 8, 65, 9000) == "gluon"  # rule
    assert dispatch.dispatch_method("sm_90", "fp8", 8, 65, 9000) == "fp8t_m32"  # rule
    assert dispatch.dispatch_method("sm_90", "fp8", 2, 5, 1000) == "fp8t_m16"  # 10 rows
    assert dispatch.dispatch_method("sm_120", "fp8", 8, 65, 9000).startswith("triton_m")


@pytest.fixture
def launches(monkeypatch):
    """Every launch Gluon-eligible (stub), the table above; records Gluon launches and the
    Triton launches' tile configs."""
    record = dict(gluon=0, configs=[])

    def fake_gluon(q, *args, **kwargs):
        record["gluon"] += 1
        return torch.zeros(q.shape[:2] + (args[6],)), torch.zeros(q.shape[:2])

    real_fit = ops.fit_config

    def fit(config, *args, **kwargs):
        record["configs"].append(config)
        return real_fit(config, *args, **kwargs)

    real_select = ops.select_config

    def select(*args, **kwargs):
        config = real_select(*args, **kwargs)
        record["configs"].append(("rule", config))
        return config

    monkeypatch.setattr(gluon_kernel, "gluon_supported", lambda q, kv, rank: kv.dtype == q.dtype)
    monkeypatch.setattr(ops, "_launch_gluon", fake_gluon)
    monkeypatch.setattr(ops, "fit_config", fit)
    monkeypatch.setattr(ops, "select_config", select)
    monkeypatch.setattr(dispatch, "TABLE", TABLE)
    monkeypatch.setattr(dispatch, "device_arch", lambda device: "sm_90")
    monkeypatch.delenv(KERNEL_ENV, raising=False)
    return record


# Two heads; the longest request has 3 new tokens (rows bucket 5).
SPECS = [(5, [-1, 0, 0]), (0, [-1])]
LENS = dict(max_query_len=3, validate_values=False)


def _check(out, lse, batch):
    ref_out, ref_lse = mla_tree_verify_reference(**batch)
    torch.testing.assert_close(out, ref_out, atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(lse, ref_lse, atol=2e-4, rtol=2e-4)


def test_a_triton_entry_overrides_gluon(launches):
    batch = make_batch(SPECS, page_size=4)
    out, lse = mla_tree_verify(**batch, **LENS, max_seq_len=9000)
    assert launches["gluon"] == 0
    assert launches["configs"] == [dispatch.TRITON_CONFIGS["triton_m32"]]
    _check(out, lse, batch)


def test_a_gluon_entry_and_no_entry_take_gluon(launches):
    batch = make_batch([(5, list(range(-1, 15)))], page_size=4)  # 16 rows: the gluon entry
    mla_tree_verify(**batch, max_query_len=16, validate_values=False, max_seq_len=9000)
    assert launches["gluon"] == 1
    mla_tree_verify(**make_batch(SPECS, page_size=4), **LENS, max_seq_len=2000)  # no entry
    assert launches["gluon"] == 2 and launches["configs"] == []


def test_other_architectures_keep_the_rule(launches, monkeypatch):
    monkeypatch.setattr(dispatch, "device_arch", lambda device: "sm_120")
    mla_tree_verify(**make_batch(SPECS, page_size=4), **LENS, max_seq_len=9000)
    assert launches["gluon"] == 1 and launches["configs"] == []


def test_without_host_lengths_the_rule_applies(launches):
    mla_tree_verify(**make_batch(SPECS, page_size=4))  # validated: lengths not given
    assert launches["gluon"] == 1


def test_fp8_cache_takes_its_own_entry(launches):
    batch = fp8_batch(SPECS, page_size=4, out_dtype=torch.float32)
    mla_tree_verify(**batch, **LENS, max_seq_len=9000)
    assert launches["gluon"] == 0
    assert launches["configs"] == [dispatch.TRITON_CONFIGS["triton_m64"]]
    # no entry: sm_90's rule, the transposed fp8 kernel (6 rows: its 16-row tile)
    check_fp8(batch, **LENS, max_seq_len=2000)
    assert launches["configs"][-1] == dispatch.TRITON_CONFIGS["fp8t_m16"]


def test_fp8_rule_elsewhere_is_select_config(launches, monkeypatch):
    """Off sm_90 (sm_120: no wgmma) the fp8 rule is ``select_config``'s widening
    kernel."""
    monkeypatch.setattr(dispatch, "device_arch", lambda device: "sm_120")
    check_fp8(fp8_batch(SPECS, page_size=4, out_dtype=torch.float32), **LENS, max_seq_len=2000)
    assert launches["configs"][-1][0] == "rule"
    assert not launches["configs"][-1][1].fp8_transposed


@pytest.mark.parametrize("how", ["kernel", "env", "config"])
def test_forcing_bypasses_the_table(launches, monkeypatch, how):
    kwargs = dict(LENS, max_seq_len=9000)
    if how == "kernel":
        kwargs["kernel"] = "triton"
    elif how == "env":
        monkeypatch.setenv(KERNEL_ENV, "triton")
    else:
        kwargs["config"] = dispatch.TRITON_CONFIGS["triton_m16"]
    batch = make_batch(MIXED[:1] + SPECS[:1], page_size=4)
    out, lse = mla_tree_verify(**batch, **kwargs)
    assert launches["gluon"] == 0
    assert dispatch.TRITON_CONFIGS["triton_m32"] not in launches["configs"]
    _check(out, lse, batch)


@pytest.mark.parametrize("entry", [False, True])
def test_fp8_past_the_transposed_kernels_latent_width_takes_the_widening_kernel(
        launches, monkeypatch, entry):
    """kv_lora_rank over ``fp8_transposed.MAX_KV_LORA_RANK`` on sm_90: neither the rule
    nor a table entry naming the transposed kernel (measured at other dims) launches it;
    ``select_config``'s kernel runs and matches the reference."""
    from vllm_ddtree.attention_backends.mla_tree import fp8_transposed

    monkeypatch.setattr(ops, "_max_shared_memory", lambda device: 227 * 1024)  # Hopper's
    if entry:
        monkeypatch.setattr(dispatch, "TABLE", {"sm_90": {"fp8": {(2, 5, 8192): "fp8t_m16"}}})
    rank = fp8_transposed.MAX_KV_LORA_RANK + 16
    batch = fp8_batch(SPECS, page_size=4, kv_lora=rank, rope=8)
    check_fp8(batch, **LENS, max_seq_len=9000 if entry else 2000)  # 2000: no entry
    assert launches["configs"][-1][0] == "rule"
    assert not launches["configs"][-1][1].fp8_transposed


@pytest.mark.parametrize("arch, optin, want", [
    ("sm_90", 227 * 1024, 227 * 1024), ("sm_100", 227 * 1024, SM120_SHARED_MEMORY_BYTES),
    ("sm_80", 163 * 1024, SM120_SHARED_MEMORY_BYTES),
    ("sm_120", 99 * 1024, SM120_SHARED_MEMORY_BYTES)])
def test_large_tiles_are_planned_only_where_they_were_measured(monkeypatch, arch, optin, want):
    """The tile choice plans with the device's opt-in shared memory on sm_90 only: its
    estimate models mma.sync, so a 64-row tile it fits in an sm_80 / sm_100 opt-in was
    never compiled there; elsewhere sm_120's tiles (compiled for sm_120). The rule the
    grid reports as dispatched agrees with what launches."""
    from types import SimpleNamespace as NS

    monkeypatch.setattr(dispatch, "device_arch", lambda device: arch)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: NS(shared_memory_per_block_optin=optin))
    budget = ops._max_shared_memory.__wrapped__(NS(type="cuda"))  # uncached: per arch
    assert budget == want
    rows = 16 * 5  # DeepSeek at TP 8: 16 heads, B = 4
    launched = ops.select_config(rows, 576, 512, torch.bfloat16, budget)
    if arch != "sm_90":
        assert dispatch.rule_method(arch, "bf16", 16, 5) == f"triton_m{launched.block_m}"
        assert launched.block_m < 64


def test_the_launchers_device_queries_are_cached(monkeypatch):
    """The launcher asks the device's shared memory and architecture at every launch
    (twice for the Gluon kernel's support check): one driver query per device, not per
    launch (tens of microseconds each, 27 launches a step in an eager MLA forward)."""
    from types import SimpleNamespace as NS

    from vllm_ddtree.attention_backends.mla_tree import gluon_kernel

    calls = {"capability": 0, "properties": 0}

    def capability(device):
        calls["capability"] += 1
        return (9, 0)

    def properties(device):
        calls["properties"] += 1
        return NS(shared_memory_per_block_optin=227 * 1024)

    monkeypatch.setattr(torch.cuda, "get_device_capability", capability)
    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    dispatch.device_arch.cache_clear()
    ops._max_shared_memory.cache_clear()
    device = torch.device("cuda", 7)

    class OnCuda(torch.Tensor):  # a CPU tensor that says it lives on ``device``
        is_cuda = True

        @property
        def device(self):
            return device

    q = torch.zeros(4, 16, 576, dtype=torch.bfloat16).as_subclass(OnCuda)
    kv = torch.zeros(8, 64, 576, dtype=torch.bfloat16).as_subclass(OnCuda)
    try:
        for _ in range(3):
            assert ops._max_shared_memory(device) == 227 * 1024
            assert gluon_kernel.gluon_supported(q, kv, 512)
        assert calls == {"capability": 1, "properties": 1}
    finally:
        dispatch.device_arch.cache_clear()
        ops._max_shared_memory.cache_clear()
