"""YaRN long-context copies of a checkpoint (``vllm_ddtree/long_context.py``): the
config written, transformers and vLLM applying the same rotation and softmax scale, the
embedded target holding past its 512-token window, and DDTree staying lossless."""

import json
import math

import pytest
import torch
from evals_scripts import load_evals_script

from vllm_ddtree.demo.reference_engine import CHECKPOINTS
from vllm_ddtree.long_context import (
    scaled_max_positions,
    write_rope_scaled,
    write_rope_scaled_pair,
    yarn_parameters,
)


def test_yarn_parameters_and_max_positions():
    rope = yarn_parameters(4.0, 512)
    assert rope == {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                    "original_max_position_embeddings": 512}
    assert scaled_max_positions(rope) == 2048
    with pytest.raises(ValueError, match="factor must be > 1"):
        yarn_parameters(1.0)
    with pytest.raises(ValueError, match="original_positions"):
        yarn_parameters(2.0, 0)


def test_write_rope_scaled_links_weights_and_rewrites_config(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({
        "model_type": "deepseek_v3", "max_position_embeddings": 4096,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}))
    (src / "model.safetensors").write_bytes(b"weights")
    (src / "tokenizer.json").write_text("{}")
    out = write_rope_scaled(src, tmp_path / "out", yarn_parameters(4.0, 512))
    config = json.loads((out / "config.json").read_text())
    assert config["rope_parameters"]["rope_type"] == "yarn"
    assert config["max_position_embeddings"] == 2048
    assert (out / "model.safetensors").is_symlink()
    assert (out / "model.safetensors").read_bytes() == b"weights"
    assert json.loads((src / "config.json").read_text())["max_position_embeddings"] == 4096
    # again into the same folder: replaced, not stacked
    write_rope_scaled(src, out, yarn_parameters(2.0, 512))
    assert json.loads((out / "config.json").read_text())["max_position_embeddings"] == 1024
    copied = write_rope_scaled(src, tmp_path / "copied", yarn_parameters(2.0, 512), link=False)
    assert not (copied / "model.safetensors").is_symlink()
    assert (copied / "model.safetensors").read_bytes() == b"weights"
    with pytest.raises(ValueError, match="already scaled"):
        write_rope_scaled(out, tmp_path / "twice", yarn_parameters(2.0, 512))
    with pytest.raises(FileNotFoundError, match="config.json"):
        write_rope_scaled(tmp_path / "missing", tmp_path / "x", yarn_parameters())

    pair_src = tmp_path / "pair_src"
    (pair_src / "drafter").mkdir(parents=True)
    (pair_src / "drafter" / "config.json").write_text("{}")
    __import__("shutil").copytree(src, pair_src / "target")
    for _ in range(2):  # a second call replaces the pair
        pair = write_rope_scaled_pair(pair_src, tmp_path / "pair", yarn_parameters(4.0, 512))
    assert json.loads((pair / "target" / "config.json").read_text())[
        "max_position_embeddings"] == 2048
    assert (pair / "drafter").is_symlink()
    assert (pair / "drafter").resolve() == (pair_src / "drafter").resolve()
    # a drafter with fewer positions than the scaled target: a copy of its config raised
    # to the target's (weights linked), which the max_model_len check then accepts
    (pair_src / "drafter" / "config.json").write_text('{"max_position_embeddings": 4096}')
    (pair_src / "drafter" / "model.safetensors").write_bytes(b"drafter")
    for _ in range(2):  # replaces the earlier link, then its own copy
        pair = write_rope_scaled_pair(pair_src, tmp_path / "pair", yarn_parameters(64.0, 512))
    drafter = pair / "drafter"
    assert not drafter.is_symlink()
    assert json.loads((drafter / "config.json").read_text())["max_position_embeddings"] == 32768
    assert (drafter / "model.safetensors").read_bytes() == b"drafter"
    assert json.loads((pair_src / "drafter" / "config.json").read_text())[
        "max_position_embeddings"] == 4096
    pair = write_rope_scaled_pair(pair_src, tmp_path / "pair", yarn_parameters(4.0, 512))
    assert (pair / "drafter").is_symlink()


def _deepseek_config(rope: dict):
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=64, hidden_size=64, num_attention_heads=2, num_key_value_heads=2,
        q_lora_rank=None, kv_lora_rank=32, qk_rope_head_dim=64, qk_nope_head_dim=32,
        v_head_dim=32, head_dim=64, num_hidden_layers=1, first_k_dense_replace=1,
        max_position_embeddings=scaled_max_positions(rope), rope_parameters=dict(rope))


def test_vllm_and_transformers_apply_the_same_yarn_rope():
    """vLLM's DeepSeek path (``deepseek_yarn``, as ``deepseek_v2.py`` maps ``yarn``)
    against transformers' DeepseekV3 rotary embedding, at every position the scaled
    config covers, and the same softmax scale on both sides."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3RotaryEmbedding,
        apply_rotary_pos_emb_interleave,
        yarn_apply_mscale,
    )
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope
    from vllm.model_executor.models.deepseek_v2 import yarn_get_mscale

    rope = yarn_parameters(4.0, 512)
    config = _deepseek_config(rope)
    positions = torch.arange(scaled_max_positions(rope))
    torch.manual_seed(0)
    q = torch.randn(len(positions), 2, 64)
    k = torch.randn(len(positions), 1, 64)

    hf_rotary = DeepseekV3RotaryEmbedding(config=config)
    cos, sin = hf_rotary(q, positions[None])
    hf_q, hf_k = apply_rotary_pos_emb_interleave(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    hf_q, hf_k = hf_q[0].transpose(0, 1), hf_k[0].transpose(0, 1)

    vllm_rope = {**rope, "rope_type": "deepseek_yarn"}
    with set_current_vllm_config(VllmConfig()):
        rotary = get_rope(64, max_position=config.max_position_embeddings,
                          is_neox_style=False, rope_parameters=vllm_rope, dtype=torch.float32)
    v_q, v_k = rotary.forward_native(positions, q.clone(), k.clone())
    # transformers returns the pairs de-interleaved ([evens | odds]); vLLM keeps them
    # interleaved. Same rotation, another layout of the same dot products.
    for hf, v in ((hf_q, v_q), (hf_k, v_k)):
        torch.testing.assert_close(v[..., 0::2], hf[..., :32], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v[..., 1::2], hf[..., 32:], rtol=1e-5, atol=1e-5)
    assert rotary.mscale == pytest.approx(0.1 * math.log(4.0) + 1.0)
    # softmax scale: vLLM multiplies by yarn_get_mscale(factor, mscale_all_dim)^2
    # (deepseek_v2.py), transformers by its yarn_apply_mscale; both leave it alone here
    scale = 192 ** -0.5
    assert yarn_apply_mscale(config.rope_parameters, scale) == scale
    assert yarn_get_mscale(rope["factor"], float(rope.get("mscale_all_dim", False))) == 1.0


def _code_prompt(tokenizer, length: int) -> list[int]:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "evals"))
    from e2e_models import code_prompts

    return code_prompts(tokenizer, 1, length)[0]


def test_yarn_copy_holds_the_embedded_target_past_its_window(tmp_path):
    """Loss over positions 640-1023 of standard-library code: the unscaled target falls
    apart there (about 4.5 nats), the YaRN copy stays near its short-range loss."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(CHECKPOINTS / "target")
    ids = torch.tensor([_code_prompt(tokenizer, 1024)])
    scaled_dir = write_rope_scaled(CHECKPOINTS / "target", tmp_path / "target",
                                   yarn_parameters())
    losses = {}
    for name, path in (("default", CHECKPOINTS / "target"), ("yarn", scaled_dir)):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, :-1]
        loss = torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="none")
        losses[name] = (loss[:512].mean().item(), loss[640:].mean().item())
    (short_default, long_default), (short_yarn, long_yarn) = losses["default"], losses["yarn"]
    assert long_default > short_default + 1.0, losses  # the failure YaRN is for
    assert long_yarn < long_default - 1.0, losses
    assert short_yarn < short_default + 0.3, losses


def test_ddtree_on_the_yarn_target_equals_ar_past_the_window(tmp_path):
    """Reference engine, fp32, a 900-token prompt: DDTree and the chain give AR's
    tokens with the YaRN target and the unchanged drafter."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_ddtree.reference import generate
    from vllm_ddtree.training.common import load_drafter

    tokenizer = AutoTokenizer.from_pretrained(CHECKPOINTS / "target")
    prompt = _code_prompt(tokenizer, 900)
    scaled_dir = write_rope_scaled(CHECKPOINTS / "target", tmp_path / "target",
                                   yarn_parameters())
    target = AutoModelForCausalLM.from_pretrained(scaled_dir, dtype=torch.float32).eval()
    drafter = load_drafter(CHECKPOINTS / "drafter", device="cpu")
    ar = generate(target, None, prompt, 24, "ar")
    tree = generate(target, drafter, prompt, 24, "ddtree", budget=16)
    chain = generate(target, drafter, prompt, 24, "dflash")
    assert tree.tokens == ar.tokens
    assert chain.tokens == ar.tokens
    assert tree.rounds < len(ar.tokens)  # the drafter is still accepted


def test_rope_scaling_loss_report(tmp_path):
    """``evals/rope_scaling_loss.py`` on a short slice: one row per variant, buckets of
    the asked size, the default row equal to the checkpoint's own loss."""
    mod = load_evals_script("rope_scaling_loss")
    assert mod.main(["--factors", "2", "--length", "256", "--prompts", "1", "--bucket", "64",
                     "--out-dir", str(tmp_path), "--no-progress"]) == 0
    result = json.loads((tmp_path / "rope_scaling_loss.json").read_text())
    assert [r["variant"] for r in result["rows"]] == ["default", "yarn x2"]
    assert all(len(r["loss"]) == 4 for r in result["rows"])
    assert result["rows"][1]["max_positions"] == 1024
    assert (tmp_path / "rope_scaling_loss.png").stat().st_size > 0
    assert "| yarn x2 |" in (tmp_path / "rope_scaling_loss.md").read_text()
    with pytest.raises(SystemExit):
        mod.parse_args(["--length", "100", "--bucket", "64"])
