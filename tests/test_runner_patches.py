"""CPU tests of the V2-runner patches of a DDTree run (``vllm_ddtree.patches``): which
patches a process applies, the target's tree attention backend, the config helpers and
the tree-positions patch."""

import os
from types import SimpleNamespace as NS

import pytest
from test_ddtree_integration_units import (
    BUDGET,
    _restore_tree_mask_state,  # noqa: F401 - autouse fixture
    make_scenario,
    new_state,
)


def test_runner_patches_apply_idempotently_and_stay_out_of_patch_modules(monkeypatch):
    import vllm.v1.worker.gpu.model_runner as model_runner
    from vllm.config.speculative import SpeculativeConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.worker.gpu.model_states.default import DefaultModelState

    from vllm_ddtree import patches

    undo_runner_patches_after_test(monkeypatch)

    assert patches.PATCH_MODULES == ["speculative_config", "spec_decode_metrics",
                                     "request_validation", "prompt_token_ids",
                                     "mla_fp32_prefill"]
    assert set(patches.RUNNER_PATCHES).isdisjoint(patches.PATCH_MODULES)
    applied = patches.apply_runner_patches()
    assert applied == patches.PATCH_MODULES + patches.RUNNER_PATCHES
    patches.apply_runner_patches()

    assert model_runner.init_speculator._ddtree_patched
    assert not getattr(model_runner.init_speculator._ddtree_original, "_ddtree_patched", False)
    for fn in (DefaultModelState.custom_sampler, DefaultModelState.prepare_inputs,
               DefaultModelState.prepare_dummy_inputs, Scheduler.__init__,
               EngineArgs.create_speculative_config):
        assert fn._ddtree_patched
    slots = SpeculativeConfig.max_num_new_slots_for_drafting.fget
    drafter = NS(hf_config=NS(block_size=16))
    assert slots(NS(ddtree={"budget": 64, "top_k": None}, draft_model_config=drafter)) == 14
    dflash = NS(ddtree=None, parallel_drafting=True, num_speculative_tokens=15,
                uses_draft_model=lambda: False)
    assert slots(dflash) == 14


def test_runner_env_applies_runner_patches(monkeypatch):
    """VLLM_DDTREE_RUNNER=1 (set by the front end of a DDTree run) makes apply_all (the
    plugin, in every vLLM process it starts) apply the runner patches too; without it
    vLLM's runner stays untouched; other values are refused by name."""
    import vllm.v1.worker.gpu.model_runner as model_runner
    from vllm.engine.arg_utils import EngineArgs

    from vllm_ddtree import patches

    undo_runner_patches_after_test(monkeypatch)

    monkeypatch.setenv(patches.RUNNER_ENV, "yes")
    with pytest.raises(ValueError, match=patches.RUNNER_ENV):
        patches.apply_all()
    monkeypatch.setenv(patches.RUNNER_ENV, "0")
    assert patches.apply_all() == patches.PATCH_MODULES
    assert not getattr(model_runner.init_speculator, "_ddtree_patched", False)
    monkeypatch.setenv(patches.RUNNER_ENV, "1")
    assert patches.apply_all() == patches.PATCH_MODULES + patches.RUNNER_PATCHES
    assert model_runner.init_speculator._ddtree_patched
    assert EngineArgs.create_speculative_config._ddtree_patched


def test_target_backend_choice_per_target(monkeypatch, custom_backend_slot):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from vllm_ddtree.attention_backends.gqa_tree.backend import TreeGQABackend
    from vllm_ddtree.attention_backends.mla_tree.backend import TreeMLABackend
    from vllm_ddtree.config import DDTreeConfigError
    from vllm_ddtree.patches.speculative_config import choose_target_attention_backend

    TREE_BACKEND_ENV = "VLLM_DDTREE_TREE_BACKEND"
    # setenv (not delenv, which records nothing for an unset variable) so that the
    # value choose_target_attention_backend writes is undone after the test
    monkeypatch.setenv(TREE_BACKEND_ENV, "")
    args = NS(attention_backend=None, attention_config=NS(backend=None))
    choose_target_attention_backend(args, NS(use_mla=False, get_head_size=lambda: 64))
    assert args.attention_backend == "CUSTOM"
    assert os.environ[TREE_BACKEND_ENV] == "gqa"
    assert AttentionBackendEnum.CUSTOM.get_class() is TreeGQABackend
    choose_target_attention_backend(args, NS(use_mla=True))  # CUSTOM chosen: fine
    assert os.environ[TREE_BACKEND_ENV] == "mla"
    assert AttentionBackendEnum.CUSTOM.get_class() is TreeMLABackend
    for chosen, target in (("FLASHMLA", True), ("FLASH_ATTN", False)):
        with pytest.raises(DDTreeConfigError, match="tree mask"):
            choose_target_attention_backend(
                NS(attention_backend=chosen, attention_config=NS(backend=None)),
                NS(use_mla=target))


def test_config_helpers_read_the_attached_ddtree_dict():
    from vllm_ddtree.config import DDTreeConfig
    from vllm_ddtree.runtime_state import ddtree_config_of, drafter_block_size

    assert ddtree_config_of(None) is None and ddtree_config_of(NS()) is None
    assert ddtree_config_of(NS(ddtree={"budget": 8, "top_k": 3})) == DDTreeConfig(8, 3)
    # vLLM wraps the drafter config in EAGLEConfig; block_size may sit on .model
    wrapped = NS(draft_model_config=NS(hf_config=NS(model=NS(block_size=16))))
    assert drafter_block_size(wrapped) == 16
    with pytest.raises(ValueError, match="block_size"):
        drafter_block_size(NS(draft_model_config=NS(hf_config=NS())))


def test_tree_positions_patch_only_acts_for_ddtree_configs(monkeypatch):
    from vllm.v1.worker.gpu.model_states.default import DefaultModelState

    import vllm_ddtree.patches.tree_positions as tree_positions
    from vllm_ddtree import runtime_state

    for name in ("prepare_inputs", "prepare_dummy_inputs"):
        monkeypatch.setattr(DefaultModelState, name, getattr(DefaultModelState, name))
    tree_positions.apply()
    state = new_state()
    monkeypatch.setattr(runtime_state, "DDTREE_STATE", state)
    model_state = DefaultModelState.__new__(DefaultModelState)
    model_state.rope_state = None
    model_state.supports_mm_inputs = False
    model_state.vllm_config = NS(speculative_config=NS(ddtree=None))
    assert model_state.prepare_dummy_inputs(2, 8) == {}
    model_state.vllm_config = NS(speculative_config=NS(ddtree={"budget": BUDGET}))
    got = model_state.prepare_dummy_inputs(2, 8)["positions"]
    assert got.data_ptr() == state.positions.data_ptr() and got.shape == (8,)
    sc = make_scenario(0.0)
    b = sc.batch
    b.num_tokens_after_padding = b.num_tokens
    state.depths.copy_(sc.state.depths)
    state.ancestor_bits.copy_(sc.state.ancestor_bits)
    pos = model_state.prepare_inputs(b, None)["positions"]
    assert int(pos[1]) == int(b.positions[0]) + int(sc.trees.depths[0, 0])


def undo_runner_patches_after_test(monkeypatch) -> None:
    """Apply the released patches, then make monkeypatch restore every attribute the
    runner patches replace: other tests expect a process without DDTree (vLLM's own
    runner code)."""
    import vllm.v1.worker.gpu.model_runner as model_runner
    from vllm.config.speculative import SpeculativeConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.worker.gpu.model_states.default import DefaultModelState

    from vllm_ddtree import patches

    # apply_runner_patches sets VLLM_DDTREE_RUNNER: restore it afterwards
    monkeypatch.setenv(patches.RUNNER_ENV, "0")
    patches.apply_all()
    for owner, name in [(model_runner, "init_speculator"),
                        (EngineArgs, "create_speculative_config"),
                        (EngineArgs, "_set_default_max_num_seqs_and_batched_tokens_args"),
                        (Scheduler, "__init__"),
                        (DefaultModelState, "custom_sampler"),
                        (DefaultModelState, "prepare_inputs"),
                        (DefaultModelState, "prepare_dummy_inputs")]:
        monkeypatch.setattr(owner, name, getattr(owner, name))
    monkeypatch.setattr(SpeculativeConfig, "max_num_new_slots_for_drafting",
                        SpeculativeConfig.__dict__["max_num_new_slots_for_drafting"])
