"""DFlash block-diffusion drafter in plain PyTorch (the reference and CPU engine).

Checkpoint format: the one vLLM 0.26 loads as ``DFlashDraftModel``
(``vllm/model_executor/models/qwen3_dflash.py``): a Qwen3-style config with
``block_size``, ``dflash_config = {"target_layer_ids": [...], "mask_token_id": m}``,
``layer_types`` (``sliding_attention`` / ``full_attention``) and ``sliding_window``;
weights ``fc``, ``hidden_norm``, ``layers.*`` (Qwen3 decoder layers), ``norm``.
Token embeddings and the LM head are the target's.

Semantics mirrored from vLLM 0.26:
- Target layer indexing: ``target_layer_ids[i] = t`` means the output of target
  decoder layer ``t`` (0-based, before the final norm), i.e. vLLM's aux hidden
  state index ``t + 1`` (``eagle3_utils.get_eagle3_aux_layers_from_config``).
- Context K/V of every layer come from ``hidden_norm(fc(concat(aux states)))``
  projected by that layer's k/v projections, k-normed and rotated at the context
  token's position (``precompute_and_store_context_kv``); they do not pass through
  the decoder layers.
- Per-layer attention (``_resolve_layer_attention``): sliding layers are causal
  with window ``sliding_window`` (``dflash_config.swa_window_size`` wins), full
  layers are non-causal; ``dflash_config.causal`` overrides causality for all.
  A sliding window ``w`` lets a query at position p see keys at positions
  ``p-w+1 .. p`` (causal) or ``|p-k| < w`` (non-causal).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel, Qwen3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm

from vllm_ddtree.drafter_config import (  # DrafterConfigError: re-exported for callers
    DrafterConfigError,  # noqa: F401
    block_size_of,
    dflash_config_of,
    resolve_layer_attention,
)


class DrafterRotary(nn.Module):
    """Neox-style RoPE with the config's ``rope_parameters`` (default, YaRN, ...).

    The inverse frequencies and the attention scaling come from transformers'
    ``ROPE_INIT_FUNCTIONS``; vLLM's ``get_rope`` builds the same tables.
    """

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.register_buffer("inv_freq", torch.empty(config.head_dim // 2), persistent=False)
        self.attention_scaling = 1.0
        self.reset_tables()

    def reset_tables(self) -> None:
        """(Re)compute ``inv_freq`` from the config; transformers 5's ``from_pretrained``
        allocates non-persistent buffers empty and refills them via ``_init_weights``."""
        config = self.config
        rope_type = config.rope_parameters.get("rope_type", "default")
        if rope_type == "default":
            base = config.rope_parameters["rope_theta"]
            dim = config.head_dim
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
            scaling = 1.0
        else:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, None)
        with torch.no_grad():
            self.inv_freq = inv_freq.float().to(self.inv_freq.device)
        self.attention_scaling = float(scaling)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate ``x [N, heads, head_dim]`` at integer ``positions [N]``; same dtype out."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq.to(x.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.attention_scaling)[:, None, :]
        sin = (emb.sin() * self.attention_scaling)[:, None, :]
        xf = x.float()
        half = xf.shape[-1] // 2
        rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
        return (xf * cos + rotated * sin).to(x.dtype)


class DFlashAttention(nn.Module):
    """Qwen3 attention whose keys are cached context K/V plus the block's own K/V."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        bias = getattr(config, "attention_bias", False)
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.sliding_window, self.causal = resolve_layer_attention(config, layer_idx)

    def project_kv(
        self, hidden: torch.Tensor, positions: torch.Tensor, rotary: DrafterRotary
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V ``[N, kv_heads, head_dim]`` of ``hidden [N, hidden]`` at ``positions [N]``."""
        n = hidden.shape[0]
        k = self.k_norm(self.k_proj(hidden).view(n, self.num_kv_heads, self.head_dim))
        v = self.v_proj(hidden).view(n, self.num_kv_heads, self.head_dim)
        return rotary(k, positions), v

    def visible(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """Bool ``[Q, K]``: which keys (positions ``k_pos``) each query may attend."""
        diff = q_pos[:, None] - k_pos[None, :]
        mask = torch.ones_like(diff, dtype=torch.bool)
        if self.causal:
            mask &= diff >= 0
        if self.sliding_window is not None:
            mask &= diff < self.sliding_window
            if not self.causal:
                mask &= diff > -self.sliding_window
        return mask

    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        ctx_k: torch.Tensor,
        ctx_v: torch.Tensor,
        ctx_pos: torch.Tensor,
        rotary: DrafterRotary,
    ) -> torch.Tensor:
        """Attention of the block ``hidden [Q, hidden]`` over context + block keys."""
        q_len = hidden.shape[0]
        q = self.q_norm(self.q_proj(hidden).view(q_len, self.num_heads, self.head_dim))
        q = rotary(q, positions)
        k_blk, v_blk = self.project_kv(hidden, positions, rotary)
        k = torch.cat([ctx_k, k_blk], dim=0)
        v = torch.cat([ctx_v, v_blk], dim=0)
        mask = self.visible(positions, torch.cat([ctx_pos, positions]))
        groups = self.num_heads // self.num_kv_heads
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask[None]
        )
        return self.o_proj(out.transpose(0, 1).reshape(q_len, -1))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden, positions, ctx_k, ctx_v, ctx_pos, rotary):
        residual = hidden
        hidden = self.self_attn(
            self.input_layernorm(hidden), positions, ctx_k, ctx_v, ctx_pos, rotary
        )
        hidden = residual + hidden
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class DFlashContextCache:
    """Per-layer context K/V of one request, grown by the committed tokens only.

    Sliding-window layers keep just the last ``window`` positions (older ones can
    never be seen again: block queries sit after every context position).
    ``num_projected`` counts context rows whose K/V were computed, for tests.
    """

    def __init__(self, drafter: DFlashDraftModel):
        self.drafter = drafter
        n = len(drafter.layers)
        self.keys: list[torch.Tensor | None] = [None] * n
        self.values: list[torch.Tensor | None] = [None] * n
        self.positions: list[torch.Tensor | None] = [None] * n
        self.num_projected = 0
        self.next_position = 0

    def append(self, target_hidden: torch.Tensor, positions: torch.Tensor) -> None:
        """Add context rows: ``target_hidden [N, len(target_layer_ids) * target_hidden]``
        (the concatenated aux states of newly committed tokens), ``positions [N]``."""
        if target_hidden.shape[0] == 0:
            return
        ctx_hidden = self.drafter.hidden_norm(self.drafter.fc(target_hidden))
        for i, layer in enumerate(self.drafter.layers):
            attn = layer.self_attn
            k, v = attn.project_kv(ctx_hidden, positions, self.drafter.rotary)
            if self.keys[i] is not None:
                k = torch.cat([self.keys[i], k])
                v = torch.cat([self.values[i], v])
                pos = torch.cat([self.positions[i], positions])
            else:
                pos = positions
            if attn.sliding_window is not None:
                k, v, pos = (t[-attn.sliding_window :] for t in (k, v, pos))
            self.keys[i], self.values[i], self.positions[i] = k, v, pos
        self.num_projected += target_hidden.shape[0]
        self.next_position = int(positions[-1]) + 1

    def layer_kv(self, i: int, like: torch.Tensor):
        if self.keys[i] is None:
            attn = self.drafter.layers[i].self_attn
            empty = like.new_zeros(0, attn.num_kv_heads, attn.head_dim)
            return empty, empty, torch.zeros(0, dtype=torch.long, device=like.device)
        return self.keys[i], self.values[i], self.positions[i]


class DFlashDraftModel(PreTrainedModel):
    """DFlash drafter: one non-causal pass over ``[bonus, MASK x (block_size-1)]``.

    ``DFlashDraftModel(config)`` gives random weights; ``from_pretrained(dir)`` loads
    a DFlash checkpoint. Embeddings and LM head are passed in (the target's).
    """

    config_class = Qwen3Config
    base_model_prefix = ""
    _no_split_modules = ["DFlashDecoderLayer"]
    decoder_layer_cls = DFlashDecoderLayer

    def __init__(self, config):
        super().__init__(config)
        dflash_config = dflash_config_of(config)
        self.block_size = block_size_of(config)
        if getattr(config, "head_dim", None) is None:
            config.head_dim = config.hidden_size // config.num_attention_heads
        self.target_layer_ids = list(dflash_config["target_layer_ids"])
        self.mask_token_id = int(dflash_config["mask_token_id"])
        target_hidden = getattr(config, "target_hidden_size", None) or config.hidden_size
        self.fc = nn.Linear(
            target_hidden * len(self.target_layer_ids), config.hidden_size, bias=False
        )
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(
            self.decoder_layer_cls(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary = DrafterRotary(config)
        self.add_modules(config)
        self.post_init()

    def add_modules(self, config) -> None:
        """Modules a subclass adds before the weights are initialised (none here)."""

    def _init_weights(self, module):
        std = getattr(self.config, "initializer_range", 0.02)
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, Qwen3RMSNorm):
            nn.init.ones_(module.weight)
        elif isinstance(module, DrafterRotary):
            module.reset_tables()

    def new_context_cache(self) -> DFlashContextCache:
        return DFlashContextCache(self)

    def forward(
        self,
        block_embeds: torch.Tensor,
        block_positions: torch.Tensor,
        context: DFlashContextCache,
    ) -> torch.Tensor:
        """Final-normed hidden states ``[block_size, hidden]`` of one block.

        ``block_embeds [block_size, hidden]`` are the embeddings of
        ``[bonus, MASK, ...]`` at ``block_positions [block_size]`` (consecutive, the
        first one right after the last context position).
        """
        hidden = block_embeds
        for i, layer in enumerate(self.layers):
            ctx_k, ctx_v, ctx_pos = context.layer_kv(i, hidden)
            hidden = layer(hidden, block_positions, ctx_k, ctx_v, ctx_pos, self.rotary)
        return self.norm(hidden)

    def block_logits(
        self,
        bonus: int,
        position: int,
        context: DFlashContextCache,
        embed: Callable[[torch.Tensor], torch.Tensor],
        lm_head: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """Draft logits ``[block_size - 1, V]`` (fp32) for depths 1..block_size-1.

        Runs the block ``[bonus, MASK x (block_size-1)]`` at positions
        ``position ..`` (``bonus`` sits at ``position``) through the drafter, with the
        target's ``embed`` and ``lm_head``.
        """
        device = self.fc.weight.device
        block_ids = torch.full((self.block_size,), self.mask_token_id, device=device)
        block_ids[0] = bonus
        block_pos = torch.arange(position, position + self.block_size, device=device)
        hidden = self(embed(block_ids), block_pos, context)
        return lm_head(hidden[1:]).float()
