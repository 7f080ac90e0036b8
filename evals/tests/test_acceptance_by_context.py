"""evals/acceptance_by_context.py on the embedded pair at tiny lengths (CPU, fp32)."""

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


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
    # the same pair against itself passes the gate (deterministic fp32 decoding)
    again = tmp_path / "again"
    rc = mod.main(["--lengths", "24", "48", "--prompts", "1", "--new-tokens", "6",
                   "--budgets", "8", "--out-dir", str(again), "--no-progress",
                   "--compare-to", str(tmp_path / "acceptance_by_context.json")])
    assert rc == 0 and "gate: PASSED" in (again / "acceptance_by_context.md").read_text()


def _result(means: dict) -> dict:
    """A measure() result whose cells have the given mean committed tokens per round:
    ``{(length, method, budget): mean}`` with two rounds per cell."""
    rows = [{"length": n, "prompt": 0, "method": m, "budget": b,
             "committed": [mean, mean], "same_as_chain": True}
            for (n, m, b), mean in means.items()]
    return {"rows": rows}


def test_shipping_gate_short_floor_and_long_gain():
    mod = _module()
    reference = _result({(384, "dflash", 0): 3.0, (384, "ddtree", 64): 4.0,
                         (1024, "dflash", 0): 1.3, (1024, "ddtree", 64): 2.0})
    good_means = {(384, "dflash", 0): 2.9, (384, "ddtree", 64): 4.4,
                  (1024, "dflash", 0): 1.6, (1024, "ddtree", 64): 2.5}
    gate = mod.compare_to_reference(_result(good_means), reference)
    assert gate["passed"] and len(gate["cells"]) == 4
    chain_384 = next(c for c in gate["cells"] if c["length"] == 384 and "chain" in c["method"])
    assert abs(chain_384["ratio"] - 2.9 / 3.0) < 1e-9 and chain_384["bound"] == 0.95
    # below the floor at a short length, or not clearly above at a long one: fails
    for bad_key, value in (((384, "ddtree", 64), 3.7), ((1024, "dflash", 0), 1.5)):
        gate = mod.compare_to_reference(_result({**good_means, bad_key: value}), reference)
        assert not gate["passed"]
        assert [c["ok"] for c in gate["cells"]].count(False) == 1
        text = mod.gate_markdown(gate, "ref")
        assert "gate: FAILED" in text and "**no**" in text
    with pytest.raises(ValueError, match="same --lengths"):
        mod.compare_to_reference(_result({(128, "dflash", 0): 2.0}), reference)
