"""vllm_ddtree.training.static_decode: batched greedy decoding of the MLA target on
fixed buffers (CPU, fp32, eager; the CUDA graph replays the same step on the GPU)."""

import pytest
import torch
from transformers import DeepseekV3ForCausalLM

from vllm_ddtree.training import configs
from vllm_ddtree.training.static_decode import StaticGreedyDecoder
from vllm_ddtree.training.train_drafter import greedy_continue

VOCAB = 96


def tiny_target(seed=0, std=0.2, **overrides):
    torch.manual_seed(seed)
    cfg = configs.target_config(VOCAB, 0, tiny=True)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    cfg.initializer_range = std
    return DeepseekV3ForCausalLM(cfg).eval()


@pytest.mark.parametrize("overrides", [{}, {"rope_interleave": False}, {"q_lora_rank": 24}])
def test_static_decoder_equals_transformers_greedy(overrides):
    """Same tokens as transformers' KV-cached greedy decoding, for batches smaller than
    the decoder's (padded rows), across two calls with different prefix lengths (the
    buffers keep the previous batch's keys beyond the current position)."""
    target = tiny_target(**overrides)
    decoder = StaticGreedyDecoder(target, batch=4, max_len=40, prefill_rows=3)
    gen = torch.Generator().manual_seed(1)
    for rows, plen, new in ((4, 17, 20), (3, 9, 25), (2, 1, 6)):
        prefix = torch.randint(2, VOCAB, (rows, plen), generator=gen)
        expected = greedy_continue(target, prefix, new)
        got = decoder(prefix, new)
        assert got.shape == (rows, plen + new)
        assert torch.equal(got, expected), (rows, plen, new)


def test_static_decoder_refuses_what_it_cannot_hold():
    target = tiny_target()
    decoder = StaticGreedyDecoder(target, batch=2, max_len=16)
    with pytest.raises(ValueError, match="batch 2"):
        decoder(torch.ones(3, 4, dtype=torch.long), 4)
    with pytest.raises(ValueError, match="max_len 16"):
        decoder(torch.ones(2, 10, dtype=torch.long), 7)
    prefix = torch.ones(2, 5, dtype=torch.long)
    assert decoder(prefix, 0) is prefix
    moe = configs.target_config(VOCAB, 0, tiny=True)
    moe.first_k_dense_replace = 1
    with pytest.raises(NotImplementedError, match="dense"):
        StaticGreedyDecoder(DeepseekV3ForCausalLM(moe), batch=2, max_len=16)


def test_agreement_is_one_for_an_exact_decoder_and_low_for_a_broken_one(monkeypatch):
    target = tiny_target()
    decoder = StaticGreedyDecoder(target, batch=4, max_len=48)
    prefix = torch.randint(2, VOCAB, (4, 16), generator=torch.Generator().manual_seed(2))
    assert decoder.agreement(prefix, 24) == 1.0
    # A step that attends to nothing past the prefix (a stale mask) parts at once.
    forward = decoder._forward
    monkeypatch.setattr(decoder, "_forward", lambda ids, rows, positions, num_keys:
                        forward(ids, rows, positions, min(num_keys, 16)))
    assert decoder.agreement(prefix, 24) < 0.5
