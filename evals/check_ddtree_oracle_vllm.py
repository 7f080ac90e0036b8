"""DDTree in vLLM with an *oracle* drafter (GPU): deep acceptance paths, same tokens.

    python evals/check_ddtree_vllm.py --method ar --max-tokens 128 --extra-tokens 16 --out ar.json
    python evals/check_ddtree_oracle_vllm.py --truth ar.json --out oracle.json \\
        [--budget 32] [--ranks 0,0,0,1,2] [--top-k K]

The trained drafter accepts a few tokens per round; this script makes every round
propose the true continuation (the AR run's tokens, ``--truth``) at chosen ranks per
depth (``vllm_ddtree.testing.oracle``): ``--ranks 0,0,0,1,2`` puts the true token
first at depths 1-3, second at depth 4, third at depth 5 and nowhere special after;
``0*15`` makes the whole drafter block (L = 15) the favourite path. The target still
decides every token, so greedy output must equal AR's (up to bf16 ties) while most
rounds accept deep paths.

How the oracle reaches the drafter (``vllm_ddtree.testing.oracle.install_oracle``;
in-process engine, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, eager only: it reads device
tensors on the host):

* ``DDTreeSpeculator.propose`` is wrapped to remember the speculator and the batch's
  ``input_batch.req_ids`` (batch order = the rows of ``_generate_draft``).
* ``vllm_ddtree.draft.speculator.build_ddtree_fast`` (what ``_generate_draft`` calls on the
  drafter logits ``[R, L, V]``) is wrapped to replace the logits first. Row ``r``'s
  depth ``d`` predicts absolute position ``sample_pos[r * L + d - 1]``: DFlash's
  ``_prepare_dflash_inputs_kernel`` (``dflash/speculator.py:512-564``) writes the
  *predicted token's* position there, ``last_valid_pos + 1 + d``, where
  ``last_valid_pos = positions[valid_ctx_end - 1]``, ``valid_ctx_end = ctx_end -
  num_rejected``, is the last committed token with KV (for DDTree the end of the
  accepted path, which ``propose`` moved to rows ``0..a``) and ``last_valid_pos + 1``
  the bonus token (the root of the next tree). DDTree keeps that buffer's layout with a
  stride of L (``self.num_speculative_steps = L``). So the true token of depth ``d``
  is ``truth[sample_pos[r, d-1]]`` with ``truth = prompt + AR output`` — no position
  arithmetic of our own.
* ``req_ids`` map to prompts: ``LLM.generate`` numbers requests ``0, 1, ...`` in
  prompt order (``entrypoints/offline_utils.py:563``) and the engine appends
  ``-<8 hex>`` (``v1/engine/input_processor.py:240``); warm-up (``_warmup_*``) and
  dummy (``req_*``) rows keep the drafter's logits.
* ``DDTreeVerifier.__call__`` is wrapped to record every verified tree: prompt, root
  position (``input_batch.positions[query_start_loc[r]]``, the last committed token)
  and accepted depth ``num_sampled - 1``.

Lengths (:func:`plan_max_tokens`): a request whose AR run reached its ``max_tokens``
(the asked-for length + ``extra_tokens``) generates ``len(truth) - extra_tokens``
tokens here, so every round's draft has the truth for all its depths. A request whose
AR run ended early (``--mixed``: every third request may stop at EOS or a blank line)
has no truth past that end: it still runs (the batch keeps its arrivals), generates
exactly its AR tokens (``ignore_eos``, no stop strings, so the length is fixed) and is
compared on all of them. The rounds whose draft reaches past the truth's end
(:func:`rounds_within_truth`; the oracle leaves those depths to noise) are left out of
the depth statistics and counted as ``rounds_past_truth``: those at the end of an
early-ended truth, and steps that async scheduling (on for vLLM's ``dflash`` method)
ran past a request's ``max_tokens`` before seeing it finish (their tokens are
discarded).

Writes JSON: outputs (prompt, tokens, top2_gap, max_tokens, truth_ended_early,
first_mismatch vs truth), rounds, oracle counters, the acceptance summary over rounds
whose committed prefix still equals the truth and whose draft lies within it, the depth
``build_ddtree`` predicts for these ranks on CPU, DDTree's and vLLM's acceptance
counters.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def plan_max_tokens(
    truth_lens: Sequence[int], extra: int, requested: Sequence[int] | None = None,
) -> tuple[list[int], dict[int, str]]:
    """Tokens each request generates (and is compared on) under the oracle, and why
    the requests whose AR truth ended early are treated so.

    ``truth_lens[i]``: AR output tokens of request ``i``; the AR run asked for
    ``requested[i] + extra`` (``requested`` None: unknown, every run is taken to be
    complete unless it is not longer than ``extra``). A complete truth gives
    ``truth_len - extra`` (the last ``extra`` tokens are the oracle's look-ahead); one
    that ended early (EOS or a stop string) gives all its tokens: nothing past its end
    is known, so the rounds reaching past it lose their look-ahead (see
    :func:`rounds_within_truth`) but every generated token is still compared.
    Returns ``(max_tokens, {i: reason})`` for the early ones."""
    if extra < 0:
        raise ValueError(f"extra_tokens must be >= 0, got {extra}")
    if requested is not None and len(requested) != len(truth_lens):
        raise ValueError(f"{len(requested)} requested lengths for {len(truth_lens)} truths")
    max_tokens, early = [], {}
    for i, n in enumerate(truth_lens):
        if n < 1:
            raise ValueError(f"request {i}: empty truth")
        asked = None if requested is None else requested[i] + extra
        if asked is not None and n > asked:
            raise ValueError(f"request {i}: {n} truth tokens, more than the {asked} asked for")
        if (asked is not None and n < asked) or n <= extra:
            max_tokens.append(n)
            of = "" if asked is None else f" of {asked}"
            early[i] = (f"AR run ended after {n}{of} tokens (EOS / stop string): all {n} "
                        "generated and compared, rounds drafting past them not in the "
                        "depth statistics")
        else:
            max_tokens.append(n - extra)
    return max_tokens, early


def rounds_within_truth(
    rounds: Sequence[dict], truth_ends: Sequence[int], num_depths: int,
) -> list[dict]:
    """The verified rounds whose whole draft lay inside the known truth: a tree rooted
    at position ``p`` (``round["root_pos"]``, the bonus token of its draft) drafted
    positions ``p + 1 .. p + num_depths``, all of which must be below ``truth_ends[q]``
    (``len(prompt + AR output)`` of request ``q``); past it the oracle drafts noise."""
    return [r for r in rounds if r["root_pos"] + num_depths < truth_ends[r["prompt"]]]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--truth", required=True,
                        help="check_ddtree_vllm.py --method ar JSON (best with --extra-tokens)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--budget", type=int, default=32, help="tree nodes B")
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--ranks", default="0,0,0,1,2",
                        help="rank of the true token per depth, e.g. 0,0,0,1,2 or 0*15; "
                        "r = noise only")
    parser.add_argument("--max-num-seqs", type=int, default=None,
                        help="default: the truth run's max_num_seqs (8)")
    parser.add_argument("--min-depth", type=int, default=3)
    args = parser.parse_args()

    import vllm_ddtree
    from vllm_ddtree.patches import apply_all

    vllm_ddtree.register()

    from check_ddtree_vllm import MIXED_MAX_TOKENS, spec_decode_metrics
    from transformers import AutoConfig
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_ddtree.demo.reference_engine import CHECKPOINTS
    from vllm_ddtree.runtime_state import DDTREE_STATE
    from vllm_ddtree.testing.compare import first_mismatch
    from vllm_ddtree.testing.oracle import (
        acceptance_summary,
        install_oracle,
        parse_ranks,
        predicted_accepted_depth,
    )

    with open(args.truth) as f:
        truth_run = json.load(f)
    extra = int(truth_run.get("extra_tokens", 0))
    refs = truth_run["outputs"]
    prompts = [r["prompt"] for r in refs]
    truths = [r["prompt"] + r["tokens"] for r in refs]
    # the --mixed AR run asked for MIXED_MAX_TOKENS (+ extra); other runs never stop early
    requested = MIXED_MAX_TOKENS if truth_run.get("mixed") else None
    max_tokens, ended_early = plan_max_tokens([len(r["tokens"]) for r in refs], extra,
                                              requested)
    for i, reason in ended_early.items():
        print(f"oracle truth of request {i}: {reason}")
    ranks = parse_ranks(args.ranks)

    record, _ = install_oracle(truths, ranks)

    target, drafter = CHECKPOINTS / "target", CHECKPOINTS / "drafter"
    drafter_config = AutoConfig.from_pretrained(drafter)
    num_depths = int(drafter_config.block_size) - 1
    vocab = int(drafter_config.vocab_size)
    spec = {"method": "ddtree", "model": str(drafter), "num_speculative_tokens": args.budget}
    if args.top_k is not None:
        spec["ddtree_top_k"] = args.top_k
    max_num_seqs = args.max_num_seqs or int(truth_run.get("max_num_seqs", 8))
    llm = LLM(model=str(target), speculative_config=spec, enforce_eager=True,
              dtype="bfloat16", gpu_memory_utilization=0.3, max_model_len=4096,
              max_num_seqs=max_num_seqs, seed=0, disable_log_stats=False)
    applied = apply_all()  # names of the patches active in this process
    # ignore_eos and no stop strings: every request generates exactly max_tokens
    params = [SamplingParams(temperature=float(r.get("temperature", 0.0)),
                             seed=r.get("seed"), max_tokens=n, logprobs=2, ignore_eos=True)
              for r, n in zip(refs, max_tokens, strict=True)]
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)

    result, firsts = [], []
    for i, (prompt, ref, out, n) in enumerate(zip(prompts, refs, outputs, max_tokens,
                                                  strict=True)):
        completion = out.outputs[0]
        gaps = []
        for lp in completion.logprobs or []:
            top = sorted((v.logprob for v in lp.values()), reverse=True)
            gaps.append(top[0] - top[1] if len(top) > 1 else float("inf"))
        tokens = list(completion.token_ids)
        first = first_mismatch(tokens, ref["tokens"][:n])  # a short output counts
        firsts.append(first)
        result.append({"prompt": prompt, "tokens": tokens, "top2_gap": gaps,
                       "temperature": ref.get("temperature", 0.0), "max_tokens": n,
                       "truth_ended_early": i in ended_early, "first_mismatch": first})
    # depths only of rounds whose whole draft the truth covers
    full_rounds = rounds_within_truth(record.rounds, [len(t) for t in truths], num_depths)
    summary = acceptance_summary(full_rounds, [len(p) for p in prompts], firsts,
                                 min_depth=args.min_depth)
    summary["rounds_past_truth"] = len(record.rounds) - len(full_rounds)
    predicted = predicted_accepted_depth(ranks, args.budget, num_depths, vocab, args.top_k)
    print(f"oracle ranks {args.ranks} B={args.budget}: {summary}; "
          f"predicted depth {predicted}; first mismatches {firsts}")
    with open(args.out, "w") as f:
        json.dump({"budget": args.budget, "top_k": args.top_k, "ranks": args.ranks,
                   "num_depths": num_depths, "patches": applied, "outputs": result,
                   "summary": summary, "predicted_depths": predicted,
                   "rounds_without_draft": record.rounds_without_draft(),
                   "rounds": record.rounds, "oracle_rows": record.oracle_rows,
                   "passthrough_rows": record.passthrough_rows,
                   "shape_mismatches": record.shape_mismatches,
                   "ddtree_mean_acceptance_length": (
                       DDTREE_STATE.mean_acceptance_length() if DDTREE_STATE.enabled else None),
                   "vllm_metrics": spec_decode_metrics(llm)}, f)
    from check_mla_backend import exit_now

    exit_now()


if __name__ == "__main__":
    main()
