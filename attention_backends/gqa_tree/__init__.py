# SPDX-License-Identifier: Apache-2.0
"""GQA tree-verify attention: Triton kernel and its PyTorch reference."""

from .configs import GQA_TILE_CONFIGS, GQATileConfig, estimate_shared_memory_bytes, select_config
from .ops import gqa_tree_verify
from .reference import gqa_tree_verify_reference

__all__ = [
    "GQA_TILE_CONFIGS",
    "GQATileConfig",
    "estimate_shared_memory_bytes",
    "gqa_tree_verify",
    "gqa_tree_verify_reference",
    "select_config",
]
