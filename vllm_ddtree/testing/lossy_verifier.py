"""Fault injection for tests and evals: a lossy verifier that commits the drafter's token
instead of the target's in a chosen fraction of rounds. Never use it in production.

In a corrupted round the walk goes as usual; then, at the deepest node of the accepted
path (the root included) that has a child whose token is not the target's token there,
the target's token is replaced by that child's token (the first such child: nodes are
in best-first order, so the drafter's most likely other token). The round then commits
a token the target did not choose and walks on with the target's tokens below it. The
stopping node is often a leaf of a budget-limited tree, so walking back up the path
matters: otherwise most chosen rounds would change nothing. A round whose path has no
such child (a chain the target accepts whole) stays intact.

- :func:`corrupt_targets`: the rule on one batch of trees (PyTorch, CPU or CUDA).
- :func:`lossy_reference`: the reference engine's rounds through the rule (a context
  manager wrapping ``vllm_ddtree.reference.engine.follow_tree``).
- :func:`apply_lossy_verifier` / :func:`apply_in_worker`: vLLM's ``DDTreeVerifier``
  through the rule, in the process that runs the engine core (in-process engines:
  call it before ``LLM()``; else ``LLM.collective_rpc(apply_in_worker, args=(rate,
  seed))``, with ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``), as
  ``vllm_ddtree.testing.forced_budgets`` forces budgets.

Rounds are chosen with ``random.Random(seed)``, one draw per request per round in the
order the verifier sees them: deterministic for a given run.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator

import torch

from vllm_ddtree.tree.draft_tree import DraftTree

__all__ = ["apply_in_worker", "apply_lossy_verifier", "check_rate", "corrupt_targets",
           "lossy_reference"]


def check_rate(rate) -> float:
    """A corruption rate in [0, 1]; else ``ValueError`` naming it."""
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate <= 1:
        raise ValueError(f"lossy verifier: rate={rate!r} is not allowed: a number in [0, 1]")
    return float(rate)


def corrupt_targets(tree: DraftTree, targets: torch.Tensor, corrupt: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The target tokens with the rule applied to the requests where ``corrupt``.

    ``tree`` ``[R, B]`` (masked nodes have token -1), ``targets`` int64 ``[R, 1 + B]``
    (column 0: the root, column ``i + 1``: node ``i``), ``corrupt`` bool ``[R]``.
    Returns ``(targets' [R, 1 + B], changed bool [R])``: ``changed`` where a token was
    replaced (the round commits a token the target did not choose). Runs on host copies
    (a test hook: one device sync).
    """
    from vllm_ddtree.walk.follow import follow_tree

    walk = follow_tree(tree, targets)
    tokens, parents = tree.tokens.cpu(), tree.parents.cpu()
    out = targets.cpu().clone()
    depth, nodes = walk.accepted_depth.cpu(), walk.accepted_nodes.cpu()
    changed = torch.zeros(targets.shape[0], dtype=torch.bool)
    for r in torch.nonzero(corrupt.cpu()).flatten().tolist():
        path = [-1] + nodes[r, :int(depth[r])].tolist()  # root, then the accepted nodes
        for v in reversed(path):
            want = int(out[r, v + 1])
            others = ((parents[r] == v) & (tokens[r] >= 0) & (tokens[r] != want)).nonzero()
            if others.numel():
                out[r, v + 1] = tokens[r, int(others[0, 0])]  # lowest index: best first
                changed[r] = True
                break
    return out.to(targets.device), changed


@contextlib.contextmanager
def lossy_reference(rate: float, seed: int = 0) -> Iterator[dict]:
    """Within the block, the reference engine's speculative rounds are corrupted with
    probability ``rate`` each. Yields counters ``{"rounds", "corrupted"}``."""
    from vllm_ddtree.reference import engine

    rate = check_rate(rate)
    rng = random.Random(seed)
    counts = {"rounds": 0, "corrupted": 0}
    original = engine.follow_tree

    def lossy_follow(tree, targets, max_depth=None):
        corrupt = torch.tensor([rng.random() < rate for _ in range(targets.shape[0])],
                               device=targets.device)
        targets, changed = corrupt_targets(tree, targets, corrupt)
        counts["rounds"] += targets.shape[0]
        counts["corrupted"] += int(changed.sum())
        return original(tree, targets, max_depth)

    engine.follow_tree = lossy_follow
    try:
        yield counts
    finally:
        engine.follow_tree = original


def apply_lossy_verifier(rate: float, seed: int = 0) -> None:
    """Patch ``DDTreeVerifier.draw_target_tokens`` (this process) so that the drawn
    tokens go through :func:`corrupt_targets` for a fraction ``rate`` of the requests'
    rounds. Applying again replaces the rate. The walk, the commit, the logprobs and the
    acceptance counters all see the corrupted tokens."""
    from vllm_ddtree.verify import verifier as verifier_module

    rate = check_rate(rate)
    cls = verifier_module.DDTreeVerifier
    original = getattr(cls.draw_target_tokens, "_lossy_original", cls.draw_target_tokens)
    rng = random.Random(seed)

    def draw_target_tokens(self, logits, input_batch, needs_history=True):
        drawn, processed, positions = original(self, logits, input_batch, needs_history)
        if rate == 0.0:
            return drawn, processed, positions
        rows_in = input_batch.input_ids[input_batch.logits_indices]
        tokens, targets = verifier_module.tree_inputs_from_rows(
            rows_in, drawn, input_batch.cu_num_logits, self.budget)
        idx = input_batch.idx_mapping.to(torch.int64)
        if self.state.adaptive:
            from vllm_ddtree.budget.choice import mask_inactive_nodes

            tokens = mask_inactive_nodes(tokens, self.state.active_nodes[idx])
        tree = DraftTree(tokens=tokens, parents=self.state.parents[idx],
                         depths=self.state.depths[idx],
                         scores=torch.zeros(tokens.shape, device=tokens.device))
        corrupt = torch.tensor([rng.random() < rate for _ in range(tokens.shape[0])],
                               device=drawn.device)
        new_targets, _ = corrupt_targets(tree, targets, corrupt)
        cu = input_batch.cu_num_logits.to(torch.int64)
        cols = torch.arange(1 + self.budget, device=drawn.device)[None, :]
        valid = cols <= (cu[1:] - cu[:-1] - 1)[:, None]
        flat = (cu[:-1, None] + cols)[valid]
        drawn = drawn.clone()
        drawn[flat] = new_targets[valid].to(drawn.dtype)
        return drawn, processed, positions

    draw_target_tokens._lossy_original = original
    cls.draw_target_tokens = draw_target_tokens


def apply_in_worker(worker, rate: float, seed: int = 0) -> None:
    """:func:`apply_lossy_verifier` in a vLLM worker process, for
    ``LLM.collective_rpc(apply_in_worker, args=(rate, seed))`` (the worker is unused)."""
    apply_lossy_verifier(rate, seed)
