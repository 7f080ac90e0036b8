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

**Drafter logits with measured ranks.** The drafter (dummy weights) runs at full cost;
its logits then pass through :func:`oracle_logits_`, in place and inside its CUDA graph
(tensor ops only, no host sync): noise clamped to +-``NOISE``, and at depth d the true
token ``f^d(bonus)`` placed at rank ``r_d``, ``(r_0 .. r_{L-1})`` one vector of the
measured table (``evals/data/drafter_ranks.json``, ``evals/drafter_ranks.py``) chosen by
a hash of (bonus token, bonus position, seed): the same request at the same position gets
the same vector in every method. Ranks of a vector follow a Zipf profile: the tokens of
ranks ``j <= r`` get logits ``c_d + log((r + 1) / (j + 1))`` (the true token the last,
at ``c_d``; the others ``decoy`` tokens), ``c_d = log(V p_d / (1 - p_d))`` so that the
top token of a rank-0 depth holds about ``p_d``, the embedded drafter's mean top-1
probability at depth d. A depth of rank "beyond" (>= the table's cap) gets the decoys
and no true token. The chain (argmax) accepts the leading rank-0 depths; the tree
accepts as deep as its nodes cover the true path: each method gets the acceptance the
embedded drafter's ranks give it.

Both hooks are benchmark instruments installed in the child process before its
``LLM`` starts (:func:`install_rank_oracle`): they wrap vLLM 0.26.0's
``DummyModelLoader.load_weights`` and ``DFlashSpeculator.load_draft_model`` (the
latter swaps the loaded drafter's ``compute_logits``, which vLLM's chain and DDTree
both call on the sampled rows of the drafter's step).
"""

from __future__ import annotations

import math

import torch

NOISE = 0.5  # drafter noise logits are clamped to +-NOISE
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


def confident_logits(top1_prob: list[float], vocab_size: int) -> torch.Tensor:
    """float32 ``[L]``: ``c_d = log(V p_d / (1 - p_d))``, ``p_d`` clipped to
    [0.02, 0.995]: a lone true token at ``c_d`` over ~0 noise holds about ``p_d``."""
    out = []
    for p in top1_prob:
        p = min(max(float(p), 0.02), 0.995)
        out.append(math.log(vocab_size * p / (1 - p)))
    return torch.tensor(out, dtype=torch.float32, device="cpu")


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
    ``[L, V]``, ``vectors`` int64 ``[N, L]``, ``confident`` float32 ``[L]``, the decoy
    offsets ``[cap]`` and the rank cap."""

    def __init__(self, perm: torch.Tensor, table: dict, vocab_size: int, seed: int = 0,
                 device: torch.device | str = "cpu"):
        depths, cap = int(table["depths"]), int(table["rank_cap"])
        if len(table["top1_prob"]) != depths:
            raise ValueError(f"rank table: top1_prob has {len(table['top1_prob'])} depths, "
                             f"not depths={depths}")
        self.depths, self.cap, self.seed = depths, cap, int(seed)
        self.vocab_size = vocab_size
        self.truth = truth_table(perm.long(), depths).to(device)
        self.vectors = rank_vectors(table).to(device)
        self.confident = confident_logits(table["top1_prob"], vocab_size).to(device)
        self.offsets = torch.arange(1, cap + 1, dtype=torch.int64, device=device)  # [cap]
        self.columns = torch.arange(cap, dtype=torch.int64, device=device)  # j = 0..cap-1

    def apply_(self, logits: torch.Tensor, bonus: torch.Tensor, bonus_pos: torch.Tensor,
               depth: torch.Tensor) -> torch.Tensor:
        """Oracle logits, in place: ``logits`` ``[n, V]`` (any float dtype); ``bonus``,
        ``bonus_pos``, ``depth`` int ``[n]`` per row (``depth`` 0-based: row predicts the
        token ``depth + 1`` after ``bonus``). Tensor ops only (CUDA-graph safe)."""
        n = logits.shape[0]
        depth = depth.long().clamp(0, self.depths - 1)
        bonus = bonus.long().clamp(0, self.vocab_size - 1)
        true = self.truth[depth, bonus]  # [n]
        which = vector_index(bonus, bonus_pos, self.seed, self.vectors.shape[0])
        rank = self.vectors[which, depth]  # [n], cap = beyond
        c = self.confident[depth]  # [n]
        logits.clamp_(-NOISE, NOISE)
        # Decoy j (0-based, j < rank) is token true + 1 + j; it ranks j: logit
        # c + log((rank + 1) / (j + 1)). Columns j >= rank keep their noise.
        cols = self.columns[None, :].expand(n, -1)  # [n, cap]
        decoy_tok = (true[:, None] + 1 + cols) % self.vocab_size
        rank_f = rank.to(torch.float32)[:, None]
        decoy_val = c[:, None] + torch.log((rank_f + 1) / (cols.to(torch.float32) + 1))
        noise = logits.gather(1, decoy_tok).to(torch.float32)
        keep = cols < rank[:, None]
        logits.scatter_(1, decoy_tok, torch.where(keep, decoy_val, noise).to(logits.dtype))
        true_val = torch.where(rank < self.cap, c, logits.gather(1, true[:, None])[:, 0]
                               .to(torch.float32))
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


def oracle_tokens_per_round(table: dict, vocab_size: int, budgets: list[int],
                            seed: int = 0) -> dict[str, float]:
    """Tokens per round the oracle gives each method over every vector of ``table``
    (CPU, ``build_ddtree`` on the oracle logits of a random truth; noise 0): ``chain``
    (argmax per depth) and ``ddtree-B``. What a sweep's acceptance should come near."""
    from vllm_ddtree.testing.oracle import true_path_depth
    from vllm_ddtree.tree.draft_tree import build_ddtree

    perm = next_token_permutation(vocab_size)
    oracle = RankOracle(perm, table, vocab_size, seed)
    depths, n = oracle.depths, oracle.vectors.shape[0]
    sums = {"chain": 0.0} | {f"ddtree-{b}": 0.0 for b in budgets}
    gen = torch.Generator().manual_seed(seed)
    for i in range(n):
        bonus = torch.randint(0, vocab_size, (1,), generator=gen)
        truth = oracle.truth[:, bonus[0]].tolist()
        # a position whose hash picks vector i: search the first few
        pos = next(p for p in range(100 * n)
                   if int(vector_index(bonus, torch.tensor([p]), seed, n)) == i)
        logits = torch.zeros(depths, vocab_size)
        oracle.apply_(logits, bonus.repeat(depths), torch.full((depths,), pos),
                      torch.arange(depths))
        argmax = logits.argmax(-1).tolist()
        sums["chain"] += 1 + next((d for d in range(depths) if argmax[d] != truth[d]), depths)
        for b in budgets:
            tree = build_ddtree(logits[None], b)
            sums[f"ddtree-{b}"] += 1 + true_path_depth(tree.tokens[0].tolist(),
                                                       tree.parents[0].tolist(), truth)
    return {k: round(v / n, 3) for k, v in sums.items()}


def main(argv=None) -> int:
    """``python evals/e2e_oracle.py``: store :func:`oracle_tokens_per_round` (V of
    DeepSeek-V2-Lite, B = 16 and 64) in the rank table, beside the measured figures."""
    import argparse
    import json
    import sys
    from pathlib import Path

    from drafter_ranks import TABLE_PATH, load_table

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--table", default=str(TABLE_PATH))
    p.add_argument("--vocab", type=int, default=102400)
    args = p.parse_args(argv)
    table = load_table(Path(args.table))
    figures = oracle_tokens_per_round(table, args.vocab, [16, 64])
    text = Path(args.table).read_text()
    data = json.loads(text)
    data["oracle_tokens_per_round"] = dict(
        figures, vocab=args.vocab,
        command="python " + " ".join(["evals/e2e_oracle.py"] + (argv or sys.argv[1:])))
    vectors = data.pop("vectors")
    body = json.dumps(data, indent=1)
    Path(args.table).write_text(body[:-2] + ',\n "vectors": ' + json.dumps(vectors) + "\n}\n")
    print(json.dumps(data["oracle_tokens_per_round"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
