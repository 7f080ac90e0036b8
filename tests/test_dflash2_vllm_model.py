"""The vLLM DFlash2 model's pieces (vllm_ddtree.draft.dflash2_model) on the CPU against the
fp32 reference (vllm_ddtree.reference.dflash2): convolutions over a batch of query blocks,
a decoder layer's wiring with vLLM's fused residual norms, the selector's scores, the
candidates and the selector-scored trees the speculator writes. The whole model in vLLM,
with CUDA graphs, is the GPU test tests/gpu/test_dflash2_vllm.py."""

import socket
from types import SimpleNamespace

import pytest
import torch
from tiny_models import tiny_target
from torch import nn

from vllm_ddtree.reference.dflash2 import DFlash2DraftModel
from vllm_ddtree.tree.draft_tree import DraftTree
from vllm_ddtree.tree.selector_tree import (
    build_selector_tree,
    candidate_log_mass,
    top_k_candidates,
    tree_candidates,
)

BLOCK, TAPS, K = 6, 3, 4


@pytest.fixture(scope="module")
def vllm_ctx():
    """A current vLLM config and a one-process tensor-parallel group (vLLM's linear
    layers ask for their rank when built)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import (
        ensure_model_parallel_initialized,
        init_distributed_environment,
        model_parallel_is_initialized,
    )

    with set_current_vllm_config(VllmConfig()):
        if not model_parallel_is_initialized():
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            init_distributed_environment(1, 0, f"tcp://127.0.0.1:{port}", 0, "gloo")
            ensure_model_parallel_initialized(1, 1)
        yield


def reference_drafter(seed: int = 0) -> DFlash2DraftModel:
    from tiny_models import drafter_config

    target = tiny_target("qwen3")
    config = drafter_config(target.config, architectures=["DFlash2DraftModel"],
                            block_size=BLOCK)
    config.dflash_config = {**config.dflash_config, "conv_kernel_size": TAPS,
                            "conv_group_size": 16, "selector_rank": 8, "selector_top_k": K,
                            "output_multiplier": 0.7, "final_logit_softcapping": 3.0}
    torch.manual_seed(seed)
    drafter = DFlash2DraftModel(config).eval()
    with torch.no_grad():  # kernel deltas and edge terms large enough to matter
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return drafter


def ready(module: nn.Module) -> nn.Module:
    """vLLM's post-load step of every quantisable layer (on the CPU it binds the GEMM)."""
    for sub in module.modules():
        method = getattr(sub, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(sub)
    return module


def vllm_conv(ref_conv, dtype=torch.float32):
    from vllm_ddtree.draft.dflash2_model import GroupedDynamicConv

    hidden = ref_conv.base_kernel.shape[-1]
    conv = GroupedDynamicConv(hidden, ref_conv.taps, ref_conv.group_size, BLOCK, dtype, "c")
    with torch.no_grad():
        conv.base_kernel.copy_(ref_conv.base_kernel)
        conv.kernel_projection.weight.copy_(ref_conv.kernel_projection.weight)
    return ready(conv)


def test_convolution_over_a_batch_of_blocks_matches_the_reference(vllm_ctx):
    ref = reference_drafter().layers[0].attention_conv
    conv = vllm_conv(ref)
    x = torch.randn(3 * BLOCK, 64)
    offsets = torch.arange(3 * BLOCK) % BLOCK
    with torch.no_grad():
        for side in (0, 1):
            got = conv.convolve(x, conv.deltas(x), side)
            want = ref.convolve(x, ref.deltas(x), side, offsets)
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
        # A block never sees the one before it: changing block 0 leaves block 1 as is.
        y = x.clone()
        y[:BLOCK] += 1.0
        assert torch.equal(conv.convolve(y, conv.deltas(y), 0)[BLOCK:],
                           conv.convolve(x, conv.deltas(x), 0)[BLOCK:])


def test_taps_past_the_block_are_masked_out(vllm_ctx):
    """More taps than block rows (allowed by the config check): the taps past the block
    only ever reach the previous block (masked), so one block of rows convolves as the
    reference does instead of failing on a shift longer than the batch."""
    from vllm_ddtree.reference.dflash2 import GroupedDynamicConv as RefConv

    torch.manual_seed(3)
    ref = RefConv(64, BLOCK + 2, 16)
    with torch.no_grad():
        ref.base_kernel.normal_()
        ref.kernel_projection.weight.normal_(std=0.1)
    conv = vllm_conv(ref)
    for rows in (BLOCK, 2 * BLOCK):
        x = torch.randn(rows, 64)
        with torch.no_grad():
            for side in (0, 1):
                got = conv.convolve(x, conv.deltas(x), side)
                want = ref.convolve(x, ref.deltas(x), side, torch.arange(rows) % BLOCK)
                torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


class FusedNorm(nn.Module):
    """vLLM's RMSNorm call convention over a reference norm: ``norm(x)`` or
    ``norm(x, residual) -> (norm(x + residual), x + residual)``."""

    def __init__(self, norm):
        super().__init__()
        self.norm = norm

    def forward(self, x, residual=None):
        if residual is None:
            return self.norm(x)
        total = x + residual
        return self.norm(total), total


def test_decoder_layers_wire_like_the_reference(vllm_ctx):
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3DecoderLayer

    from vllm_ddtree.draft.dflash2_model import DFlash2DecoderLayer

    drafter = reference_drafter(1)
    positions = torch.arange(20, 20 + BLOCK)
    empty_k = torch.zeros(0, 2, 16)
    empty_pos = torch.zeros(0, dtype=torch.long)
    layers = []
    for i, ref in enumerate(drafter.layers):
        # A vLLM DFlash layer's parts, the attention and MLP being the reference's own.
        base = DFlashQwen3DecoderLayer.__new__(DFlashQwen3DecoderLayer)
        nn.Module.__init__(base)
        base.input_layernorm = FusedNorm(ref.input_layernorm)
        base.post_attention_layernorm = FusedNorm(ref.post_attention_layernorm)
        base.self_attn = SimpleNamespace(__call__=None)
        base.mlp = ref.mlp
        layer = DFlash2DecoderLayer.upgrade(base, drafter.config, torch.float32, f"layers.{i}")
        for name in ("attention_conv", "mlp_conv"):
            getattr(layer, name).load_state_dict(getattr(ref, name).state_dict())
            ready(getattr(layer, name))

        def attention(*, positions, hidden_states, ref=ref):
            return ref.self_attn(hidden_states, positions, empty_k, empty_k, empty_pos,
                                 drafter.rotary)

        layer.self_attn = attention
        layers.append(layer)
    names = {n for n, _ in layers[0].named_parameters() if "conv" in n}
    assert names == {"attention_conv.base_kernel", "attention_conv.kernel_projection.weight",
                     "mlp_conv.base_kernel", "mlp_conv.kernel_projection.weight"}
    x = torch.randn(BLOCK, 64)
    with torch.no_grad():
        hidden, residual = x, None
        for layer in layers:
            hidden, residual = layer(positions, hidden, residual)
        want = x
        for ref in drafter.layers:
            want = ref(want, positions, empty_k, empty_k, empty_pos, drafter.rotary)
    scale = want.abs().max()  # the perturbed random weights grow the states
    torch.testing.assert_close(hidden + residual, want, atol=1e-5 * scale, rtol=1e-5)


def test_published_names_pass_vllms_weight_mapper_unchanged():
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Model

    names = ["layers.0.attention_conv.base_kernel",
             "layers.0.attention_conv.kernel_projection.weight",
             "layers.1.mlp_conv.base_kernel", "layers.1.mlp_conv.kernel_projection.weight",
             "candidate_selector.hidden_projection.weight",
             "candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook"]
    mapped = DFlashQwen3Model.hf_to_vllm_mapper.apply_list(names)
    assert mapped == names


def selector_pieces(drafter):
    from vllm_ddtree.draft.dflash2_model import DFlash2Qwen3ForCausalLM, SelectorScores

    ref = drafter.candidate_selector
    selector = SelectorScores(64, ref.predecessor_codebook.shape[0],
                              ref.predecessor_codebook.shape[1], K, torch.float32, "cs")
    selector.load_state_dict(ref.state_dict())
    ready(selector)
    lm_head = torch.randn(ref.predecessor_codebook.shape[0], 64)
    model = DFlash2Qwen3ForCausalLM.__new__(DFlash2Qwen3ForCausalLM)
    nn.Module.__init__(model)
    model.compute_logits = lambda h: h @ lm_head.T
    model.output_multiplier, model.softcap = drafter.output_multiplier, drafter.softcap
    model.model = nn.Module()
    model.model.candidate_selector = selector
    return model, lm_head


def test_candidates_and_selector_scores_match_the_reference(vllm_ctx):
    drafter = reference_drafter(2)
    model, lm_head = selector_pieces(drafter)
    hidden = torch.randn(2, BLOCK - 1, 64)
    anchors = torch.tensor([3, 40])
    with torch.no_grad():
        ids, unary, log_norm = model.compute_candidates(hidden.flatten(0, 1))
        want_logits = drafter.output_logits(hidden.flatten(0, 1) @ lm_head.T)
        assert torch.equal(model.marginal_logits(hidden.flatten(0, 1)), want_logits)
        want_unary, want_ids = top_k_candidates(want_logits, K)
        assert torch.equal(ids, want_ids) and torch.equal(unary, want_unary)
        torch.testing.assert_close(log_norm, torch.logsumexp(want_logits, -1))
        wide_ids, _, _ = model.compute_candidates(hidden.flatten(0, 1), 3 * K)
        assert torch.equal(wide_ids, top_k_candidates(want_logits, 3 * K)[1])
        ids, unary = ids.view(2, BLOCK - 1, K), unary.view(2, BLOCK - 1, K)
        got = model.model.candidate_selector(ids, unary, hidden, anchors)
        want = drafter.candidate_selector(ids, unary, hidden, anchors)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("budget_rows", [None, 1, 3])
def test_candidates_match_the_reference_tie_rule_in_row_chunks(dtype, budget_rows):
    """Multiplier and softcap set, logits full of ties (raw ties, and distinct raw logits
    that the saturated ``tanh`` makes equal): the same ids, ties by ascending token id,
    and bit-identical values as the reference, whole or in chunks of 1 or 3 rows."""
    from vllm_ddtree.draft.dflash2_model import _CANDIDATE_BYTES_PER_LOGIT, ranked_candidates

    g = torch.Generator().manual_seed(3)
    rows, vocab, multiplier, softcap = 7, 96, 0.7, 3.0
    logits = torch.randn(rows, vocab, generator=g) * 4
    logits[0] = 0.0  # one tie group: the K smallest ids
    logits[1, 10:40] = 200.0 + torch.arange(30.0)  # distinct raw, all 3.0 after the cap
    logits[2, ::3] = logits[2].max() + 1  # raw ties above the rest
    logits[3, 5] = float("nan")  # NaN ranks last
    logits[4] = torch.randint(-3, 4, (vocab,), generator=g).float()  # small-integer ties
    logits = logits.to(dtype)
    budget = (budget_rows or rows) * vocab * _CANDIDATE_BYTES_PER_LOGIT
    ids, unary, log_norm = ranked_candidates(logits, K, multiplier, softcap, budget)
    drafter = SimpleNamespace(output_multiplier=multiplier, softcap=softcap)
    transformed = DFlash2DraftModel.output_logits(drafter, logits)
    want_unary, want_ids = top_k_candidates(transformed, K)
    assert torch.equal(ids, want_ids) and torch.equal(unary, want_unary)
    torch.testing.assert_close(log_norm, torch.logsumexp(transformed, -1), equal_nan=True)
    assert ids[0].tolist() == list(range(K)) and ids[1].tolist() == list(range(10, 10 + K))


def test_candidate_temporaries_stay_within_the_chunk_budget():
    """No op of the ranking makes a tensor of more than a chunk's rows (a dispatch mode
    sees every op's outputs), and at the production shape (256 requests x 7 positions x
    248,320 tokens) a chunk's temporaries stay within the 512 MiB budget."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from vllm_ddtree.draft.dflash2_model import (
        _CANDIDATE_BYTES_PER_LOGIT,
        _CANDIDATE_CHUNK_BYTES,
        candidate_chunk_rows,
        ranked_candidates,
    )

    rows, vocab, chunk = 40, 500, 6
    budget = chunk * vocab * _CANDIDATE_BYTES_PER_LOGIT
    assert candidate_chunk_rows(rows, vocab, budget) == chunk

    class Largest(TorchDispatchMode):
        numel = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and func is not torch.ops.aten.slice.Tensor:
                    Largest.numel = max(Largest.numel, t.numel())
            return out

    logits = torch.randn(rows, vocab, dtype=torch.bfloat16)
    with Largest():
        ranked_candidates(logits, K, 0.7, 3.0, budget)
    assert 0 < Largest.numel <= chunk * vocab
    big = candidate_chunk_rows(256 * 7, 248_320)
    assert 1 <= big < 256 * 7
    assert big * 248_320 * _CANDIDATE_BYTES_PER_LOGIT <= _CANDIDATE_CHUNK_BYTES
    assert candidate_chunk_rows(3, 248_320) == 3 and candidate_chunk_rows(5, 10**12) == 1


def test_speculator_trees_are_the_selector_trees_of_each_request(vllm_ctx):
    from vllm_ddtree.draft.dflash2_draft import SelectorDrafting

    drafter = reference_drafter(3)
    model, _ = selector_pieces(drafter)
    reqs, depths, budget = 3, BLOCK - 1, 12
    vocab = drafter.candidate_selector.predecessor_codebook.shape[0]
    k = tree_candidates(K, budget, None, vocab)
    assert k == budget > K  # a tree ranks as many candidates as a node may have children
    drafting = SelectorDrafting(num_depths=depths, budget=budget, top_k=None,
                                block_size=BLOCK, num_candidates=k, max_num_reqs=8,
                                device=torch.device("cpu"))
    hidden = torch.randn(reqs * depths, 64)
    input_ids = torch.randint(0, 90, (8 * BLOCK,))
    out = DraftTree(tokens=torch.zeros(reqs, budget, dtype=torch.long),
                    parents=torch.zeros(reqs, budget, dtype=torch.long),
                    depths=torch.zeros(reqs, budget, dtype=torch.long),
                    scores=torch.zeros(reqs, budget),
                    packed_bits=torch.zeros(reqs, 1 + budget, 1, dtype=torch.long))
    with torch.no_grad():
        drafting.draft(model, hidden, input_ids, reqs, out)
        for r in range(reqs):
            rows = hidden.view(reqs, depths, 64)[r]
            logits = drafter.output_logits(model.compute_logits(rows))
            unary, ids = top_k_candidates(logits, k)
            mass = candidate_log_mass(unary, torch.logsumexp(logits, -1))
            anchor = input_ids[r * BLOCK : r * BLOCK + 1]
            scores = drafter.candidate_selector(ids[None], unary[None], rows[None], anchor)
            want = build_selector_tree(ids[None], scores, budget, position_log_mass=mass[None])
            assert torch.equal(out.tokens[r], want.tokens[0])
            assert torch.equal(out.parents[r], want.parents[0])
            assert torch.equal(out.packed_bits[r], want.ancestor_bits()[0])


def test_vllm_loads_the_published_layout_and_matches_the_reference(vllm_ctx, tmp_path,
                                                                    monkeypatch):
    """vLLM's model loader builds a ``DFlash2DraftModel`` checkpoint as the plugin's class
    and loads every published tensor; its layers (the attention swapped for the
    reference's, which needs vLLM's forward context), final norm, candidates and selector
    scores match the reference on the same checkpoint. vLLM-CPU runs the V1 runner only,
    which takes DFlash drafters without mixed sliding / full layers: all layers slide."""
    import functools

    from transformers import AutoModelForCausalLM
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model

    import vllm_ddtree
    from vllm_ddtree.demo.reference_engine import CHECKPOINTS
    from vllm_ddtree.draft.dflash2_model import DFlash2DecoderLayer, DFlash2Qwen3ForCausalLM
    from vllm_ddtree.training.common import load_drafter

    vllm_ddtree.register()
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    # vLLM's dflash method is only the vehicle to vLLM's model loader here (DDTree needs
    # the V2 runner, which vLLM-CPU lacks): lift the front end's refusal of DFlash2
    # drafters outside DDTree for this config
    monkeypatch.setattr("vllm_ddtree.drafter_config.refuse_dflash2_outside_ddtree",
                        lambda spec: None)
    dflash = load_drafter(CHECKPOINTS / "drafter")
    dflash.config.layer_types = ["sliding_attention"] * len(dflash.layers)
    ref = DFlash2DraftModel.from_dflash(dflash, selector_top_k=8, selector_rank=16)
    with torch.no_grad():  # move the new parts off their identity start
        g = torch.Generator().manual_seed(9)
        for name, p in ref.named_parameters():
            if "conv" in name or "selector" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
    ref.save_pretrained(tmp_path)
    ref = DFlash2DraftModel.from_pretrained(tmp_path, dtype=torch.float32).eval()
    args = EngineArgs(model=str(CHECKPOINTS / "target"), dtype="float32", max_model_len=512,
                      speculative_config={"method": "dflash", "model": str(tmp_path),
                                          "num_speculative_tokens": ref.block_size - 1})
    config = args.create_engine_config()
    with set_current_vllm_config(config):
        model = get_model(vllm_config=config,
                          model_config=config.speculative_config.draft_model_config)
    assert isinstance(model, DFlash2Qwen3ForCausalLM)
    assert all(isinstance(layer, DFlash2DecoderLayer) for layer in model.model.layers)
    for i, layer in enumerate(model.model.layers):
        for name in ("attention_conv", "mlp_conv"):
            got, want = getattr(layer, name), getattr(ref.layers[i], name)
            # (vLLM-CPU repacks linear weights after loading: those count via the forward)
            assert torch.equal(got.base_kernel, want.base_kernel)
    for name in ("predecessor_codebook", "successor_codebook"):
        assert torch.equal(getattr(model.model.candidate_selector, name),
                           getattr(ref.candidate_selector, name))

    bs = ref.block_size
    x = torch.randn(2 * bs, ref.config.hidden_size, generator=torch.Generator().manual_seed(1))
    positions = torch.arange(100, 100 + 2 * bs)
    kv = torch.zeros(0, ref.config.num_key_value_heads, ref.config.head_dim)
    none = torch.zeros(0, dtype=torch.long)

    def reference_attention(layer):
        def attention(*, positions, hidden_states):
            return torch.cat([layer.self_attn(hidden_states[i:i + bs], positions[i:i + bs],
                                              kv, kv, none, ref.rotary)
                              for i in range(0, hidden_states.shape[0], bs)])
        return attention

    with torch.no_grad():
        for mine, theirs in zip(model.model.layers, ref.layers, strict=True):
            del mine.self_attn
            mine.self_attn = reference_attention(theirs)
        hidden, residual = x, None
        for layer in model.model.layers:
            hidden, residual = layer(positions, hidden, residual)
        got = model.model.norm(hidden, residual)[0]
        want = torch.cat([ref.norm(functools.reduce(
            lambda h, layer, i=i: layer(h, positions[i:i + bs], kv, kv, none, ref.rotary),
            ref.layers, x[i:i + bs])) for i in range(0, 2 * bs, bs)])
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)

        target = AutoModelForCausalLM.from_pretrained(CHECKPOINTS / "target",
                                                      dtype=torch.float32)
        head = target.get_output_embeddings().weight
        # vLLM shares the target's head at load (and vLLM-CPU repacks it): its logits here.
        model.compute_logits = lambda h: h @ head.T
        rows = want[1:bs]
        ids, unary, _ = model.compute_candidates(rows)
        want_unary, want_ids = top_k_candidates(ref.output_logits(rows @ head.T), 8)
        assert torch.equal(ids, want_ids) and torch.equal(unary, want_unary)
        anchor = torch.tensor([7])
        got_scores = model.model.candidate_selector(ids[None], unary[None], rows[None], anchor)
        want_scores = ref.candidate_selector(ids[None], unary[None], rows[None], anchor)
        torch.testing.assert_close(got_scores, want_scores, atol=1e-4, rtol=1e-4)


def test_the_speculators_draft_step_writes_selector_trees(vllm_ctx):
    """``DDTreeSpeculator._generate_draft`` with a DFlash2 drafter (its selector_drafting
    set, the drafter forward stubbed) writes each request's selector tree, anchored at
    row 0 of its query block, into the batch buffers."""
    from test_ddtree_integration_units import BUDGET, DEPTHS, MAX_REQS, fake_speculator, new_state

    from vllm_ddtree.draft.dflash2_draft import SelectorDrafting

    drafter = reference_drafter(4)
    model, _ = selector_pieces(drafter)
    spec = fake_speculator(new_state())
    block, reqs = DEPTHS + 1, 3
    k = tree_candidates(K, BUDGET, None, drafter.candidate_selector.successor_codebook.shape[0])
    spec.selector_drafting = SelectorDrafting(
        num_depths=DEPTHS, budget=BUDGET, top_k=None, block_size=block, num_candidates=k,
        max_num_reqs=MAX_REQS, device=torch.device("cpu"))
    hidden = torch.randn(reqs * block, 64, generator=torch.Generator().manual_seed(2))
    spec._run_model = lambda *args: hidden
    spec.model = model
    spec.input_buffers = SimpleNamespace(input_ids=torch.randint(0, 90, (MAX_REQS * block,),
                                                                 dtype=torch.int32))
    spec.sample_indices[: reqs * DEPTHS] = torch.tensor(
        [r * block + k for r in range(reqs) for k in range(1, block)])
    with torch.no_grad():
        spec._generate_draft(reqs, reqs * block, None, None, None)
        rows = hidden.view(reqs, block, 64)[:, 1:]
        ids, unary, log_norm = model.compute_candidates(rows.flatten(0, 1), k)
        ids, unary = ids.view(reqs, DEPTHS, k), unary.view(reqs, DEPTHS, k)
        mass = candidate_log_mass(unary, log_norm.view(reqs, DEPTHS))
        anchors = spec.input_buffers.input_ids[::block][:reqs].long()
        scores = drafter.candidate_selector(ids, unary, rows, anchors)
    want = build_selector_tree(ids, scores, BUDGET, position_log_mass=mass)
    assert torch.equal(spec.draft_tokens[:reqs], want.tokens)
    assert torch.equal(spec.batch_parents[:reqs], want.parents)
    assert torch.equal(spec.batch_depths[:reqs], want.depths)
    torch.testing.assert_close(spec.batch_scores[:reqs], want.scores)  # fp32 op order
    assert torch.equal(spec.batch_ancestor_bits[:reqs], want.ancestor_bits())


def test_selector_drafting_makes_no_host_sync(vllm_ctx):
    """The DFlash2 draft step (candidates, selector scores, tree, ancestor bits) reads
    nothing back to the host: ``HostSyncDetector`` treats the CPU tensors as device ones."""
    from vllm_ddtree.draft.dflash2_draft import SelectorDrafting
    from vllm_ddtree.testing.sync_guard import HostSyncDetector

    drafter = reference_drafter(5)
    model, _ = selector_pieces(drafter)
    reqs, depths, budget = 4, BLOCK - 1, 32
    drafting = SelectorDrafting(num_depths=depths, budget=budget, top_k=3, block_size=BLOCK,
                                num_candidates=tree_candidates(K, budget, 3, 90),
                                max_num_reqs=8, device=torch.device("cpu"))
    out = DraftTree(tokens=torch.zeros(reqs, budget, dtype=torch.long),
                    parents=torch.zeros(reqs, budget, dtype=torch.long),
                    depths=torch.zeros(reqs, budget, dtype=torch.long),
                    scores=torch.zeros(reqs, budget),
                    packed_bits=torch.zeros(reqs, 1 + budget, 1, dtype=torch.long))
    hidden = torch.randn(reqs * depths, 64)
    input_ids = torch.randint(0, 90, (8 * BLOCK,), dtype=torch.int32)
    with torch.no_grad():
        drafting.draft(model, hidden, input_ids, reqs, out)  # warm host-made tables
        with HostSyncDetector() as detector:
            drafting.draft(model, hidden, input_ids, reqs, out)
    assert detector.count() == 0, detector.report()
