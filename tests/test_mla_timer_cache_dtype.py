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
    uint8 storage viewed as e4m3 with a 0-d fp32 scale of 1.0 and an e4m3 query with
    its own (as MLAAttention hands the backend; the fp8 Triton kernel the run verifies
    with, not the bf16 cache's Gluon kernel on sm_90), outputs in the model dtype;
    "auto" (or no cache_config): the model dtype, no scales. The launch is mocked
    (timing needs a GPU)."""
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
    assert kv_cache.shape[-1] == 16 + 16
    if cache_dtype in ("fp8", "fp8_e4m3"):
        assert kv_cache.dtype == torch.float8_e4m3fn and q.dtype == torch.float8_e4m3fn
        assert kv_cache.float().abs().max() > 0 and q.float().abs().max() > 0
        for name in ("kv_scale", "q_scale"):
            scale = kwargs[name]
            assert scale.dtype == torch.float32 and scale.shape == () and float(scale) == 1.0
        assert kwargs["out_dtype"] == torch.float32
    else:
        want = torch.bfloat16 if cache_dtype == "bfloat16" else torch.float32
        assert q.dtype == torch.float32 and kv_cache.dtype == want
        assert kwargs["kv_scale"] is None and kwargs["q_scale"] is None


def test_mla_timer_names_an_unknown_kv_cache_dtype():
    from vllm_ddtree.budget.attention_timing import mla_attention_timer

    with pytest.raises(ValueError, match="kv_cache_dtype='fp8_e5m2' is not allowed"):
        mla_attention_timer(2, 16, 16, 5, 24, torch.float32, torch.device("cpu"),
                            kv_cache_dtype="fp8_e5m2")


@pytest.mark.parametrize("verify_shape", ["adaptive", "fixed", None])
def test_policy_times_the_kernel_the_runs_verify_takes(monkeypatch, verify_shape):
    """The MLA verify is timed with the run's ``mostly_active`` (adaptive verify shapes:
    on sm_90 the Gluon kernel computes every row; else Triton skips the inactive ones)
    and, where decode steps replay FULL graphs, with the split count resolved on the
    device (``runtime_kv_splits``), as the backend launches it. The launch is mocked
    (timing needs a GPU)."""
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
                                     time_fn=lambda run: clock(run), adaptive_shapes=adaptive)
    measure(24, 1 + 2)
    assert launches[-1]["mostly_active"] is adaptive
    assert launches[-1]["runtime_kv_splits"] is False  # eager run: host split count


@pytest.mark.parametrize("use_mla", [True, False])
@pytest.mark.parametrize("verify_shape", ["adaptive", "fixed"])
def test_policy_times_the_rows_the_runs_verify_launches(monkeypatch, use_mla, verify_shape):
    """``BudgetPolicy.from_vllm_config``'s launches per cell ``(context, 1 + b)`` and
    the one-row column: with adaptive verify shapes a round of budget ``b`` verifies
    ``1 + b`` rows, all active (on sm_90 the MLA Gluon kernel computes every launched row,
    so ``1 + B`` rows would time every budget as B); with fixed ones ``1 + B`` rows, the
    first ``1 + b`` active. The kernels are mocked (timing needs a GPU)."""
    import vllm.distributed.parallel_state as parallel_state

    from vllm_ddtree.attention_backends import gqa_tree, mla_tree
    from vllm_ddtree.budget import attention_timing
    from vllm_ddtree.budget.policy import BudgetPolicy
    from vllm_ddtree.config import DDTreeConfig

    launches = []

    def launch(q, *args, **kwargs):
        seq_lens, query_start_loc = args[2:4] if use_mla else args[3:5]
        launches.append(dict(rows=q.shape[0], starts=query_start_loc.tolist(),
                             seq_len=int(seq_lens[0]), active=int(kwargs["active_query_lens"][0]),
                             max_query_len=kwargs["max_query_len"],
                             mostly_active=kwargs.get("mostly_active")))

    monkeypatch.setattr(mla_tree if use_mla else gqa_tree,
                        "mla_tree_verify" if use_mla else "gqa_tree_verify", launch)
    monkeypatch.setattr(attention_timing, "attention_time_fn",
                        lambda config, device: lambda run: (run(), 1e-6)[1])
    monkeypatch.setattr(parallel_state, "get_tp_group", lambda: NS(ranks=[0, 1]))
    config = fake_vllm_config(use_mla, max_model_len=2000)
    config.speculative_config = NS(ddtree=DDTreeConfig(budget=4, adaptive=True,
                                                       verify_shape=verify_shape))
    BudgetPolicy.from_vllm_config(config, 4, "cpu")
    adaptive = verify_shape == "adaptive"
    cells = {(launch["seq_len"] - launch["rows"], launch["active"]) for launch in launches}
    assert cells == {(c, q) for c in (1024, 2000) for q in (1, 2, 3, 5)}  # 1 + b, plain
    for launch in launches:
        rows = launch["active"] if adaptive else 1 + 4
        assert (launch["rows"], launch["starts"], launch["max_query_len"]) == (
            rows, [0, rows], rows), launch
        if use_mla:
            assert launch["mostly_active"] is adaptive


def test_adaptive_shapes_time_the_real_kernels_on_their_rows():
    """The MLA timer with adaptive shapes runs the tree kernel (Triton interpreter on
    CPU) on ``1 + b`` rows, every one computed."""
    from vllm_ddtree.budget.attention_timing import target_attention_timer

    seen = []

    def time_fn(run):
        seen.append(run())
        return clock(lambda: None)

    measure = target_attention_timer(fake_vllm_config(True), 1 + 4, torch.device("cpu"),
                                     time_fn=time_fn, adaptive_shapes=True)
    assert measure(24, 1 + 2) > 0
    out, lse = seen[-1]
    assert out.shape == (3, 2, 16) and bool(torch.isfinite(lse).all())
    assert not out.eq(0).all(dim=-1).any()  # every launched row is active


@pytest.mark.parametrize("block_size", [16, 1, None])
def test_mla_timer_reads_the_runs_page_size(monkeypatch, block_size):
    """The dummy cache the timer launches on has the run's KV page
    (``cache_config.block_size``; 64 where vLLM has not set one), so a run on 16- or
    1-token pages is timed on them, not on 64-token pages."""
    from vllm_ddtree.attention_backends import mla_tree
    from vllm_ddtree.budget.attention_timing import target_attention_timer

    launches = []
    monkeypatch.setattr(mla_tree, "mla_tree_verify",
                        lambda *args, **kwargs: launches.append(args))
    config = fake_vllm_config(True)
    config.cache_config = NS(cache_dtype="auto", block_size=block_size)
    measure = target_attention_timer(config, 1 + 4, torch.device("cpu"),
                                     time_fn=lambda run: clock(run))
    measure(24, 1 + 2)
    _, kv_cache, block_table, *_ = launches[-1]
    assert kv_cache.shape[1] == (block_size or 64)


@pytest.mark.parametrize("use_mla", [True, False])
@pytest.mark.parametrize("max_num_seqs", [None, 1, 3, 1000])
def test_timers_time_a_batch_and_give_one_requests_share(use_mla, max_num_seqs):
    """The start-up table is one request's share of a batch's launch: the timed call
    verifies ``min(TIMING_REQUESTS, max_num_seqs)`` requests of ``1 + b`` active rows
    each (every one computed), and the seconds are the call's over that count.
    Timed alone, a short-context request costs the kernel's latency, which a step pays
    once, not once a request. Real kernels (CPU reference / interpreter), fixed clock."""
    from vllm_ddtree.budget.attention_timing import TIMING_REQUESTS, target_attention_timer

    config = fake_vllm_config(use_mla)
    if max_num_seqs is not None:
        config.scheduler_config = NS(max_num_seqs=max_num_seqs)
    want = min(TIMING_REQUESTS, max_num_seqs or 1)
    outputs = []

    def time_fn(run):
        outputs.append(run())
        return 0.5

    measure = target_attention_timer(config, 1 + 4, torch.device("cpu"), time_fn=time_fn)
    assert measure(24, 1 + 2) == pytest.approx(0.5 / want)
    out = outputs[-1][0] if isinstance(outputs[-1], tuple) else outputs[-1]
    assert out.shape[0] == want * (1 + 4)  # fixed verify shape: 1 + B rows a request
    rows = out.float().reshape(want, 1 + 4, -1)[:, : 1 + 2]  # the active rows
    assert torch.isfinite(rows).all() and bool((rows != 0).any(dim=-1).all())
