"""The drafter's greedy pools on disk, so that decoding them and training on them can
run in separate jobs.

A large pool takes minutes to decode (12,288 sequences took vLLM about 5.5 minutes on
an H200), so a job with a time limit may not fit decoding and drafter training. The
pools' tokens (corpus prefix + greedy continuation + padding), prefix lengths and
continuation ends are saved as one ``.npz`` beside a description of what produced them
(the target's weights, the corpus splits, the pool settings); a later run loads them
only when that description matches its own, and recomputes the aux hidden states with
its target (one forward per batch, seconds on a GPU).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from vllm_ddtree.training.corpus import sha256_file
from vllm_ddtree.training.train_drafter import DrafterTrainConfig, GreedyPool, pool_from_tokens

__all__ = ["pool_description", "save_pools", "load_pools", "POOL_FILE"]

POOL_FILE = "pools.npz"
# DrafterTrainConfig fields that decide a pool's sequences (not how it is trained on).
# gen_batch: transformers' pool takes one corpus prefix length per decoding batch.
_POOL_FIELDS = ("seq_len", "prefix_min", "prefix_max", "continuation_max",
                "gen_sequences", "gen_batch", "eval_sequences")


def pool_description(target_dir: str | Path, corpus_sha: dict[str, str],
                     cfg: DrafterTrainConfig, seed: int) -> dict:
    """What a pool depends on: the target's weights (``model.safetensors`` digest), the
    corpus splits' digests (``manifest.json``'s ``npy_sha256``), the pool settings of
    ``cfg`` and the seed."""
    return {
        "target_sha256": sha256_file(Path(target_dir) / "model.safetensors"),
        "corpus_sha256": dict(sorted(corpus_sha.items())),
        **{name: getattr(cfg, name) for name in _POOL_FIELDS},
        "seed": seed,
    }


def save_pools(directory: str | Path, pools: dict[str, GreedyPool], description: dict,
               engine: str) -> Path:
    """Write ``pools`` (``{name: pool}``) and ``description`` to
    ``directory/pools.npz``; tokens as int32, prefix lengths and ends as int64."""
    path = Path(directory) / POOL_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    arrays = {}
    for name, pool in pools.items():
        arrays[f"{name}_tokens"] = pool.tokens.cpu().numpy().astype(np.int32)
        arrays[f"{name}_prefix_len"] = pool.prefix_len.cpu().numpy().astype(np.int64)
        arrays[f"{name}_end"] = pool.end.cpu().numpy().astype(np.int64)
    meta = {"description": description, "engine": engine, "names": list(pools)}
    np.savez(path, meta=np.array(json.dumps(meta)), **arrays)
    return path


def load_pools(directory: str | Path, description: dict, target, layer_ids,
               cfg: DrafterTrainConfig, device: torch.device | str
               ) -> tuple[dict[str, GreedyPool], str] | None:
    """The pools saved in ``directory`` with their aux hidden states recomputed by
    ``target`` (``{name: pool}``, engine name), or None when there is no pool file.

    Raises ``ValueError`` naming the fields that differ when the saved pools were made
    for another target, corpus or pool setting (delete the file or pass another
    ``--pool-cache``)."""
    path = Path(directory) / POOL_FILE
    if not path.exists():
        return None
    with np.load(path) as data:
        meta = json.loads(str(data["meta"]))
        saved = meta["description"]
        differ = sorted(k for k in set(saved) | set(description)
                        if saved.get(k) != description.get(k))
        if differ:
            raise ValueError(
                f"{path} holds pools for another run (fields that differ: "
                f"{', '.join(differ)}): delete it or pass another --pool-cache")
        pools = {
            name: pool_from_tokens(
                target, torch.from_numpy(data[f"{name}_tokens"].astype(np.int64)),
                torch.from_numpy(data[f"{name}_prefix_len"]),
                torch.from_numpy(data[f"{name}_end"]), layer_ids, cfg, device)
            for name in meta["names"]
        }
    return pools, meta["engine"]
