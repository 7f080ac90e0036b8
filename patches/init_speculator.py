"""Patch ``vllm.v1.worker.gpu.model_runner.init_speculator`` (vLLM 0.26.0).

``GPUModelRunner.__init__`` builds its speculator through the name
``init_speculator`` that ``model_runner.py:106`` imports from
``spec_decode/__init__.py:8-40``; patching the ``spec_decode`` package attribute would
not reach it, so the model-runner module's name is replaced. A speculative config
carrying a ``ddtree`` dict (method ``dflash`` for vLLM) gets
``vllm_ddtree.draft.speculator.DDTreeSpeculator``; anything else the original.
"""

from __future__ import annotations

from vllm_ddtree.patches._guard import mark_patched, require_vllm_version

PATCHED_FUNCTION = "vllm.v1.worker.gpu.model_runner.init_speculator"


def apply() -> None:
    require_vllm_version(PATCHED_FUNCTION)
    import vllm.v1.worker.gpu.model_runner as model_runner

    original = model_runner.init_speculator
    if getattr(original, "_ddtree_patched", False):
        return

    def init_speculator(vllm_config, device):
        from vllm_ddtree.runtime_state import ddtree_config_of

        if ddtree_config_of(vllm_config.speculative_config) is None:
            return original(vllm_config, device)
        from vllm_ddtree.draft.speculator import DDTreeSpeculator

        return DDTreeSpeculator(vllm_config, device)

    mark_patched(init_speculator, original)
    model_runner.init_speculator = init_speculator
