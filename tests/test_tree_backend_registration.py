"""Which tree backend fills vLLM's CUSTOM slot (``vllm_ddtree.attention_backends.registration``)."""

import pytest

from vllm_ddtree import settings
from vllm_ddtree.attention_backends.registration import (
    TREE_BACKEND_ENV,
    register_tree_backend,
    tree_backend_kind_from_env,
)
from vllm_ddtree.settings import SettingError


def test_register_switches_the_custom_class(custom_backend_slot):
    from vllm_ddtree.attention_backends.gqa_tree.backend import TreeGQABackend
    from vllm_ddtree.attention_backends.mla_tree.backend import TreeMLABackend

    assert register_tree_backend("gqa") == (
        "vllm_ddtree.attention_backends.gqa_tree.backend.TreeGQABackend")
    assert custom_backend_slot.get_class() is TreeGQABackend
    register_tree_backend("mla")
    assert custom_backend_slot.get_class() is TreeMLABackend
    with pytest.raises(ValueError, match="'flash'"):
        register_tree_backend("flash")


def test_kind_from_env(monkeypatch):
    """Read through vllm_ddtree.settings: unset or empty is ``mla``; anything but the
    two kinds raises a SettingError naming the variable, the value and the choices."""
    monkeypatch.delenv(TREE_BACKEND_ENV, raising=False)
    assert tree_backend_kind_from_env() == "mla"
    monkeypatch.setenv(TREE_BACKEND_ENV, " gqa ")
    assert tree_backend_kind_from_env() == "gqa"
    monkeypatch.setenv(TREE_BACKEND_ENV, "")
    assert tree_backend_kind_from_env() == "mla"
    for bad in ("flashinfer", "GQA"):
        monkeypatch.setenv(TREE_BACKEND_ENV, bad)
        with pytest.raises(SettingError, match=f"{TREE_BACKEND_ENV}='{bad}'.*mla, gqa"):
            tree_backend_kind_from_env()


def test_front_end_setting_reaches_the_reader(monkeypatch):
    """The front end sets the kind with settings.set_for_children; the reader sees it."""
    monkeypatch.setenv(TREE_BACKEND_ENV, "")  # restored after the test
    settings.set_for_children(TREE_BACKEND_ENV, "gqa")
    assert tree_backend_kind_from_env() == "gqa"


def test_mla_backend_asks_vllm_for_64_token_pages():
    """vLLM keeps its default 16-token page for a backend that accepts any size unless the
    backend names another (``Platform.update_block_size_for_backend``)."""
    from vllm.config.cache import CacheConfig

    from vllm_ddtree.attention_backends.mla_tree.backend import TreeMLABackend

    assert CacheConfig.DEFAULT_BLOCK_SIZE != 64  # else the override is moot
    assert TreeMLABackend.get_preferred_block_size(CacheConfig.DEFAULT_BLOCK_SIZE) == 64
    assert TreeMLABackend.supports_block_size(16)  # --block-size 16 stays possible
