"""``evals/fp8_margin_noise.py`` on the embedded target (CPU): without noise the leads
are the exact ones; noise spreads them, more with a larger sigma, and the same seed
gives the same draw."""

import fp8_margin_noise
import numpy as np
import pytest
import torch

from vllm_ddtree.demo.reference_engine import CHECKPOINTS


@pytest.fixture(scope="module")
def target():
    if not (CHECKPOINTS / "target" / "config.json").exists():
        pytest.skip("the embedded pair is not trained here")
    from vllm_ddtree.demo.reference_engine import load_embedded_pair

    return load_embedded_pair().target.float().eval()


def test_noise_spreads_the_exact_leads(target):
    prompt = [3 + (7 * i) % 900 for i in range(17)]
    generated = fp8_margin_noise.exact_greedy(target, prompt, 6)
    lead, spreads = fp8_margin_noise.noise_spread(target, prompt, generated, 5,
                                                  [0.0, 1e-3, 1e-2], seeds=3)
    none, small, large = spreads
    assert lead > 0  # the greedy token leads at its own position
    np.testing.assert_array_equal(none.at_position, lead)
    assert not none.change.any() and none.flips == 0
    assert small.change.std() > 0 and large.change.std() > small.change.std()
    again = fp8_margin_noise.noise_spread(target, prompt, generated, 5, [1e-2], seeds=3)[1]
    np.testing.assert_array_equal(again[0].change, large.change)
    table = fp8_margin_noise.report(lead, spreads, 5)
    rows = [line for line in table.splitlines() if line.startswith("| 0")]
    assert len(rows) == 3 and f"{lead:.3f}" in table


def test_main_refuses_a_position_past_the_tokens(capsys):
    with pytest.raises(SystemExit):
        fp8_margin_noise.main(["--tokens", "4", "--position", "4"])
    assert "--position must be in [0, --tokens), got 4 with --tokens 4" in (
        capsys.readouterr().err)


def test_perturbation_leaves_the_model_as_it_was(target):
    """The hooks are removed: a later exact run is unchanged."""
    from vllm_ddtree.testing.fp8_mla_reference import fp8_cache_logits

    prompt = [3 + (7 * i) % 900 for i in range(5)]
    before = fp8_cache_logits(target, prompt, [84, 13])
    fp8_margin_noise.noise_spread(target, prompt, [84, 13], 1, [1e-2], seeds=1)
    assert torch.equal(fp8_cache_logits(target, prompt, [84, 13]), before)


def test_bf16_rounding_moves_gaps_by_a_reproducible_draw(target):
    """``--bf16``: one change per decoded position and seed (the prefill row left out),
    two log-probs each; the same seeds give the same draw; the hooks come off."""
    from vllm_ddtree.testing.fp8_mla_reference import fp8_cache_logits

    prompt = [3 + (7 * i) % 900 for i in range(17)]
    before = fp8_cache_logits(target, prompt, [84, 13])
    gaps, logprobs = fp8_margin_noise.bf16_rounding_spread(target, [prompt], 5, seeds=2)
    assert gaps.shape == (2 * 4,) and logprobs.shape == (2 * 5 * 2,)
    assert (gaps > 0).any() and np.isfinite(gaps).all() and (logprobs < 1.0).all()
    again = fp8_margin_noise.bf16_rounding_spread(target, [prompt], 5, seeds=2)
    np.testing.assert_array_equal(again[0], gaps)
    assert torch.equal(fp8_cache_logits(target, prompt, [84, 13]), before)
    table = fp8_margin_noise.bf16_report(gaps, logprobs)
    assert table.splitlines()[-1].startswith("| 8 | ")
