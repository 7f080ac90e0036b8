"""Patch ``vllm.engine.arg_utils.EngineArgs.create_speculative_config`` (vLLM 0.26.0).

Accepts ``method: ddtree`` (which vLLM's ``SpeculativeMethod`` Literal rejects) from
``vllm serve --speculative-config``, ``LLM(speculative_config=...)`` and lm-eval's
``--model_args``: validates the DDTree keys and the drafter against the target
before any GPU work, with errors that name the field and the fix.
"""

from __future__ import annotations

from patches._guard import require_vllm_version

PATCHED_FUNCTION = "vllm.engine.arg_utils.EngineArgs.create_speculative_config"


def apply() -> None:
    require_vllm_version(PATCHED_FUNCTION)
    from vllm.engine.arg_utils import EngineArgs

    original = EngineArgs.create_speculative_config
    if getattr(original, "_ddtree_patched", False):
        return

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
                raise NotImplementedError(
                    "speculative method 'ddtree' is validated but not yet wired into "
                    "vLLM's V2 runner in this vllm-ddtree build; use the reference engine "
                    "(vllm_ddtree.reference.generate) or method 'dflash' meanwhile"
                )
            self.speculative_config = vllm_spec
        return original(self, target_model_config, target_parallel_config)

    create_speculative_config._ddtree_patched = True
    EngineArgs.create_speculative_config = create_speculative_config
