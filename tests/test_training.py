"""Training pipeline of the embedded pair: corpus, tokenizer, batched DFlash forward,
training steps, checkpoints (CPU, fp32, tiny shapes)."""

import copy
import json
import shutil

import numpy as np
import pytest
import torch
from evals_scripts import load_evals_script
from training_testing import (
    MASK_ID,
    VOCAB,
    anchor_contexts,
    tiny_corpus,
    tiny_drafter,
    tiny_target,
)
from transformers import AutoTokenizer, DeepseekV3ForCausalLM

from vllm_ddtree.drafter_config import check_drafter_target_pair
from vllm_ddtree.reference import DFlashDraftModel
from vllm_ddtree.reference.target import TargetRunner
from vllm_ddtree.training import configs, corpus
from vllm_ddtree.training.common import cosine_lr, load_drafter, save_checkpoint
from vllm_ddtree.training.drafter_forward import (
    attention_mask,
    block_labels,
    drafter_block_outputs,
    target_aux_hidden,
)
from vllm_ddtree.training.train_drafter import (
    DrafterTrainConfig,
    build_pool,
    evaluate_drafter,
    sample_anchors,
    train_drafter,
)
from vllm_ddtree.training.train_target import (
    AnswerSet,
    TargetTrainConfig,
    answer_nll,
    evaluate_nll,
    train_target,
)


@pytest.fixture(scope="module")
def stdlib_files():
    return corpus.list_stdlib_files()


# ---------------------------------------------------------------- corpus / tokenizer


def tiny_greedy_pool(num_seqs, seq_len, continuation_max, corpus_tokens=None):
    """(target, drafter, cfg, pool): a tiny target's greedy pool of ``num_seqs`` rows
    (prefixes of 8..24 corpus tokens, at most ``continuation_max`` greedy tokens)."""
    target = tiny_target()
    drafter = tiny_drafter(target)
    if corpus_tokens is None:
        corpus_tokens = torch.randint(2, VOCAB, (4000,),
                                      generator=torch.Generator().manual_seed(0))
    cfg = DrafterTrainConfig(seq_len=seq_len, prefix_min=8, prefix_max=24, gen_batch=4,
                             continuation_max=continuation_max, seed=0)
    pool = build_pool(target, corpus_tokens.numpy(), num_seqs, drafter.target_layer_ids, cfg,
                      seed=1, device="cpu", progress=False)
    return target, drafter, cfg, pool


def test_split_is_deterministic_and_disjoint(stdlib_files):
    kept, skipped = stdlib_files
    paths = list(kept)
    assert len(paths) > 100
    for p in paths:
        parts = p.split("/")
        assert not {"test", "tests", "idle_test", "site-packages"} & set(parts[:-1]), p
    splits = corpus.split_files(paths)
    train, valid, heldout = (set(splits[k]) for k in ("train", "valid", "heldout"))
    assert train.isdisjoint(heldout) and train.isdisjoint(valid) and valid.isdisjoint(heldout)
    assert train | valid | heldout == set(paths)
    for part in (valid, heldout):
        assert 0.01 < len(part) / len(paths) < 0.15
    # Same split again, and a file's side does not depend on the other files.
    assert corpus.split_files(reversed(paths)) == splits
    sub = corpus.split_files(paths[::3])
    assert all(set(sub[k]) <= set(splits[k]) for k in corpus.SPLITS)
    # The rule itself is pinned (a change would silently move files between splits).
    assert corpus.is_heldout("chunk.py") and not corpus.is_heldout("os.py")
    assert corpus.split_of("os.py") == "train"
    assert "generated (codec table)" in skipped.values()


SNIPPET = (
    'class Ünïcode:\n    """Döc — with a tab\tand   spaces."""\n\n'
    "    def f(self, x):  # comment\n        return {x: [1, 2.5e-3, 'a']}\n\n\n"
)


def test_tokenizer_round_trip(stdlib_files, tmp_path):
    kept, _ = stdlib_files
    texts = [kept[p] for p in sorted(kept)[:20]]
    tok = corpus.train_tokenizer(texts, vocab_size=512)
    assert tok.get_vocab_size() == 512
    assert tok.token_to_id(corpus.EOS_TOKEN) == 0 and tok.token_to_id(corpus.MASK_TOKEN) == 1
    corpus.save_tokenizer(tok, tmp_path)
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    ids = hf.encode(SNIPPET)
    assert hf.decode(ids) == SNIPPET
    assert 0 not in ids and 1 not in ids  # no BOS/EOS added
    assert len(ids) < len(SNIPPET.encode())  # merges were learned
    assert (hf.eos_token_id, hf.mask_token_id) == (0, 1)
    flat = corpus.tokenize_texts(tok, ["a = 1\n", "b = 2\n"], eos_id=0)
    assert flat.dtype == np.uint16
    assert (flat == 0).sum() == 2 and flat[-1] == 0
    assert hf.decode(flat[: int(np.flatnonzero(flat == 0)[0])].tolist()) == "a = 1\n"


# ---------------------------------------------------------------- batched DFlash forward


@pytest.mark.parametrize(
    "overrides",
    [{}, {"sliding_window": 4}, {"causal": True}, {"causal": False, "swa_window_size": 5}],
    ids=["default", "window<block", "all-causal", "noncausal-window"],
)
def test_training_forward_equals_reference_block_logits(overrides):
    target = tiny_target()
    drafter = tiny_drafter(target, **overrides)
    seq_len = 40
    torch.manual_seed(3)
    tokens = torch.randint(2, VOCAB, (2, seq_len))
    aux = target_aux_hidden(target, tokens, drafter.target_layer_ids)
    runner = TargetRunner(target, drafter.target_layer_ids)
    _, aux_ref = runner.forward(tokens[1], torch.arange(seq_len), None)
    runner.close()
    torch.testing.assert_close(aux[1], aux_ref, rtol=0, atol=1e-6)

    anchors = torch.tensor([[0, 5, 17, 30, 32], [1, 13, 20, 25, 31]])
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    with torch.no_grad():
        batched = drafter_block_outputs(drafter, tokens, aux, anchors, embed, head)[1]
        assert batched.shape == (2, 5, drafter.block_size - 1, VOCAB)
        for b, n, a, ctx in anchor_contexts(drafter, aux, anchors):
            ref = drafter.block_logits(int(tokens[b, a]), a, ctx, embed, head)
            torch.testing.assert_close(batched[b, n], ref, rtol=1e-5, atol=1e-5)
    # The check has teeth: a context shifted by one position changes the logits.
    with torch.no_grad():
        shifted = drafter_block_outputs(drafter, tokens, aux.roll(1, dims=1), anchors, embed,
                                        head)[1]
    assert (shifted - batched).abs().max() > 1e-3


def test_attention_mask_context_and_blocks():
    target = tiny_target()
    drafter = tiny_drafter(target)  # window 12, block 8
    sliding = drafter.layers[0].self_attn
    full = drafter.layers[1].self_attn
    anchors = torch.tensor([[3, 20]])
    m_full = attention_mask(full, anchors, 8, 30)[0]
    m_slide = attention_mask(sliding, anchors, 8, 30)[0]
    q = 8 + 2  # block 1 (anchor 20), offset 2, position 22
    assert m_full[q, :20].all() and not m_full[q, 20:30].any()
    assert m_full[q, 30 + 8 : 30 + 16].all() and not m_full[q, 30 : 30 + 8].any()
    # Sliding: causal inside the block, keys at positions > 22 - 12 only.
    assert not m_slide[q, :11].any() and m_slide[q, 11:20].all()
    assert m_slide[q, 30 + 8 : 30 + 11].all() and not m_slide[q, 30 + 11 : 30 + 16].any()


def test_anchor_sampling_and_labels():
    gen = torch.Generator().manual_seed(0)
    prefix = torch.tensor([10, 30])
    anchors = sample_anchors(prefix, 48, 8, 6, gen)
    assert anchors.shape == (2, 6)
    assert (anchors[:, 1:] > anchors[:, :-1]).all()
    assert (anchors >= prefix[:, None]).all() and (anchors <= 40).all()
    tokens = torch.arange(100).view(2, 50)
    labels = block_labels(tokens, torch.tensor([[3], [7]]), 4)
    assert labels.tolist() == [[[4, 5, 6]], [[58, 59, 60]]]
    assert cosine_lr(0, 100, 1.0, 10, 0.1) == pytest.approx(0.1)
    assert cosine_lr(100, 100, 1.0, 10, 0.1) == pytest.approx(0.1)


# ---------------------------------------------------------------- training steps


def test_target_training_reduces_loss():
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(configs.target_config(VOCAB, 0, tiny=True))
    rng = np.random.default_rng(0)
    period = rng.integers(2, VOCAB, size=24)
    data = np.tile(period, 400).astype(np.uint16)  # learnable: period-24 sequence
    before, _ = evaluate_nll(model, data, 32, max_windows=8)
    cfg = TargetTrainConfig(
        seq_len=32, batch_size=8, lr=3e-3, warmup_steps=3, steps=30, eval_every=1000, seed=0
    )
    log = train_target(model, data, None, cfg, "cpu", progress=False)
    after, _ = evaluate_nll(model, data, 32, max_windows=8)
    assert log.total_steps == 30 and len(log.losses) == 30
    assert after < 0.6 * before, (before, after)


def test_drafter_training_reduces_loss():
    target = tiny_target()
    params_before = copy.deepcopy(target.state_dict())
    drafter = tiny_drafter(target, std=0.02)
    corpus_tokens = torch.randint(2, VOCAB, (4000,), generator=torch.Generator().manual_seed(0))
    cfg = DrafterTrainConfig(
        seq_len=48,
        prefix_min=8,
        prefix_max=16,
        gen_batch=16,
        batch_size=8,
        anchors_per_seq=8,
        eval_anchors_per_seq=8,
        lr=3e-3,
        warmup_steps=3,
        steps=40,
        eval_every=1000,
        seed=0,
    )
    pool = build_pool(
        target,
        corpus_tokens.numpy(),
        32,
        drafter.target_layer_ids,
        cfg,
        seed=1,
        device="cpu",
        progress=False,
    )
    assert pool.tokens.shape == (32, 48) and pool.aux.shape[:2] == (32, 48)
    # The pool's continuation is the target's own greedy text.
    row = pool.tokens[0]
    p = int(pool.prefix_len[0])
    logits = target(input_ids=row[None]).logits[0]
    assert torch.equal(logits[p - 1 : -1].argmax(-1), row[p:])

    before = evaluate_drafter(drafter, target, pool, cfg)
    log = train_drafter(drafter, target, pool, None, cfg, progress=False)
    after = evaluate_drafter(drafter, target, pool, cfg)
    assert log.total_steps == 40
    assert after["loss"] < 0.7 * before["loss"], (before, after)
    assert after["tau"] > before["tau"]
    for key, value in target.state_dict().items():  # the target stays frozen
        assert torch.equal(value, params_before[key]), key


# ---------------------------------------------------------------- checkpoints


def test_checkpoint_round_trip(tmp_path):
    target = tiny_target()
    drafter = tiny_drafter(target)
    tok_dir = tmp_path / "tok"
    corpus.save_tokenizer(corpus.train_tokenizer(["x = 1\n" * 50], vocab_size=300), tok_dir)
    save_checkpoint(target, tmp_path / "target", tok_dir)
    save_checkpoint(drafter, tmp_path / "drafter", tok_dir)
    for d in ("target", "drafter"):
        names = {f.name for f in (tmp_path / d).iterdir()}
        assert {"config.json", "model.safetensors", "tokenizer.json"} <= names
    assert next(target.parameters()).dtype == torch.float32  # the model is not changed

    t2 = DeepseekV3ForCausalLM.from_pretrained(str(tmp_path / "target"), dtype=torch.float32)
    d2 = load_drafter(tmp_path / "drafter", torch.float32)
    raw = json.loads((tmp_path / "drafter" / "config.json").read_text())
    assert raw["architectures"] == ["DFlashDraftModel"]
    assert raw["dflash_config"] == {"target_layer_ids": [0, 1], "mask_token_id": MASK_ID}
    assert raw["dtype"] == "bfloat16" and raw["sliding_window"] == 12
    assert raw["layer_types"] == ["sliding_attention", "full_attention", "sliding_attention"]
    check_drafter_target_pair(d2.config, t2.config)
    # another checkpoint as the tokenizer's directory gives its tokenizer, not its weights
    other = tiny_target(seed=1)
    save_checkpoint(other, tmp_path / "other", tmp_path / "target")
    t3 = DeepseekV3ForCausalLM.from_pretrained(str(tmp_path / "other"), dtype=torch.float32)
    want = other.state_dict()
    for name, value in t3.state_dict().items():
        assert torch.equal(value, want[name].to(torch.bfloat16).float()), name
    assert (tmp_path / "other" / "tokenizer.json").read_bytes() == (
        tok_dir / "tokenizer.json").read_bytes()

    # Same logits as the in-memory models with their weights rounded to bf16
    # (parameters only: `.to(bf16)` would also round the RoPE buffers).
    t_ref, d_ref = copy.deepcopy(target), copy.deepcopy(drafter)
    with torch.no_grad():
        for p in [*t_ref.parameters(), *d_ref.parameters()]:
            p.copy_(p.to(torch.bfloat16).float())
    ids = torch.randint(2, VOCAB, (1, 24), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(t2(input_ids=ids).logits, t_ref(input_ids=ids).logits)
        aux = target_aux_hidden(t2, ids, d2.target_layer_ids)
        anchors = torch.tensor([[4, 12]])
        embed, head = t2.get_input_embeddings(), t2.get_output_embeddings()
        got = drafter_block_outputs(d2, ids, aux, anchors, embed, head)[1]
        want = drafter_block_outputs(d_ref, ids, aux, anchors, embed, head)[1]
    assert torch.equal(got, want)


def test_full_size_configs_fit():
    vocab = corpus.DEFAULT_VOCAB_SIZE
    tcfg = configs.target_config(vocab, 0)
    dcfg = configs.drafter_config(tcfg, 1)
    assert (tcfg.kv_lora_rank, tcfg.qk_rope_head_dim, tcfg.q_lora_rank) == (512, 64, None)
    assert tcfg.first_k_dense_replace == tcfg.num_hidden_layers and not tcfg.tie_word_embeddings
    check_drafter_target_pair(dcfg, tcfg)
    assert dcfg.sliding_window == 256 and dcfg.block_size == 16
    with torch.device("meta"):
        n_target = sum(p.numel() for p in DeepseekV3ForCausalLM(tcfg).parameters())
        n_drafter = sum(p.numel() for p in DFlashDraftModel(dcfg).parameters())
    assert 2 * (n_target + n_drafter) + 2 * 400_000 <= 24_000_000  # bf16 + tokenizer copies


# ---------------------------------------------------------------- end to end (tiny)


def test_train_pair_tiny_end_to_end(tmp_path):
    data = tmp_path / "data"
    manifest = tiny_corpus(data)
    assert all(manifest["splits"][k]["files"] > 0 for k in corpus.SPLITS)
    mod = load_evals_script("train_pair")
    out = tmp_path / "ckpt"
    flags = "--tiny --no-progress --target-steps 6 --drafter-steps 6 --accept-new-tokens 8"
    mod.main([*flags.split(), "--data", str(data), "--out", str(out)])
    summary = json.loads((out / "results" / "train_pair.json").read_text())
    assert summary["target"]["log"]["total_steps"] == 6
    assert summary["drafter"]["log"]["total_steps"] == 6
    for key in ("dflash", "ddtree_b32"):
        assert summary["acceptance"][key]["tokens_equal_ar"]
    assert (out / "results" / "train_target_loss.png").stat().st_size > 0
    assert (out / "results" / "train_drafter_loss.png").stat().st_size > 0


def test_stratified_prefix_lengths_cover_the_range():
    """A pool of few generation batches still spans short and long contexts: one draw
    per stratum, in range, in a seeded random order."""
    from vllm_ddtree.training.train_drafter import stratified_prefix_lengths

    lengths = stratified_prefix_lengths(32, 1280, 3, torch.Generator().manual_seed(0))
    strata = sorted((p - 32) * 3 // (1280 - 32 + 1) for p in lengths)
    assert strata == [0, 1, 2] and all(32 <= p <= 1280 for p in lengths)
    again = stratified_prefix_lengths(32, 1280, 3, torch.Generator().manual_seed(0))
    assert again == lengths
    many = stratified_prefix_lengths(8, 16, 40, torch.Generator().manual_seed(1))
    assert min(many) == 8 and max(many) == 16


def test_pool_with_capped_continuation_pads_and_keeps_anchors_inside():
    """``continuation_max``: each sequence is its prefix plus at most that many greedy
    tokens, EOS-padded to ``seq_len``; anchors never reach the padding (as context or
    label), and the greedy part is still the target's own argmax text."""
    from vllm_ddtree.training.train_drafter import padding_token_id, sample_anchors

    target, drafter, cfg, pool = tiny_greedy_pool(12, seq_len=64, continuation_max=20)
    ends = pool.ends()
    assert torch.equal(ends, pool.prefix_len + 20)
    eos = padding_token_id(target)
    for row, p, end in zip(pool.tokens, pool.prefix_len.tolist(), ends.tolist(), strict=True):
        assert bool((row[end:] == eos).all())
        logits = target(input_ids=row[None, :end]).logits[0]
        assert torch.equal(logits[p - 1 : -1].argmax(-1), row[p:end])
    anchors = sample_anchors(pool.prefix_len, cfg.seq_len, drafter.block_size, 3,
                             torch.Generator().manual_seed(0), end=ends)
    assert bool((anchors >= pool.prefix_len[:, None]).all())
    assert bool((anchors + drafter.block_size <= ends[:, None]).all())
    with pytest.raises(ValueError, match="anchor positions"):
        sample_anchors(pool.prefix_len, cfg.seq_len, drafter.block_size, 20,
                       torch.Generator().manual_seed(0), end=ends)


def test_corpus_extra_packages_go_to_train_only(tmp_path, monkeypatch):
    """``extra_packages`` adds an installed package's sources (its tests skipped) to the
    train split; the tokenizer and the valid / held-out splits are those of the
    standard library alone."""
    pkg = tmp_path / "site" / "ddtree_fakepkg"
    (pkg / "tests").mkdir(parents=True)
    (pkg / "__init__.py").write_text("def double(x):\n    return 2 * x\n" * 20)
    (pkg / "util.py").write_text("import os\n\nPATH = os.getcwd()\n" * 20)
    (pkg / "tests" / "test_util.py").write_text("def test_it():\n    assert True\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    kwargs = dict(vocab_size=VOCAB * 4, heldout_fraction=0.3, max_files=30, valid_fraction=0.3)
    plain = corpus.build_corpus(tmp_path / "plain", **kwargs)
    extra = corpus.build_corpus(tmp_path / "extra", extra_packages=["ddtree_fakepkg"], **kwargs)
    assert extra["extra_packages"]["ddtree_fakepkg"]["files"] == 2
    train_paths = {f["path"] for f in extra["train_files"]}
    assert {"site-packages/ddtree_fakepkg/__init__.py",
            "site-packages/ddtree_fakepkg/util.py"} <= train_paths
    assert not any("tests/" in p for p in train_paths if p.startswith("site-packages/"))
    sha = "tokenizer_json_sha256"
    assert extra["tokenizer"][sha] == plain["tokenizer"][sha]
    for name in ("valid", "heldout"):
        assert extra["splits"][name]["npy_sha256"] == plain["splits"][name]["npy_sha256"]
    assert extra["splits"]["train"]["tokens"] > plain["splits"]["train"]["tokens"]
    with pytest.raises(ValueError, match="no installed package"):
        corpus.build_corpus(tmp_path / "bad", extra_packages=["no_such_pkg_ddtree"], **kwargs)


def test_corpus_reuses_a_given_tokenizer(tmp_path):
    """``tokenizer_dir``: the corpus keeps that tokenizer byte for byte (the trainyarn
    fine-tune on a Python whose standard library trains another one) and tokenizes
    every split with it; a tokenizer without the special ids 0 / 1 is refused."""
    kwargs = dict(heldout_fraction=0.3, valid_fraction=0.3)
    first = corpus.build_corpus(tmp_path / "first", vocab_size=VOCAB * 4, max_files=12, **kwargs)
    other = corpus.build_corpus(tmp_path / "other", vocab_size=VOCAB * 4, max_files=30, **kwargs)
    reused = corpus.build_corpus(tmp_path / "reused", max_files=30,
                                 tokenizer_dir=tmp_path / "first" / "tokenizer", **kwargs)
    sha = "tokenizer_json_sha256"
    assert other["tokenizer"][sha] != first["tokenizer"][sha]  # more text, other merges
    assert reused["tokenizer"][sha] == first["tokenizer"][sha]
    assert (tmp_path / "reused/tokenizer/tokenizer.json").read_bytes() == \
        (tmp_path / "first/tokenizer/tokenizer.json").read_bytes()
    tok = corpus.load_tokenizer(tmp_path / "reused" / "tokenizer")
    assert tok.convert_tokens_to_ids([corpus.EOS_TOKEN, corpus.MASK_TOKEN]) == [0, 1]
    kept, _ = corpus.list_stdlib_files()
    kept = dict(list(kept.items())[:30])
    bpe = corpus.load_bpe_tokenizer(tmp_path / "first" / "tokenizer")
    valid_paths = [f["path"] for f in reused["valid_files"]]
    expected = corpus.tokenize_texts(bpe, (kept[p] for p in valid_paths), 0)
    np.testing.assert_array_equal(corpus.load_split(tmp_path / "reused", "valid"), expected)
    bad = tmp_path / "bad"
    bad.mkdir()
    from tokenizers import Tokenizer, models
    Tokenizer(models.BPE()).save(str(bad / "tokenizer.json"))
    with pytest.raises(ValueError, match="tokenizer_dir"):
        corpus.build_corpus(tmp_path / "x", max_files=5, tokenizer_dir=bad, **kwargs)


def test_pool_cache_round_trip_and_refuses_another_run(tmp_path):
    """Saved pools come back with the same tokens, prefix lengths and ends, and aux
    hidden states recomputed by the target equal the original ones; a description that
    differs (another target, corpus or pool setting) is refused, naming the fields."""
    from vllm_ddtree.training.pool_cache import load_pools, save_pools

    target, drafter, cfg, pool = tiny_greedy_pool(6, seq_len=48, continuation_max=12)
    description = {"target_sha256": "a", "corpus_sha256": {"train": "b"}, "seq_len": 48}
    assert load_pools(tmp_path, description, target, drafter.target_layer_ids, cfg,
                      "cpu") is None
    save_pools(tmp_path, {"train": pool}, description, engine="hf")
    pools, engine = load_pools(tmp_path, description, target, drafter.target_layer_ids,
                               cfg, "cpu")
    assert engine == "hf" and list(pools) == ["train"]
    again = pools["train"]
    assert torch.equal(again.tokens, pool.tokens)
    assert torch.equal(again.prefix_len, pool.prefix_len) and torch.equal(again.end, pool.end)
    torch.testing.assert_close(again.aux, pool.aux)
    other = {**description, "target_sha256": "c", "seq_len": 64}
    with pytest.raises(ValueError, match="seq_len, target_sha256"):
        load_pools(tmp_path, other, target, drafter.target_layer_ids, cfg, "cpu")


def test_train_pair_pool_stage_then_drafter_from_the_cache(tmp_path, capsys):
    """``--stage pool`` decodes and saves the pools only; ``--stage drafter`` with the
    same ``--pool-cache`` trains on them without decoding again (two device calls)."""
    data = tmp_path / "data"
    tiny_corpus(data)
    mod = load_evals_script("train_pair")
    out, cache = tmp_path / "ckpt", tmp_path / "pool"
    flags = ["--tiny", "--no-progress", "--target-steps", "4", "--drafter-steps", "4",
             "--accept-new-tokens", "8", "--data", str(data), "--out", str(out)]
    with pytest.raises(SystemExit, match="--pool-cache"):
        mod.main([*flags, "--stage", "pool"])
    mod.main([*flags, "--stage", "target"])
    capsys.readouterr()
    mod.main([*flags, "--stage", "pool", "--pool-cache", str(cache), "--pool-engine",
              "static"])
    printed = capsys.readouterr().out
    assert "saved the greedy pools" in printed and "greedy pools (static)" in printed
    assert "static decoder agrees with transformers' greedy on 100 %" in printed
    assert (cache / "pools.npz").exists() and not (out / "drafter").exists()
    mod.main([*flags, "--stage", "drafter", "--pool-cache", str(cache),
              "--text-sequences", "3"])
    printed = capsys.readouterr().out
    assert "greedy pools (cache (static))" in printed and "saved the greedy pools" not in printed
    assert "+ 3 corpus-text rows" in printed
    summary = json.loads((out / "results" / "train_pair.json").read_text())
    assert summary["drafter"]["greedy_pool_engine"] == "cache (static)"
    assert summary["drafter"]["log"]["total_steps"] == 4
    gen = summary["drafter"]["train_config"]["gen_sequences"]
    assert summary["drafter"]["reproduce_with"].endswith(
        f"--gen-sequences {gen} --gen-minutes 0 --text-sequences 3")
    # A pool setting that differs is refused, not silently reused.
    with pytest.raises(ValueError, match="gen_sequences"):
        mod.main([*flags, "--stage", "drafter", "--pool-cache", str(cache),
                  "--gen-sequences", "5"])
    # So is another decoding batch (one corpus prefix length per batch).
    with pytest.raises(ValueError, match="gen_batch"):
        mod.main([*flags, "--stage", "drafter", "--pool-cache", str(cache),
                  "--gen-batch", "5"])
    # --drafter-init: the next drafter starts from the saved one (fine-tuning), so its
    # first evaluation is the saved drafter's kept evaluation, not a random model's.
    first = summary["drafter"]
    saved = tmp_path / "first_drafter"
    __import__("shutil").copytree(out / "drafter", saved)
    mod.main([*flags, "--stage", "drafter", "--pool-cache", str(cache),
              "--text-sequences", "3", "--drafter-init", str(saved)])
    assert f"initialised from {saved}" in capsys.readouterr().out
    again = json.loads((out / "results" / "train_pair.json").read_text())["drafter"]
    kept = first["log"].get("eval_kept") or first["log"]["eval_last"]
    assert again["init_eval"]["loss"] == pytest.approx(kept["loss"], rel=1e-3)
    assert again["init_eval"]["loss"] < first["init_eval"]["loss"]
    other = DFlashDraftModel.from_pretrained(str(saved))
    other.config.block_size = other.config.block_size * 2
    with pytest.raises(ValueError, match="block_size"):
        mod.init_from_checkpoint(DFlashDraftModel(other.config), saved)


def test_text_pool_rows_are_corpus_text_and_join_the_greedy_pool():
    """``text_pool``: each row is a contiguous corpus slice (prefix + the next tokens up to
    ``continuation_max``), EOS-padded, with the target's aux hidden states; anchors stay
    inside the text; ``concat_pools`` stacks it under a greedy pool."""
    from vllm_ddtree.training.drafter_forward import target_aux_hidden
    from vllm_ddtree.training.train_drafter import (
        concat_pools,
        padding_token_id,
        sample_anchors,
        text_pool,
    )

    corpus_tokens = torch.arange(5000) % (VOCAB - 2) + 2  # every slice is recognisable
    target, drafter, cfg, greedy = tiny_greedy_pool(3, seq_len=48, continuation_max=12,
                                                    corpus_tokens=corpus_tokens)
    text = text_pool(target, corpus_tokens.numpy(), 5, drafter.target_layer_ids, cfg,
                     seed=3, device="cpu")
    assert torch.equal(text.end, text.prefix_len + 12)
    eos = padding_token_id(target)
    for row, end in zip(text.tokens, text.end.tolist(), strict=True):
        step = (row[1:end] - row[:end - 1]) % (VOCAB - 2)
        assert bool((step == 1).all()) and bool((row[end:] == eos).all())
    torch.testing.assert_close(text.aux, target_aux_hidden(target, text.tokens,
                                                          drafter.target_layer_ids))
    both = concat_pools(greedy, text)
    assert len(both) == 8 and torch.equal(both.tokens[3:], text.tokens)
    assert torch.equal(both.ends()[:3], greedy.ends())
    anchors = sample_anchors(both.prefix_len, cfg.seq_len, drafter.block_size, 2,
                             torch.Generator().manual_seed(0), end=both.ends())
    assert bool((anchors + drafter.block_size <= both.ends()[:, None]).all())


def test_train_pair_target_init_starts_from_the_checkpoint(tmp_path, monkeypatch):
    """``--target-init``: the target trains from the given checkpoint's weights (the
    shipped target fine-tuned on a new mix); a checkpoint of another shape or tokenizer,
    or without a config, is refused before any training."""

    data = tmp_path / "data"
    tiny_corpus(data)
    mod = load_evals_script("train_pair")
    first = tmp_path / "first"
    flags = "--tiny --no-progress --stage target --target-steps 3".split()
    mod.main([*flags, "--data", str(data), "--out", str(first)])
    started = {}
    train_target = mod.train_target

    def recording(model, *args, **kwargs):
        started.update({k: v.detach().clone() for k, v in model.state_dict().items()})
        return train_target(model, *args, **kwargs)

    monkeypatch.setattr(mod, "train_target", recording)
    second = tmp_path / "second"
    mod.main([*flags, "--data", str(data), "--out", str(second),
              "--target-init", str(first / "target")])
    saved = DeepseekV3ForCausalLM.from_pretrained(str(first / "target"), dtype=torch.float32)
    for name, value in saved.state_dict().items():
        assert torch.equal(started[name], value), name
    summary = json.loads((second / "results" / "train_pair.json").read_text())
    assert summary["target"]["init"] == str(first / "target")
    # another tokenizer than the corpus's
    other = tmp_path / "other"
    shutil.copytree(first / "target", other)
    (other / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match="build the corpus with --tokenizer"):
        mod.main([*flags, "--data", str(data), "--out", str(tmp_path / "x"),
                  "--target-init", str(other)])
    # another shape
    config = json.loads((first / "target" / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "hidden_size": 8}))
    with pytest.raises(ValueError, match="hidden_size is 8"):
        mod.main([*flags, "--data", str(data), "--out", str(tmp_path / "x"),
                  "--target-init", str(other)])
    with pytest.raises(SystemExit):
        mod.main([*flags, "--data", str(data), "--out", str(tmp_path / "x"),
                  "--target-init", str(tmp_path / "missing")])


def test_answer_nll_scores_only_the_answer_tokens_of_each_padded_row():
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(configs.target_config(VOCAB, 0, tiny=True)).eval()
    pairs = [([5, 6, 7], [8, 9]), ([10], [11, 12, 13]), ([14, 15, 16, 17], [18])]
    answers = AnswerSet.from_pairs(pairs, pad_id=0)
    total, count = 0.0, 0
    for prompt, answer in pairs:  # one unpadded row at a time
        ids = torch.tensor([prompt + answer])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits.float(), -1)[0]
        for j, tok in enumerate(answer):
            total -= float(logp[len(prompt) - 1 + j, tok])
            count += 1
    assert answer_nll(model, answers, batch_size=2) == pytest.approx(total / count, rel=1e-5)
    with pytest.raises(ValueError, match="non-empty prompt and answer"):
        AnswerSet.from_pairs([([1], [])], pad_id=0)


def test_target_selection_on_answers_stays_within_the_validation_slack(monkeypatch):
    """Kept: the lowest answer loss among evaluations whose validation loss is within
    the slack of the starting weights'; its weights are the ones restored."""
    from vllm_ddtree.training import train_target as module

    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(configs.target_config(VOCAB, 0, tiny=True))
    data = np.tile(np.arange(2, 26), 200).astype(np.uint16)
    # evaluations at steps 0 (the start), 4, 8, 12, 16; each evaluates seq_len windows
    # (16 tokens), then the slack's 8-token windows
    valid = iter([9.0, 2.00, 8.0, 1.99, 7.0, 2.01, 6.0, 2.05, 5.0, 2.02])
    answer = iter([3.0, 2.5, 1.2, 1.0, 1.5])
    snapshots = []

    def fake_answer_nll(model, answers, **kwargs):
        snapshots.append({k: v.clone() for k, v in model.state_dict().items()})
        return next(answer)

    monkeypatch.setattr(module, "evaluate_nll", lambda *a, **k: (next(valid), 1))
    monkeypatch.setattr(module, "answer_nll", fake_answer_nll)
    cfg = TargetTrainConfig(seq_len=16, batch_size=4, lr=3e-3, warmup_steps=1, steps=16,
                            eval_every=4, valid_slack=0.03, slack_seq_len=8, seed=0)
    answers = AnswerSet.from_pairs([([1, 2], [3])], pad_id=0)
    log = train_target(model, data, data, cfg, "cpu", progress=False, answers=answers)
    assert log.eval_steps == [0, 4, 8, 12, 16]
    # step 12 answers best (1.0) but its short-window loss 2.05 is past 2.00 + 0.03
    assert log.extra["kept_step"] == 8
    assert log.extra["kept_answer_loss"] == 1.2 and log.extra["kept_eval_loss"] == 7.0
    assert log.extra["slack_eval_losses"] == [2.00, 1.99, 2.01, 2.05, 2.02]
    for name, value in model.state_dict().items():
        assert torch.equal(value, snapshots[2][name]), name
    with pytest.raises(ValueError, match="needs valid_slack and eval_tokens"):
        train_target(model, data, None, cfg, "cpu", progress=False, answers=answers)


def test_train_pair_selects_the_target_on_held_out_answers(tmp_path, capsys):
    data = tmp_path / "data"
    tiny_corpus(data)
    mod = load_evals_script("train_pair")
    mod.main(["--tiny", "--no-progress", "--stage", "target", "--target-steps", "3",
              "--target-valid-slack", "0.05", "--data", str(data),
              "--out", str(tmp_path / "out")])
    line = next(x for x in capsys.readouterr().out.splitlines() if "kept step" in x)
    assert "answer loss" in line, line
    log = json.loads((tmp_path / "out" / "results" / "train_pair.json").read_text())
    log = log["target"]["log"]
    assert len(log["answer_losses"]) == len(log["eval_losses"]) >= 2
