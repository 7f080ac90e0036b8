"""Which implementation runs the eager per-round work on the GPU: the verify inputs
(``verify_inputs_kernel``), the tree walk with its inputs and its finish
(``tree_walk_kernel``), the KV compaction (``kv_compaction_kernel``), ``propose``'s
hidden-row moves (``hidden_rows_kernel``), the tree scatter to request-state rows
(``tree_store_kernel``) and ``auto``'s budget choice (``budget_choice_kernel``).

``VLLM_DDTREE_ROUND_KERNELS``:

* ``triton`` (default): one Triton launch for the walk and one for the whole round's
  compaction (about 180 and 19 launches per KV-cache group fewer per round; the
  mixed-batch GPU suite, tests/gpu/test_ddtree_vllm.py, and the compiled kernel tests
  passed with them on the H200), one each for the verify inputs, the walk's inputs,
  what follows the walk (sampled rows, counters, KV source rows), the hidden-row index
  and ``auto``'s budget choice (about 50, 20, 15, 10 and 20 fewer; interpreter-tested,
  not yet GPU-run);
* ``torch``: batched PyTorch ops (``walk.follow.follow_tree``,
  ``compact.reference.compact_kv_cache_``), the earlier path, kept as a fallback.

CPU tensors always take the PyTorch path.
"""

from __future__ import annotations

import os

import torch

ROUND_KERNELS_ENV = "VLLM_DDTREE_ROUND_KERNELS"
ROUND_KERNEL_CHOICES = ("torch", "triton")
DEFAULT_ROUND_KERNELS = "triton"


def _choice(env: str, default: str, choices: tuple[str, ...] = ROUND_KERNEL_CHOICES) -> str:
    """One of ``choices`` (default ``"torch"`` / ``"triton"``) from the environment
    variable ``env``.

    Raises:
        ValueError: the variable holds another value (names it and the choices).
    """
    raw = os.environ.get(env)
    if raw is None:  # the common case, checked several times a round
        return default
    value = raw.strip().lower()
    if value not in choices:
        raise ValueError(f"{env}={value!r}: use one of {', '.join(choices)}")
    return value


def round_kernels() -> str:
    """The configured implementation, ``"torch"`` or ``"triton"`` (raises
    ``ValueError`` naming the variable on any other value)."""
    return _choice(ROUND_KERNELS_ENV, DEFAULT_ROUND_KERNELS)


def use_triton_round_kernels(tensor: torch.Tensor) -> bool:
    """True when ``tensor`` (a CUDA tensor of the round) goes to the Triton kernels."""
    return tensor.is_cuda and round_kernels() == "triton"


# The tree build (``tree_build_kernel``) has its own switch, ``VLLM_DDTREE_TREE_BUILD``:
# ``triton`` (default: one launch for the beam selection and the merge; the mixed-batch
# GPU suite, CUDA graphs included, passed with it on the H200, 2026-11-30) or ``torch``
# (``build_ddtree``'s batched PyTorch ops, the fallback).
TREE_BUILD_ENV = "VLLM_DDTREE_TREE_BUILD"
DEFAULT_TREE_BUILD = "triton"


def tree_build() -> str:
    """The configured tree build, ``"torch"`` or ``"triton"`` (raises ``ValueError``
    naming ``VLLM_DDTREE_TREE_BUILD`` on any other value)."""
    return _choice(TREE_BUILD_ENV, DEFAULT_TREE_BUILD)


def use_triton_tree_build(tensor: torch.Tensor) -> bool:
    """True when the drafter logits ``tensor`` (CUDA) go to the Triton tree build."""
    return tree_build() == "triton" and tensor.is_cuda


# Where the trees reach the request-state rows, ``VLLM_DDTREE_TREE_STORE``: ``graph``
# (default since the twenty-third session): ``tree_store_kernel`` inside the drafter's
# step, so inside its CUDA graph (one eager launch and its host time fewer per round;
# H200: the ddtree suite, CUDA graphs and one KV-cache group included, and the
# captured-store GPU test passed with it); ``eager``: the same kernel launched in
# ``propose`` after the drafter's step. ``graph`` applies to fixed budgets with the
# Triton round kernels on CUDA; ``auto`` follows ``VLLM_DDTREE_AUTO_IN_GRAPH`` below.
TREE_STORE_ENV = "VLLM_DDTREE_TREE_STORE"
TREE_STORE_CHOICES = ("eager", "graph")
DEFAULT_TREE_STORE = "graph"


def tree_store() -> str:
    """The configured tree store, ``"eager"`` or ``"graph"`` (raises ``ValueError``
    naming ``VLLM_DDTREE_TREE_STORE`` on any other value)."""
    return _choice(TREE_STORE_ENV, DEFAULT_TREE_STORE, TREE_STORE_CHOICES)


# ``ddtree_budget: "auto"`` with its per-round choice and tree store inside the drafter's
# CUDA graph, ``VLLM_DDTREE_AUTO_IN_GRAPH``: ``1`` (default) runs both inside the graph
# (padding requests skipped by their -1 state row), leaving the wall-time copy in and the
# chosen-budget copy out; ``0`` chooses and stores eagerly after the graph (four eager
# operations a round). In-graph needs TP = 1 and the Triton round kernels on CUDA; other
# setups keep the eager path. Its H200 figures against the eager path are in
# evals/results/ddtree_vllm_h200.md.
AUTO_IN_GRAPH_ENV = "VLLM_DDTREE_AUTO_IN_GRAPH"
DEFAULT_AUTO_IN_GRAPH = "1"


def auto_in_graph() -> bool:
    """``VLLM_DDTREE_AUTO_IN_GRAPH`` is ``1``, its default (raises ``ValueError``
    naming it on a value other than ``0`` / ``1``)."""
    return _choice(AUTO_IN_GRAPH_ENV, DEFAULT_AUTO_IN_GRAPH, ("0", "1")) == "1"


# DFlash's draft inputs for every drafter KV-cache group in one launch
# (``dflash_inputs_kernel``) instead of vLLM's one ``prepare_dflash_inputs`` launch per
# group, ``VLLM_DDTREE_FUSED_PREPARE``: ``1`` (default; bit-equal to vLLM's per-group
# launches in Triton's interpreter and on the H200, where the ddtree suite and the graphs
# test passed with it, thirtieth session) or ``0`` (vLLM's per-group launches).
FUSED_PREPARE_ENV = "VLLM_DDTREE_FUSED_PREPARE"
DEFAULT_FUSED_PREPARE = "1"


def fused_prepare() -> bool:
    """``VLLM_DDTREE_FUSED_PREPARE`` is ``1``, its default (raises ``ValueError`` naming
    it on a value other than ``0`` / ``1``)."""
    return _choice(FUSED_PREPARE_ENV, DEFAULT_FUSED_PREPARE, ("0", "1")) == "1"


def use_fused_prepare(tensor: torch.Tensor | None) -> bool:
    """True when the round whose ``tensor`` (a CUDA tensor) is given prepares the
    drafter's inputs in one launch (:func:`fused_prepare`); CPU rounds and test fakes
    without the tensor keep DFlash's per-group path."""
    return isinstance(tensor, torch.Tensor) and tensor.is_cuda and fused_prepare()
