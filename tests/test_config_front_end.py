"""Bad speculative configs and drafter config.json files are refused by the front end
(``EngineArgs.create_speculative_config``) with the field, the value and what is
allowed, before vLLM creates the drafter's ``ModelConfig`` (no model load)."""

import copy
import json

import pytest
from tiny_models import drafter_config, tiny_target

from vllm_ddtree.config import DDTreeConfigError
from vllm_ddtree.drafter_config import DrafterConfigError

DROP = object()  # a field left out of config.json
DRAFTER = "<drafter>"  # replaced by the tiny drafter's directory


class DrafterModelConfigReached(BaseException):
    """vLLM created the drafter's ModelConfig: the front end let the input through."""


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    """A tiny Qwen3 target directory and the text of a matching drafter config.json."""
    import vllm_ddtree

    vllm_ddtree.register()
    target = tiny_target("qwen3", head_dim=32)  # the GQA tree backend's smallest head
    root = tmp_path_factory.mktemp("pair")
    target.save_pretrained(root / "target")
    drafter_config(target.config).save_pretrained(root / "drafter")
    return root / "target", json.loads((root / "drafter" / "config.json").read_text())


@pytest.fixture
def front_end(pair_dirs, tmp_path, monkeypatch, custom_backend_slot):
    """``build(spec, drafter_json=None, **engine_args)``: run the patched
    ``create_speculative_config`` with the tiny target and a drafter directory holding
    ``drafter_json`` (the value ``DRAFTER`` in ``spec`` or ``engine_args`` stands for
    that directory). vLLM's drafter
    ``ModelConfig`` raises ``DrafterModelConfigReached`` with its arguments. DDTree's
    process-wide side effects (runner patches, environment) are undone afterwards."""
    from vllm.config import ModelConfig, ParallelConfig
    from vllm.config import speculative as vllm_speculative
    from vllm.engine.arg_utils import EngineArgs

    from vllm_ddtree import patches

    target_dir, good_json = pair_dirs
    target_config = ModelConfig(model=str(target_dir), skip_tokenizer_init=True)

    def reached(*args, **kwargs):
        raise DrafterModelConfigReached(kwargs)

    monkeypatch.setattr(vllm_speculative, "ModelConfig", reached)
    monkeypatch.setattr(patches, "apply_runner_patches", lambda: None)
    for name in ("VLLM_USE_V2_MODEL_RUNNER", "VLLM_DDTREE_TREE_BACKEND"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)

    def build(spec=None, drafter_json=None, **engine_args):
        drafter = tmp_path / "drafter"
        drafter.mkdir(exist_ok=True)
        text = drafter_json if isinstance(drafter_json, str) else json.dumps(
            good_json if drafter_json is None else drafter_json)
        (drafter / "config.json").write_text(text)

        def fill(value):
            return str(drafter) if value == DRAFTER else value

        if spec is not None:
            spec = {key: fill(value) for key, value in spec.items()}
        engine_args = {key: fill(value) for key, value in engine_args.items()}
        args = EngineArgs(model=str(target_dir), speculative_config=spec, **engine_args)
        build.engine_args = args
        return args.create_speculative_config(target_config, ParallelConfig())

    build.good_json = good_json
    build.drafter_dir = tmp_path / "drafter"
    return build


def refused(build, error=DDTreeConfigError, **kwargs) -> str:
    """The message ``build(**kwargs)`` is refused with (before the drafter's ModelConfig)."""
    with pytest.raises(error) as info:
        build(**kwargs)
    return str(info.value)


SPEC = {"method": "ddtree", "model": DRAFTER, "num_speculative_tokens": 8}


def test_a_valid_spec_reaches_vllm(front_end):
    """The control: a good spec does reach the drafter's ModelConfig, and leaves the
    tree's shape (B, drafter block_size) for the batch limits (patches/batch_defaults)."""
    from vllm_ddtree.patches.batch_defaults import TREE_SHAPE_ATTR

    with pytest.raises(DrafterModelConfigReached) as info:
        front_end(SPEC)
    assert info.value.args[0]["model"] == str(front_end.drafter_dir)
    assert getattr(front_end.engine_args, TREE_SHAPE_ATTR) == (8, 8)


# -- the tree budget against ddtree_top_k and the drafter's depth ------------------------


@pytest.mark.parametrize("budget, top_k, block_size, most", [
    (8, 1, 8, 7),  # a chain of depth 7
    (255, 2, 8, 254),  # 2 + 4 + ... + 2^7
    (13, 3, 3, 12),  # 3 + 9
    (97, None, 2, 96),  # depth 1: one child per vocabulary token (V = 96)
])
def test_budget_larger_than_the_tree_can_hold(front_end, budget, top_k, block_size, most):
    spec = {**SPEC, "num_speculative_tokens": budget}
    if top_k is not None:
        spec["ddtree_top_k"] = top_k
    message = refused(front_end, spec=spec,
                      drafter_json={**front_end.good_json, "block_size": block_size})
    assert f"num_speculative_tokens={budget}" in message
    assert f"at most {most} nodes" in message
    assert f"block_size {block_size}" in message
    if top_k is not None:
        assert f"ddtree_top_k={top_k}" in message
    with pytest.raises(DrafterModelConfigReached):  # the largest budget that fits
        front_end({**spec, "num_speculative_tokens": most},
                  drafter_json={**front_end.good_json, "block_size": block_size})


# -- ddtree_* keys, num_speculative_tokens and model: types and ranges ------------------


@pytest.mark.parametrize("key, value, allowed", [
    ("num_speculative_tokens", True, "an int in 1..512"),
    ("num_speculative_tokens", "64", "an int in 1..512"),
    ("num_speculative_tokens", 8.0, "an int in 1..512"),
    ("num_speculative_tokens", None, "an int in 1..512"),
    ("num_speculative_tokens", 0, "an int in 1..512"),
    ("num_speculative_tokens", 513, "an int in 1..512"),
    ("ddtree_top_k", True, "an int >= 1"),
    ("ddtree_top_k", "4", "an int >= 1"),
    ("ddtree_top_k", 3.0, "an int >= 1"),
    ("ddtree_top_k", 0, "an int >= 1"),
    ("ddtree_top_k", [4], "an int >= 1"),
    ("ddtree_budget", "AUTO", '"auto"'),
    ("ddtree_budget", True, '"auto"'),
    ("ddtree_budget", 64, '"auto"'),
    ("ddtree_verify_shape", "ADAPTIVE", "'adaptive', 'fixed'"),
    ("ddtree_verify_shape", 1, "'adaptive', 'fixed'"),
    ("model", 5, "the local directory of a DFlash drafter"),
    ("model", "", "the local directory of a DFlash drafter"),
])
def test_ddtree_keys_refused_with_key_value_and_allowed(front_end, key, value, allowed):
    spec = {**SPEC, "ddtree_budget": "auto", key: value}
    message = refused(front_end, spec=spec)
    assert f"{key}={value!r}" in message
    assert allowed in message


@pytest.mark.parametrize("key", ["ddtree_topk", "ddtree_budjet", "DDTree_top_k",
                                 "ddtree"])
def test_unknown_ddtree_keys_list_the_known_ones(front_end, key):
    message = refused(front_end, spec={**SPEC, key: 4})
    assert repr(key) in message
    for known in ("ddtree_top_k", "ddtree_budget", "ddtree_verify_shape"):
        assert known in message


def test_none_is_the_default_of_optional_ddtree_keys(front_end):
    with pytest.raises(DrafterModelConfigReached):
        front_end({**SPEC, "ddtree_top_k": None, "ddtree_budget": None,
                   "ddtree_verify_shape": None})


# -- the method ------------------------------------------------------------------------


@pytest.mark.parametrize("method, hint", [
    ("DDTree", "ddtree"), ("dd_tree", "ddtree"), ("ddtre", "ddtree"), ("DFlash", "dflash"),
])
def test_unknown_method_lists_ddtree_and_says_names_are_case_sensitive(front_end, method,
                                                                      hint):
    for kwargs in ({"spec": {**SPEC, "method": method}},
                   {"spec": {"model": DRAFTER, "num_speculative_tokens": 8},
                    "spec_method": method}):
        message = refused(front_end, **kwargs)
        assert f"method={method!r}" in message
        assert f"did you mean {hint!r}" in message
        assert "case-sensitive" in message
        assert "'ddtree'" in message and "'dflash'" in message and "'ngram'" in message


def test_vllm_methods_are_left_to_vllm(front_end):
    config = front_end({"method": "ngram", "num_speculative_tokens": 3,
                        "prompt_lookup_max": 3})
    assert config.method == "ngram"
    config = front_end(None, spec_method="ngram", spec_tokens=3)
    assert config.method == "ngram" and config.num_speculative_tokens == 3
    with pytest.raises(ValueError, match="mutually exclusive"):  # vLLM's own rule
        front_end({"method": "ngram"}, spec_method="ngram", spec_tokens=3)


# -- vLLM's shorthand arguments (--spec-method / --spec-model / --spec-tokens) ----------


@pytest.mark.parametrize("spec, shorthands", [
    (None, {"spec_method": "ddtree", "spec_tokens": 8, "spec_model": DRAFTER}),
    ({"method": "ddtree", "model": DRAFTER}, {"spec_tokens": 8}),
    ({"num_speculative_tokens": 8, "model": DRAFTER}, {"spec_method": "ddtree"}),
    ({"method": "ddtree", "num_speculative_tokens": 8}, {"spec_model": DRAFTER}),
    ({"method": "ddtree", "num_speculative_tokens": 8, "model": DRAFTER},
     {"spec_method": "ddtree", "spec_tokens": 8, "spec_model": DRAFTER}),  # agreeing
])
def test_shorthands_merge_into_the_ddtree_spec(front_end, spec, shorthands):
    with pytest.raises(DrafterModelConfigReached) as info:
        front_end(spec, **shorthands)
    assert info.value.args[0]["model"] == str(front_end.drafter_dir)


@pytest.mark.parametrize("spec, shorthands, names", [
    ({**SPEC}, {"spec_tokens": 16},
     ["--spec-tokens=16", "num_speculative_tokens=8"]),
    ({**SPEC, "method": "dflash"}, {"spec_method": "ddtree"},
     ["--spec-method='ddtree'", "method='dflash'"]),
    ({**SPEC}, {"spec_method": "dflash"},
     ["--spec-method='dflash'", "method='ddtree'"]),
    ({**SPEC}, {"spec_model": "/elsewhere"},
     ["--spec-model='/elsewhere'", "model="]),
])
def test_shorthand_and_json_conflicts_name_both(front_end, spec, shorthands, names):
    message = refused(front_end, spec=spec, **shorthands)
    for name in names:
        assert name in message


def test_cli_accepts_spec_method_ddtree(front_end):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    drafter = str(front_end.drafter_dir)
    args = parser.parse_args(["--model", "unused", "--spec-method", "ddtree",
                              "--spec-model", drafter, "--spec-tokens", "8"])
    assert (args.spec_method, args.spec_model, args.spec_tokens) == ("ddtree", drafter, 8)
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "unused", "--spec-method", "DDTree"])
    with pytest.raises(DrafterModelConfigReached):
        front_end(None, spec_method=args.spec_method, spec_model=args.spec_model,
                  spec_tokens=args.spec_tokens)


# -- the drafter's config.json -----------------------------------------------------------


def changed(good: dict, **fields) -> dict:
    """``good`` with top-level ``fields`` replaced (``DROP``: left out); a value for
    ``dflash_config`` that is a dict updates it the same way."""
    config = copy.deepcopy(good)
    for key, value in fields.items():
        if value is DROP:
            config.pop(key, None)
        elif key == "dflash_config" and isinstance(value, dict):
            for inner, inner_value in value.items():
                if inner_value is DROP:
                    config[key].pop(inner, None)
                else:
                    config[key][inner] = inner_value
        else:
            config[key] = value
    return config


BAD_DRAFTER_FIELDS = [
    # (changes, the "field=value" the message names, what it says is allowed)
    ({"block_size": DROP}, "block_size=None", "an int >= 2"),
    ({"block_size": "8"}, "block_size='8'", "an int >= 2"),
    ({"block_size": True}, "block_size=True", "an int >= 2"),
    ({"block_size": 8.5}, "block_size=8.5", "an int >= 2"),
    ({"block_size": 1}, "block_size=1", "an int >= 2"),
    ({"dflash_config": DROP}, "dflash_config=None", "an object"),
    ({"dflash_config": [1]}, "dflash_config=[1]", "an object"),
    ({"dflash_config": "x"}, "dflash_config='x'", "an object"),
    ({"dflash_config": {"target_layer_ids": DROP}}, "target_layer_ids=None",
     "a non-empty list of distinct ints"),
    ({"dflash_config": {"target_layer_ids": ["a", 1]}}, "target_layer_ids=['a', 1]",
     "a non-empty list of distinct ints"),
    ({"dflash_config": {"target_layer_ids": [0.5, 1]}}, "target_layer_ids=[0.5, 1]",
     "a non-empty list of distinct ints"),
    ({"dflash_config": {"target_layer_ids": [True, 1]}}, "target_layer_ids=[True, 1]",
     "a non-empty list of distinct ints"),
    ({"dflash_config": {"target_layer_ids": 1}}, "target_layer_ids=1",
     "a non-empty list of distinct ints"),
    ({"dflash_config": {"target_layer_ids": []}}, "target_layer_ids=[]",
     "a non-empty list of distinct ints"),
    ({"dflash_config": {"target_layer_ids": [1, 1]}}, "target_layer_ids=[1, 1]",
     "distinct"),
    ({"dflash_config": {"target_layer_ids": [0, 7]}}, "target_layer_ids=[0, 7]",
     "0..2 (the target has 3 layers)"),
    ({"dflash_config": {"mask_token_id": DROP}}, "mask_token_id=None", "an int in 0..95"),
    ({"dflash_config": {"mask_token_id": 96}}, "mask_token_id=96", "an int in 0..95"),
    ({"dflash_config": {"mask_token_id": -1}}, "mask_token_id=-1", "an int in 0..95"),
    ({"dflash_config": {"mask_token_id": "5"}}, "mask_token_id='5'", "an int in 0..95"),
    ({"dflash_config": {"mask_token_id": 5.5}}, "mask_token_id=5.5", "an int in 0..95"),
    ({"architectures": DROP}, "architectures=None", '["DFlashDraftModel"]'),
    ({"architectures": []}, "architectures=[]", '["DFlashDraftModel"]'),
    ({"architectures": "DFlashDraftModel"}, "architectures='DFlashDraftModel'",
     '["DFlashDraftModel"]'),
    ({"architectures": ["Qwen3ForCausalLM"]}, "architectures=['Qwen3ForCausalLM']",
     '["DFlashDraftModel"]'),
    ({"use_sliding_window": False}, "use_sliding_window=False", "true"),
    ({"use_sliding_window": "yes"}, "use_sliding_window='yes'", "true or false"),
    ({"sliding_window": 0}, "sliding_window=0", "an int >= 1"),
    ({"sliding_window": "4"}, "sliding_window='4'", "an int >= 1"),
    ({"sliding_window": None}, "sliding_window=None", "an int >= 1"),
    ({"layer_types": ["full_attention"]}, "layer_types=['full_attention']",
     "one entry per layer (num_hidden_layers=2)"),
    ({"layer_types": ["full_attention", "linear"]}, "layer_types=['full_attention', "
     "'linear']", "'full_attention' or 'sliding_attention'"),
    ({"dflash_config": {"use_swa": "yes"}}, "use_swa='yes'", "true or false"),
    ({"dflash_config": {"causal": 1}}, "causal=1", "true or false"),
    ({"dflash_config": {"swa_window_size": 0}}, "swa_window_size=0", "an int >= 1"),
    ({"hidden_size": "64"}, "hidden_size='64'", "an int >= 1"),
    ({"num_hidden_layers": 2.0}, "num_hidden_layers=2.0", "an int >= 1"),
    ({"vocab_size": 95}, "vocab_size=95", "96 (the target's vocab_size)"),
]


@pytest.mark.parametrize("fields, named, allowed", BAD_DRAFTER_FIELDS)
def test_bad_drafter_config_json_named_before_vllm_reads_it(front_end, fields, named,
                                                            allowed):
    message = refused(front_end, error=DrafterConfigError, spec=SPEC,
                      drafter_json=changed(front_end.good_json, **fields))
    assert message.startswith("drafter config.json: "), message
    assert named in message
    assert allowed in message


@pytest.mark.parametrize("text, named", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "a JSON object"),
])
def test_unreadable_drafter_config_json(front_end, text, named):
    message = refused(front_end, error=DrafterConfigError, spec=SPEC, drafter_json=text)
    assert message.startswith("drafter config.json") and named in message


def test_sliding_window_from_dflash_config_needs_no_use_sliding_window(front_end):
    """``dflash_config.swa_window_size`` is a window of its own (vLLM reads it first)."""
    with pytest.raises(DrafterModelConfigReached):
        front_end(SPEC, drafter_json=changed(front_end.good_json, use_sliding_window=False,
                                             dflash_config={"swa_window_size": 4}))


# -- what the worker could not run, refused before the target loads ---------------------


@pytest.mark.parametrize("attr, kind", [
    ("is_hybrid", "hybrid"), ("is_encoder_decoder", "encoder-decoder"),
    ("uses_mrope", "M-RoPE")])
def test_targets_the_runner_cannot_verify_are_refused(front_end, monkeypatch, attr, kind):
    """Hybrid, encoder-decoder and M-RoPE targets would reach the worker and fail after
    the model loaded (DDTree patches vLLM's default model state only)."""
    from vllm.config import ModelConfig

    monkeypatch.setattr(ModelConfig, attr, property(lambda self: True), raising=False)
    message = refused(front_end, spec=SPEC)
    assert kind in message and "Qwen3ForCausalLM" in message
    assert "without --speculative-config" in message


def test_a_default_repetition_penalty_is_refused_at_start_up():
    """A generation config's repetition_penalty becomes every request's: each would be
    refused (penalties assume a chain), so the server is refused at start-up with the
    flag that drops it; a neutral 1.0 passes."""
    from types import SimpleNamespace

    from vllm_ddtree.config import check_target

    def target(defaults):
        return SimpleNamespace(hf_config=SimpleNamespace(architectures=["X"]),
                               get_diff_sampling_param=lambda: defaults)

    with pytest.raises(DDTreeConfigError) as info:
        check_target(target({"repetition_penalty": 1.05, "temperature": 0.7}))
    assert "repetition_penalty=1.05" in str(info.value)
    assert "--generation-config vllm" in str(info.value)
    check_target(target({"repetition_penalty": 1.0, "temperature": 0.7}))
    check_target(target({}))


@pytest.mark.parametrize("key, value", [
    ("use_local_argmax_reduction", True), ("draft_sample_method", "gumbel"),
    ("rejection_sample_method", "synthetic")])
def test_chain_only_speculative_keys_are_refused_unless_vllms_default(front_end, key, value):
    message = refused(front_end, spec={**SPEC, key: value})
    assert f"{key}={value!r} is not allowed" in message
    default = {"use_local_argmax_reduction": False, "draft_sample_method": "greedy",
               "rejection_sample_method": "standard"}[key]
    with pytest.raises(DrafterModelConfigReached):
        front_end({**SPEC, key: default})


def test_one_key_spelled_twice_is_refused(front_end):
    message = refused(front_end, spec={**SPEC, "ddtree-top-k": 2, "ddtree_top_k": 4})
    assert "'ddtree-top-k' and 'ddtree_top_k' are one key" in message


def test_numpy_integers_become_ints():
    """The workers compare types (``top_k must be an int``): NumPy integers from a
    Python caller are taken as ints."""
    np = pytest.importorskip("numpy")
    from vllm_ddtree.config import split_ddtree_spec

    _, ddtree = split_ddtree_spec({"method": "ddtree", "model": "d",
                                   "num_speculative_tokens": np.int64(8),
                                   "ddtree_top_k": np.int32(4)})
    assert (type(ddtree.budget), type(ddtree.top_k)) == (int, int)


@pytest.mark.parametrize("field", ["decode_context_parallel_size",
                                   "prefill_context_parallel_size"])
def test_context_parallelism_is_refused(field):
    from vllm_ddtree.config import DDTreeConfig, check_parallel_setup

    sizes = {"decode_context_parallel_size": 1, "prefill_context_parallel_size": 1,
             field: 2}
    with pytest.raises(DDTreeConfigError, match=f"{field}=2 is not allowed"):
        check_parallel_setup(DDTreeConfig(budget=8), 1, 1, **sizes)


def test_gqa_target_cache_and_head_size_are_checked_before_loading(front_end):
    """DDTree's GQA tree backend keeps a 16-bit cache of heads 32..256: an fp8 cache or a
    16-wide head would fail only in the worker."""
    from types import SimpleNamespace

    from vllm_ddtree.patches.speculative_config import check_gqa_target

    message = refused(front_end, spec=SPEC, kv_cache_dtype="fp8")
    assert "kv_cache_dtype='fp8' is not allowed" in message and "auto" in message
    with pytest.raises(DDTreeConfigError, match="head size 16 .* 32..256"):
        check_gqa_target(SimpleNamespace(kv_cache_dtype="auto"),
                         SimpleNamespace(get_head_size=lambda: 16))


@pytest.mark.parametrize("value", ["0", "00", " 0", "no"])
def test_any_value_that_selects_the_v1_runner_is_refused(front_end, monkeypatch, value):
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", value)
    assert "V2 model runner only" in refused(front_end, spec=SPEC)


def test_a_bad_switch_fails_at_start_up_not_in_the_worker(front_end, monkeypatch):
    from vllm_ddtree.settings import SettingError

    monkeypatch.setenv("VLLM_DDTREE_MLA_KERNEL", "gluon")
    message = refused(front_end, SettingError, spec=SPEC)
    assert "VLLM_DDTREE_MLA_KERNEL='gluon' is not allowed" in message


def test_a_long_prefill_threshold_below_a_verify_step_is_refused(front_end):
    """vLLM cuts every request's tokens at long_prefill_token_threshold, decodes too:
    below 1 + B a tree's verify rows are cut (and a padded new decode cannot run). Set
    by hand, or by vLLM (4 % of max_model_len 4096 = 163) with partial prefills."""
    message = refused(front_end, spec=SPEC, long_prefill_token_threshold=5)
    assert "long_prefill_token_threshold=5 (--long-prefill-token-threshold)" in message
    assert "at least 9" in message
    big = {**SPEC, "num_speculative_tokens": 255, "ddtree_top_k": 4}
    message = refused(front_end, spec=big, max_num_partial_prefills=2)
    assert "long_prefill_token_threshold=163 (vLLM's default" in message
    assert "at least 256" in message
    for ok in (dict(long_prefill_token_threshold=9), dict(max_num_partial_prefills=2)):
        with pytest.raises(DrafterModelConfigReached):
            front_end(SPEC, **ok)
