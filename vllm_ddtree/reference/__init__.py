"""Reference DFlash + DDTree in plain PyTorch: the losslessness oracle and CPU engine."""

from vllm_ddtree.reference.drafter import (
    DFlashContextCache,
    DFlashDraftModel,
    DrafterConfigError,
)
from vllm_ddtree.reference.engine import GenerationResult, RoundStats, generate

__all__ = [
    "DFlashContextCache",
    "DFlashDraftModel",
    "DrafterConfigError",
    "GenerationResult",
    "RoundStats",
    "generate",
]
