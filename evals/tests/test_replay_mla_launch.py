# SPDX-License-Identifier: Apache-2.0
"""evals/replay_mla_launch.py: the launch lines ``VLLM_DDTREE_LOG_LAUNCHES=1`` prints
parse back, and the replayed inputs (logged q strides, padded page stride) are a valid
launch that the kernel computes as the fp32 reference does (CPU: Triton interpreter)."""

import logging
import sys
from pathlib import Path

import torch
from test_mla_tree_kernel import make_batch
from vllm_ddtree.attention_backends.mla_tree import mla_tree_verify, mla_tree_verify_reference, ops

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "evals"))
import replay_mla_launch as replay  # noqa: E402


def _logged_lines(caplog, batch, **kwargs) -> str:
    ops._LOGGED_LAUNCHES.clear()
    with caplog.at_level(logging.DEBUG, logger=ops.logger.name):
        mla_tree_verify(**batch, **kwargs)
    return "\n".join("INFO noise" + "\n" + r.getMessage() for r in caplog.records)


def test_logged_launches_parse_back(caplog):
    batch = make_batch([(5, [-1, 0, 0]), (9, [-1, 0])], page_size=4)
    text = _logged_lines(caplog, batch, kernel="triton", num_kv_splits=1)
    launches = replay.parse_launches(text + "\n" + text)  # duplicates collapse
    assert len(launches) == 1
    launch = launches[0]
    assert launch.kernel == "triton"
    assert launch.q_shape == tuple(batch["q"].shape)
    assert launch.q_stride == batch["q"].stride()
    assert launch.kv_shape == tuple(batch["kv_cache"].shape)
    assert launch.param("requests") == "2" and launch.param("max_query_len") == "3"
    assert launch.param("kv_lora_rank") == str(batch["kv_lora_rank"])
    assert launch.param("config").startswith("(")


def test_replayed_inputs_with_a_padded_page_stride_match_the_reference():
    head_dim, page = 80, 4
    line = (f"mla_tree launch triton: q (8, 2, {head_dim}) ({2 * head_dim}, {head_dim}, 1), "
            f"kv_cache (50, {page}, {head_dim}) ({3 * page * head_dim}, {head_dim}, 1), "
            "active=False, config=(16, 32, 4), kv_lora_rank=64, max_query_len=3, "
            "max_seq_len=4096, requests=2, row_blocks=1, splits=2")
    (launch,) = replay.parse_launches(line)
    for compact in (False, True):
        kwargs = replay.build_inputs(launch, 11, "cpu", torch.float32, compact=compact)
        stride = kwargs["kv_cache"].stride(0)
        assert stride == (page * head_dim if compact else 3 * page * head_dim)
        out, lse = mla_tree_verify(**kwargs, num_kv_splits=2)
        ref_out, ref_lse = mla_tree_verify_reference(**kwargs)
        rows = 2 * 3  # the logged q has 8 rows; requests use the first 6
        torch.testing.assert_close(out[:rows], ref_out[:rows], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(lse[:rows], ref_lse[:rows], atol=1e-4, rtol=1e-4)
