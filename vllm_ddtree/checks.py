"""Input checks shared by every public surface (speculative config, drafter config.json,
reference engine, CLI): one message shape, ``<where>: <field>=<value> is not allowed:
<what is allowed>``."""

from __future__ import annotations

from numbers import Integral
from typing import Any

__all__ = ["check_int", "int_range", "is_int", "not_allowed"]


def not_allowed(where: str, field: str, value: Any, allowed: str) -> str:
    """The message for ``field=value`` at ``where``, saying what is allowed."""
    return f"{where}: {field}={value!r} is not allowed: {allowed}"


def is_int(value: Any) -> bool:
    """An integer (Python or NumPy), not a bool."""
    return isinstance(value, Integral) and not isinstance(value, bool)


def int_range(lo: int, hi: int | None = None) -> str:
    """``"an int in lo..hi"`` / ``"an int >= lo"``."""
    return f"an int in {lo}..{hi}" if hi is not None else f"an int >= {lo}"


def check_int(where: str, field: str, value: Any, lo: int, hi: int | None = None,
              note: str = "", error: type[ValueError] = ValueError) -> int:
    """``value`` is an int in ``lo..hi`` (``hi`` None: no upper bound); else ``error``."""
    if not is_int(value) or value < lo or (hi is not None and value > hi):
        allowed = int_range(lo, hi) + (f" ({note})" if note else "")
        raise error(not_allowed(where, field, value, allowed))
    return int(value)
