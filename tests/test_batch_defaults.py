"""patches/batch_defaults.py: batch limits that fit a DDTree tree, chosen where the user
did not set them, refused with the budget and the fix where the user's cannot work."""

from types import SimpleNamespace as NS

import pytest

from vllm_ddtree.config import DDTreeConfigError
from vllm_ddtree.patches import batch_defaults
from vllm_ddtree.patches.batch_defaults import TREE_SHAPE_ATTR, fit_batch_to_tree

# vLLM 0.26's defaults on a GPU with >= 70 GiB (arg_utils.py:2460-2469).
SERVE_SEQS, SERVE_TOKENS = 1024, 8192


def schedulable(seqs: int, tokens: int, block_size: int = 16) -> int:
    """What vLLM's _set_max_num_scheduled_tokens leaves after DDTree's drafting slots."""
    return tokens - seqs * (block_size - 2)


@pytest.mark.parametrize("budget", [1, 8, 32, 64, 256, 512])
def test_serve_defaults_shrink_max_num_seqs_until_every_tree_fits(budget):
    assert schedulable(SERVE_SEQS, SERVE_TOKENS) < 0  # vLLM refuses to start
    seqs, tokens, note = fit_batch_to_tree(budget, 16, SERVE_SEQS, SERVE_TOKENS,
                                           seqs_set=False, tokens_set=False)
    assert tokens == SERVE_TOKENS and 1 <= seqs < SERVE_SEQS
    assert schedulable(seqs, tokens) >= seqs * (1 + budget)  # all verify in one step
    assert schedulable(seqs + 1, tokens) < (seqs + 1) * (1 + budget)  # the largest such
    assert f"max_num_seqs {SERVE_SEQS} -> {seqs}" in note
    assert f"num_speculative_tokens={budget}" in note


def test_limits_that_already_fit_are_kept():
    assert fit_batch_to_tree(32, 16, 32, 2048, seqs_set=False, tokens_set=False) == (
        32, 2048, None)
    assert fit_batch_to_tree(32, 16, 32, 2048, seqs_set=True, tokens_set=True) == (
        32, 2048, None)


def test_user_sequences_raise_default_tokens():
    seqs, tokens, note = fit_batch_to_tree(64, 16, 256, SERVE_TOKENS, seqs_set=True,
                                           tokens_set=False)
    assert seqs == 256 and tokens == 256 * (65 + 14)
    assert "max_num_batched_tokens 8192 -> 20224" in note


def test_user_tokens_lower_default_sequences():
    seqs, tokens, _ = fit_batch_to_tree(64, 16, 1024, 4096, seqs_set=False, tokens_set=True)
    assert tokens == 4096 and seqs == 4096 // 79


def test_a_tiny_default_token_budget_still_fits_one_tree():
    seqs, tokens, _ = fit_batch_to_tree(512, 16, 256, 256, seqs_set=False, tokens_set=False)
    assert seqs == 1 and schedulable(1, tokens) >= 513


def test_user_limits_that_cannot_verify_a_tree_name_the_budget_and_the_fix():
    with pytest.raises(DDTreeConfigError) as err:
        fit_batch_to_tree(64, 16, 1024, 8192, seqs_set=True, tokens_set=True)
    message = str(err.value)
    for part in ("num_speculative_tokens=64", "max_num_batched_tokens=8192",
                 "max_num_seqs=1024", "--max-num-batched-tokens to at least 80896"):
        assert part in message


def test_user_limits_below_the_drafters_block_pass_name_both_fixes():
    """Enough tokens for the trees but not for every sequence's drafter block (the worker
    would refuse it after loading the model)."""
    with pytest.raises(DDTreeConfigError) as err:
        fit_batch_to_tree(8, 16, 64, 1000, seqs_set=True, tokens_set=True)
    message = str(err.value)
    for part in ("max_num_seqs=64 x 16 = 1024", "max_num_batched_tokens=1000",
                 "at least 1024", "--max-num-seqs to at most 62"):
        assert part in message, message
    assert fit_batch_to_tree(8, 16, 62, 1000, seqs_set=True, tokens_set=True)[:2] == (62, 1000)


def _engine_args(monkeypatch, **kwargs):
    from vllm.engine.arg_utils import EngineArgs

    name = "_set_default_max_num_seqs_and_batched_tokens_args"
    monkeypatch.setattr(EngineArgs, name, getattr(EngineArgs, name))  # undone after the test
    batch_defaults.apply()
    monkeypatch.setattr(EngineArgs, "get_batch_defaults", classmethod(
        lambda cls, world_size: ({None: SERVE_TOKENS}, {None: SERVE_SEQS})))
    return EngineArgs(model="unused", **kwargs)


def test_the_patched_engine_args_apply_it_to_ddtree_runs_only(monkeypatch, caplog):
    model = NS(max_model_len=4096, is_multimodal_model=False, is_mm_prefix_lm=False)
    parallel = NS(use_batched_dp_moe=False)

    plain = _engine_args(monkeypatch)
    plain._set_default_max_num_seqs_and_batched_tokens_args(None, model, parallel)
    assert (plain.max_num_seqs, plain.max_num_batched_tokens) == (SERVE_SEQS, SERVE_TOKENS)

    ddtree = _engine_args(monkeypatch)
    setattr(ddtree, TREE_SHAPE_ATTR, (32, 16))
    # the note goes to a child of vLLM's "vllm" logger (shown by `vllm serve`), which
    # need not propagate to the root logger where caplog listens
    batch_defaults.logger.addHandler(caplog.handler)
    try:
        with caplog.at_level("INFO", logger=batch_defaults.logger.name):
            ddtree._set_default_max_num_seqs_and_batched_tokens_args(None, model, parallel)
    finally:
        batch_defaults.logger.removeHandler(caplog.handler)
    assert batch_defaults.logger.name.startswith("vllm.")
    assert ddtree.max_num_seqs == SERVE_TOKENS // (33 + 14)
    assert "so that every running request verifies its 33 tree tokens" in caplog.text

    ddtree = _engine_args(monkeypatch, max_num_seqs=1024, max_num_batched_tokens=8192)
    setattr(ddtree, TREE_SHAPE_ATTR, (32, 16))
    with pytest.raises(DDTreeConfigError, match="num_speculative_tokens=32"):
        ddtree._set_default_max_num_seqs_and_batched_tokens_args(None, model, parallel)
