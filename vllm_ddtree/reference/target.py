"""A Hugging Face causal LM driven as the verifier: KV cache, tree masks, compaction."""

from __future__ import annotations

import torch
from transformers import DynamicCache


class TargetRunner:
    """Runs a transformers causal LM (Qwen3, DeepseekV3, ...) one request at a time.

    Keeps the target's KV cache across rounds; ``verify`` appends the KV of
    ``[bonus, nodes...]`` and ``keep_accepted`` compacts the accepted rows into
    consecutive slots (their RoPE already used the right positions), so the
    cache always holds exactly the committed tokens.

    Aux hidden states (for the DFlash drafter) are the outputs of decoder layers
    ``aux_layer_ids`` (0-based, before the final norm), concatenated in ascending
    layer order, as vLLM 0.26 collects them.
    """

    def __init__(self, model, aux_layer_ids: list[int] | None = None):
        self.model = model
        self.cache = DynamicCache(config=model.config)
        self.num_cached = 0
        self.aux_layer_ids = sorted(aux_layer_ids or [])
        self._aux: dict[int, torch.Tensor] = {}
        layers = model.model.layers
        self._hooks = [
            layers[i].register_forward_hook(self._make_hook(i)) for i in self.aux_layer_ids
        ]

    def _make_hook(self, layer_idx: int):
        def hook(module, args, output):
            self._aux[layer_idx] = output[0] if isinstance(output, tuple) else output

        return hook

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    @torch.no_grad()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, new_mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run ``input_ids [Q]`` at ``positions [Q]`` after the cached tokens.

        ``new_mask`` bool ``[Q, Q]`` says which new tokens each new token sees
        (None = causal); every cached token is visible. Returns logits ``[Q, V]``
        (fp32) and aux hidden states ``[Q, len(aux_layer_ids) * hidden]`` (or None).
        """
        q = input_ids.shape[0]
        device = input_ids.device
        if new_mask is None:
            new_mask = torch.ones(q, q, dtype=torch.bool, device=device).tril()
        visible = torch.cat(
            [torch.ones(q, self.num_cached, dtype=torch.bool, device=device), new_mask], dim=1
        )
        dtype = self.model.dtype
        attn = torch.zeros(visible.shape, dtype=dtype, device=device)
        attn.masked_fill_(~visible, torch.finfo(dtype).min)
        self._aux.clear()
        out = self.model(
            input_ids=input_ids[None],
            position_ids=positions[None],
            attention_mask=attn[None, None],
            past_key_values=self.cache,
            use_cache=True,
        )
        self.num_cached += q
        aux = None
        if self.aux_layer_ids:
            aux = torch.cat([self._aux[i][0] for i in self.aux_layer_ids], dim=-1)
        return out.logits[0].float(), aux

    def keep_accepted(self, first_new: int, src_rows: torch.Tensor) -> None:
        """Keep the root row and the accepted rows of the last forward, compacted.

        ``first_new`` is the cache index of the last forward's row 0 (the root);
        ``src_rows [a]`` are the accepted rows (relative to the root, in path order)
        that move to rows ``1..a``. Sources are gathered before any write.
        """
        keep = torch.cat(
            [torch.arange(first_new + 1, device=src_rows.device), first_new + src_rows]
        )
        for layer in self.cache.layers:
            layer.keys = layer.keys.index_select(-2, keep)
            layer.values = layer.values.index_select(-2, keep)
        self.num_cached = first_new + 1 + src_rows.shape[0]

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.model.get_input_embeddings()(token_ids)

    def lm_head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.get_output_embeddings()(hidden).float()
