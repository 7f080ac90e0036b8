"""evals/sampling_distribution.py: the homogeneity test, and a small CPU run on the
reference engine that keeps DDTree and rejects the lossy verifier."""

import random

import pytest
import sampling_distribution as sd


def test_homogeneity_test_accepts_one_distribution_and_rejects_two():
    rng = random.Random(0)
    weights = [0.5, 0.3, 0.15, 0.05] + [0.001] * 20
    tokens = list(range(len(weights)))

    def draw(w, n):
        return rng.choices(tokens, weights=w, k=n)

    same = sd.homogeneity_test(draw(weights, 2000), draw(weights, 2000))
    assert same["p"] > 1e-3
    # rare tokens (pooled count < MIN_POOLED) share one tail bin
    assert same["bins"] <= 4 + 1 + sum(1 for w in weights if w * 4000 >= sd.MIN_POOLED)
    shifted = [0.4, 0.4, 0.15, 0.05] + [0.001] * 20
    assert sd.homogeneity_test(draw(weights, 2000), draw(shifted, 2000))["p"] < 1e-6
    assert sd.homogeneity_test([3] * 50, [3] * 50) == {"chi2": 0.0, "dof": 0, "p": 1.0,
                                                         "bins": 1}


def test_arguments_are_checked():
    with pytest.raises(SystemExit):
        sd.parse_args(["--backend", "ref"])  # top-p 0.95: the reference engine has none
    with pytest.raises(SystemExit):
        sd.parse_args(["--temperature", "0"])
    with pytest.raises(SystemExit):
        sd.parse_args(["--lossy-rate", "2"])


def test_reference_engine_keeps_ddtree_and_rejects_the_lossy_verifier(tmp_path):
    """60 samples per arm of the first 2 tokens of one prompt at T = 0.8: DDTree's token
    histograms stay homogeneous with plain decoding's; a verifier that commits the
    drafter's token in every round (rate 1) moves position 2 far beyond the level."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small forwards: more threads only contend
    out = tmp_path / "sd.md"
    args = sd.parse_args(["--backend", "ref", "--samples", "60", "--top-p", "1",
                          "--prompts", "1", "--positions", "2", "--lossy-rate", "1.0",
                          "--out", str(out)])
    try:
        tests = sd.run(args, "pytest")
    finally:
        torch.set_num_threads(threads)
    assert not tests["ddtree"]["rejected"], tests["ddtree"]
    assert tests["lossy"]["rejected"], tests["lossy"]
    first = [r for r in tests["lossy"]["rows"] if r["position"] == 1]
    assert all(r["p"] > tests["lossy"]["level"] for r in first)  # the prefill's token
    text = out.read_text()
    assert "`ddtree`: not rejected" in text and "`lossy`: rejected" in text
    assert out.with_suffix(".png").is_file()
