"""DFlash2 reference drafter: a checkpoint written in the published layout loads, and its
forward (marginals, candidates, selector scores) equals a second, loop-by-loop fp32
implementation written from the published description."""

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from vllm_ddtree.drafter_config import DrafterConfigError, read_drafter_config_json
from vllm_ddtree.reference.dflash2 import DFlash2DraftModel

V, H, HEADS, KV_HEADS, HEAD_DIM, FFN = 96, 64, 4, 2, 16, 112
TAPS, GROUP, RANK, TOP_K, BLOCK, WINDOW = 3, 16, 8, 5, 6, 7
LAYER_TYPES = ["sliding_attention", "full_attention"]
TARGET_LAYERS = [0, 2]
DRAFT = {"block_size": BLOCK, "mask_token_id": V - 1, "target_layer_ids": TARGET_LAYERS,
         "conv_kernel_size": TAPS, "conv_group_size": GROUP, "selector_rank": RANK,
         "selector_top_k": TOP_K, "input_embedding_scale": 1.25, "output_multiplier": 0.8,
         "final_logit_softcapping": 6.0}


def published_config(**draft_changes) -> dict:
    return {"architectures": ["DFlash2DraftModel"], "model_type": "qwen3", "is_causal": False,
            "hidden_size": H, "intermediate_size": FFN, "num_hidden_layers": len(LAYER_TYPES),
            "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
            "head_dim": HEAD_DIM, "vocab_size": V, "rms_norm_eps": 1e-6, "hidden_act": "silu",
            "layer_types": LAYER_TYPES, "use_sliding_window": True, "sliding_window": WINDOW,
            "max_position_embeddings": 4096, "num_target_layers": 3,
            "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
            "tie_word_embeddings": False, "dflash_config": {**DRAFT, **draft_changes}}


def published_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    """Random tensors under the published names and shapes."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=0.2):
        return torch.randn(*shape, generator=g) * scale

    groups = H // GROUP
    w = {"fc.weight": rand(H, H * len(TARGET_LAYERS), scale=0.1),
         "hidden_norm.weight": 1 + rand(H, scale=0.1), "norm.weight": 1 + rand(H, scale=0.1),
         "candidate_selector.hidden_projection.weight": rand(RANK, H),
         "candidate_selector.predecessor_codebook": rand(V, RANK, scale=0.6),
         "candidate_selector.successor_codebook": rand(V, RANK, scale=0.6)}
    for i in range(len(LAYER_TYPES)):
        p = f"layers.{i}."
        w.update({p + "self_attn.q_proj.weight": rand(HEADS * HEAD_DIM, H),
                  p + "self_attn.k_proj.weight": rand(KV_HEADS * HEAD_DIM, H),
                  p + "self_attn.v_proj.weight": rand(KV_HEADS * HEAD_DIM, H),
                  p + "self_attn.o_proj.weight": rand(H, HEADS * HEAD_DIM),
                  p + "self_attn.q_norm.weight": 1 + rand(HEAD_DIM, scale=0.1),
                  p + "self_attn.k_norm.weight": 1 + rand(HEAD_DIM, scale=0.1),
                  p + "mlp.gate_proj.weight": rand(FFN, H), p + "mlp.up_proj.weight": rand(FFN, H),
                  p + "mlp.down_proj.weight": rand(H, FFN),
                  p + "input_layernorm.weight": 1 + rand(H, scale=0.1),
                  p + "post_attention_layernorm.weight": 1 + rand(H, scale=0.1)})
        for conv in ("attention_conv", "mlp_conv"):
            base = rand(2, TAPS, H, scale=0.3)
            base[:, 0] += 1.0
            w[p + conv + ".base_kernel"] = base
            w[p + conv + ".kernel_projection.weight"] = rand(2 * TAPS * groups, H, scale=0.1)
    return w


def write_checkpoint(directory, weights, config) -> None:
    save_file({k: v.contiguous() for k, v in weights.items()}, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(config))


# ---- the loop-by-loop implementation, from the published description -------------

def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """RMS norm of one vector ``x``."""
    assert x.dim() == 1
    return x / torch.sqrt((x * x).mean() + 1e-6) * w


def rope(x: torch.Tensor, pos: int) -> torch.Tensor:
    """Neox rotation of one head vector ``x [HEAD_DIM]`` at ``pos``."""
    half = HEAD_DIM // 2
    out = torch.empty_like(x)
    for j in range(half):
        angle = pos / 10000.0 ** (2 * j / HEAD_DIM)
        c, s = math.cos(angle), math.sin(angle)
        out[j] = x[j] * c - x[j + half] * s
        out[j + half] = x[j + half] * c + x[j] * s
    return out


def conv(x: torch.Tensor, w: dict, name: str, coef: torch.Tensor, side: int) -> torch.Tensor:
    """Grouped dynamic depthwise convolution of one block ``x [S, H]``; ``coef [S, 2*T*G]``
    read as [side, tap, group]."""
    groups = H // GROUP
    out = torch.zeros_like(x)
    for i in range(x.shape[0]):
        for t in range(TAPS):
            if i - t < 0:
                continue
            for c in range(H):
                g = c // GROUP
                k = w[name + ".base_kernel"][side, t, c] + coef[i, (side * TAPS + t) * groups + g]
                out[i, c] += k * x[i - t, c]
    return out


def attention(w, p, x, positions, ctx, ctx_pos, layer) -> torch.Tensor:
    """One layer's attention of the block rows over context + block keys."""
    sliding = LAYER_TYPES[layer] == "sliding_attention"
    keys_h = torch.cat([ctx, x])
    key_pos = ctx_pos + positions
    out = torch.zeros(x.shape[0], HEADS * HEAD_DIM)
    for h in range(HEADS):
        kv = h // (HEADS // KV_HEADS)
        rows = slice(kv * HEAD_DIM, (kv + 1) * HEAD_DIM)
        keys, values = [], []
        for j in range(keys_h.shape[0]):
            k = keys_h[j] @ w[p + "self_attn.k_proj.weight"][rows].T
            keys.append(rope(rms(k, w[p + "self_attn.k_norm.weight"]), key_pos[j]))
            values.append(keys_h[j] @ w[p + "self_attn.v_proj.weight"][rows].T)
        for i in range(x.shape[0]):
            q = x[i] @ w[p + "self_attn.q_proj.weight"][h * HEAD_DIM:(h + 1) * HEAD_DIM].T
            q = rope(rms(q, w[p + "self_attn.q_norm.weight"]), positions[i])
            logits = []
            for j in range(len(keys)):
                diff = positions[i] - key_pos[j]
                seen = (0 <= diff < WINDOW) if sliding else True
                logits.append(float(q @ keys[j]) / math.sqrt(HEAD_DIM) if seen else -math.inf)
            probs = torch.softmax(torch.tensor(logits), 0)
            out[i, h * HEAD_DIM:(h + 1) * HEAD_DIM] = sum(
                probs[j] * values[j] for j in range(len(keys)))
    return out @ w[p + "self_attn.o_proj.weight"].T


def simple_block(w, embed, lm_head, aux, bonus, start):
    """(logits [S-1, V], candidate ids [S-1, K], unary, edge scores [S-1, K, K])."""
    ctx = torch.stack([rms(r, w["hidden_norm.weight"]) for r in aux @ w["fc.weight"].T])
    ctx_pos = list(range(aux.shape[0]))
    ids = [bonus] + [V - 1] * (BLOCK - 1)
    positions = list(range(start, start + BLOCK))
    x = torch.stack([embed[t] * DRAFT["input_embedding_scale"] for t in ids])
    for layer in range(len(LAYER_TYPES)):
        p = f"layers.{layer}."
        a = torch.stack([rms(r, w[p + "input_layernorm.weight"]) for r in x])
        coef = a @ w[p + "attention_conv.kernel_projection.weight"].T
        a = conv(a, w, p + "attention_conv", coef, 0)
        a = attention(w, p, a, positions, ctx, ctx_pos, layer)
        x = x + conv(a, w, p + "attention_conv", coef, 1)
        m = torch.stack([rms(r, w[p + "post_attention_layernorm.weight"]) for r in x])
        coef = m @ w[p + "mlp_conv.kernel_projection.weight"].T
        m = conv(m, w, p + "mlp_conv", coef, 0)
        gate, up = m @ w[p + "mlp.gate_proj.weight"].T, m @ w[p + "mlp.up_proj.weight"].T
        m = (gate * torch.sigmoid(gate) * up) @ w[p + "mlp.down_proj.weight"].T
        x = x + conv(m, w, p + "mlp_conv", coef, 1)
    hidden = torch.stack([rms(r, w["norm.weight"]) for r in x])[1:]
    cap = DRAFT["final_logit_softcapping"]
    logits = torch.tanh(hidden @ lm_head.T * DRAFT["output_multiplier"] / cap) * cap
    cand, unary, edges = [], [], []
    gate = hidden @ w["candidate_selector.hidden_projection.weight"].T
    for pos in range(BLOCK - 1):
        row = logits[pos].tolist()
        best = sorted(range(V), key=lambda t, row=row: (-row[t], t))[:TOP_K]
        preds = [bonus] * TOP_K if pos == 0 else cand[-1]
        table = torch.empty(TOP_K, TOP_K)
        for a_slot, prev in enumerate(preds):
            for c_slot, tok in enumerate(best):
                table[a_slot, c_slot] = row[tok] + sum(
                    w["candidate_selector.predecessor_codebook"][prev, r] * gate[pos, r]
                    * w["candidate_selector.successor_codebook"][tok, r] for r in range(RANK))
        cand.append(best)
        unary.append([row[t] for t in best])
        edges.append(table)
    return logits, torch.tensor(cand), torch.tensor(unary), torch.stack(edges)


def test_published_layout_loads_and_matches_the_loop_implementation(tmp_path):
    weights = published_weights()
    write_checkpoint(tmp_path, weights, published_config())
    read_drafter_config_json(tmp_path)
    drafter = DFlash2DraftModel.from_pretrained(tmp_path, dtype=torch.float32).eval()
    state = drafter.state_dict()
    assert set(state) == set(weights)  # no missing, no extra tensors
    for name, value in weights.items():
        assert torch.equal(state[name], value), name

    g = torch.Generator().manual_seed(7)
    embed, lm_head = torch.randn(V, H, generator=g), torch.randn(V, H, generator=g) * 0.3
    aux = torch.randn(9, H * len(TARGET_LAYERS), generator=g)
    bonus, start = 17, 9
    context = drafter.new_context_cache()
    context.append(aux, torch.arange(9))
    with torch.no_grad():
        block = drafter.draft_block(bonus, start, context, lambda t: embed[t],
                                    lambda h: h @ lm_head.T)
        want = simple_block(weights, embed, lm_head, aux, bonus, start)
    torch.testing.assert_close(block.logits, want[0], atol=2e-5, rtol=2e-5)
    assert torch.equal(block.candidate_ids, want[1])
    torch.testing.assert_close(block.unary, want[2], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(block.edge_scores, want[3], atol=2e-5, rtol=2e-5)
    # The edge term and the convolutions matter: without them the result moves.
    assert (block.edge_scores - block.unary[:, None, :]).abs().max() > 0.05
    assert block.edge_scores[0].std(0).max() == 0  # every predecessor row is the anchor's


def test_save_pretrained_keeps_the_published_layout(tmp_path):
    config = published_config()
    write_checkpoint(tmp_path, published_weights(1), config)
    drafter = DFlash2DraftModel.from_pretrained(tmp_path, dtype=torch.float32)
    out = tmp_path / "saved"
    drafter.save_pretrained(out)
    from safetensors.torch import load_file

    saved = load_file(out / "model.safetensors")
    assert set(saved) == set(published_weights(1))
    assert json.loads((out / "config.json").read_text())["dflash_config"]["selector_top_k"] == TOP_K


@pytest.mark.parametrize("field,value,match", [
    ("conv_kernel_size", 0, r"dflash_config\.conv_kernel_size=0"),
    ("conv_group_size", 24, r"dflash_config\.conv_group_size=24 .*divisor of hidden_size=64"),
    ("selector_rank", None, r"dflash_config\.selector_rank=None"),
    ("selector_top_k", V + 1, r"dflash_config\.selector_top_k=97"),
    ("output_multiplier", -1.0, r"dflash_config\.output_multiplier=-1\.0"),
    ("final_logit_softcapping", "big", r"dflash_config\.final_logit_softcapping='big'"),
])
def test_bad_dflash2_keys_are_refused_by_name(tmp_path, field, value, match):
    write_checkpoint(tmp_path, {}, published_config(**{field: value}))
    with pytest.raises(DrafterConfigError, match=match):
        read_drafter_config_json(tmp_path)
