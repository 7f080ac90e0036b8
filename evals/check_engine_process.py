"""CPU check of ``bench_e2e --engine-process``'s plumbing (``e2e_engine.RemoteEngine``):
vLLM with its engine core in another process, ``e2e_engine``'s functions sent there by
``collective_rpc`` and their results read back (the step timer installs there, the host
speed, allocator and DDTree counters come back, a cProfile summary is written by the
engine's worker). The CPU build runs vLLM's V1 runner, which the step timer does not
wrap, so the timer's steps are empty here; on the GPU (V2 runner) they are not.

    .venv/bin/python evals/check_engine_process.py     # about 2 minutes; exit 0 = plumbing ok
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

EVALS = Path(__file__).resolve().parent


def main() -> int:
    sys.path.insert(0, str(EVALS))
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(EVALS), os.environ.get("PYTHONPATH")) if p)
    import e2e_engine
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    tmp = Path(tempfile.mkdtemp(prefix="check_engine_process_"))
    Qwen3ForCausalLM(Qwen3Config(
        vocab_size=96, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64,
        max_position_embeddings=512)).save_pretrained(tmp / "model")
    llm = LLM(model=str(tmp / "model"), skip_tokenizer_init=True, enforce_eager=True,
              max_model_len=256, dtype="float32", gpu_memory_utilization=0.2)
    engine = e2e_engine.RemoteEngine(llm)
    prompt = [TokensPrompt(prompt_token_ids=list(range(1, 9)))]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    speed, cpu, node = engine.call(e2e_engine.engine_host_speed)
    engine.call(e2e_engine.engine_timer_begin, 8)
    llm.generate(prompt, params, use_tqdm=False)
    steps = engine.call(e2e_engine.engine_timer_end)
    engine.profile(llm, prompt, params, tmp / "profile.md", "engine-process check")
    profile = (tmp / "profile.md").read_text()
    checks = {
        "timer hooks installed in the engine process": bool(engine.hooks),
        "host speed measured there": speed > 0,
        "timer steps came back (a list)": isinstance(steps, list),
        "DDTree counters read there (none without DDTree)":
            engine.call(e2e_engine.engine_active_counters) is None,
        "the engine's worker wrote the profile":
            "(engine-core process)" in profile and " engine steps under cProfile" in profile,
    }
    for name, ok in checks.items():
        print(f"{'ok  ' if ok else 'FAIL'} {name}")
    print(f"host speed {speed:.2f} ms on cpu {cpu} node {node}; {len(steps)} timed steps")
    sys.stdout.flush()
    os._exit(0 if all(checks.values()) else 1)  # vLLM can hang at interpreter exit


if __name__ == "__main__":
    main()
