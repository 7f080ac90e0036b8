"""vllm_ddtree.settings: every switch declared once, one parser, the README table from it,
and no undeclared ``VLLM_DDTREE_*`` variable read anywhere in product code."""

import re
import subprocess
from pathlib import Path

import pytest

from vllm_ddtree import settings

REPO = Path(__file__).resolve().parents[1]
PRODUCT = ("vllm_ddtree", "attention_backends", "patches")


def test_defaults_choices_and_errors_name_variable_value_and_choices(monkeypatch):
    for switch in settings.SWITCHES:
        assert switch.default in switch.choices
        monkeypatch.delenv(switch.name, raising=False)
        assert settings.get(switch.name) == switch.default
        monkeypatch.setenv(switch.name, "")
        assert settings.get(switch.name) == switch.default
        for choice in switch.choices:
            monkeypatch.setenv(switch.name, f" {choice} ")
            assert settings.get(switch.name) == choice
        monkeypatch.setenv(switch.name, "bogus")
        with pytest.raises(settings.SettingError) as err:
            settings.get(switch.name)
        message = str(err.value)
        assert switch.name in message and "'bogus'" in message
        assert all(choice in message for choice in switch.choices)
    with pytest.raises(KeyError, match="VLLM_DDTREE_NOPE is not a declared"):
        settings.get("VLLM_DDTREE_NOPE")


def test_set_for_children_checks_the_value(monkeypatch):
    monkeypatch.delenv("VLLM_DDTREE_RUNNER", raising=False)
    settings.set_for_children("VLLM_DDTREE_RUNNER", "1")
    assert settings.get("VLLM_DDTREE_RUNNER") == "1"
    with pytest.raises(settings.SettingError, match="VLLM_DDTREE_RUNNER"):
        settings.set_for_children("VLLM_DDTREE_RUNNER", "yes")


def test_readme_switch_table_is_generated_from_settings():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    found = re.search(r"<!-- switches:begin -->\n(.*?)\n<!-- switches:end -->", readme, re.S)
    assert found, "README.md lacks the <!-- switches:begin/end --> block"
    assert found.group(1).strip() == settings.markdown_table(), (
        "README switch table drifted: paste `python -m vllm_ddtree.settings` between the markers")


def test_product_code_reads_only_declared_switches():
    files = subprocess.run(["git", "ls-files", *PRODUCT], cwd=REPO, capture_output=True,
                           text=True, check=True).stdout.split()
    used = set()
    for name in files:
        if name.endswith(".py"):
            used |= set(re.findall(r"VLLM_DDTREE_[A-Z0-9_]+",
                                   (REPO / name).read_text(encoding="utf-8")))
    declared = {switch.name for switch in settings.SWITCHES}
    assert used <= declared, f"undeclared switches in product code: {sorted(used - declared)}"
    assert len(declared) <= 8
