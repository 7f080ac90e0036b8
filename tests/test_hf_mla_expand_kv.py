"""vllm_ddtree.patches.hf_mla_expand_kv: greedy decoding with incrementally expanded MLA keys /
values gives the logits and tokens of transformers' own full re-expansion (CPU, fp32)."""

import pytest
import torch
from transformers import DeepseekV3ForCausalLM, DynamicCache

from vllm_ddtree.patches.hf_mla_expand_kv import (
    _ExpandedKVMemo,
    incremental_expand_kv,
    require_transformers_version,
)
from vllm_ddtree.training import configs
from vllm_ddtree.training.train_drafter import greedy_continue


def tiny_target(seed=0):
    torch.manual_seed(seed)
    cfg = configs.target_config(96, 0, tiny=True)
    cfg.initializer_range = 0.2  # non-degenerate greedy text
    return DeepseekV3ForCausalLM(cfg).eval()


def decode_logits(model, prefix, steps):
    """Per-step last-position logits ``[steps, B, V]`` of greedy decoding."""
    cache = DynamicCache(config=model.config)
    out = model(input_ids=prefix, past_key_values=cache, use_cache=True, logits_to_keep=1)
    logits = [out.logits[:, -1]]
    for _ in range(steps - 1):
        nxt = logits[-1].argmax(-1)
        out = model(input_ids=nxt[:, None], past_key_values=cache, use_cache=True)
        logits.append(out.logits[:, -1])
    return torch.stack(logits)


@torch.no_grad()
def test_incremental_expand_matches_full_expansion():
    model = tiny_target()
    prefix = torch.randint(2, 96, (3, 37), generator=torch.Generator().manual_seed(0))
    plain = decode_logits(model, prefix, 80)  # passes the memo's first doubling (64)
    with incremental_expand_kv(model):
        memo = decode_logits(model, prefix, 80)
        assert any(isinstance(m.__dict__.get("expand_kv"), _ExpandedKVMemo)
                   for m in model.modules())
    torch.testing.assert_close(memo, plain, rtol=1e-5, atol=1e-5)
    assert torch.equal(memo.argmax(-1), plain.argmax(-1))
    # restored on exit: no instance attribute shadows the class method any more
    assert not any("expand_kv" in m.__dict__ for m in model.modules())


@torch.no_grad()
def test_greedy_continue_equals_plain_decoding_and_restarts_per_generation():
    model = tiny_target(seed=1)
    gen = torch.Generator().manual_seed(1)
    a = torch.randint(2, 96, (2, 20), generator=gen)
    b = torch.randint(2, 96, (4, 50), generator=gen)  # other batch, longer prefix
    for prefix in (a, b, a):
        want = prefix
        plain = decode_logits(model, prefix, 30).argmax(-1).T
        got = greedy_continue(model, prefix, 30)
        assert torch.equal(got[:, :prefix.shape[1]], want)
        assert torch.equal(got[:, prefix.shape[1]:], plain)


def test_other_transformers_version_is_refused():
    with pytest.raises(RuntimeError, match="transformers==5.17.0"):
        require_transformers_version("5.18.0")
    require_transformers_version("5.17.0")
