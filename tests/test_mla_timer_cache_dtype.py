"""The adaptive budget's MLA verify timer runs the run's KV-cache dtype
(``cache_config.cache_dtype``): an fp8 cache verifies with the fp8 Triton kernel, a bf16
one with the Gluon kernel on sm_90, so the start-up table must time the one the run
uses. CPU: the launch is mocked and its arguments checked (timing needs a GPU)."""

from types import SimpleNamespace as NS

import pytest
import torch
from test_adaptive_budget import clock, fake_vllm_config


@pytest.mark.parametrize("cache_dtype", ["fp8", "fp8_e4m3", "auto", None, "bfloat16"])
def test_mla_timer_verifies_with_the_runs_kv_cache_dtype(monkeypatch, cache_dtype):
    """The MLA timer's launch gets the cache ``--kv-cache-dtype`` gives the run: for fp8,
    uint8 storage viewed as e4m3 with a 0-d fp32 scale of 1.0 (the fp8 Triton kernel
    the run verifies with, not the bf16 cache's Gluon kernel on sm_90); "auto" (or no
    cache_config): the model dtype, no scale. The launch is mocked (timing needs a GPU)."""
    from vllm_ddtree.attention_backends import mla_tree
    from vllm_ddtree.budget.attention_timing import target_attention_timer

    launches = []
    monkeypatch.setattr(mla_tree, "mla_tree_verify",
                        lambda *args, **kwargs: launches.append((args, kwargs)))
    config = fake_vllm_config(True)
    if cache_dtype is not None:
        config.cache_config = NS(cache_dtype=cache_dtype)
    measure = target_attention_timer(config, 1 + 4, torch.device("cpu"),
                                     time_fn=lambda run: clock(run))
    assert measure(24, 1 + 2) > 0
    (q, kv_cache, *_), kwargs = launches[-1]
    assert q.dtype == torch.float32 and kv_cache.shape[-1] == 16 + 16
    if cache_dtype in ("fp8", "fp8_e4m3"):
        assert kv_cache.dtype == torch.float8_e4m3fn
        assert kv_cache.float().abs().max() > 0
        scale = kwargs["kv_scale"]
        assert scale.dtype == torch.float32 and scale.shape == () and float(scale) == 1.0
    else:
        want = torch.bfloat16 if cache_dtype == "bfloat16" else torch.float32
        assert kv_cache.dtype == want and kwargs["kv_scale"] is None


def test_mla_timer_names_an_unknown_kv_cache_dtype():
    from vllm_ddtree.budget.attention_timing import mla_attention_timer

    with pytest.raises(ValueError, match="kv_cache_dtype='fp8_e5m2' is not allowed"):
        mla_attention_timer(2, 16, 16, 5, 24, torch.float32, torch.device("cpu"),
                            kv_cache_dtype="fp8_e5m2")


@pytest.mark.parametrize("verify_shape", ["adaptive", "fixed", None])
def test_policy_times_the_kernel_the_runs_verify_takes(monkeypatch, verify_shape):
    """``BudgetPolicy.from_vllm_config`` times the MLA verify with the run's
    ``mostly_active`` (adaptive verify shapes: on sm_90 the Gluon kernel computes every
    row; else Triton skips the inactive ones) and, where decode steps replay FULL graphs,
    with the split count resolved on the device (``runtime_kv_splits``), as the backend
    launches it. The launch is mocked (timing needs a GPU)."""
    from vllm_ddtree.attention_backends import mla_tree
    from vllm_ddtree.budget.attention_timing import target_attention_timer
    from vllm_ddtree.budget.policy import _adaptive_verify_shapes
    from vllm_ddtree.config import DDTreeConfig

    launches = []
    monkeypatch.setattr(mla_tree, "mla_tree_verify",
                        lambda *args, **kwargs: launches.append(kwargs))
    config = fake_vllm_config(True)
    config.speculative_config = None
    if verify_shape is not None:
        ddtree = DDTreeConfig(budget=4, adaptive=True, verify_shape=verify_shape)
        config.speculative_config = NS(ddtree=ddtree)
    adaptive = _adaptive_verify_shapes(config)
    assert adaptive == (verify_shape == "adaptive")
    measure = target_attention_timer(config, 1 + 4, torch.device("cpu"),
                                     time_fn=lambda run: clock(run), mostly_active=adaptive)
    measure(24, 1 + 2)
    assert launches[-1]["mostly_active"] is adaptive
    assert launches[-1]["runtime_kv_splits"] is False  # eager run: host split count
