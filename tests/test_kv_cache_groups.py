"""vLLM 0.26's KV-cache grouping of an MLA target beside a DFlash drafter
(evals/kv_cache_groups.py): one group per layer with the hybrid manager, one group for
all with it disabled. Guards the assumption behind the per-group host costs that
``evals/results/kv_cache_groups.md`` reports."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "evals"))
import kv_cache_groups  # noqa: E402


def test_every_layer_gets_a_group_unless_the_hybrid_manager_is_off(tmp_path):
    for shape in kv_cache_groups.shapes():
        layers = shape.target_layers + shape.sliding_layers + shape.full_layers
        hybrid = kv_cache_groups.kv_cache_groups(shape, hybrid=True)
        assert len(hybrid) == layers and all(n == 1 for _, n in hybrid), shape.name
        assert kv_cache_groups.kv_cache_groups(shape, hybrid=False) == [
            ("UniformTypeKVCacheSpecs", layers)], shape.name
    out = tmp_path / "groups.md"
    assert kv_cache_groups.main(["--out", str(out)]) == 0
    assert "| Kimi-K2 + Kimi-K2.6-shaped drafter | 61 + 5 + 1 | 67:" in out.read_text()
