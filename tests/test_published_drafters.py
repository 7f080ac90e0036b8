"""Published DFlash drafter configs (copies in tests/data/published_drafters): each loads
and pairs with a target of its shape, or is refused naming the unsupported field."""

import json
import shutil
from pathlib import Path
from types import SimpleNamespace as NS

import pytest

from vllm_ddtree.drafter_config import (
    DrafterConfigError,
    block_size_of,
    check_drafter_target_pair,
    dflash2_config_of,
    is_dflash2,
    load_drafter_config,
    read_drafter_config_json,
)

PUBLISHED = Path(__file__).parent / "data" / "published_drafters"
# (config file, the target it was published for: hidden size, vocabulary, layers)
CASES = [
    ("qwen3-4b-dflash-b16.json", NS(hidden_size=2560, vocab_size=151936, num_hidden_layers=36)),
    ("qwen3.5-122b-a10b-dflash.json",
     NS(hidden_size=3072, vocab_size=248320, num_hidden_layers=48)),
]


def drafter_dir(tmp_path: Path, name: str, **changes) -> Path:
    config = json.loads((PUBLISHED / name).read_text())
    config.update(changes)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize("name,target", CASES, ids=[c[0] for c in CASES])
def test_published_configs_load_and_pair_with_their_target(tmp_path, name, target):
    shutil.copy(PUBLISHED / name, tmp_path / "config.json")
    raw = read_drafter_config_json(tmp_path)
    config = load_drafter_config(tmp_path)
    assert block_size_of(raw) == block_size_of(config) == 16  # top level or dflash_config
    check_drafter_target_pair(config, target)
    assert config.dflash_config["target_layer_ids"] == raw["dflash_config"]["target_layer_ids"]


@pytest.mark.parametrize("name,target", CASES, ids=[c[0] for c in CASES])
def test_a_published_drafter_for_another_target_is_refused_by_field(tmp_path, name, target):
    config = load_drafter_config(drafter_dir(tmp_path, name))
    smaller = NS(hidden_size=target.hidden_size, vocab_size=target.vocab_size,
                 num_hidden_layers=30)
    with pytest.raises(DrafterConfigError, match=r"dflash_config\.target_layer_ids=.*0\.\.29"):
        check_drafter_target_pair(config, smaller)
    other_width = NS(hidden_size=4096, vocab_size=target.vocab_size,
                     num_hidden_layers=target.num_hidden_layers)
    with pytest.raises(DrafterConfigError, match="hidden_size=.*4096"):
        check_drafter_target_pair(config, other_width)


# z-lab/Qwen3.8-27B-DFlash2 (Hugging Face, 2026), the fields its config.json publishes;
# its target Qwen3.8-27B: hidden 5120, vocabulary 248320, 64 layers.
DFLASH2 = "qwen3.8-27b-dflash2.json"
DFLASH2_TARGET = NS(hidden_size=5120, vocab_size=248320, num_hidden_layers=64)


def test_published_dflash2_config_loads_and_pairs_with_its_target(tmp_path):
    shutil.copy(PUBLISHED / DFLASH2, tmp_path / "config.json")
    raw = read_drafter_config_json(tmp_path)
    config = load_drafter_config(tmp_path)
    assert block_size_of(raw) == block_size_of(config) == 8  # dflash_config.block_size
    check_drafter_target_pair(config, DFLASH2_TARGET)
    assert is_dflash2(config) and is_dflash2(raw)
    draft = dflash2_config_of(config)
    assert (draft["conv_kernel_size"], draft["conv_group_size"], draft["selector_rank"],
            draft["selector_top_k"]) == (2, 16, 256, 16)
    with pytest.raises(DrafterConfigError, match="hidden_size=.*4096"):
        check_drafter_target_pair(config, NS(hidden_size=4096, vocab_size=248320,
                                             num_hidden_layers=64))


def test_unsupported_published_fields_are_named(tmp_path):
    # A DFlash config relabelled DFlash2 lacks the convolution and selector keys.
    dflash2 = drafter_dir(tmp_path, "qwen3.5-122b-a10b-dflash.json",
                          architectures=["DFlash2DraftModel"])
    with pytest.raises(DrafterConfigError, match=r"dflash_config\.conv_kernel_size=None"):
        read_drafter_config_json(dflash2)
    other = drafter_dir(tmp_path, "qwen3.5-122b-a10b-dflash.json",
                        architectures=["EagleDraftModel"])
    with pytest.raises(DrafterConfigError, match="architectures=.*DFlash2DraftModel"):
        read_drafter_config_json(other)
    both = drafter_dir(tmp_path, "qwen3.5-122b-a10b-dflash.json", block_size=8)
    with pytest.raises(DrafterConfigError, match=r"dflash_config\.block_size=16 .*block_size=8"):
        read_drafter_config_json(both)


def test_vllm_front_end_takes_a_dflash2_drafter_with_a_budget_its_tree_holds(tmp_path):
    """A DFlash2 tree ranks as many candidates a position as a node may have children
    (``tree_candidates``: B or ddtree_top_k, at least the checkpoint's selector_top_k), so
    its budget is bounded as a DFlash drafter's: by ddtree_top_k, not selector_top_k."""
    from vllm_ddtree.config import DDTreeConfig, DDTreeConfigError, check_drafter_for_target
    from vllm_ddtree.tree.selector_tree import tree_candidates

    shutil.copy(PUBLISHED / DFLASH2, tmp_path / "config.json")
    config = check_drafter_for_target(str(tmp_path), DFLASH2_TARGET, DDTreeConfig(budget=64))
    assert is_dflash2(config)
    # Depth 7, at most 2 children a node: 2 + 4 + ... + 128 = 254 nodes.
    check_drafter_for_target(str(tmp_path), DFLASH2_TARGET, DDTreeConfig(budget=254, top_k=2))
    with pytest.raises(DDTreeConfigError, match=r"num_speculative_tokens=255 .*1\.\.254"):
        check_drafter_for_target(str(tmp_path), DFLASH2_TARGET,
                                 DDTreeConfig(budget=255, top_k=2))
    narrow = json.loads((PUBLISHED / DFLASH2).read_text())
    narrow["dflash_config"]["selector_top_k"] = 2
    (tmp_path / "config.json").write_text(json.dumps(narrow))
    # a checkpoint that walks 2 candidates still drafts trees of 255 nodes: its tree ranks
    # 255 candidates a position, more than 2 children a node
    check_drafter_for_target(str(tmp_path), DFLASH2_TARGET, DDTreeConfig(budget=255))
    assert tree_candidates(2, 255, None, DFLASH2_TARGET.vocab_size) == 255
    with pytest.raises(DDTreeConfigError, match=r"=255 .*1\.\.254.*ddtree_top_k=2"):
        check_drafter_for_target(str(tmp_path), DFLASH2_TARGET,
                                 DDTreeConfig(budget=255, top_k=2))


def test_a_dflash2_drafter_under_another_method_is_refused(tmp_path):
    """The plugin registers DFlash2DraftModel for DDTree; vLLM's own dflash method would
    load it too and ignore its selector: refused, naming the method and the fix."""
    from vllm_ddtree.drafter_config import refuse_dflash2_outside_ddtree

    shutil.copy(PUBLISHED / DFLASH2, tmp_path / "config.json")
    with pytest.raises(DrafterConfigError) as err:
        refuse_dflash2_outside_ddtree({"method": "dflash", "model": str(tmp_path)})
    assert str(err.value).startswith("speculative config: method='dflash' is not allowed "
                                     "with a DFlash2 drafter")
    assert "use method 'ddtree'" in str(err.value)
    refuse_dflash2_outside_ddtree({"method": "ddtree", "model": str(tmp_path)})
    (tmp_path / "dflash").mkdir()
    dflash = drafter_dir(tmp_path / "dflash", CASES[0][0])
    refuse_dflash2_outside_ddtree({"method": "dflash", "model": str(dflash)})
    refuse_dflash2_outside_ddtree({"method": "ngram"})  # no drafter: vLLM's business


def test_the_front_end_refuses_dflash2_under_vllms_dflash_method(tmp_path):
    from vllm.engine.arg_utils import EngineArgs

    from vllm_ddtree import patches

    patches.apply_all()
    shutil.copy(PUBLISHED / DFLASH2, tmp_path / "config.json")
    args = EngineArgs(model="unused", speculative_config={
        "method": "dflash", "model": str(tmp_path), "num_speculative_tokens": 7})
    with pytest.raises(DrafterConfigError, match="method='dflash' is not allowed"):
        args.create_speculative_config(NS(), NS(data_parallel_size=1))
