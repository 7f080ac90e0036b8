"""DFlash reference drafter: checkpoint format, RoPE, sliding window, config errors."""

import json

import pytest
import torch
from tiny_models import drafter_config, tiny_drafter, tiny_target
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding, apply_rotary_pos_emb

from vllm_ddtree.drafter_config import check_drafter_target_pair
from vllm_ddtree.reference import DFlashDraftModel, DrafterConfigError, generate
from vllm_ddtree.reference.drafter import DrafterRotary

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 512}


def test_checkpoint_format_round_trip(tmp_path):
    target = tiny_target("qwen3")
    drafter = tiny_drafter(target)
    drafter.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["block_size"] == 8
    assert config["dflash_config"]["target_layer_ids"] == [0, 2]
    from safetensors.torch import load_file

    names = set(load_file(tmp_path / "model.safetensors"))
    assert {"fc.weight", "hidden_norm.weight", "norm.weight",
            "layers.0.self_attn.q_proj.weight", "layers.1.mlp.gate_proj.weight"} <= names
    assert not any("embed" in n or "lm_head" in n for n in names)  # shared with the target
    loaded = DFlashDraftModel.from_pretrained(tmp_path).eval()
    for (name, a), (_, b) in zip(drafter.state_dict().items(), loaded.state_dict().items(),
                                 strict=True):
        assert torch.equal(a, b), name
    prompt = [3, 9, 27, 81 % 96, 50]
    assert (generate(target, loaded, prompt, 12, "ddtree", budget=8).tokens
            == generate(target, None, prompt, 12, "ar").tokens)


def test_layer_attention_resolution_matches_vllm():
    from vllm.model_executor.models import qwen3_dflash

    target = tiny_target("qwen3")
    for overrides in ({}, {"dflash_config": {"target_layer_ids": [0], "mask_token_id": 1,
                                             "causal": False}}):
        config = drafter_config(target.config, layer_types=("sliding_attention",
                                                            "full_attention"), **overrides)
        drafter = DFlashDraftModel(config)
        got = [(layer.self_attn.sliding_window, layer.self_attn.causal)
               for layer in drafter.layers]
        want = []
        for i in range(2):
            # vLLM's resolver asks the current vLLM config only for mixed layers.
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(qwen3_dflash, "get_current_vllm_config",
                           lambda: type("C", (), {"use_v2_model_runner": True})())
                want.append(qwen3_dflash._resolve_layer_attention(config, i))
        assert got == want


@pytest.mark.parametrize("rope", [{"rope_type": "default", "rope_theta": 10000.0}, YARN])
def test_rope_matches_transformers_and_vllm(rope):
    from vllm.model_executor.layers.rotary_embedding import get_rope

    config = Qwen3Config(hidden_size=64, num_attention_heads=4, head_dim=16,
                         max_position_embeddings=2048, rope_parameters=dict(rope))
    positions = torch.tensor([0, 1, 7, 300, 511, 1500, 2047])
    x = torch.randn(len(positions), 4, 16, generator=torch.Generator().manual_seed(0))
    ours = DrafterRotary(config)(x, positions)

    hf = Qwen3RotaryEmbedding(config)
    cos, sin = hf(x, positions[None])
    hf_rot, _ = apply_rotary_pos_emb(x.transpose(0, 1)[None], x.transpose(0, 1)[None], cos, sin)
    torch.testing.assert_close(ours, hf_rot[0].transpose(0, 1), atol=1e-5, rtol=1e-5)

    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):
        vllm_rope = get_rope(16, max_position=2048, is_neox_style=True,
                             rope_parameters=dict(rope), dtype=torch.float32)
    q, _ = vllm_rope.forward_native(positions, x.reshape(len(positions), -1).clone(),
                                    x.reshape(len(positions), -1).clone())
    torch.testing.assert_close(ours, q.view_as(x), atol=1e-4, rtol=1e-4)
    if rope["rope_type"] == "yarn":
        plain = DrafterRotary(Qwen3Config(hidden_size=64, num_attention_heads=4, head_dim=16,
                                          rope_parameters={"rope_type": "default",
                                                           "rope_theta": 10000.0}))
        assert not torch.allclose(plain(x, positions), ours, atol=1e-3)


def _block_logits_after_context(drafter, target, ctx_len: int, end: int):
    """Drafter logits for a block after ``ctx_len`` context rows ending at ``end``."""
    gen = torch.Generator().manual_seed(5)
    width = drafter.fc.in_features
    rows = torch.randn(ctx_len, width, generator=gen)
    tail = torch.randn(16, width, generator=torch.Generator().manual_seed(9))
    rows[-16:] = tail  # the last 16 rows (>= window) are identical in both contexts
    cache = drafter.new_context_cache()
    cache.append(rows, torch.arange(end - ctx_len, end))
    emb = target.get_input_embeddings()
    head = target.get_output_embeddings()
    return drafter.block_logits(4, end, cache, emb, head)


def test_sliding_window_only_sees_last_window_positions():
    target = tiny_target("qwen3")
    sliding = tiny_drafter(target, layer_types=("sliding_attention",) * 2, sliding_window=4)
    with torch.no_grad():
        short = _block_logits_after_context(sliding, target, 4 + 5 + 16, 600)
        long = _block_logits_after_context(sliding, target, 4 + 500 + 16, 600)
    torch.testing.assert_close(short, long, atol=0, rtol=0)
    full = tiny_drafter(target, layer_types=("sliding_attention", "full_attention"),
                        sliding_window=4)
    with torch.no_grad():
        short = _block_logits_after_context(full, target, 4 + 5 + 16, 600)
        long = _block_logits_after_context(full, target, 4 + 500 + 16, 600)
    assert not torch.allclose(short, long, atol=1e-4)


def test_sliding_window_keeps_bounded_cache():
    target = tiny_target("qwen3")
    drafter = tiny_drafter(target, layer_types=("sliding_attention", "full_attention"),
                           sliding_window=4)
    cache = drafter.new_context_cache()
    cache.append(torch.randn(50, drafter.fc.in_features), torch.arange(50))
    assert cache.keys[0].shape[0] == 4 and cache.keys[1].shape[0] == 50


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda c: setattr(c, "hidden_size", 32), "hidden_size"),
        (lambda c: setattr(c, "vocab_size", 95), "vocab_size"),
        (lambda c: c.dflash_config.update(target_layer_ids=[0, 3]), "target_layer_ids"),
        (lambda c: c.dflash_config.update(mask_token_id=96), "mask_token_id"),
        (lambda c: setattr(c, "architectures", ["Qwen3ForCausalLM"]), "architectures"),
        (lambda c: setattr(c, "dflash_config", None), "dflash_config"),
        (lambda c: setattr(c, "dflash_config", [0, 2]), r"dflash_config=\[0, 2\]"),
        (lambda c: c.dflash_config.update(target_layer_ids=["0", 2]),
         r"target_layer_ids=\['0', 2\]"),
        (lambda c: c.dflash_config.update(target_layer_ids=[0.5, 2]),
         r"target_layer_ids=\[0.5, 2\]"),
        (lambda c: c.dflash_config.update(target_layer_ids=[2, 2]), "distinct"),
        (lambda c: c.dflash_config.update(mask_token_id="95"), "mask_token_id='95'"),
        (lambda c: setattr(c, "block_size", "8"), "block_size='8'"),
        (lambda c: setattr(c, "block_size", True), "block_size=True"),
        (lambda c: setattr(c, "sliding_window", None), "sliding_window=None"),
    ],
)
def test_pair_mismatch_errors_name_the_field(mutate, field):
    target = tiny_target("qwen3")
    config = drafter_config(target.config)
    mutate(config)
    with pytest.raises(DrafterConfigError, match=field):
        check_drafter_target_pair(config, target.config)


def test_missing_dflash_config_rejected_at_construction():
    target = tiny_target("qwen3")
    config = drafter_config(target.config)
    del config.dflash_config
    with pytest.raises(DrafterConfigError, match="dflash_config"):
        DFlashDraftModel(config)


@pytest.mark.parametrize("kwargs, match", [
    ({"method": "ddtree", "budget": 0}, "budget"),
    ({"method": "ddtree", "budget": 513}, "budget"),
    ({"method": "beam"}, "method"),
    ({"method": "ddtree", "temperature": 1.0}, "seed"),
])
def test_generate_rejects_bad_arguments(kwargs, match):
    target = tiny_target("qwen3")
    drafter = tiny_drafter(target)
    with pytest.raises(ValueError, match=match):
        generate(target, drafter, [1, 2, 3], 4, **kwargs)


def test_generate_rejects_mismatched_pair():
    qwen = tiny_target("qwen3")
    other = tiny_target("qwen3", num_layers=1)
    drafter = tiny_drafter(qwen)  # target_layer_ids [0, 2]: layer 2 missing in `other`
    with pytest.raises(DrafterConfigError, match="target_layer_ids"):
        generate(other, drafter, [1, 2, 3], 4, "ddtree")


def test_from_pretrained_drafter_drafts_like_the_original(tmp_path):
    target = tiny_target("qwen3")
    drafter = tiny_drafter(target, rope_parameters=dict(YARN))
    drafter.save_pretrained(tmp_path)
    loaded = DFlashDraftModel.from_pretrained(tmp_path).eval()
    torch.testing.assert_close(loaded.rotary.inv_freq, drafter.rotary.inv_freq)
    assert loaded.rotary.attention_scaling == drafter.rotary.attention_scaling != 1.0
    with torch.no_grad():
        want = _block_logits_after_context(drafter, target, 40, 100)
        got = _block_logits_after_context(loaded, target, 40, 100)
    torch.testing.assert_close(got, want)
