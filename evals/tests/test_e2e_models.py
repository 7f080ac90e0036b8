"""The end-to-end benchmark's model setups and prompts (evals/e2e_models.py), on CPU."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "evals"))
import e2e_models  # noqa: E402
import e2e_runs  # noqa: E402
from bench_e2e import parse_args  # noqa: E402

# ---------------------------------------------------------------------------------------
# Model configs


@pytest.mark.parametrize("heads", [8, 64])
def test_kimi_configs_have_the_anchor_shapes_and_pass_the_drafter_checks(heads, tmp_path):
    from transformers import AutoConfig

    from vllm_ddtree.config import check_drafter_for_target
    from vllm_ddtree.drafter_config import resolve_layer_attention

    target_dir, drafter_dir = e2e_models.write_kimi_pair(tmp_path, heads)
    assert sorted(p.name for p in target_dir.iterdir()) == ["config.json"]  # dummy load
    target = AutoConfig.from_pretrained(target_dir)
    assert target.architectures == ["DeepseekV3ForCausalLM"]
    assert (target.hidden_size, target.num_attention_heads, target.q_lora_rank,
            target.kv_lora_rank, target.qk_rope_head_dim, target.vocab_size) == (
        7168, heads, 1536, 512, 64, 163840)
    assert target.num_hidden_layers == target.first_k_dense_replace == 4  # dense only
    assert target.max_position_embeddings >= 131072 + 4096

    check_drafter_for_target(str(drafter_dir), target)
    drafter = AutoConfig.from_pretrained(drafter_dir)
    assert drafter.architectures == ["DFlashDraftModel"]
    assert (drafter.num_hidden_layers, drafter.hidden_size, drafter.num_attention_heads,
            drafter.num_key_value_heads, drafter.block_size) == (6, 7168, 64, 8, 8)
    windows = [resolve_layer_attention(drafter, i)[0] for i in range(6)]
    assert windows == [4096] * 5 + [None]
    ids = drafter.dflash_config["target_layer_ids"]
    assert len(set(ids)) == len(ids) and max(ids) < target.num_hidden_layers


def test_trained_yarn_takes_a_pair_that_is_scaled_already(tmp_path, monkeypatch):
    """A pair carried with E2E_PAIR whose target already has YaRN (a `trainyarn`
    fine-tune) is used as it is, not scaled twice."""
    from vllm_ddtree.long_context import write_rope_scaled, yarn_parameters

    pair = tmp_path / "pair"
    write_rope_scaled(e2e_models.CHECKPOINTS / "target", pair / "target", yarn_parameters())
    monkeypatch.setattr(e2e_models, "CHECKPOINTS", pair)
    paths = e2e_models.prepare_setup(e2e_models.SETUPS["trained_yarn"], tmp_path / "root")
    assert paths.target == pair / "target"


def test_prepare_setup_paths_and_positions(tmp_path):
    trained = e2e_models.prepare_setup(e2e_models.SETUPS["trained"], tmp_path)
    assert (trained.target / "config.json").exists() and trained.tokenizer_file.exists()
    assert e2e_models.read_config(trained.target)["max_position_embeddings"] == 4096
    yarn = e2e_models.prepare_setup(e2e_models.SETUPS["trained_yarn"], tmp_path)
    config = e2e_models.read_config(yarn.target)
    assert config["rope_parameters"]["rope_type"] == "yarn"
    assert config["max_position_embeddings"] == yarn.max_positions == 2048
    assert yarn.tokenizer_file.exists() and yarn.drafter == trained.drafter
    assert yarn.target != trained.target  # the embedded checkpoint is left alone
    kimi = e2e_models.prepare_setup(e2e_models.SETUPS["kimi8"], tmp_path,
                                    min_positions=300_000)
    assert kimi.max_positions == 524288 and kimi.tokenizer_file is None
    assert e2e_models.read_config(kimi.target)["max_position_embeddings"] == 524288
    assert e2e_models.read_config(kimi.drafter)["max_position_embeddings"] == 524288
    kv = e2e_models.kv_cache_bytes(e2e_models.read_config(kimi.target),
                                   e2e_models.read_config(kimi.drafter), 131072, 8)
    assert kv["target"] == 4 * 576 * 2 * 131072 * 8  # MLA latent + rope, 4 layers, bf16
    assert kv["drafter"] == 2 * 8 * 128 * 2 * (5 * 4096 + 131072) * 8  # 5 windows + 1 full


# ---------------------------------------------------------------------------------------
# Prompts


def test_random_prompts_have_exact_lengths_and_range():
    prompts = e2e_models.random_prompts(3, 777, (1000, 163584), seed=5)
    assert [len(p) for p in prompts] == [777] * 3
    assert min(min(p) for p in prompts) >= 1000 and max(max(p) for p in prompts) < 163584
    assert prompts != e2e_models.random_prompts(3, 777, (1000, 163584), seed=6)
    assert prompts == e2e_models.random_prompts(3, 777, (1000, 163584), seed=5)
    assert e2e_models.cell_seed(1024, 1) != e2e_models.cell_seed(1024, 8)


def test_code_prompts_are_disjoint_slices_of_stdlib_source():
    tokenizer = e2e_models.load_tokenizer(e2e_models.CHECKPOINTS / "target" / "tokenizer.json")
    setup = e2e_models.SETUPS["trained"]
    prompts = e2e_models.make_prompts("code", 8, 1000, setup, tokenizer)
    assert [len(p) for p in prompts] == [1000] * 8
    assert len({tuple(p) for p in prompts}) == 8
    text = tokenizer.decode(prompts[0])
    assert "argparse" in text or "import" in text
    assert [len(p) for p in e2e_models.make_prompts("random", 2, 33, setup)] == [33, 33]
    with pytest.raises(ValueError, match="tokenizer"):
        e2e_models.make_prompts("code", 1, 10, e2e_models.SETUPS["kimi8"])


def test_prompt_sets_are_the_next_disjoint_slices(capsys):
    """``code@k``: the k-th set of ``batch`` slices (``code`` = ``code@0``), so batch-1
    cells can run on several prompts; ``random@k`` another seed."""
    tokenizer = e2e_models.load_tokenizer(e2e_models.CHECKPOINTS / "target" / "tokenizer.json")
    setup = e2e_models.SETUPS["trained"]
    eight = e2e_models.code_prompts(tokenizer, 8, 300)
    assert e2e_models.make_prompts("code@0", 1, 300, setup, tokenizer) == eight[:1]
    assert e2e_models.make_prompts("code@3", 1, 300, setup, tokenizer) == eight[3:4]
    assert e2e_models.make_prompts("code@1", 2, 300, setup, tokenizer) == eight[2:4]
    first = e2e_models.make_prompts("random", 2, 40, setup, seed=5)
    assert e2e_models.make_prompts("random@0", 2, 40, setup, seed=5) == first
    assert e2e_models.make_prompts("random@1", 2, 40, setup, seed=5) != first
    assert e2e_models.parse_prompt_kind("code@12") == ("code", 12)
    for bad, why in (("prose", "unknown prompt kind"), ("code@x", "integer"),
                     ("code@-1", "integer")):
        with pytest.raises(ValueError, match=why):
            e2e_models.parse_prompt_kind(bad)
    assert parse_args(["--prompts", "code", "code@1"]).prompts == ["code", "code@1"]
    with pytest.raises(SystemExit):
        parse_args(["--prompts", "code@one"])
    assert "the set after '@' must be an integer" in capsys.readouterr().err
    kimi = e2e_models.SETUPS["kimi8"]
    _, skipped = e2e_runs.plan_cells(kimi, [1024], [1], ["code@2"], 64, 32)
    assert skipped and "no tokenizer" in skipped[0][3]


def test_code_prompts_come_from_the_python_311_snapshot(monkeypatch):
    """The ``code`` prompts read the shipped Python 3.11 text of the listed modules, so
    the device's 3.12 decodes the prompts the CPU reference engine measured; modules
    past the snapshot come from the running Python."""
    snapshot = e2e_models.code_source_snapshot()
    names = list(snapshot)
    assert names[0] == e2e_models.CODE_MODULES[0]
    assert sum(map(len, snapshot.values())) >= e2e_models.CODE_SOURCE_SNAPSHOT_CHARS
    if sys.version_info[:2] == (3, 11):
        assert snapshot[names[0]] == e2e_models.live_module_source(names[0])
    monkeypatch.setattr(e2e_models, "live_module_source", lambda name: f"# {name}\n")
    assert e2e_models.stdlib_source(1000) == snapshot[names[0]]
    total = sum(map(len, snapshot.values()))
    past = e2e_models.stdlib_source(total + 1)
    assert past == "".join(snapshot.values()) + f"# {e2e_models.CODE_MODULES[len(names)]}\n"


def test_weight_bytes_of_the_v2lite_targets(tmp_path):
    """The dense V2-Lite-shaped target holds about 2.66 B parameters (its MoE 15.7 B,
    DeepSeek-V2-Lite's published size): a lockstep sweep of seven engines cannot hold
    the MoE target on one GPU."""
    sizes = {}
    for name in ("v2lite", "v2lite_moe"):
        models = e2e_models.prepare_setup(e2e_models.SETUPS[name], tmp_path)
        sizes[name] = e2e_models.weight_bytes(models.target) / 2
    assert 2.6e9 < sizes["v2lite"] < 2.7e9
    assert 15.6e9 < sizes["v2lite_moe"] < 15.8e9


def test_lockstep_fit_refuses_what_cannot_fit_and_names_the_way_out():
    from e2e_children import lockstep_fit_problem

    gib = 2**30
    # The dense V2-Lite target (4.95 GiB) with the 32k sweep's KV cache (6.5 GiB each):
    # seven engines exceed an 80 GB card, four do not.
    problem = lockstep_fit_problem(7, int(4.95 * gib), int(6.5 * gib), int(79.1 * gib))
    assert problem is not None
    for part in ("7 engines", "80.1 GiB", "4.9 GiB", "6.5 GiB", "79.1 GiB", "fewer --runs",
                 "--lockstep-kv-gib"):
        assert part in problem, (part, problem)
    assert lockstep_fit_problem(4, int(4.95 * gib), int(6.5 * gib), int(79.1 * gib)) is None
    assert lockstep_fit_problem(7, int(4.95 * gib), int(6.5 * gib), None) is None
