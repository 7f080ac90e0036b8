"""Shared helpers of the KV compaction tests (tests/test_kv_compaction_kernel.py): random
verify batches (trees, walks of chosen depths, paged slot mappings) and the cache
layouts the compaction knows, as physical tensors and the backend's logical views."""

import random
from types import SimpleNamespace as NS

import torch
from kernel_testing import DEVICE

from vllm_ddtree.draft.speculator import path_compaction_slots
from vllm_ddtree.tree.draft_tree import DraftTree, build_ddtree
from vllm_ddtree.walk.follow import follow_tree

VOCAB, BUDGET, DEPTHS = 6, 12, 4
HEADS, HEAD_DIM = 2, 16


class Counted:
    """Wraps a ``@triton.jit`` kernel: ``kernel[grid](...)`` still launches it and
    records the grid."""

    def __init__(self, kernel):
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.grids.append(tuple(grid))
            return self.kernel[grid](*args, **kwargs)

        return launch


# ----------------------------------------------------------------------------------
# Random verify batches: trees, walks of chosen depths, paged slot mappings
# ----------------------------------------------------------------------------------


def ancestors(parents: list[int], node: int) -> list[int]:
    """Nodes from depth 1 down to ``node``."""
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


def walk_targets(tree: DraftTree, paths: list[list[int] | None], gen) -> torch.Tensor:
    """Target tokens ``[R, 1+B]`` whose walk accepts exactly ``paths[r]`` (random
    elsewhere; the token ``VOCAB`` matches no child, so the walk stops there)."""
    targets = torch.randint(0, VOCAB, (tree.num_requests, 1 + tree.budget), generator=gen)
    for r, path in enumerate(paths):
        row = 0
        for node in path or []:
            targets[r, row] = tree.tokens[r, node]
            row = node + 1
        targets[r, row] = VOCAB
    return targets


def make_batch(kinds, page_size, seed, *, depths=None):
    """One verify batch. ``kinds[r]``: "tree" (a random path, depth ``depths[r]`` or
    random 0..L), "chain" (the path is nodes 0, 1, .., L-1: every row in place),
    "prefill" (a chunk of rows, no tree) or "decode" (one row, no tree); ``depths[r]``
    None: random.

    Returns the tree, walk, ``query_start_loc``, slot mapping (blocks of the requests
    drawn from one shuffled pool), ``num_blocks`` and ``src, dst`` from
    ``path_compaction_slots``."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    num_reqs = len(kinds)
    logits = torch.randn(num_reqs, DEPTHS, VOCAB, generator=gen)
    for r, kind in enumerate(kinds):
        if kind == "chain":  # a dominant token per depth: the top-1 chain comes first
            logits[r, :, rng.randrange(VOCAB)] += 30.0
    tree = build_ddtree(logits, BUDGET)
    parents = tree.parents.tolist()
    tree_depths = tree.depths.tolist()

    paths = []
    for r, kind in enumerate(kinds):
        if kind == "tree":
            want = depths[r] if depths and depths[r] is not None else rng.randint(0, DEPTHS)
            deep = [n for n in range(BUDGET) if tree_depths[r][n] >= want]
            node = rng.choice(deep) if deep else max(range(BUDGET), key=tree_depths[r].__getitem__)
            paths.append(ancestors(parents[r], node)[:want])
        elif kind == "chain":
            assert parents[r][:DEPTHS] == list(range(-1, DEPTHS - 1)), parents[r]
            paths.append(list(range(DEPTHS)))
        else:
            paths.append(None)
    walk = follow_tree(tree, walk_targets(tree, paths, gen), max_depth=DEPTHS)
    kv_src_rows = walk.kv_src_rows.clone()
    for r, path in enumerate(paths):
        assert int(walk.accepted_depth[r]) == len(path or [])
        if path is None:
            kv_src_rows[r] = -1

    qlens = [1 + BUDGET if k in ("tree", "chain") else rng.randint(2, 9) if k == "prefill"
             else 1 for k in kinds]
    contexts = [rng.randint(0, 40) for _ in kinds]
    slot_mapping, num_blocks = paged_slots(contexts, qlens, page_size, gen)
    qsl = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32)
    src, dst = path_compaction_slots(slot_mapping, qsl, kv_src_rows)
    return NS(tree=tree, walk=walk, kv_src_rows=kv_src_rows, qsl=qsl, slots=slot_mapping,
              num_blocks=num_blocks, src=src, dst=dst, paths=paths, contexts=contexts,
              qlens=qlens)


def paged_slots(contexts, qlens, page_size, gen, pool=None):
    """Slots of the new rows of requests with ``contexts[r]`` cached tokens, each
    request on its own blocks drawn from ``pool`` (a shuffled list of block ids,
    consumed; default: a fresh shuffle of just enough blocks + 3). Returns the int64
    slot mapping and the number of blocks the pool must hold."""
    pages = [-(-(c + q) // page_size) for c, q in zip(contexts, qlens, strict=True)]
    if pool is None:
        pool = torch.randperm(sum(pages) + 3, generator=gen).tolist()
    num_blocks = max(pool) + 1
    slots = []
    for c, q, n in zip(contexts, qlens, pages, strict=True):
        blocks = [pool.pop(0) for _ in range(n)]
        slots += [blocks[p // page_size] * page_size + p % page_size for p in range(c, c + q)]
    return torch.tensor(slots, dtype=torch.int64), num_blocks


# ----------------------------------------------------------------------------------
# Cache layouts: physical tensor -> the backend's logical kv_cache
# ----------------------------------------------------------------------------------

LAYOUTS = {
    # MLA [nb, page, 576]
    "mla": (lambda nb, ps: (nb, ps, 576), lambda phys: phys),
    # MLA with padded rows: slot stride 640, rows of 576
    "mla_padded": (lambda nb, ps: (nb, ps, 640), lambda phys: phys[..., :576]),
    # MLA with padded pages (vLLM's unify_kv_cache_spec_page_size beside a larger
    # drafter page): blocks ps * 576 + 96 elements apart, not a whole number of rows
    "mla_page_padded": (lambda nb, ps: (nb, ps * 576 + 96),
                        lambda phys: phys[:, :-96].view(phys.shape[0], -1, 576)),
    # FlashAttention [2, nb, page, H, D]: K and V views
    "flash": (lambda nb, ps: (2, nb, ps, HEADS, HEAD_DIM), lambda phys: phys),
    # vLLM Triton / GQA tree backend: logical [nb, H, page, 2D] over [nb, page, H, 2D]
    "gqa": (lambda nb, ps: (nb, ps, HEADS, 2 * HEAD_DIM), lambda phys: phys.permute(0, 2, 1, 3)),
    # ... with padded heads: rows of H chunks of 2D (stride 2D + 8)
    "gqa_padded": (lambda nb, ps: (nb, ps, HEADS, 2 * HEAD_DIM + 8),
                   lambda phys: phys[..., : 2 * HEAD_DIM].permute(0, 2, 1, 3)),
}


def random_physical(shape, dtype, gen):
    values = torch.randn(shape, generator=gen)
    if dtype == torch.float8_e4m3fn:
        values = values.clamp(-200, 200)
    if dtype == torch.uint8:  # every byte value, NaN bit patterns of e4m3 included
        return torch.randint(0, 256, shape, generator=gen, dtype=dtype).to(DEVICE)
    return values.to(dtype).to(DEVICE)


def bits(t: torch.Tensor) -> torch.Tensor:
    """A bit-exact view for comparisons (any float dtype, NaN-safe)."""
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[
        t.element_size()])


def reference_views(views):
    """Views to run ``compact_kv_cache_`` on (fp8 has no CPU index_copy_: bit views)."""
    return [bits(v) if v.dtype == torch.float8_e4m3fn else v for v in views]


def on_device(batch):
    return batch.src.to(DEVICE), batch.dst.to(DEVICE)


