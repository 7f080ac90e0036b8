"""evals/acceptance_by_context.py on the embedded pair at tiny lengths (CPU, fp32)."""

import importlib.util
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _module():
    spec = importlib.util.spec_from_file_location(
        "acceptance_by_context", REPO / "evals" / "acceptance_by_context.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_acceptance_by_context_tables_from_real_decoding(tmp_path):
    """Every cell comes from decoding (rounds > 0, the committed tokens add up to the
    new tokens after the prefill's), DDTree keeps the chain's tokens, and the report names each
    length and method."""
    mod = _module()
    rc = mod.main(["--lengths", "24", "48", "--prompts", "1", "--new-tokens", "6",
                   "--budgets", "8", "--out-dir", str(tmp_path), "--no-progress"])
    assert rc == 0
    result = json.loads((tmp_path / "acceptance_by_context.json").read_text())
    summary = mod.summarize(result)
    assert [(s["length"], s["method"]) for s in summary] == [
        (24, "dflash"), (24, "ddtree"), (48, "dflash"), (48, "ddtree")]
    for row in result["rows"]:  # the first new token comes from the prefill
        assert row["same_as_chain"] and sum(row["committed"]) >= 6 - 1
    for s in summary:
        assert s["rounds"] > 0 and 1.0 <= s["mean_committed"] <= 16.0
    assert list(result["target_loss_by_position"]) == ["0-127"]
    text = (tmp_path / "acceptance_by_context.md").read_text()
    assert "| DFlash chain |" in text and "| DDTree B=8 |" in text and "| 24 | 48 |" in text
    assert (tmp_path / "acceptance_by_context.png").stat().st_size > 0
