"""Reference DFlash / DFlash2 + DDTree in plain PyTorch: the losslessness oracle and CPU
engine."""

from vllm_ddtree.reference.dflash2 import DFlash2DraftModel
from vllm_ddtree.reference.drafter import (
    DFlashContextCache,
    DFlashDraftModel,
    DrafterConfigError,
)
from vllm_ddtree.reference.engine import GenerationResult, RoundStats, generate
from vllm_ddtree.reference.replay import clip_rounds, compare_rounds, replay

__all__ = [
    "DFlash2DraftModel",
    "DFlashContextCache",
    "DFlashDraftModel",
    "DrafterConfigError",
    "GenerationResult",
    "RoundStats",
    "clip_rounds",
    "compare_rounds",
    "generate",
    "replay",
]
