# SPDX-License-Identifier: Apache-2.0
"""Launch DDTree's per-round Triton kernels through their cached ``CompiledKernel``.

Steps at batch 1 are host-bound, and a ``kernel[grid](...)`` launch through Triton
3.6's ``JITFunction.run`` spends most of its host time before the CUDA launch: the
argument binder and specializer, the cache-key string, the launch-metadata and hook
checks (about 70 us of a launch under cProfile on the H200 host, 21 us of it in the
driver's launcher; twentieth session: one launch of ours took 0.06-0.14 ms of a
step's host time). :class:`DirectLauncher` keeps the ``CompiledKernel`` that the first
JIT launch returned under a key computed here, and later launches call its launcher
directly.

The key must never be coarser than Triton's specialization, or a kernel compiled under
one assumption would run under another. It holds, per argument: for tensors the dtype,
the device and whether ``data_ptr()`` is 16-byte aligned; for ints whether the value
is 1, whether it is divisible by 16, and its integer width (i32 / i64 / u64); for
bools, floats and ``None`` their type and, for bools, the value; every keyword (the
constexprs and ``num_warps``-style options) by value. That is finer than Triton's
rules (which ignore the int properties of ``do_not_specialize`` arguments), so a
miss only costs one more JIT launch. Launch hooks (profilers) and Triton's
interpreter always take the JIT path.

Off unless ``VLLM_DDTREE_DIRECT_LAUNCH=1``. Its first GPU run (twenty-first session)
never went direct: the hook check read Triton 3.6's always-present ``HookChain`` as a
registered hook (fixed; outputs were equal, since the JIT path ran). Twenty-second
session, H200: direct and JIT launches gave equal outputs, a captured direct launch
replayed, and the ddtree suite (CUDA graphs and one KV-cache group included) passed
with it on. Its effect on step time did not show above the host's noise; the per-cell
``launch_counts`` in ``bench_e2e`` now say whether the engine's launches went direct.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["DIRECT_LAUNCH_ENV", "DirectLauncher", "direct_launch_enabled", "launch_counts"]

DIRECT_LAUNCH_ENV = "VLLM_DDTREE_DIRECT_LAUNCH"
_I32 = (-(2**31), 2**31)
_I64 = (-(2**63), 2**63)


def direct_launch_enabled() -> bool:
    """``VLLM_DDTREE_DIRECT_LAUNCH`` is ``1`` (raises ``ValueError`` naming it on a value
    other than ``0`` / ``1``)."""
    raw = os.environ.get(DIRECT_LAUNCH_ENV, "0").strip()
    if raw not in ("0", "1"):
        raise ValueError(f"{DIRECT_LAUNCH_ENV}={raw!r}: use 0 or 1")
    return raw == "1"


_LAUNCHERS: list[DirectLauncher] = []  # every launcher made, for launch_counts


def launch_counts() -> tuple[int, int]:
    """``(direct, jit)``: launches of every :class:`DirectLauncher` in this process so
    far that went through a cached ``CompiledKernel`` / through Triton's JIT path (the
    benchmark reads it per cell: whether the engine's round kernels went direct)."""
    return (sum(launcher.direct_launches for launcher in _LAUNCHERS),
            sum(launcher.jit_launches for launcher in _LAUNCHERS))


def _arg_key(arg: Any) -> Any:
    if isinstance(arg, torch.Tensor):
        return (arg.dtype, arg.get_device(), arg.data_ptr() % 16 == 0)
    if isinstance(arg, bool):
        return ("b", arg)
    if isinstance(arg, int):
        width = 32 if _I32[0] <= arg < _I32[1] else 64 if _I64[0] <= arg < _I64[1] else 65
        return ("i", arg == 1, arg % 16 == 0, width)
    if isinstance(arg, float):
        return ("f",)
    if arg is None:
        return None
    return ("?", type(arg).__name__, arg)  # e.g. a dtype: by value


class DirectLauncher:
    """``launcher(grid, *args, **meta)`` launches ``kernel[grid](*args, **meta)``, through
    the cached ``CompiledKernel`` when one matches (see the module docstring).

    ``get_kernel``: returns the ``@triton.jit`` function at each call (a module global
    read late, so tests that replace the global reach the launch). ``args``: every
    non-constexpr parameter, in order; ``meta``: the constexprs (every parameter after
    the positional ones) and launch options.
    """

    max_entries = 64  # distinct keys kept per kernel; later ones stay on the JIT path

    def __init__(self, get_kernel: Callable[[], Any]) -> None:
        self.get_kernel = get_kernel
        self._compiled: dict[tuple, Any] = {}
        self._names: dict[int, tuple[list[str], set[str]]] = {}
        self.direct_launches = 0  # for tests and counters (launch_counts)
        self.jit_launches = 0
        _LAUNCHERS.append(self)

    def _signature(self, fn: Any) -> tuple[list[str], set[str]]:
        names = self._names.get(id(fn))
        if names is None:
            names = (list(getattr(fn, "arg_names", [])),
                     {p.name for p in getattr(fn, "params", [])
                      if getattr(p, "is_constexpr", False)})
            self._names[id(fn)] = names
        return names

    def __call__(self, grid: tuple[int, ...], *args: Any, **meta: Any) -> None:
        fn = self.get_kernel()
        if not direct_launch_enabled() or self._hooks_set():
            self.jit_launches += 1
            fn[grid](*args, **meta)
            return
        arg_names, constexpr_names = self._signature(fn)
        rest = arg_names[len(args):]
        if not arg_names or any(name not in meta for name in rest):
            self.jit_launches += 1
            fn[grid](*args, **meta)  # a default we would have to guess
            return

        def meta_key(name: str, value: Any) -> Any:
            # constexprs and options (num_warps, ...) compile into the kernel: by value;
            # a runtime argument passed by keyword: by its specialization.
            if name in constexpr_names or name not in arg_names:
                return _arg_key(value) if isinstance(value, torch.Tensor) else value
            return _arg_key(value)

        key = (id(fn), tuple(_arg_key(a) for a in args),
               tuple(sorted((k, meta_key(k, v)) for k, v in meta.items())))
        compiled = self._compiled.get(key)
        if compiled is None:
            self.jit_launches += 1
            compiled = fn[grid](*args, **meta)
            if (compiled is not None and hasattr(compiled, "packed_metadata")
                    and len(self._compiled) < self.max_entries):
                self._compiled[key] = compiled  # the interpreter returns nothing to keep
            return
        full = list(args) + [meta[name] for name in rest]
        grid3 = tuple(grid) + (1,) * (3 - len(grid))
        compiled.run(grid3[0], grid3[1], grid3[2], self._stream(), compiled.function,
                     compiled.packed_metadata, None, None, None, *full)
        self.direct_launches += 1

    @staticmethod
    def _hooks_set() -> bool:
        """Whether a launch hook (a profiler's) is registered: then the JIT path runs it.

        Triton 3.6 keeps the hooks in a ``HookChain`` that is never None, empty until a
        hook is added (the first GPU run read ``is not None`` and never went direct);
        a plain callable (older knobs) counts as set.
        """
        try:
            from triton import knobs
        except ImportError:  # an older Triton: no knobs module, no direct path
            return True
        runtime = knobs.runtime
        return any(hook is not None and bool(getattr(hook, "calls", True))
                   for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook))

    @staticmethod
    def _stream() -> int:
        from triton.runtime import driver

        active = driver.active
        return active.get_current_stream(active.get_current_device())
