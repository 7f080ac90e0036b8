"""Checks of the ``ddtree-ref`` lm-eval model's arguments, before any model loads.

Errors are ``ValueError``s of the form ``"ddtree-ref: <arg>=<value> is not allowed:
<what is allowed>"`` (:func:`vllm_ddtree.reference.inputs.refuse`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vllm_ddtree.checks import check_int
from vllm_ddtree.cli_args import DEVICE
from vllm_ddtree.reference.inputs import (
    INT64,
    MAX_BUDGET,
    METHODS,
    check_choice,
    check_optional_int,
    check_real,
    refuse,
)

WHERE = "ddtree-ref"
DTYPES = ("float32", "bfloat16", "float16")
# Model args of DDTreeRefLM; lm-eval adds batch_size, max_batch_size and device.
ARG_NAMES = ("pretrained", "drafter", "method", "budget", "top_k", "temperature", "seed",
             "dtype", "device", "max_length", "threads", "max_gen_toks", "pair",
             "batch_size", "max_batch_size")


def check_device(where: str, field: str, value: Any) -> None:
    """None, ``"cpu"``, ``"cuda"`` or ``"cuda:<index>"``."""
    if value is not None and not (isinstance(value, str) and DEVICE.fullmatch(value)):
        raise refuse(where, field, value, "'cpu', 'cuda' or 'cuda:<index>'")


def check_model_dir(where: str, field: str, value: Any, what: str) -> None:
    """None or a local directory holding ``config.json``."""
    if value is None:
        return
    if not isinstance(value, (str, Path)) or not (Path(value) / "config.json").is_file():
        raise refuse(where, field, str(value) if isinstance(value, Path) else value,
                     f"a local directory holding config.json ({what})")


def check_pair_dirs(where: str, pretrained, drafter) -> None:
    """The drafter's ``config.json`` fits the target's (hidden size, vocabulary, layer
    ids: :func:`vllm_ddtree.drafter_config.check_drafter_target_pair`); reads configs
    only."""
    from transformers import AutoConfig

    from vllm_ddtree.drafter_config import DrafterConfigError, check_drafter_target_pair

    try:
        check_drafter_target_pair(AutoConfig.from_pretrained(str(drafter)),
                                  AutoConfig.from_pretrained(str(pretrained)))
    except DrafterConfigError as err:
        raise refuse(where, "drafter", str(drafter),
                     f"a DFlash drafter made for pretrained={str(pretrained)!r}: {err}") from None


def check_ref_lm_args(args: dict[str, Any], where: str = WHERE) -> None:
    """Check ``DDTreeRefLM`` model args: known names; ``method`` (ar, dflash, ddtree);
    ``budget`` (int, 1..512); ``top_k``, ``threads``, ``max_length`` (None or int
    >= 1); ``max_gen_toks`` (int >= 1); ``temperature`` (finite, >= 0); ``seed`` (int);
    ``dtype``; ``device`` (cpu, cuda, cuda:N); ``pretrained`` / ``drafter`` (local
    directories with config.json, a drafter needed with ``pretrained`` for dflash
    and ddtree, and made for that target). Absent args take ``DDTreeRefLM``'s
    defaults."""
    unknown = sorted(set(args) - set(ARG_NAMES))
    if unknown:
        raise refuse(where, "model argument", unknown[0],
                     "one of " + ", ".join(ARG_NAMES[:-3]))
    method = check_choice(where, "method", args.get("method", "ddtree"), METHODS)
    check_int(where, "budget", args.get("budget", 32), 1, MAX_BUDGET, "tree nodes per round")
    check_optional_int(where, "top_k", args.get("top_k"), 1)
    check_real(where, "temperature", args.get("temperature", 0.0))
    check_int(where, "seed", args.get("seed", 0), *INT64)
    check_choice(where, "dtype", args.get("dtype", "float32"), DTYPES)
    check_device(where, "device", args.get("device", "cpu"))
    check_optional_int(where, "max_length", args.get("max_length"), 1)
    check_optional_int(where, "threads", args.get("threads"), 1)
    check_int(where, "max_gen_toks", args.get("max_gen_toks", 256), 1)
    if args.get("pair") is None:
        check_dirs(where, args.get("pretrained"), args.get("drafter"), method)


def check_dirs(where: str, pretrained, drafter, method: str) -> None:
    """``pretrained`` / ``drafter`` directories (None: the embedded pair's)."""
    from vllm_ddtree.demo.reference_engine import CHECKPOINTS

    check_model_dir(where, "pretrained", pretrained, "the target model")
    check_model_dir(where, "drafter", drafter, "the DFlash drafter")
    if method == "ar":
        return
    if pretrained is not None and drafter is None:
        raise refuse(where, "drafter", None, f"a DFlash drafter directory (method "
                     f"{method!r} with pretrained={str(pretrained)!r})")
    if drafter is not None:
        check_pair_dirs(where, pretrained or CHECKPOINTS / "target", drafter)
