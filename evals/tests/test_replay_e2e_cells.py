"""evals/replay_e2e_cells.py: the reference engine forced along a bench cell's AR text."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "evals"))
import replay_e2e_cells  # noqa: E402
from e2e_models import SETUPS, cell_seed, load_tokenizer, make_prompts, prepare_setup  # noqa: E402

from vllm_ddtree.demo.reference_engine import CHECKPOINTS  # noqa: E402

pytestmark = pytest.mark.skipif(not (CHECKPOINTS / "target" / "config.json").exists(),
                                reason="embedded pair not trained yet")


def row(run, method, budget, kind, accept, ids=None):
    r = {"run": run, "method": method, "budget": budget, "context": 96,
         "backend": "FLASH_ATTN_MLA" if method != "ddtree" else None,
         "batch": 1, "kind": kind, "status": "ok", "acceptance_length": accept,
         "step_ms": 1.0}
    if ids is not None:
        r["output_token_ids"] = ids
    return r


def test_replay_along_the_references_own_text_gives_its_own_rounds(tmp_path):
    """Cells whose AR ids are the fp32 reference's own greedy text: the replay commits
    exactly what the reference's generate did per round (chain and B = 16), so the
    report's "vLLM / reference" ratio is 1.00 for a vLLM that matches; ``auto`` rows
    and cells without AR ids are not replayed."""
    from transformers import AutoModelForCausalLM

    from vllm_ddtree.reference import clip_rounds, generate
    from vllm_ddtree.training.common import load_drafter

    setup = SETUPS["trained"]
    models = prepare_setup(setup, tmp_path)
    prompt = make_prompts("code", 1, 96, setup, load_tokenizer(models.tokenizer_file),
                          seed=cell_seed(96, 1))[0]
    target = AutoModelForCausalLM.from_pretrained(models.target, dtype=torch.float32).eval()
    drafter = load_drafter(models.drafter)
    own = {}
    for method, budget in (("dflash", 1), ("ddtree", 16)):
        out = generate(target, drafter, prompt, 24, method, budget=budget)
        rounds = clip_rounds([s.committed for s in out.stats], len(out.tokens))
        own[method] = (out.tokens, sum(rounds) / len(rounds))
    ids = own["dflash"][0]
    assert own["ddtree"][0] == ids  # lossless: both are the target's greedy text
    data = {"setup": "trained", "rows": [
        row("ar@FLASH_ATTN_MLA", "ar", None, "code", 1.0, [ids]),
        row("dflash@FLASH_ATTN_MLA", "dflash", None, "code", own["dflash"][1], [ids]),
        row("ddtree-16", "ddtree", 16, "code", own["ddtree"][1] + 1.0, [ids]),
        row("ddtree-auto-16", "ddtree", 16, "code", 3.0, [ids]),
        row("ddtree-16", "ddtree", 16, "random", 2.0)]}
    data["rows"][3]["run"] = "ddtree-auto-16"
    results = replay_e2e_cells.replay_cells(data, tmp_path, progress=False)
    assert [r["run"] for r in results] == ["dflash@FLASH_ATTN_MLA", "ddtree-16"]
    chain, tree = results
    assert chain["reference_accept"] == pytest.approx(own["dflash"][1])
    assert tree["reference_accept"] == pytest.approx(own["ddtree"][1])
    md = replay_e2e_cells.markdown(results, "x.json", "cmd")
    assert "| code | 96 | 1 | DFlash chain, FA-MLA | " in md and " | 1.00 | " in md
    assert "(no cell with AR's generated ids" in replay_e2e_cells.markdown([], "x", "c")
