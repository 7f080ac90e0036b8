"""DDTree's own speculative-config keys: parsing and validation, before any GPU work.

Users pass ``{"method": "ddtree", "model": <DFlash drafter>, "num_speculative_tokens": B,
"ddtree_top_k": K, ...}``. vLLM keeps treating the request as ``method: dflash`` (so
every DFlash code path keeps working); the ``ddtree_*`` keys travel as a plain dict
on the built ``SpeculativeConfig`` (attribute ``ddtree``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

DDTREE_METHOD = "ddtree"
MAX_BUDGET = 512
DDTREE_KEYS = {
    "ddtree_top_k": "children kept per node: the top-k tokens of each depth (default: B)",
    "ddtree_budget": '"auto": verify 1..B nodes per round, picked to maximise expected '
    "tokens per second (default: always B)",
    "ddtree_verify_shape": 'with ddtree_budget "auto": "adaptive" verifies 1 + b rows per '
    'request (b rounded up to a power of two; default at tensor-parallel size 1), "fixed" '
    "verifies 1 + B and skips the inactive rows in attention only (default at tensor-"
    "parallel size > 1, where adaptive is not GPU-tested yet)",
}
AUTO_BUDGET = "auto"
VERIFY_SHAPES = ("adaptive", "fixed")
# vLLM speculative-config keys that assume a chain or another drafter kind.
UNSUPPORTED_KEYS = {
    "num_speculative_tokens_per_batch_size": "dynamic speculative decoding assumes a chain",
    "draft_sample_method": "DDTree drafts greedily (its tree covers the alternatives)",
    "rejection_sample_method": "DDTree verifies by walking the tree",
}


class DDTreeConfigError(ValueError):
    """A ``--speculative-config`` for ``method: ddtree`` that cannot run."""


@dataclass(frozen=True)
class DDTreeConfig:
    """What DDTree adds to vLLM's speculative config.

    ``budget`` is the tree's node count per round (vLLM's ``num_speculative_tokens``),
    ``top_k`` caps the children per node (None = no cap beyond the budget).
    ``adaptive`` (``ddtree_budget: "auto"``): ``budget`` is the maximum B; each round
    verifies only the first ``b <= B`` nodes, ``b`` chosen by
    ``vllm_ddtree.budget.policy``. ``verify_shape`` (``"adaptive"`` / ``"fixed"``,
    None = the default for the parallel setup, :meth:`resolved_verify_shape`): whether
    the target verifies ``1 + b`` or ``1 + B`` rows (``vllm_ddtree.verify.shape``).
    """

    budget: int
    top_k: int | None = None
    adaptive: bool = False
    verify_shape: str | None = None

    def resolved_verify_shape(self, tensor_parallel_size: int) -> str | None:
        """``"adaptive"`` / ``"fixed"`` for ``auto`` (None without it). The default is
        adaptive at TP = 1 and fixed at TP > 1, where adaptive shapes (each rank reads
        the choice of two rounds before, ``vllm_ddtree.verify.shape``) have not run on
        a GPU yet; an explicit ``"adaptive"`` is honoured at any TP."""
        if not self.adaptive:
            return None
        if self.verify_shape is None:
            return "adaptive" if tensor_parallel_size == 1 else "fixed"
        return self.verify_shape

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _positive_int(value: Any, field: str, upper: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise DDTreeConfigError(f"`{field}` must be an integer, got {value!r}")
    if value < 1 or (upper is not None and value > upper):
        bound = f"1..{upper}" if upper is not None else ">= 1"
        raise DDTreeConfigError(f"`{field}` must be in {bound}, got {value}")
    return value


def split_ddtree_spec(spec: dict[str, Any]) -> tuple[dict[str, Any], DDTreeConfig | None]:
    """Split a raw speculative-config dict into vLLM's part and DDTree's part.

    Returns ``(spec, None)`` unchanged unless ``spec["method"] == "ddtree"``; then
    the vLLM part has ``method: dflash`` and no ``ddtree_*`` keys. Raises
    ``DDTreeConfigError`` naming the field and the fix for bad input.
    """
    if spec.get("method") != DDTREE_METHOD:
        stray = sorted(k for k in spec if k.startswith("ddtree_"))
        if stray:
            raise DDTreeConfigError(
                f"{stray} are DDTree keys: set `\"method\": \"ddtree\"` or remove them"
            )
        return spec, None
    unknown = sorted(k for k in spec if k.startswith("ddtree_") and k not in DDTREE_KEYS)
    if unknown:
        known = ", ".join(f"`{k}` ({doc})" for k, doc in DDTREE_KEYS.items())
        raise DDTreeConfigError(f"unknown DDTree key(s) {unknown}; known keys: {known}")
    for key, why in UNSUPPORTED_KEYS.items():
        if spec.get(key) is not None:
            raise DDTreeConfigError(f"`{key}` is not supported with method ddtree: {why}")
    if not spec.get("model"):
        raise DDTreeConfigError(
            '`model` is required with method ddtree: the path of a DFlash drafter '
            '(config.json with "architectures": ["DFlashDraftModel"])'
        )
    if spec.get("num_speculative_tokens") is None:
        raise DDTreeConfigError(
            f"`num_speculative_tokens` is required with method ddtree: the tree's node "
            f"budget B per round, 1..{MAX_BUDGET} (64 is a good start)"
        )
    budget = _positive_int(spec["num_speculative_tokens"], "num_speculative_tokens", MAX_BUDGET)
    top_k = spec.get("ddtree_top_k")
    if top_k is not None:
        top_k = _positive_int(top_k, "ddtree_top_k")
    adaptive = _adaptive_budget(spec.get("ddtree_budget"))
    verify_shape = _verify_shape(spec.get("ddtree_verify_shape"), adaptive)
    vllm_spec = {k: v for k, v in spec.items() if not k.startswith("ddtree_")}
    vllm_spec["method"] = "dflash"
    return vllm_spec, DDTreeConfig(budget=budget, top_k=top_k, adaptive=adaptive,
                                   verify_shape=verify_shape)


def _verify_shape(value: Any, adaptive: bool) -> str | None:
    """``ddtree_verify_shape``: None (the default) or one of ``VERIFY_SHAPES``; only
    meaningful with ``ddtree_budget: "auto"``."""
    if value is None:
        return None
    if value not in VERIFY_SHAPES:
        raise DDTreeConfigError(
            f"`ddtree_verify_shape` must be one of {list(VERIFY_SHAPES)} (or left out), "
            f"got {value!r}"
        )
    if not adaptive:
        raise DDTreeConfigError(
            '`ddtree_verify_shape` needs `"ddtree_budget": "auto"`: a fixed budget always '
            "verifies 1 + num_speculative_tokens rows"
        )
    return value


def _adaptive_budget(value: Any) -> bool:
    """``ddtree_budget``: absent (None) = fixed budget B, ``"auto"`` = adaptive."""
    if value is None:
        return False
    if value != AUTO_BUDGET:
        raise DDTreeConfigError(
            f'`ddtree_budget` must be "auto" (or left out), got {value!r}: the fixed node '
            'budget is `num_speculative_tokens`; with "auto" it is the maximum B'
        )
    return True


def check_drafter_for_target(drafter: str, target_hf_config) -> None:
    """Check the DFlash drafter at ``drafter`` (a local directory) against the target.

    Reads only ``config.json``; raises ``DDTreeConfigError`` / ``DrafterConfigError``
    with the field and the fix (not DFlash, hidden size, vocabulary, layer ids).
    """
    from transformers import AutoConfig

    from vllm_ddtree.drafter_config import check_drafter_target_pair

    if not (Path(drafter) / "config.json").exists():
        raise DDTreeConfigError(
            f"`model` {drafter!r}: no config.json there; pass the local directory of a "
            "DFlash drafter (download it first: vLLM workers cannot check a hub name here)"
        )
    drafter_config = AutoConfig.from_pretrained(drafter)
    check_drafter_target_pair(drafter_config, target_hf_config)
