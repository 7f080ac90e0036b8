"""DDTree's default KV-cache grouping (vllm_ddtree/kv_group_choice.py over
vllm_ddtree/kv_grouping.py): one group where the user did not choose, the target has no
windows of its own and one group costs at most 1.10x the hybrid manager's KV bytes per
context token; from the pairs' configs (no weights) and through the front end that
builds the engine config."""

from types import SimpleNamespace as NS

import pytest
import torch
from transformers import AutoConfig, DeepseekV3Config, MistralConfig, Qwen3Config

from vllm_ddtree.demo.reference_engine import CHECKPOINTS
from vllm_ddtree.kv_group_choice import (
    ONE_GROUP_MAX_KV_RATIO,
    choose_by_kv_bytes,
    logger,
    prefer_one_kv_cache_group,
    user_or_target_choice,
)
from vllm_ddtree.kv_grouping import (
    kv_bytes_per_token,
    pair_kv_shape,
    target_has_own_windows,
    vllm_kv_cache_groups,
)

MLA_PAGE_TOKEN = 576 * 2  # one MLA layer's bf16 latent per token
KIMI_DRAFTER_PAGE = 64 * 2 * 8 * 128 * 2  # a 64-token page of a K2.6-shaped drafter layer


def _embedded():
    return (AutoConfig.from_pretrained(CHECKPOINTS / "target"),
            AutoConfig.from_pretrained(CHECKPOINTS / "drafter"))


def _kimi(target_layers: int):
    """A Kimi-K2-shaped MLA target (``evals/e2e_models.py``: 4 layers in the kimi8 /
    kimi64 setups, 61 in Kimi-K2) and a K2.6-shaped DFlash drafter: 5 sliding layers of
    window 4096 and a full one, 8 KV heads of 128."""
    target = DeepseekV3Config(hidden_size=7168, num_hidden_layers=target_layers,
                              num_attention_heads=64, kv_lora_rank=512, qk_rope_head_dim=64)
    drafter = Qwen3Config(hidden_size=7168, num_hidden_layers=6, num_attention_heads=64,
                          num_key_value_heads=8, head_dim=128, use_sliding_window=True,
                          sliding_window=4096, max_window_layers=6,
                          layer_types=["sliding_attention"] * 5 + ["full_attention"])
    return target, drafter


# (target, drafter), hybrid and one-group bytes per context token from the pages vLLM
# gives each layer, and DDTree's choice (True: one group; None: vLLM's default kept)
PAIRS = {
    # drafter pages (2 KV heads of 64) stretched to the MLA page: 4 MLA + 1 full layer;
    # one group: 4 MLA + 3 drafter layers of 512 B
    "embedded": (_embedded, 5 * MLA_PAGE_TOKEN, 4 * MLA_PAGE_TOKEN + 3 * 512, True),
    # MLA pages padded to the drafter's 64-token page: 4 MLA + 1 full drafter layer
    "kimi8": (lambda: _kimi(4), 5 * KIMI_DRAFTER_PAGE // 64,
              4 * MLA_PAGE_TOKEN + 6 * KIMI_DRAFTER_PAGE // 64, None),
    "kimi_k2": (lambda: _kimi(61), 62 * KIMI_DRAFTER_PAGE // 64,
                61 * MLA_PAGE_TOKEN + 6 * KIMI_DRAFTER_PAGE // 64, True),
}


@pytest.mark.parametrize("pair", PAIRS)
def test_each_pair_decides_by_the_kv_bytes_of_its_pages(pair):
    configs, hybrid_bytes, one_bytes, one_group = PAIRS[pair]
    shape = pair_kv_shape(*configs())
    assert kv_bytes_per_token(shape, hybrid=True) == hybrid_bytes
    assert kv_bytes_per_token(shape, hybrid=False) == one_bytes
    groups = len(vllm_kv_cache_groups(shape, hybrid=True, sliding_page=16))
    assert groups == shape.target_layers + shape.sliding_layers + shape.full_layers
    assert len(vllm_kv_cache_groups(shape, hybrid=False, sliding_page=16)) == 1
    choice = choose_by_kv_bytes(shape, page=64)
    assert choice.disable_hybrid_kv_cache_manager is one_group
    assert (one_bytes / hybrid_bytes <= ONE_GROUP_MAX_KV_RATIO) is (one_group is True)
    ratio = f"{one_bytes / hybrid_bytes:.2f}x"
    assert f"{one_bytes:,}" in choice.note and f"{hybrid_bytes:,}" in choice.note
    assert ratio in choice.note and f"{groups} groups" in choice.note
    assert ("one KV-cache group" if one_group else "hybrid KV-cache manager kept") in choice.note


def test_hybrid_groups_of_fewer_layers_still_take_full_blocks():
    """A GQA target beside the same drafter (evals/tiny_pairs.py's qwen3 pair): pages of
    one size, so the hybrid manager groups 4 target + 1 drafter full layers in groups of
    2 (the sliding layers' count) and a block of the 1-layer group still spans 2 pages:
    3 groups x 2 x 512 B against 7 x 512 B in one group (1.17x: hybrid kept)."""
    target = Qwen3Config(hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=64)
    drafter = Qwen3Config(hidden_size=256, num_hidden_layers=3, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=64, use_sliding_window=True,
                          sliding_window=64,
                          layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    shape = pair_kv_shape(target, drafter)
    layer_page = 2 * 2 * 64 * 2  # K and V of 2 heads of 64, bf16, per token
    assert [len(g.layer_names) for g in vllm_kv_cache_groups(shape, True, 16)] == [2, 2, 1, 2]
    assert kv_bytes_per_token(shape, hybrid=True, page=16) == 3 * 2 * layer_page
    assert kv_bytes_per_token(shape, hybrid=False, page=16) == 7 * layer_page
    choice = choose_by_kv_bytes(shape, page=16)
    assert choice.disable_hybrid_kv_cache_manager is None and "(1.17x > 1.10x)" in choice.note


def test_the_pair_shape_follows_tensor_parallelism_and_the_cache_dtype():
    """KV heads split over the ranks as vLLM does (MLA keeps its one latent); an fp8
    cache halves every page, so the choice stays."""
    target, drafter = _kimi(61)
    shape = pair_kv_shape(target, drafter, tensor_parallel_size=8)
    assert (shape.target_kv_heads, shape.drafter_kv_heads) == (1, 1)
    assert (shape.sliding_layers, shape.full_layers, shape.window) == (5, 1, 4096)
    # a drafter page of 64 x 2 x 128 x 2 B = 32,768 B is below an MLA page (73,728 B):
    # the hybrid manager pads the drafter's 6 layers' pages instead
    assert kv_bytes_per_token(shape, hybrid=True) == 62 * MLA_PAGE_TOKEN
    fp8 = pair_kv_shape(target, drafter, dtype=torch.uint8)
    bf16 = pair_kv_shape(target, drafter)
    for hybrid in (True, False):
        assert 2 * kv_bytes_per_token(fp8, hybrid) == kv_bytes_per_token(bf16, hybrid)
    gqa = pair_kv_shape(Qwen3Config(num_hidden_layers=3, num_attention_heads=8,
                                    num_key_value_heads=4, head_dim=32), drafter,
                        tensor_parallel_size=2)
    assert (gqa.target_mla, gqa.target_kv_heads, gqa.target_head_size) == (False, 2, 32)


def test_targets_with_windows_or_state_of_their_own_are_named():
    target, _ = _embedded()
    assert target_has_own_windows(target) is None
    assert target_has_own_windows(_kimi(61)[0]) is None
    mistral = MistralConfig(num_hidden_layers=4, sliding_window=4096)
    assert target_has_own_windows(mistral) == "sliding_window=4096 on every layer"
    assert target_has_own_windows(MistralConfig(sliding_window=None)) is None
    # Qwen3Config drops the window without use_sliding_window (so does vLLM)
    assert target_has_own_windows(Qwen3Config(sliding_window=4096)) is None
    interleaved = Qwen3Config(num_hidden_layers=4, use_sliding_window=True, sliding_window=512,
                              layer_types=["sliding_attention", "full_attention"] * 2)
    assert target_has_own_windows(interleaved) == "sliding_window=512 on 2 sliding_attention layers"
    linear = Qwen3Config(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
    assert target_has_own_windows(linear) == "layer_types ['linear_attention']"
    assert "hybrid" in target_has_own_windows(target, is_hybrid=True)
    chunked = NS(attention_chunk_size=8192, sliding_window=None)
    assert "attention_chunk_size=8192" in target_has_own_windows(chunked)


def test_the_user_choice_and_the_targets_own_windows_come_first():
    for chosen, flag in ((True, "--disable-hybrid-kv-cache-manager"),
                         (False, "--no-disable-hybrid-kv-cache-manager")):
        choice = user_or_target_choice(chosen, "sliding_window=4096 on every layer")
        assert choice.disable_hybrid_kv_cache_manager is None and flag in choice.note
    choice = user_or_target_choice(None, "sliding_window=4096 on every layer")
    assert choice.disable_hybrid_kv_cache_manager is None
    assert "its own sliding_window=4096 on every layer" in choice.note
    assert user_or_target_choice(None, None) is None


def _target_model_config(hf_config, use_mla):
    return NS(hf_text_config=hf_config, is_hybrid=False, use_mla=use_mla, dtype=torch.bfloat16)


def test_prefer_one_group_sets_only_an_unset_choice(caplog):
    """On the embedded pair an unset choice becomes one group; the user's True / False
    stay; a Mistral-style target (its own sliding window) keeps vLLM's default."""
    target, drafter = _embedded()
    mla = _target_model_config(target, use_mla=True)
    tp1 = NS(tensor_parallel_size=1)
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level("INFO", logger=logger.name):
            for chosen, after in ((None, True), (True, True), (False, False)):
                args = NS(disable_hybrid_kv_cache_manager=chosen, block_size=64,
                          kv_cache_dtype="auto")
                prefer_one_kv_cache_group(args, mla, drafter, tp1)
                assert args.disable_hybrid_kv_cache_manager is after, chosen
            mistral = MistralConfig(vocab_size=4096, hidden_size=256, num_hidden_layers=4,
                                    sliding_window=4096)
            args = NS(disable_hybrid_kv_cache_manager=None, block_size=None,
                      kv_cache_dtype="auto")
            prefer_one_kv_cache_group(args, _target_model_config(mistral, False), drafter, tp1)
            assert args.disable_hybrid_kv_cache_manager is None
    finally:
        logger.removeHandler(caplog.handler)
    assert logger.name.startswith("vllm.")
    # a record reaches caplog's handler once here and once more where the logger propagates
    notes = [r.getMessage() for r in dict.fromkeys(caplog.records) if r.name == logger.name]
    assert len(notes) == 4
    assert "one KV-cache group" in notes[0] and "(1.07x <= 1.10x)" in notes[0]
    assert "--disable-hybrid-kv-cache-manager" in notes[1]
    assert "--no-disable-hybrid-kv-cache-manager" in notes[2]
    assert "its own sliding_window=4096 on every layer" in notes[3]


class SchedulerConfigReached(BaseException):
    """vLLM got to ``VllmConfig`` with the engine's scheduler config."""


@pytest.fixture
def engine_front_end(monkeypatch, custom_backend_slot):
    """``build(speculative=None, **engine_args)``: vLLM's ``EngineArgs.create_engine_config``
    for a DDTree run on the embedded pair (``speculative``: more speculative-config keys),
    up to the ``SchedulerConfig`` it hands ``VllmConfig`` (which on the CPU refuses the V2
    runner), returned. DDTree's process-wide side effects (runner patches, environment)
    are undone afterwards."""
    from vllm.engine import arg_utils

    import vllm_ddtree
    from vllm_ddtree import patches

    vllm_ddtree.register()

    def reached(**kwargs):
        raise SchedulerConfigReached(kwargs["scheduler_config"])

    monkeypatch.setattr(patches, "apply_runner_patches", lambda: None)
    for name in ("VLLM_USE_V2_MODEL_RUNNER", "VLLM_DDTREE_TREE_BACKEND"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)

    def build(speculative=None, **engine_args):
        spec = {"method": "ddtree", "model": str(CHECKPOINTS / "drafter"),
                "num_speculative_tokens": 8, **(speculative or {})}
        args = engine_args.pop("engine_args", None) or arg_utils.EngineArgs(
            model=str(CHECKPOINTS / "target"), **engine_args)
        args.speculative_config, args.max_model_len = spec, 512
        with monkeypatch.context() as patched, pytest.raises(SchedulerConfigReached) as info:
            patched.setattr(arg_utils, "VllmConfig", reached)
            args.create_engine_config()
        return info.value.args[0]

    return build


def test_the_front_end_gives_the_embedded_pair_one_group(engine_front_end):
    assert engine_front_end().disable_hybrid_kv_cache_manager is True
    assert engine_front_end(disable_hybrid_kv_cache_manager=False
                            ).disable_hybrid_kv_cache_manager is False
    assert engine_front_end(disable_hybrid_kv_cache_manager=True
                            ).disable_hybrid_kv_cache_manager is True


def test_the_documented_overrides_reach_the_engine(engine_front_end, tmp_path):
    """``--no-disable-hybrid-kv-cache-manager`` on the command line, and in a ``--config``
    file as ``no-disable-hybrid-kv-cache-manager: true``, keep the hybrid manager; vLLM
    drops ``disable-hybrid-kv-cache-manager: false`` from a config file (false values
    are not passed on), which then leaves the choice to DDTree."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    model = ["--model", str(CHECKPOINTS / "target")]
    yaml_no = tmp_path / "keep.yaml"
    yaml_no.write_text("no-disable-hybrid-kv-cache-manager: true\n")
    yaml_false = tmp_path / "false.yaml"
    yaml_false.write_text("disable-hybrid-kv-cache-manager: false\n")
    for argv, after in (([], True), (["--no-disable-hybrid-kv-cache-manager"], False),
                        (["--config", str(yaml_no)], False),
                        (["--config", str(yaml_false)], True)):
        args = EngineArgs.from_cli_args(parser.parse_args(model + argv))
        scheduler = engine_front_end(engine_args=args)
        assert scheduler.disable_hybrid_kv_cache_manager is after, argv


def test_the_drafters_own_kv_cache_dtype_counts(engine_front_end):
    """vLLM builds the drafter's KV cache in the speculative config's ``kv_cache_dtype``
    (``load_dflash_model``). Beside the embedded target's fp8 latent (576 B a token a
    layer) a bf16 drafter makes one group 4 x 576 + 3 x 512 = 3,840 B a context token
    against the hybrid manager's 5 x 576 = 2,880 (1.33x: hybrid kept); an fp8 drafter
    4 x 576 + 3 x 256 = 3,072 (1.07x: one group)."""
    target, drafter = _embedded()
    mixed = pair_kv_shape(target, drafter, dtype=torch.uint8, drafter_dtype=torch.bfloat16)
    assert kv_bytes_per_token(mixed, hybrid=True) == 5 * 576
    assert kv_bytes_per_token(mixed, hybrid=False) == 4 * 576 + 3 * 512
    assert choose_by_kv_bytes(mixed, page=64).disable_hybrid_kv_cache_manager is None
    assert engine_front_end(kv_cache_dtype="fp8").disable_hybrid_kv_cache_manager is True
    for drafter_cache in ("auto", "bfloat16"):
        scheduler = engine_front_end(speculative={"kv_cache_dtype": drafter_cache},
                                     kv_cache_dtype="fp8")
        assert scheduler.disable_hybrid_kv_cache_manager is None, drafter_cache
    assert engine_front_end(speculative={"kv_cache_dtype": "fp8"}, kv_cache_dtype="fp8"
                            ).disable_hybrid_kv_cache_manager is True
