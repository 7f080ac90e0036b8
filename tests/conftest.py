import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

# Triton kernels run in the interpreter on CPU machines; the variable must be set
# before triton is first imported (vLLM imports it), so here, before any test module.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def custom_backend_slot():
    """Restore vLLM's ``AttentionBackendEnum.CUSTOM`` registration after a test."""
    from vllm.v1.attention.backends import registry

    custom = registry.AttentionBackendEnum.CUSTOM
    saved = registry._ATTN_OVERRIDES.get(custom)
    yield custom
    if saved is None:
        registry._ATTN_OVERRIDES.pop(custom, None)
    else:
        registry._ATTN_OVERRIDES[custom] = saved
