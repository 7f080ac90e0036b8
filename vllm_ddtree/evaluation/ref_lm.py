"""``ddtree-ref``: the reference engine (PyTorch, CPU or GPU) as an lm-eval model.

Importing this module registers the model, so ``lm_eval.simple_evaluate(model=
"ddtree-ref", ...)`` works after ``import vllm_ddtree.evaluation.ref_lm``; on the
command line use ``python evals/run_lm_eval.py --model ddtree-ref ...``.

Model args (all optional): ``pretrained`` (target directory; default the embedded
pair), ``drafter`` (DFlash drafter directory; default the embedded one when
``pretrained`` is not given), ``method`` (``ar``, ``dflash``, ``ddtree``; default
``ddtree``), ``budget`` (tree nodes per round, 32), ``top_k``, ``temperature``
(used when a task samples; tasks here are greedy), ``seed``, ``dtype``
(``float32``), ``device`` (``cpu``), ``max_length`` (default: the target's
``max_position_embeddings``), ``threads`` (torch CPU threads). They are checked
before any model loads (``vllm_ddtree.evaluation.ref_args``).

Only ``generate_until`` is implemented: log-likelihood tasks involve no decoding,
so there is nothing for speculation to change (use lm-eval's ``hf`` model).
Per request, ``records`` keeps the engine's ``RoundStats`` (rounds up to the stop
sequence only), for ``acceptance_summary``, and the prompt's and the generation's
token ids, for the tie rule of ``evals/validate.py``.
"""

from __future__ import annotations

import logging
import time
import zlib
from collections import Counter

import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from tqdm import tqdm

from vllm_ddtree.demo.reference_engine import CHECKPOINTS, Pair
from vllm_ddtree.evaluation.ref_args import DTYPES, check_ref_lm_args
from vllm_ddtree.reference import generate
from vllm_ddtree.training.common import load_drafter

logger = logging.getLogger(__name__)
MODEL_NAME = "ddtree-ref"
DEFAULT_MAX_GEN_TOKS = 256
_DTYPES = {name: getattr(torch, name) for name in DTYPES}


def load_pair(pretrained: str | None, drafter: str | None, dtype: str = "float32",
              device: str = "cpu", need_drafter: bool = True) -> Pair:
    """Target, drafter and tokenizer from directories (default: the embedded pair)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    if pretrained is None:
        pretrained = str(CHECKPOINTS / "target")
        drafter = drafter or str(CHECKPOINTS / "drafter")
    if need_drafter and drafter is None:
        raise ValueError("methods dflash and ddtree need `drafter=<DFlash drafter directory>`")
    torch_dtype = _DTYPES[dtype]
    target = AutoModelForCausalLM.from_pretrained(pretrained, dtype=torch_dtype)
    target = target.to(device).eval()
    draft = None
    if need_drafter:
        draft = load_drafter(drafter, torch_dtype, device)  # DFlash or DFlash2
    tokenizer = AutoTokenizer.from_pretrained(pretrained)
    return Pair(target, draft, tokenizer, f"{pretrained} + {drafter}")


def stop_index(text: str, until: list[str]) -> int | None:
    """Index of the earliest stop sequence in ``text``, or None."""
    found = [i for i in (text.find(s) for s in until if s) if i >= 0]
    return min(found) if found else None


def tokens_used(tokenizer, tokens: list[int], chars: int) -> int:
    """Fewest leading ``tokens`` whose decoded text covers ``chars`` characters."""
    lo, hi = 0, len(tokens)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(tokenizer.decode(tokens[:mid], skip_special_tokens=True)) >= chars:
            hi = mid
        else:
            lo = mid + 1
    return lo


def rounds_until(stats, n_tokens: int) -> list:
    """The rounds that produced the first ``n_tokens`` tokens (the first token comes
    from the prefill, not from a round)."""
    out, have = [], 1
    for s in stats:
        if have >= n_tokens:
            break
        out.append(s)
        have += s.committed
    return out


def acceptance_summary(records: list[dict]) -> dict:
    """Mean committed tokens per round, mean accepted depth and the accepted-depth
    histogram over all ``records`` of a ``DDTreeRefLM`` (prefill excluded)."""
    committed = [c for r in records for c in r["committed"]]
    depths = [d for r in records for d in r["depth"]]
    rounds = len(committed)
    return {
        "requests": len(records),
        "rounds": rounds,
        "tokens": sum(r["tokens_used"] for r in records),
        "prompt_tokens_max": max((r["prompt_tokens"] for r in records), default=0),
        "mean_committed_per_round": sum(committed) / rounds if rounds else None,
        "mean_accepted_depth": sum(depths) / rounds if rounds else None,
        "depth_histogram": dict(sorted(Counter(depths).items())),
        "seconds": sum(r["seconds"] for r in records),
    }


@register_model(MODEL_NAME)
class DDTreeRefLM(LM):
    """lm-eval model that decodes with ``vllm_ddtree.reference.generate``."""

    def __init__(self, pretrained: str | None = None, drafter: str | None = None,
                 method: str = "ddtree", budget: int = 32, top_k: int | None = None,
                 temperature: float = 0.0, seed: int = 0, dtype: str = "float32",
                 device: str | None = "cpu", max_length: int | None = None,
                 threads: int | None = None, max_gen_toks: int = DEFAULT_MAX_GEN_TOKS,
                 pair: Pair | None = None, batch_size=None, max_batch_size=None) -> None:
        super().__init__()
        check_ref_lm_args({
            "pretrained": pretrained, "drafter": drafter, "method": method, "budget": budget,
            "top_k": top_k, "temperature": temperature, "seed": seed, "dtype": dtype,
            "device": device, "max_length": max_length, "threads": threads,
            "max_gen_toks": max_gen_toks, "pair": pair})
        if threads:
            torch.set_num_threads(int(threads))
        self.method, self.budget = method, int(budget)
        self.top_k = int(top_k) if top_k is not None else None
        self.temperature, self.seed = float(temperature), int(seed)
        self.max_gen_toks = int(max_gen_toks)
        device = device or "cpu"
        if device.startswith("cuda") and not torch.cuda.is_available():
            # lm-eval's command line passes --device cuda unless told otherwise.
            logger.warning("%s: no CUDA device, running on the CPU", MODEL_NAME)
            device = "cpu"
        self.pair = pair or load_pair(pretrained, drafter, dtype, device,
                                      need_drafter=method != "ar")
        if self.pair.tokenizer is None:
            raise ValueError("the model pair has no tokenizer")
        self.tokenizer = self.pair.tokenizer
        config = self.pair.target.config
        self.max_length = int(max_length or getattr(config, "max_position_embeddings", 4096))
        self.records: list[dict] = []

    @property
    def tokenizer_name(self) -> str:
        """Name used by lm-eval to fingerprint request caches."""
        return str(getattr(self.tokenizer, "name_or_path", MODEL_NAME)).replace("/", "__")

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        """Not implemented: scoring does not decode, so speculation cannot change it."""
        raise NotImplementedError(f"{MODEL_NAME} implements generate_until only; "
                                  "use lm-eval's `hf` model for log-likelihood tasks")

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        """Not implemented (see ``loglikelihood``)."""
        return self.loglikelihood(requests, disable_tqdm)

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Decode each request's context with the configured method; cut at ``until``."""
        out = []
        label = self.method if self.method != "ddtree" else f"ddtree B={self.budget}"
        for req in tqdm(requests, desc=f"{MODEL_NAME} {label}", disable=disable_tqdm):
            context, gen_kwargs = req.args
            text, record = self.generate_text(context, dict(gen_kwargs or {}))
            record.update(task=req.task_name, doc_id=req.doc_id)
            self.records.append(record)
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
            out.append(text)
        return out

    def generate_text(self, context: str, gen_kwargs: dict) -> tuple[str, dict]:
        """One completion of ``context`` and its record (per-round stats, timing)."""
        until = gen_kwargs.pop("until", None) or []
        until = [until] if isinstance(until, str) else list(until)
        max_gen = int(gen_kwargs.pop("max_gen_toks", self.max_gen_toks))
        do_sample = gen_kwargs.pop("do_sample", None)
        temperature = float(gen_kwargs.pop("temperature", self.temperature))
        if do_sample is False:
            temperature = 0.0
        if gen_kwargs:
            logger.debug("%s ignores generation kwargs %s", MODEL_NAME, sorted(gen_kwargs))
        ids = self.tokenizer.encode(context, add_special_tokens=False)
        ids = ids[-(self.max_length - max_gen):] if self.max_length > max_gen else ids
        # Sampled draws are keyed by (seed, position): the same seed for a context in
        # every run, so that AR and DDTree runs can be compared.
        seed = (self.seed + zlib.crc32(context.encode("utf-8"))) % 2**31
        def reached_stop(tokens: list[int]) -> bool:
            # Decoding the whole output per round is cheap at lm-eval's lengths.
            return bool(until) and stop_index(
                self.tokenizer.decode(tokens, skip_special_tokens=True), until) is not None

        start = time.perf_counter()
        result = generate(self.pair.target, self.pair.drafter, ids, max_gen, self.method,
                          budget=self.budget, temperature=temperature, seed=seed,
                          eos_token_id=self.tokenizer.eos_token_id, top_k=self.top_k,
                          stop=reached_stop)
        seconds = time.perf_counter() - start
        text = self.tokenizer.decode(result.tokens, skip_special_tokens=True)
        cut = stop_index(text, until)
        if cut is not None:
            text = text[:cut]
        # the tokens of ``text``: a stop string's and the end-of-sequence token dropped
        text_tokens = tokens_used(self.tokenizer, result.tokens, len(text))
        used = len(result.tokens) if cut is None else max(1, text_tokens)
        rounds = rounds_until(result.stats, used)
        return text, {
            "prompt_ids": ids,
            "generated_ids": result.tokens[:text_tokens],
            "prompt_tokens": len(ids),
            "tokens_generated": len(result.tokens),
            "tokens_used": used,
            "committed": [s.committed for s in rounds],
            "depth": [s.accepted_depth for s in rounds],
            "seconds": seconds,
        }

    def get_model_info(self) -> dict:
        """Shown in lm-eval's results ``config``."""
        return {"engine": "vllm_ddtree.reference", "method": self.method,
                "budget": self.budget, "top_k": self.top_k, "pair": self.pair.label}
