import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

# Triton kernels run in the interpreter on CPU machines; the variable must be set
# before triton is first imported (vLLM imports it), so here, before any test module.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
