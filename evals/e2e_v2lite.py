# SPDX-License-Identifier: Apache-2.0
"""Config files of the ``v2lite`` setups of ``evals/bench_e2e.py`` (no GPU, no vLLM).

Target: DeepSeek-V2-Lite's shapes (deepseek-ai/DeepSeek-V2-Lite config.json): 27 layers,
hidden 2048, 16 heads, no q LoRA, kv_lora_rank 512, qk_rope 64, qk_nope 128, v_head 128,
vocab 102400, MoE of 64 routed experts (intermediate 1408) + 2 shared, 6 routed active
per token, first layer dense (intermediate 10944). Dummy weights, one GPU.

- ``v2lite_moe``: that MoE target. vLLM runs its MoE layers with its fused-MoE C++ ops,
  which the offline GPU kit leaves out: ``scripts/kit_moe_ops.sh`` packs them as extra
  kit parts that ``scripts/gpu_suites.sh install`` installs (stage ``sweep_v2lite_moe``).
- ``v2lite`` (runs on the kit alone): every layer a dense MLP of intermediate
  ``(6 + 2) x 1408 = 11264``: the weights a token multiplies per layer are those of its
  6 routed + 2 shared experts (69.2 M), so the active parameters per token match
  (:func:`active_params_per_token`: 2.451 B MoE, 2.450 B dense, LM head included; layer
  0 at 11264 instead of 10944, no routers). Not modelled: the MoE's 15.7 B total
  weights, its routing, and that a batch of tokens reads more distinct experts' weights
  than one token does (the dense MLP reads one set of weights for the whole batch).

Drafter: a DFlash drafter shaped like z-lab's Qwen3-4B-DFlash-b16 (3 Qwen3 layers,
full attention, 16 heads / 8 KV heads of 128, block 16), scaled to hidden 2048
(intermediate 7680, the published 3.8 x hidden), tapping 5 target layers, sharing the
target's embeddings and LM head. Its logits are replaced by the rank oracle
(``evals/e2e_oracle.py``).
"""

from __future__ import annotations

V2LITE_VOCAB = 102400
V2LITE_HIDDEN = 2048
V2LITE_LAYERS = 27
V2LITE_HEADS = 16
V2LITE_DENSE_INTERMEDIATE = 10944  # layer 0 of the MoE target
V2LITE_MOE_INTERMEDIATE = 1408
V2LITE_ROUTED, V2LITE_SHARED, V2LITE_ACTIVE = 64, 2, 6
V2LITE_ACTIVE_INTERMEDIATE = (V2LITE_ACTIVE + V2LITE_SHARED) * V2LITE_MOE_INTERMEDIATE  # 11264
V2LITE_BOS, V2LITE_EOS = 100000, 100001
V2LITE_FIRST_SPECIAL = 100000  # random prompt ids stay below
V2LITE_MAX_POSITIONS = 32768 + 4096
V2LITE_ROPE_THETA = 10000.0
V2LITE_DRAFTER_LAYERS = 3
V2LITE_DRAFTER_HEADS, V2LITE_DRAFTER_KV_HEADS, V2LITE_DRAFTER_HEAD_DIM = 16, 8, 128
V2LITE_DRAFTER_INTERMEDIATE = 7680
V2LITE_DRAFTER_BLOCK = 16
V2LITE_TARGET_LAYER_IDS = [1, 7, 13, 19, 25]
V2LITE_MASK_TOKEN = V2LITE_VOCAB - 1


def v2lite_target_config(moe: bool, max_positions: int = V2LITE_MAX_POSITIONS):
    """``DeepseekV2Config`` with DeepSeek-V2-Lite's shapes; ``moe=False``: every layer a
    dense MLP of the active intermediate size (module docstring)."""
    from transformers import DeepseekV2Config

    config = DeepseekV2Config(
        architectures=["DeepseekV2ForCausalLM"],
        dtype="bfloat16",
        vocab_size=V2LITE_VOCAB,
        hidden_size=V2LITE_HIDDEN,
        intermediate_size=V2LITE_DENSE_INTERMEDIATE if moe else V2LITE_ACTIVE_INTERMEDIATE,
        moe_intermediate_size=V2LITE_MOE_INTERMEDIATE,
        num_hidden_layers=V2LITE_LAYERS,
        num_attention_heads=V2LITE_HEADS,
        num_key_value_heads=V2LITE_HEADS,
        n_shared_experts=V2LITE_SHARED,
        n_routed_experts=V2LITE_ROUTED,
        num_experts_per_tok=V2LITE_ACTIVE,
        routed_scaling_factor=1.0,
        topk_method="greedy",
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1 if moe else V2LITE_LAYERS,
        moe_layer_freq=1,
        norm_topk_prob=False,
        scoring_func="softmax",
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_rope_head_dim=64,
        v_head_dim=128,
        qk_nope_head_dim=128,
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-6,
        bos_token_id=V2LITE_BOS,
        eos_token_id=V2LITE_EOS,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": V2LITE_ROPE_THETA},
    )
    return config


def v2lite_drafter_config(max_positions: int = V2LITE_MAX_POSITIONS):
    """``Qwen3Config`` of the DFlash drafter (module docstring)."""
    from e2e_models import dflash_drafter_config

    return dflash_drafter_config(
        vocab=V2LITE_VOCAB, hidden=V2LITE_HIDDEN, intermediate=V2LITE_DRAFTER_INTERMEDIATE,
        layers=V2LITE_DRAFTER_LAYERS, heads=V2LITE_DRAFTER_HEADS,
        kv_heads=V2LITE_DRAFTER_KV_HEADS, head_dim=V2LITE_DRAFTER_HEAD_DIM,
        max_positions=max_positions, rope_theta=V2LITE_ROPE_THETA,
        block_size=V2LITE_DRAFTER_BLOCK, target_layer_ids=V2LITE_TARGET_LAYER_IDS,
        mask_token=V2LITE_MASK_TOKEN, bos=V2LITE_BOS, eos=V2LITE_EOS, tie_embeddings=True,
        num_target_layers=V2LITE_LAYERS)


def active_params_per_token(config: dict) -> int:
    """Weights one decode token multiplies in a ``DeepseekV2Config`` dict (attention
    without q LoRA, dense or MoE MLP with the routed + shared experts it uses, the
    routers, embedding row excluded, LM head included)."""
    h, heads = config["hidden_size"], config["num_attention_heads"]
    qk = config["qk_nope_head_dim"] + config["qk_rope_head_dim"]
    attn = (h * heads * qk + h * (config["kv_lora_rank"] + config["qk_rope_head_dim"])
            + config["kv_lora_rank"] * heads * (config["qk_nope_head_dim"]
                                                + config["v_head_dim"])
            + heads * config["v_head_dim"] * h)
    total = 0
    for layer in range(config["num_hidden_layers"]):
        if layer < config["first_k_dense_replace"]:
            mlp = 3 * h * config["intermediate_size"]
        else:
            experts = config["num_experts_per_tok"] + config["n_shared_experts"]
            mlp = 3 * h * config["moe_intermediate_size"] * experts + h * config[
                "n_routed_experts"]
        total += attn + mlp
    return total + h * config["vocab_size"]
