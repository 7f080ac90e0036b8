# SPDX-License-Identifier: Apache-2.0
"""The ``v2lite`` setups' rank oracle: a dummy-weight target whose greedy output is known,
and drafter logits that rank the true token as the embedded drafter did (GPU, CPU-tested).

**Target with a known output.** After vLLM's dummy loader has filled the target
(``DummyModelLoader.load_weights``), :func:`structure_target_` zeroes every layer's
output projections (attention ``o_proj``, MLP ``down_proj``, MoE ``w2``), so the residual
stream leaves the last layer as the current token's embedding; it sets the embeddings to
seeded N(0, 1) rows ``E``, the final norm's weight to 1 and the LM head to
``W[f(t)] = E[t]`` for a seeded permutation ``f`` of the vocabulary. The target's greedy
token after ``t`` is then ``f(t)`` (logit ~ hidden size against a noise maximum ~ 4.5
sqrt(hidden): a margin far beyond bf16's rounding), every layer still computes at full
cost (zeros cost what other values cost), and a request's output is the chain ``f(last
prompt token), f(f(...)), ...``: lossless decoding is checkable token for token.

**Drafter logits with measured ranks and measured confidence.** The drafter (dummy
weights) runs at full cost; its logits then pass through :meth:`RankOracle.apply_`, in place
and inside its CUDA graph (tensor ops only, no host sync): noise clamped to +-``NOISE``,
and at depth d the true token ``f^d(bonus)`` placed at rank ``r_d``, ``(r_0 .. r_{L-1})``
one vector of the measured table (``evals/data/drafter_ranks.json``,
``evals/drafter_ranks.py``) chosen by a hash of (bonus token, bonus position, seed): the
same request at the same position gets the same vector in every method. The ranked
tokens (the true one and ``decoy`` tokens around it) get the probabilities a drafter
like the embedded one gives them: the top token the embedded drafter's mean top-1
probability at that depth, measured apart over the rounds where it was right
(``top1_prob_rank0``) and where it was not (``top1_prob_missed``); ranks 1..cap share
a fixed part of the rest on a power law (``oracle_tail``: ``share``, ``exponent``,
fitted by :func:`fit_tail` so that what the trees' own probabilities promise and what
they commit, budget by budget, come near the embedded drafter's measured calibration
curve, ``calibration``); the rest is the noise's. The device's budget cut and the gate
trust those probabilities, so they must be as right (and as wrong) as a real
drafter's. A depth of rank "beyond" (>= the table's cap) gets the decoys and no true
token. The chain (argmax) accepts the leading rank-0 depths; the tree accepts as deep
as its nodes cover the true path: each method gets the acceptance the embedded
drafter's ranks give it.

Both hooks are benchmark instruments installed in the child process before its
``LLM`` starts (:func:`install_rank_oracle`): they wrap vLLM 0.26.0's
``DummyModelLoader.load_weights`` and ``DFlashSpeculator.load_draft_model`` (the
latter swaps the loaded drafter's ``compute_logits``, which vLLM's chain and DDTree
both call on the sampled rows of the drafter's step).
"""

from __future__ import annotations

import torch

NOISE = 0.5  # drafter noise logits are clamped to +-NOISE
RANK_STEP = 0.9  # a ranked token's probability at most this times the rank above it
TARGET_SEED = 1234
ZERO_SUFFIXES = ("o_proj.weight", "down_proj.weight", "w2_weight")
_HASH_MUL = 6364136223846793005  # < 2**63; int64 products wrap on CPU and GPU alike
_HASH_ADD = 1442695040888963407


def next_token_permutation(vocab_size: int, seed: int = TARGET_SEED) -> torch.Tensor:
    """``f``: int64 ``[V]``, a seeded permutation; the structured target's greedy token
    after ``t`` is ``f[t]``."""
    gen = torch.Generator().manual_seed(seed)
    # device="cpu": vLLM loads models under a CUDA default device
    return torch.randperm(vocab_size, generator=gen, device="cpu")


def truth_table(perm: torch.Tensor, depths: int) -> torch.Tensor:
    """int64 ``[depths, V]``: row ``d`` is ``f^(d+1)`` (the true token at depth d + 1
    after a bonus token)."""
    rows = [perm]
    for _ in range(depths - 1):
        rows.append(perm[rows[-1]])
    return torch.stack(rows)


def chain_of(perm: torch.Tensor, last_prompt_token: int, n: int) -> list[int]:
    """The structured target's first ``n`` greedy tokens after a prompt ending in
    ``last_prompt_token``."""
    out, t = [], int(last_prompt_token)
    for _ in range(n):
        t = int(perm[t])
        out.append(t)
    return out


def ranked_logits(top1_prob: list[float], share: float, exponent: float, cap: int,
                  vocab_size: int) -> torch.Tensor:
    """float32 ``[L, cap + 1]``: the logit of rank k (0..cap) at depth d over noise ~0
    when the top token holds ``p_d`` (clipped to [0.02, 0.995]) and ranks 1..cap hold
    ``share`` of the rest on the power law ``k ** -exponent``, each at most ``RANK_STEP``
    times the rank above it: ``log(q_k V / q_noise)`` with ``q_noise = (1 - p_d)
    (1 - share)`` spread over the vocabulary."""
    if not 0.0 < share < 1.0 or exponent < 0.0:
        raise ValueError(f"oracle_tail share={share!r} / exponent={exponent!r} is not "
                         "allowed: 0 < share < 1 and exponent >= 0")
    k = torch.arange(1, cap + 1, dtype=torch.float64)
    law = k.pow(-exponent)
    law = law / law.sum()
    rows = []
    for p in top1_prob:
        p = min(max(float(p), 0.02), 0.995)
        noise = (1 - p) * (1 - share) / vocab_size
        q = torch.cat([torch.tensor([p], dtype=torch.float64), (1 - p) * share * law])
        for j in range(1, cap + 1):  # ranks stay apart, in bf16 too (its step at 8-16: 1/16)
            q[j] = min(q[j], RANK_STEP * q[j - 1])
        rows.append(torch.log(q / noise))
    return torch.stack(rows).to(torch.float32)


def rank_vectors(table: dict) -> torch.Tensor:
    """int64 ``[N, L]`` of the table's vectors (``RANK_CAP`` = beyond)."""
    from drafter_ranks import decode_ranks

    return torch.tensor([decode_ranks(v) for v in table["vectors"]], dtype=torch.int64,
                        device="cpu")


def vector_index(bonus: torch.Tensor, bonus_pos: torch.Tensor, seed: int,
                 num_vectors: int) -> torch.Tensor:
    """int64 ``[n]``: which table vector a draft (bonus token, its position) uses; the
    same integer hash on CPU and GPU (int64 arithmetic wraps on both)."""
    key = bonus_pos.long() * 1_000_003 + bonus.long() * 7919 + seed * 104_729
    h = key * _HASH_MUL + _HASH_ADD
    h = (h ^ (h >> 29)) * _HASH_MUL + _HASH_ADD
    return ((h >> 33) & 0x7FFFFFFF) % num_vectors


class RankOracle:
    """Device tensors of the oracle (see the module docstring): ``truth`` int64
    ``[L, V]``, ``vectors`` int64 ``[N, L]``, the ranked logits of a right and of a
    missed top token ``[L, cap + 1]`` each, and the rank cap."""

    def __init__(self, perm: torch.Tensor, table: dict, vocab_size: int, seed: int = 0,
                 device: torch.device | str = "cpu", tail: dict | None = None):
        depths, cap = int(table["depths"]), int(table["rank_cap"])
        for key in ("top1_prob_rank0", "top1_prob_missed"):
            got = table.get(key)
            if not isinstance(got, list) or len(got) != depths:
                raise ValueError(f"rank table: {key} must list {depths} depths (python "
                                 f"evals/drafter_ranks.py writes it), got {got!r}")
        tail = tail or table.get("oracle_tail")
        if not tail:
            raise ValueError("rank table: no oracle_tail (python evals/e2e_oracle.py fits "
                             "and stores it)")
        self.depths, self.cap, self.seed = depths, cap, int(seed)
        self.vocab_size = vocab_size
        self.truth = truth_table(perm.long(), depths).to(device)
        self.vectors = rank_vectors(table).to(device)
        # a depth the drafter never got right (or never missed) takes the overall mean
        right = [p if p is not None else q
                 for p, q in zip(table["top1_prob_rank0"], table["top1_prob"], strict=True)]
        missed = [p if p is not None else q
                  for p, q in zip(table["top1_prob_missed"], table["top1_prob"], strict=True)]
        share, exponent = float(tail["share"]), float(tail["exponent"])
        self.right = ranked_logits(right, share, exponent, cap, vocab_size).to(device)
        self.missed = ranked_logits(missed, share, exponent, cap, vocab_size).to(device)
        self.columns = torch.arange(cap, dtype=torch.int64, device=device)  # j = 0..cap-1

    def apply_(self, logits: torch.Tensor, bonus: torch.Tensor, bonus_pos: torch.Tensor,
               depth: torch.Tensor) -> torch.Tensor:
        """Oracle logits, in place: ``logits`` ``[n, V]`` (any float dtype); ``bonus``,
        ``bonus_pos``, ``depth`` int ``[n]`` per row (``depth`` 0-based: row predicts the
        token ``depth + 1`` after ``bonus``). Tensor ops only (CUDA-graph safe)."""
        depth = depth.long().clamp(0, self.depths - 1)
        bonus = bonus.long().clamp(0, self.vocab_size - 1)
        true = self.truth[depth, bonus]  # [n]
        which = vector_index(bonus, bonus_pos, self.seed, self.vectors.shape[0])
        rank = self.vectors[which, depth]  # [n], cap = beyond
        ranked = torch.where((rank == 0)[:, None], self.right[depth], self.missed[depth])
        logits.clamp_(-NOISE, NOISE)
        # Decoy j (0-based) is token true + 1 + j; it takes rank j below the true token's
        # rank and j + 1 from it on (a "beyond" depth: every decoy at its own j).
        cols = self.columns[None, :].expand(rank.shape[0], -1)  # [n, cap]
        decoy_tok = (true[:, None] + 1 + cols) % self.vocab_size
        decoy_rank = cols + (cols >= rank[:, None]).long() * (rank[:, None] < self.cap)
        logits.scatter_(1, decoy_tok, ranked.gather(1, decoy_rank).to(logits.dtype))
        true_val = torch.where(rank < self.cap,
                               ranked.gather(1, rank.clamp(max=self.cap)[:, None])[:, 0],
                               logits.gather(1, true[:, None])[:, 0].to(torch.float32))
        logits.scatter_(1, true[:, None], true_val[:, None].to(logits.dtype))
        return logits


def speculator_rows(spec, n: int, depths: int) -> tuple[torch.Tensor, torch.Tensor,
                                                         torch.Tensor]:
    """(bonus token, bonus position, 0-based depth), int64 ``[n]``, of the ``n`` sampled
    rows of a DFlash / DDTree drafter step, read from the speculator's persistent buffers
    (row ``i`` = request ``i // L``, depth ``i % L``; ``sample_indices[i]`` its query row,
    ``input_ids`` of the request's first query row its bonus token, ``sample_pos[i]`` the
    predicted position)."""
    i = torch.arange(n, device=spec.sample_indices.device)
    depth = i % depths
    bonus_row = (spec.sample_indices[:n] - depth - 1).clamp(min=0)
    bonus = spec.input_buffers.input_ids[bonus_row].long()
    bonus_pos = spec.sample_pos[:n] - depth - 1
    return bonus, bonus_pos, depth


def structure_target_(model: torch.nn.Module, perm: torch.Tensor,
                      seed: int = TARGET_SEED) -> int:
    """Make a loaded DeepSeek-style target's greedy output ``f`` (module docstring), in
    place; returns how many projection weights were zeroed."""
    zeroed = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(ZERO_SUFFIXES):
                p.zero_()
                zeroed += 1
        inner = model.model
        embed = inner.embed_tokens.weight
        vocab, hidden = perm.numel(), embed.shape[1]
        gen = torch.Generator().manual_seed(seed)
        rows = torch.randn(vocab, hidden, generator=gen, device="cpu").to(embed.device,
                                                                          embed.dtype)
        embed[:vocab].copy_(rows)
        head = model.lm_head.weight
        head[:vocab].index_copy_(0, perm.to(head.device), rows.to(head.dtype))
        inner.norm.weight.fill_(1.0)
    if not zeroed:
        raise ValueError("structure_target_: no o_proj / down_proj / w2 weight found")
    return zeroed


def install_rank_oracle(table: dict, seed: int = 0) -> None:
    """In this process (the benchmark's child, before ``LLM(...)``): every target a
    dummy loader fills afterwards is structured (:func:`structure_target_`), and every
    DFlash / DDTree drafter loaded afterwards returns oracle logits. Wraps vLLM
    0.26.0's ``DummyModelLoader.load_weights`` and ``DFlashSpeculator.load_draft_model``."""
    from vllm.model_executor.model_loader.dummy_loader import DummyModelLoader
    from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator

    from vllm_ddtree.patches._guard import require_vllm_version

    require_vllm_version("evals rank oracle")
    load_weights = DummyModelLoader.load_weights
    load_draft = DFlashSpeculator.load_draft_model

    def structured_load_weights(self, model, model_config):
        load_weights(self, model, model_config)
        if "deepseek" in type(model).__name__.lower():
            vocab = model_config.get_vocab_size()
            structure_target_(model, next_token_permutation(vocab))

    def oracle_load_draft_model(self, target_model, target_attn_layer_names):
        model = load_draft(self, target_model, target_attn_layer_names)
        vocab = self.vllm_config.model_config.get_vocab_size()
        device = self.sample_indices.device
        oracle = RankOracle(next_token_permutation(vocab), table, vocab, seed, device)
        depths = getattr(self, "num_draft_depths", None) or self.num_speculative_steps
        if depths != oracle.depths:
            raise ValueError(f"rank oracle: the drafter drafts {depths} depths, the table "
                             f"has {oracle.depths}")
        compute_logits = model.compute_logits

        def oracle_compute_logits(hidden_states):
            logits = compute_logits(hidden_states)
            bonus, pos, depth = speculator_rows(self, logits.shape[0], depths)
            return oracle.apply_(logits, bonus, pos, depth)

        model.compute_logits = oracle_compute_logits
        return model

    DummyModelLoader.load_weights = structured_load_weights
    DFlashSpeculator.load_draft_model = oracle_load_draft_model


def oracle_logits_of(oracle: RankOracle, index: int, seed: int, gen: torch.Generator,
                     ) -> tuple[torch.Tensor, list[int]]:
    """The oracle's logits ``[L, V]`` (noise 0) of a random bonus token at a position
    whose hash draws vector ``index``, and the true tokens of its L depths."""
    n = oracle.vectors.shape[0]
    bonus = torch.randint(0, oracle.vocab_size, (1,), generator=gen)
    pos = next(p for p in range(100 * n)
               if int(vector_index(bonus, torch.tensor([p]), seed, n)) == index)
    logits = torch.zeros(oracle.depths, oracle.vocab_size)
    oracle.apply_(logits, bonus.repeat(oracle.depths), torch.full((oracle.depths,), pos),
                  torch.arange(oracle.depths))
    return logits, oracle.truth[:, bonus[0]].tolist()


def oracle_tokens_per_round(table: dict, vocab_size: int, budgets: list[int],
                            seed: int = 0, tail: dict | None = None) -> dict:
    """What the oracle gives over every vector of ``table`` (CPU, the trees built on its
    logits for a random truth; noise 0): tokens per round of ``chain`` (argmax per
    depth) and ``ddtree-B``, what a sweep's acceptance should come near, and
    ``calibration``: the trees' promised and committed tokens by budget
    (``drafter_ranks.calibration_curve``), to set beside the embedded drafter's."""
    from drafter_ranks import calibration, calibration_curve

    from vllm_ddtree.testing.oracle import true_path_depth
    from vllm_ddtree.tree.draft_tree import build_ddtree

    oracle = RankOracle(next_token_permutation(vocab_size), table, vocab_size, seed,
                        tail=tail)
    depths, n = oracle.depths, oracle.vectors.shape[0]
    sums = {"chain": 0.0} | {f"ddtree-{b}": 0.0 for b in budgets}
    promised, got = [], []
    gen = torch.Generator().manual_seed(seed)
    for i in range(n):
        logits, truth = oracle_logits_of(oracle, i, seed, gen)
        argmax = logits.argmax(-1).tolist()
        sums["chain"] += 1 + next((d for d in range(depths) if argmax[d] != truth[d]), depths)
        for b in budgets:
            tree = build_ddtree(logits[None], b)
            sums[f"ddtree-{b}"] += 1 + true_path_depth(tree.tokens[0].tolist(),
                                                       tree.parents[0].tolist(), truth)
        p, g = calibration(logits, truth)
        promised.append(p)
        got.append(g)
    return {k: round(v / n, 3) for k, v in sums.items()} | {
        "calibration": calibration_curve(promised, got)}


def round_cuts(table: dict, vocab_size: int, arms: list[int], seed: int = 0,
               rounds: int | None = None) -> list[list[int]]:
    """Accepted drafts of each of ``table``'s rounds, in recorded order, by the oracle's
    tree of each budget in ``arms`` (CPU, noise 0): ``[rounds][arms]``, what the walk's
    arm counters count for one tree cut to each arm. The rounds keep the recorded
    stretches (10-round windows commit 1.1 to 9.3 tokens a tree at B = 64), which
    ``tests/test_budget_gate.py`` replays through ``auto``'s step gate; ``rounds``: the
    first rounds only."""
    from vllm_ddtree.testing.oracle import true_path_depth
    from vllm_ddtree.tree.draft_tree import build_ddtree

    oracle = RankOracle(next_token_permutation(vocab_size), table, vocab_size, seed)
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(oracle.vectors.shape[0] if rounds is None else rounds):
        logits, truth = oracle_logits_of(oracle, i, seed, gen)
        trees = [build_ddtree(logits[None], b) for b in arms]
        rows.append([true_path_depth(t.tokens[0].tolist(), t.parents[0].tolist(), truth)
                     for t in trees])
    return rows


# The tails :func:`fit_tail` tries: the share of the non-top mass on ranks 1..cap, and
# the power law's exponent.
TAIL_SHARES = (0.3, 0.5, 0.7, 0.85, 0.95)
TAIL_EXPONENTS = (0.5, 1.0, 1.5, 2.0, 3.0)


def calibration_distance(curve: dict, target: dict) -> float:
    """Sum of squared differences, budget by budget, of promised and of committed
    tokens between two calibration curves (same budgets)."""
    if curve["budgets"] != target["budgets"]:
        raise ValueError(f"calibration budgets differ: {curve['budgets']} vs "
                         f"{target['budgets']}")
    return sum((a - b) ** 2 for key in ("promised", "committed")
               for a, b in zip(curve[key], target[key], strict=True))


def fit_tail(table: dict, vocab_size: int, shares=TAIL_SHARES, exponents=TAIL_EXPONENTS,
             progress: bool = True) -> tuple[dict, dict]:
    """The ``oracle_tail`` of the grid whose calibration curve comes nearest the
    embedded drafter's (``table["calibration"]``), and that curve."""
    from tqdm import tqdm

    target = table.get("calibration")
    if not target:
        raise ValueError("rank table: no calibration curve (python evals/drafter_ranks.py "
                         "measures it)")
    best = None
    grid = [(s, e) for s in shares for e in exponents]
    for share, exponent in tqdm(grid, desc="oracle tails", disable=not progress):
        tail = {"share": share, "exponent": exponent}
        curve = oracle_tokens_per_round(table, vocab_size, [], tail=tail)["calibration"]
        distance = calibration_distance(curve, target)
        if best is None or distance < best[0]:
            best = (distance, tail, curve)
    return best[1], best[2]


def main(argv=None) -> int:
    """``python evals/e2e_oracle.py``: fit the oracle's tail to the embedded drafter's
    calibration (:func:`fit_tail`) and store it with :func:`oracle_tokens_per_round`
    (V of DeepSeek-V2-Lite, B = 16 and 64) in the rank table, beside the measured
    figures."""
    import argparse
    import json
    import sys
    from pathlib import Path

    from drafter_ranks import TABLE_PATH, load_table

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--table", default=str(TABLE_PATH))
    p.add_argument("--vocab", type=int, default=102400)
    p.add_argument("--round-cuts", metavar="PATH",
                   help="only write each round's accepted drafts by tree budget "
                        "(round_cuts; budgets 1-64) as JSON to PATH")
    args = p.parse_args(argv)
    table = load_table(Path(args.table))
    command = "python " + " ".join(["evals/e2e_oracle.py"] + (argv or sys.argv[1:]))
    if args.round_cuts:
        arms = [1, 2, 4, 8, 16, 32, 64]
        rows = round_cuts(table, args.vocab, arms)
        body = ",\n".join("  " + json.dumps(r) for r in rows)
        Path(args.round_cuts).write_text(
            f'{{"command": {json.dumps(command)},\n "pair": {json.dumps(table["pair"])},\n'
            f' "arms": {json.dumps(arms)},\n "accepted": [\n{body}\n]}}\n')
        return 0
    tail, _ = fit_tail(table, args.vocab)
    figures = oracle_tokens_per_round(table, args.vocab, [16, 64], tail=tail)
    data = json.loads(Path(args.table).read_text())
    data["oracle_tail"] = tail
    data["oracle_calibration"] = figures.pop("calibration")
    data["oracle_tokens_per_round"] = dict(
        figures, vocab=args.vocab,
        command=command)
    vectors = data.pop("vectors")
    body = json.dumps(data, indent=1)
    Path(args.table).write_text(body[:-2] + ',\n "vectors": ' + json.dumps(vectors) + "\n}\n")
    print(json.dumps({k: data[k] for k in ("oracle_tail", "calibration", "oracle_calibration",
                                           "oracle_tokens_per_round")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
