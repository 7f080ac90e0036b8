"""Reference generation loop: AR, DFlash chain and DDTree on transformers models."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch

from vllm_ddtree.budget.choice import mask_inactive_nodes
from vllm_ddtree.reference.draft_trees import draft_tree
from vllm_ddtree.reference.inputs import check_generate_args
from vllm_ddtree.reference.sampling import choose_tokens
from vllm_ddtree.reference.target import TargetRunner
from vllm_ddtree.tree.draft_tree import DraftTree
from vllm_ddtree.walk.follow import WalkResult, follow_tree

Method = Literal["ar", "dflash", "dflash2", "ddtree"]
# budget_chooser(tree of B nodes [1, B], context length) -> active nodes b in 1..B
BudgetChooser = Callable[[DraftTree, int], int]


@dataclass
class RoundStats:
    """One decoding round: ``committed == accepted_depth + 1`` always; ``nodes`` are
    the verified (active) tree nodes."""

    committed: int
    accepted_depth: int
    nodes: int


@dataclass
class GenerationResult:
    tokens: list[int]
    stats: list[RoundStats] = field(default_factory=list)

    @property
    def rounds(self) -> int:
        return len(self.stats)

    @property
    def mean_committed(self) -> float:
        """Tokens committed per round (vLLM's "mean acceptance length")."""
        return sum(s.committed for s in self.stats) / max(1, len(self.stats))


@torch.no_grad()
def generate(
    target,
    drafter,
    prompt_ids: list[int],
    max_new_tokens: int,
    method: Method,
    budget: int = 64,
    temperature: float = 0.0,
    seed: int | None = None,
    eos_token_id: int | None = None,
    top_k: int | None = None,
    stop: Callable[[list[int]], bool] | None = None,
    budget_chooser: BudgetChooser | None = None,
    draft_scores: str | None = None,
) -> GenerationResult:
    """Generate up to ``max_new_tokens`` tokens after ``prompt_ids``.

    ``method``: ``"ar"`` (target only), ``"dflash"`` (the drafter's greedy chain
    of ``block_size - 1`` tokens) or ``"ddtree"`` (a tree of ``budget`` nodes,
    children of a node limited to the ``top_k`` best tokens of their depth).
    Every committed token is the target's own choice (argmax, or a draw keyed by
    ``(seed, position)``), so all methods return the same ``tokens`` (list[int]);
    ``stats`` has one ``RoundStats`` per round (prefill excluded).

    ``stop(tokens)`` (optional, e.g. a stop-string check) is asked after every round;
    when it returns True generation ends there. The tokens up to that point are the
    same for every method, but a round may commit tokens past the stop, so callers cut
    the output at their stop condition themselves.

    ``budget_chooser`` (``"ddtree"`` only; the reference of ``ddtree_budget: "auto"``):
    each round the tree of ``budget`` nodes is built and verified as usual, then only
    its first ``b = budget_chooser(tree, context_len)`` nodes count in the walk, as in
    vLLM (``vllm_ddtree.budget.choice.mask_inactive_nodes``).

    DFlash2 drafters (:mod:`vllm_ddtree.reference.draft_trees`): ``"dflash2"`` drafts
    the selector's chain walk; ``"ddtree"`` builds its tree over the selector's path
    scores, or over the marginals with ``draft_scores="marginals"``.

    Every argument is checked before any model work
    (:func:`vllm_ddtree.reference.inputs.check_generate_args`); a bad one raises
    ``ValueError`` naming the field, the value and what is allowed.
    """
    check_generate_args(target, drafter, prompt_ids, max_new_tokens, method, budget,
                        temperature, seed, eos_token_id, top_k, stop, budget_chooser,
                        draft_scores=draft_scores)
    device = next(target.parameters()).device
    aux_ids = drafter.target_layer_ids if method != "ar" else None
    runner = TargetRunner(target, aux_ids)
    try:
        n = len(prompt_ids)
        last_logits, context = prefill(runner, drafter if method != "ar" else None, prompt_ids)
        bonus = int(choose_tokens(last_logits, torch.tensor([n]), temperature, seed)[0])
        result = GenerationResult(tokens=[bonus])
        position = n  # position of `bonus`, whose KV is not cached yet
        done = eos_token_id is not None and bonus == eos_token_id
        while not done and len(result.tokens) < max_new_tokens:
            if method == "ar":
                logits, _ = runner.forward(
                    torch.tensor([bonus], device=device),
                    torch.tensor([position], device=device),
                    None,
                )
                new = choose_tokens(logits, torch.tensor([position + 1]), temperature, seed)
                committed = new.tolist()
                result.stats.append(RoundStats(committed=1, accepted_depth=0, nodes=0))
            else:
                committed, stats = _speculative_round(
                    runner,
                    drafter,
                    context,
                    bonus,
                    position,
                    method,
                    budget,
                    top_k,
                    temperature,
                    seed,
                    budget_chooser,
                    draft_scores,
                )
                result.stats.append(stats)
            for tok in committed:
                result.tokens.append(tok)
                if (eos_token_id is not None and tok == eos_token_id) or (
                    len(result.tokens) >= max_new_tokens
                ):
                    done = True
                    break
            position += len(committed)
            bonus = committed[-1]
            if stop is not None and not done and stop(result.tokens):
                done = True
        return result
    finally:
        runner.close()


def prefill(runner: TargetRunner, drafter, prompt_ids: list[int]):
    """Run the prompt through the target (and into a new drafter context cache).

    Returns the target's fp32 logits ``[1, V]`` at the last prompt token and the
    drafter's :class:`DFlashContextCache` holding the prompt's aux hidden states
    at positions ``0..len(prompt_ids)-1`` (None when ``drafter`` is None).
    """
    device = next(runner.model.parameters()).device
    prompt = torch.tensor(prompt_ids, dtype=torch.long, device=device)
    n = prompt.shape[0]
    logits, aux = runner.forward(prompt, torch.arange(n, device=device), None)
    context = None
    if drafter is not None:
        context = drafter.new_context_cache()
        context.append(aux, torch.arange(n, device=device))
    return logits[-1:], context


@dataclass
class Verified:
    """A drafted tree after the target's verify forward (see :func:`draft_and_verify`).

    ``tree`` holds one request ``[1, B]``; ``logits`` fp32 ``[1 + B, V]`` and ``aux``
    ``[1 + B, len(aux_layer_ids) * hidden]`` are the target's outputs at the verify
    rows ``[root, nodes...]``; ``offsets`` int64 ``[1 + B]`` = ``[0, depths...]``;
    ``first_new`` is the target cache index of the root row.
    """

    tree: DraftTree
    logits: torch.Tensor
    aux: torch.Tensor
    offsets: torch.Tensor
    first_new: int


def draft_and_verify(
    runner: TargetRunner,
    drafter,
    context,
    bonus: int,
    position: int,
    method: Method,
    budget: int,
    top_k: int | None,
    draft_scores: str | None = None,
) -> Verified:
    """Draft a tree (``"ddtree"``) or chain (``"dflash"``, ``"dflash2"``) after ``bonus``
    (at ``position``; :func:`vllm_ddtree.reference.draft_trees.draft_tree`) and run the
    target over ``[bonus, nodes...]`` with the tree mask."""
    device = next(runner.model.parameters()).device
    tree = draft_tree(drafter, runner, context, bonus, position, method, budget, top_k,
                      draft_scores)

    verify_ids = torch.cat([torch.tensor([bonus], device=device), tree.tokens[0]])
    offsets = torch.cat([torch.zeros(1, dtype=torch.long, device=device), tree.depths[0]])
    first_new = runner.num_cached
    logits, aux = runner.forward(verify_ids, position + offsets, tree.ancestor_mask()[0])
    return Verified(tree, logits, aux, offsets, first_new)


def keep_accepted(
    runner: TargetRunner, context, verified: Verified, walk: WalkResult, position: int
) -> int:
    """Keep the root and the accepted path of a verified tree: compact the target's KV
    cache and append their aux hidden states to the drafter ``context`` at positions
    ``position..position + depth``. Returns the accepted depth."""
    device = verified.offsets.device
    depth = int(walk.accepted_depth[0])
    src_rows = walk.kv_src_rows[0, :depth]
    runner.keep_accepted(verified.first_new, src_rows)
    keep_rows = torch.cat([torch.zeros(1, dtype=torch.long, device=device), src_rows])
    context.append(
        verified.aux[keep_rows], torch.arange(position, position + depth + 1, device=device)
    )
    return depth


def _speculative_round(
    runner: TargetRunner,
    drafter,
    context,
    bonus: int,
    position: int,
    method: Method,
    budget: int,
    top_k: int | None,
    temperature: float,
    seed: int | None,
    budget_chooser: BudgetChooser | None = None,
    draft_scores: str | None = None,
) -> tuple[list[int], RoundStats]:
    verified = draft_and_verify(runner, drafter, context, bonus, position, method, budget, top_k,
                                draft_scores)
    # The token chosen at a row sits at that row's position + 1.
    positions = (position + verified.offsets + 1).cpu()
    target_tokens = choose_tokens(verified.logits, positions, temperature, seed)
    tree = verified.tree
    nodes = tree.tokens.shape[1]
    if budget_chooser is not None:
        nodes = int(budget_chooser(tree, position + 1))
        if not 1 <= nodes <= tree.budget:
            raise ValueError(f"budget_chooser returned {nodes}, not in 1..{tree.budget}")
        tree = DraftTree(mask_inactive_nodes(tree.tokens, torch.tensor(nodes)), tree.parents,
                         tree.depths, tree.scores)
    walk = follow_tree(tree, target_tokens[None])
    depth = keep_accepted(runner, context, verified, walk, position)
    committed = walk.committed_tokens[0, : depth + 1].tolist()
    return committed, RoundStats(committed=depth + 1, accepted_depth=depth, nodes=nodes)
