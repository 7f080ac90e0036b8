"""vLLM 0.26's KV-cache grouping of an MLA target beside a DFlash drafter
(evals/kv_cache_groups.py): one group per layer with the hybrid manager, one group for
all with it disabled. Guards the assumption behind the per-group host costs that
``evals/results/kv_cache_groups.md`` reports."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "evals"))
import kv_cache_groups  # noqa: E402


def test_every_layer_gets_a_group_unless_the_hybrid_manager_is_off(tmp_path):
    for shape in kv_cache_groups.shapes():
        layers = shape.target_layers + shape.sliding_layers + shape.full_layers
        hybrid = kv_cache_groups.kv_cache_groups(shape, hybrid=True)
        assert len(hybrid) == layers and all(n == 1 for _, n in hybrid), shape.name
        assert kv_cache_groups.kv_cache_groups(shape, hybrid=False) == [
            ("UniformTypeKVCacheSpecs", layers)], shape.name
    out = tmp_path / "groups.md"
    assert kv_cache_groups.main(["--out", str(out), "--batches", "2", "--steps", "3"]) == 0
    text = out.read_text()
    assert "| Kimi-K2 + Kimi-K2.6-shaped drafter | 61 + 5 + 1 | 67:" in text
    assert "| Kimi-K2 + Kimi-K2.6-shaped drafter | 64 drafts a step, hybrid manager (67 " \
        "groups) |" in text


def test_scheduler_steps_time_real_decode_steps():
    """The scheduler's host time is taken over steps that decode every request with
    the drafts asked for (scheduler_steps checks each timed step); too few warm-up
    steps leave prefills among them, which it refuses to time."""
    import pytest
    from scheduler_steps import scheduler_step_ms

    shape = kv_cache_groups.shapes()[0]
    for hybrid in (True, False):
        groups = kv_cache_groups.vllm_groups(shape, hybrid, sliding_page=16, align=not hybrid)
        for drafts in (0, 4):
            assert scheduler_step_ms(groups, drafts, 3, steps=4, warmup=3) > 0
    with pytest.raises(RuntimeError, match="timed step scheduled"):
        scheduler_step_ms(groups, 4, 3, steps=4, warmup=0)


def test_one_group_needs_the_sliding_block_size_aligned():
    """With the hybrid manager off, vLLM 0.26 keeps each sliding layer's own block size
    (FlashAttention: 16) when it makes the layer a full-attention one: beside 64-token
    MLA pages it refuses to start (seen on the H200 with DDTree, kimi8).
    ``vllm_ddtree.patches.unify_kv_block_size`` gives the sliding layers the full layers' 64 first:
    one group, windows kept on the specs."""
    import pytest

    shape = kv_cache_groups.shapes()[1]  # kimi8: 4 MLA + 5 sliding + 1 full
    layers = shape.target_layers + shape.sliding_layers + shape.full_layers
    with pytest.raises(ValueError, match="failed to convert the KV cache specs"):
        kv_cache_groups.kv_cache_groups(shape, hybrid=False, sliding_page=16)
    assert kv_cache_groups.kv_cache_groups(shape, hybrid=False, sliding_page=16, align=True) == [
        ("UniformTypeKVCacheSpecs", layers)]
    # hybrid manager on: the alignment is never called, vLLM's grouping is unchanged
    assert len(kv_cache_groups.kv_cache_groups(shape, hybrid=True, sliding_page=16)) == layers


def test_sliding_block_alignment_rules():
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec

    from vllm_ddtree.patches.unify_kv_block_size import align_sliding_block_sizes

    def specs(full_blocks, sliding_block):
        out = {f"t{i}": MLAAttentionSpec(block_size=b, num_kv_heads=1, head_size=576,
                                         dtype=torch.bfloat16)
               for i, b in enumerate(full_blocks)}
        out["d0"] = SlidingWindowSpec(block_size=sliding_block, num_kv_heads=2, head_size=64,
                                      dtype=torch.bfloat16, sliding_window=256)
        out["d1"] = FullAttentionSpec(block_size=full_blocks[0], num_kv_heads=2, head_size=64,
                                      dtype=torch.bfloat16)
        return out

    aligned = specs([64, 64], 16)
    assert align_sliding_block_sizes(aligned) == ["d0"]
    assert aligned["d0"].block_size == 64 and aligned["d0"].sliding_window == 256
    assert isinstance(aligned["d0"], SlidingWindowSpec)
    for full_blocks, sliding_block in (([64, 64], 48), ([64, 32], 16), ([64, 64], 64)):
        same = specs(full_blocks, sliding_block)
        assert align_sliding_block_sizes(same) == [], (full_blocks, sliding_block)
        assert same["d0"].block_size == sliding_block


def test_unify_patch_applies_and_forms_one_group():
    from types import SimpleNamespace

    from vllm.v1.core import kv_cache_utils

    from vllm_ddtree.patches import unify_kv_block_size

    unify_kv_block_size.apply()
    unify_kv_block_size.apply()  # idempotent
    patched = kv_cache_utils.unify_hybrid_kv_cache_specs
    assert patched._ddtree_patched and not getattr(patched._ddtree_original,
                                                   "_ddtree_patched", False)
    import torch
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, SlidingWindowSpec

    layer_specs = {"t0": MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=576,
                                          dtype=torch.bfloat16),
                   "d0": SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=64,
                                           dtype=torch.bfloat16, sliding_window=256)}
    config = SimpleNamespace(scheduler_config=SimpleNamespace(
        disable_hybrid_kv_cache_manager=True))
    groups = kv_cache_utils.get_kv_cache_groups(config, layer_specs)
    assert [sorted(g.layer_names) for g in groups] == [["d0", "t0"]]
    assert {s.block_size for s in groups[0].kv_cache_spec.kv_cache_specs.values()} == {64}


def test_kv_bytes_and_hit_granularity_of_each_grouping():
    """The figures the README's known limits quote, from vLLM's own grouping: beside a
    K2.6-shaped drafter the hybrid manager pads Kimi-K2's MLA pages to the drafter's
    page (3.41x the bytes its layers need; 1.28x in one group), and stretches the embedded
    drafter's 16-token sliding blocks to 144 tokens, so prefix-cache hits come every
    lcm(64, 144) = 576 tokens (64 in one group)."""
    embedded, _, kimi_k2 = kv_cache_groups.shapes()
    assert kv_cache_groups.unpadded_bytes_per_token(kimi_k2) == 61 * 1152 + 2 * 8 * 128 * 2
    assert kv_cache_groups.kv_layout(kimi_k2, hybrid=True) == (62 * 4096, 64)
    assert kv_cache_groups.kv_layout(kimi_k2, hybrid=False) == (61 * 1152 + 6 * 4096, 64)
    assert kv_cache_groups.kv_layout(embedded, hybrid=True) == (5 * 1152, 576)
    assert kv_cache_groups.kv_layout(embedded, hybrid=False) == (4 * 1152 + 3 * 512, 64)
