"""Argument checks of the reference engine, run before any model work.

Every refusal is a ``ValueError`` of the form ``"<where>: <field>=<value> is not
allowed: <what is allowed>"``, e.g. ``generate: temperature=nan is not allowed: a
finite number >= 0``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from numbers import Real
from typing import Any

from vllm_ddtree.checks import check_int, int_range, is_int, not_allowed
from vllm_ddtree.config import MAX_BUDGET

METHODS = ("ar", "dflash", "dflash2", "ddtree")
INT64 = (-(1 << 63), (1 << 63) - 1)


def refuse(where: str, field: str, value: Any, allowed: str) -> ValueError:
    """The error for ``field=value`` at ``where``, saying what is allowed."""
    return ValueError(not_allowed(where, field, value, allowed))


def check_optional_int(where: str, field: str, value: Any, lo: int,
                       hi: int | None = None) -> int | None:
    """None, or an int in ``lo..hi``."""
    if value is None:
        return None
    if not is_int(value) or value < lo or (hi is not None and value > hi):
        raise refuse(where, field, value, f"None or {int_range(lo, hi)}")
    return int(value)


def check_real(where: str, field: str, value: Any, lo: float = 0.0) -> float:
    """``value`` is a finite real number ``>= lo`` (a bool is not a number here)."""
    if (not isinstance(value, Real) or isinstance(value, bool) or not math.isfinite(value)
            or value < lo):
        raise refuse(where, field, value, f"a finite number >= {lo:g}")
    return float(value)


def check_choice(where: str, field: str, value: Any, allowed: Iterable[str]) -> str:
    """``value`` is one of ``allowed`` (strings)."""
    allowed = tuple(allowed)
    if not isinstance(value, str) or value not in allowed:
        raise refuse(where, field, value, "one of " + ", ".join(repr(a) for a in allowed))
    return value


def check_token_ids(where: str, field: str, ids: Any, vocab_size: int) -> None:
    """``ids`` is a non-empty list or tuple of ints in ``0..vocab_size - 1``."""
    if not isinstance(ids, (list, tuple)) or len(ids) == 0:
        shown = ids if isinstance(ids, (list, tuple)) else type(ids).__name__
        raise refuse(where, field, shown, "a non-empty list of int token ids")
    for i, token in enumerate(ids):
        if not is_int(token) or not 0 <= token < vocab_size:
            raise refuse(where, f"{field}[{i}]", token,
                         f"a token id in 0..{vocab_size - 1} (the target's vocabulary)")


def vocab_size_of(where: str, target) -> int:
    """The target's vocabulary size (``config.vocab_size``)."""
    size = getattr(getattr(target, "config", None), "vocab_size", None)
    if not is_int(size) or size < 1:
        raise refuse(where, "target", type(target).__name__,
                     "a transformers causal LM whose config has a vocab_size")
    return int(size)


def check_callable(where: str, field: str, value: Any) -> None:
    """None or a callable."""
    if value is not None and not callable(value):
        raise refuse(where, field, value, "None or a callable")


def check_generate_args(target, drafter, prompt_ids, max_new_tokens, method, budget,
                        temperature, seed, eos_token_id, top_k, stop,
                        budget_chooser, where: str = "generate",
                        draft_scores: str | None = None) -> None:
    """Check every argument of :func:`vllm_ddtree.reference.generate`: method,
    prompt ids (non-empty, ints inside the target's vocabulary), ``max_new_tokens``
    (an int >= 1; prompt plus new tokens within the target's
    ``max_position_embeddings``), ``budget`` (an int in ``1..MAX_BUDGET``), ``temperature`` (finite,
    >= 0; > 0 needs an int64 ``seed``), ``eos_token_id`` (None or inside the
    vocabulary), ``top_k`` (None or >= 1), ``stop`` and ``budget_chooser`` (None or
    callables; a chooser only with ``ddtree``), ``draft_scores`` (None, or
    ``"selector"`` / ``"marginals"`` with a DFlash2 drafter and ``ddtree``; ``dflash2``
    needs a DFlash2 drafter) and, for speculative methods, the drafter and its fit to the
    target. ``where`` starts the messages."""
    check_choice(where, "method", method, METHODS)
    vocab = vocab_size_of(where, target)
    check_token_ids(where, "prompt_ids", prompt_ids, vocab)
    check_int(where, "max_new_tokens", max_new_tokens, 1)
    _check_positions_fit(where, target, len(prompt_ids), max_new_tokens)
    check_int(where, "budget", budget, 1, MAX_BUDGET, "tree nodes per round")
    temperature = check_real(where, "temperature", temperature)
    if temperature > 0 and seed is None:
        raise refuse(where, "seed", seed, "an int when temperature > 0 (draws are keyed "
                     "by seed and position)")
    check_optional_int(where, "seed", seed, *INT64)
    check_optional_int(where, "eos_token_id", eos_token_id, 0, vocab - 1)
    check_optional_int(where, "top_k", top_k, 1)
    check_callable(where, "stop", stop)
    check_callable(where, "budget_chooser", budget_chooser)
    if budget_chooser is not None and method != "ddtree":
        raise refuse(where, "method", method, "'ddtree' when a budget_chooser is given")
    if method != "ar":
        _check_drafter(where, drafter, target, method)
    _check_dflash2(where, drafter, method, budget, top_k, draft_scores)


def _check_dflash2(where: str, drafter, method: str, budget: int, top_k: int | None,
                   draft_scores: str | None) -> None:
    """``dflash2`` and ``draft_scores`` need a DFlash2 drafter; a selector tree of
    ``budget`` nodes fits its ``selector_top_k`` candidates per position."""
    from vllm_ddtree.reference.dflash2 import DFlash2DraftModel
    from vllm_ddtree.reference.draft_trees import DRAFT_SCORES, uses_selector

    is_dflash2 = isinstance(drafter, DFlash2DraftModel)
    if method == "dflash2" and not is_dflash2:
        shown = drafter if drafter is None else type(drafter).__name__
        raise refuse(where, "drafter", shown, "a DFlash2DraftModel (method 'dflash2')")
    if draft_scores is not None:
        check_choice(where, "draft_scores", draft_scores, DRAFT_SCORES)
        if not is_dflash2 or method != "ddtree":
            raise refuse(where, "draft_scores", draft_scores,
                         "None unless method is 'ddtree' with a DFlash2DraftModel drafter")
    if uses_selector(drafter, method, draft_scores) and method == "ddtree":
        k = min(top_k or drafter.selector_top_k, drafter.selector_top_k)
        depth = drafter.block_size - 1
        most = sum(k**d for d in range(1, depth + 1))
        if budget > most:
            raise refuse(where, "budget", budget,
                         f"at most {most}: a selector tree of depth {depth} with {k} "
                         "candidates per position")


def _check_positions_fit(where: str, target, prompt_len: int, max_new_tokens: int) -> None:
    """``prompt_len + max_new_tokens`` positions fit the target's
    ``max_position_embeddings`` (vLLM's ``max_model_len`` default), when its config has
    one."""
    limit = getattr(getattr(target, "config", None), "max_position_embeddings", None)
    if is_int(limit) and prompt_len + max_new_tokens > limit:
        raise refuse(where, "max_new_tokens", max_new_tokens,
                     f"at most {max(limit - prompt_len, 0)}: the prompt's {prompt_len} "
                     f"tokens plus the new ones must fit the target's "
                     f"max_position_embeddings={limit}")


def _check_drafter(where: str, drafter, target, method: str) -> None:
    """A DFlash drafter made for ``target`` (speculative methods only)."""
    from vllm_ddtree.drafter_config import check_drafter_target_pair
    from vllm_ddtree.reference.drafter import DFlashDraftModel

    if not isinstance(drafter, DFlashDraftModel):
        shown = drafter if drafter is None else type(drafter).__name__
        raise refuse(where, "drafter", shown, f"a DFlashDraftModel (method {method!r})")
    check_drafter_target_pair(drafter.config, target.config)
