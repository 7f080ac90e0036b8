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

from vllm_ddtree.checks import is_int, not_allowed

DDTREE_METHOD = "ddtree"
MAX_BUDGET = 512
DDTREE_KEYS = {
    "ddtree_top_k": "children kept per node: the top-k tokens of each depth (default: B)",
    "ddtree_budget": '"auto": verify 1..B nodes per round, picked to maximise expected '
    "tokens per second, or decode plainly (b = 0) where speculation does not pay "
    "(default: always B)",
    "ddtree_verify_shape": 'with ddtree_budget "auto": "adaptive" verifies 1 + b rows per '
    'request (b rounded up to a power of two; default at tensor-parallel size 1), "fixed" '
    "verifies 1 + B and skips the inactive rows in attention only (default at tensor-"
    "parallel size > 1, where adaptive is not GPU-tested yet)",
}
AUTO_BUDGET = "auto"
VERIFY_SHAPES = ("adaptive", "fixed")
# vLLM's dynamic speculative decoding key; with DDTree: the tree budget per batch size.
BATCH_SCHEDULE_KEY = "num_speculative_tokens_per_batch_size"
BATCH_SCHEDULE_ALLOWED = (
    "a non-empty list of [range_start, range_end, k] entries (vLLM's dynamic speculative "
    "decoding schedule): inclusive batch-size ranges of ints >= 1, sorted without overlap, "
    "the first starting at 1; k an int >= 0, the tree nodes each request verifies at those "
    "batch sizes (capped at num_speculative_tokens; 0 = plain decoding, no drafter pass; "
    'with ddtree_budget "auto" the largest budget auto may pick there)')
# vLLM speculative-config keys that assume a chain or another drafter kind: key ->
# (vLLM's default, the only value allowed; why).
UNSUPPORTED_KEYS = {
    "draft_sample_method": ("greedy", "DDTree drafts greedily (its tree covers the "
                                      "alternatives)"),
    "rejection_sample_method": ("standard", "DDTree verifies by walking the tree"),
    "use_local_argmax_reduction": (False, "the tree ranks the drafter's full logits"),
}
MODEL_ALLOWED = ('the local directory of a DFlash drafter (config.json with '
                 '"architectures": ["DFlashDraftModel"] or ["DFlash2DraftModel"])')
BUDGET_ALLOWED = (f"an int in 1..{MAX_BUDGET} (the tree's node budget B per round; 64 is a "
                  "good start)")
# vLLM's shorthand arguments: EngineArgs field -> (command-line flag, speculative-config key)
SHORTHANDS = {
    "spec_method": ("--spec-method", "method"),
    "spec_model": ("--spec-model", "model"),
    "spec_tokens": ("--spec-tokens", "num_speculative_tokens"),
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
    ``batch_schedule`` (``num_speculative_tokens_per_batch_size``, normalised by vLLM's
    own check: sorted ``(range_start, range_end, k)`` tuples, None = no schedule): the
    tree budget per batch size, a cap on ``auto``'s choice; ``k = 0`` is a plain decoding
    step (``vllm_ddtree.budget.schedule``).
    """

    budget: int
    top_k: int | None = None
    adaptive: bool = False
    verify_shape: str | None = None
    batch_schedule: tuple[tuple[int, int, int], ...] | None = None

    def __post_init__(self) -> None:
        if self.batch_schedule is not None:  # lists after a JSON round trip
            object.__setattr__(self, "batch_schedule",
                               tuple(tuple(int(x) for x in e) for e in self.batch_schedule))

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


def refuse(field: str, value: Any, allowed: str) -> DDTreeConfigError:
    """The error for ``field=value`` in the speculative config, saying what is allowed."""
    return DDTreeConfigError(not_allowed("speculative config", field, value, allowed))


def _check_int(field: str, value: Any, lo: int, hi: int | None, allowed: str) -> int:
    """``value`` is an int (not a bool) in ``lo..hi`` (``hi`` None: no upper bound)."""
    if not is_int(value) or value < lo or (hi is not None and value > hi):
        raise refuse(field, value, allowed)
    return int(value)  # a NumPy integer too: the workers compare types


def is_ddtree_key(key: str) -> bool:
    """A key in DDTree's namespace (``ddtree...``, any case)."""
    return isinstance(key, str) and key.lower().startswith(DDTREE_METHOD)


def vllm_methods() -> tuple[str, ...]:
    """vLLM's speculative methods (the values of its ``SpeculativeMethod`` Literal)."""
    from typing import get_args

    from vllm.config.speculative import SpeculativeMethod

    def values(literal) -> list[str]:
        return [v for arg in get_args(literal)
                for v in ([arg] if isinstance(arg, str) else values(arg))]

    return tuple(values(SpeculativeMethod))


def check_method(method: Any, field: str = "method") -> None:
    """``method`` is None, ``ddtree`` or one of vLLM's methods; otherwise refuse it
    with the closest name and every method, ``ddtree`` included."""
    known = (DDTREE_METHOD, *sorted(vllm_methods()))
    if method is None or method in known:
        return
    import difflib

    close = difflib.get_close_matches(str(method).lower(), known, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise refuse(field, method, f"{hint}method names are case-sensitive; known methods: "
                 + ", ".join(repr(m) for m in known))


def uses_ddtree(spec: dict[str, Any] | None, shorthands: dict[str, Any]) -> bool:
    """Whether the speculative config or the ``--spec-method`` shorthand asks for DDTree."""
    return DDTREE_METHOD in (shorthands.get("spec_method"), (spec or {}).get("method"))


def merge_shorthands(spec: dict[str, Any] | None, shorthands: dict[str, Any]) -> dict[str, Any]:
    """The speculative config with vLLM's shorthand arguments (``SHORTHANDS``, the
    EngineArgs fields ``spec_method``, ``spec_model``, ``spec_tokens``) merged in, as
    vLLM's ``create_speculative_config`` merges them (``arg_utils.py:1749-1762``).
    A shorthand and a config key that give different values are refused, naming both."""
    merged = dict(spec or {})
    for name, (flag, key) in SHORTHANDS.items():
        value = shorthands.get(name)
        if value is None:
            continue
        if merged.get(key) is not None and merged[key] != value:
            raise DDTreeConfigError(
                f"speculative config: {flag}={value!r} and --speculative-config "
                f"{key}={merged[key]!r} disagree: give {key} once")
        merged[key] = value
    return merged


def split_ddtree_spec(spec: dict[str, Any]) -> tuple[dict[str, Any], DDTreeConfig | None]:
    """Split a raw speculative-config dict into vLLM's part and DDTree's part.

    Returns ``(spec, None)`` unchanged unless ``spec["method"] == "ddtree"``; then
    the vLLM part has ``method: dflash`` and neither the ``ddtree_*`` keys nor
    ``num_speculative_tokens_per_batch_size`` (DDTree's worker applies the schedule:
    vLLM's scheduler would apply the budget of the previous step's batch size and stop
    padding new decodes to one verify length, ``scheduler.py:847, 1134``). Checks the
    type and range of ``model``, ``num_speculative_tokens``, the schedule and every
    ``ddtree_*`` key, refuses unknown ``ddtree*`` keys and vLLM keys that assume a
    chain; raises ``DDTreeConfigError`` naming the field, the value and what is allowed.
    """
    if spec.get("method") != DDTREE_METHOD:
        stray = sorted(k for k in spec if is_ddtree_key(k))
        if stray:
            raise DDTreeConfigError(
                f"{stray} are DDTree keys: set `\"method\": \"ddtree\"` or remove them"
            )
        return spec, None
    unknown = sorted(k for k in spec if is_ddtree_key(k) and k not in DDTREE_KEYS)
    if unknown:
        known = ", ".join(f"`{k}` ({doc})" for k, doc in DDTREE_KEYS.items())
        raise DDTreeConfigError(
            f"speculative config: unknown DDTree key(s) {unknown} (keys are case-sensitive); "
            f"known keys: {known}")
    for key, (default, why) in UNSUPPORTED_KEYS.items():
        if spec.get(key) is not None and spec[key] != default:
            raise refuse(key, spec[key], f"left out (or vLLM's default {default!r}) with "
                         f"method ddtree: {why}")
    if not isinstance(spec.get("model"), str) or not spec["model"]:
        raise refuse("model", spec.get("model"), MODEL_ALLOWED)
    budget = _check_int("num_speculative_tokens", spec.get("num_speculative_tokens"), 1,
                        MAX_BUDGET, BUDGET_ALLOWED)
    top_k = spec.get("ddtree_top_k")
    if top_k is not None:
        top_k = _check_int("ddtree_top_k", top_k, 1, None,
                           "an int >= 1, or left out (children kept per node; default: B)")
    adaptive = _adaptive_budget(spec.get("ddtree_budget"))
    verify_shape = _verify_shape(spec.get("ddtree_verify_shape"), adaptive)
    schedule = batch_schedule(spec.get(BATCH_SCHEDULE_KEY))
    vllm_spec = {k: v for k, v in spec.items()
                 if not is_ddtree_key(k) and k != BATCH_SCHEDULE_KEY}
    vllm_spec["method"] = "dflash"
    return vllm_spec, DDTreeConfig(budget=budget, top_k=top_k, adaptive=adaptive,
                                   verify_shape=verify_shape, batch_schedule=schedule)


def batch_schedule(value: Any) -> tuple[tuple[int, int, int], ...] | None:
    """``num_speculative_tokens_per_batch_size``: None, or the schedule as vLLM's own
    check normalises it (``validate_and_normalize_dynamic_sd_schedule``: sorted
    ``(range_start, range_end, k)`` tuples). Every number must be an int (vLLM would
    take ``"4"`` or ``4.5`` through ``int()``); vLLM's reason is kept in the error."""
    if value is None:
        return None
    entries = value if isinstance(value, (list, tuple)) else None
    if not entries or not all(
            isinstance(e, (list, tuple)) and len(e) == 3 and all(is_int(x) for x in e)
            for e in entries):
        raise refuse(BATCH_SCHEDULE_KEY, value, BATCH_SCHEDULE_ALLOWED)
    from vllm.v1.spec_decode.dynamic.utils import validate_and_normalize_dynamic_sd_schedule

    try:
        normalised = validate_and_normalize_dynamic_sd_schedule(
            [[int(x) for x in e] for e in entries])
    except ValueError as e:
        raise refuse(BATCH_SCHEDULE_KEY, value, f"{e} Allowed: {BATCH_SCHEDULE_ALLOWED}"
                     ) from None
    return tuple(tuple(int(x) for x in e) for e in normalised)


def check_parallel_setup(ddtree: DDTreeConfig, data_parallel_size: int,
                         pipeline_parallel_size: int = 1,
                         decode_context_parallel_size: int = 1,
                         prefill_context_parallel_size: int = 1) -> None:
    """Refuse pipeline and context parallelism, and a batch schedule with data
    parallelism.

    vLLM's V2 runner builds the speculator on the last pipeline stage only
    (``v1/worker/gpu/model_runner.py:194-195``), so earlier stages would run the
    scheduler's ``1 + B`` rows without the tree's positions, mask or step shape. With
    data parallelism the ranks' batch sizes differ, so a schedule would give them
    different budgets and plain steps (vLLM drops its own dynamic speculative decoding
    there for the same reason, ``config/vllm.py:838-855``). Context parallelism splits a
    request's KV cache across ranks, which the tree's KV compaction does not follow."""
    if pipeline_parallel_size != 1:
        raise refuse("pipeline_parallel_size", pipeline_parallel_size,
                     "1 with method 'ddtree' (the tree speculator runs on the last pipeline "
                     "stage only); use tensor parallelism")
    for field, size in (("decode_context_parallel_size", decode_context_parallel_size),
                        ("prefill_context_parallel_size", prefill_context_parallel_size)):
        if size != 1:
            raise refuse(field, size, "1 with method 'ddtree' (the tree's KV compaction "
                         "keeps a request's KV cache on one rank); use tensor parallelism")
    if ddtree.batch_schedule is not None and data_parallel_size > 1:
        raise refuse(BATCH_SCHEDULE_KEY, [list(e) for e in ddtree.batch_schedule],
                     f"left out with data parallelism (data_parallel_size="
                     f"{data_parallel_size}): each rank would pick its own budget")


def check_long_prefill_threshold(budget: int, threshold: int, max_num_partial_prefills: int,
                                 max_model_len: int) -> None:
    """vLLM's scheduler cuts every request's scheduled tokens at
    ``long_prefill_token_threshold`` (``scheduler.py:861-863``), decodes too: below
    ``1 + B`` it cuts the trees' verify rows (and a new decode padded to ``1 + B`` keeps
    B drafts in fewer rows, which the runner cannot verify). With
    ``max_num_partial_prefills > 1`` and no threshold vLLM sets 4 % of
    ``max_model_len`` (``config/scheduler.py:257-259``). Raises ``DDTreeConfigError``."""
    source = "--long-prefill-token-threshold"
    if threshold == 0 and max_num_partial_prefills > 1:
        threshold = int(max_model_len * 0.04)
        source = (f"vLLM's default with --max-num-partial-prefills {max_num_partial_prefills}:"
                  f" 4 % of max_model_len {max_model_len}")
    if 0 < threshold < 1 + budget:
        raise DDTreeConfigError(
            f"long_prefill_token_threshold={threshold} ({source}) is not allowed with "
            f"method 'ddtree' and num_speculative_tokens={budget}: vLLM cuts each request's "
            f"scheduled tokens there, a tree's verify step needs 1 + {budget}; set "
            f"--long-prefill-token-threshold to at least {1 + budget}, or lower "
            "num_speculative_tokens")


def check_target(model_config) -> None:
    """Refuse, before vLLM loads the target, what DDTree's runner cannot verify: a hybrid
    (Mamba / linear-attention), encoder-decoder or M-RoPE target (the worker patches
    only vLLM's default model state and one position per token), and a generation config
    whose default ``repetition_penalty`` every request would inherit (penalties assume
    the draft tokens form a chain; each request would be refused)."""
    arch = ", ".join(getattr(getattr(model_config, "hf_config", None), "architectures",
                             None) or []) or "this target"
    kinds = (("is_hybrid", "a hybrid (Mamba / linear-attention) target"),
             ("is_encoder_decoder", "an encoder-decoder target"),
             ("uses_mrope", "a target with M-RoPE (multimodal) positions"))
    for attr, kind in kinds:
        if getattr(model_config, attr, False):
            raise DDTreeConfigError(
                f"speculative method 'ddtree' cannot verify {kind} ({arch}): it supports "
                "decoder-only attention targets with one position a token; serve this "
                "model without --speculative-config or with one of vLLM's methods")
    get_defaults = getattr(model_config, "get_diff_sampling_param", None)
    penalty = (get_defaults() if get_defaults else {}).get("repetition_penalty")
    if penalty is not None and penalty != 1.0:
        raise DDTreeConfigError(
            f"the target's generation config sets repetition_penalty={penalty}, the "
            "default of every request, which speculative method 'ddtree' cannot honour "
            "(penalties assume the draft tokens form a chain): serve with "
            "--generation-config vllm, or --override-generation-config "
            "'{\"repetition_penalty\": 1.0}'")


def _verify_shape(value: Any, adaptive: bool) -> str | None:
    """``ddtree_verify_shape``: None (the default) or one of ``VERIFY_SHAPES``; only
    meaningful with ``ddtree_budget: "auto"``."""
    if value is None:
        return None
    if not isinstance(value, str) or value not in VERIFY_SHAPES:
        raise refuse("ddtree_verify_shape", value, "one of " + ", ".join(
            repr(v) for v in VERIFY_SHAPES) + ", or left out")
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
    if not isinstance(value, str) or value != AUTO_BUDGET:
        raise refuse("ddtree_budget", value, '"auto", or left out: the fixed node budget is '
                     '`num_speculative_tokens`; with "auto" it is the maximum B')
    return True


def tree_capacity(top_k: int, depth: int) -> int:
    """Nodes of a tree of ``depth`` levels whose nodes have at most ``top_k`` children:
    ``top_k + top_k**2 + ... + top_k**depth``."""
    return sum(top_k**d for d in range(1, depth + 1))


def _series(k: int, depth: int) -> str:
    """``"k + k^2 + ... + k^depth"`` with ``k`` written out."""
    terms = [str(k)] + [f"{k}^{d}" for d in range(2, depth + 1)]
    return " + ".join(terms) if depth <= 3 else f"{terms[0]} + {terms[1]} + ... + {terms[-1]}"


def check_budget_fits_tree(ddtree: DDTreeConfig, block_size: int, vocab_size: int) -> None:
    """The budget B fits a tree of depth ``block_size - 1`` (the drafter's mask
    queries) whose nodes have at most ``k`` children, ``k = min(ddtree_top_k or B, V)``:
    ``B <= k + k^2 + ... + k^(block_size - 1)``."""
    depth = block_size - 1
    k = min(ddtree.top_k or ddtree.budget, vocab_size)
    most = tree_capacity(k, depth)
    if ddtree.budget <= most:
        return
    if ddtree.top_k is None:
        why = f"the vocabulary size {vocab_size}"
    elif ddtree.top_k > vocab_size:
        why = f"ddtree_top_k={ddtree.top_k} capped at the vocabulary size {vocab_size}"
    else:
        why = f"ddtree_top_k={ddtree.top_k}"
    fix = " or raise ddtree_top_k" if ddtree.top_k is not None and k < vocab_size else ""
    raise refuse("num_speculative_tokens", ddtree.budget,
                 f"an int in 1..{most}: a tree of depth {depth} (the drafter's block_size "
                 f"{block_size} - 1) with at most {k} {'child' if k == 1 else 'children'} "
                 f"per node ({why}) holds at most {most} nodes ({_series(k, depth)}); lower "
                 f"num_speculative_tokens{fix}")


def check_drafter_for_target(drafter: str, target_hf_config, ddtree: DDTreeConfig | None = None,
                             max_model_len: int | None = None):
    """Check the DFlash drafter at ``drafter`` (a local directory) against the target,
    and, given ``ddtree``, that its budget fits the drafter's tree depth
    (:func:`check_budget_fits_tree`); given the target's ``max_model_len``, that the
    drafter's positions cover it (:func:`check_drafter_positions`).

    Reads only ``config.json`` (``drafter_config.load_drafter_config``: every field's
    type and range, then the fit to the target: hidden size, vocabulary, layer ids).
    Returns the drafter's transformers config; raises ``DDTreeConfigError`` /
    ``DrafterConfigError`` naming the field, the value and what is allowed.
    """
    from vllm_ddtree.drafter_config import (
        block_size_of,
        check_drafter_target_pair,
        load_drafter_config,
    )

    if not (Path(drafter) / "config.json").exists():
        raise DDTreeConfigError(
            f"`model` {drafter!r}: no config.json there; pass the local directory of a "
            "DFlash drafter (download it first: vLLM workers cannot check a hub name here)"
        )
    drafter_config = load_drafter_config(drafter)
    check_drafter_target_pair(drafter_config, target_hf_config)
    if max_model_len is not None:
        check_drafter_positions(drafter, drafter_config, max_model_len)
    if ddtree is not None:
        # A DFlash2 tree ranks as many candidates a position as a node may have children
        # (vllm_ddtree.tree.selector_tree.tree_candidates): the same bound as DFlash's.
        check_budget_fits_tree(ddtree, block_size_of(drafter_config),
                               target_hf_config.vocab_size)
    return drafter_config


def check_drafter_positions(drafter: str, drafter_config, max_model_len: int) -> None:
    """The drafter's RoPE table must hold every position it is given: vLLM's DFlash
    drafter sizes it by its own ``max_position_embeddings`` (``qwen3_dflash.py:283``)
    and clamps block positions to the target's ``max_model_len - 1``
    (``dflash/speculator.py:550``), with no bound check in between; a longer context
    would read cos/sin past the table's end. Raises ``DDTreeConfigError``."""
    positions = getattr(drafter_config, "max_position_embeddings", None)
    if positions is None or max_model_len <= positions:
        return
    raise DDTreeConfigError(
        f"`model` {drafter!r}: max_position_embeddings={positions} is below the target's "
        f"max_model_len={max_model_len}, and the drafter's RoPE table holds only "
        f"{positions} positions. Allowed: max_model_len <= {positions} (--max-model-len), "
        "or a drafter whose config.json covers max_model_len (raise its "
        "max_position_embeddings where its RoPE is meant to extrapolate)"
    )
