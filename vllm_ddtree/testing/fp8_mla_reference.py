"""fp32 greedy logits of an MLA target as vLLM's plain decoding computes them on an fp8
latent cache, with exact arithmetic everywhere else: the arbiter of a flip between two
bf16 backends on the same fp8 cache.

vLLM's MLA path with ``--kv-cache-dtype fp8``:
- the prompt is prefilled from the fresh, unquantized latents (``forward_mha``);
- every latent written to the cache is e4m3 (``kv_c_normed`` and the roped ``k_pe``,
  divided by the layer's ``_k_scale``, rounded to nearest, saturated at 448);
- a decode row reads the whole cache, its own row included, with the absorbed query
  (``q_nope @ W_UK`` beside the roped ``q_pe``, 576 wide) quantized the same way with
  ``_q_scale``.
Both scales are 1.0 for checkpoints without KV scales (the embedded pair).

:func:`fp8_cache_logits` reproduces that on a Hugging Face ``DeepseekV3ForCausalLM`` in
fp32: each attention layer's forward is swapped for the absorbed form, rows before
``prompt_len`` attend exactly, rows from ``prompt_len`` on attend on the quantized
query and cache. What is left out is only the bf16 rounding of the runs it judges, so a
bf16 kernel whose token it picks is the one nearer the exact result.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator, Sequence

import torch

__all__ = ["E4M3_MAX", "FP32_LOGPROB_MEDIAN_BAR", "FP32_LOGPROB_P95_BAR", "absorbed_mla_forward",
           "deviations_from", "e4m3", "exact_fp8_arbiter", "fp8_cache_logits",
           "logprob_deviations"]

E4M3_MAX = 448.0  # the largest finite float8_e4m3fn; vLLM's conversion saturates there


def e4m3(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x`` (any float dtype) rounded as vLLM stores it in an fp8 cache with ``scale``
    (``x / scale`` to e4m3, nearest, saturating), returned dequantized in fp32."""
    code = (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return code.float() * scale


def absorbed_mla_forward(prompt_len: int, kv_scale: float | None, q_scale: float | None):
    """A ``DeepseekV3Attention.forward`` for batch 1, no cache: rows ``< prompt_len``
    attend exactly (causal); rows ``>= prompt_len`` take the e4m3 query (``q_scale``) and
    the e4m3 cache of all rows up to their own (``kv_scale``). ``None`` scales: exact
    (the plain model in its absorbed form, for checking this function)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        apply_rotary_pos_emb,
        apply_rotary_pos_emb_interleave,
    )

    def forward(self, hidden_states: torch.Tensor, position_embeddings, attention_mask=None,
                past_key_values=None, **kwargs):
        if hidden_states.shape[0] != 1 or past_key_values is not None:
            raise ValueError("fp8_cache_logits runs one sequence without a KV cache")
        seq = hidden_states.shape[1]
        heads, nope, rope = self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim
        if self.q_lora_rank is None:
            q = self.q_proj(hidden_states)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        q = q.view(1, seq, heads, nope + rope).transpose(1, 2)
        q_nope, q_rot = torch.split(q, [nope, rope], dim=-1)
        kv_c, k_rot = torch.split(self.kv_a_proj_with_mqa(hidden_states),
                                  [self.kv_lora_rank, rope], dim=-1)
        kv_c = self.kv_a_layernorm(kv_c)
        k_rot = k_rot.view(1, 1, seq, rope)
        cos, sin = position_embeddings
        rotate = (apply_rotary_pos_emb_interleave if self.config.rope_interleave
                  else apply_rotary_pos_emb)
        q_rot, k_rot = rotate(q_rot, k_rot, cos, sin)

        w_kv = self.kv_b_proj.weight.view(heads, nope + self.v_head_dim, self.kv_lora_rank)
        w_uk, w_uv = w_kv[:, :nope], w_kv[:, nope:]  # [H, nope | v, kv_lora]
        q_full = torch.cat([torch.einsum("hsd,hdl->hsl", q_nope[0], w_uk), q_rot[0]], -1)
        k_full = torch.cat([kv_c[0], k_rot[0, 0]], -1)  # [S, kv_lora + rope]
        causal = torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()

        def attend(q_rows: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
            scores = torch.einsum("hsl,tl->hst", q_rows, keys) * self.scaling
            scores = scores.masked_fill(~causal[rows], float("-inf"))
            return torch.einsum("hst,tl->hsl", scores.softmax(-1), keys[:, :self.kv_lora_rank])

        rows = slice(0, min(prompt_len, seq))
        out = [attend(q_full[:, rows], k_full)]
        if seq > prompt_len:
            rows = slice(prompt_len, seq)
            q_dec = q_full[:, rows] if q_scale is None else e4m3(q_full[:, rows], q_scale)
            k_dec = k_full if kv_scale is None else e4m3(k_full, kv_scale)
            out.append(attend(q_dec, k_dec))
        latent = torch.cat(out, dim=1)  # [H, S, kv_lora]
        values = torch.einsum("hsl,hdl->shd", latent, w_uv).reshape(1, seq, -1)
        return self.o_proj(values), None

    return forward


@contextlib.contextmanager
def _swapped_attention(model: torch.nn.Module, forward) -> Iterator[None]:
    layers = [m for m in model.modules() if type(m).__name__ == "DeepseekV3Attention"]
    if not layers:
        raise ValueError(f"{type(model).__name__} has no DeepseekV3Attention layers")
    for layer in layers:
        layer.forward = types.MethodType(forward, layer)
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward


@torch.no_grad()
def fp8_cache_logits(model: torch.nn.Module, prompt: Sequence[int], generated: Sequence[int],
                     kv_scale: float | None = 1.0, q_scale: float | None = 1.0,
                     quantized_prompt: bool = False) -> torch.Tensor:
    """``[len(generated) + 1, vocab]`` fp32 logits: row ``j`` scores generated token
    ``j`` given the prompt and ``generated[:j]`` (teacher-forced), as plain decoding on
    vLLM's fp8 MLA cache computes it in exact arithmetic; the last row scores the token
    after all of ``generated``. Row 0 comes from the prefill (no quantization; with
    ``quantized_prompt`` the prompt's rows attend on the e4m3 query and cache too, as
    our tree backend computes an fp32 model's prefill: every token a decode there).
    ``model``: a ``DeepseekV3ForCausalLM``, cast to fp32 by the caller."""
    tokens = list(prompt) + list(generated)
    if not prompt or not all(isinstance(t, int) for t in tokens):
        raise ValueError("fp8_cache_logits runs one sequence: prompt (non-empty) and "
                         "generated are lists of token ids")
    ids = torch.tensor([tokens], device=model.device)
    exact_rows = 0 if quantized_prompt else len(prompt)
    with _swapped_attention(model, absorbed_mla_forward(exact_rows, kv_scale, q_scale)):
        logits = model(input_ids=ids, use_cache=False).logits[0].float()
    return logits[len(prompt) - 1:]


# An fp32 model on the fp8 cache against fp8_cache_logits(quantized_prompt=True): bars on
# |log-prob difference| over the log-probs a run returned (median, 95th percentile).
# Each e4m3 query code amplifies the run's own fp32 rounding: relative noise of 3e-5,
# 1e-4 and 3e-4 in every row's attention output (the tree kernel's fp32 output is 3e-5 to
# 1e-4 from the exact attention) moves the embedded target's log-probs by a median of
# 6.7e-4, 1.3e-3 and 2.2e-3 (95th percentile 8e-3, 1.2e-2, 2.0e-2); a systematic error
# moves them further: the query left unquantized 1.2e-2 (5.7e-2), the cache left
# unquantized 2.9e-2 (0.17), the prompt prefilled exactly 6.9e-3 (8.8e-2). Four of
# check_mla_backend's prompts, 24 greedy tokens, 3 noise seeds (tests/test_fp8_mla_reference.py
# checks both sides on one prompt).
FP32_LOGPROB_MEDIAN_BAR = 3e-3
FP32_LOGPROB_P95_BAR = 3e-2


def logprob_deviations(model: torch.nn.Module, outputs: Sequence[dict],
                       quantized_prompt: bool = False) -> list[float]:
    """|vLLM's log-prob - the exact fp8 result's| for every log-prob a run returned.

    ``outputs``: dicts with ``prompt`` and ``tokens`` (lists of ids) and ``top_logprobs``
    (per generated token, ``{token id: log-prob}``, keys int or str as JSON gives them);
    each is scored teacher-forced on its own tokens by :func:`fp8_cache_logits`."""
    deviations: list[float] = []
    for output in outputs:
        tokens = list(output["tokens"])
        if len(output["top_logprobs"]) != len(tokens):
            raise ValueError(f"top_logprobs has {len(output['top_logprobs'])} positions "
                             f"for {len(tokens)} tokens")
        reference = fp8_cache_logits(model, list(output["prompt"]), tokens,
                                     quantized_prompt=quantized_prompt)[:-1].log_softmax(-1)
        deviations += deviations_from(reference, output["top_logprobs"])
    return deviations


def deviations_from(reference: torch.Tensor, top_logprobs: Sequence[dict]) -> list[float]:
    """|returned log-prob - ``reference``'s| for each ``{token id: log-prob}`` of
    ``top_logprobs`` (one dict per position); ``reference``: fp32 ``[positions, vocab]``
    log-probs of the same tokens (:func:`logprob_deviations` for one output)."""
    return [abs(float(lp) - reference[j, int(t)].item())
            for j, logprobs in enumerate(top_logprobs) for t, lp in logprobs.items()]


def exact_fp8_arbiter(model: torch.nn.Module, outputs: Sequence[dict],
                      names: tuple[str, str] = ("ours", "the reference")):
    """``compare.mismatch_problems``' arbiter for runs on vLLM's fp8 cache: the exact
    result's logit margin of the first run's token over the reference's where they part
    (``outputs``: the first run's, with ``prompt`` and ``tokens``), printed."""

    def arbiter(i: int, pos: int, got_token: int, want_token: int) -> float:
        output = outputs[i]
        logits = fp8_cache_logits(model, list(output["prompt"]), list(output["tokens"][:pos]))[-1]
        top2 = logits.topk(2)
        margin = (logits[got_token] - logits[want_token]).item()
        print(f"exact fp8 result, output {i} pos {pos}: {names[0]} {got_token} vs "
              f"{names[1]} {want_token}: margin {margin:+.3f} (its top-2 "
              f"{top2.indices.tolist()}, gap {(top2.values[0] - top2.values[1]).item():.3f})",
              flush=True)
        return margin

    return arbiter
