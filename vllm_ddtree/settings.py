"""Every environment switch of vllm-ddtree, declared once, with one parser.

A switch is read with :func:`get` (a choice, validated) or :func:`is_set`; an unknown or
malformed value raises :class:`SettingError` naming the variable, the value and what is
allowed. The README's switch table is :func:`markdown_table` (``python -m
vllm_ddtree.settings`` prints it; a test fails when the two drift apart).

Internal switches are set by the plugin itself (the front end of a DDTree run, for the
engine and worker processes it starts); they are listed so that nothing reads an
undeclared variable, not for users to set.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["SWITCHES", "SettingError", "Switch", "check_all", "get", "markdown_table",
           "set_for_children"]


class SettingError(ValueError):
    """An environment switch holds a value outside its choices."""


@dataclass(frozen=True)
class Switch:
    """One environment switch: its name, default, allowed values and a one-line doc."""

    name: str
    default: str
    choices: tuple[str, ...]
    doc: str
    internal: bool = False


SWITCHES: tuple[Switch, ...] = (
    Switch(
        "VLLM_DDTREE_MLA_KERNEL", "auto", ("auto", "triton", "cascade"),
        "MLA tree-verify kernel. `auto`: on sm_90 the kernel measured fastest for the launch "
        "(`mla_tree/dispatch_table.py`), else Gluon (16-bit cache) or the transposed fp8 "
        "kernel; Triton elsewhere; `triton`: always Triton; `cascade`: FlashMLA over the "
        "context, ours over the tree, wherever that applies.",
    ),
    Switch(
        "VLLM_DDTREE_TREE_BACKEND", "mla", ("mla", "gqa"),
        "Which tree-verify attention backend fills vLLM's `--attention-backend CUSTOM` slot; "
        "set by the front end from the target's attention (MLA or GQA/MHA).",
        internal=True,
    ),
    Switch(
        "VLLM_DDTREE_RUNNER", "0", ("0", "1"),
        "`1` in the engine and worker processes of a `method: ddtree` run (set by its front "
        "end): apply the V2-runner patches there. Other vLLM runs keep vLLM's own runner.",
        internal=True,
    ),
)

_BY_NAME = {switch.name: switch for switch in SWITCHES}


def _switch(name: str) -> Switch:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"{name} is not a declared vllm-ddtree switch "
                       f"(declared: {', '.join(_BY_NAME)})") from None


def get(name: str) -> str:
    """The value of switch ``name`` from the environment, or its default when unset or
    empty. Raises :class:`SettingError` for a value outside the switch's choices."""
    switch = _switch(name)
    value = os.environ.get(name, "").strip()
    if not value:
        return switch.default
    if value not in switch.choices:
        raise SettingError(f"{name}={value!r} is not allowed: choose one of "
                           f"{', '.join(switch.choices)} (default {switch.default})")
    return value


def check_all() -> None:
    """Read every declared switch (:func:`get`): a value outside its choices raises
    :class:`SettingError` now, at a DDTree run's start-up, not at its first use inside
    a worker."""
    for switch in SWITCHES:
        get(switch.name)


def set_for_children(name: str, value: str) -> None:
    """Set switch ``name`` in this process's environment (inherited by the processes it
    starts), after checking ``value`` against its choices."""
    switch = _switch(name)
    if value not in switch.choices:
        raise SettingError(f"{name}={value!r} is not allowed: choose one of "
                           f"{', '.join(switch.choices)}")
    os.environ[name] = value


def markdown_table() -> str:
    """The README's switch table: every switch, its default, its choices and its doc."""
    lines = ["| variable | default | choices | what it does |", "|---|---|---|---|"]
    for switch in SWITCHES:
        doc = ("(set by the plugin) " if switch.internal else "") + switch.doc
        choices = ", ".join(f"`{c}`" for c in switch.choices)
        lines.append(f"| `{switch.name}` | `{switch.default}` | {choices} | {doc} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown_table())
