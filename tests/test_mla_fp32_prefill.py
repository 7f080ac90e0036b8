# SPDX-License-Identifier: Apache-2.0
"""fp32 MLA on the tree backend (exactness checks): vLLM's MLA prefill backends are
bf16 / fp16 only, so the tree backend takes every query as a decode and
``vllm_ddtree.patches.mla_fp32_prefill`` gives the layer a prefill stand-in that refuses to run.
CPU: the patch's decisions and the builder's decode limit; the fp32 engine itself
runs on the GPU only (``scripts/gpu_suites.sh lmeval32``)."""

from types import SimpleNamespace as NS

import pytest
import torch

from vllm_ddtree.attention_backends.mla_tree.backend import TreeMLABackend
from vllm_ddtree.attention_backends.registration import TREE_BACKEND_ENV
from vllm_ddtree.attention_backends.tree_mask_state import decode_query_limit
from vllm_ddtree.patches import mla_fp32_prefill


def config(dtype, backend="CUSTOM", tokens=16384):
    return NS(model_config=NS(dtype=dtype), attention_config=NS(backend=NS(name=backend)),
              scheduler_config=NS(max_num_batched_tokens=tokens))


def test_the_tree_backend_takes_fp32_and_every_query_as_a_decode():
    assert torch.float32 in TreeMLABackend.supported_dtypes
    assert decode_query_limit(config(torch.float32), 65) == 16384
    assert decode_query_limit(config(torch.bfloat16), 65) == 65
    assert decode_query_limit(config(torch.float16, tokens=8), 65) == 65


def test_only_fp32_on_the_mla_tree_backend_gets_the_stand_in(monkeypatch):
    monkeypatch.setenv(TREE_BACKEND_ENV, "mla")
    assert mla_fp32_prefill.uses_fp32_tree_mla(config(torch.float32))
    assert not mla_fp32_prefill.uses_fp32_tree_mla(config(torch.bfloat16))
    assert not mla_fp32_prefill.uses_fp32_tree_mla(config(torch.float32, "TRITON_MLA"))
    assert not mla_fp32_prefill.uses_fp32_tree_mla(NS(model_config=None))
    monkeypatch.setenv(TREE_BACKEND_ENV, "gqa")
    assert not mla_fp32_prefill.uses_fp32_tree_mla(config(torch.float32))


def test_patched_selector_defers_to_vllm_and_falls_back_only_for_fp32_tree(monkeypatch):
    from vllm.model_executor.layers.attention import mla_attention

    monkeypatch.setenv(TREE_BACKEND_ENV, "mla")
    calls = []

    def vllm_selector(vllm_config):
        calls.append(vllm_config)
        if vllm_config.model_config.dtype == torch.float32:
            raise ValueError("No valid MLA prefill backend found")
        return "FLASH_ATTN_PREFILL"

    monkeypatch.setattr(mla_attention, "get_mla_prefill_backend", vllm_selector)
    mla_fp32_prefill.apply()
    mla_fp32_prefill.apply()  # idempotent
    patched = mla_attention.get_mla_prefill_backend
    assert patched._ddtree_patched and patched._ddtree_original is vllm_selector
    assert patched(config(torch.bfloat16)) == "FLASH_ATTN_PREFILL"
    assert patched(config(torch.float32)) is mla_fp32_prefill.NoMLAPrefillBackend
    with pytest.raises(ValueError, match="No valid MLA prefill"):
        patched(config(torch.float32, "TRITON_MLA"))
    assert len(calls) == 3


def test_the_stand_in_builds_and_refuses_to_run():
    backend = mla_fp32_prefill.NoMLAPrefillBackend(num_heads=4, scale=0.1)
    clone = backend.clone()
    assert clone is not backend and clone.kwargs == backend.kwargs
    assert not backend.supports_quant_output(None)
    for call in (lambda: backend.prepare_metadata(None),
                 lambda: backend.run_prefill_new_tokens(),
                 lambda: backend.run_prefill_context_chunk()):
        with pytest.raises(RuntimeError, match="reorder_batch_threshold"):
            call()
