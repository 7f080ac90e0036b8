"""Patch ``vllm.v1.engine.input_processor.InputProcessor._validate_params`` (vLLM
0.26.0): refuse, per request and before it reaches the engine, the sampling features
that assume the draft tokens form a chain.

With ``method: ddtree`` the verifier walks a tree; vLLM's penalty and bad-words
kernels take row ``i``'s history to be draft rows ``1..i`` and structured outputs
validate drafts in chain order (``vllm_ddtree.verify.verifier.DDTreeVerifier.check_supported``
lists the code). The verifier refuses them too, but inside the worker that would end a
served engine; here the request gets a ``ValueError`` (HTTP 400 from ``vllm serve``)
that names the field and the fix.
"""

from __future__ import annotations

from vllm_ddtree.patches._guard import mark_patched, require_vllm_version

PATCHED_FUNCTION = "vllm.v1.engine.input_processor.InputProcessor._validate_params"


def chain_only_features(params) -> list[str]:
    """The ``SamplingParams`` fields set on ``params`` that DDTree cannot honour."""
    problems = []
    if params.repetition_penalty not in (None, 1.0):
        problems.append(f"repetition_penalty={params.repetition_penalty}")
    if params.frequency_penalty not in (None, 0.0):
        problems.append(f"frequency_penalty={params.frequency_penalty}")
    if params.presence_penalty not in (None, 0.0):
        problems.append(f"presence_penalty={params.presence_penalty}")
    if params.bad_words:
        problems.append("bad_words")
    if params.structured_outputs is not None:
        problems.append("structured_outputs (guided decoding)")
    if getattr(params, "logprob_token_ids", None):
        # the tree verifier's logprobs are the top-n of the committed rows only
        problems.append("logprob_token_ids")
    return problems


def check_request_for_ddtree(vllm_config, params) -> None:
    """Raise ``ValueError`` when ``vllm_config`` decodes with DDTree and ``params``
    (``SamplingParams``) asks for a feature that assumes a chain."""
    from vllm_ddtree.runtime_state import ddtree_config_of

    if ddtree_config_of(vllm_config.speculative_config) is None:
        return
    problems = chain_only_features(params)
    if problems:
        raise ValueError(
            f"this server decodes with speculative method 'ddtree', which cannot honour "
            f"{', '.join(problems)} (penalties, bad words and guided decoding assume the "
            "draft tokens form a chain; logprobs are the top-n only): drop them from the "
            "request, or serve without --speculative-config"
        )


def apply() -> None:
    require_vllm_version(PATCHED_FUNCTION)
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.input_processor import InputProcessor

    original = InputProcessor._validate_params
    if getattr(original, "_ddtree_patched", False):
        return

    def _validate_params(self, params, supported_tasks):
        original(self, params, supported_tasks)
        if isinstance(params, SamplingParams):
            check_request_for_ddtree(self.vllm_config, params)

    mark_patched(_validate_params, original)
    InputProcessor._validate_params = _validate_params
