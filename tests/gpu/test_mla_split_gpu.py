# SPDX-License-Identifier: Apache-2.0
"""Tree verify split into a FlashMLA context part and the masked tree tail
(``attention_backends/mla_tree/split.py``) against the fp32 reference on a Hopper GPU
(bf16, kv_lora 512 + rope 64, 64-token pages), eager and in a CUDA graph."""

import os

import pytest
import torch

if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
    pytest.skip("needs a Hopper (sm_90) GPU", allow_module_level=True)
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("TRITON_INTERPRET=1: run tests/gpu in its own process", allow_module_level=True)

from test_mla_tree_kernel_gpu import LSE_TOL, OUT_TOL, make_batch  # noqa: E402
from vllm_ddtree.attention_backends.mla_tree import mla_tree_verify_reference  # noqa: E402
from vllm_ddtree.attention_backends.mla_tree.split import (  # noqa: E402
    context_attention_flashmla,
    mla_tree_verify_split,
)


def split_batch(heads, contexts, qlen, seed=0):
    batch = make_batch([(c, "tree", qlen) for c in contexts], heads=heads, page_size=64,
                       seed=seed)
    return batch, batch.pop("query_start_loc")


@pytest.mark.parametrize("fused_tail", [False, True])
@pytest.mark.parametrize("heads", [8, 64])
@pytest.mark.parametrize("qlen", [16, 65, 129])
def test_flashmla_context_plus_tail_matches_reference(heads, qlen, fused_tail):
    """Contexts ending inside a page (1000, 5003) and a long one (33000); the tail in
    PyTorch or in the fused Triton tail + merge kernel."""
    batch, qsl = split_batch(heads, [1000, 5003, 33000], qlen, seed=heads + qlen)
    out, lse = mla_tree_verify_split(query_len=qlen, context_fn=context_attention_flashmla,
                                     fused_tail=fused_tail, **batch)
    ref_out, ref_lse = mla_tree_verify_reference(query_start_loc=qsl, **batch)
    torch.testing.assert_close(out.float(), ref_out.float(), **OUT_TOL)
    torch.testing.assert_close(lse, ref_lse, **LSE_TOL)


def test_split_replays_in_a_cuda_graph():
    batch, _ = split_batch(8, [8000, 300], 65, seed=3)

    def launch():
        return mla_tree_verify_split(query_len=65, context_fn=context_attention_flashmla,
                                     fused_tail=True, **batch)

    expected, _ = launch()  # plans FlashMLA's schedule outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, _ = launch()
    batch["q"].mul_(-1.0)
    graph.replay()
    torch.cuda.synchronize()
    fresh, _ = launch()
    torch.testing.assert_close(out, fresh, atol=0, rtol=0)
    assert not torch.allclose(out.float(), expected.float(), atol=1e-2)
