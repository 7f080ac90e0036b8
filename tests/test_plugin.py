"""The plugin entry point: discoverable, idempotent, harmless without a GPU."""

from importlib.metadata import entry_points

import pytest

import vllm_ddtree
from vllm_ddtree.patches import VllmVersionError, require_vllm_version


def test_entry_point_is_installed():
    names = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert names.get("ddtree") == "vllm_ddtree:register"


def test_register_is_idempotent_without_gpu():
    import torch

    assert not torch.cuda.is_available()
    vllm_ddtree.register()
    vllm_ddtree.register()
    assert vllm_ddtree._registered


def test_vllm_loads_the_plugin():
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    assert vllm_ddtree._registered


def test_version_guard_refuses_other_vllm():
    require_vllm_version("x", "0.26.0")
    require_vllm_version("x", "0.26.0+cpu")
    with pytest.raises(VllmVersionError, match="vllm==0.26.0"):
        require_vllm_version("DFlashSpeculator.propose", "0.27.1")


def test_mla_tree_backend_registered_as_custom():
    from vllm.model_executor.layers.attention.mla_attention import QueryLenSupport
    from vllm.v1.attention.backend import AttentionCGSupport
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from vllm_ddtree.attention_backends.mla_tree.backend import (
        TreeMLABackend,
        TreeMLAMetadataBuilder,
    )

    vllm_ddtree.register()
    cls = AttentionBackendEnum.CUSTOM.get_class()
    assert cls is TreeMLABackend and cls.is_mla()
    assert TreeMLAMetadataBuilder.query_len_support == QueryLenSupport.VARLEN
    assert TreeMLAMetadataBuilder._cudagraph_support == AttentionCGSupport.UNIFORM_BATCH


def test_causal_bits_match_dense_causal_mask():
    import torch

    from vllm_ddtree.attention_backends.tree_mask_state import causal_bits_
    from vllm_ddtree.tree.draft_tree import pack_ancestor_mask

    qlens = [1, 70, 3, 130, 64]
    qsl = torch.tensor([0] + list(torch.tensor(qlens).cumsum(0)), dtype=torch.int32)
    out = torch.full((400, 3), 7, dtype=torch.int64)
    got = causal_bits_(out, qsl, int(qsl[-1]))
    want = torch.cat([pack_ancestor_mask(torch.ones(n, 192, dtype=torch.bool).tril())
                      for n in qlens])
    assert torch.equal(got, want)
