"""Incremental key/value expansion for transformers' DeepSeek-V3 attention in greedy
decoding (training data generation only; never applied inside vLLM).

Replaces ``transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3Attention.
expand_kv`` on the given model's attention *instances*, for the duration of a ``with``
block. transformers 5.17 caches the compressed latent and re-expands the whole context
through ``kv_b_proj`` at every decoding step: an ``[B * ctx, kv_lora_rank] x
[kv_lora_rank, H * (dk + dv)]`` matmul per layer per token. At batch 256 and 1.6k
tokens of context that made a decoding step 42 ms on an H200, so a timed
greedy pool held 1.8k sequences instead of 12k. Inside the block each layer keeps the
expanded keys/values of the positions it has seen and expands only the new ones.

Scope: one ``with`` block = one generation (one cache). The first call expands
everything; later calls must extend the same sequences (same batch, longer context),
otherwise the memo starts over.
"""

from __future__ import annotations

import contextlib

import torch

SUPPORTED_TRANSFORMERS_VERSION = "5.17.0"
PATCHED_FUNCTION = "transformers DeepseekV3Attention.expand_kv"


def require_transformers_version(version: str | None = None) -> None:
    """Raise ``RuntimeError`` unless transformers ``SUPPORTED_TRANSFORMERS_VERSION`` is
    installed (the memo relies on its latent cache layout and ``expand_kv``)."""
    if version is None:
        import transformers

        version = transformers.__version__
    if version.split("+")[0] != SUPPORTED_TRANSFORMERS_VERSION:
        raise RuntimeError(
            f"vllm-ddtree patch {PATCHED_FUNCTION!r} targets transformers "
            f"{SUPPORTED_TRANSFORMERS_VERSION} but {version} is installed: install "
            f"transformers=={SUPPORTED_TRANSFORMERS_VERSION} (pyproject.toml pins it)")


class _ExpandedKVMemo:
    """Stand-in for one attention module's ``expand_kv``: keys ``[B, H, cap, dk]`` and
    values ``[B, H, cap, dv]`` (model dtype) of the positions expanded so far, grown by
    doubling; returns views of the first ``L`` positions."""

    def __init__(self, attn: torch.nn.Module):
        self.attn = attn
        self.expand = type(attn).expand_kv  # the class's own (unpatched) function
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.length = 0

    def _store(self, keys: torch.Tensor, values: torch.Tensor, start: int) -> None:
        end = start + keys.shape[2]
        if self.keys is None or end > self.keys.shape[2]:
            cap = max(end, 2 * (self.keys.shape[2] if self.keys is not None else 0), 64)
            new_k = keys.new_empty(*keys.shape[:2], cap, keys.shape[3])
            new_v = values.new_empty(*values.shape[:2], cap, values.shape[3])
            if start:
                new_k[:, :, :start].copy_(self.keys[:, :, :start])
                new_v[:, :, :start].copy_(self.values[:, :, :start])
            self.keys, self.values = new_k, new_v
        self.keys[:, :, start:end].copy_(keys)
        self.values[:, :, start:end].copy_(values)
        self.length = end

    def __call__(self, kv_nope: torch.Tensor, k_rot: torch.Tensor):
        """``kv_nope [B, 1, L, kv_lora_rank]``, ``k_rot [B, 1, L, rope_dim]`` (the whole
        cached context) -> keys ``[B, H, L, dk]``, values ``[B, H, L, dv]``."""
        batch, _, length, _ = kv_nope.shape
        extends = (self.keys is not None and self.keys.shape[0] == batch
                   and self.length < length)
        start = self.length if extends else 0
        keys, values = self.expand(self.attn, kv_nope[:, :, start:], k_rot[:, :, start:])
        self._store(keys, values, start)
        return self.keys[:, :, :length], self.values[:, :, :length]


@contextlib.contextmanager
def incremental_expand_kv(model: torch.nn.Module):
    """Within the block, every DeepSeek-V3 attention module of ``model`` expands only the
    positions it has not expanded yet (see the module docstring). A model without such
    modules (e.g. Qwen3) is left as it is. Restores the class method on exit."""
    attns = [m for m in model.modules() if hasattr(type(m), "expand_kv")]
    if attns:
        require_transformers_version()
    for attn in attns:
        attn.expand_kv = _ExpandedKVMemo(attn)  # the instance attribute shadows the method
    try:
        yield
    finally:
        for attn in attns:
            del attn.expand_kv
