"""The embedded trained pair loads in transformers and the reference engine, and drafts."""

import json

import pytest
import torch

from vllm_ddtree.demo.reference_engine import CHECKPOINTS, humaneval_prompts, load_embedded_pair
from vllm_ddtree.drafter_config import check_drafter_target_pair
from vllm_ddtree.reference import generate


def test_the_embedded_pair_ships_with_the_package():
    """The pair is part of the package: a missing one is a packaging bug, not a skip."""
    for part in ("target", "drafter"):
        assert (CHECKPOINTS / part / "config.json").is_file()
        assert (CHECKPOINTS / part / "model.safetensors").is_file()


@pytest.fixture(scope="module")
def pair():
    return load_embedded_pair()


def test_checkpoints_are_small_and_of_the_right_kind():
    def size(part: str) -> int:
        return sum(f.stat().st_size for f in (CHECKPOINTS / part).rglob("*") if f.is_file())

    assert size("target") + size("drafter") <= 24 * 1000 * 1000  # the pair travels
    assert size("dflash2_drafter") <= 8 * 1000 * 1000  # beside it
    dflash2 = json.loads((CHECKPOINTS / "dflash2_drafter/config.json").read_text())
    assert dflash2["architectures"] == ["DFlash2DraftModel"]
    target = json.loads((CHECKPOINTS / "target/config.json").read_text())
    drafter = json.loads((CHECKPOINTS / "drafter/config.json").read_text())
    assert target["architectures"] == ["DeepseekV3ForCausalLM"]
    assert (target["kv_lora_rank"], target["qk_rope_head_dim"]) == (512, 64)
    # vLLM 0.26's MLA prefill backends need DeepSeek's head dims.
    assert (target["qk_nope_head_dim"], target["v_head_dim"]) == (128, 128)
    assert drafter["architectures"] == ["DFlashDraftModel"] and drafter["block_size"] == 16
    assert {"sliding_attention", "full_attention"} == set(drafter["layer_types"])


def test_pair_loads_and_matches(pair):
    assert pair.tokenizer is not None and "trained" in pair.label
    check_drafter_target_pair(pair.drafter.config, pair.target.config)
    text = "def add(a, b):\n    return a + b\n"
    assert pair.tokenizer.decode(pair.tokenizer.encode(text)) == text


def test_trained_drafter_accepts_and_stays_lossless(pair):
    prompt = pair.tokenizer.encode(humaneval_prompts(2)[1])
    eos = pair.tokenizer.eos_token_id
    ar = generate(pair.target, None, prompt, 48, "ar", eos_token_id=eos)
    chain = generate(pair.target, pair.drafter, prompt, 48, "dflash", eos_token_id=eos)
    tree = generate(pair.target, pair.drafter, prompt, 48, "ddtree", budget=32, eos_token_id=eos)
    assert chain.tokens == ar.tokens and tree.tokens == ar.tokens
    # A random drafter commits ~1 token per round; the trained one must do much better.
    assert chain.mean_committed > 2.0 and tree.mean_committed >= chain.mean_committed


def test_target_perplexity_on_heldout_style_code(pair):
    code = ("import os\n\n\ndef read_lines(path):\n    with open(path) as f:\n"
            "        return [line.rstrip('\\n') for line in f]\n")
    ids = torch.tensor([pair.tokenizer.encode(code)])
    with torch.no_grad():
        loss = pair.target(ids, labels=ids).loss
    assert torch.exp(loss) < 40  # a random 4096-token model sits near 4096


def test_vllm_demo_refuses_without_cuda_and_reports_rounds(monkeypatch):
    """`--engine vllm` names the fix on a CPU machine; its table counts one prefill
    round per prompt plus one round per draft (AR: one per further token)."""
    import torch as _torch

    from vllm_ddtree import cli
    from vllm_ddtree.demo import vllm_engine as demo_vllm

    monkeypatch.setattr(_torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="--engine reference"):
        cli.main(["demo", "--engine", "vllm"])
    with pytest.raises(SystemExit):
        cli.main(["demo", "--engine", "tensorrt"])
    prompts = [[5, 6], [7]]
    tokens = [[10, 11, 12, 13], [20, 21]]
    results = {
        "AR": {"method": "ar", "seconds": 2.0, "drafts": 0, "accepted": 0,
               "prompts": prompts, "tokens": tokens, "text": "x"},
        "DDTree": {"method": "ddtree", "seconds": 1.0, "drafts": 2, "accepted": 2,
                   "prompts": prompts, "tokens": tokens, "text": "x"},
    }
    table = demo_vllm.format_report(results).splitlines()
    ar_row = next(line for line in table if line.startswith("AR"))
    dd_row = next(line for line in table if line.startswith("DDTree"))
    assert ar_row.split()[1:3] == ["1.00", "6"]
    assert dd_row.split()[1:3] == ["1.50", "4"] and dd_row.endswith("0.50x")
    assert demo_vllm.speculative_config("ddtree", 8)["num_speculative_tokens"] == 8
