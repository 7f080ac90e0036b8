"""argparse types of the command-line entry points: each refuses a bad value with a message
naming the value and what is allowed (argparse adds the option and exits with status 2)."""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable

__all__ = ["DEVICE", "device_arg", "float_arg", "int_arg"]

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
