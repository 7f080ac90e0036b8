"""Test helpers shared by the CPU tests, the GPU tests and the ``evals/`` scripts.

* :mod:`vllm_ddtree.testing.oracle`: oracle drafter logits (the true continuation at
  chosen ranks per depth) for the in-process vLLM engine;
* :mod:`vllm_ddtree.testing.compare`: greedy token comparison with bf16-tie allowance;
* :mod:`vllm_ddtree.testing.serve`: start / stop ``vllm serve``, read ``/metrics``.

Nothing here imports vLLM at module load; everything runs on CPU machines.
"""
