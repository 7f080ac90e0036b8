"""Speed and agreement of ``training.static_decode.StaticGreedyDecoder`` against
transformers' greedy decoding of the same target (GPU: the CUDA-graph path).

    python evals/check_static_decode.py [--target vllm_ddtree/checkpoints/target]
        [--batch 256] [--prefix 512] [--new 384] [--check-rows 8] [--check-new 48]

Prints one JSON line: sequences per second of the static decoder (after a first call
that captures the graph), and for ``--check-rows`` rows the tokens of both decoders
compared (rows identical over ``--check-new`` tokens, mean length of the common
prefix: in bf16 two kernels may part at a near-tie, which is still the target's
greedy text).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from vllm_ddtree.training.static_decode import StaticGreedyDecoder  # noqa: E402
from vllm_ddtree.training.train_drafter import greedy_continue  # noqa: E402


def common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    """Length of the common prefix of two 1-D token tensors."""
    differ = (a != b).nonzero()
    return int(differ[0]) if differ.numel() else a.numel()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=str(REPO / "vllm_ddtree" / "checkpoints" / "target"))
    p.add_argument("--device", default=None)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--prefix", type=int, default=512)
    p.add_argument("--new", type=int, default=384)
    p.add_argument("--check-rows", type=int, default=8)
    p.add_argument("--check-new", type=int, default=48)
    args = p.parse_args(argv)
    from transformers import DeepseekV3ForCausalLM

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target = DeepseekV3ForCausalLM.from_pretrained(args.target, dtype=dtype).to(device).eval()
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(2, target.config.vocab_size, (args.batch, args.prefix),
                           generator=gen).to(device)
    decoder = StaticGreedyDecoder(target, args.batch, args.prefix + args.new)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    decoder(prefix, 8)  # captures the graph on CUDA
    sync()
    first_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = decoder(prefix, args.new)
    sync()
    seconds = time.perf_counter() - t0
    rows = min(args.check_rows, args.batch)
    ref = greedy_continue(target, prefix[:rows], args.check_new)[:, args.prefix:]
    got = out[:rows, args.prefix:args.prefix + args.check_new]
    lengths = [common_prefix(a, b) for a, b in zip(got, ref, strict=True)]
    print(json.dumps({
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "graph": decoder.use_graph, "batch": args.batch, "prefix": args.prefix,
        "new": args.new, "first_call_s": round(first_s, 3), "seconds": round(seconds, 3),
        "sequences_per_s": round(args.batch / seconds, 1),
        "ms_per_step": round(1000 * seconds / args.new, 3),
        "rows_identical": sum(n == args.check_new for n in lengths), "rows": rows,
        "mean_common_prefix": sum(lengths) / rows, "check_new": args.check_new,
    }), flush=True)


if __name__ == "__main__":
    main()
