"""Patch ``vllm.v1.worker.gpu.model_states.default.DefaultModelState.prepare_inputs``
and ``.prepare_dummy_inputs`` (vLLM 0.26.0).

The runner keeps ``input_batch.positions`` linear: slot mappings
(``model_runner.py:1067-1072`` -> ``block_table.py:168``), DFlash context positions
(``dflash/speculator.py:512-532``) and attention metadata need that. The model's
RoPE, however, must see each tree node at ``root + depth``. ``prepare_inputs``'s
result overrides the model inputs (``model_runner.py:1293-1301``), after slots and
attention metadata exist, so it returns a persistent DDTree positions buffer and, in
the same pass, writes the per-token ancestor bits the MLA tree backend reads
(``TREE_MASK_STATE``; the builder took a view of that buffer in ``prepare_attn``).
``prepare_dummy_inputs`` returns the same buffer, because FULL CUDA-graph capture
binds ``**model_state.prepare_dummy_inputs(...)`` (``cudagraph_utils.py:476-480``)
and replays whatever address it bound.
"""

from __future__ import annotations

from vllm_ddtree.patches._guard import mark_patched, require_vllm_version

PATCHED_FUNCTION = (
    "vllm.v1.worker.gpu.model_states.default.DefaultModelState.prepare_inputs / "
    "prepare_dummy_inputs"
)


def apply() -> None:
    require_vllm_version(PATCHED_FUNCTION)
    from vllm.v1.worker.gpu.model_states.default import DefaultModelState

    original_inputs = DefaultModelState.prepare_inputs
    original_dummy = DefaultModelState.prepare_dummy_inputs
    if getattr(original_inputs, "_ddtree_patched", False):
        return

    def uses_ddtree(model_state) -> bool:
        from vllm_ddtree.runtime_state import DDTREE_STATE, ddtree_config_of

        spec = model_state.vllm_config.speculative_config
        return DDTREE_STATE.enabled and ddtree_config_of(spec) is not None

    def prepare_inputs(self, input_batch, req_states):
        from vllm_ddtree.runtime_state import DDTREE_STATE, verify_inputs_

        if not uses_ddtree(self):
            return original_inputs(self, input_batch, req_states)
        if self.rope_state is not None:
            raise NotImplementedError("DDTree does not support M-RoPE targets yet")
        positions = verify_inputs_(
            DDTREE_STATE,
            input_batch.positions,
            input_batch.query_start_loc,
            input_batch.cu_num_logits,
            input_batch.idx_mapping,
            input_batch.num_tokens,
            input_batch.num_tokens_after_padding,
        )
        return {"positions": positions}

    def prepare_dummy_inputs(self, num_reqs, num_tokens):
        from vllm_ddtree.runtime_state import DDTREE_STATE

        model_inputs = original_dummy(self, num_reqs, num_tokens)
        if uses_ddtree(self):
            assert DDTREE_STATE.positions is not None
            model_inputs["positions"] = DDTREE_STATE.positions[:num_tokens]
        return model_inputs

    mark_patched(prepare_inputs, original_inputs)
    mark_patched(prepare_dummy_inputs, original_dummy)
    DefaultModelState.prepare_inputs = prepare_inputs
    DefaultModelState.prepare_dummy_inputs = prepare_dummy_inputs
