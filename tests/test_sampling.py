"""Keyed sampling: deterministic per (seed, position), uniform, and a real sampler."""

import torch

from vllm_ddtree.reference.sampling import choose_tokens, keyed_uniform


def test_noise_depends_only_on_seed_and_position():
    a = keyed_uniform(3, torch.tensor([5, 9, 5]), 100)
    assert torch.equal(a[0], a[2]) and not torch.equal(a[0], a[1])
    assert not torch.equal(keyed_uniform(4, torch.tensor([5]), 100)[0], a[0])
    assert (a > 0).all() and (a < 1).all()


def test_noise_is_uniform():
    u = keyed_uniform(0, torch.arange(200), 1000).flatten()
    hist = torch.histc(u, bins=10, min=0, max=1) / u.numel()
    assert (hist - 0.1).abs().max() < 0.005
    assert abs(u.mean().item() - 0.5) < 0.002


def test_gumbel_max_samples_the_softmax():
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]])
    draws = torch.stack([choose_tokens(logits, torch.tensor([p]), 1.0, seed=1)[0]
                         for p in range(20000)])
    freq = torch.bincount(draws, minlength=4).double() / draws.numel()
    torch.testing.assert_close(freq, torch.softmax(logits[0].double(), -1), atol=0.012, rtol=0)
