"""The plugin entry point: discoverable, idempotent, harmless without a GPU."""

from importlib.metadata import entry_points

import pytest

import vllm_ddtree
from patches import VllmVersionError, require_vllm_version


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
