"""DFlash2 reference drafter: a checkpoint written in the published layout loads, and its
forward (marginals, candidates, selector scores) equals a second, loop-by-loop fp32
implementation written from the published description."""

import json
import math
from dataclasses import dataclass

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

@dataclass(frozen=True)
class Dims:
    """What the loop implementation reads from a published config."""

    vocab: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    taps: int
    group: int
    rank: int
    top_k: int
    block: int
    window: int
    layer_types: tuple
    mask_token: int
    eps: float
    theta: float
    embed_scale: float
    multiplier: float
    cap: float

    @classmethod
    def of(cls, config: dict) -> "Dims":
        draft = config["dflash_config"]
        return cls(config["vocab_size"], config["hidden_size"], config["num_attention_heads"],
                   config["num_key_value_heads"], config["head_dim"],
                   draft["conv_kernel_size"], draft["conv_group_size"], draft["selector_rank"],
                   draft["selector_top_k"], config.get("block_size", draft.get("block_size")),
                   config["sliding_window"],
                   tuple(config["layer_types"]), draft["mask_token_id"], config["rms_norm_eps"],
                   config["rope_parameters"]["rope_theta"],
                   draft.get("input_embedding_scale") or 1.0,
                   draft.get("output_multiplier") or 1.0,
                   draft.get("final_logit_softcapping") or 0.0)


TINY = Dims.of(published_config())


def rms(x: torch.Tensor, w: torch.Tensor, d: Dims = TINY) -> torch.Tensor:
    """RMS norm of one vector ``x``."""
    assert x.dim() == 1
    return x / torch.sqrt((x * x).mean() + d.eps) * w


def rope(x: torch.Tensor, pos: int, d: Dims = TINY) -> torch.Tensor:
    """Neox rotation of one head vector ``x [head_dim]`` at ``pos``."""
    half = d.head_dim // 2
    out = torch.empty_like(x)
    for j in range(half):
        angle = pos / d.theta ** (2 * j / d.head_dim)
        c, s = math.cos(angle), math.sin(angle)
        out[j] = x[j] * c - x[j + half] * s
        out[j + half] = x[j + half] * c + x[j] * s
    return out


def conv(x: torch.Tensor, w: dict, name: str, coef: torch.Tensor, side: int,
         d: Dims = TINY) -> torch.Tensor:
    """Grouped dynamic depthwise convolution of one block ``x [S, H]``; ``coef [S, 2*T*G]``
    read as [side, tap, group]."""
    groups = d.hidden // d.group
    group_of_channel = torch.arange(d.hidden) // d.group
    out = torch.zeros_like(x)
    for i in range(x.shape[0]):
        for t in range(d.taps):
            if i - t < 0:
                continue
            # channel c uses its group's coefficient: k[c] = base[c] + coef[group(c)]
            k = (w[name + ".base_kernel"][side, t]
                 + coef[i, (side * d.taps + t) * groups + group_of_channel])
            out[i] += k * x[i - t]
    return out


def attention(w, p, x, positions, ctx, ctx_pos, layer, d: Dims = TINY) -> torch.Tensor:
    """One layer's attention of the block rows over context + block keys."""
    sliding = d.layer_types[layer] == "sliding_attention"
    keys_h = torch.cat([ctx, x])
    key_pos = ctx_pos + positions
    out = torch.zeros(x.shape[0], d.heads * d.head_dim)
    for h in range(d.heads):
        kv = h // (d.heads // d.kv_heads)
        rows = slice(kv * d.head_dim, (kv + 1) * d.head_dim)
        keys, values = [], []
        for j in range(keys_h.shape[0]):
            k = keys_h[j] @ w[p + "self_attn.k_proj.weight"][rows].T
            keys.append(rope(rms(k, w[p + "self_attn.k_norm.weight"], d), key_pos[j], d))
            values.append(keys_h[j] @ w[p + "self_attn.v_proj.weight"][rows].T)
        for i in range(x.shape[0]):
            q = x[i] @ w[p + "self_attn.q_proj.weight"][h * d.head_dim:(h + 1) * d.head_dim].T
            q = rope(rms(q, w[p + "self_attn.q_norm.weight"], d), positions[i], d)
            logits = []
            for j in range(len(keys)):
                diff = positions[i] - key_pos[j]
                seen = (0 <= diff < d.window) if sliding else True
                logits.append(float(q @ keys[j]) / math.sqrt(d.head_dim) if seen else -math.inf)
            probs = torch.softmax(torch.tensor(logits), 0)
            out[i, h * d.head_dim:(h + 1) * d.head_dim] = sum(
                probs[j] * values[j] for j in range(len(keys)))
    return out @ w[p + "self_attn.o_proj.weight"].T


def simple_block(w, embed, lm_head, aux, bonus, start, d: Dims = TINY):
    """(logits [S-1, V], candidate ids [S-1, K], unary, edge scores [S-1, K, K])."""
    ctx = torch.stack([rms(r, w["hidden_norm.weight"], d) for r in aux @ w["fc.weight"].T])
    ctx_pos = list(range(aux.shape[0]))
    ids = [bonus] + [d.mask_token] * (d.block - 1)
    positions = list(range(start, start + d.block))
    x = torch.stack([embed[t] * d.embed_scale for t in ids])
    for layer in range(len(d.layer_types)):
        p = f"layers.{layer}."
        a = torch.stack([rms(r, w[p + "input_layernorm.weight"], d) for r in x])
        coef = a @ w[p + "attention_conv.kernel_projection.weight"].T
        a = conv(a, w, p + "attention_conv", coef, 0, d)
        a = attention(w, p, a, positions, ctx, ctx_pos, layer, d)
        x = x + conv(a, w, p + "attention_conv", coef, 1, d)
        m = torch.stack([rms(r, w[p + "post_attention_layernorm.weight"], d) for r in x])
        coef = m @ w[p + "mlp_conv.kernel_projection.weight"].T
        m = conv(m, w, p + "mlp_conv", coef, 0, d)
        gate, up = m @ w[p + "mlp.gate_proj.weight"].T, m @ w[p + "mlp.up_proj.weight"].T
        m = (gate * torch.sigmoid(gate) * up) @ w[p + "mlp.down_proj.weight"].T
        x = x + conv(m, w, p + "mlp_conv", coef, 1, d)
    hidden = torch.stack([rms(r, w["norm.weight"], d) for r in x])[1:]
    logits = hidden @ lm_head.T * d.multiplier
    if d.cap:
        logits = torch.tanh(logits / d.cap) * d.cap
    cand, unary, edges = [], [], []
    gate = hidden @ w["candidate_selector.hidden_projection.weight"].T
    for pos in range(d.block - 1):
        row = logits[pos].tolist()
        best = sorted(range(d.vocab), key=lambda t, row=row: (-row[t], t))[:d.top_k]
        preds = [bonus] * d.top_k if pos == 0 else cand[-1]
        table = torch.empty(d.top_k, d.top_k)
        pred_codes = w["candidate_selector.predecessor_codebook"]
        succ_codes = w["candidate_selector.successor_codebook"]
        for a_slot, prev in enumerate(preds):
            for c_slot, tok in enumerate(best):
                table[a_slot, c_slot] = row[tok] + sum(
                    pred_codes[prev, r] * gate[pos, r] * succ_codes[tok, r]
                    for r in range(d.rank))
        cand.append(best)
        unary.append([row[t] for t in best])
        edges.append(table)
    return logits, torch.tensor(cand), torch.tensor(unary), torch.stack(edges)

def assert_block_matches(drafter, weights, embed, lm_head, aux, bonus: int, tol: float,
                         d: Dims = TINY):
    """``drafter.draft_block`` after ``bonus`` with ``aux`` as the context rows
    0..n-1 (the block at position n) equals :func:`simple_block` within ``tol``, the
    candidate ids exactly; returns the block."""
    start = aux.shape[0]
    context = drafter.new_context_cache()
    context.append(aux, torch.arange(start))
    with torch.no_grad():
        block = drafter.draft_block(bonus, start, context, lambda t: embed[t],
                                    lambda h: h @ lm_head.T)
        want = simple_block(weights, embed, lm_head, aux, bonus, start, d)
    torch.testing.assert_close(block.logits, want[0], atol=tol, rtol=tol)
    assert torch.equal(block.candidate_ids, want[1])
    torch.testing.assert_close(block.unary, want[2], atol=tol, rtol=tol)
    torch.testing.assert_close(block.edge_scores, want[3], atol=tol, rtol=tol)
    return block



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
    block = assert_block_matches(drafter, weights, embed, lm_head, aux, 17, 2e-5)
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


def test_the_shipped_trained_checkpoint_matches_the_loop_implementation():
    """The DFlash2 drafter trained for the embedded target (``checkpoints/dflash2_drafter``,
    selector and convolutions trained) in fp32: the reference's block (logits, top-K
    candidates, unary and edge scores) equals the loop implementation on the same
    weights, with the target's own embedding and head."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from vllm_ddtree.demo.reference_engine import CHECKPOINTS

    directory = CHECKPOINTS / "dflash2_drafter"
    config = json.loads((directory / "config.json").read_text())
    d = Dims.of(config)
    weights = {k: v.float() for k, v in load_file(directory / "model.safetensors").items()}
    drafter = DFlash2DraftModel.from_pretrained(directory, dtype=torch.float32).eval()
    target = AutoModelForCausalLM.from_pretrained(CHECKPOINTS / "target", dtype=torch.float32)
    embed = target.get_input_embeddings().weight.detach()
    lm_head = target.get_output_embeddings().weight.detach()
    # The selector learned an edge term: trained, not the identity start.
    assert weights["candidate_selector.successor_codebook"].abs().max() > 0
    width = config["hidden_size"] * len(config["dflash_config"]["target_layer_ids"])
    aux = torch.randn(9, width, generator=torch.Generator().manual_seed(3))
    block = assert_block_matches(drafter, weights, embed, lm_head, aux, 417, 1e-4, d)
    assert (block.edge_scores - block.unary[:, None, :]).abs().max() > 1e-3
