"""Shared helpers of the MLA tree-verify kernel tests."""

from __future__ import annotations

import textwrap

# Script text (run by kernel_testing.compiled_shared_memory, outside the interpreter):
# ``compiled(cfg, arch=120, page=64, has_active=False, runtime=False, kv_fp8=False)``
# compiles ``_mla_tree_fwd_kernel`` for sm_<arch> at DeepSeek's dims (16 heads,
# kv_lora_rank 512, rope 64; bf16 q, a bf16 or fp8 e4m3 latent cache; with an fp8 cache,
# ``cfg.fp8_transposed`` picks the transposed-products variant) with the tile config
# ``cfg`` and returns Triton's compiled kernel; ``shared_bytes(...)`` (same arguments)
# its shared memory in bytes. A test appends its own loop, which prints one
# JSON line.
MLA_COMPILE_PRELUDE = textwrap.dedent(
    """
    import json, triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from vllm_ddtree.attention_backends.mla_tree import MLA_TILE_CONFIGS, kernels
    from vllm_ddtree.attention_backends.mla_tree.configs import LARGE_SMEM_TILE_CONFIGS

    fn = kernels._mla_tree_fwd_kernel
    aligned = ("stride_qt", "stride_kvb", "stride_kvp", "stride_ot", "stride_os")


    def compiled(cfg, arch=120, page=64, has_active=False, runtime=False, kv_fp8=False):
        elem = "*fp8e4nv" if kv_fp8 else "*bf16"  # an fp8 cache takes vLLM's e4m3 query
        ptrs = {"Q": elem, "KV": elem, "BlockTable": "*i32",
                "SeqLens": "*i32", "QueryStartLoc": "*i32", "AncestorBits": "*i64",
                "Out": "*fp32", "Lse": "*fp32", "ActiveQueryLens": "*i32",
                "MergeBase": "*i32", "MergeCount": "*i32", "KVScale": "*fp32",
                "QScale": "*fp32"}
        consts = dict(NUM_HEADS=16, KV_LORA=512, ROPE=64, BLOCK_L=512, BLOCK_R=64,
                      PAGE_SIZE=page, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                      DOT_PRECISION="tf32", DOT_UPCAST=False, HAS_ACTIVE=has_active,
                      MIN_TILES=8, MAX_SPLITS=128, RUNTIME_SPLITS=runtime, KV_FP8=kv_fp8,
                      KV_FP8_TRANSPOSED=kv_fp8 and cfg.fp8_transposed)
        sig = {n: ptrs.get(n, "constexpr" if n in consts else
                           "fp32" if n == "qk_scale" else "i32") for n in fn.arg_names}
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
                 if n in ptrs or n in aligned}
        return triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs),
                              target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": cfg.num_warps,
                                       "num_stages": cfg.num_stages})


    def shared_bytes(*args, **kwargs):
        return compiled(*args, **kwargs).metadata.shared
    """
)
