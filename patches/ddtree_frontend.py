"""Patch ``vllm.engine.arg_utils.EngineArgs.create_speculative_config`` a second time
(vLLM 0.26.0): route ``method: ddtree`` to the V2 runner path.

``patches.speculative_config`` validates DDTree specs and then refuses them with
``NotImplementedError`` until the runner path is validated on a GPU. This pending
patch wraps that function: a DDTree spec is validated the same way, then built by
``patches.speculative_config.create_ddtree_speculative_config`` (vLLM sees
``method: dflash`` plus a ``ddtree`` dict; an MLA target gets the ``CUSTOM`` tree
backend; V2 runner). Anything else goes through unchanged.
"""

from __future__ import annotations

from patches._guard import require_vllm_version

PATCHED_FUNCTION = "vllm.engine.arg_utils.EngineArgs.create_speculative_config (runner path)"


def apply() -> None:
    require_vllm_version(PATCHED_FUNCTION)
    from vllm.engine.arg_utils import EngineArgs

    from patches import speculative_config

    speculative_config.apply()
    validated = EngineArgs.create_speculative_config
    if getattr(validated, "_ddtree_runner_path", False):
        return
    original = validated._ddtree_original

    def create_speculative_config(self, target_model_config, target_parallel_config):
        from vllm_ddtree.config import check_drafter_for_target, split_ddtree_spec

        spec = self.speculative_config
        if self.spec_method == "ddtree":
            spec = {**(spec or {}), "method": "ddtree"}
            self.spec_method = None
        if isinstance(spec, dict):
            spec = {k.replace("-", "_"): v for k, v in spec.items()}
            vllm_spec, ddtree = split_ddtree_spec(spec)
            if ddtree is not None:
                check_drafter_for_target(vllm_spec["model"], target_model_config.hf_config)
                return speculative_config.create_ddtree_speculative_config(
                    self, original, vllm_spec, ddtree, target_model_config,
                    target_parallel_config,
                )
        return validated(self, target_model_config, target_parallel_config)

    create_speculative_config._ddtree_patched = True
    create_speculative_config._ddtree_runner_path = True
    create_speculative_config._ddtree_original = original
    EngineArgs.create_speculative_config = create_speculative_config
