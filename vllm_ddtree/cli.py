"""``vllm-ddtree`` command line: ``vllm-ddtree demo [--prompts N] ...``.

Arguments are checked by argparse before any model loads: a bad value exits with
status 2 and a message naming the option, the value and the allowed range.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable

from vllm_ddtree.demo import LIMITS

DEVICE = re.compile(r"cpu|cuda(:\d+)?")


def _allowed(kind: str, lo: float, hi: float | None, lo_open: bool, note: str) -> str:
    """``"an integer in 1..164 (note)"``, ``"a number > 0"``, ..."""
    if hi is not None:
        text = f"{kind} in {lo:g}..{hi:g}"
    else:
        text = f"{kind} {'>' if lo_open else '>='} {lo:g}"
    return f"{text} ({note})" if note else text


def int_arg(lo: int, hi: int | None = None, note: str = "") -> Callable[[str], int]:
    """argparse ``type``: an integer in ``lo..hi`` (``hi`` None: no upper bound)."""
    allowed = _allowed("an integer", lo, hi, False, note)

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not allowed: {allowed}") from None
        if value < lo or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"{value} is not allowed: {allowed}")
        return value

    return parse


def float_arg(lo: float, hi: float | None = None, lo_open: bool = False,
              note: str = "") -> Callable[[str], float]:
    """argparse ``type``: a finite number ``>= lo`` (``> lo`` with ``lo_open``), at most
    ``hi`` when given."""
    allowed = _allowed("a finite number", lo, hi, lo_open, note)

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not allowed: {allowed}") from None
        low = value <= lo if lo_open else value < lo
        if not math.isfinite(value) or low or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"{text} is not allowed: {allowed}")
        return value

    return parse


def device_arg(text: str) -> str:
    """argparse ``type``: a torch device, ``cpu``, ``cuda`` or ``cuda:<index>``."""
    if not DEVICE.fullmatch(text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not allowed: 'cpu', 'cuda' or 'cuda:<index>'")
    return text


def demo_arg(field: str) -> Callable[[str], int]:
    """argparse ``type`` of a demo argument, bounded as ``vllm_ddtree.demo.LIMITS``."""
    return int_arg(*LIMITS[field])


def add_demo_args(parser: argparse.ArgumentParser) -> None:
    """``--prompts``, ``--max-new-tokens`` and ``--budget``, with their ranges."""
    parser.add_argument("--prompts", type=demo_arg("num_prompts"), default=3,
                        help="HumanEval prompts, 1..164")
    parser.add_argument("--max-new-tokens", type=demo_arg("max_new_tokens"), default=64)
    parser.add_argument("--budget", type=demo_arg("budget"), default=32,
                        help="DDTree nodes per round, 1..512")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vllm-ddtree")
    sub = parser.add_subparsers(dest="command")
    demo = sub.add_parser("demo", help="complete HumanEval prompts: AR vs DFlash vs DDTree")
    add_demo_args(demo)
    demo.add_argument("--engine", choices=["reference", "vllm"], default="reference")
    args = parser.parse_args(argv)
    if args.command in (None, "demo"):
        if getattr(args, "engine", "reference") == "vllm":
            from vllm_ddtree.demo.vllm_engine import run_demo_vllm as run_demo
        else:
            from vllm_ddtree.demo.reference_engine import run_demo
        print(run_demo(getattr(args, "prompts", 3), getattr(args, "max_new_tokens", 64),
                       getattr(args, "budget", 32)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
