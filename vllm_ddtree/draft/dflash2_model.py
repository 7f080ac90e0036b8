"""The DFlash2 drafter as a vLLM 0.26 model (``DFlash2DraftModel``, registered by the plugin).

vLLM 0.26 loads DFlash drafters as ``DFlashQwen3ForCausalLM``
(``vllm/model_executor/models/qwen3_dflash.py``); DFlash2 checkpoints (layout in
:mod:`vllm_ddtree.reference.dflash2`) add per-layer grouped dynamic convolutions
(``layers.{i}.attention_conv`` / ``mlp_conv``: ``base_kernel [2, T, H]``,
``kernel_projection [2 T G, H]``) and a ``candidate_selector`` (``hidden_projection
[R, H]``, ``predecessor_codebook`` / ``successor_codebook [V, R]``). The classes here
subclass vLLM's DFlash ones: the DFlash layers are built by vLLM's own constructor and
then become :class:`DFlash2DecoderLayer` (their class is swapped for the subclass and
the two convolutions added), so the attention layers register once, under vLLM's
names. Weight loading is vLLM's (the new tensors go through ``AutoWeightsLoader``
under ``model.``).

The convolution runs along each request's query block: the drafter's rows are
``block_size`` consecutive rows a request (DDTree's query block, one bonus and
``block_size - 1`` masks), so a row's offset in its block is its index modulo
``block_size``.
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.models.qwen3_dflash import (
    DFlashQwen3DecoderLayer,
    DFlashQwen3ForCausalLM,
    DFlashQwen3Model,
)
from vllm.model_executor.models.utils import maybe_prefix

from vllm_ddtree.drafter_config import block_size_of, dflash2_config_of
from vllm_ddtree.tree.selector_tree import top_k_candidates

__all__ = ["DFlash2DecoderLayer", "DFlash2Qwen3ForCausalLM", "DFlash2Qwen3Model",
           "GroupedDynamicConv", "SelectorScores", "candidate_chunk_rows",
           "output_transform", "ranked_candidates"]


def drafter_config_of(config):
    """The drafter's own config: vLLM wraps a DFlash drafter's config in an
    ``EAGLEConfig`` whose ``model`` is the original (it may lack ``block_size``)."""
    return getattr(config, "model", None) or config


def _linear(in_size: int, out_size: int, dtype: torch.dtype, prefix: str) -> ReplicatedLinear:
    return ReplicatedLinear(in_size, out_size, bias=False, params_dtype=dtype,
                            quant_config=None, prefix=prefix, return_bias=False)


class GroupedDynamicConv(nn.Module):
    """Grouped dynamic depthwise convolution along the query block, both sides.

    ``base_kernel`` ``[2, taps, H]``; ``kernel_projection``: H -> ``2 * taps * groups``.
    """

    def __init__(self, hidden_size: int, taps: int, group_size: int, block_size: int,
                 dtype: torch.dtype, prefix: str):
        super().__init__()
        self.taps = taps
        self.group_size = group_size
        self.num_groups = hidden_size // group_size
        self.block_size = block_size
        self.base_kernel = nn.Parameter(torch.zeros(2, taps, hidden_size, dtype=dtype),
                                        requires_grad=False)
        self.kernel_projection = _linear(hidden_size, 2 * taps * self.num_groups, dtype,
                                         maybe_prefix(prefix, "kernel_projection"))

    def deltas(self, x: torch.Tensor) -> torch.Tensor:
        """Per-row kernel deltas ``[N, 2, taps, groups]`` of ``x [N, H]``."""
        return self.kernel_projection(x).view(x.shape[0], 2, self.taps, self.num_groups)

    def convolve(self, x: torch.Tensor, deltas: torch.Tensor, side: int) -> torch.Tensor:
        """Side ``side`` of the convolution of ``x [N, H]`` (N a multiple of the block)."""
        n = x.shape[0]
        blocks = x.view(n, self.num_groups, self.group_size)
        kernel = (self.base_kernel[side].view(1, self.taps, self.num_groups, self.group_size)
                  + deltas[:, side].unsqueeze(-1))
        out = kernel[:, 0] * blocks
        offsets = torch.arange(n, device=x.device) % self.block_size
        # A tap >= block_size reaches into the previous block only (always masked): skip it,
        # which also keeps every shift shorter than n (whole blocks, n >= block_size).
        for tap in range(1, min(self.taps, self.block_size)):
            shifted = torch.nn.functional.pad(blocks[:-tap], (0, 0, 0, 0, tap, 0))
            out = out + kernel[:, tap] * shifted * (offsets >= tap).to(x.dtype).view(n, 1, 1)
        return out.reshape(n, -1)


class DFlash2DecoderLayer(DFlashQwen3DecoderLayer):
    """vLLM's DFlash decoder layer with the attention and the MLP inside convolutions.
    Made from a built ``DFlashQwen3DecoderLayer`` by :meth:`upgrade`."""

    attention_conv: GroupedDynamicConv
    mlp_conv: GroupedDynamicConv

    @classmethod
    def upgrade(cls, layer: DFlashQwen3DecoderLayer, config, dtype: torch.dtype,
                prefix: str) -> DFlash2DecoderLayer:
        config = drafter_config_of(config)
        draft = dflash2_config_of(config)
        args = (config.hidden_size, draft["conv_kernel_size"], draft["conv_group_size"],
                block_size_of(config), dtype)
        layer.__class__ = cls
        layer.attention_conv = GroupedDynamicConv(*args, prefix=f"{prefix}.attention_conv")
        layer.mlp_conv = GroupedDynamicConv(*args, prefix=f"{prefix}.mlp_conv")
        return layer

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        deltas = self.attention_conv.deltas(hidden_states)
        hidden_states = self.attention_conv.convolve(hidden_states, deltas, 0)
        hidden_states = self.self_attn(positions=positions, hidden_states=hidden_states)
        hidden_states = self.attention_conv.convolve(hidden_states, deltas, 1)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        deltas = self.mlp_conv.deltas(hidden_states)
        hidden_states = self.mlp(self.mlp_conv.convolve(hidden_states, deltas, 0))
        return self.mlp_conv.convolve(hidden_states, deltas, 1), residual


class SelectorScores(nn.Module):
    """The candidate selector's parameters and its edge scores (eager PyTorch)."""

    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int,
                 dtype: torch.dtype, prefix: str):
        super().__init__()
        self.top_k = top_k
        self.vocab_size = vocab_size
        self.hidden_projection = _linear(hidden_size, rank, dtype,
                                         maybe_prefix(prefix, "hidden_projection"))
        self.predecessor_codebook = nn.Parameter(torch.zeros(vocab_size, rank, dtype=dtype),
                                                 requires_grad=False)
        self.successor_codebook = nn.Parameter(torch.zeros(vocab_size, rank, dtype=dtype),
                                               requires_grad=False)

    def forward(self, candidate_ids: torch.Tensor, unary: torch.Tensor, hidden: torch.Tensor,
                anchor_ids: torch.Tensor) -> torch.Tensor:
        """fp32 ``[R, L, K, K]`` edge scores (as
        :class:`vllm_ddtree.reference.dflash2.CandidateSelector`): ``candidate_ids``
        int64 ``[R, L, K]``, ``unary`` fp32 ``[R, L, K]``, ``hidden`` ``[R, L, H]``,
        ``anchor_ids`` int64 ``[R]`` (clamped into the vocabulary: CUDA-graph padding
        rows carry stale ids)."""
        gate = self.hidden_projection(hidden.flatten(0, 1)).view(*hidden.shape[:2], -1)
        anchors = anchor_ids.clamp(0, self.vocab_size - 1)
        previous = torch.cat([anchors.view(-1, 1, 1).expand(-1, 1, candidate_ids.shape[-1]),
                              candidate_ids[:, :-1]], dim=1)
        pred = self.predecessor_codebook[previous].float() * gate.float()[:, :, None]
        succ = self.successor_codebook[candidate_ids].float()
        return unary.float()[:, :, None, :] + torch.einsum("rlpk,rlck->rlpc", pred, succ)


class DFlash2Qwen3Model(DFlashQwen3Model):
    """vLLM's DFlash model with DFlash2 layers, the embedding scale and the selector."""

    def __init__(self, *, vllm_config, start_layer_id: int = 0, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, start_layer_id=start_layer_id,
                         prefix=prefix)
        config = drafter_config_of(self.config)
        dtype = vllm_config.model_config.dtype
        draft = dflash2_config_of(config)
        for i, layer in enumerate(self.layers):
            DFlash2DecoderLayer.upgrade(
                layer, config, dtype, maybe_prefix(prefix, f"layers.{i + start_layer_id}"))
        self.input_embedding_scale = float(draft.get("input_embedding_scale") or 1.0)
        self.candidate_selector = SelectorScores(
            config.hidden_size, config.vocab_size, draft["selector_rank"],
            draft["selector_top_k"], dtype, maybe_prefix(prefix, "candidate_selector"))

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().embed_input_ids(input_ids) * self.input_embedding_scale


class DFlash2Qwen3ForCausalLM(DFlashQwen3ForCausalLM):
    """``DFlash2DraftModel`` in vLLM 0.26: vLLM's DFlash drafter with the DFlash2 model,
    plus :meth:`compute_candidates` (the selector's top-K and unary terms, ranked in
    bounded row chunks: :func:`ranked_candidates`)."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        # vLLM's DFlashQwen3ForCausalLM.__init__ builds its own DFlashQwen3Model; this one
        # builds the same parts around DFlash2Qwen3Model.
        nn.Module.__init__(self)
        self.draft_model_config = vllm_config.speculative_config.draft_model_config
        self.config = self.draft_model_config.hf_config
        vocab = self.config.vocab_size
        if getattr(self.config, "draft_vocab_size", None) not in (None, vocab):
            raise ValueError(
                f"drafter config.json: draft_vocab_size={self.config.draft_vocab_size} is "
                f"not allowed: absent or the vocab_size {vocab} (DFlash2 drafts over the "
                "target's vocabulary)")
        self.config.draft_vocab_size = vocab
        num_target_layers = vllm_config.model_config.get_num_layers(
            vllm_config.parallel_config)
        self.model = DFlash2Qwen3Model(vllm_config=vllm_config,
                                       prefix=maybe_prefix(prefix, "model"),
                                       start_layer_id=num_target_layers)
        self.lm_head = ParallelLMHead(vocab, self.config.hidden_size,
                                      prefix=maybe_prefix(prefix, "lm_head"))
        self.logits_processor = LogitsProcessor(
            vocab, scale=getattr(self.config, "logit_scale", 1.0))
        self.draft_id_to_target_id = None
        draft = dflash2_config_of(drafter_config_of(self.config))
        self.output_multiplier = float(draft.get("output_multiplier") or 1.0)
        self.softcap = float(draft.get("final_logit_softcapping") or 0.0)

    def compute_candidates(self, hidden_states: torch.Tensor, num_candidates: int | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For final-normed ``hidden_states [N, H]``: candidate ids int64 ``[N, K]``,
        unary terms fp32 ``[N, K]`` and the logsumexp of each row's whole logits fp32
        ``[N]`` (the candidates' marginal mass: ``selector_tree.candidate_log_mass``).
        K = ``num_candidates`` (default the checkpoint's ``selector_top_k``). Best first,
        as the reference's ``top_k_candidates`` of the logits after
        ``output_multiplier`` and ``final_logit_softcapping``: by descending value, ties
        by ascending token id (NaN last), the same ids and bit-identical values.

        The head's logits ``[N, V]`` stay in their own dtype; the fp32 transform and the
        ranking's int64 sort keys run over row chunks of :func:`candidate_chunk_rows`
        rows, so their temporaries stay near ``_CANDIDATE_CHUNK_BYTES`` instead of several
        fp32 ``[N, V]`` tensors (~1.8 GB each at 256 requests x 7 positions x 248k
        tokens). Static shapes (the chunking depends on ``N`` and ``V`` only), no host
        reads: the drafter's CUDA graph captures it."""
        logits = self.compute_logits(hidden_states)
        return ranked_candidates(logits, num_candidates or self.model.candidate_selector.top_k,
                                 self.output_multiplier, self.softcap)

    def marginal_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The marginals fp32 ``[N, V]`` of ``hidden_states [N, H]`` after the multiplier
        and softcap (whole ``[N, V]`` tensors: checks and tools, not the draft step)."""
        return output_transform(self.compute_logits(hidden_states), self.output_multiplier,
                                self.softcap)


# A chunk's temporaries stay under this budget: per logit the fp32 values and their
# NaN-cleaned copy (8 bytes), the sort keys' int32 bit temporaries (~8) and three int64
# ones (24), plus topk's scratch: 48 bytes counted. At 248,320 tokens a chunk is 45
# rows (1,792 rows: 40 chunks of ~15 small kernels each inside the drafter's graph).
_CANDIDATE_CHUNK_BYTES = 512 << 20
_CANDIDATE_BYTES_PER_LOGIT = 48


def candidate_chunk_rows(num_rows: int, vocab_size: int,
                         budget_bytes: int = _CANDIDATE_CHUNK_BYTES) -> int:
    """Rows one chunk of :func:`ranked_candidates` ranks: as many as keep its
    temporaries (``_CANDIDATE_BYTES_PER_LOGIT`` bytes a logit) under ``budget_bytes``,
    at least 1, at most ``num_rows``."""
    per_row = max(1, vocab_size * _CANDIDATE_BYTES_PER_LOGIT)
    return max(1, min(num_rows, budget_bytes // per_row))


def output_transform(logits: torch.Tensor, multiplier: float, softcap: float,
                     inplace: bool = False) -> torch.Tensor:
    """fp32 ``logits * multiplier``, then ``softcap * tanh(x / softcap)`` when
    ``softcap > 0``: the reference's ``DFlash2DraftModel.output_logits`` op for op (so
    bit for bit). ``inplace``: ``logits`` is an fp32 tensor this call may overwrite."""
    values = logits if inplace else logits.float() * multiplier
    if inplace:
        values.mul_(multiplier)
    if softcap > 0:
        values.div_(softcap).tanh_().mul_(softcap)
    return values


def ranked_candidates(logits: torch.Tensor, k: int, multiplier: float, softcap: float,
                      budget_bytes: int = _CANDIDATE_CHUNK_BYTES
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``k`` best tokens of each row of ``logits [N, V]`` (any float dtype) after
    :func:`output_transform`: ids int64 ``[N, k]`` and values fp32 ``[N, k]``, by
    descending value then ascending token id (NaN last), as the reference's
    ``top_k_candidates(output_logits(logits), k)``; and each row's logsumexp fp32
    ``[N]`` of the transformed values.

    The ranking runs on the transformed fp32 values, not the raw logits: the multiplier
    and the softcap are monotonic, but fp32 rounding (and ``tanh`` saturating) can make
    distinct raw logits equal after them, and the reference breaks such ties by token
    id, which a top-k of the raw logits would not reproduce. The fp32 values and the
    sort keys exist for :func:`candidate_chunk_rows` rows at a time only."""
    num_rows, vocab_size = logits.shape
    step = candidate_chunk_rows(num_rows, vocab_size, budget_bytes)
    ids = torch.empty(num_rows, k, dtype=torch.int64, device=logits.device)
    unary = torch.empty(num_rows, k, dtype=torch.float32, device=logits.device)
    log_norm = torch.empty(num_rows, dtype=torch.float32, device=logits.device)
    for start in range(0, num_rows, step):
        rows = logits[start : start + step]
        values = output_transform(rows.to(torch.float32, copy=True), multiplier, softcap,
                                  inplace=True)
        log_norm[start : start + step] = torch.logsumexp(values, dim=-1)
        chunk_unary, chunk_ids = top_k_candidates(values, k)
        del values
        ids[start : start + step] = chunk_ids
        unary[start : start + step] = chunk_unary
    return ids, unary, log_norm
