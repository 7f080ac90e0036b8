"""Patch ``vllm.engine.arg_utils.EngineArgs.create_speculative_config`` (vLLM 0.26.0).

Accepts ``method: ddtree`` (which vLLM's ``SpeculativeMethod`` Literal rejects) from
``vllm serve --speculative-config``, the shorthand arguments (``--spec-method ddtree
--spec-model <drafter> --spec-tokens B``), ``LLM(speculative_config=...)`` and
lm-eval's ``--model_args``: checks the speculative config, the drafter's
``config.json`` and its fit to the target before vLLM builds the drafter's model
config, with errors that name the field, the value and what is allowed. Also adds
``ddtree`` to the choices of ``--spec-method`` (``EngineArgs.add_cli_args``, which
``AsyncEngineArgs.add_cli_args`` calls after loading the plugins).
"""

from __future__ import annotations

from vllm_ddtree.patches._guard import mark_patched, require_vllm_version

PATCHED_FUNCTION = "vllm.engine.arg_utils.EngineArgs.create_speculative_config"
PATCHED_CLI = "vllm.engine.arg_utils.EngineArgs.add_cli_args"


def checked_spec(engine_args):
    """``engine_args.speculative_config`` with dashed keys normalised, after checking
    the method names (:func:`vllm_ddtree.config.check_method`) of it and of the
    ``--spec-method`` shorthand. A DDTree config has the shorthands merged in
    (:func:`vllm_ddtree.config.merge_shorthands`), which are then cleared so that
    vLLM does not merge them again."""
    from vllm_ddtree.config import check_method, merge_shorthands, uses_ddtree

    spec = engine_args.speculative_config
    if isinstance(spec, dict):
        spec = normalised_keys(spec)
        check_method(spec.get("method"))
    check_method(engine_args.spec_method, "--spec-method")
    shorthands = {"spec_method": engine_args.spec_method,
                  "spec_model": engine_args.spec_model,
                  "spec_tokens": engine_args.spec_tokens}
    if not uses_ddtree(spec if isinstance(spec, dict) else None, shorthands):
        return spec
    spec = merge_shorthands(spec, shorthands)
    engine_args.spec_method = engine_args.spec_model = engine_args.spec_tokens = None
    return spec


def normalised_keys(spec: dict) -> dict:
    """``spec`` with dashes in its keys turned into underscores (as vLLM's CLI does);
    two spellings of one key (``ddtree-top-k`` and ``ddtree_top_k``) are refused."""
    from vllm_ddtree.config import DDTreeConfigError

    out: dict = {}
    spelled: dict = {}
    for key, value in spec.items():
        name = key.replace("-", "_") if isinstance(key, str) else key
        if name in out:
            raise DDTreeConfigError(
                f"speculative config: {spelled[name]!r} and {key!r} are one key "
                f"({name}): give it once")
        out[name], spelled[name] = value, key
    return out


def apply() -> None:
    require_vllm_version(PATCHED_FUNCTION)
    from vllm.engine.arg_utils import EngineArgs

    apply_cli_choice(EngineArgs)
    original = EngineArgs.create_speculative_config
    if getattr(original, "_ddtree_patched", False):
        return

    def create_speculative_config(self, target_model_config, target_parallel_config):
        from vllm_ddtree.config import (
            check_drafter_for_target,
            check_long_prefill_threshold,
            check_parallel_setup,
            check_target,
            split_ddtree_spec,
        )
        from vllm_ddtree.drafter_config import block_size_of, refuse_dflash2_outside_ddtree
        from vllm_ddtree.patches.batch_defaults import TREE_SHAPE_ATTR

        spec = checked_spec(self)
        if isinstance(spec, dict):
            vllm_spec, ddtree = split_ddtree_spec(spec)
            if ddtree is not None:
                check_parallel_setup(
                    ddtree, *(getattr(target_parallel_config, name, 1) for name in (
                        "data_parallel_size", "pipeline_parallel_size",
                        "decode_context_parallel_size", "prefill_context_parallel_size")))
                check_target(target_model_config)
                check_long_prefill_threshold(
                    ddtree.budget, self.long_prefill_token_threshold or 0,
                    self.max_num_partial_prefills or 1, target_model_config.max_model_len)
                drafter = check_drafter_for_target(
                    vllm_spec["model"], target_model_config.hf_config, ddtree,
                    getattr(target_model_config, "max_model_len", None))
                # read by patches/batch_defaults.py when vLLM picks the batch limits
                setattr(self, TREE_SHAPE_ATTR, (ddtree.budget, block_size_of(drafter)))
                return create_ddtree_speculative_config(
                    self, original, vllm_spec, ddtree, target_model_config,
                    target_parallel_config, drafter,
                )
            refuse_dflash2_outside_ddtree(vllm_spec)
            self.speculative_config = vllm_spec
        return original(self, target_model_config, target_parallel_config)

    mark_patched(create_speculative_config, original)
    EngineArgs.create_speculative_config = create_speculative_config


def apply_cli_choice(engine_args_class) -> None:
    """Add ``ddtree`` to the choices of ``--spec-method`` (vLLM lists its
    ``SpeculativeMethod`` values there)."""
    require_vllm_version(PATCHED_CLI)
    original = engine_args_class.add_cli_args
    if getattr(original, "_ddtree_patched", False):
        return

    def add_cli_args(parser):
        parser = original(parser)
        for action in parser._actions:
            if action.dest == "spec_method" and action.choices is not None:
                if "ddtree" not in action.choices:
                    action.choices = sorted([*action.choices, "ddtree"], key=str)
        return parser

    mark_patched(add_cli_args, original)
    engine_args_class.add_cli_args = staticmethod(add_cli_args)


# --------------------------------------------------------------------------------
# The runner path: a DDTree config applies patches.RUNNER_PATCHES here and, through
# VLLM_DDTREE_RUNNER=1, in the engine and worker processes this one starts.
# --------------------------------------------------------------------------------

TREE_ATTENTION_BACKEND = "CUSTOM"  # see vllm_ddtree.attention_backends.registration


def choose_target_attention_backend(engine_args, target_model_config) -> None:
    """Give the target DDTree's tree-verify backend (``CUSTOM``) unless the user chose
    one; refuse any other choice (it would verify the tree with a causal mask).

    ``CUSTOM`` is the MLA tree backend for MLA targets and the GQA one for others. The
    kind goes into ``VLLM_DDTREE_TREE_BACKEND``, which vLLM's engine and worker
    processes inherit, so the plugin's ``register()`` there registers the same class;
    this process registers it at once.

    Runs inside ``create_speculative_config``, which ``create_engine_config`` calls
    (``arg_utils.py:2159``) before it turns ``engine_args.attention_backend`` into
    ``attention_config.backend`` (``arg_utils.py:2249-2259``).
    """
    from vllm_ddtree import settings
    from vllm_ddtree.attention_backends.registration import register_tree_backend
    from vllm_ddtree.config import DDTreeConfigError

    chosen = engine_args.attention_backend
    config_backend = getattr(engine_args.attention_config, "backend", None)
    if chosen is not None or config_backend is not None:
        name = getattr(chosen or config_backend, "name", chosen or config_backend)
        if str(name).upper() != TREE_ATTENTION_BACKEND:
            raise DDTreeConfigError(
                f"attention backend {name!r} cannot apply DDTree's tree mask: drop "
                f"--attention-backend (DDTree selects {TREE_ATTENTION_BACKEND}) or pass "
                f"--attention-backend {TREE_ATTENTION_BACKEND}"
            )
    kind = "mla" if target_model_config.use_mla else "gqa"
    if kind == "gqa":
        check_gqa_target(engine_args, target_model_config)
    settings.set_for_children("VLLM_DDTREE_TREE_BACKEND", kind)
    register_tree_backend(kind)
    if chosen is None and config_backend is None:
        engine_args.attention_backend = TREE_ATTENTION_BACKEND


def check_gqa_target(engine_args, target_model_config) -> None:
    """The GQA / MHA tree backend keeps a 16-bit KV cache of head sizes 32..256
    (``attention_backends/gqa_tree``): refuse other caches and heads here, before the
    target loads (vLLM would ask the backend only in the worker)."""
    from vllm_ddtree.attention_backends.gqa_tree.backend import TreeGQABackend
    from vllm_ddtree.config import DDTreeConfigError

    dtype = getattr(engine_args, "kv_cache_dtype", "auto")
    if dtype not in (None, "auto"):
        raise DDTreeConfigError(
            f"kv_cache_dtype={dtype!r} is not allowed with method 'ddtree' on a GQA / MHA "
            "target (DDTree's GQA tree backend keeps the model's 16-bit cache): use "
            "--kv-cache-dtype auto (an fp8 cache is supported for MLA targets)")
    head_size = target_model_config.get_head_size()
    if not TreeGQABackend.supports_head_size(head_size):
        raise DDTreeConfigError(
            f"head size {head_size} of this GQA / MHA target is not supported by DDTree's "
            "GQA tree backend (allowed: 32..256)")


def create_ddtree_speculative_config(
    engine_args, original, vllm_spec, ddtree, target_model_config, target_parallel_config,
    drafter_config,
):
    """Build vLLM's ``SpeculativeConfig`` for a validated DDTree spec.

    vLLM gets ``vllm_spec`` (``method: dflash``, ``num_speculative_tokens = B``) and
    the built config carries ``ddtree`` as a plain dict (it pickles to the workers;
    ``vllm_ddtree.runtime_state.ddtree_config_of`` reads it back). Also selects the
    target's tree attention backend and the V2 model runner, the only runner with a
    DDTree speculator (``VLLM_USE_V2_MODEL_RUNNER`` is read lazily,
    ``config/vllm.py:551``), applies the runner patches (``patches.RUNNER_PATCHES``)
    here and, through ``VLLM_DDTREE_RUNNER=1``, in the processes started later, and
    picks one KV-cache group where the user did not choose and it costs no more KV
    memory (``vllm_ddtree.kv_group_choice``; ``create_engine_config`` reads
    ``engine_args.disable_hybrid_kv_cache_manager`` after this, ``arg_utils.py:2199``).
    """
    import os

    from vllm_ddtree import settings
    from vllm_ddtree.config import DDTreeConfigError

    settings.check_all()
    runner = os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "").strip()
    if runner:  # vLLM reads it as bool(int(value)) (envs.py)
        try:
            v2 = bool(int(runner))
        except ValueError:
            v2 = None
        if not v2:
            raise DDTreeConfigError(
                f"VLLM_USE_V2_MODEL_RUNNER={os.environ['VLLM_USE_V2_MODEL_RUNNER']!r}: "
                "speculative method 'ddtree' runs on vLLM's V2 model runner only: set it "
                "to 1 or unset it")
    else:
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    from vllm_ddtree.kv_group_choice import prefer_one_kv_cache_group
    from vllm_ddtree.patches import apply_runner_patches

    apply_runner_patches()
    choose_target_attention_backend(engine_args, target_model_config)
    prefer_one_kv_cache_group(engine_args, target_model_config, drafter_config,
                              target_parallel_config, vllm_spec.get("kv_cache_dtype"))
    engine_args.speculative_config = vllm_spec
    config = original(engine_args, target_model_config, target_parallel_config)
    config.ddtree = ddtree.to_dict()
    return config
