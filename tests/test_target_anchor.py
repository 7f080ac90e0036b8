"""The target fine-tune's anchor (``train_target``, ``anchor_weight``): a KL to the
starting weights on code windows that keeps the code distribution while the fine-tune
learns something else."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from training_testing import VOCAB
from transformers import DeepseekV3ForCausalLM

from vllm_ddtree.training import configs
from vllm_ddtree.training.train_target import (
    TargetTrainConfig,
    anchor_kl,
    evaluate_anchor_kl,
    evaluate_nll,
    train_target,
)


def _model(seed: int = 0) -> DeepseekV3ForCausalLM:
    torch.manual_seed(seed)
    return DeepseekV3ForCausalLM(configs.target_config(VOCAB, 0, tiny=True))


def _periodic(seed: int, period: int = 24, repeats: int = 300) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.tile(rng.integers(2, VOCAB, size=period), repeats).astype(np.uint16)


def test_anchor_kl_is_the_kl_between_next_token_distributions():
    start, moved = _model(0).eval(), _model(1).eval()
    windows = torch.as_tensor(_periodic(0)[:64].astype(np.int64)).view(4, 16)
    with torch.no_grad():
        same = float(anchor_kl(start, copy.deepcopy(start), windows))
        got = float(anchor_kl(moved, start, windows))
    assert same == pytest.approx(0, abs=1e-6)
    with torch.no_grad():
        p = torch.log_softmax(start(input_ids=windows).logits.double(), -1)
        q = torch.log_softmax(moved(input_ids=windows).logits.double(), -1)
    direct = float((p.exp() * (p - q)).sum(-1).mean())
    assert got == pytest.approx(direct, rel=1e-4) and got > 0.01
    # consecutive windows of a flat array, the same mean
    flat = windows.flatten().numpy()
    assert evaluate_anchor_kl(moved, start, flat, 16, batch_size=3) == pytest.approx(
        direct, rel=1e-4)


def _fine_tune(weight: float | None, code: np.ndarray, task: np.ndarray):
    model = _model(0)
    pre = TargetTrainConfig(seq_len=24, batch_size=8, lr=3e-3, warmup_steps=3, steps=40,
                            eval_every=1000, seed=0)
    train_target(model, code, None, pre, "cpu", progress=False)  # "the shipped target"
    start = copy.deepcopy(model).eval()
    cfg = TargetTrainConfig(seq_len=24, batch_size=8, lr=3e-3, warmup_steps=3, steps=30,
                            eval_every=15, keep_best=False, seed=0, anchor_weight=weight,
                            anchor_seq_len=12)
    log = train_target(model, task, code, cfg, "cpu", progress=False,
                       anchor_tokens=code if weight else None)
    return model, start, log


def test_an_anchored_fine_tune_keeps_the_code_distribution_and_learns_the_task():
    """A target trained on one sequence ("code") is fine-tuned on another ("the task"):
    unanchored, its predictions on code move; anchored, they move far less, and it
    still learns the task."""
    code, task = _periodic(0), _periodic(1)
    free, start, free_log = _fine_tune(None, code, task)
    held, _, held_log = _fine_tune(5.0, code, task)
    drift_free = evaluate_anchor_kl(free, start, code, 12, max_windows=16)
    drift_held = evaluate_anchor_kl(held, start, code, 12, max_windows=16)
    print(f"KL to the start on code: free {drift_free:.4f}, anchored {drift_held:.4f}")
    assert drift_held < 0.25 * drift_free, (drift_held, drift_free)
    task_start, _ = evaluate_nll(start, task, 24, max_windows=8)
    task_held, _ = evaluate_nll(held, task, 24, max_windows=8)
    print(f"task loss: start {task_start:.3f}, anchored {task_held:.3f}")
    assert task_held < 0.7 * task_start, (task_start, task_held)
    # the evaluations log the KL on the validation split (here the code itself)
    assert len(held_log.extra["anchor_kls"]) == len(held_log.eval_steps) == 2
    assert held_log.extra["anchor_kls"][-1] == pytest.approx(
        evaluate_anchor_kl(held, start, code, 12, max_windows=64), rel=1e-4)
    assert "anchor_kls" not in free_log.extra


def test_anchor_weight_zero_is_the_plain_fine_tune():
    code, task = _periodic(0), _periodic(1)
    plain, _, plain_log = _fine_tune(None, code, task)
    zero, _, zero_log = _fine_tune(0.0, code, task)
    assert plain_log.losses == zero_log.losses
    for (name, a), (_, b) in zip(plain.state_dict().items(), zero.state_dict().items(),
                                 strict=True):
        assert torch.equal(a, b), name


def test_bad_anchor_settings_are_refused_before_training():
    code = _periodic(0)
    model = _model(0)
    cfg = TargetTrainConfig(seq_len=24, batch_size=8, steps=1, anchor_weight=-1.0)
    with pytest.raises(ValueError, match=r"anchor_weight=-1.0 is not allowed: a KL weight >= 0"):
        train_target(model, code, None, cfg, "cpu", progress=False, anchor_tokens=code)
    cfg = TargetTrainConfig(seq_len=24, batch_size=8, steps=1, anchor_weight=1.0,
                            anchor_seq_len=12)
    with pytest.raises(ValueError, match="needs anchor_tokens .* got None tokens"):
        train_target(model, code, None, cfg, "cpu", progress=False)
    with pytest.raises(ValueError, match="longer than anchor_seq_len=12, got 10 tokens"):
        train_target(model, code, None, cfg, "cpu", progress=False, anchor_tokens=code[:10])


def test_train_pair_anchors_a_fine_tune_to_its_starting_target(tmp_path, capsys):
    """``--target-anchor-kl``: the fine-tune logs its KL to the start at every
    evaluation; without ``--target-init`` there is no start to anchor to."""
    import json

    from evals_scripts import load_evals_script
    from training_testing import tiny_corpus

    data = tmp_path / "data"
    tiny_corpus(data)
    mod = load_evals_script("train_pair")
    flags = ["--tiny", "--no-progress", "--stage", "target", "--target-steps", "3",
             "--data", str(data)]
    mod.main([*flags, "--out", str(tmp_path / "first")])
    with pytest.raises(SystemExit):
        mod.main([*flags, "--out", str(tmp_path / "x"), "--target-anchor-kl", "1"])
    assert "needs --target-init" in capsys.readouterr().err
    mod.main([*flags, "--out", str(tmp_path / "second"), "--target-anchor-kl", "1",
              "--target-init", str(tmp_path / "first" / "target")])
    line = next(x for x in capsys.readouterr().out.splitlines() if "kept step" in x)
    assert "KL to the start on code" in line, line
    summary = json.loads((tmp_path / "second" / "results" / "train_pair.json").read_text())
    kls = summary["target"]["log"]["anchor_kls"]
    assert len(kls) == len(summary["target"]["log"]["eval_losses"]) >= 1
    assert all(0 <= x < 1 for x in kls), kls
