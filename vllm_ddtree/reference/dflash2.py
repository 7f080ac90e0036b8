"""DFlash2 block-diffusion drafter in plain PyTorch (the fp32 reference and CPU engine).

Published design (architecture ``DFlash2DraftModel``; z-lab / inco.ai drafters such as
``z-lab/Qwen3.8-27B-DFlash2``, vLLM PR #52816 ``vllm/model_executor/models/qwen3_dflash2.py``
and ``vllm/v1/worker/gpu/spec_decode/dflash2/``, SGLang PR #35371): a DFlash drafter
(:mod:`vllm_ddtree.reference.drafter`) plus two checkpoint-carried modules.

Checkpoint layout (``model.safetensors``, names without a prefix; ``H`` hidden size,
``T = conv_kernel_size`` taps, ``G = H / conv_group_size`` channel groups,
``R = selector_rank``, ``V`` vocabulary), on top of the DFlash tensors:

- ``layers.{i}.attention_conv.base_kernel`` and ``layers.{i}.mlp_conv.base_kernel``:
  ``[2, T, H]``; dim 0 is the side (0: before the sublayer, 1: after it).
- ``layers.{i}.attention_conv.kernel_projection.weight`` (and ``mlp_conv``):
  ``[2 * T * G, H]``, no bias; its output reads as ``[2 sides, T taps, G groups]``.
- ``candidate_selector.hidden_projection.weight``: ``[R, H]``, no bias.
- ``candidate_selector.predecessor_codebook`` and ``.successor_codebook``: ``[V, R]``.

Config keys in ``dflash_config``: ``block_size``, ``mask_token_id``,
``target_layer_ids`` (as DFlash), ``conv_kernel_size`` (T), ``conv_group_size``,
``selector_rank`` (R), ``selector_top_k`` (K); optional ``input_embedding_scale``
(multiplies the token embeddings, default 1), ``output_multiplier`` (multiplies the
logits, default 1) and ``final_logit_softcapping`` (``cap * tanh(logit / cap)``; absent,
null or 0: none).

Forward of one decoder layer over a query block (rows ``0..S-1`` of one request):
``x = input_layernorm(h)``; one projection of ``x`` gives the per-row, per-group kernel
deltas of both sides; the attention input is the grouped dynamic depthwise convolution
``y[i, c] = sum_t (base[0, t, c] + delta[i, 0, t, g(c)]) * x[i - t, c]`` over the taps
``t < T`` with ``i - t >= 0`` inside the block (``g(c) = c // conv_group_size``); the
attention output goes through the same convolution with side 1 and the same deltas;
then the residual add, ``post_attention_layernorm`` and the MLP wrapped the same way by
``mlp_conv``. The context K/V path is DFlash's, untouched.

Candidate selector, per block position ``l = 1..S-1`` (final-normed hidden ``h_l``):
the ``K`` best tokens ``c`` of the logits (after the multiplier and softcap; the value is
the unary term ``u[l, c]``) and, for a predecessor token ``p`` (the verified anchor at
``l = 1``, a candidate of position ``l - 1`` otherwise), the score
``s[l, p, c] = u[l, c] + sum_r P[p, r] * (W h_l)[r] * S[c, r]``. vLLM's DFlash2 drafts
the chain that walks from the anchor taking, at each position, the best score given
the previous pick; its sampled walk draws from ``softmax(s[l, p, :] / T)``. DDTree's
trees score more than ``K`` candidates with the same formula (``draft_block``'s
``num_candidates``; ``vllm_ddtree.tree.selector_tree.tree_candidates``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from vllm_ddtree.drafter_config import DFLASH2_ARCHITECTURE, dflash2_config_of
from vllm_ddtree.reference.drafter import (
    DFlashContextCache,
    DFlashDecoderLayer,
    DFlashDraftModel,
)
from vllm_ddtree.tree.selector_tree import candidate_log_mass, top_k_candidates


class GroupedDynamicConv(nn.Module):
    """Grouped dynamic depthwise convolution along a query block (both sides).

    ``base_kernel`` fp ``[2, taps, hidden]``; ``kernel_projection``: hidden ->
    ``2 * taps * groups``.
    """

    def __init__(self, hidden_size: int, taps: int, group_size: int):
        super().__init__()
        self.taps = taps
        self.group_size = group_size
        self.num_groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, taps, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * taps * self.num_groups, bias=False)

    def deltas(self, x: torch.Tensor) -> torch.Tensor:
        """Kernel deltas ``[N, 2, taps, groups]`` of the sublayer input ``x [N, hidden]``."""
        return self.kernel_projection(x).view(x.shape[0], 2, self.taps, self.num_groups)

    def convolve(self, x: torch.Tensor, deltas: torch.Tensor, side: int,
                 offsets: torch.Tensor) -> torch.Tensor:
        """Side ``side`` of the convolution of ``x [N, hidden]``; ``deltas`` from
        :meth:`deltas`; ``offsets`` int64 ``[N]``: each row's index inside its block
        (rows of a block are consecutive). Returns ``[N, hidden]`` in ``x``'s dtype."""
        n, hidden = x.shape
        blocks = x.view(n, self.num_groups, self.group_size)
        kernel = (self.base_kernel[side].view(1, self.taps, self.num_groups, self.group_size)
                  + deltas[:, side].unsqueeze(-1))  # [N, taps, G, group_size]
        out = kernel[:, 0] * blocks
        for tap in range(1, self.taps):
            shifted = torch.zeros_like(blocks)
            shifted[tap:] = blocks[:-tap]
            keep = (offsets >= tap).to(x.dtype).view(n, 1, 1)
            out = out + kernel[:, tap] * shifted * keep
        return out.reshape(n, hidden)

    def around(self, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
               offsets: torch.Tensor) -> torch.Tensor:
        """``fn`` (a sublayer) between the two sides of the convolution, both made with
        the deltas of ``x``; ``x [..., S, H]`` (rows of a block consecutive),
        ``offsets`` int64 ``[S]``: each row's index in its block."""
        shape = x.shape
        rows = x.reshape(-1, shape[-1])
        offsets = offsets.repeat(rows.shape[0] // offsets.shape[0])
        deltas = self.deltas(rows)
        y = fn(self.convolve(rows, deltas, 0, offsets).view(shape))
        return self.convolve(y.reshape(-1, shape[-1]), deltas, 1, offsets).view(shape)


class DFlash2DecoderLayer(DFlashDecoderLayer):
    """A DFlash decoder layer whose attention and MLP sit inside grouped convolutions."""

    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx)
        draft = dflash2_config_of(config)
        taps, group = draft["conv_kernel_size"], draft["conv_group_size"]
        self.attention_conv = GroupedDynamicConv(config.hidden_size, taps, group)
        self.mlp_conv = GroupedDynamicConv(config.hidden_size, taps, group)

    def forward(self, hidden, positions, ctx_k, ctx_v, ctx_pos, rotary, offsets=None):
        """``hidden [S, H]`` of one block at ``positions [S]``; ``offsets`` int64 ``[S]``
        each row's index in its block (default ``0..S-1``: one block)."""
        if offsets is None:
            offsets = torch.arange(hidden.shape[0], device=hidden.device)
        hidden = hidden + self.attention_conv.around(
            lambda x: self.self_attn(x, positions, ctx_k, ctx_v, ctx_pos, rotary),
            self.input_layernorm(hidden), offsets)
        return hidden + self.mlp_conv.around(
            self.mlp, self.post_attention_layernorm(hidden), offsets)


class CandidateSelector(nn.Module):
    """Unary + low-rank edge scores between adjacent block positions' top-K candidates."""

    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        self.predecessor_codebook = nn.Parameter(torch.zeros(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.zeros(vocab_size, rank))

    def forward(self, candidate_ids: torch.Tensor, unary: torch.Tensor, hidden: torch.Tensor,
                anchor_ids: torch.Tensor) -> torch.Tensor:
        """Edge scores fp32 ``[R, L, K, K]``: ``[r, l, p, c]`` scores candidate ``c`` of
        position ``l`` after predecessor slot ``p`` (the anchor for every ``p`` at
        ``l = 0``, candidate ``p`` of position ``l - 1`` otherwise).

        ``candidate_ids`` int64 ``[R, L, K]``, ``unary`` fp32 ``[R, L, K]``, ``hidden``
        ``[R, L, H]`` (the final-normed drafter states), ``anchor_ids`` int64 ``[R]``.
        """
        gate = self.hidden_projection(hidden)  # [R, L, rank]
        previous = torch.cat([anchor_ids.view(-1, 1, 1).expand(-1, 1, candidate_ids.shape[-1]),
                              candidate_ids[:, :-1]], dim=1)
        pred = self.predecessor_codebook[previous] * gate[:, :, None]  # [R, L, K, rank]
        succ = self.successor_codebook[candidate_ids]  # [R, L, K, rank]
        edges = torch.einsum("rlpk,rlck->rlpc", pred, succ)
        return unary.float()[:, :, None, :] + edges.float()

    def given(self, candidate_ids: torch.Tensor, unary: torch.Tensor, hidden: torch.Tensor,
              predecessor_ids: torch.Tensor) -> torch.Tensor:
        """Scores fp32 ``[..., K]`` of the candidates ``candidate_ids [..., K]`` (unary
        ``[..., K]``, drafter states ``hidden [..., H]``) after one known predecessor
        token each, ``predecessor_ids [...]`` (training: the true previous token)."""
        gate = self.hidden_projection(hidden)  # [..., rank]
        pred = self.predecessor_codebook[predecessor_ids] * gate
        edges = (self.successor_codebook[candidate_ids] * pred[..., None, :]).sum(-1)
        return unary.float() + edges.float()


@dataclass
class Dflash2Block:
    """The drafter's outputs for one block after ``anchor`` (L = block_size - 1 depths).

    ``logits`` fp32 ``[L, V]`` (after the output multiplier and softcap: the marginals),
    ``candidate_ids`` int64 ``[L, K]`` (best first, ties by token id), ``unary`` fp32
    ``[L, K]`` (their logits), ``edge_scores`` fp32 ``[L, K, K]`` (selector scores).
    """

    logits: torch.Tensor
    candidate_ids: torch.Tensor
    unary: torch.Tensor
    edge_scores: torch.Tensor

    def candidate_log_mass(self) -> torch.Tensor:
        """fp32 ``[L]``: log of the marginal mass of each position's candidates."""
        return candidate_log_mass(self.unary, torch.logsumexp(self.logits, dim=-1))


class DFlash2DraftModel(DFlashDraftModel):
    """DFlash2 drafter: DFlash with grouped convolutions and a candidate selector.

    ``DFlash2DraftModel(config)`` gives random weights; ``from_pretrained(dir)`` loads a
    checkpoint in the published layout (module docstring). Embeddings and LM head are
    the target's.
    """

    _no_split_modules = ["DFlash2DecoderLayer"]
    decoder_layer_cls = DFlash2DecoderLayer

    def add_modules(self, config) -> None:
        draft = dflash2_config_of(config)
        self.selector_top_k = draft["selector_top_k"]
        self.input_embedding_scale = float(draft.get("input_embedding_scale") or 1.0)
        self.output_multiplier = float(draft.get("output_multiplier") or 1.0)
        self.softcap = float(draft.get("final_logit_softcapping") or 0.0)
        self.candidate_selector = CandidateSelector(
            config.hidden_size, config.vocab_size, draft["selector_rank"], draft["selector_top_k"])

    def _init_weights(self, module):
        super()._init_weights(module)
        std = getattr(self.config, "initializer_range", 0.02)
        if isinstance(module, GroupedDynamicConv):
            with torch.no_grad():
                module.base_kernel.normal_(std=std)
                module.base_kernel[:, 0] += 1.0  # near the identity, as trained kernels sit
        elif isinstance(module, CandidateSelector):
            nn.init.normal_(module.predecessor_codebook, std=std)
            nn.init.normal_(module.successor_codebook, std=std)

    def new_context_cache(self) -> DFlashContextCache:
        return DFlashContextCache(self)

    @classmethod
    def from_dflash(cls, drafter: DFlashDraftModel, conv_kernel_size: int = 2,
                    conv_group_size: int = 16, selector_rank: int = 32,
                    selector_top_k: int = 8, seed: int = 0) -> DFlash2DraftModel:
        """A DFlash2 drafter that starts as ``drafter`` exactly: its weights, identity
        convolutions (first tap 1, the rest and the kernel deltas 0) and a selector whose
        edge term is 0 (successor codebook 0; the predecessor codebook and hidden
        projection random, seeded, so the edge term can learn)."""
        config = copy.deepcopy(drafter.config)
        config.architectures = [DFLASH2_ARCHITECTURE]
        config.dflash_config = {**config.dflash_config, "conv_kernel_size": conv_kernel_size,
                                "conv_group_size": conv_group_size,
                                "selector_rank": selector_rank,
                                "selector_top_k": selector_top_k}
        model = cls(config)
        missing, unexpected = model.load_state_dict(drafter.state_dict(), strict=False)
        assert not unexpected, unexpected
        g = torch.Generator().manual_seed(seed)
        std = getattr(config, "initializer_range", 0.02)
        with torch.no_grad():
            for layer in model.layers:
                for conv in (layer.attention_conv, layer.mlp_conv):
                    conv.base_kernel.zero_()
                    conv.base_kernel[:, 0] = 1.0
                    conv.kernel_projection.weight.zero_()
            selector = model.candidate_selector
            for p in (selector.hidden_projection.weight, selector.predecessor_codebook):
                p.copy_(torch.randn(p.shape, generator=g) * std)
            selector.successor_codebook.zero_()
        return model.to(next(drafter.parameters()).device)

    def output_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """fp32 logits after ``output_multiplier`` and ``final_logit_softcapping``."""
        logits = logits.float() * self.output_multiplier
        if self.softcap > 0:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def block_hidden(self, bonus: int, position: int, context: DFlashContextCache,
                     embed: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Final-normed hidden states ``[block_size, H]`` of ``[bonus, MASK...]``."""
        device = self.fc.weight.device
        block_ids = torch.full((self.block_size,), self.mask_token_id, device=device)
        block_ids[0] = bonus
        block_pos = torch.arange(position, position + self.block_size, device=device)
        return self(embed(block_ids) * self.input_embedding_scale, block_pos, context)

    def block_logits(self, bonus, position, context, embed, lm_head) -> torch.Tensor:
        """Marginal draft logits fp32 ``[block_size - 1, V]`` (depths 1..block_size-1)."""
        hidden = self.block_hidden(bonus, position, context, embed)
        return self.output_logits(lm_head(hidden[1:]))

    def draft_block(self, bonus: int, position: int, context: DFlashContextCache,
                    embed: Callable[[torch.Tensor], torch.Tensor],
                    lm_head: Callable[[torch.Tensor], torch.Tensor],
                    num_candidates: int | None = None) -> Dflash2Block:
        """Marginals, top-K candidates and selector scores of the block after ``bonus``
        (the verified anchor, at ``position``); ``num_candidates`` K (default the
        checkpoint's ``selector_top_k``; trees rank more,
        ``vllm_ddtree.tree.selector_tree.tree_candidates``)."""
        hidden = self.block_hidden(bonus, position, context, embed)[1:]
        logits = self.output_logits(lm_head(hidden))
        unary, ids = top_k_candidates(logits, num_candidates or self.selector_top_k)
        anchor = torch.tensor([bonus], device=ids.device)
        scores = self.candidate_selector(ids[None], unary[None], hidden[None], anchor)[0]
        return Dflash2Block(logits, ids, unary, scores)

