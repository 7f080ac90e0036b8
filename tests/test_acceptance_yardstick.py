"""Acceptance of the embedded pair, pinned: tokens per round on fixed prompts, and the
drafter's context checked row by row against an independent construction.

The reference engine is lossless whatever the drafter is fed (every committed token is
the target's), so token equality cannot see a drafter that is given the wrong context:
only its acceptance drops. These tests pin the embedded pair's tokens per round (fp32,
greedy, CPU) for the chain (method ``dflash``) and DDTree at B = 8 / 32 / 64, and for the
shipped DFlash2 drafter its selector chain walk and DDTree B = 64 over its marginals and
over its selector scores, and fail on a 5 % drop (the DFlash2 drafter's selector before
its refit on 64 candidates commits 3.346 tokens per round in the selector tree, 7 % under
its pin), and compare the rows the drafter is fed with the target's hidden states along
the committed sequence, computed by one plain causal forward of the target.

Run-to-run spread: none. In fp32 on the CPU the engine is deterministic; four repeated
runs of ``measure()`` (two processes, 1 and 2 torch threads) gave the same committed
token counts and rounds to the last token, so the observed spread is 0 %, against the
5 % bar. Feeding the drafter verify rows ``0..depth`` instead of the accepted path
(the mutant of issue 44) costs DDTree about 10-20 % of its tokens per round here.

After a deliberate change of the pair or the drafter, re-measure with
``python tests/test_acceptance_yardstick.py`` and paste the printed tables into ``PINNED``
and ``PINNED_DFLASH2``.
"""

from __future__ import annotations

import pytest
import torch

from vllm_ddtree.demo.reference_engine import CHECKPOINTS, humaneval_prompts, load_embedded_pair
from vllm_ddtree.reference import generate
from vllm_ddtree.reference.drafter import DFlashContextCache
from vllm_ddtree.training.common import load_drafter

NUM_PROMPTS = 4
NEW_TOKENS = 64
RUNS = [("dflash", 1), ("ddtree", 8), ("ddtree", 32), ("ddtree", 64)]
MAX_DROP = 0.05  # a 5 % loss of tokens per round fails
# (method, budget) -> tokens committed per round over the NUM_PROMPTS prompts
# (sum of RoundStats.committed / rounds; the prefill's token is not a round).
PINNED = {
    ("dflash", 1): 2.2479,
    ("ddtree", 8): 2.6000,
    ("ddtree", 32): 3.0723,
    ("ddtree", 64): 3.3077,
}

DFLASH2_BUDGET = 64
# The shipped DFlash2 drafter (checkpoints/dflash2_drafter): (method, draft_scores).
DFLASH2_RUNS = [("dflash2", None), ("ddtree", "marginals"), ("ddtree", "selector")]
PINNED_DFLASH2 = {
    ("dflash2", None): 2.3130,
    ("ddtree", "marginals"): 3.0595,
    ("ddtree", "selector"): 3.5946,
}


def _prompts(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(p) for p in humaneval_prompts(NUM_PROMPTS)]


def _tokens_per_round(pair, drafter, runs: dict) -> dict:
    """Tokens per round over the fixed prompts of each ``runs`` entry (key -> the
    ``generate`` arguments after the token count); every run's tokens must equal plain
    decoding's."""
    out = {}
    prompts = _prompts(pair.tokenizer)
    ar = [generate(pair.target, None, ids, NEW_TOKENS, "ar").tokens for ids in prompts]
    for key, kwargs in runs.items():
        committed = rounds = 0
        for ids, want in zip(prompts, ar, strict=True):
            got = generate(pair.target, drafter, ids, NEW_TOKENS, **kwargs)
            assert got.tokens == want, key
            committed += sum(s.committed for s in got.stats)
            rounds += got.rounds
        out[key] = committed / rounds
    return out


def measure(pair) -> dict[tuple[str, int], float]:
    """Tokens per round of each ``RUNS`` entry with the embedded DFlash drafter."""
    return _tokens_per_round(pair, pair.drafter, {
        (method, budget): {"method": method, "budget": budget} for method, budget in RUNS})


def measure_dflash2(pair, drafter) -> dict[tuple[str, str | None], float]:
    """Tokens per round of each ``DFLASH2_RUNS`` entry (B = ``DFLASH2_BUDGET``) with the
    DFlash2 ``drafter``."""
    return _tokens_per_round(pair, drafter, {
        (method, scores): {"method": method, "budget": DFLASH2_BUDGET, "draft_scores": scores}
        for method, scores in DFLASH2_RUNS})


def _dflash2_drafter():
    return load_drafter(CHECKPOINTS / "dflash2_drafter", torch.float32, "cpu").eval()


@pytest.fixture(scope="module")
def pair():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small forwards: more threads only contend on shared CPUs
    yield load_embedded_pair()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def measured(pair):
    return measure(pair)


@pytest.mark.parametrize("run", RUNS, ids=lambda r: f"{r[0]}-{r[1]}")
def test_tokens_per_round_hold_their_pinned_value(measured, run):
    _within_the_pin(run, measured[run], PINNED[run])


@pytest.fixture(scope="module")
def measured_dflash2(pair):
    return measure_dflash2(pair, _dflash2_drafter())


def _within_the_pin(run, got: float, pinned: float) -> None:
    assert got >= (1 - MAX_DROP) * pinned, (
        f"{run}: {got:.4f} tokens per round, more than {MAX_DROP:.0%} below the pinned "
        f"{pinned:.4f}")
    assert got <= (1 + MAX_DROP) * pinned, (
        f"{run}: {got:.4f} tokens per round, more than {MAX_DROP:.0%} above the pinned "
        f"{pinned:.4f}: a changed pair? re-pin (see the module docstring)")


@pytest.mark.parametrize("run", DFLASH2_RUNS, ids=lambda r: f"{r[0]}-{r[1]}")
def test_dflash2_tokens_per_round_hold_their_pinned_value(measured_dflash2, run):
    _within_the_pin(run, measured_dflash2[run], PINNED_DFLASH2[run])


def test_the_selector_tree_accepts_more_than_the_marginal_tree_and_the_walk(measured_dflash2):
    got = measured_dflash2
    assert got[("ddtree", "selector")] > got[("ddtree", "marginals")] > got[("dflash2", None)]


def test_trees_accept_more_than_the_chain(measured):
    assert measured[("ddtree", 64)] > measured[("ddtree", 8)] > measured[("dflash", 1)]


def _fed_rows(monkeypatch) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Record every ``DFlashContextCache.append(target_hidden, positions)``."""
    fed = []
    original = DFlashContextCache.append

    def recording(self, target_hidden, positions):
        fed.append((target_hidden.detach().clone(), positions.detach().clone()))
        return original(self, target_hidden, positions)

    monkeypatch.setattr(DFlashContextCache, "append", recording)
    return fed


def _plain_hidden(target, layer_ids: list[int], ids: list[int]) -> torch.Tensor:
    """``[len(ids), len(layer_ids) * hidden]`` fp32: the outputs of decoder layers
    ``layer_ids`` (ascending) in one causal forward of ``ids``, collected with forward
    hooks of this function's own (no engine code)."""
    got = {}
    hooks = [target.model.layers[i].register_forward_hook(
        lambda m, a, out, i=i: got.__setitem__(i, out[0] if isinstance(out, tuple) else out))
        for i in layer_ids]
    try:
        with torch.no_grad():
            target(input_ids=torch.tensor([ids]), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return torch.cat([got[i][0] for i in sorted(layer_ids)], dim=-1).float()


@pytest.mark.parametrize("method,budget", [("ddtree", 64), ("ddtree", 8), ("dflash", 1)])
def test_drafter_context_is_the_committed_sequence_row_by_row(pair, monkeypatch, method,
                                                              budget):
    """Row ``p`` of the drafter's context is the target's hidden state at position ``p``
    of prompt + committed tokens, as one plain causal forward computes it, for every
    position fed so far (each committed token once, positions in order)."""
    ids = _prompts(pair.tokenizer)[1]
    fed = _fed_rows(monkeypatch)
    out = generate(pair.target, pair.drafter, ids, NEW_TOKENS, method, budget=budget)
    hidden = torch.cat([h for h, _ in fed])
    positions = torch.cat([p for _, p in fed])
    assert positions.tolist() == list(range(positions.shape[0]))
    # A last round may commit past NEW_TOKENS (cut from out.tokens, fed all the same):
    # plain decoding of a block more gives the sequence those rows belong to.
    ar = generate(pair.target, None, ids, NEW_TOKENS + pair.drafter.block_size, "ar")
    assert ar.tokens[: len(out.tokens)] == out.tokens
    sequence = ids + ar.tokens
    assert len(ids) + len(out.tokens) - 1 <= positions.shape[0] < len(sequence)
    want = _plain_hidden(pair.target, pair.drafter.target_layer_ids,
                         sequence[: positions.shape[0]])
    assert hidden.shape == want.shape
    scale = want.abs().max().item()
    errors = (hidden.float() - want).abs().amax(dim=-1) / scale
    bad = (errors > 1e-4).nonzero().flatten().tolist()
    assert not bad, (f"{len(bad)} of {len(errors)} context rows differ from the target's "
                     f"hidden states of the committed sequence (first at position {bad[0]}, "
                     f"relative error {errors[bad[0]]:.3g})")


if __name__ == "__main__":
    torch.set_num_threads(1)
    embedded = load_embedded_pair()
    for run, value in measure(embedded).items():
        print(f"    {run}: {value:.4f},")
    for run, value in measure_dflash2(embedded, _dflash2_drafter()).items():
        print(f"    {run}: {value:.4f},")
