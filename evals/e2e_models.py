"""Model setups and prompts for ``evals/bench_e2e.py`` (no GPU, no vLLM import).

Setups:

- ``trained``: the project's embedded pair (``vllm_ddtree/checkpoints``): a 4-layer
  DeepSeek-V3 (MLA) target with ``max_position_embeddings`` 4096 and its DFlash drafter
  (block 16). Real weights, so acceptance is meaningful; only contexts that fit in 4096
  positions run.
- ``kimi64`` / ``kimi8``: a DeepSeek-V3 target with Kimi-K2 shapes (7168 hidden, q_lora
  1536, kv_lora 512, rope 64, vocab 163840) cut to 4 dense layers, with 64 query heads
  (Kimi-K2 on one GPU) or 8 (one GPU's share at TP8), and a DFlash drafter shaped like
  the published Kimi-K2.5/K2.6 drafters (6 Qwen3 layers, 7168 hidden, 64 heads / 8 KV
  heads, intermediate 18432, 5 sliding layers with window 4096 + 1 full layer, block 8).
  Config files only: vLLM loads them with ``load_format="dummy"`` (uniform weights in
  [-1e-3, 1e-3]: drafts are almost never accepted, so these measure step latency).

- ``trained_yarn``: the same pair with the target's RoPE stretched by YaRN x4 over
  its 512-token window (``vllm_ddtree/long_context.py``), how a short-window model is
  served at long context; max_position_embeddings 2048.
- ``v2lite`` / ``v2lite_moe``: a DeepSeek-V2-Lite-shaped MLA target (dense-MLP variant
  with the MoE's active parameters / the MoE itself) and a DFlash drafter, config files
  only (``evals/e2e_v2lite.py``); the rank oracle (``evals/e2e_oracle.py``) gives the
  dummy target a known greedy output and the drafter the embedded drafter's measured
  ranks.

Prompts: ``code`` (standard-library source tokenized with the target's tokenizer: text
the trained pair knows) and ``random`` (uniform token ids, unpredictable). Every prompt
has exactly the asked length.
"""

from __future__ import annotations

import functools
import json
import lzma
import sys
from dataclasses import dataclass, replace
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
CHECKPOINTS = REPO_ROOT / "vllm_ddtree" / "checkpoints"

# Kimi-K2 target shapes (moonshotai/Kimi-K2-Instruct config.json), 4 dense layers.
KIMI_VOCAB = 163840
KIMI_HIDDEN = 7168
KIMI_INTERMEDIATE = 18432
KIMI_TARGET_LAYERS = 4
KIMI_BOS, KIMI_EOS = 163584, 163585
KIMI_FIRST_SPECIAL = 163584  # ids >= this are special tokens in Kimi's tokenizer
KIMI_ROPE_THETA = 50000.0
KIMI_MAX_POSITIONS = 262144  # Kimi-K2-0905 / K2.5 context; raised when a run needs more
# DFlash drafter shaped like z-lab's Kimi-K2.5 drafter (6 Qwen3 layers, 64/8 heads,
# intermediate 18432), with the anchors' block 8 and 5 sliding + 1 full layers.
KIMI_DRAFTER_LAYERS = 6
KIMI_DRAFTER_HEADS = 64
KIMI_DRAFTER_KV_HEADS = 8
KIMI_DRAFTER_HEAD_DIM = 128
KIMI_DRAFTER_WINDOW = 4096
KIMI_DRAFTER_BLOCK = 8
KIMI_MASK_TOKEN = KIMI_VOCAB - 1  # a reserved special id
# The real drafter taps 6 of the target's 61 layers; vLLM collects each tapped layer
# once (``deepseek_v2.py`` aux_hidden_state_layers), so a 4-layer target offers 4.
KIMI_TARGET_LAYER_IDS = [0, 1, 2, 3]

PROMPT_KINDS = ("code", "random")
# Standard-library modules whose source makes the ``code`` prompts (the first three are
# those of evals/check_ddtree_vllm.py ``mixed_prompts``); more are added for long prompts.
CODE_MODULES = (
    "argparse", "json", "inspect", "typing", "dataclasses", "functools", "collections",
    "pathlib", "subprocess", "threading", "logging", "configparser", "difflib", "pydoc",
    "ast", "enum", "textwrap", "calendar", "datetime", "_pydecimal", "statistics",
    "fractions", "shutil", "tempfile", "os", "random", "heapq", "csv", "gettext", "locale",
    "optparse", "pickle", "pprint", "queue", "selectors", "smtplib", "socket", "ssl",
    "tokenize", "trace", "traceback", "uuid", "weakref", "tarfile", "zipfile",
    "email.message", "email.utils", "http.client", "http.server", "urllib.request",
    "unittest.case", "unittest.mock", "asyncio.base_events", "asyncio.tasks",
    "concurrent.futures._base", "multiprocessing.pool", "xml.dom.minidom", "imaplib",
    "ftplib", "mailbox", "doctest", "platform", "sysconfig", "zipimport",
)


@dataclass(frozen=True)
class Setup:
    """One model pair of the benchmark."""

    name: str
    title: str
    description: str
    dummy: bool  # load_format="dummy" (config files only)
    heads: int | None  # Kimi target query heads; None for the trained pair
    default_kinds: tuple[str, ...]
    random_ids: tuple[int, int]  # [low, high) of ``random`` prompt ids (no special ids)
    block_size: int  # drafter block: the DFlash chain drafts block_size - 1 tokens
    max_positions: int  # the target's max_position_embeddings (default)
    # the embedded target with YaRN (long_context.yarn_parameters()), written per run
    target_rope: bool = False
    family: str = "kimi"  # dummy setups: "kimi" or "v2lite" (config writer)
    moe: bool = False  # v2lite: the MoE target (else its dense-MLP variant)
    # the rank oracle (evals/e2e_oracle.py): structured target, drafter logits from the
    # embedded drafter's measured ranks
    oracle: bool = False


SETUPS: dict[str, Setup] = {
    "trained": Setup(
        name="trained",
        title="Trained pair (embedded checkpoints)",
        description=(
            "vllm_ddtree/checkpoints: DeepSeek-V3 (MLA) target, 4 layers, hidden 256, 4 heads, "
            "kv_lora 512, rope 64, vocab 4096, max_position_embeddings 4096; DFlash drafter "
            "with 3 layers (sliding 256 / full / sliding), block 16. Real weights."
        ),
        dummy=False,
        heads=None,
        default_kinds=("code", "random"),
        random_ids=(2, 4096),  # 0 = bos/eos/pad, 1 = mask
        block_size=16,
        max_positions=4096,
    ),
    "trained_yarn": Setup(
        name="trained_yarn",
        title="Trained pair, target RoPE stretched by YaRN x4 (long-context serving)",
        description=(
            "The embedded pair with the target's config changed to YaRN factor 4 over its "
            "512-token training window (vllm_ddtree/long_context.py; max_position_embeddings "
            "2048; same weights, drafter unchanged): the target holds past 640 tokens, where "
            "the unscaled one falls apart. AR, the chain and DDTree all run this target."
        ),
        dummy=False,
        heads=None,
        default_kinds=("code",),
        random_ids=(2, 4096),
        block_size=16,
        max_positions=2048,
        target_rope=True,
    ),
    "kimi64": Setup(
        name="kimi64",
        title="Kimi-K2-shaped MLA target, 64 heads (one GPU), dummy weights",
        description=(
            "DeepSeek-V3 architecture with Kimi-K2 shapes (hidden 7168, 64 heads, q_lora 1536, "
            "kv_lora 512, rope 64, vocab 163840), 4 dense layers; DFlash drafter shaped like "
            "the Kimi-K2.6 drafter (6 Qwen3 layers, hidden 7168, 64 heads / 8 KV heads, "
            "5 sliding (window 4096) + 1 full layer, block 8). Dummy weights: drafts are "
            "~never accepted, so the figures are step latencies."
        ),
        dummy=True,
        heads=64,
        default_kinds=("random",),
        random_ids=(1000, KIMI_FIRST_SPECIAL),
        block_size=KIMI_DRAFTER_BLOCK,
        max_positions=KIMI_MAX_POSITIONS,
    ),
    "kimi8": Setup(
        name="kimi8",
        title="Kimi-K2-shaped MLA target, 8 heads (one GPU's share at TP8), dummy weights",
        description=(
            "As kimi64 with 8 query heads (Kimi-K2's 64 heads split over 8 GPUs); same "
            "drafter (64 heads / 8 KV heads). Dummy weights: step latencies."
        ),
        dummy=True,
        heads=8,
        default_kinds=("random",),
        random_ids=(1000, KIMI_FIRST_SPECIAL),
        block_size=KIMI_DRAFTER_BLOCK,
        max_positions=KIMI_MAX_POSITIONS,
    ),
}


def _v2lite_setup(name: str, moe: bool) -> Setup:
    from e2e_v2lite import (
        V2LITE_DRAFTER_BLOCK,
        V2LITE_FIRST_SPECIAL,
        V2LITE_MAX_POSITIONS,
    )

    mlp = ("MoE: 64 routed experts of 1408 + 2 shared, 6 routed active, first layer dense "
           "(needs vLLM's fused-MoE ops)" if moe else
           "every layer a dense MLP of intermediate 11264 = (6 active + 2 shared) x 1408: "
           "the MoE's active parameters per token (evals/e2e_v2lite.py)")
    return Setup(
        name=name,
        title=("DeepSeek-V2-Lite-shaped MLA target" + (" (MoE)" if moe else
                                                       " (dense-MLP variant)")
               + ", rank-oracle drafter, dummy weights"),
        description=(
            "27 layers, hidden 2048, 16 heads, kv_lora 512, qk_rope 64, qk_nope 128, v_head "
            f"128, vocab 102400; {mlp}. DFlash drafter shaped like Qwen3-4B-DFlash-b16 at "
            "hidden 2048 (3 layers, block 16). Dummy weights made into a known greedy "
            "output, and drafter logits that rank the true token as the embedded drafter "
            "did on code, with probabilities fitted to its calibration (what its trees "
            "promise against what they commit, evals/e2e_oracle.py, "
            "evals/data/drafter_ranks.json): acceptance and confidence are the embedded "
            "drafter's, cost is V2-Lite's."
        ),
        dummy=True,
        heads=16,
        default_kinds=("random",),
        random_ids=(1000, V2LITE_FIRST_SPECIAL),
        block_size=V2LITE_DRAFTER_BLOCK,
        max_positions=V2LITE_MAX_POSITIONS,
        family="v2lite",
        moe=moe,
        oracle=True,
    )


SETUPS["trained_dflash2"] = replace(
    SETUPS["trained"], name="trained_dflash2", title="Trained pair and its DFlash2 drafter",
    description=(
        "The embedded pair (as `trained`) beside the DFlash2 drafter trained for its target "
        "(vllm_ddtree/checkpoints/dflash2_drafter: the DFlash drafter plus grouped "
        "convolutions and a candidate selector; runs with +dflash2). DDTree over the "
        "selector's scores, over the DFlash2 marginals (+marginals) and the selector's chain "
        "walk (B = 15, +top1) beside DDTree over the DFlash drafter."),
    default_kinds=("code",))
SETUPS["v2lite"] = _v2lite_setup("v2lite", moe=False)
SETUPS["v2lite_moe"] = _v2lite_setup("v2lite_moe", moe=True)


@dataclass(frozen=True)
class ModelPaths:
    target: Path
    drafter: Path
    tokenizer_file: Path | None  # tokenizers' tokenizer.json (None: token ids only)
    max_positions: int


# ---------------------------------------------------------------------------------------
# Config files of the Kimi-shaped pair


def kimi_target_config(heads: int, max_positions: int = KIMI_MAX_POSITIONS):
    """``DeepseekV3Config`` with Kimi-K2 shapes, ``heads`` query heads, 4 dense layers."""
    from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config

    return DeepseekV3Config(
        architectures=["DeepseekV3ForCausalLM"],
        dtype="bfloat16",
        vocab_size=KIMI_VOCAB,
        hidden_size=KIMI_HIDDEN,
        intermediate_size=KIMI_INTERMEDIATE,
        moe_intermediate_size=2048,
        num_hidden_layers=KIMI_TARGET_LAYERS,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        n_shared_experts=1,
        n_routed_experts=384,  # unused: every layer is dense (first_k_dense_replace)
        routed_scaling_factor=2.827,
        kv_lora_rank=512,
        q_lora_rank=1536,
        qk_rope_head_dim=64,
        v_head_dim=128,
        qk_nope_head_dim=128,
        n_group=1,
        topk_group=1,
        num_experts_per_tok=8,
        first_k_dense_replace=KIMI_TARGET_LAYERS,
        norm_topk_prob=True,
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-6,
        bos_token_id=KIMI_BOS,
        eos_token_id=KIMI_EOS,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": KIMI_ROPE_THETA},
        num_mtp_layers=0,
    )


def dflash_drafter_config(*, vocab: int, hidden: int, intermediate: int, layers: int,
                          heads: int, kv_heads: int, head_dim: int, max_positions: int,
                          rope_theta: float, block_size: int, target_layer_ids,
                          mask_token: int, bos: int, eos: int, tie_embeddings: bool,
                          window: int | None = None, num_target_layers: int | None = None):
    """``Qwen3Config`` of a DFlash drafter of this shape: every layer full attention, or
    with ``window`` sliding layers and a full last one (the published Kimi drafters)."""
    from transformers.models.qwen3.configuration_qwen3 import Qwen3Config

    if window is None:
        sliding = dict(use_sliding_window=False, layer_types=["full_attention"] * layers)
    else:
        sliding = dict(use_sliding_window=True, sliding_window=window,
                       max_window_layers=layers,
                       layer_types=["sliding_attention"] * (layers - 1) + ["full_attention"])
    config = Qwen3Config(
        architectures=["DFlashDraftModel"],
        dtype="bfloat16",
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        **sliding,
        tie_word_embeddings=tie_embeddings,
        bos_token_id=bos,
        eos_token_id=eos,
    )
    config.block_size = block_size
    config.target_hidden_size = hidden
    if num_target_layers is not None:
        config.num_target_layers = num_target_layers
    config.dflash_config = {"target_layer_ids": list(target_layer_ids),
                            "mask_token_id": mask_token}
    return config


def kimi_drafter_config(max_positions: int = KIMI_MAX_POSITIONS,
                        block_size: int = KIMI_DRAFTER_BLOCK):
    """``Qwen3Config`` of a DFlash drafter shaped like the Kimi-K2.6 drafter."""
    return dflash_drafter_config(
        vocab=KIMI_VOCAB, hidden=KIMI_HIDDEN, intermediate=KIMI_INTERMEDIATE,
        layers=KIMI_DRAFTER_LAYERS, heads=KIMI_DRAFTER_HEADS, kv_heads=KIMI_DRAFTER_KV_HEADS,
        head_dim=KIMI_DRAFTER_HEAD_DIM, max_positions=max_positions,
        rope_theta=KIMI_ROPE_THETA, block_size=block_size,
        target_layer_ids=KIMI_TARGET_LAYER_IDS, mask_token=KIMI_MASK_TOKEN, bos=KIMI_BOS,
        eos=KIMI_EOS, tie_embeddings=False, window=KIMI_DRAFTER_WINDOW)


def _write_config(config, out: Path) -> Path:
    """``config.json`` (and nothing else) in ``out``; rewritten only when it changed,
    so a directory shared by several runs keeps its modification time."""
    out.mkdir(parents=True, exist_ok=True)
    text = config.to_json_string(use_diff=False)
    path = out / "config.json"
    if not path.exists() or path.read_text() != text:
        path.write_text(text)
    return out


def write_kimi_pair(out: Path, heads: int, max_positions: int = KIMI_MAX_POSITIONS
                    ) -> tuple[Path, Path]:
    """Write ``out/target/config.json`` and ``out/drafter/config.json``."""
    target = _write_config(kimi_target_config(heads, max_positions), out / "target")
    drafter = _write_config(kimi_drafter_config(max_positions), out / "drafter")
    return target, drafter


def prepare_setup(setup: Setup, model_root: Path, min_positions: int = 0) -> ModelPaths:
    """Paths of ``setup``'s target and drafter (config files written for dummy setups).

    ``min_positions``: the longest sequence a run needs; Kimi configs get a larger
    ``max_position_embeddings`` when it exceeds the default (the trained pair cannot).
    """
    if setup.target_rope:
        from vllm_ddtree.long_context import write_rope_scaled, yarn_parameters

        target = CHECKPOINTS / "target"
        rope = read_config(target).get("rope_parameters") or {}
        if rope.get("rope_type", "default") == "default":  # else scaled already (E2E_PAIR)
            target = write_rope_scaled(target, Path(model_root) / setup.name / "target",
                                       yarn_parameters())
        return ModelPaths(target, CHECKPOINTS / "drafter", target / "tokenizer.json",
                          setup.max_positions)
    if not setup.dummy:
        return ModelPaths(CHECKPOINTS / "target", CHECKPOINTS / "drafter",
                          CHECKPOINTS / "target" / "tokenizer.json", setup.max_positions)
    positions = setup.max_positions
    while positions < min_positions:
        positions *= 2
    if setup.family == "v2lite":
        from e2e_v2lite import v2lite_drafter_config, v2lite_target_config

        root = Path(model_root) / setup.name
        target = _write_config(v2lite_target_config(setup.moe, positions), root / "target")
        drafter = _write_config(v2lite_drafter_config(positions), root / "drafter")
        return ModelPaths(target, drafter, None, positions)
    target, drafter = write_kimi_pair(Path(model_root) / setup.name, setup.heads, positions)
    return ModelPaths(target, drafter, None, positions)


def read_config(path: Path) -> dict:
    return json.loads((Path(path) / "config.json").read_text())


def weight_bytes(model_dir: Path, dtype_bytes: int = 2) -> int:
    """Bytes of the parameters of the model whose ``config.json`` is in ``model_dir``
    (built on the meta device by transformers: no memory, no weights read)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_dir))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters()) * dtype_bytes


def kv_cache_bytes(target: dict, drafter: dict, context: int, batch: int,
                   dtype_bytes: int = 2) -> dict:
    """KV-cache bytes ``batch`` sequences of ``context`` tokens need (config.json
    dicts): MLA target ``layers x (kv_lora_rank + rope) x dtype`` per token; drafter
    K and V per layer, sliding layers capped at their window."""
    mla = target["kv_lora_rank"] + target["qk_rope_head_dim"]
    target_bytes = target["num_hidden_layers"] * mla * dtype_bytes * context * batch
    head_dim = drafter.get("head_dim") or drafter["hidden_size"] // drafter["num_attention_heads"]
    per_token = 2 * drafter["num_key_value_heads"] * head_dim * dtype_bytes
    window = drafter.get("sliding_window") or context
    types = drafter.get("layer_types") or ["full_attention"] * drafter["num_hidden_layers"]
    drafter_bytes = sum(per_token * (min(window, context) if t == "sliding_attention"
                                     else context) for t in types) * batch
    return {"target": target_bytes, "drafter": drafter_bytes,
            "total": target_bytes + drafter_bytes}


# ---------------------------------------------------------------------------------------
# Prompts


def random_prompts(batch: int, length: int, id_range: tuple[int, int], seed: int
                   ) -> list[list[int]]:
    """``batch`` prompts of exactly ``length`` uniform token ids in ``[low, high)``."""
    import numpy as np

    low, high = id_range
    if not 0 <= low < high:
        raise ValueError(f"bad id range {id_range}")
    rng = np.random.default_rng(seed)
    return rng.integers(low, high, size=(batch, length)).tolist()


# The first CODE_MODULES' source as Python 3.11 ships it (the embedded pair's tokenizer
# and every reference-engine result were made on 3.11): the device's 3.12 has other
# text in the same modules (argparse, ...), so its prompts were not the ones the CPU
# reference engine measured. Modules past the snapshot come from the running Python.
CODE_SOURCE_SNAPSHOT = Path(__file__).resolve().parent / "data" / "code_modules_py311.json.xz"
CODE_SOURCE_SNAPSHOT_CHARS = 600_000


@functools.lru_cache(maxsize=1)
def code_source_snapshot() -> dict[str, str]:
    """``{module name: source}`` of the snapshot (empty when the file is absent)."""
    if not CODE_SOURCE_SNAPSHOT.exists():
        return {}
    with lzma.open(CODE_SOURCE_SNAPSHOT, "rt", encoding="utf-8") as f:
        return dict(json.load(f)["modules"])


def live_module_source(name: str) -> str | None:
    """This Python's source of module ``name`` (None when it has none)."""
    import importlib
    import inspect

    try:
        return inspect.getsource(importlib.import_module(name))
    except (ImportError, OSError, TypeError):
        return None


def write_code_source_snapshot(path: Path = CODE_SOURCE_SNAPSHOT,
                               min_chars: int = CODE_SOURCE_SNAPSHOT_CHARS) -> dict:
    """Write the running Python's source of the first ``CODE_MODULES`` (at least
    ``min_chars`` in all) to ``path`` (xz JSON ``{"python", "modules": [[name, src]]}``)."""
    modules, total = [], 0
    for name in dict.fromkeys(CODE_MODULES):
        source = live_module_source(name)
        if source is None:
            continue
        modules.append([name, source])
        total += len(source)
        if total >= min_chars:
            break
    data = {"python": sys.version.split()[0], "modules": modules}
    path.parent.mkdir(parents=True, exist_ok=True)
    with lzma.open(path, "wt", encoding="utf-8", preset=9) as f:
        json.dump(data, f)
    code_source_snapshot.cache_clear()
    return data


def stdlib_source(min_chars: int, modules: tuple[str, ...] = CODE_MODULES) -> str:
    """Concatenated source of standard-library modules, at least ``min_chars`` long
    when the listed modules hold that much (else all of them): each module's text from
    the Python 3.11 snapshot when it holds it, else from the running Python."""
    snapshot = code_source_snapshot()
    parts, total = [], 0
    for name in dict.fromkeys(modules):
        source = snapshot.get(name)
        if source is None:
            source = live_module_source(name)
        if source is None:
            continue
        parts.append(source)
        total += len(source)
        if total >= min_chars:
            break
    return "".join(parts)


def load_tokenizer(tokenizer_file: Path):
    """A ``tokenizers.Tokenizer`` (fast to import; same ids as the target's
    ``PreTrainedTokenizerFast``, which adds no special tokens here)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tokenizer_file))


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` with a ``tokenizers.Tokenizer`` or a transformers tokenizer."""
    out = tokenizer.encode(text)
    return list(out.ids) if hasattr(out, "ids") else list(out)


def code_prompts(tokenizer, batch: int, length: int, chars_per_token: float = 2.0
                 ) -> list[list[int]]:
    """``batch`` disjoint slices of ``length`` tokens of standard-library source."""
    need = batch * length
    min_chars = int(need * chars_per_token) + 10_000
    ids = encode(tokenizer, stdlib_source(min_chars))
    while len(ids) < need:  # a tokenizer denser than chars_per_token: read more
        more = stdlib_source(2 * min_chars)
        if len(more) <= min_chars:
            raise ValueError(
                f"the standard library's listed modules give {len(ids)} tokens, "
                f"{need} needed for {batch} x {length}"
            )
        min_chars *= 2
        ids = encode(tokenizer, more)
    return [ids[i * length:(i + 1) * length] for i in range(batch)]


def parse_prompt_kind(kind: str) -> tuple[str, int]:
    """``(base, set)`` of a prompt kind: ``code`` / ``random``, optionally ``@k`` for
    the k-th disjoint prompt set (``code@1``: the next ``batch`` slices of the same
    source; ``code`` = ``code@0``). At batch 1 one prompt decides a cell's acceptance
    (DDTree B = 64 on the YaRN-served trained pair: 2.6-6.4 tokens per round
    across eight 1k slices, reference engine), so a run can
    measure several sets side by side."""
    base, sep, index = kind.partition("@")
    if base not in PROMPT_KINDS:
        raise ValueError(f"unknown prompt kind {kind!r}; choose from {PROMPT_KINDS}, "
                         "optionally with @k (k >= 0) for the k-th prompt set")
    if not sep:
        return base, 0
    if not index.isdigit():
        raise ValueError(f"prompt kind {kind!r}: the set after '@' must be an integer "
                         ">= 0, e.g. code@1")
    return base, int(index)


def make_prompts(kind: str, batch: int, length: int, setup: Setup, tokenizer=None,
                 seed: int = 0) -> list[list[int]]:
    """Prompts of ``kind`` (see :func:`parse_prompt_kind`; ``code`` needs the target's
    tokenizer): ``batch`` lists of ``length`` token ids."""
    base, index = parse_prompt_kind(kind)
    if base == "random":
        return random_prompts(batch, length, setup.random_ids, seed + 7919 * index)
    if tokenizer is None:
        raise ValueError(f"setup {setup.name} has no tokenizer: 'code' prompts need one")
    return code_prompts(tokenizer, batch * (index + 1), length)[index * batch:]


def cell_seed(context: int, batch: int) -> int:
    """Distinct random prompts per (context, batch) cell (no prefix-cache hits across
    cells)."""
    return 1_000_003 * batch + context
