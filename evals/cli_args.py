"""argparse types shared by the evals entry points.

A refused value exits with status 2 and a message naming the option, the value and
what is allowed (``argument --repeats: 0 is not allowed: an integer >= 1``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from vllm_ddtree.cli_args import device_arg, float_arg, int_arg  # noqa: E402

__all__ = ["device_arg", "float_arg", "fraction", "int_arg", "json_object", "non_negative_float",
           "non_negative_int", "positive_float", "positive_int"]

positive_int = int_arg(1)
non_negative_int = int_arg(0)
positive_float = float_arg(0.0, lo_open=True)
non_negative_float = float_arg(0.0)
fraction = float_arg(0.0, 1.0)


def json_object(text: str) -> dict:
    """argparse ``type``: a JSON object (``{...}``), returned as a dict."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not allowed: a JSON object ({err.msg} at character {err.pos})"
        ) from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed: a JSON object {{...}}")
    return value
