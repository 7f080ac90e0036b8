"""DDTree verification for vLLM 0.26's V2 runner: the tree replacement of
``vllm.v1.worker.gpu.spec_decode.rejection_sampler.RejectionSampler``.

The runner calls ``rejection_sampler(logits, input_batch, draft_logits)``
(``model_runner.py:1108-1115``) whenever the batch holds draft tokens, with one
logit row per verify token: per request ``[root, node_1..node_n]`` (n = its
scheduled draft count, <= B). The chain sampler compares row ``i``'s draw with the
draft token of row ``i+1`` (``rejection_sampler_utils.py:460``); a tree needs the
parent structure instead:

1. apply the request's sampling parameters to every row, as ``Sampler.sample`` does
   (``sample/sampler.py:209-258``, logit bias / min-tokens keyed by the row's tree
   position, temperature, min-p, then top-k/top-p);
2. draw the target's token at every row with vLLM's own ``gumbel_sample``
   (``sample/gumbel.py:215``; argmax for greedy rows), keyed by the request seed and
   the row's RoPE position, which is what plain decoding uses for the same token
   ("sample and match": lossless at any temperature);
3. walk the tree (on CUDA one Triton launch for steps 3 and 4,
   ``walk_kernel.verify_walk_triton``; CPU tensors: ``walk.follow.follow_tree``; fixed
   ``max_depth = L``: no host sync); with ``ddtree_budget: "auto"`` the nodes past the
   request's active budget are masked out first (``budget.mask_inactive_nodes``), so the
   walk is the walk of the budget-``b`` tree;
4. return ``SamplerOutput(sampled [R, B+1], num_sampled = a+1, num_rejected =
   num_logits - num_sampled)`` via vLLM's ``get_num_sampled_and_rejected``
   (``input_batch.py:438``) so chunked prefills and truncated drafts count as vLLM
   counts them, and record the walk for the speculator's next ``propose``.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from vllm_ddtree.budget.choice import mask_inactive_nodes
from vllm_ddtree.runtime_state import DDTREE_STATE, DDTreeRuntimeState, logit_row_positions
from vllm_ddtree.tree.draft_tree import DraftTree
from vllm_ddtree.triton_path import use_triton
from vllm_ddtree.verify.batch import sampled_rows_from_walk
from vllm_ddtree.verify.shape import WARMUP_PREFIX, warm_up_batch
from vllm_ddtree.walk.follow import WalkResult, follow_tree
from vllm_ddtree.walk.walk_kernel import verify_walk_triton

__all__ = [
    "DDTreeVerifier",
    "UnsupportedForTreeError",
    "committed_logit_rows",
    "flatten_committed",
    "num_sampled_and_rejected_torch",
    "tree_inputs_from_rows",
]

# Requests the V2 warm-up creates (``verify.shape.WARMUP_PREFIX``) use every
# sampling feature (``SamplingParams.for_sampler_warmup``): penalties and bad words
# are applied to them chain-wise only to warm the kernels; their tokens are dropped.
# DDTreeRuntimeState's acceptance counters that a walk adds to.
_COUNTER_NAMES = ("accepted_sum", "num_drafts", "active_nodes_sum", "arm_accepted_sum")

# draw(processed_logits [N, V], expanded_idx_mapping [N], positions [N]) -> int64 [N]
DrawFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class UnsupportedForTreeError(ValueError):
    """A request feature that assumes the drafts form a chain."""


def tree_inputs_from_rows(
    draft_row_tokens: torch.Tensor,
    drawn: torch.Tensor,
    cu_num_logits: torch.Tensor,
    budget: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-request tree tokens and target tokens from flat logit rows.

    Args:
        draft_row_tokens: int64 ``[num_logits]``, the input token of each logit row
            (``input_ids[logits_indices]``: the root, then the verified draft nodes).
        drawn: int64 ``[num_logits]``, the target's token drawn at each row.
        cu_num_logits: int32 ``[R+1]``.
        budget: B.

    Returns:
        ``tokens`` int64 ``[R, B]`` (node i = row ``start + 1 + i``; -1 past the
        request's n drafts, so those nodes never match) and ``targets`` int64
        ``[R, 1+B]`` (-1 past row n).
    """
    num_logits = draft_row_tokens.shape[0]
    device = draft_row_tokens.device
    cu = cu_num_logits.to(torch.int64)
    starts = cu[:-1, None]
    num_drafts = (cu[1:] - cu[:-1] - 1)[:, None]
    cols = torch.arange(1 + budget, device=device)[None, :]
    rows = (starts + cols).clamp(max=max(num_logits - 1, 0))
    valid = cols <= num_drafts
    targets = torch.where(valid, drawn.to(torch.int64)[rows], -1)
    tokens = torch.where(valid, draft_row_tokens.to(torch.int64)[rows], -1)[:, 1:]
    return tokens, targets


def committed_logit_rows(
    kv_src_rows: torch.Tensor, cu_num_logits: torch.Tensor, num_logits: int
) -> torch.Tensor:
    """Logit row that produced each committed token, in vLLM's chain layout.

    vLLM's logprobs code reads committed token ``i`` of request ``r`` from logit row
    ``cu[r] + i`` (``rejection_sampler.py:23-41, 80-101``). In a tree that token was
    drawn at the path's node ``i-1`` (the root for ``i = 0``), i.e. row
    ``cu[r] + kv_src_rows[r, i-1]``. Returns int64 ``[num_logits]``, a row index
    (identity outside committed rows) that puts the right rows in the chain layout.
    """
    num_reqs, width = kv_src_rows.shape
    device = kv_src_rows.device
    starts = cu_num_logits[:num_reqs].to(torch.int64)[:, None]
    valid = kv_src_rows >= 0
    # committed token i >= 1 comes from the row of accepted node i-1 ...
    dst = starts + torch.arange(1, width + 1, device=device)[None, :]
    src = starts + kv_src_rows
    dst = torch.where(valid, dst, num_logits).flatten()
    src = torch.where(valid, src, num_logits).flatten()
    index = torch.arange(num_logits + 1, dtype=torch.int64, device=device)
    index.scatter_(0, dst, src)
    return index[:num_logits]  # ... and token 0 from the root row (identity)


def flatten_committed(
    sampled: torch.Tensor, num_sampled: torch.Tensor, cu_num_logits: torch.Tensor,
    num_logits: int,
) -> torch.Tensor:
    """Torch version of ``_flatten_sampled_kernel`` (``rejection_sampler.py:23``):
    ``flat[cu[r] + i] = sampled[r, i]`` for ``i < num_sampled[r]``, else 0.
    Returns ``[num_logits]`` in ``sampled``'s dtype."""
    num_reqs, width = sampled.shape
    device = sampled.device
    cols = torch.arange(width, device=device)[None, :]
    valid = cols < num_sampled.to(torch.int64)[:, None]
    dst = torch.where(valid, cu_num_logits[:num_reqs].to(torch.int64)[:, None] + cols,
                      num_logits)
    flat = torch.zeros(num_logits + 1, dtype=sampled.dtype, device=device)
    flat.scatter_(0, dst.flatten(), torch.where(valid, sampled, 0).flatten())
    return flat[:num_logits]


def num_sampled_and_rejected_torch(
    num_sampled: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_num_logits: torch.Tensor,
    idx_mapping: torch.Tensor,
    prefill_len: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch version of ``get_num_sampled_and_rejected`` (``input_batch.py:409-455``):
    chunked-prefill requests (``seq_len < prefill_len``) sample and reject nothing;
    otherwise ``num_rejected = num_logits - num_sampled``. int32 ``[R]`` each."""
    num_reqs = idx_mapping.shape[0]
    chunked = seq_lens[:num_reqs] < prefill_len[idx_mapping.to(torch.int64)]
    num_sampled = torch.where(chunked, 0, num_sampled).to(torch.int32)
    num_logits = cu_num_logits[1 : num_reqs + 1] - cu_num_logits[:num_reqs]
    num_rejected = torch.where(chunked, 0, num_logits - num_sampled).to(torch.int32)
    return num_sampled, num_rejected


class DDTreeVerifier:
    """Tree verification with ``RejectionSampler``'s call contract.

    Args:
        sampler: vLLM's V2 ``Sampler`` (``sample/sampler.py:30``); its states give the
            requests' sampling parameters, seeds and logprob settings.
        speculative_config: vLLM's ``SpeculativeConfig`` (B = ``num_speculative_tokens``).
        device: the runner's device.
        max_depth: L, the drafter's depths (``block_size - 1``): the walk's width.
        state: the process's DDTree buffers (default ``DDTREE_STATE``).
        draw_fn: token drawing ``(processed_logits, expanded_idx_mapping, positions)
            -> int64 tokens``; default vLLM's ``gumbel_sample`` with the sampler's
            temperatures and seeds. Tests inject a CPU version.
    """

    _scratch_counters: SimpleNamespace | None = None  # a warm-up batch's (_walk_counters)

    def __init__(
        self,
        sampler: Any,
        speculative_config: Any,
        device: torch.device | str,
        max_depth: int,
        state: DDTreeRuntimeState | None = None,
        draw_fn: DrawFn | None = None,
    ) -> None:
        self.sampler = sampler
        self.budget = int(speculative_config.num_speculative_tokens)
        self.max_depth = max_depth
        self.device = device
        self.state = DDTREE_STATE if state is None else state
        # Tests pass their own draw; vLLM's (``_gumbel_draw``) has a greedy fast path.
        self.custom_draw = draw_fn is not None
        self.draw_fn = self._gumbel_draw if draw_fn is None else draw_fn

    # -- vLLM pieces (CUDA/Triton); isolated so that tests can replace them --------

    def _gumbel_draw(
        self, logits: torch.Tensor, expanded_idx_mapping: torch.Tensor, pos: torch.Tensor
    ) -> torch.Tensor:
        from vllm.v1.worker.gpu.sample.gumbel import gumbel_sample

        states = self.sampler.sampling_states
        # Temperature is already applied by apply_sampling_params, as in Sampler.sample.
        return gumbel_sample(
            logits,
            expanded_idx_mapping,
            states.temperature.gpu,
            states.seeds.gpu,
            pos,
            apply_temperature=False,
            use_fp64=self.sampler.use_fp64_gumbel,
        )

    def _num_sampled_and_rejected(self, num_sampled, input_batch):
        args = (
            num_sampled,
            input_batch.seq_lens,
            input_batch.cu_num_logits,
            input_batch.idx_mapping,
            self.sampler.req_states.prefill_len.gpu,
        )
        if num_sampled.is_cuda:
            from vllm.v1.worker.gpu.input_batch import get_num_sampled_and_rejected

            return get_num_sampled_and_rejected(*args)
        return num_sampled_and_rejected_torch(*args)

    # -- checks ------------------------------------------------------------------

    def check_supported(self, input_batch: Any) -> bool:
        """Raise ``UnsupportedForTreeError`` for features that assume a chain; return
        whether any of them is on (V2 warm-up batches only).

        * structured outputs: the grammar bitmask rows and ``validate_tokens`` follow
          the chain order (``scheduler.py:2057-2114``);
        * penalties and bad words: their kernels take row ``i``'s history to be the
          draft rows ``1..i`` of its request (``penalties.py:146-156``,
          ``bad_words.py:72-97``), not the node's ancestors.

        V2 warm-up requests (which use all of them) are exempt: their tokens are
        discarded, and the call still warms the kernels.
        """
        idx = input_batch.idx_mapping_np
        problems = []
        if input_batch.has_structured_output_reqs:
            problems.append("structured outputs (guided decoding)")
        penalties = getattr(self.sampler, "penalties_state", None)
        if penalties is not None and bool(penalties.use_penalty[idx].any()):
            problems.append("repetition/frequency/presence penalties")
        bad_words = getattr(self.sampler, "bad_words_state", None)
        if bad_words is not None and int(bad_words.num_bad_words.np[idx].max(initial=0)) > 0:
            problems.append("bad_words")
        if problems and not all(r.startswith(WARMUP_PREFIX) for r in input_batch.req_ids):
            raise UnsupportedForTreeError(
                f"speculative method 'ddtree' does not support {', '.join(problems)}: "
                "they assume the draft tokens form a chain. Drop them from the request's "
                "SamplingParams, or serve without --speculative-config"
            )
        return bool(problems)

    # -- the call ------------------------------------------------------------------

    def all_greedy(self, input_batch: Any) -> bool:
        """Whether every request of the batch decodes greedily (temperature 0) without
        top-k / top-p: then the target's token at a row is the processed logits'
        argmax, which is what ``gumbel_sample`` computes for temperature 0 (the first
        maximal index, as ``torch.argmax``), without its seed and position inputs."""
        if self.custom_draw:
            return False
        states = self.sampler.sampling_states
        temperature = getattr(getattr(states, "temperature", None), "np", None)
        if temperature is None:  # a sampler without vLLM's host copy: the seeded draw
            return False
        idx = input_batch.idx_mapping_np
        if not bool(np.all(temperature[idx] == 0.0)):
            return False
        top_k, top_p = states.get_top_k_top_p(input_batch.expanded_idx_mapping, idx)
        return top_k is None and top_p is None

    def _uses_logit_bias(self, input_batch: Any) -> bool:
        state = getattr(self.sampler, "logit_bias_state", None)
        flags = getattr(state, "use_logit_bias", None)
        return flags is None or bool(np.any(flags[input_batch.idx_mapping_np]))

    def draw_target_tokens(
        self, logits: torch.Tensor, input_batch: Any, needs_history: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The target's token at every logit row.

        ``needs_history``: whether penalties or bad words may run (they read each row's
        input token); ``check_supported`` refuses them outside V2 warm-up batches.

        Returns ``(drawn int64 [num_logits], processed_logits [num_logits, V],
        row_positions int64 [num_logits] or None)``: greedy batches without logit bias
        skip the positions (only the seeded draw and the logit bias read them).
        """
        assert self.state.depths is not None
        greedy = self.all_greedy(input_batch)
        row_positions = None
        if not greedy or self._uses_logit_bias(input_batch):
            row_positions = self._row_positions(input_batch)
        draft_row_tokens = (input_batch.input_ids[input_batch.logits_indices]
                            if needs_history else None)  # unread: no penalty, bad words
        processed = self.sampler.apply_sampling_params(
            logits,
            input_batch.expanded_idx_mapping,
            input_batch.idx_mapping_np,
            row_positions,
            draft_row_tokens,
            input_batch.expanded_local_pos,
            skip_top_k_top_p=True,
        )
        if greedy:
            return processed.argmax(dim=-1), processed, row_positions
        top_k, top_p = self.sampler.sampling_states.get_top_k_top_p(
            input_batch.expanded_idx_mapping, input_batch.idx_mapping_np
        )
        if top_k is not None or top_p is not None:
            from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

            processed = apply_top_k_top_p(processed, top_k, top_p)
        drawn = self.draw_fn(processed, input_batch.expanded_idx_mapping, row_positions)
        return drawn.to(torch.int64), processed, row_positions

    def _row_positions(self, input_batch: Any) -> torch.Tensor:
        """int64 ``[num_logits]``: each logit row's RoPE position (its token's)."""
        if (self.state.positions is not None
                and self.state.positions_num_tokens == input_batch.num_tokens):
            # verify_inputs_ (prepare_inputs) wrote this batch's RoPE positions: a logit
            # row's key is its token's position (logit_row_positions' formula).
            return self.state.positions[input_batch.logits_indices]
        return logit_row_positions(
            input_batch.positions[input_batch.logits_indices],
            input_batch.expanded_local_pos,
            input_batch.expanded_idx_mapping,
            self.state.depths,
        )

    def walk(self, drawn: torch.Tensor, input_batch: Any) -> WalkResult:
        """Walk each request's tree with the drawn tokens in PyTorch (no host sync):
        the CPU path of ``__call__``, whose CUDA
        path walks inside ``verify_walk_triton``."""
        assert self.state.parents is not None and self.state.depths is not None
        draft_row_tokens = input_batch.input_ids[input_batch.logits_indices]
        tokens, targets = tree_inputs_from_rows(
            draft_row_tokens, drawn, input_batch.cu_num_logits, self.budget
        )
        idx = input_batch.idx_mapping.to(torch.int64)
        if self.state.adaptive:
            assert self.state.active_nodes is not None
            tokens = mask_inactive_nodes(tokens, self.state.active_nodes[idx])
        parents = self.state.parents[idx]
        tree = DraftTree(
            tokens=tokens,
            parents=parents,
            depths=self.state.depths[idx],
            scores=torch.zeros(tokens.shape, dtype=torch.float32, device=tokens.device),
        )
        return follow_tree(tree, targets, max_depth=self.max_depth)

    def __call__(
        self,
        logits: torch.Tensor,
        input_batch: Any,
        draft_logits: torch.Tensor | None = None,
    ) -> Any:
        """Verify every request's tree; ``logits [num_logits, V]`` in the runner's row
        order. Returns vLLM's ``SamplerOutput``."""
        from vllm.v1.worker.gpu.sample.output import SamplerOutput

        if draft_logits is not None:
            raise UnsupportedForTreeError(
                "DDTree drafts greedily; draft_sample_method must stay 'greedy'"
            )
        needs_history = self.check_supported(input_batch)
        num_nans = None
        if self.sampler.compute_nans:
            from vllm.v1.worker.gpu.metrics.logits import get_num_nans

            num_nans = get_num_nans(logits)

        drawn, processed, _ = self.draw_target_tokens(logits, input_batch, needs_history)
        if use_triton(drawn):
            walk, sampled, num_sampled, num_rejected = self._verify_walk_fused(
                drawn, input_batch
            )
        else:
            walk = self.walk(drawn, input_batch)
            sampled, num_sampled, _ = sampled_rows_from_walk(
                walk.committed_tokens, walk.accepted_depth, self.budget
            )
            self._update_stats(walk, input_batch)
            self.state.record_walk_(walk.kv_src_rows)
            num_sampled, num_rejected = self._num_sampled_and_rejected(
                num_sampled, input_batch
            )

        logprobs = self._logprobs(logits, processed, sampled, num_sampled, walk, input_batch)
        return SamplerOutput(
            sampled_token_ids=sampled,
            logprobs_tensors=logprobs,
            num_nans=num_nans,
            num_sampled=num_sampled,
            num_rejected=num_rejected,
        )

    def _verify_walk_fused(self, drawn: torch.Tensor, input_batch: Any):
        """``walk`` + ``sampled_rows_from_walk`` + ``_update_stats`` + ``record_walk_`` +
        ``_num_sampled_and_rejected`` in one Triton launch
        (``tree_walk_kernel.verify_walk_triton``). Returns ``(walk, sampled,
        num_sampled, num_rejected)``."""
        assert self.state.parents is not None and self.state.walk_kv_src_rows is not None
        counters, active_sum, arm_counters = self._walk_counters(input_batch)
        out = verify_walk_triton(
            input_batch.input_ids, input_batch.logits_indices, drawn,
            input_batch.cu_num_logits, input_batch.idx_mapping, self.state.parents,
            self.max_depth, self.budget, self.state.walk_kv_src_rows,
            input_batch.seq_lens, self.sampler.req_states.prefill_len.gpu,
            self.state.active_nodes if self.state.adaptive else None, counters,
            active_sum, arm_counters,
        )  # fmt: skip
        self.state.mark_walk_(input_batch.idx_mapping.shape[0])
        return out

    def _walk_counters(self, input_batch: Any) -> tuple[Any, Any, Any]:
        """``(counters, active_sum, arm_counters)`` of ``verify_walk_triton``: DDTree's
        acceptance counters (``arm_counters`` where the step gate asked for them,
        ``DDTreeRuntimeState.enable_arm_counters_``). A V2 warm-up batch, which does not
        count (``_counts``), gets scratch copies instead of none: its launch is then the
        counting one, compiled at start-up and not at the first request."""
        st = self.state
        if st.accepted_sum is None or st.num_drafts is None:
            return None, st.active_nodes_sum, None
        into = st if self._counts(input_batch) else self._warm_up_counters()
        arms = None
        if st.arm_sizes is not None:
            assert into.arm_accepted_sum is not None
            arms = (st.arm_sizes, into.arm_accepted_sum)
        return (into.accepted_sum, into.num_drafts), into.active_nodes_sum, arms

    def _warm_up_counters(self) -> SimpleNamespace:
        """Zeroed copies of the state's counters (``_COUNTER_NAMES``), made again when one
        of them appears or changes shape (counters enabled after a warm-up batch)."""
        real = [getattr(self.state, name) for name in _COUNTER_NAMES]
        scratch = self._scratch_counters
        if scratch is None or any(
                (t is None) != (c is None) or (t is not None and t.shape != c.shape)
                for t, c in zip(real, vars(scratch).values(), strict=True)):
            scratch = self._scratch_counters = SimpleNamespace(**{
                name: None if t is None else torch.zeros_like(t)
                for name, t in zip(_COUNTER_NAMES, real, strict=True)})
        return scratch

    def _counts(self, input_batch: Any) -> bool:
        """Whether this batch's walks go into DDTree's acceptance counters.

        Every verified tree counts, also a round that was in flight when its request
        finished (a stop string, async scheduling); vLLM's scheduler skips those
        (``Scheduler.update_from_output``), so under stop strings DDTree's counters hold
        up to one more round per request than vLLM's."""
        if self.state.accepted_sum is None or self.state.num_drafts is None:
            return False
        # V2 warm-up batches hold only warm-up requests (dummy drafts); vLLM's own
        # spec-decode counters skip them too, so both reports count the same rounds.
        return not warm_up_batch(getattr(input_batch, "req_ids", None) or ())

    def _update_stats(self, walk: WalkResult, input_batch: Any) -> None:
        if not self._counts(input_batch):
            return
        cu = input_batch.cu_num_logits
        num_reqs = walk.accepted_depth.shape[0]
        has_tree = (cu[1 : num_reqs + 1] - cu[:num_reqs]) > 1
        self.state.accepted_sum += torch.where(has_tree, walk.accepted_depth, 0).sum()
        self.state.num_drafts += has_tree.sum()
        if self.state.arm_sizes is not None:
            assert self.state.arm_accepted_sum is not None
            nodes = walk.accepted_nodes[:, :, None]  # [R, L, 1], -1 past the path
            inside = (nodes >= 0) & (nodes < self.state.arm_sizes)  # [R, L, A]
            self.state.arm_accepted_sum += (inside & has_tree[:, None, None]).sum((0, 1))
        if self.state.adaptive:
            assert self.state.active_nodes is not None and self.state.active_nodes_sum is not None
            num_nodes = cu[1 : num_reqs + 1] - cu[:num_reqs] - 1
            active = torch.minimum(
                self.state.active_nodes[input_batch.idx_mapping.to(torch.int64)], num_nodes
            )
            self.state.active_nodes_sum += torch.where(has_tree, active, 0).sum()

    def _logprobs(self, logits, processed, sampled, num_sampled, walk, input_batch):
        """Logprobs of the committed tokens, laid out as ``RejectionSampler`` lays them
        out (``rejection_sampler.py:67-101``), with each token's logits taken from the
        tree row that drew it."""
        from vllm.v1.worker.gpu.sample.states import NO_LOGPROBS

        max_num_logprobs = self.sampler.sampling_states.max_num_logprobs(
            input_batch.idx_mapping_np
        )
        if max_num_logprobs == NO_LOGPROBS:
            return None
        from vllm.v1.worker.gpu.sample.logprob import compute_topk_scores

        use_processed = self.sampler.logprobs_mode in ("processed_logprobs", "processed_logits")
        source = processed if use_processed else logits
        num_logits = source.shape[0]
        rows = committed_logit_rows(walk.kv_src_rows, input_batch.cu_num_logits, num_logits)
        flat = flatten_committed(sampled, num_sampled, input_batch.cu_num_logits, num_logits)
        expanded = num_logits != input_batch.idx_mapping.shape[0]
        return compute_topk_scores(
            source[rows],
            max_num_logprobs,
            flat,
            input_batch.cu_num_logits_np.tolist() if expanded else None,
            logits_mode=self.sampler.logprobs_mode in ("raw_logits", "processed_logits"),
        )
