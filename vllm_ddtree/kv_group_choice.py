"""DDTree's default KV-cache grouping: one group where it does not cost more KV memory.

vLLM's hybrid KV-cache manager gives every layer of an MLA target beside a drafter with
sliding-window layers its own KV-cache group, and each group costs scheduler host time
in every step (at batch 64 with 64 drafts a step: 5.45 ms for Kimi-K2 beside a
K2.6-shaped drafter in 67 groups against 0.75 ms in one, ``evals/results/
kv_cache_groups.md``); it also shortens prefix-cache hits where it stretches the
drafter's pages. One group (``disable_hybrid_kv_cache_manager``) keeps the drafter's
sliding layers' KV for the whole context instead. Where the user did not choose, DDTree
picks one group when the target has no windows of its own and one group takes at most
``ONE_GROUP_MAX_KV_RATIO`` times the hybrid manager's KV bytes per context token, and
logs the choice. Called by the DDTree front end (``patches/speculative_config.py``)
before vLLM builds its ``SchedulerConfig``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from vllm_ddtree.kv_grouping import (
    DRAFTER_SLIDING_BLOCK,
    KVPairShape,
    kv_bytes_per_token,
    pair_kv_shape,
    target_has_own_windows,
    vllm_kv_cache_groups,
)

# a child of vLLM's "vllm" logger, so the note shows in `vllm serve`'s log
logger = logging.getLogger("vllm.ddtree.kv_group_choice")

# One group at most this many times the hybrid manager's KV bytes per context token.
ONE_GROUP_MAX_KV_RATIO = 1.10
KEEP_HYBRID_FLAG = "--no-disable-hybrid-kv-cache-manager"
ONE_GROUP_FLAG = "--disable-hybrid-kv-cache-manager"


@dataclass(frozen=True)
class KVGroupingChoice:
    """``disable_hybrid_kv_cache_manager``: the value DDTree sets (True: one group), or
    None to leave the engine argument as it is; ``note``: which and why, with numbers."""

    disable_hybrid_kv_cache_manager: bool | None
    note: str


def user_or_target_choice(user_choice: bool | None, own_windows: str | None
                          ) -> KVGroupingChoice | None:
    """The grouping that is not DDTree's to pick, or None when it is.

    Args:
        user_choice: ``disable_hybrid_kv_cache_manager`` as the user left it: None when
            unset (vLLM's default), True / False when chosen (kept either way).
        own_windows: what the target keeps other than full attention
            (:func:`vllm_ddtree.kv_grouping.target_has_own_windows`), or None: then the
            hybrid manager stays, which gives those layers groups of their own.
    """
    if user_choice is not None:
        flag = ONE_GROUP_FLAG if user_choice else KEEP_HYBRID_FLAG
        return KVGroupingChoice(None, f"DDTree: KV-cache grouping as chosen "
                                      f"(disable_hybrid_kv_cache_manager={user_choice}: {flag})")
    if own_windows is not None:
        return KVGroupingChoice(None, (
            f"DDTree: vLLM's hybrid KV-cache manager kept: the target has its own "
            f"{own_windows}, which one KV-cache group would give full-context KV"))
    return None


def choose_by_kv_bytes(shape: KVPairShape, page: int) -> KVGroupingChoice:
    """One KV-cache group for ``shape`` on ``page``-token pages where it takes at most
    ``ONE_GROUP_MAX_KV_RATIO`` times the hybrid manager's KV bytes per context token
    (:func:`vllm_ddtree.kv_grouping.kv_bytes_per_token`) and the hybrid manager forms
    more than one group; else vLLM's default is left."""
    try:
        groups = len(vllm_kv_cache_groups(shape, hybrid=True, page=page,
                                          sliding_page=DRAFTER_SLIDING_BLOCK))
        if groups == 1:
            return KVGroupingChoice(None, "DDTree: the hybrid KV-cache manager forms one "
                                          "KV-cache group for this pair; nothing to choose")
        hybrid_bytes = kv_bytes_per_token(shape, hybrid=True, page=page)
        one_bytes = kv_bytes_per_token(shape, hybrid=False, page=page)
    except (ValueError, NotImplementedError) as error:
        return KVGroupingChoice(None, (
            f"DDTree: vLLM's hybrid KV-cache manager kept: the KV bytes of one group could "
            f"not be compared with it ({error})"))
    ratio = one_bytes / hybrid_bytes
    numbers = (f"one group takes {one_bytes:,} KV bytes per context token against "
               f"{hybrid_bytes:,} in the hybrid manager's {groups} groups ({ratio:.2f}x")
    if ratio <= ONE_GROUP_MAX_KV_RATIO:
        return KVGroupingChoice(True, (
            f"DDTree: one KV-cache group (disable_hybrid_kv_cache_manager=True): {numbers} "
            f"<= {ONE_GROUP_MAX_KV_RATIO:.2f}x), and every group costs scheduler time each "
            f"step; {KEEP_HYBRID_FLAG} keeps the hybrid manager"))
    return KVGroupingChoice(None, (
        f"DDTree: vLLM's hybrid KV-cache manager kept: {numbers} > "
        f"{ONE_GROUP_MAX_KV_RATIO:.2f}x); {ONE_GROUP_FLAG} makes one group (less "
        f"scheduler time per step, more KV memory)"))


def engine_page_size(engine_args: Any) -> int:
    """The target's KV page in tokens: ``--block-size`` when set, else what the tree
    backend registered as ``CUSTOM`` prefers (vLLM's
    ``Platform.update_block_size_for_backend``): 64 for MLA, vLLM's 16 for GQA."""
    if engine_args.block_size is not None:
        return engine_args.block_size
    from vllm.config import CacheConfig
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    backend = AttentionBackendEnum.CUSTOM.get_class()
    return backend.get_preferred_block_size(CacheConfig.DEFAULT_BLOCK_SIZE)


def kv_cache_dtype(name: str, target_model_config: Any):
    """The torch dtype of a KV cache named ``name`` (``--kv-cache-dtype``, or the
    speculative config's ``kv_cache_dtype`` for the drafter), ``auto`` being the model's
    (the drafter's model dtype is the target's)."""
    from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype

    try:
        return kv_cache_dtype_str_to_dtype(name, target_model_config)
    except KeyError:  # a format vLLM sizes otherwise (no tree backend takes it)
        return target_model_config.dtype


def prefer_one_kv_cache_group(engine_args: Any, target_model_config: Any, drafter_config: Any,
                              target_parallel_config: Any,
                              drafter_kv_cache_dtype: str | None = None) -> KVGroupingChoice:
    """Set ``engine_args.disable_hybrid_kv_cache_manager = True`` where the user left it
    unset, the target has no windows of its own and :func:`choose_by_kv_bytes` picks
    one group for this target (vLLM ``ModelConfig``) and drafter (transformers config)
    at the engine's page size and KV dtypes; log the choice in one INFO line.
    ``drafter_kv_cache_dtype``: the speculative config's ``kv_cache_dtype`` (vLLM builds
    the drafter's KV cache in it, ``dflash/utils.py:load_dflash_model``); None: the
    drafter's cache takes ``--kv-cache-dtype`` as the target's does.
    Runs after the tree backend is registered as ``CUSTOM``. Returns the choice."""
    user_choice = engine_args.disable_hybrid_kv_cache_manager
    choice = user_or_target_choice(user_choice, None if user_choice is not None else (
        target_has_own_windows(target_model_config.hf_text_config,
                               target_model_config.is_hybrid)))
    if choice is None:
        shape = pair_kv_shape(
            target_model_config.hf_text_config, drafter_config,
            tensor_parallel_size=target_parallel_config.tensor_parallel_size,
            dtype=kv_cache_dtype(engine_args.kv_cache_dtype, target_model_config),
            target_mla=target_model_config.use_mla,
            drafter_dtype=None if drafter_kv_cache_dtype is None else kv_cache_dtype(
                drafter_kv_cache_dtype, target_model_config))
        choice = choose_by_kv_bytes(shape, engine_page_size(engine_args))
    if choice.disable_hybrid_kv_cache_manager is not None:
        engine_args.disable_hybrid_kv_cache_manager = choice.disable_hybrid_kv_cache_manager
    logger.info(choice.note)
    return choice
