"""`method: ddtree` speculative configs: split into vLLM's part, and clear errors."""

import os
from types import SimpleNamespace

import pytest
from tiny_models import drafter_config, tiny_target

from vllm_ddtree.config import (
    DDTreeConfig,
    DDTreeConfigError,
    check_drafter_for_target,
    split_ddtree_spec,
)
from vllm_ddtree.drafter_config import DrafterConfigError

BASE = {"method": "ddtree", "model": "/drafter", "num_speculative_tokens": 64}


def test_ddtree_becomes_dflash_with_its_own_keys_apart():
    spec, cfg = split_ddtree_spec({**BASE, "ddtree_top_k": 8, "attention_backend": None})
    assert spec == {"method": "dflash", "model": "/drafter", "num_speculative_tokens": 64,
                    "attention_backend": None}
    assert cfg == DDTreeConfig(budget=64, top_k=8)


def test_other_methods_pass_through():
    spec = {"method": "dflash", "model": "/d", "num_speculative_tokens": 7}
    assert split_ddtree_spec(spec) == (spec, None)


@pytest.mark.parametrize("patch, field", [
    ({"ddtree_budjet": 3}, "ddtree_budjet"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"num_speculative_tokens": 513}, "num_speculative_tokens"),
    ({"num_speculative_tokens": "64"}, "num_speculative_tokens"),
    ({"num_speculative_tokens": None}, "num_speculative_tokens"),
    ({"ddtree_top_k": 0}, "ddtree_top_k"),
    ({"model": None}, "model"),
    ({"draft_sample_method": "probabilistic"}, "draft_sample_method"),
    ({"num_speculative_tokens_per_batch_size": [(2, 8, 4)]}, "num_speculative_tokens_per_batch"),
])
def test_bad_specs_name_the_field(patch, field):
    with pytest.raises(DDTreeConfigError, match=field):
        split_ddtree_spec({**BASE, **patch})


def test_ddtree_keys_without_ddtree_method_are_rejected():
    with pytest.raises(DDTreeConfigError, match="method"):
        split_ddtree_spec({"method": "dflash", "model": "/d", "ddtree_top_k": 4})


def test_drafter_checked_against_target(tmp_path):
    target = tiny_target("qwen3")
    drafter_config(target.config).save_pretrained(tmp_path / "good")
    check_drafter_for_target(str(tmp_path / "good"), target.config)
    bad = drafter_config(target.config)
    bad.vocab_size = 50
    bad.save_pretrained(tmp_path / "bad")
    with pytest.raises(DrafterConfigError, match="vocab_size"):
        check_drafter_for_target(str(tmp_path / "bad"), target.config)
    with pytest.raises(DDTreeConfigError, match="config.json"):
        check_drafter_for_target(str(tmp_path / "missing"), target.config)


def test_drafter_positions_must_cover_max_model_len(tmp_path):
    """vLLM's DFlash drafter sizes its RoPE table by its own max_position_embeddings and
    never bounds-checks a position against it: a longer max_model_len is refused."""
    target = tiny_target("qwen3")
    config = drafter_config(target.config)
    config.max_position_embeddings = 4096
    config.save_pretrained(tmp_path / "d")
    drafter = str(tmp_path / "d")
    check_drafter_for_target(drafter, target.config, max_model_len=4096)
    check_drafter_for_target(drafter, target.config, max_model_len=100)
    with pytest.raises(DDTreeConfigError) as err:
        check_drafter_for_target(drafter, target.config, max_model_len=16512)
    for part in ("max_position_embeddings=4096", "max_model_len=16512",
                 "max_model_len <= 4096"):
        assert part in str(err.value)


def test_engine_args_reject_bad_ddtree_spec_before_gpu_work(tmp_path):
    from vllm.config import ModelConfig, ParallelConfig
    from vllm.engine.arg_utils import EngineArgs

    import vllm_ddtree

    vllm_ddtree.register()
    target = tiny_target("qwen3")
    target.save_pretrained(tmp_path / "target")
    drafter_config(target.config).save_pretrained(tmp_path / "drafter")
    model_config = ModelConfig(model=str(tmp_path / "target"), skip_tokenizer_init=True)

    def build(spec):
        args = EngineArgs(model=str(tmp_path / "target"), speculative_config=spec)
        return args.create_speculative_config(model_config, ParallelConfig())

    spec = {**BASE, "model": str(tmp_path / "drafter")}
    with pytest.raises(DDTreeConfigError, match="ddtree_topk"):
        build({**spec, "ddtree_topk": 4})
    with pytest.raises(DDTreeConfigError, match="num_speculative_tokens"):
        build({**spec, "num_speculative_tokens": 1000})


def test_ddtree_spec_builds_dflash_config_with_ddtree(monkeypatch, custom_backend_slot):
    """A valid DDTree spec becomes vLLM's DFlash config plus a picklable ``ddtree``
    dict, on the V2 runner, with the tree backend for the target and the runner
    patches applied; the V1 runner is refused by name."""
    from vllm_ddtree import patches
    from vllm_ddtree.config import DDTreeConfig, DDTreeConfigError
    from vllm_ddtree.patches.speculative_config import create_ddtree_speculative_config

    runner_patches = []  # the real ones would leak into later tests of this process
    monkeypatch.setattr(patches, "apply_runner_patches", lambda: runner_patches.append(1))

    # setenv first: delenv of an unset variable records nothing, and the values the
    # code under test writes would leak into later tests (VllmConfig() then refuses
    # the V2 runner without Triton)
    for name in ("VLLM_USE_V2_MODEL_RUNNER", "VLLM_DDTREE_TREE_BACKEND"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    seen = {}

    def original(engine_args, target_model_config, target_parallel_config):
        seen["spec"] = engine_args.speculative_config
        return SimpleNamespace(method=engine_args.speculative_config["method"])

    # the user's KV-cache grouping is kept (kv_group_choice, tests/test_kv_group_choice.py)
    args = SimpleNamespace(attention_backend=None, attention_config=SimpleNamespace(backend=None),
                           speculative_config=None, disable_hybrid_kv_cache_manager=False)
    vllm_spec = {"method": "dflash", "model": "/d", "num_speculative_tokens": 32}
    config = create_ddtree_speculative_config(
        args, original, vllm_spec, DDTreeConfig(budget=32, top_k=4),
        SimpleNamespace(use_mla=True), None, None)
    assert config.method == "dflash" and seen["spec"] is vllm_spec
    assert args.disable_hybrid_kv_cache_manager is False
    assert config.ddtree == {"budget": 32, "top_k": 4, "adaptive": False, "verify_shape": None,
                             "batch_schedule": None}
    assert args.attention_backend == "CUSTOM"
    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    assert runner_patches == [1]
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    with pytest.raises(DDTreeConfigError, match="VLLM_USE_V2_MODEL_RUNNER"):
        create_ddtree_speculative_config(args, original, vllm_spec, DDTreeConfig(budget=32),
                                         SimpleNamespace(use_mla=True), None, None)


def test_chain_only_sampling_features_refused_per_request():
    """With DDTree, penalties, bad words and structured outputs get a ValueError naming
    the field at request validation (HTTP 400 in vllm serve), not an engine crash."""
    from vllm.sampling_params import SamplingParams, StructuredOutputsParams
    from vllm.v1.engine.input_processor import InputProcessor

    from vllm_ddtree import patches
    from vllm_ddtree.patches.request_validation import check_request_for_ddtree

    patches.apply_all()
    assert InputProcessor._validate_params._ddtree_patched
    ddtree = SimpleNamespace(speculative_config=SimpleNamespace(ddtree={"budget": 8}))
    plain = SimpleNamespace(speculative_config=None)
    for params, field in [
        (SamplingParams(repetition_penalty=1.2), "repetition_penalty=1.2"),
        (SamplingParams(presence_penalty=0.5), "presence_penalty=0.5"),
        (SamplingParams(frequency_penalty=0.5), "frequency_penalty=0.5"),
        (SamplingParams(bad_words=["x"]), "bad_words"),
        (SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+")),
         "structured_outputs"),
        (SamplingParams(logprobs=2, logprob_token_ids=[3, 4]), "logprob_token_ids"),
    ]:
        with pytest.raises(ValueError, match=field):
            check_request_for_ddtree(ddtree, params)
        check_request_for_ddtree(plain, params)  # without DDTree: vLLM's business
    check_request_for_ddtree(ddtree, SamplingParams(temperature=0.8, top_p=0.9, top_k=5,
                                                    seed=3, min_tokens=4, stop=["\n"],
                                                    logprobs=2))
