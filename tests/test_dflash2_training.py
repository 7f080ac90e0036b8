"""DFlash2 training path (CPU, tiny): the batched training forward equals the reference
drafter block by block, a DFlash2 drafter made from a DFlash one starts as it, the
selector loss equals a per-depth construction at any candidate count, training lowers
the DFlash and the selector losses; the selector refit's frozen blocks give the training
forward's selector loss and the refit changes only the selector; train_pair writes a
DFlash2 drafter and refits only its selector with --selector-only."""

import json
import math

import pytest
import torch
from evals_scripts import load_evals_script
from safetensors.torch import load_file
from training_testing import (
    VOCAB,
    anchor_contexts,
    tiny_corpus,
    tiny_drafter,
    tiny_target,
)

from vllm_ddtree.reference import generate
from vllm_ddtree.reference.dflash2 import DFlash2DraftModel
from vllm_ddtree.training.common import load_drafter, save_checkpoint
from vllm_ddtree.training.drafter_forward import drafter_block_outputs, target_aux_hidden
from vllm_ddtree.training.selector_loss import selector_cross_entropy, selector_loss
from vllm_ddtree.training.train_drafter import (
    DrafterTrainConfig,
    batch_loss,
    block_labels,
    build_pool,
    evaluate_drafter,
    sample_anchors,
    train_drafter,
)
from vllm_ddtree.training.train_selector import frozen_selector_blocks, train_selector


def tiny_dflash2(target, perturb: float = 0.2) -> DFlash2DraftModel:
    drafter = DFlash2DraftModel.from_dflash(tiny_drafter(target), conv_kernel_size=3,
                                            selector_top_k=6, selector_rank=8)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():  # move the new parts off their starting point
        for name, p in drafter.named_parameters():
            if "conv" in name or "selector" in name:
                p.add_(torch.randn(p.shape, generator=g) * perturb)
    return drafter.eval()


def test_training_forward_equals_the_reference_blocks():
    target = tiny_target()
    drafter = tiny_dflash2(target)
    tokens = torch.randint(2, VOCAB, (2, 40), generator=torch.Generator().manual_seed(3))
    aux = target_aux_hidden(target, tokens, drafter.target_layer_ids)
    anchors = torch.tensor([[0, 5, 17, 30], [1, 13, 20, 31]])
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    with torch.no_grad():
        hidden, logits = drafter_block_outputs(drafter, tokens, aux, anchors, embed, head)
        for b, n, a, ctx in anchor_contexts(drafter, aux, anchors):
            block = drafter.draft_block(int(tokens[b, a]), a, ctx, embed, head)
            torch.testing.assert_close(logits[b, n], block.logits, rtol=1e-4, atol=5e-5)
            want = drafter.block_hidden(int(tokens[b, a]), a, ctx, embed)[1:]
            torch.testing.assert_close(hidden[b, n], want, rtol=1e-4, atol=5e-5)


def test_a_dflash2_drafter_made_from_dflash_starts_as_it():
    target = tiny_target()
    dflash = tiny_drafter(target)
    dflash2 = DFlash2DraftModel.from_dflash(dflash, selector_top_k=4, selector_rank=8).eval()
    prompt = [5, 17, 33, 2, 60, 41, 9, 12]
    a = generate(target, dflash, prompt, 20, "ddtree", budget=16)
    b = generate(target, dflash2, prompt, 20, "ddtree", budget=16, draft_scores="marginals")
    assert a.tokens == b.tokens and [s.committed for s in a.stats] == [
        s.committed for s in b.stats]
    # Its edge term starts at 0: the selector's scores are the unary terms.
    ctx = dflash2.new_context_cache()
    from vllm_ddtree.reference.target import TargetRunner

    runner = TargetRunner(target, dflash2.target_layer_ids)
    with torch.no_grad():
        _, aux = runner.forward(torch.tensor(prompt), torch.arange(len(prompt)), None)
        ctx.append(aux, torch.arange(len(prompt)))
        block = dflash2.draft_block(7, len(prompt), ctx, runner.embed, runner.lm_head_logits)
    runner.close()
    assert torch.equal(block.edge_scores, block.unary[:, None, :].expand_as(block.edge_scores))


def _selector_ce_by_hand(drafter, hidden, logits, anchor_ids, labels, k):
    """Mean over covered depths of -log softmax(score)[truth], one depth at a time:
    score = unary + <successor[c], predecessor[p] * W h> over the k best tokens."""
    sel = drafter.candidate_selector
    total, count = 0.0, 0
    for b in range(labels.shape[0]):
        for n in range(labels.shape[1]):
            for d in range(labels.shape[2]):
                order = sorted(range(logits.shape[-1]),
                               key=lambda t: (-float(logits[b, n, d, t]), t))[:k]
                truth = int(labels[b, n, d])
                if truth not in order:
                    continue
                prev = int(anchor_ids[b, n]) if d == 0 else int(labels[b, n, d - 1])
                gate = sel.hidden_projection(hidden[b, n, d]).double()
                scores = [float(logits[b, n, d, c]) + float(
                    (sel.successor_codebook[c].double()
                     * sel.predecessor_codebook[prev].double() * gate).sum())
                    for c in order]
                top = max(scores)
                log_z = top + math.log(sum(math.exp(x - top) for x in scores))
                total += log_z - scores[order.index(truth)]
                count += 1
    return total / count, count


@pytest.mark.parametrize("num_candidates", [None, 3, 20])
def test_selector_loss_equals_a_per_depth_construction(num_candidates):
    target = tiny_target()
    drafter = tiny_dflash2(target)
    g = torch.Generator().manual_seed(11)
    hidden = torch.randn(2, 3, drafter.block_size - 1, drafter.config.hidden_size, generator=g)
    logits = torch.randn(2, 3, drafter.block_size - 1, VOCAB, generator=g) * 3
    labels = torch.randint(2, VOCAB, (2, 3, drafter.block_size - 1), generator=g)
    # Make about half of the truths a top-3 token, so every count covers some depths.
    top = logits.topk(3, dim=-1).indices[..., 1]
    pick = torch.rand(labels.shape, generator=g) < 0.5
    labels = torch.where(pick, top, labels)
    anchor_ids = torch.randint(2, VOCAB, (2, 3), generator=g)
    with torch.no_grad():
        loss, stats = selector_loss(drafter, hidden, logits, anchor_ids, labels, num_candidates)
        want, covered = _selector_ce_by_hand(drafter, hidden, logits, anchor_ids, labels,
                                             num_candidates or drafter.selector_top_k)
    assert abs(float(loss) - want) < 1e-4 * max(1.0, want)
    assert abs(float(stats["sel_cover"]) - covered / labels.numel()) < 1e-6


@pytest.mark.parametrize("bad", [0, VOCAB + 1, 2.5, True])
def test_selector_loss_refuses_a_bad_candidate_count(bad):
    target = tiny_target()
    drafter = tiny_dflash2(target)
    shape = (1, 1, drafter.block_size - 1)
    with pytest.raises(ValueError, match="num_candidates"):
        selector_loss(drafter, torch.zeros(*shape, drafter.config.hidden_size),
                      torch.zeros(*shape, VOCAB), torch.zeros(1, 1, dtype=torch.int64),
                      torch.zeros(shape, dtype=torch.int64), bad)


def test_training_lowers_both_losses():
    target = tiny_target()
    drafter = tiny_dflash2(target, perturb=0.02)
    cfg = DrafterTrainConfig(seq_len=48, prefix_min=8, prefix_max=16, gen_batch=16,
                             batch_size=8, anchors_per_seq=8, eval_anchors_per_seq=8, lr=3e-3,
                             warmup_steps=3, steps=30, eval_every=1000, seed=0)
    corpus_tokens = torch.randint(2, VOCAB, (4000,), generator=torch.Generator().manual_seed(0))
    pool = build_pool(target, corpus_tokens.numpy(), 24, drafter.target_layer_ids, cfg,
                      seed=1, device="cpu", progress=False)
    idx, anchors = torch.arange(8), torch.randint(16, 48 - drafter.block_size, (8, 8))
    with torch.no_grad():
        _, before = batch_loss(drafter, target, pool, idx, anchors.sort(1).values, 2.0)
    ev_before = evaluate_drafter(drafter, target, pool, cfg)
    log = train_drafter(drafter, target, pool, None, cfg, progress=False)
    ev_after = evaluate_drafter(drafter, target, pool, cfg)
    assert log.total_steps == 30
    assert ev_after["loss"] < 0.8 * ev_before["loss"], (ev_before, ev_after)
    with torch.no_grad():
        loss, after = batch_loss(drafter, target, pool, idx, anchors.sort(1).values, 2.0)
    assert torch.isfinite(loss)
    assert float(after["sel_acc"]) >= float(before["sel_acc"])
    assert float(after["sel_tau"]) > 1.0


def test_selector_refit_trains_on_the_frozen_blocks_and_changes_only_the_selector():
    target = tiny_target()
    drafter = tiny_dflash2(target, perturb=0.02)
    cfg = DrafterTrainConfig(seq_len=48, prefix_min=8, prefix_max=16, gen_batch=16,
                             batch_size=8, anchors_per_seq=8, eval_anchors_per_seq=4, lr=1e-2,
                             warmup_steps=3, steps=40, eval_every=10, seed=0,
                             selector_candidates=20)
    corpus_tokens = torch.randint(2, VOCAB, (4000,), generator=torch.Generator().manual_seed(0))
    pool = build_pool(target, corpus_tokens.numpy(), 24, drafter.target_layer_ids, cfg,
                      seed=1, device="cpu", progress=False)
    blocks = frozen_selector_blocks(drafter, target, pool, 8, cfg, seed=3, progress=False)
    eval_blocks = frozen_selector_blocks(drafter, target, pool, 4, cfg, seed=4, progress=False)
    assert len(blocks) == 24 * 8 and len(eval_blocks) == 24 * 4
    assert blocks.targets.candidate_ids.shape == (24 * 8, drafter.block_size - 1, 20)

    # The first sequences' blocks are the training forward's blocks at the same anchors.
    rows = torch.arange(cfg.batch_size)
    anchors = sample_anchors(pool.prefix_len[rows], cfg.seq_len, drafter.block_size, 8,
                             torch.Generator().manual_seed(3), end=pool.ends(rows))
    tokens = pool.tokens[rows]
    with torch.no_grad():
        hidden, logits = drafter_block_outputs(drafter, tokens, pool.aux[rows], anchors,
                                               target.get_input_embeddings(),
                                               target.get_output_embeddings())
        want, _ = selector_loss(drafter, hidden, logits, torch.gather(tokens, 1, anchors),
                                block_labels(tokens, anchors, drafter.block_size), 20)
        got, _ = selector_cross_entropy(drafter.candidate_selector,
                                        *blocks.take(torch.arange(cfg.batch_size * 8)))
    assert abs(float(got) - float(want)) < 1e-5 * max(1.0, float(want))

    before = {k: v.clone() for k, v in drafter.state_dict().items()}
    log = train_selector(drafter, blocks, eval_blocks, cfg, progress=False)
    after = drafter.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(k.startswith("candidate_selector.") for k in changed), changed
    assert log.total_steps == 40 and log.extra["blocks_seen"] == 40 * 64
    assert log.extra["eval_kept"]["loss"] < 0.95 * log.extra["eval_init"]["loss"], log.extra
    assert log.extra["eval_kept"]["sel_acc"] > log.extra["eval_init"]["sel_acc"]


def test_a_trained_dflash2_drafter_saves_loads_and_decodes_losslessly(tmp_path):
    target = tiny_target()
    drafter = tiny_dflash2(target)
    save_checkpoint(drafter, tmp_path / "drafter", dtype=torch.float32)
    loaded = load_drafter(tmp_path / "drafter")
    assert isinstance(loaded, DFlash2DraftModel)
    prompt = [5, 17, 33, 2, 60, 41, 9, 12]
    ar = generate(target, None, prompt, 16, "ar")
    assert generate(target, loaded, prompt, 16, "ddtree", budget=16).tokens == ar.tokens


def test_train_pair_writes_a_dflash2_drafter(tmp_path):
    data = tmp_path / "data"
    tiny_corpus(data)
    mod = load_evals_script("train_pair")
    out = tmp_path / "ckpt"
    flags = ("--tiny --no-progress --target-steps 4 --drafter-steps 4 --accept-new-tokens 8 "
             "--drafter-kind dflash2")
    mod.main([*flags.split(), "--data", str(data), "--out", str(out)])
    config = json.loads((out / "drafter" / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"]
    assert config["dflash_config"]["selector_top_k"] == 8
    summary = json.loads((out / "results" / "train_pair.json").read_text())
    assert summary["drafter"]["kind"] == "dflash2"
    for key in ("dflash", "ddtree_b32"):
        assert summary["acceptance"][key]["tokens_equal_ar"]

    # --selector-only: the same drafter refitted, only its candidate selector changes.
    init = tmp_path / "dflash2_init"
    (out / "drafter").rename(init)
    before = load_file(init / "model.safetensors")
    mod.main([*flags.split(), "--selector-only", "--drafter-init", str(init), "--stage",
              "drafter", "--data", str(data), "--out", str(out)])
    after = load_file(out / "drafter" / "model.safetensors")
    assert before.keys() == after.keys()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(k.startswith("candidate_selector.") for k in changed), changed
    summary = json.loads((out / "results" / "train_pair.json").read_text())
    assert summary["acceptance"]["ddtree_b32"]["tokens_equal_ar"]


def test_selector_only_needs_a_dflash2_init(tmp_path, capsys):
    mod = load_evals_script("train_pair")
    with pytest.raises(SystemExit):
        mod.parse_args(["--selector-only", "--drafter-kind", "dflash2"])
    assert "--selector-only refits a DFlash2 drafter's selector" in capsys.readouterr().err
