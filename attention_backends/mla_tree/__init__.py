# SPDX-License-Identifier: Apache-2.0
"""MLA tree-verify attention: Triton and Gluon (sm_90) kernels, their launcher and the PyTorch
reference."""

from .configs import (
    MLA_TILE_CONFIGS,
    SM120_SHARED_MEMORY_BYTES,
    MLATileConfig,
    estimate_shared_memory_bytes,
    select_config,
    select_num_kv_splits,
)
from .ops import mla_tree_verify, quantize_query
from .reference import mla_tree_verify_reference
from .tree_mask import (
    ancestor_bits_from_parents,
    causal_ancestor_bits,
    dense_new_token_mask,
    num_mask_words,
)

__all__ = [
    "MLA_TILE_CONFIGS",
    "SM120_SHARED_MEMORY_BYTES",
    "MLATileConfig",
    "ancestor_bits_from_parents",
    "causal_ancestor_bits",
    "dense_new_token_mask",
    "estimate_shared_memory_bytes",
    "mla_tree_verify",
    "mla_tree_verify_reference",
    "quantize_query",
    "num_mask_words",
    "select_config",
    "select_num_kv_splits",
]
