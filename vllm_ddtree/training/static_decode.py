"""Batched greedy decoding of the MLA training target with a static KV cache and one
CUDA graph per decoding step: the drafter's greedy pool without a serving engine.

The pool is many sequences that share one prefix length per batch, decoded for a fixed
number of steps: no scheduling, no paging, no stops. transformers' decoding ran about
45 ms per step at batch 256 (about 1,200 eager ops per step) and vLLM about 60 ms at
1,024 running requests (its per-request host work), both on an H200 for a 4-layer
model whose step is well under a millisecond of GPU work. Here a step is the same
modules' arithmetic on fixed buffers (keys and values expanded once per position,
attention over the whole buffer with a mask that ends at the current position), so on
CUDA it is captured once and replayed for every step of every batch.

The arithmetic is the target's own (``DeepseekV3ForCausalLM`` of transformers 5.17: its
norms, projections, rotary embedding and MLP modules are called; the attention is
``scaled_dot_product_attention`` over the expanded keys and values, as transformers'
SDPA path computes it); tests compare the tokens with transformers' greedy decoding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_ddtree.training.train_drafter import greedy_continue

__all__ = ["StaticGreedyDecoder"]


class StaticGreedyDecoder:
    """Greedy continuations of ``batch`` equal-length prefixes at a time.

    Args:
        target: a dense ``DeepseekV3ForCausalLM`` (MLA, ``q_lora_rank`` None or set),
            in eval mode, on its device.
        batch: rows per call (fewer are padded by repeating the first row).
        max_len: the longest prefix + continuation.
        use_graph: replay the decoding step as a CUDA graph (CUDA only; default: on CUDA).
        prefill_rows: prefix rows per prefill forward (bounds its attention memory).
    """

    def __init__(self, target, batch: int, max_len: int, use_graph: bool | None = None,
                 prefill_rows: int = 32) -> None:
        cfg = target.config
        if getattr(cfg, "first_k_dense_replace", 0) < cfg.num_hidden_layers:
            raise NotImplementedError("StaticGreedyDecoder supports dense targets only")
        self.target = target
        self.batch, self.max_len = batch, max_len
        self.prefill_rows = prefill_rows
        param = next(target.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.use_graph = self.device.type == "cuda" if use_graph is None else use_graph
        heads = cfg.num_attention_heads
        self.qk_nope, self.qk_rope = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        self.v_dim, self.kv_rank = cfg.v_head_dim, cfg.kv_lora_rank
        kw = dict(device=self.device, dtype=self.dtype)
        layers = cfg.num_hidden_layers
        self.keys = [torch.zeros(batch, heads, max_len, self.qk_nope + self.qk_rope, **kw)
                     for _ in range(layers)]
        self.values = [torch.zeros(batch, heads, max_len, self.v_dim, **kw)
                       for _ in range(layers)]
        # Decoding-step state: the token to feed, its position, the step's output column.
        self.step_ids = torch.zeros(batch, 1, dtype=torch.long, device=self.device)
        self.step_pos = torch.zeros(1, dtype=torch.long, device=self.device)
        self.step_col = torch.zeros(1, dtype=torch.long, device=self.device)
        self.out = torch.zeros(batch, max_len, dtype=torch.long, device=self.device)
        self._graph: torch.cuda.CUDAGraph | None = None

    # -- the target's arithmetic on fixed buffers ---------------------------------------

    def _attention(self, layer, hidden: torch.Tensor, rows: slice, positions: torch.Tensor,
                   cos: torch.Tensor, sin: torch.Tensor, num_keys: int) -> torch.Tensor:
        """One MLA layer's attention for ``hidden [b, S, D]`` at ``positions [S]``: writes
        the rows' expanded keys / values at those positions, attends over the first
        ``num_keys`` slots with a mask that stops at each query's position."""
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
            apply_rotary_pos_emb,
            apply_rotary_pos_emb_interleave,
        )

        attn = layer.self_attn
        b, s, _ = hidden.shape
        if attn.q_lora_rank is None:
            q = attn.q_proj(hidden)
        else:
            q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(hidden)))
        q = q.view(b, s, -1, self.qk_nope + self.qk_rope).transpose(1, 2)
        q_pass, q_rot = torch.split(q, [self.qk_nope, self.qk_rope], dim=-1)
        latent, k_rot = torch.split(attn.kv_a_proj_with_mqa(hidden),
                                    [self.kv_rank, self.qk_rope], dim=-1)
        latent = attn.kv_a_layernorm(latent)
        k_rot = k_rot.view(b, 1, s, self.qk_rope)
        rotate = (apply_rotary_pos_emb_interleave if attn.config.rope_interleave
                  else apply_rotary_pos_emb)
        q_rot, k_rot = rotate(q_rot, k_rot, cos, sin)
        kv = attn.kv_b_proj(latent).view(b, s, -1, self.qk_nope + self.v_dim).transpose(1, 2)
        k_nope, value = torch.split(kv, [self.qk_nope, self.v_dim], dim=-1)
        key = torch.cat([k_nope, k_rot.expand(-1, k_nope.shape[1], -1, -1)], dim=-1)
        idx = attn.layer_idx
        self.keys[idx][rows].index_copy_(2, positions, key)
        self.values[idx][rows].index_copy_(2, positions, value)
        slots = torch.arange(num_keys, device=hidden.device)
        mask = slots[None, :] <= positions[:, None]  # [S, num_keys]
        out = F.scaled_dot_product_attention(
            torch.cat([q_pass, q_rot], dim=-1), self.keys[idx][rows, :, :num_keys],
            self.values[idx][rows, :, :num_keys], attn_mask=mask, scale=attn.scaling)
        return attn.o_proj(out.transpose(1, 2).reshape(b, s, -1))

    def _forward(self, ids: torch.Tensor, rows: slice, positions: torch.Tensor,
                 num_keys: int) -> torch.Tensor:
        """Next-token argmax int64 ``[b]`` after ``ids [b, S]`` at ``positions [S]``."""
        model = self.target.model
        hidden = model.embed_tokens(ids)
        cos, sin = model.rotary_emb(hidden, position_ids=positions[None, :])
        for layer in model.layers:
            hidden = hidden + self._attention(layer, layer.input_layernorm(hidden), rows,
                                              positions, cos, sin, num_keys)
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        logits = self.target.lm_head(model.norm(hidden[:, -1]))
        return logits.argmax(-1)

    def _step(self) -> None:
        """One decoding step on the step buffers (what the CUDA graph holds)."""
        nxt = self._forward(self.step_ids, slice(None), self.step_pos, self.max_len)
        self.out.index_copy_(1, self.step_col, nxt[:, None])
        self.step_ids.copy_(nxt[:, None])
        self.step_pos.add_(1)
        self.step_col.add_(1)

    def _capture(self) -> None:
        """Capture :meth:`_step` in a CUDA graph (after one warm-up run on a side
        stream). Both runs write slots 0 and 1 and the step buffers; called before a
        batch's prefill, which (with the first decoding step) writes every slot a
        query reads, so the leftovers are never read."""
        self.step_pos.zero_()
        self.step_col.zero_()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._step()
        torch.cuda.current_stream().wait_stream(stream)
        self._graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self._graph):
            self._step()

    # -- the public call ------------------------------------------------------------------

    @torch.no_grad()
    def __call__(self, prefix: torch.Tensor, num_new: int) -> torch.Tensor:
        """``[B, P + num_new]`` int64: ``prefix [B, P]`` (int64, ``B <= batch``) followed
        by the target's greedy continuation of ``num_new`` tokens."""
        rows_in, plen = prefix.shape
        if rows_in > self.batch:
            raise ValueError(f"{rows_in} prefixes > batch {self.batch}: decode in batches")
        if plen + num_new > self.max_len:
            raise ValueError(f"prefix {plen} + {num_new} new tokens > max_len {self.max_len}")
        if num_new <= 0:
            return prefix
        if self.use_graph and self._graph is None:
            self._capture()
        prefix = prefix.to(self.device)
        if rows_in < self.batch:  # fixed shapes: pad with copies of the first row
            pad = prefix[:1].expand(self.batch - rows_in, -1)
            prefix = torch.cat([prefix, pad])
        positions = torch.arange(plen, device=self.device)
        first = torch.empty(self.batch, dtype=torch.long, device=self.device)
        for start in range(0, self.batch, self.prefill_rows):
            rows = slice(start, min(self.batch, start + self.prefill_rows))
            first[rows] = self._forward(prefix[rows], rows, positions, plen)
        self.out[:, 0] = first
        self.step_ids.copy_(first[:, None])
        self.step_pos.fill_(plen)
        self.step_col.fill_(1)
        for _ in range(num_new - 1):
            if self._graph is not None:
                self._graph.replay()
            else:
                self._step()
        return torch.cat([prefix, self.out[:, :num_new]], dim=1)[:rows_in]

    @torch.no_grad()
    def agreement(self, prefix: torch.Tensor, num_new: int = 32) -> float:
        """Mean fraction of ``num_new`` greedy tokens on which this decoder and
        transformers' KV-cached decoding (``train_drafter.greedy_continue``) agree
        before they first differ, over the rows of ``prefix [B, P]``. 1.0 in fp32; in
        bf16 a near-tie may part them late; a broken step (a stale graph, a wrong
        mask) parts them at once."""
        plen = prefix.shape[1]
        ours = self(prefix, num_new)[:, plen:]
        ref = greedy_continue(self.target, prefix.to(self.device), num_new)[:, plen:]
        differ = ours != ref
        first = torch.where(differ.any(1), differ.float().argmax(1), num_new)
        return float(first.float().mean()) / num_new

