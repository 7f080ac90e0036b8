"""vllm_ddtree.training.vllm_pool: the drafter's greedy pool decoded by vLLM (CPU vLLM,
fp32, a tiny Qwen3 target: CPU vLLM has no MLA) equals transformers' greedy decoding,
with one prefix length per sequence, EOS padding and the aux hidden states of the
finished sequences."""

import numpy as np
import pytest
import torch
from evals_scripts import load_evals_script
from transformers import Qwen3Config, Qwen3ForCausalLM

from vllm_ddtree.training.drafter_forward import target_aux_hidden
from vllm_ddtree.training.train_drafter import DrafterTrainConfig, greedy_continue
from vllm_ddtree.training.vllm_pool import (
    PoolRequest,
    _pack,
    _unpack,
    build_pools_vllm,
    vllm_greedy_continuations,
)

VOCAB, EOS = 96, 0


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    """A tiny fp32 Qwen3 target saved for vLLM (head_dim 64: CPU attention needs it)."""
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=128, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=64, max_position_embeddings=256, initializer_range=0.2,
                         tie_word_embeddings=False, eos_token_id=EOS)
    model = Qwen3ForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("qwen3")
    model.save_pretrained(path)
    return path, model


def test_pack_roundtrip_and_length_check():
    rows = [np.arange(3), np.arange(0), np.arange(5, 12)]
    flat, offsets = _pack(rows)
    assert offsets.tolist() == [0, 3, 3, 10]
    assert [r.tolist() for r in _unpack(flat, offsets)] == [r.tolist() for r in rows]
    with pytest.raises(ValueError, match="raise max_model_len"):
        vllm_greedy_continuations("unused", [np.arange(10)], [8], max_model_len=16)


@torch.no_grad()
def test_vllm_pool_equals_transformers_greedy(qwen3_dir):
    path, model = qwen3_dir
    corpus = np.random.default_rng(0).integers(2, VOCAB, 4000)
    cfg = DrafterTrainConfig(seq_len=64, prefix_min=4, prefix_max=40, gen_batch=4,
                             continuation_max=20)
    reversed_corpus = corpus[::-1].copy()
    pool, other = build_pools_vllm(
        model, path, [PoolRequest(corpus, 7, 3), PoolRequest(reversed_corpus, 2, 4)],
        (0, 1), cfg, "cpu", dtype="float32")
    assert pool.tokens.shape == (7, 64) and len(set(pool.prefix_len.tolist())) == 7
    assert other.tokens.shape == (2, 64)
    assert pool.prefix_len.min() >= 4 and pool.prefix_len.max() <= 40
    check_pool(model, pool, corpus)
    check_pool(model, other, reversed_corpus)


@torch.no_grad()
def check_pool(model, pool, corpus):
    """Rows = corpus slice + transformers' greedy continuation + EOS; aux recomputed."""
    for row, p, end in zip(pool.tokens, pool.prefix_len.tolist(), pool.end.tolist(),
                           strict=True):
        assert end == p + min(64 - p, 20)
        windows = np.lib.stride_tricks.sliding_window_view(corpus, p)
        assert (windows == row[:p].numpy()).all(1).any(), "the prefix is a corpus slice"
        want = greedy_continue(model, row[None, :p], end - p)[0]
        assert torch.equal(row[:end], want)
        assert (row[end:] == EOS).all()
    torch.testing.assert_close(pool.aux, target_aux_hidden(model, pool.tokens, (0, 1)))


def test_vllm_failure_names_the_fallback(tmp_path):
    with pytest.raises(RuntimeError, match="--pool-engine hf"):
        vllm_greedy_continuations(tmp_path / "missing", [np.arange(2, 6)], [3],
                                  max_model_len=16, dtype="float32")


@pytest.mark.parametrize("choice", ["auto", "vllm"])
def test_train_pair_pool_engine_fallback(monkeypatch, capsys, tmp_path, choice):
    """``auto`` falls back to transformers when the vLLM child fails and says so;
    an explicit ``vllm`` raises."""
    import argparse

    mod = load_evals_script("train_pair")
    calls = []

    def failing_vllm(*args, **kwargs):
        raise RuntimeError("vLLM greedy pool failed (exit 1)")

    def fake_hf(target, corpus, num, layer_ids, cfg, **kwargs):
        calls.append((num, kwargs["max_seconds"]))
        return f"pool{num}"

    monkeypatch.setattr(mod, "pool_engine", lambda choice, device: "vllm")
    monkeypatch.setattr(mod, "build_pools_vllm", failing_vllm)
    monkeypatch.setattr(mod, "build_pool", fake_hf)
    args = argparse.Namespace(pool_engine=choice, seed=0, no_progress=True)
    cfg = DrafterTrainConfig(gen_sequences=5, eval_sequences=2, gen_minutes=0.5)
    splits = {"train": np.zeros(8), "valid": np.zeros(8)}

    def run():
        return mod.greedy_pools(args, None, tmp_path, splits, (0,), cfg, torch.device("cpu"))

    if choice == "vllm":
        with pytest.raises(RuntimeError, match="exit 1"):
            run()
        assert calls == []
        return
    assert run() == ("pool5", "pool2", "hf")
    assert calls == [(5, 30.0), (2, None)]
    assert "WARNING: the vLLM greedy pool failed" in capsys.readouterr().out
