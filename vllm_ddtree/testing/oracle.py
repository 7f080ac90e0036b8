"""Oracle drafter logits: the target's own continuation placed at chosen ranks.

A trained drafter accepts a few tokens per round and a random one almost none, so
neither exercises deep acceptance paths (long KV compactions, hidden-row gathers,
16 tokens committed per step). The oracle replaces the drafter's logits of depths
1..L by logits in which the *true* token of depth ``d`` (the token greedy decoding
will produce at that position, known from a prior AR run) has rank ``ranks[d-1]``,
and everything else is seeded noise. The target still decides every token, so the
output must not change; only which tokens are proposed does.

Logit layout of one depth with rank ``k`` (V = vocabulary):

* every token: ``noise * N(0, 1)`` (seeded);
* the true token: ``confident`` (default 12, far above the noise maximum, about
  ``noise * 4`` for V = 4096: with V = 4096 a logit of 12 still leaves the true
  token about 97 % of the mass at rank 0);
* ``k`` decoys (random tokens other than the true one) at ``confident + step * (k - j)``,
  ``j = 0..k-1``, so exactly ``k`` tokens rank above the true one.

A depth whose rank is ``None`` (or past the end of ``ranks``, or of the known
continuation) is noise only: the true token sits at a random rank there.

Everything is pure PyTorch on CPU tensors; :func:`oracle_logits` returns a float32
copy on the input's device.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

__all__ = [
    "CONFIDENT_LOGIT",
    "DECOY_STEP",
    "NOISE_STD",
    "OracleRecord",
    "acceptance_summary",
    "install_oracle",
    "oracle_depth_logits",
    "oracle_logits",
    "oracle_true_tokens",
    "parse_ranks",
    "predicted_accepted_depth",
    "request_index",
    "row_seed",
    "true_path_depth",
]

CONFIDENT_LOGIT = 12.0
DECOY_STEP = 0.5
NOISE_STD = 0.5


def parse_ranks(spec: str) -> list[int | None]:
    """``"0,0,0,1,2"`` -> ``[0, 0, 0, 1, 2]``; ``"0*3,1,r*2"`` -> ``[0, 0, 0, 1, None,
    None]``. ``r`` (random) means noise only at that depth."""
    ranks: list[int | None] = []
    for item in spec.replace(" ", "").split(","):
        if not item:
            continue
        value, _, count = item.partition("*")
        n = int(count) if count else 1
        if n < 1:
            raise ValueError(f"bad repeat count in {item!r}")
        if value in ("r", "x", "-"):
            rank = None
        else:
            rank = int(value)
            if rank < 0:
                raise ValueError(f"rank must be >= 0, got {rank}")
        ranks.extend([rank] * n)
    if not ranks:
        raise ValueError(f"no ranks in {spec!r}")
    return ranks


# LLM.generate names requests str(next(counter)) (entrypoints/offline_utils.py:563);
# InputProcessor.assign_request_id appends "-" + 8 random hex characters
# (v1/engine/input_processor.py:222-240) unless VLLM_DISABLE_REQUEST_ID_RANDOMIZATION.
# Warm-up ("_warmup_{i}_") and dummy ("req_{i}_{uuid}") requests do not match.
_REQUEST_ID = re.compile(r"(\d+)(?:-[0-9a-f]+)?")


def request_index(req_id: str) -> int | None:
    """Index of the prompt (in the order given to ``LLM.generate``) of an engine
    request id, or None for warm-up, dummy and foreign requests."""
    match = _REQUEST_ID.fullmatch(req_id)
    return int(match.group(1)) if match else None


def oracle_true_tokens(truth: Sequence[int], depth_positions: Sequence[int]) -> list[int | None]:
    """The true token at each depth: ``truth[p]`` for the absolute position ``p`` the
    depth predicts (None past the known sequence). ``truth`` is prompt + AR output."""
    return [int(truth[p]) if 0 <= p < len(truth) else None for p in depth_positions]


def row_seed(prompt_index: int, root_position: int) -> int:
    """Noise seed of one draft: same request and root -> same logits in every run."""
    return (prompt_index * 1_000_003 + root_position) % (2**31 - 1)


def oracle_depth_logits(
    true_tokens: Sequence[int | None],
    ranks: Sequence[int | None],
    vocab_size: int,
    seed: int,
    *,
    confident: float = CONFIDENT_LOGIT,
    step: float = DECOY_STEP,
    noise: float = NOISE_STD,
) -> torch.Tensor:
    """Oracle logits of one draft, float32 ``[L, V]`` with ``L = len(true_tokens)``
    (see the module docstring). ``ranks[d]`` applies to depth ``d + 1``."""
    num_depths = len(true_tokens)
    gen = torch.Generator().manual_seed(seed)
    logits = noise * torch.randn(num_depths, vocab_size, generator=gen)
    for d, token in enumerate(true_tokens):
        rank = ranks[d] if d < len(ranks) else None
        if token is None or rank is None:
            continue
        if rank >= vocab_size:
            raise ValueError(f"rank {rank} needs more than V={vocab_size} tokens")
        logits[d, token] = confident
        if rank:
            pool = torch.randperm(vocab_size, generator=gen)[: rank + 1].tolist()
            decoys = [t for t in pool if t != token][:rank]
            for j, decoy in enumerate(decoys):
                logits[d, decoy] = confident + step * (rank - j)
    return logits


def oracle_logits(
    logits: torch.Tensor,
    rows: Sequence[Sequence[int | None] | None],
    ranks: Sequence[int | None],
    seeds: Sequence[int],
    **kwargs,
) -> torch.Tensor:
    """Drafter logits ``[R, L, V]`` with row ``r`` replaced by oracle logits built
    from ``rows[r]`` (the true tokens of depths 1..L) when it is not None.

    Returns a new float32 tensor on ``logits.device``; rows left as None keep the
    drafter's logits."""
    num_reqs, num_depths, vocab_size = logits.shape
    if len(rows) != num_reqs or len(seeds) != num_reqs:
        raise ValueError(f"{len(rows)} rows / {len(seeds)} seeds for {num_reqs} requests")
    out = logits.float().clone()
    for r, true_tokens in enumerate(rows):
        if true_tokens is None:
            continue
        if len(true_tokens) != num_depths:
            raise ValueError(f"row {r}: {len(true_tokens)} true tokens for L={num_depths}")
        out[r] = oracle_depth_logits(true_tokens, ranks, vocab_size, seeds[r], **kwargs).to(
            out.device
        )
    return out


def true_path_depth(tokens: Sequence[int], parents: Sequence[int],
                    true_tokens: Sequence[int | None]) -> int:
    """How deep the true continuation goes in one tree (``tokens`` / ``parents`` of
    its B nodes, topologically ordered): the depth greedy verification accepts when
    the target's tokens are ``true_tokens``."""
    current, depth = -1, 0
    for token in true_tokens:
        if token is None:
            break
        child = next((i for i, (t, p) in enumerate(zip(tokens, parents, strict=True))
                      if p == current and t == token), None)
        if child is None:
            break
        current, depth = child, depth + 1
    return depth


def predicted_accepted_depth(
    ranks: Sequence[int | None],
    budget: int,
    num_depths: int,
    vocab_size: int,
    top_k: int | None = None,
    num_samples: int = 8,
    seed: int = 0,
) -> list[int]:
    """Accepted depths of ``num_samples`` oracle drafts of random true continuations
    (``build_ddtree`` on CPU): what the engine should accept per round when its
    output follows the truth."""
    from vllm_ddtree.tree.draft_tree import build_ddtree

    gen = torch.Generator().manual_seed(seed)
    depths = []
    for i in range(num_samples):
        truth = torch.randint(0, vocab_size, (num_depths,), generator=gen).tolist()
        logits = oracle_depth_logits(truth, ranks, vocab_size, row_seed(i, 1000 + i))
        tree = build_ddtree(logits[None], budget, top_k)
        depths.append(true_path_depth(tree.tokens[0].tolist(), tree.parents[0].tolist(), truth))
    return depths


def acceptance_summary(
    rounds: Sequence[dict],
    prompt_lens: Sequence[int],
    first_mismatch: Sequence[int | None],
    min_depth: int = 3,
) -> dict:
    """Accepted depths of the verify rounds whose committed prefix still equals the
    reference (AR) output, i.e. the rounds in which the oracle proposed the truth.

    A round ``{"prompt": q, "root_pos": p, "depth": a}`` verified a tree rooted at
    the last committed token, position ``p`` = output index ``p - prompt_len``; it
    counts iff every output token up to that index matches the reference, i.e.
    ``first_mismatch[q]`` is None or greater than that index.
    """
    counted = []
    for rnd in rounds:
        q = rnd["prompt"]
        index = rnd["root_pos"] - prompt_lens[q]
        if first_mismatch[q] is None or index < first_mismatch[q]:
            counted.append(rnd["depth"])
    n = len(counted)
    histogram: dict[int, int] = {}
    for d in counted:
        histogram[d] = histogram.get(d, 0) + 1
    return {
        "rounds": n,
        "rounds_total": len(rounds),
        "mean_depth": sum(counted) / n if n else 0.0,
        "min_depth": min_depth,
        "frac_at_least_min_depth": sum(d >= min_depth for d in counted) / n if n else 0.0,
        "histogram": dict(sorted(histogram.items())),
    }


# -- the in-process vLLM engine ------------------------------------------------------


@dataclass
class OracleRecord:
    """What :func:`install_oracle` saw while the engine ran.

    * ``rounds``: one dict per verified tree of a known request: ``prompt`` (index),
      ``root_pos`` (position of the tree's root, the last committed token),
      ``depth`` (accepted depth, ``num_sampled - 1``) and ``nodes`` (verified drafts).
    * ``drafts``: ``[prompt, bonus position]`` of every oracle draft (the root of the
      tree the next verify step sees).
    * ``oracle_rows`` / ``passthrough_rows``: draft rows given oracle logits / left
      with the drafter's (warm-up, dummy); ``shape_mismatches``: drafts whose logits
      did not have one row per request of the batch (left alone).
    """

    rounds: list[dict] = field(default_factory=list)
    drafts: list[list[int]] = field(default_factory=list)
    oracle_rows: int = 0
    passthrough_rows: int = 0
    shape_mismatches: int = 0

    def rounds_without_draft(self) -> int:
        """Verified trees whose root is not the bonus position of an oracle draft of
        the same request: each should be one (a position bookkeeping check)."""
        roots = {(q, pos) for q, pos in self.drafts}
        return sum((r["prompt"], r["root_pos"]) not in roots for r in self.rounds)


def install_oracle(
    truths: Sequence[Sequence[int]], ranks: Sequence[int | None], **logit_kwargs
) -> tuple[OracleRecord, Callable[[], None]]:
    """Make this process's DDTree speculator draft oracle trees; returns the record
    that fills while the engine runs and a function that undoes the patches.

    ``truths[q]`` is prompt ``q`` + the target's output (``LLM.generate`` order).
    Needs the in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and eager
    mode (it reads device tensors on the host). Three patches:

    * ``DDTreeSpeculator.propose`` remembers the speculator and ``input_batch.req_ids``
      (batch order: the rows of ``_generate_draft``); dummy runs are left alone.
    * ``vllm_ddtree.draft.speculator.build_ddtree_fast`` (``_generate_draft`` calls it on the
      drafter logits ``[R, L, V]``) gets oracle logits instead. Depth ``d`` of row
      ``r`` predicts absolute position ``sample_pos[r * L + d - 1]``, which DFlash's
      ``_prepare_dflash_inputs_kernel`` (``dflash/speculator.py:534-564``) sets to
      ``last_valid_pos + 1 + d`` (``last_valid_pos = positions[ctx_end - num_rejected
      - 1]``, the last token with KV; ``+ 1`` is the bonus token, the next root); the
      true token there is ``truth[sample_pos]``.
    * ``DDTreeVerifier.__call__`` records each verified tree (:class:`OracleRecord`).
    """
    from vllm_ddtree.draft import speculator as speculator_mod
    from vllm_ddtree.verify import verifier as verifier_mod

    record = OracleRecord()
    ctx: dict = {"spec": None, "req_ids": None}
    ranks = list(ranks)

    original_propose = speculator_mod.DDTreeSpeculator.propose
    original_build = speculator_mod.build_ddtree_fast
    original_call = verifier_mod.DDTreeVerifier.__call__
    signature = inspect.signature(original_propose)

    def propose(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        dummy = bound.arguments.get("dummy_run", False)
        ctx["spec"] = self
        ctx["req_ids"] = None if dummy else list(bound.arguments["input_batch"].req_ids)
        try:
            return original_propose(self, *args, **kwargs)
        finally:
            ctx["req_ids"] = None

    def build_oracle_tree(logits, budget, top_k=None, *, out=None):
        req_ids, spec = ctx["req_ids"], ctx["spec"]
        if req_ids is None:
            return original_build(logits, budget, top_k, out=out)
        num_reqs, num_depths, _ = logits.shape
        if num_reqs != len(req_ids) or num_depths != spec.num_draft_depths:
            record.shape_mismatches += 1
            return original_build(logits, budget, top_k, out=out)
        positions = spec.sample_pos[: num_reqs * num_depths].view(num_reqs, num_depths)
        positions = positions.tolist()
        rows: list = []
        seeds: list[int] = []
        for r, req_id in enumerate(req_ids):
            q = request_index(req_id)
            if q is None or q >= len(truths):
                rows.append(None)
                seeds.append(0)
                record.passthrough_rows += 1
                continue
            bonus_pos = int(positions[r][0]) - 1
            rows.append(oracle_true_tokens(truths[q], positions[r]))
            seeds.append(row_seed(q, bonus_pos))
            record.drafts.append([q, bonus_pos])
            record.oracle_rows += 1
        return original_build(oracle_logits(logits, rows, ranks, seeds, **logit_kwargs),
                              budget, top_k, out=out)

    def verify(self, logits, input_batch, draft_logits=None):
        out = original_call(self, logits, input_batch, draft_logits)
        prompts = [request_index(r) for r in input_batch.req_ids]
        if any(q is not None for q in prompts):
            num_reqs = input_batch.num_reqs
            cu = input_batch.cu_num_logits[: num_reqs + 1].tolist()
            roots = input_batch.positions[input_batch.query_start_loc[:num_reqs].long()]
            roots = roots.tolist()
            num_sampled = out.num_sampled[:num_reqs].tolist()
            for r, q in enumerate(prompts):
                nodes = cu[r + 1] - cu[r] - 1
                if q is not None and nodes > 0:
                    record.rounds.append({"prompt": q, "root_pos": int(roots[r]),
                                          "depth": int(num_sampled[r]) - 1, "nodes": nodes})
        return out

    speculator_mod.DDTreeSpeculator.propose = propose
    speculator_mod.build_ddtree_fast = build_oracle_tree
    verifier_mod.DDTreeVerifier.__call__ = verify

    def uninstall() -> None:
        speculator_mod.DDTreeSpeculator.propose = original_propose
        speculator_mod.build_ddtree_fast = original_build
        verifier_mod.DDTreeVerifier.__call__ = original_call

    return record, uninstall
