"""A Hugging Face causal LM answering ``vllm.LLM.generate`` with prompt log-probs: how
``evals/validate.py`` gets plain decoding's log-probs on the reference engine
(``ddtree-ref``), whose target is a Hugging Face model, for the tie rule of
``evals/lm_eval_ties.py`` (``reference_logprobs``)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from vllm.logprobs import Logprob


class HFPromptLogprobLLM:
    """``generate(prompts, params)`` as vLLM answers it: per ``TokensPrompt``, one forward
    of ``model`` over the prompt in the model's dtype (log-softmax in fp32, as vLLM
    takes log-probs); ``prompt_logprobs[j]`` holds the log-probs of token ``j`` and of
    the ``params.prompt_logprobs`` best tokens given tokens ``< j`` (None for
    ``j = 0``); the one output token is the greedy one, with the ``params.logprobs``
    best. Records the prompts it saw in ``prompts``."""

    def __init__(self, model):
        self.model = model
        self.prompts: list[list[int]] = []

    def generate(self, prompts, params, use_tqdm=True):
        if params.max_tokens != 1 or not params.prompt_logprobs or not params.logprobs:
            raise ValueError("HFPromptLogprobLLM answers max_tokens=1 with prompt_logprobs "
                             f"and logprobs only, got {params}")
        device = next(self.model.parameters()).device
        outputs = []
        for prompt in prompts:
            ids = list(prompt["prompt_token_ids"])
            self.prompts.append(ids)
            with torch.inference_mode():
                logits = self.model(torch.tensor([ids], device=device)).logits[0]
            logprobs = torch.log_softmax(logits.float(), dim=-1).cpu()
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
