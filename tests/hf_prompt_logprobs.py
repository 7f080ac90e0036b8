"""A Hugging Face causal LM standing in for ``vllm.LLM.generate`` with prompt log-probs,
for tests of ``evals/lm_eval_ties.py`` on the CPU."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from vllm.logprobs import Logprob


class HFPromptLogprobLLM:
    """``generate(prompts, params)`` as vLLM answers it: per ``TokensPrompt``, one forward
    of ``model`` over the prompt; ``prompt_logprobs[j]`` holds the log-probs of token
    ``j`` and of the ``params.prompt_logprobs`` best tokens given tokens ``< j`` (None
    for ``j = 0``); the one output token is the greedy one, with the ``params.logprobs``
    best. Records the prompts it saw in ``prompts``."""

    def __init__(self, model):
        self.model = model
        self.prompts: list[list[int]] = []

    def generate(self, prompts, params, use_tqdm=True):
        assert params.max_tokens == 1 and params.prompt_logprobs and params.logprobs
        outputs = []
        for prompt in prompts:
            ids = list(prompt["prompt_token_ids"])
            self.prompts.append(ids)
            with torch.no_grad():
                logits = self.model(torch.tensor([ids])).logits[0]
            logprobs = torch.log_softmax(logits.float(), dim=-1)
            entries = [None] + [self._entry(logprobs[j - 1], params.prompt_logprobs, ids[j])
                                for j in range(1, len(ids))]
            last = self._entry(logprobs[-1], params.logprobs)
            outputs.append(SimpleNamespace(
                prompt_token_ids=ids, prompt_logprobs=entries,
                outputs=[SimpleNamespace(token_ids=[max(last, key=lambda t: last[t].logprob)],
                                         logprobs=[last])]))
        return outputs

    @staticmethod
    def _entry(row: torch.Tensor, k: int, token: int | None = None) -> dict[int, Logprob]:
        best = torch.topk(row, k).indices.tolist()
        chosen = [token] if token is not None else []
        return {t: Logprob(float(row[t]), rank=None) for t in chosen + best}
