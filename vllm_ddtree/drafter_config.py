"""Reading and checking a DFlash drafter config (no model code, cheap to import)."""

from __future__ import annotations

SLIDING_ATTENTION = "sliding_attention"
FULL_ATTENTION = "full_attention"


class DrafterConfigError(ValueError):
    """A drafter config that cannot describe a DFlash drafter."""


def dflash_config_of(config) -> dict:
    """Return ``config.dflash_config`` or raise a clear error when it is missing."""
    dflash_config = getattr(config, "dflash_config", None)
    if not dflash_config:
        raise DrafterConfigError(
            "drafter config has no `dflash_config`: a DFlash drafter needs "
            '`"dflash_config": {"target_layer_ids": [...], "mask_token_id": <id>}` '
            "in its config.json"
        )
    for key in ("target_layer_ids", "mask_token_id"):
        if dflash_config.get(key) is None:
            raise DrafterConfigError(
                f"drafter config `dflash_config.{key}` is missing; add it to config.json"
            )
    return dflash_config


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

    Both arguments are transformers configs (or objects with the same fields).
    The drafter shares the target's embeddings and LM head, so hidden size and
    vocabulary must agree; ``target_layer_ids`` must name existing target layers.
    """
    dflash_config = dflash_config_of(drafter_config)
    archs = getattr(drafter_config, "architectures", None) or []
    if archs and "DFlashDraftModel" not in archs:
        raise DrafterConfigError(
            f"drafter `architectures` is {archs}: DDTree needs a DFlash drafter "
            '(`"architectures": ["DFlashDraftModel"]`)'
        )
    target_hidden = target_config.hidden_size
    drafter_target_hidden = getattr(drafter_config, "target_hidden_size", None) or target_hidden
    if drafter_target_hidden != target_hidden:
        raise DrafterConfigError(
            f"drafter `target_hidden_size` ({drafter_target_hidden}) != target `hidden_size` "
            f"({target_hidden}): the drafter was trained for another target"
        )
    if drafter_config.hidden_size != target_hidden:
        raise DrafterConfigError(
            f"drafter `hidden_size` ({drafter_config.hidden_size}) != target `hidden_size` "
            f"({target_hidden}): DFlash shares the target's embeddings and LM head, "
            "use a drafter made for this target"
        )
    if drafter_config.vocab_size != target_config.vocab_size:
        raise DrafterConfigError(
            f"drafter `vocab_size` ({drafter_config.vocab_size}) != target `vocab_size` "
            f"({target_config.vocab_size}): use a drafter trained with the target's tokenizer"
        )
    num_layers = target_config.num_hidden_layers
    bad = [i for i in dflash_config["target_layer_ids"] if not 0 <= int(i) < num_layers]
    if bad or not dflash_config["target_layer_ids"]:
        raise DrafterConfigError(
            f"drafter `dflash_config.target_layer_ids` {dflash_config['target_layer_ids']} "
            f"must be non-empty and within 0..{num_layers - 1} (the target has {num_layers} "
            "layers)"
        )
    mask_id = int(dflash_config["mask_token_id"])
    if not 0 <= mask_id < target_config.vocab_size:
        raise DrafterConfigError(
            f"drafter `dflash_config.mask_token_id` ({mask_id}) is outside the vocabulary "
            f"(0..{target_config.vocab_size - 1})"
        )
