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


def test_unsupported_published_fields_are_named(tmp_path):
    dflash2 = drafter_dir(tmp_path, "qwen3.5-122b-a10b-dflash.json",
                          architectures=["DFlash2DraftModel"])
    with pytest.raises(DrafterConfigError, match="architectures=.*DFlash2DraftModel"):
        read_drafter_config_json(dflash2)
    both = drafter_dir(tmp_path, "qwen3.5-122b-a10b-dflash.json", block_size=8)
    with pytest.raises(DrafterConfigError, match=r"dflash_config\.block_size=16 .*block_size=8"):
        read_drafter_config_json(both)
