"""Batched DFlash training forward: many anchor blocks per sequence in one pass.

For a sequence ``tokens [S]`` with target aux hidden states ``aux [S, A]`` and an
anchor position ``a``, the reference drafter (``DFlashDraftModel.block_logits``)
runs the block ``[tokens[a], MASK x (block_size-1)]`` at positions
``a .. a+block_size-1`` over a context cache holding the aux states of positions
``< a``. Here ``N`` anchors of each of ``B`` sequences are computed together:

- context K/V of every layer are projected once for all ``S`` positions
  (``hidden_norm(fc(aux))`` -> k/v projection, k-norm, RoPE at the position);
- the ``N * block_size`` block queries attend to ``[S context keys, N * block_size
  block keys]`` under a dense boolean mask: context key ``k`` is visible to a
  query of the block anchored at ``a`` iff ``k < a`` and the layer's rule
  (``DFlashAttention.visible``: causal + window for sliding layers, everything
  for full layers) allows it; block keys are visible only inside their own block,
  again under the layer's rule.

This is the same computation as the reference, block by block (the reference's
sliding-window truncation of the context cache never removes a key that the
window rule would let a block query see). ``tests/test_training.py`` checks the
equality in fp32.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from vllm_ddtree.reference.drafter import DFlashAttention, DFlashDraftModel


class AuxHiddenCapture:
    """Forward hooks that collect the outputs of target decoder layers ``layer_ids``.

    Use as a context manager around a target forward; ``aux()`` returns the
    outputs (0-based layer index, before the final norm) concatenated in
    ascending layer order along the last dim, as ``TargetRunner`` and vLLM do.
    """

    def __init__(self, target, layer_ids):
        self.target = target
        self.layer_ids = sorted(int(i) for i in layer_ids)
        self._out: dict[int, torch.Tensor] = {}
        self._hooks = []

    def __enter__(self) -> AuxHiddenCapture:
        layers = self.target.model.layers
        for i in self.layer_ids:
            self._hooks.append(layers[i].register_forward_hook(self._hook(i)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _hook(self, idx: int):
        def hook(module, args, output):
            self._out[idx] = output[0] if isinstance(output, tuple) else output

        return hook

    def aux(self) -> torch.Tensor:
        return torch.cat([self._out[i] for i in self.layer_ids], dim=-1)


@torch.no_grad()
def target_aux_hidden(target, input_ids: torch.Tensor, layer_ids) -> torch.Tensor:
    """Aux hidden states ``[B, S, len(layer_ids) * hidden]`` (target dtype) of a
    causal forward over ``input_ids [B, S]`` (positions ``0..S-1``).

    Runs only the target's decoder stack (no LM head)."""
    with AuxHiddenCapture(target, layer_ids) as cap:
        target.model(input_ids=input_ids, use_cache=False)
        return cap.aux()


def block_positions(anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """Positions ``[B, N * block_size]`` of the blocks anchored at ``anchors [B, N]``."""
    offs = torch.arange(block_size, device=anchors.device)
    return (anchors[:, :, None] + offs).flatten(1)


def attention_mask(
    attn: DFlashAttention, anchors: torch.Tensor, block_size: int, ctx_len: int
) -> torch.Tensor:
    """Bool ``[B, Q, ctx_len + Q]`` (``Q = N * block_size``): which keys each block
    query may attend, under ``attn``'s causality and window.

    Keys ``0..ctx_len-1`` are the context positions ``0..ctx_len-1``; then the
    block keys in query order."""
    bsz, n = anchors.shape
    device = anchors.device
    q_pos = block_positions(anchors, block_size)  # [B, Q]
    ctx_pos = torch.arange(ctx_len, device=device)
    ctx = attn.visible(q_pos.flatten(), ctx_pos).view(bsz, n * block_size, ctx_len)
    q_anchor = anchors.repeat_interleave(block_size, dim=1)  # [B, Q]
    ctx &= ctx_pos[None, None, :] < q_anchor[:, :, None]
    # Inside a block the offsets, not the anchor, decide visibility.
    offs = torch.arange(block_size, device=device)
    pattern = attn.visible(offs, offs)  # [bs, bs]
    same = torch.eye(n, dtype=torch.bool, device=device)
    blk = (same[:, None, :, None] & pattern[None, :, None, :]).reshape(
        n * block_size, n * block_size
    )
    return torch.cat([ctx, blk[None].expand(bsz, -1, -1)], dim=-1)


def _layer_attention(
    attn: DFlashAttention,
    x: torch.Tensor,
    q_pos: torch.Tensor,
    ctx_hidden: torch.Tensor,
    mask: torch.Tensor,
    rotary,
) -> torch.Tensor:
    bsz, q_len, hidden = x.shape
    ctx_len = ctx_hidden.shape[1]
    hq, hkv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    q = attn.q_norm(attn.q_proj(x).view(bsz * q_len, hq, d))
    q = rotary(q, q_pos.flatten()).view(bsz, q_len, hq, d)
    k_blk, v_blk = attn.project_kv(x.reshape(bsz * q_len, hidden), q_pos.flatten(), rotary)
    ctx_pos = torch.arange(ctx_len, device=x.device).repeat(bsz)
    k_ctx, v_ctx = attn.project_kv(ctx_hidden.reshape(bsz * ctx_len, hidden), ctx_pos, rotary)
    k = torch.cat([k_ctx.view(bsz, ctx_len, hkv, d), k_blk.view(bsz, q_len, hkv, d)], dim=1)
    v = torch.cat([v_ctx.view(bsz, ctx_len, hkv, d), v_blk.view(bsz, q_len, hkv, d)], dim=1)
    groups = hq // hkv
    k = k.repeat_interleave(groups, dim=2)
    v = v.repeat_interleave(groups, dim=2)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask[:, None]
    )
    return attn.o_proj(out.transpose(1, 2).reshape(bsz, q_len, hq * d))


def drafter_block_hidden(
    drafter: DFlashDraftModel,
    block_embeds: torch.Tensor,
    anchors: torch.Tensor,
    target_hidden: torch.Tensor,
) -> torch.Tensor:
    """Final-normed drafter hidden states ``[B, N, block_size, H]``.

    ``block_embeds [B, N, block_size, H]``: embeddings of ``[anchor token, MASK...]``;
    ``anchors [B, N]`` (int64, ``0 <= a``, ``a + block_size`` may exceed ``S``);
    ``target_hidden [B, S, A]``: aux hidden states of the sequence. Context of the
    block at ``a`` = positions ``< a``.
    """
    bsz, n, bs, hidden = block_embeds.shape
    ctx_len = target_hidden.shape[1]
    q_pos = block_positions(anchors, bs)
    ctx_hidden = drafter.hidden_norm(drafter.fc(target_hidden))
    masks: dict[tuple, torch.Tensor] = {}
    h = block_embeds.reshape(bsz, n * bs, hidden)
    offsets = torch.arange(n * bs, device=h.device) % bs  # DFlash2: row index in its block
    for layer in drafter.layers:
        attn = layer.self_attn
        key = (attn.sliding_window, attn.causal)
        if key not in masks:
            masks[key] = attention_mask(attn, anchors, bs, ctx_len)

        def attention(x, attn=attn, mask=masks[key]):
            return _layer_attention(attn, x, q_pos, ctx_hidden, mask, drafter.rotary)

        if hasattr(layer, "attention_conv"):  # DFlash2: sublayers inside convolutions
            h = h + layer.attention_conv.around(attention, layer.input_layernorm(h), offsets)
            h = h + layer.mlp_conv.around(layer.mlp, layer.post_attention_layernorm(h),
                                          offsets)
            continue
        h = h + attention(layer.input_layernorm(h))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return drafter.norm(h).view(bsz, n, bs, hidden)


def block_input_ids(
    tokens: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int
) -> torch.Tensor:
    """``[B, N, block_size]`` ids ``[tokens[b, a], MASK, ..., MASK]``."""
    ids = torch.full(
        (*anchors.shape, block_size), mask_token_id, dtype=torch.long, device=tokens.device
    )
    ids[..., 0] = torch.gather(tokens, 1, anchors)
    return ids


def block_labels(tokens: torch.Tensor, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """``[B, N, block_size - 1]``: ``tokens[b, a + j]`` for depths ``j = 1..block_size-1``.

    Needs ``a + block_size - 1 < S`` for every anchor."""
    offs = torch.arange(1, block_size, device=tokens.device)
    idx = (anchors[:, :, None] + offs).flatten(1)
    return torch.gather(tokens, 1, idx).view(*anchors.shape, block_size - 1)


def drafter_block_outputs(
    drafter: DFlashDraftModel,
    tokens: torch.Tensor,
    target_hidden: torch.Tensor,
    anchors: torch.Tensor,
    embed: Callable[[torch.Tensor], torch.Tensor],
    lm_head: Callable[[torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """(final-normed drafter states ``[B, N, block_size - 1, H]``, draft logits
    ``[B, N, block_size - 1, V]`` (LM head dtype)) for depths ``1..block_size-1`` of the
    blocks anchored at ``anchors [B, N]``.

    ``tokens [B, S]`` int64, ``target_hidden [B, S, A]``; ``embed``/``lm_head`` are
    the target's. Block ``(b, n)``'s logits equal the reference
    ``drafter.block_logits(tokens[b, a], a, ctx, embed, lm_head)`` with ``ctx`` filled
    from ``target_hidden[b, :a]``. A DFlash2 drafter scales the embeddings by its
    ``input_embedding_scale`` and its logits by ``output_logits`` (fp32 then)."""
    bs = drafter.block_size
    ids = block_input_ids(tokens, anchors, bs, drafter.mask_token_id)
    embeds = embed(ids).to(drafter.fc.weight.dtype)  # fp32 residual stream under autocast
    embeds = embeds * getattr(drafter, "input_embedding_scale", 1.0)
    hidden = drafter_block_hidden(drafter, embeds, anchors, target_hidden)[:, :, 1:]
    logits = lm_head(hidden)
    if hasattr(drafter, "output_logits"):
        logits = drafter.output_logits(logits)
    return hidden, logits
