#!/usr/bin/env python
"""Train the embedded model pair (MLA target + DFlash drafter) in one go.

    python -m vllm_ddtree.training.corpus --out data/          # once, CPU
    python evals/train_pair.py --data data/ --out vllm_ddtree/checkpoints \\
        --target-minutes 3 --drafter-minutes 3                 # CUDA

Stages (``--stage``): ``target`` trains and saves ``<out>/target``; ``drafter``
loads it, generates the greedy pools, trains and saves ``<out>/drafter``; ``pool``
only generates the pools and saves them to ``--pool-cache`` (a later ``drafter``
stage with the same ``--pool-cache`` loads them: decoding and training in two calls);
``report`` (also run after the others) prints the held-out perplexity, greedy
completions and the reference engine's acceptance (DFlash chain and DDTree B=32)
on held-out prompts. ``all`` = the three. Loss plots and ``train_pair.json`` go to
``--results``. ``--tiny`` runs tiny models for a few steps (CPU smoke test).

Splits: ``train`` is trained on; ``valid`` picks the kept checkpoint of each model
(lowest validation loss) and feeds the drafter's monitoring pool; ``heldout`` is
only reported on (perplexity, acceptance prompts).

Step counts: without ``--target-steps`` / ``--drafter-steps`` each run times its
first steps and takes as many as fit in the minute budget, capped by
``--*-max-steps`` and, for the target, ``--target-max-epochs`` passes over the
train split. The chosen counts are printed and saved; passing them back as
``--target-steps N --drafter-steps M`` repeats the run step for step.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import DeepseekV3ForCausalLM

REPO = Path(__file__).resolve().parents[1]
for _path in (str(REPO), str(REPO / "evals")):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from cli_args import (  # noqa: E402
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
)

from vllm_ddtree.reference import DFlashDraftModel, generate  # noqa: E402
from vllm_ddtree.reference.dflash2 import DFlash2DraftModel  # noqa: E402
from vllm_ddtree.training import configs  # noqa: E402
from vllm_ddtree.training.common import (  # noqa: E402
    dir_size,
    load_drafter,
    plot_losses,
    save_checkpoint,
    seed_everything,
)
from vllm_ddtree.training.corpus import (  # noqa: E402
    SPLITS,
    TOKENIZER_SUBDIR,
    load_code_train,
    load_split,
    load_tokenizer,
)
from vllm_ddtree.training.pool_cache import (  # noqa: E402
    load_pools,
    pool_description,
    save_pools,
)
from vllm_ddtree.training.static_decode import StaticGreedyDecoder  # noqa: E402
from vllm_ddtree.training.synthetic import selection_docs  # noqa: E402
from vllm_ddtree.training.train_drafter import (  # noqa: E402
    DrafterTrainConfig,
    build_pool,
    concat_pools,
    evaluate_drafter,
    greedy_continue,
    text_pool,
    train_drafter,
)
from vllm_ddtree.training.train_selector import (  # noqa: E402
    frozen_selector_blocks,
    train_selector,
)
from vllm_ddtree.training.train_target import (  # noqa: E402
    AnswerSet,
    TargetTrainConfig,
    evaluate_nll,
    perplexity,
    train_target,
)
from vllm_ddtree.training.vllm_pool import PoolRequest, build_pools_vllm  # noqa: E402

SIZE_LIMIT_BYTES = 24_000_000
EMBEDDED_TARGET_SEQ_LEN = 512  # training windows of vllm_ddtree/checkpoints/target
SANITY_PROMPTS = [
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "import os\n\n\ndef list_python_files(path):\n",
]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default="data", help="output of vllm_ddtree.training.corpus")
    p.add_argument("--out", default="vllm_ddtree/checkpoints", help="checkpoint root")
    p.add_argument(
        "--results",
        default=None,
        help="plots + JSON (default evals/results; <out>/results with --tiny)",
    )
    p.add_argument("--stage", choices=["all", "target", "pool", "drafter", "report"],
                   default="all")
    p.add_argument(
        "--pool-cache",
        default=None,
        help="directory for the drafter's greedy pools (pools.npz): a later run with the "
        "same target, corpus and pool settings loads them instead of decoding again "
        "(--stage pool decodes and saves them only)",
    )
    p.add_argument("--tiny", action="store_true", help="tiny models, few steps (CPU smoke)")
    p.add_argument("--device", default=None, help="default: cuda if available")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target-minutes", type=positive_float, default=3.0)
    p.add_argument("--drafter-minutes", type=positive_float, default=3.0)
    p.add_argument("--target-steps", type=positive_int, default=None,
                   help="fixed steps (reproduce)")
    p.add_argument("--drafter-steps", type=positive_int, default=None,
                   help="fixed steps (reproduce)")
    p.add_argument("--target-max-steps", type=positive_int, default=None)
    p.add_argument("--drafter-max-steps", type=positive_int, default=None)
    p.add_argument("--target-max-epochs", type=positive_float, default=None, help="default 30")
    p.add_argument("--target-batch", type=positive_int, default=None)
    p.add_argument("--drafter-batch", type=positive_int, default=None)
    p.add_argument("--target-lr", type=positive_float, default=None)
    p.add_argument("--drafter-lr", type=positive_float, default=None)
    p.add_argument("--gen-sequences", type=positive_int, default=None, help="greedy pool size")
    p.add_argument("--gen-batch", type=positive_int, default=None,
                   help="sequences decoded together for the greedy pool, one corpus prefix "
                   "length per batch with transformers (default 256; less memory on a CPU)")
    p.add_argument("--text-sequences", type=non_negative_int, default=None,
                   help="corpus-text rows added to the drafter's train pool (no decoding; "
                   "labels are the text: see train_drafter.text_pool); default 0")
    p.add_argument(
        "--gen-minutes",
        type=non_negative_float,
        default=None,
        help="no new generation batch after this long (default 1.5; 0 = no limit)",
    )
    p.add_argument(
        "--pool-engine",
        choices=["auto", "vllm", "static", "hf"],
        default="auto",
        help="who decodes the drafter's greedy pool: vLLM in a child process (every "
        "sequence its own prefix length; --gen-minutes does not apply), the target on "
        "a static KV cache with the decoding step in a CUDA graph (training."
        "static_decode; one prefix length per batch) or transformers (one prefix "
        "length per batch); auto = vllm on CUDA, hf elsewhere",
    )
    p.add_argument("--target-seq-len", type=positive_int, default=2048,
                   help="target training window (full size)")
    p.add_argument("--drafter-seq-len", type=positive_int, default=1536,
                   help="drafter training sequence: corpus prefix + greedy continuation")
    p.add_argument("--drafter-prefix-max", type=positive_int, default=1280,
                   help="longest corpus prefix of a drafter training sequence")
    p.add_argument("--drafter-continuation", type=non_negative_int, default=384,
                   help="greedy tokens after each corpus prefix (0: up to the sequence end)")
    p.add_argument("--target-layer-ids", default=None, help="e.g. 1,2,3")
    p.add_argument("--target-valid-slack", type=non_negative_float, default=None,
                   metavar="NATS",
                   help="keep the target checkpoint of lowest loss on held-out exact "
                   "answers (training/synthetic.py selection_docs) among those whose "
                   "validation loss (512-token windows) is within NATS of the starting "
                   "weights' (a fine-tune "
                   "with --target-init on a corpus with --synthetic-docs); default: the "
                   "lowest validation loss")
    p.add_argument("--target-anchor-kl", type=non_negative_float, default=None,
                   metavar="WEIGHT",
                   help="add WEIGHT * KL(starting target || target) on code windows of "
                   "512 tokens to every target step (a fine-tune with --target-init: its "
                   "code predictions, and a drafter's acceptance on them, stay the "
                   "starting target's; code only: the corpus's train_code.npy when it "
                   "has synthetic snippets); default: no anchor")
    p.add_argument("--target-init", default=None,
                   help="start the target from this checkpoint instead of random weights "
                   "(fine-tune; e.g. vllm_ddtree/checkpoints/target on a corpus built with "
                   "its tokenizer and --synthetic-docs); its shape and tokenizer must be "
                   "the ones trained")
    p.add_argument("--drafter-init", default=None,
                   help="start the drafter from this checkpoint (fine-tune; e.g. the "
                   "embedded drafter on a YaRN copy of its target, long_context.py) "
                   "instead of random weights; its shape must match the drafter config")
    p.add_argument("--drafter-kind", choices=["dflash", "dflash2"], default="dflash",
                   help="dflash2: a DFlash2 drafter (grouped convolutions, candidate "
                   "selector) that starts as the DFlash one (random or --drafter-init) and "
                   "trains its new parts with the rest")
    p.add_argument("--selector-only", action="store_true",
                   help="refit only the candidate selector of the DFlash2 drafter given by "
                   "--drafter-init (the rest frozen; the selector loss scores the 64 "
                   "candidates a B = 64 tree ranks); needs --drafter-kind dflash2")
    p.add_argument("--accept-prompts", type=positive_int, default=None)
    p.add_argument("--accept-new-tokens", type=positive_int, default=None)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="deterministic CUDA kernels where torch has them (slower); without it a "
        "rerun repeats batches and init but GPU atomics may change the last bits",
    )
    p.add_argument(
        "--pack",
        default=None,
        help="also write <out>/target, <out>/drafter and the results as target.tar, "
        "drafter.tar, results.tar into this folder (e.g. a GPU job's output folder)",
    )
    args = p.parse_args(argv)
    if args.target_init and not (Path(args.target_init) / "config.json").exists():
        p.error(f"--target-init {args.target_init}: no config.json there (a target "
                "checkpoint directory, e.g. vllm_ddtree/checkpoints/target)")
    if args.target_anchor_kl and not args.target_init:
        p.error(f"--target-anchor-kl {args.target_anchor_kl} anchors a fine-tune to its "
                "starting weights: it needs --target-init")
    if args.selector_only:
        arch = None
        if args.drafter_init and (Path(args.drafter_init) / "config.json").exists():
            config = json.loads((Path(args.drafter_init) / "config.json").read_text())
            arch = (config.get("architectures") or [None])[0]
        if args.drafter_kind != "dflash2" or arch != "DFlash2DraftModel":
            p.error(f"--selector-only refits a DFlash2 drafter's selector: it needs "
                    f"--drafter-kind dflash2 (got {args.drafter_kind}) and --drafter-init "
                    f"a DFlash2DraftModel checkpoint (got {args.drafter_init!r}, "
                    f"architecture {arch!r})")
    return args


def train_configs(args) -> tuple[TargetTrainConfig, DrafterTrainConfig]:
    seed = args.seed
    if args.tiny:
        tc = TargetTrainConfig(
            seq_len=64,
            batch_size=8,
            lr=3e-3,
            warmup_steps=5,
            steps=40,
            max_steps=40,
            eval_every=20,
            eval_windows=4,
            seed=seed,
        )
        dc = DrafterTrainConfig(
            seq_len=64,
            prefix_min=8,
            prefix_max=24,
            gen_sequences=32,
            gen_batch=16,
            eval_sequences=8,
            batch_size=8,
            anchors_per_seq=8,
            eval_anchors_per_seq=8,
            lr=3e-3,
            warmup_steps=5,
            steps=40,
            max_steps=40,
            eval_every=20,
            seed=seed,
        )
    else:
        # --target-seq-len windows: a target trained on 512-token windows falls apart
        # past ~600 tokens of relative distance (loss 2.1 -> 5.1 nats at 512 -> 1024),
        # and the drafter with it; the 1k-context benchmarks need both to hold there.
        # Same tokens per step as 64 x 512.
        tc = TargetTrainConfig(seed=seed, seq_len=args.target_seq_len,
                               batch_size=max(1, 32768 // args.target_seq_len))
        # Corpus prefixes up to --drafter-prefix-max, then the target's own greedy
        # continuation: the drafter sees long real-code contexts, as at decode time.
        # Batches of 256: four times the prefix lengths of 1024 in the same minutes; at
        # most --drafter-continuation greedy tokens each (decoding steps are the cost).
        dc = DrafterTrainConfig(seed=seed, seq_len=args.drafter_seq_len,
                                prefix_max=args.drafter_prefix_max, gen_batch=256,
                                continuation_max=args.drafter_continuation or None)
    tc.minutes, dc.minutes = args.target_minutes, args.drafter_minutes
    for cfg, prefix in ((tc, "target"), (dc, "drafter")):
        for field, arg in (
            ("steps", "steps"),
            ("max_steps", "max_steps"),
            ("batch_size", "batch"),
            ("lr", "lr"),
        ):
            value = getattr(args, f"{prefix}_{arg}")
            if value is not None:
                setattr(cfg, field, value)
    if args.target_max_epochs is not None:
        tc.max_epochs = args.target_max_epochs
    tc.valid_slack = args.target_valid_slack
    # the slack's code loss at the windows the embedded target was trained on
    tc.slack_seq_len = min(tc.seq_len, EMBEDDED_TARGET_SEQ_LEN)
    tc.anchor_weight = args.target_anchor_kl
    tc.anchor_seq_len = tc.slack_seq_len
    if args.gen_sequences is not None:
        dc.gen_sequences = args.gen_sequences
    if args.gen_batch is not None:
        dc.gen_batch = args.gen_batch
    if args.text_sequences is not None:
        dc.text_sequences = args.text_sequences
    if args.gen_minutes is not None:
        dc.gen_minutes = args.gen_minutes or None
    return tc, dc


def heldout_prompts(heldout: np.ndarray, eos_id: int, n: int, length: int) -> list[list[int]]:
    """``length`` tokens from a third of the way into ``n`` held-out files (files of at
    least ``3 * length`` tokens, spread over the split in file order)."""
    ends = np.flatnonzero(heldout == eos_id)
    starts = np.concatenate([[0], ends[:-1] + 1])
    files = [(s, e) for s, e in zip(starts, ends, strict=True) if e - s >= 3 * length]
    if not files:
        return []
    pick = np.linspace(0, len(files) - 1, num=min(n, len(files))).round().astype(int)
    prompts = []
    for i in pick:
        s, e = files[i]
        first = s + (e - s) // 3
        prompts.append(heldout[first : first + length].astype(np.int64).tolist())
    return prompts


def acceptance_estimate(target, drafter, prompts, max_new: int, budget: int = 32) -> dict:
    """Reference-engine decoding of ``prompts``: AR, DFlash chain and DDTree
    (``budget`` nodes); mean committed tokens per round, pooled over prompts, and
    whether each method reproduced AR's tokens."""
    out = {"prompts": len(prompts), "max_new_tokens": max_new, "ddtree_budget": budget}
    ar_tokens = [generate(target, None, p, max_new, "ar").tokens for p in prompts]
    for name, method, b in (("dflash", "dflash", 1), (f"ddtree_b{budget}", "ddtree", budget)):
        committed = rounds = 0
        same = True
        t0 = time.perf_counter()
        for p, ref in zip(prompts, ar_tokens, strict=True):
            res = generate(target, drafter, p, max_new, method, budget=b)
            committed += sum(s.committed for s in res.stats)
            rounds += res.rounds
            same &= res.tokens == ref
        out[name] = {
            "mean_committed_per_round": committed / max(1, rounds),
            "rounds": rounds,
            "tokens_equal_ar": bool(same),
            "seconds": round(time.perf_counter() - t0, 2),
        }
    return out


TARGET_INIT_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers",
                      "num_attention_heads", "kv_lora_rank", "q_lora_rank",
                      "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                      "intermediate_size", "moe_intermediate_size", "n_routed_experts",
                      "n_shared_experts", "first_k_dense_replace")


def init_target(model, path: Path, corpus_tokenizer: dict) -> None:
    """Load ``path``'s target weights into ``model``. ValueError naming the first of
    ``TARGET_INIT_FIELDS`` that differs, or a tokenizer other than the corpus's
    (``corpus_tokenizer``: the manifest's entry; build the corpus with
    ``--tokenizer <path>``)."""
    check_init_fields("--target-init", path, model.config, TARGET_INIT_FIELDS, "target")
    tokenizer = path / "tokenizer.json"
    want = corpus_tokenizer.get("tokenizer_json_sha256")
    got = hashlib.sha256(tokenizer.read_bytes()).hexdigest() if tokenizer.exists() else None
    if got != want:
        raise ValueError(f"--target-init {path}: its tokenizer.json (sha256 {got}) is not "
                         f"the corpus's ({want}): build the corpus with --tokenizer {path}")
    init = DeepseekV3ForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    model.load_state_dict(init.state_dict(), strict=True)


def run_target(args, out, results, device, tok, splits, summary) -> None:
    tc, _ = train_configs(args)
    seed_everything(args.seed)
    cfg = configs.target_config(len(tok), tok.eos_token_id, tiny=args.tiny)
    model = DeepseekV3ForCausalLM(cfg)
    if args.target_init:
        init_target(model, Path(args.target_init), summary["corpus"]["tokenizer"])
        print(f"[target] initialised from {args.target_init}")
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"[target] DeepseekV3ForCausalLM {n_params / 1e6:.2f} M params, "
        f"batch {tc.batch_size} x {tc.seq_len}, device {device}"
    )
    answers = None
    if tc.valid_slack is not None:
        def ids(text):
            return tok(text, add_special_tokens=False)["input_ids"]

        answers = AnswerSet.from_pairs(
            [(ids(prompt), ids(answer)) for _, prompt, answer in selection_docs()],
            tok.eos_token_id)
    anchor_tokens = load_code_train(args.data) if tc.anchor_weight else None
    log = train_target(model, splits["train"], splits["valid"], tc, device,
                       progress=not args.no_progress, answers=answers,
                       anchor_tokens=anchor_tokens)
    planned = "fixed" if tc.steps is not None else "from time budget"
    print(
        f"[target] {log.total_steps} steps ({planned}) in {log.seconds:.1f} s, "
        f"{log.extra['train_epochs']:.2f} epochs, final train loss {log.final_loss():.4f}, "
        f"kept step {log.extra['kept_step']} (validation loss {log.extra['kept_eval_loss']}"
        + (f", answer loss {log.extra['kept_answer_loss']} of "
           f"{[round(x, 3) for x in log.extra['answer_losses']]} at validation losses "
           f"{[round(x, 3) for x in log.eval_losses]}, at {tc.slack_seq_len}-token windows "
           f"{[round(x, 3) for x in log.extra['slack_eval_losses']]})"
           if answers is not None else ")")
        + (f", KL to the start on code {[round(x, 4) for x in log.extra['anchor_kls']]}"
           if log.extra.get("anchor_kls") else "")
        + ("  [stopped by the clock]" if log.stopped_by_clock else "")
    )
    size = save_checkpoint(model, out / "target", Path(args.data) / TOKENIZER_SUBDIR)
    print(f"[target] saved {out / 'target'} ({size / 1e6:.2f} MB)")
    plot_losses(results / "train_target_loss.png", log, "target (DeepseekV3 MLA) LM loss")
    summary["target"] = {
        "params": n_params,
        "init": args.target_init,
        "train_config": {k: v for k, v in vars(tc).items()},
        "log": log.to_dict(),
        "reproduce_with": f"--target-steps {log.total_steps} --target-batch {tc.batch_size}",
    }


def load_frozen_target(out: Path, device: torch.device):
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target = DeepseekV3ForCausalLM.from_pretrained(str(out / "target"), dtype=dtype)
    return target.to(device).eval()


def pool_engine(choice: str, device: torch.device) -> str:
    """``vllm`` or ``hf``: who decodes the greedy pool (``auto``: vLLM on CUDA)."""
    if choice == "auto":
        return "vllm" if device.type == "cuda" else "hf"
    return choice


def greedy_pools(args, target, out, splits, layer_ids, dc, device):
    """(train pool, valid pool, engine name). ``--pool-engine auto`` tries vLLM on CUDA
    and falls back to transformers, loudly, when vLLM fails; ``vllm`` raises."""
    engine = pool_engine(args.pool_engine, device)
    if engine == "vllm":
        torch.cuda.empty_cache()  # vLLM's child asks for a share of the free memory
        # FA-MLA: the backend the end-to-end runs serve this target with.
        backend = "FLASH_ATTN_MLA" if device.type == "cuda" else None
        try:
            pool, eval_pool = build_pools_vllm(
                target, out / "target",
                [PoolRequest(splits["train"], dc.gen_sequences, args.seed + 1),
                 PoolRequest(splits["valid"], dc.eval_sequences, args.seed + 2)],
                layer_ids, dc, device, attention_backend=backend)
            return pool, eval_pool, engine
        except RuntimeError as err:
            if args.pool_engine != "auto":
                raise
            print(f"[drafter] WARNING: the vLLM greedy pool failed, decoding with "
                  f"transformers instead (slow; --gen-minutes applies):\n{err}")
            engine = "hf"
    decode = None
    if engine == "static":
        decode = StaticGreedyDecoder(target, dc.gen_batch, dc.seq_len)
        # A wrong step would fill the pool with text the target never writes: compare
        # a few rows with transformers' decoding first.
        plen = min(64, dc.seq_len // 2)
        new = min(32, dc.seq_len - plen)
        sample = torch.as_tensor(np.asarray(splits["train"][:4 * plen], dtype=np.int64))
        agree = decode.agreement(sample.view(4, plen).to(device), new)
        print(f"[drafter] static decoder agrees with transformers' greedy on "
              f"{100 * agree:.0f} % of {new} tokens (4 rows)")
        if agree < 0.5:
            raise RuntimeError(f"the static decoder parts from transformers' greedy "
                               f"decoding after {100 * agree:.0f} % of the tokens: use "
                               "--pool-engine vllm or hf")
    pools = [
        build_pool(target, splits[split], num, layer_ids, dc, seed=args.seed + offset,
                   device=device, progress=not args.no_progress,
                   desc=f"greedy pool ({split})", max_seconds=max_seconds, decode=decode)
        for split, num, offset, max_seconds in (
            ("train", dc.gen_sequences, 1,
             None if dc.gen_minutes is None else 60 * dc.gen_minutes),
            ("valid", dc.eval_sequences, 2, None))
    ]
    return pools[0], pools[1], engine


def cached_greedy_pools(args, target, out, splits, layer_ids, dc, device, corpus_sha):
    """:func:`greedy_pools`, through ``--pool-cache`` when given: pools saved by an
    earlier run for the same target, corpus and pool settings are loaded (engine
    ``cache (<engine>)``), others are decoded and saved there."""
    if not args.pool_cache:
        return greedy_pools(args, target, out, splits, layer_ids, dc, device)
    description = pool_description(out / "target", corpus_sha, dc, args.seed)
    loaded = load_pools(args.pool_cache, description, target, layer_ids, dc, device)
    if loaded is not None:
        pools, engine = loaded
        return pools["train"], pools["valid"], f"cache ({engine})"
    pool, eval_pool, engine = greedy_pools(args, target, out, splits, layer_ids, dc, device)
    path = save_pools(args.pool_cache, {"train": pool, "valid": eval_pool}, description,
                      engine)
    print(f"[drafter] saved the greedy pools to {path}")
    return pool, eval_pool, engine


def drafter_pools(args, out, device, tok, splits, summary):
    """The frozen target, the drafter config, its target layer ids, the train and valid
    pools (see :func:`cached_greedy_pools`), the engine name and the pools' seconds."""
    _, dc = train_configs(args)
    target = load_frozen_target(out, device)
    ids = None
    if args.target_layer_ids:
        ids = tuple(int(i) for i in args.target_layer_ids.split(","))
    dcfg = configs.drafter_config(
        target.config, tok.mask_token_id, tiny=args.tiny, target_layer_ids=ids
    )
    layer_ids = dcfg.dflash_config["target_layer_ids"]
    corpus_sha = {k: v["npy_sha256"] for k, v in summary["corpus"]["splits"].items()}
    t0 = time.perf_counter()
    pool, eval_pool, engine = cached_greedy_pools(args, target, out, splits, layer_ids, dc,
                                                  device, corpus_sha)
    gen_s = time.perf_counter() - t0
    print(
        f"[drafter] greedy pools ({engine}): {len(pool)} train + {len(eval_pool)} valid "
        f"sequences of {dc.seq_len} tokens in {gen_s:.1f} s"
    )
    return target, dc, dcfg, layer_ids, pool, eval_pool, engine, gen_s


DRAFTER_INIT_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads",
                       "num_key_value_heads", "intermediate_size", "vocab_size",
                       "block_size", "layer_types", "sliding_window", "dflash_config")


def init_from_checkpoint(drafter, path: Path) -> None:
    """Load ``path``'s drafter weights into ``drafter`` (same architecture). Raises
    ValueError naming the first config field that differs."""
    check_init_config(drafter.config, path)
    init = DFlashDraftModel.from_pretrained(str(path), dtype=torch.float32)
    drafter.load_state_dict(init.state_dict(), strict=True)


def check_init_fields(flag: str, path: Path, config, fields: tuple[str, ...],
                      what: str, hint: str = "") -> None:
    """ValueError naming ``flag``, the first of ``fields`` in which ``path``'s
    config.json differs from ``config`` (the ``what`` being trained) and both values,
    then ``hint``. A drafter's ``dflash_config`` compares its target layers and mask
    token only."""
    config_path = path / "config.json"
    if not config_path.exists():
        raise ValueError(f"{flag} {path}: no config.json there")
    saved = json.loads(config_path.read_text())
    for field in fields:
        want = getattr(config, field, None)
        if field == "dflash_config":
            want = {k: want.get(k) for k in ("target_layer_ids", "mask_token_id")}
            got = {k: (saved.get(field) or {}).get(k) for k in want}
        else:
            got = saved.get(field)
        if got != want:
            raise ValueError(f"{flag} {path}: {field} is {got!r}, the {what} being trained "
                             f"has {want!r}{hint}")


def check_init_config(config, path: Path) -> None:
    """ValueError naming the first ``DRAFTER_INIT_FIELDS`` entry in which ``path``'s
    config differs from ``config`` (the drafter being trained)."""
    check_init_fields("--drafter-init", path, config, DRAFTER_INIT_FIELDS, "drafter",
                      "; pass a drafter of this shape (or --target-layer-ids to match it)")


def refit_selector(drafter, target, pool, eval_pool, dc, seed: int, no_progress: bool):
    """--selector-only: ``drafter``'s frozen blocks of both pools, then its selector
    trained on them (:mod:`vllm_ddtree.training.train_selector`); returns the log."""
    t0 = time.perf_counter()
    blocks = frozen_selector_blocks(drafter, target, pool, dc.anchors_per_seq, dc, seed + 4,
                                    progress=not no_progress, desc="frozen blocks (train)")
    eval_blocks = frozen_selector_blocks(drafter, target, eval_pool, dc.eval_anchors_per_seq,
                                         dc, 1234, progress=False)
    print(f"[drafter] frozen drafter blocks: {len(blocks)} train + {len(eval_blocks)} valid, "
          f"{dc.selector_candidates} candidates a depth, in {time.perf_counter() - t0:.1f} s")
    return train_selector(drafter, blocks, eval_blocks, dc, progress=not no_progress)


def run_drafter(args, out, results, device, tok, splits, summary) -> None:
    target, dc, dcfg, layer_ids, pool, eval_pool, engine, gen_s = drafter_pools(
        args, out, device, tok, splits, summary)
    num_greedy = len(pool)
    if dc.text_sequences:
        pool = concat_pools(pool, text_pool(target, splits["train"], dc.text_sequences,
                                            layer_ids, dc, args.seed + 3, device))
        print(f"[drafter] + {dc.text_sequences} corpus-text rows: train pool {len(pool)}")
    seed_everything(args.seed)
    if args.selector_only:
        # The whole DFlash2 drafter from --drafter-init; only its selector trains.
        check_init_config(dcfg, Path(args.drafter_init))
        drafter = DFlash2DraftModel.from_pretrained(args.drafter_init, dtype=torch.float32)
        print(f"[drafter] {args.drafter_init}: refitting its candidate selector only")
    else:
        drafter = DFlashDraftModel(dcfg)
        if args.drafter_init:
            init_from_checkpoint(drafter, Path(args.drafter_init))
            print(f"[drafter] initialised from {args.drafter_init}")
        if args.drafter_kind == "dflash2":
            drafter = DFlash2DraftModel.from_dflash(drafter, seed=args.seed)
    n_params = sum(p.numel() for p in drafter.parameters())
    print(
        f"[drafter] {type(drafter).__name__} {n_params / 1e6:.2f} M params, block "
        f"{drafter.block_size}, target_layer_ids {layer_ids}, batch {dc.batch_size} seqs x "
        f"{dc.anchors_per_seq} anchors"
    )
    drafter.to(device)
    planned = "fixed" if dc.steps is not None else "from time budget"
    if args.selector_only:
        log = refit_selector(drafter, target, pool, eval_pool, dc, args.seed, args.no_progress)
        init, final = log.extra["eval_init"], log.extra.get("eval_kept") or log.extra["eval_last"]
        print(
            f"[drafter] selector: {log.total_steps} steps ({planned}) in {log.seconds:.1f} s, "
            f"final train loss {log.final_loss():.4f}; kept step {log.extra['kept_step']}: "
            f"validation cross-entropy over {dc.selector_candidates} candidates "
            f"{final['loss']:.4f} (init {init['loss']:.4f}), teacher-forced selector tau "
            f"{final['sel_tau']:.3f} (init {init['sel_tau']:.3f}), top-1 {final['sel_acc']:.4f} "
            f"(init {init['sel_acc']:.4f})"
            + ("  [stopped by the clock]" if log.stopped_by_clock else "")
        )
    else:
        init = evaluate_drafter(drafter, target, eval_pool, dc)
        log = train_drafter(drafter, target, pool, eval_pool, dc, progress=not args.no_progress)
        final = log.extra.get("eval_kept") or log.extra.get("eval_last", {})
        print(
            f"[drafter] {log.total_steps} steps ({planned}) in {log.seconds:.1f} s, final train "
            f"loss {log.final_loss():.4f}; kept step {log.extra['kept_step']}: validation loss "
            f"{final.get('loss', float('nan')):.4f} (init {init['loss']:.4f}), validation chain "
            f"tau {final.get('tau', float('nan')):.3f}"
            + ("  [stopped by the clock]" if log.stopped_by_clock else "")
        )
        print(f"[drafter] validation top-1 accuracy by depth: {final.get('acc_by_depth')}")
    size = save_checkpoint(drafter, out / "drafter", Path(args.data) / TOKENIZER_SUBDIR)
    print(f"[drafter] saved {out / 'drafter'} ({size / 1e6:.2f} MB)")
    plot_losses(
        results / "train_drafter_loss.png",
        log,
        "DFlash2 selector loss (teacher forced)" if args.selector_only
        else "DFlash drafter loss (depth-weighted)",
        extra_axis="eval_tau",
    )
    summary["drafter"] = {
        "kind": args.drafter_kind,
        "params": n_params,
        "config": {
            "target_layer_ids": layer_ids,
            "block_size": drafter.block_size,
            "mask_token_id": drafter.mask_token_id,
            "layer_types": dcfg.layer_types,
            "sliding_window": dcfg.sliding_window,
        },
        "train_config": {k: v for k, v in vars(dc).items()},
        "greedy_pool_seconds": round(gen_s, 2),
        "greedy_pool_engine": engine,
        "init_eval": init,
        "log": log.to_dict(),
        "reproduce_with": (
            f"--drafter-steps {log.total_steps} --gen-sequences {num_greedy} --gen-minutes 0"
            + (f" --text-sequences {dc.text_sequences}" if dc.text_sequences else "")
        ),
    }


def run_report(args, out, device, tok, splits, summary, with_drafter: bool = True) -> None:
    # Shipped weights (bf16 on disk), fp32 compute.
    target = DeepseekV3ForCausalLM.from_pretrained(str(out / "target"), dtype=torch.float32)
    target = target.to(device).eval()
    windows = (64,) if args.tiny else (512, args.target_seq_len)
    summary["perplexity"] = {}
    for seq_len in dict.fromkeys(windows):
        for name in ("heldout", "valid"):
            nll, count = evaluate_nll(target, splits[name], seq_len, device=device, amp=False)
            print(
                f"[report] {name} perplexity (checkpoint, fp32 compute, {count} tokens in "
                f"{seq_len}-token windows): {perplexity(nll):.3f}  (nll {nll:.4f} nats/token)"
            )
            key = name if seq_len == windows[0] else f"{name}_{seq_len}"
            summary["perplexity"][key] = {
                "nll": nll,
                "perplexity": perplexity(nll),
                "tokens": count,
                "window": seq_len,
            }
    heldout = splits["heldout"]
    completions = []
    for prompt in SANITY_PROMPTS:
        ids = torch.tensor([tok.encode(prompt)], device=device)
        seq = greedy_continue(target, ids, 24 if args.tiny else 80)
        text = tok.decode(seq[0, ids.shape[1] :].tolist())
        completions.append({"prompt": prompt, "completion": text})
        print(f"[report] greedy completion of {prompt!r}:\n{prompt}{text}\n" + "-" * 60)
    summary["sanity_completions"] = completions
    drafter_dir = out / "drafter"
    if with_drafter and drafter_dir.exists():
        drafter = load_drafter(drafter_dir, torch.float32, device)
        n_prompts = args.accept_prompts or (2 if args.tiny else 4)
        new = args.accept_new_tokens or (24 if args.tiny else 128)
        # Short prompts, and prompts as long as the 1k-context benchmarks'.
        for length in (32,) if args.tiny else (128, 1024):
            prompts = heldout_prompts(heldout, tok.eos_token_id, n_prompts, length)
            t0 = time.perf_counter()
            try:
                acc = acceptance_estimate(target, drafter, prompts, new)
            except Exception as exc:  # the reference engine's home is the CPU
                print(f"[report] reference engine failed on {device} ({exc!r}); retrying on CPU")
                acc = acceptance_estimate(target.cpu(), drafter.cpu(), prompts, new)
                acc["device"] = "cpu (fallback)"
            acc["prompt_tokens"] = length
            print(
                f"[report] reference engine on {len(prompts)} held-out prompts of {length} "
                f"tokens x {new} new ({time.perf_counter() - t0:.1f} s):"
            )
            for key in ("dflash", "ddtree_b32"):
                r = acc[key]
                print(
                    f"[report]   {key:11s} mean committed/round "
                    f"{r['mean_committed_per_round']:.3f}  rounds {r['rounds']}  "
                    f"tokens == AR: {r['tokens_equal_ar']}"
                )
            summary["acceptance" if length <= 128 else f"acceptance_{length}"] = acc
    sizes = {d.name: dir_size(d) for d in (out / "target", out / "drafter") if d.exists()}
    total = sum(sizes.values())
    summary["checkpoint_bytes"] = {**sizes, "total": total}
    flag = "OK" if total <= SIZE_LIMIT_BYTES else "OVER THE 24 MB LIMIT"
    print(f"[report] checkpoint sizes: {sizes}, total {total / 1e6:.2f} MB ({flag})")


def pack(out: Path, results: Path, dest: Path) -> None:
    """Tar ``out/target``, ``out/drafter`` and ``results`` into ``dest`` (3 files,
    each under 16 MiB for the full-size pair)."""
    dest.mkdir(parents=True, exist_ok=True)
    for name, src in (
        ("target", out / "target"),
        ("drafter", out / "drafter"),
        ("results", results),
    ):
        if src.exists():
            tar_path = dest / f"{name}.tar"
            with tarfile.open(tar_path, "w") as tar:
                tar.add(src, arcname=name)
            print(f"packed {src} -> {tar_path} ({tar_path.stat().st_size / 2**20:.2f} MiB)")


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type != "cuda" and not (args.tiny or args.selector_only):
        sys.exit("full-size training needs CUDA; use --tiny for a CPU smoke run (a "
                 "--selector-only refit runs on the CPU)")
    out = Path(args.out)
    results = (
        Path(args.results)
        if args.results
        else (out / "results" if args.tiny else REPO / "evals" / "results")
    )
    results.mkdir(parents=True, exist_ok=True)
    data = Path(args.data)
    manifest = json.loads((data / "manifest.json").read_text())
    tok = load_tokenizer(data / TOKENIZER_SUBDIR)
    splits = {name: load_split(data, name) for name in SPLITS}
    summary_path = results / "train_pair.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    summary.update(
        {
            "command": " ".join(sys.argv),
            "tiny": args.tiny,
            "seed": args.seed,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "versions": {
                "python": platform.python_version(),
                "torch": torch.__version__,
                "transformers": transformers.__version__,
            },
            "corpus": {
                "python_version": manifest["python_version"],
                "splits": {
                    k: {f: v[f] for f in ("files", "bytes", "tokens", "npy_sha256")}
                    for k, v in manifest["splits"].items()
                },
                "tokenizer": manifest["tokenizer"],
            },
        }
    )
    print(
        f"corpus: stdlib of Python {manifest['python_version'].split()[0]}: "
        + ", ".join(f"{k} {len(v):,}" for k, v in splits.items())
        + f" tokens; vocab {len(tok)}"
    )
    t0 = time.perf_counter()
    if args.stage in ("all", "target"):
        run_target(args, out, results, device, tok, splits, summary)
    if args.stage == "pool":
        if not args.pool_cache:
            sys.exit("--stage pool saves the greedy pools: pass --pool-cache <dir>")
        drafter_pools(args, out, device, tok, splits, summary)
        return
    if args.stage in ("all", "drafter"):
        run_drafter(args, out, results, device, tok, splits, summary)
    # After `--stage target` a drafter in <out> belongs to an older target: no acceptance.
    run_report(args, out, device, tok, splits, summary, with_drafter=args.stage != "target")
    summary["wall_seconds_last_run"] = round(time.perf_counter() - t0, 1)
    summary_path.write_text(json.dumps(summary, indent=1, default=str) + "\n")
    print(f"wrote {summary_path} (wall {summary['wall_seconds_last_run']} s)")
    if args.pack:
        pack(out, results, Path(args.pack))


if __name__ == "__main__":
    main()
