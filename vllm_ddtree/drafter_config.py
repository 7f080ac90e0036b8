"""Reading and checking a DFlash drafter config (no model code, cheap to import).

The checks cover every field that vLLM 0.26's DFlash drafter
(``vllm/model_executor/models/qwen3_dflash.py``) and DDTree read, by type and range.
A config is either a transformers config or the dict of a ``config.json`` (a
``Mapping``: then also the rules that only the file can break, such as
``use_sliding_window``). Every refusal is a ``DrafterConfigError`` of the form
``"drafter config.json: <field>=<value> is not allowed: <what is allowed>"``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from vllm_ddtree.checks import check_int, is_int, not_allowed

WHERE = "drafter config.json"
DFLASH_ARCHITECTURE = "DFlashDraftModel"
DFLASH2_ARCHITECTURE = "DFlash2DraftModel"
DRAFTER_ARCHITECTURES = (DFLASH_ARCHITECTURE, DFLASH2_ARCHITECTURE)
SLIDING_ATTENTION = "sliding_attention"
FULL_ATTENTION = "full_attention"
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)
# Integer shape fields (None: transformers' default, or the target's for
# ``target_hidden_size``).
SIZE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "head_dim",
               "max_position_embeddings", "target_hidden_size")
TARGET_LAYER_IDS_ALLOWED = ("a non-empty list of distinct ints >= 0 (the target layers "
                            "whose outputs the drafter reads)")


class DrafterConfigError(ValueError):
    """A drafter config that cannot describe a DFlash drafter."""


def refuse(field: str, value: Any, allowed: str) -> DrafterConfigError:
    """The error for ``field=value``, saying what is allowed."""
    return DrafterConfigError(not_allowed(WHERE, field, value, allowed))


def field_of(config: Any, name: str) -> Any:
    """Field ``name`` of a transformers config or of a config.json dict (None: absent)."""
    if isinstance(config, Mapping):
        return config.get(name)
    return getattr(config, name, None)


def _check_int(field: str, value: Any, lo: int, hi: int | None = None,
               note: str = "") -> int:
    """``value`` is an int in ``lo..hi`` (``hi`` None: no upper bound)."""
    return check_int(WHERE, field, value, lo, hi, note, error=DrafterConfigError)


def _check_optional_bool(field: str, value: Any) -> None:
    """``value`` is absent (None) or a bool."""
    if value is not None and not isinstance(value, bool):
        raise refuse(field, value, "true or false (or left out)")


def check_architectures(architectures: Any) -> None:
    """``architectures`` is a list naming ``DFlashDraftModel`` or ``DFlash2DraftModel``
    (the DFlash and DFlash2 drafters DDTree drafts with)."""
    if (not isinstance(architectures, list)
            or not any(a in DRAFTER_ARCHITECTURES for a in architectures)):
        raise refuse("architectures", architectures,
                     f'["{DFLASH_ARCHITECTURE}"] or ["{DFLASH2_ARCHITECTURE}"]: DDTree '
                     "drafts with a DFlash or DFlash2 drafter")


def is_dflash2(config: Any) -> bool:
    """Whether the config's ``architectures`` names ``DFlash2DraftModel``."""
    architectures = field_of(config, "architectures")
    return isinstance(architectures, (list, tuple)) and DFLASH2_ARCHITECTURE in architectures


def refuse_dflash2_outside_ddtree(spec: Mapping) -> None:
    """Refuse a DFlash2 drafter under another speculative method than ``ddtree``.

    The plugin registers ``DFlash2DraftModel`` with vLLM's model registry so DDTree can
    load it, which would also let vLLM 0.26's own ``dflash`` method load it: that path
    sends ``1 + num_speculative_tokens`` query rows per block and takes per-position
    argmaxes, ignoring the candidate selector and the convolution's block. ``spec`` is
    the speculative-config dict (``method``, ``model``)."""
    method, model = spec.get("method"), spec.get("model")
    if method == "ddtree" or not isinstance(model, str):
        return
    path = Path(model) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return  # not a local DFlash2 checkpoint: vLLM's own checks apply
    if isinstance(raw, dict) and is_dflash2(raw):
        raise DrafterConfigError(
            f"speculative config: method={method!r} is not allowed with a DFlash2 drafter "
            f"({path} names {DFLASH2_ARCHITECTURE}): use method 'ddtree' (its "
            "\"ddtree_top_k\": 1 with num_speculative_tokens = block_size - 1 is the "
            "selector's chain walk)")


def _check_number(field: str, value: Any, allowed: str, positive: bool) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if ok and value == value and abs(value) != float("inf"):  # finite
        if not positive or value > 0:
            return
    raise refuse(field, value, allowed)


def dflash2_config_of(config: Any) -> dict:
    """``config.dflash_config`` of a DFlash2 drafter after checking its DFlash2 keys
    (besides :func:`dflash_config_of`): ``conv_kernel_size`` an int >= 1,
    ``conv_group_size`` an int >= 1 dividing ``hidden_size``, ``selector_rank`` an int
    >= 1, ``selector_top_k`` an int in 1..vocab_size; ``input_embedding_scale`` and
    ``output_multiplier`` absent or finite numbers > 0, ``final_logit_softcapping``
    absent, null or a finite number >= 0."""
    draft = dflash_config_of(config)
    _check_int("dflash_config.conv_kernel_size", draft.get("conv_kernel_size"), 1,
               note="taps of the grouped convolution around each sublayer")
    group = _check_int("dflash_config.conv_group_size", draft.get("conv_group_size"), 1,
                       note="channels per convolution group")
    hidden = field_of(config, "hidden_size")
    if is_int(hidden) and hidden % group:
        raise refuse("dflash_config.conv_group_size", group,
                     f"a divisor of hidden_size={hidden}")
    _check_int("dflash_config.selector_rank", draft.get("selector_rank"), 1,
               note="rank of the selector's edge term")
    vocab = field_of(config, "vocab_size")
    _check_int("dflash_config.selector_top_k", draft.get("selector_top_k"), 1,
               vocab if is_int(vocab) else None, "candidates per block position")
    for name in ("input_embedding_scale", "output_multiplier"):
        if draft.get(name) is not None:
            _check_number(f"dflash_config.{name}", draft[name],
                          "a finite number > 0 (or left out: 1)", positive=True)
    cap = draft.get("final_logit_softcapping")
    if cap is not None:
        _check_number("dflash_config.final_logit_softcapping", cap,
                      "a finite number >= 0 (0, null or left out: no softcap)", positive=False)
        if cap < 0:
            raise refuse("dflash_config.final_logit_softcapping", cap,
                          "a finite number >= 0 (0, null or left out: no softcap)")
    return draft


def check_sizes(config: Any) -> None:
    """Every field of ``SIZE_FIELDS`` is absent (None) or an int >= 1."""
    for name in SIZE_FIELDS:
        value = field_of(config, name)
        if value is not None:
            _check_int(name, value, 1)


def block_size_of(config: Any) -> int:
    """``block_size``: an int >= 2, the drafter's query block (one bonus token and
    ``block_size - 1`` masks, i.e. tree depths ``1..block_size - 1``). Published
    drafters carry it at the top level or, in newer releases, as
    ``dflash_config.block_size``; both present must agree."""
    note = "the drafter's training block: a bonus token and block_size - 1 mask tokens"
    top = field_of(config, "block_size")
    dflash_config = field_of(config, "dflash_config")
    inner = dflash_config.get("block_size") if isinstance(dflash_config, Mapping) else None
    if top is None and inner is not None:
        return _check_int("dflash_config.block_size", inner, 2, note=note)
    block_size = _check_int("block_size", top, 2, note=note)
    if inner is not None and inner != block_size:
        raise refuse("dflash_config.block_size", inner,
                     f"absent or equal to block_size={block_size}")
    return block_size


def dflash_config_of(config: Any) -> dict:
    """``config.dflash_config`` after checking it: an object whose
    ``target_layer_ids`` is a non-empty list of distinct ints >= 0 and whose
    ``mask_token_id`` is an int >= 0; ``use_swa`` and ``causal`` are absent or bools,
    ``swa_window_size`` absent or an int >= 1. The upper bounds (the target's layers
    and vocabulary) are checked by :func:`check_drafter_target_pair`."""
    dflash_config = field_of(config, "dflash_config")
    if not isinstance(dflash_config, Mapping):
        raise refuse("dflash_config", dflash_config,
                     'an object {"target_layer_ids": [...], "mask_token_id": <id>}')
    ids = dflash_config.get("target_layer_ids")
    if (not isinstance(ids, (list, tuple)) or not ids or not all(map(is_int, ids))
            or min(ids) < 0 or len(set(ids)) != len(ids)):
        raise refuse("dflash_config.target_layer_ids", ids, TARGET_LAYER_IDS_ALLOWED)
    mask_token_id = dflash_config.get("mask_token_id")
    if not is_int(mask_token_id) or mask_token_id < 0:
        vocab_size = field_of(config, "vocab_size")
        _check_int("dflash_config.mask_token_id", mask_token_id, 0,
                   vocab_size - 1 if is_int(vocab_size) else None,
                   "the token id fed at the masked positions of a block")
    for name in ("use_swa", "causal"):
        _check_optional_bool(f"dflash_config.{name}", dflash_config.get(name))
    if dflash_config.get("swa_window_size") is not None:
        _check_int("dflash_config.swa_window_size", dflash_config["swa_window_size"], 1)
    return dict(dflash_config)


def check_layer_types(config: Any) -> list | None:
    """``layer_types`` is absent or one of ``LAYER_TYPES`` per drafter layer; returns it."""
    layer_types = field_of(config, "layer_types")
    if layer_types is None:
        return None
    num_layers = field_of(config, "num_hidden_layers")
    if (not isinstance(layer_types, (list, tuple))
            or any(t not in LAYER_TYPES for t in layer_types)
            or (is_int(num_layers) and len(layer_types) != num_layers)):
        raise refuse("layer_types", layer_types,
                     f"a list of {FULL_ATTENTION!r} or {SLIDING_ATTENTION!r}, one entry per "
                     f"layer (num_hidden_layers={num_layers})")
    return list(layer_types)


def check_sliding_window(config: Any, dflash_config: Mapping) -> None:
    """``use_sliding_window`` is absent or a bool, ``sliding_window`` absent or an
    int >= 1, and every sliding layer (``layer_types``, or all layers with
    ``dflash_config.use_swa``; ``dflash_config`` checked by :func:`dflash_config_of`)
    has a window: ``dflash_config.swa_window_size`` or
    ``sliding_window``. In a config.json, ``sliding_window`` counts only with
    ``"use_sliding_window": true`` (Qwen3Config drops it otherwise, in transformers
    and in vLLM alike)."""
    use_sliding = field_of(config, "use_sliding_window")
    _check_optional_bool("use_sliding_window", use_sliding)
    window = field_of(config, "sliding_window")
    if window is not None:
        _check_int("sliding_window", window, 1)
    layer_types = check_layer_types(config) or []
    if dflash_config.get("use_swa"):
        why = "dflash_config.use_swa makes every layer sliding"
    elif SLIDING_ATTENTION in layer_types:
        why = f"layer {layer_types.index(SLIDING_ATTENTION)} is {SLIDING_ATTENTION!r}"
    else:
        return
    if dflash_config.get("swa_window_size") is not None:
        return
    if isinstance(config, Mapping) and window is not None and use_sliding is not True:
        raise refuse("use_sliding_window", use_sliding,
                     f"true: {why}, and Qwen3Config drops sliding_window={window} unless "
                     "use_sliding_window is true (in transformers and in vLLM alike)")
    if window is None:
        raise refuse("sliding_window", window,
                     f'an int >= 1 (with "use_sliding_window": true): {why}; or set '
                     "dflash_config.swa_window_size")


def check_drafter_config(config: Any) -> None:
    """Types and ranges of the drafter's own fields: ``SIZE_FIELDS``, ``block_size``,
    ``dflash_config``, ``layer_types`` and the sliding window
    (:func:`check_sizes`, :func:`block_size_of`, :func:`dflash_config_of`,
    :func:`check_sliding_window`). The fit to a target is
    :func:`check_drafter_target_pair`."""
    check_sizes(config)
    block_size_of(config)
    check_sliding_window(config, dflash_config_of(config))
    if is_dflash2(config):
        dflash2_config_of(config)


def read_drafter_config_json(directory: str | Path) -> dict:
    """The checked text of ``directory/config.json``: a JSON object naming
    ``DFlashDraftModel`` or ``DFlash2DraftModel`` in ``architectures`` whose fields pass
    :func:`check_drafter_config`."""
    path = Path(directory) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise DrafterConfigError(f"{WHERE} ({path}) is not valid JSON: {error}") from error
    if not isinstance(raw, dict):
        raise DrafterConfigError(
            f"{WHERE} ({path}) holds a {type(raw).__name__}: it must be a JSON object")
    check_architectures(raw.get("architectures"))
    check_drafter_config(raw)
    return raw


def load_drafter_config(directory: str | Path):
    """The transformers config of the drafter in ``directory``, after
    :func:`read_drafter_config_json`; transformers' own refusals come back as a
    ``DrafterConfigError`` naming the file."""
    from transformers import AutoConfig

    read_drafter_config_json(directory)
    try:
        return AutoConfig.from_pretrained(str(directory))
    except Exception as error:  # transformers raises several types for a bad file
        raise DrafterConfigError(
            f"{WHERE} ({Path(directory) / 'config.json'}): transformers cannot read it: "
            f"{error}") from error


def resolve_layer_attention(config, layer_idx: int) -> tuple[int | None, bool]:
    """(sliding_window or None, causal) of drafter layer ``layer_idx``, as vLLM 0.26."""
    dflash_config = getattr(config, "dflash_config", None) or {}
    layer_types = getattr(config, "layer_types", None)
    use_swa = dflash_config.get("use_swa", False)
    any_sliding = bool(layer_types) and SLIDING_ATTENTION in layer_types
    if layer_types is None or (use_swa and not any_sliding):
        is_sliding = bool(use_swa)
    else:
        is_sliding = layer_types[layer_idx] == SLIDING_ATTENTION
    window = None
    if is_sliding:
        window = dflash_config.get("swa_window_size", getattr(config, "sliding_window", None))
        if window is None or window < 1:
            raise DrafterConfigError(
                f"drafter layer {layer_idx} is `sliding_attention` but no window is set: "
                "add `sliding_window` (or `dflash_config.swa_window_size`) >= 1"
            )
    causal = dflash_config.get("causal")
    if causal is None:
        causal = is_sliding
    return window, bool(causal)


def check_drafter_target_pair(drafter_config, target_config) -> None:
    """Raise ``DrafterConfigError`` naming the field and the fix when the pair mismatches.

    Both arguments are transformers configs (or objects with the same fields). The
    drafter's own fields pass :func:`check_drafter_config` and, where present,
    ``architectures`` names ``DFlashDraftModel`` or ``DFlash2DraftModel``. The drafter
    shares the target's
    embeddings and LM head, so hidden size and vocabulary must agree;
    ``target_layer_ids`` must name existing target layers.
    """
    check_drafter_config(drafter_config)
    dflash_config = dflash_config_of(drafter_config)
    if field_of(drafter_config, "architectures") is not None:
        check_architectures(field_of(drafter_config, "architectures"))
    target_hidden = target_config.hidden_size
    drafter_target_hidden = field_of(drafter_config, "target_hidden_size") or target_hidden
    if drafter_target_hidden != target_hidden:
        raise refuse("target_hidden_size", drafter_target_hidden,
                     f"{target_hidden} (the target's hidden_size): the drafter was "
                     "trained for another target")
    if drafter_config.hidden_size != target_hidden:
        raise refuse("hidden_size", drafter_config.hidden_size,
                     f"{target_hidden} (the target's hidden_size): DFlash shares the "
                     "target's embeddings and LM head, use a drafter made for this target")
    vocab_size = target_config.vocab_size
    if drafter_config.vocab_size != vocab_size:
        raise refuse("vocab_size", drafter_config.vocab_size,
                     f"{vocab_size} (the target's vocab_size): use a drafter trained with "
                     "the target's tokenizer")
    num_layers = target_config.num_hidden_layers
    ids = dflash_config["target_layer_ids"]
    if max(ids) >= num_layers:
        raise refuse("dflash_config.target_layer_ids", ids,
                     f"layer ids in 0..{num_layers - 1} (the target has {num_layers} "
                     "layers)")
    _check_int("dflash_config.mask_token_id", dflash_config["mask_token_id"], 0,
               vocab_size - 1, "the target's vocabulary")
