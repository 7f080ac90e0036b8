"""Patch ``vllm.v1.worker.gpu.model_states.default.DefaultModelState.custom_sampler``
(vLLM 0.26.0).

``GPUModelRunner.load_model`` asks the model state for a sampler override
(``model_runner.py:337-346``: ``custom = model_state.custom_sampler(sampler)``; a
``(sampler, rejection_sampler)`` pair replaces vLLM's chain ``RejectionSampler``).
With DDTree active in this process (the ``DDTreeSpeculator`` was built first, in
``GPUModelRunner.__init__``) it returns ``(sampler, DDTreeVerifier)``.
"""

from __future__ import annotations

from vllm_ddtree.patches._guard import mark_patched, require_vllm_version

PATCHED_FUNCTION = (
    "vllm.v1.worker.gpu.model_states.default.DefaultModelState.custom_sampler"
)


def apply() -> None:
    require_vllm_version(PATCHED_FUNCTION)
    from vllm.v1.worker.gpu.model_states.default import DefaultModelState

    original = DefaultModelState.custom_sampler
    if getattr(original, "_ddtree_patched", False):
        return

    def custom_sampler(self, sampler):
        from vllm_ddtree.runtime_state import (
            DDTREE_STATE,
            ddtree_config_of,
            drafter_block_size,
        )

        spec = self.vllm_config.speculative_config
        if ddtree_config_of(spec) is None:
            return original(self, sampler)
        if not DDTREE_STATE.enabled:
            raise RuntimeError(
                "speculative config has ddtree but no DDTreeSpeculator was built in this "
                "process: apply vllm_ddtree.patches.init_speculator before the model runner starts"
            )
        from vllm_ddtree.verify.verifier import DDTreeVerifier

        verifier = DDTreeVerifier(
            sampler, spec, self.device, max_depth=drafter_block_size(spec) - 1
        )
        return sampler, verifier

    mark_patched(custom_sampler, original)
    DefaultModelState.custom_sampler = custom_sampler
