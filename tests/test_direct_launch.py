# SPDX-License-Identifier: Apache-2.0
"""vllm_ddtree.direct_launch on a fake JIT function: which launches take the cached
CompiledKernel, with which arguments, and every change of specialization that must
send a launch back through Triton's JIT path (the GPU side is
tests/gpu/test_direct_launch_gpu.py)."""

from types import SimpleNamespace as NS

import pytest
import torch

from vllm_ddtree import direct_launch
from vllm_ddtree.direct_launch import DIRECT_LAUNCH_ENV, DirectLauncher


class FakeCompiled:
    def __init__(self, calls):
        self.calls, self.function, self.packed_metadata = calls, "fn-handle", "meta"

    def run(self, *args):
        self.calls.append(("run", args))


class FakeJit:
    """``kernel(x_ptr, n, y_ptr, BLOCK: constexpr, FLAG: constexpr)``."""

    arg_names = ["x_ptr", "n", "y_ptr", "BLOCK", "FLAG"]
    params = [NS(name=n, is_constexpr=n in ("BLOCK", "FLAG")) for n in arg_names]

    def __init__(self, returns=True):
        self.calls, self.returns = [], returns

    def __getitem__(self, grid):
        def launch(*args, **meta):
            self.calls.append(("jit", grid, args, meta))
            return FakeCompiled(self.calls) if self.returns else None
        return launch


@pytest.fixture
def on(monkeypatch):
    monkeypatch.setenv(DIRECT_LAUNCH_ENV, "1")
    monkeypatch.setattr(DirectLauncher, "_stream", staticmethod(lambda: 7))
    monkeypatch.setattr(DirectLauncher, "_hooks_set", staticmethod(lambda: False))


def kinds(fn):
    return [c[0] for c in fn.calls]


def test_second_launch_runs_the_compiled_kernel_with_every_argument(on):
    fn = FakeJit()
    launch = DirectLauncher(lambda: fn)
    x, y = torch.zeros(8, dtype=torch.int64), torch.zeros(8, dtype=torch.float32)
    launch((4,), x, 5, y, BLOCK=32, FLAG=True, num_warps=2)
    launch((6, 2), x, 9, y, BLOCK=32, FLAG=True, num_warps=2)  # 9: same as 5 for Triton
    assert kinds(fn) == ["jit", "run"] and launch.direct_launches == 1
    _, args = fn.calls[1]
    assert args[:7] == (6, 2, 1, 7, "fn-handle", "meta", None)
    assert args[9:] == (x, 9, y, 32, True)  # positionals, then the constexprs in order


@pytest.mark.parametrize("change", ["dtype", "misaligned", "int_one", "int_16", "int_wide",
                                    "constexpr", "option", "keyword_tensor"])
def test_every_specialization_change_goes_back_through_the_jit(on, change):
    fn = FakeJit()
    launch = DirectLauncher(lambda: fn)
    x, y = torch.zeros(16, dtype=torch.int64), torch.zeros(8)
    base = dict(args=(x, 5, y), meta=dict(BLOCK=32, FLAG=True, num_warps=2))
    launch((1,), *base["args"], **base["meta"])
    args, meta = list(base["args"]), dict(base["meta"])
    if change == "dtype":
        args[0] = x.int()
    elif change == "misaligned":
        args[0] = x[1:]  # 8 bytes past a 16-byte boundary
    elif change == "int_one":
        args[1] = 1
    elif change == "int_16":
        args[1] = 32
    elif change == "int_wide":
        args[1] = 2**40
    elif change == "constexpr":
        meta["BLOCK"] = 64
    elif change == "option":
        meta["num_warps"] = 4
    else:  # a runtime tensor passed by keyword keys by its specialization too
        args, meta = args[:2], dict(meta, y_ptr=y[1:])
    launch((1,), *args, **meta)
    assert kinds(fn) == ["jit", "jit"], change
    launch((1,), *args, **meta)
    assert kinds(fn) == ["jit", "jit", "run"], change  # the new key is cached in turn


def test_jit_path_when_off_hooked_interpreted_or_a_default_is_left_out(monkeypatch, on):
    x, y = torch.zeros(8, dtype=torch.int64), torch.zeros(8)
    for case in ("off", "hooks", "interpreter", "default"):
        fn = FakeJit(returns=case != "interpreter")
        launch = DirectLauncher(lambda fn=fn: fn)
        with monkeypatch.context() as m:
            if case == "off":
                m.setenv(DIRECT_LAUNCH_ENV, "0")
            if case == "hooks":
                m.setattr(DirectLauncher, "_hooks_set", staticmethod(lambda: True))
            meta = dict(BLOCK=32) if case == "default" else dict(BLOCK=32, FLAG=False)
            for _ in range(3):
                launch((1,), x, 5, y, **meta)
        assert kinds(fn) == ["jit"] * 3, case
        assert (launch.direct_launches, launch.jit_launches) == (0, 3), case


def test_launch_counts_sum_every_launcher(on):
    before = direct_launch.launch_counts()
    fns = [FakeJit(), FakeJit()]
    launches = [DirectLauncher(lambda fn=fn: fn) for fn in fns]
    x, y = torch.zeros(8, dtype=torch.int64), torch.zeros(8)
    for launch in launches:
        for n in (5, 7, 9):  # one JIT launch (compiles), then two direct
            launch((1,), x, n, y, BLOCK=32, FLAG=True)
    launches[0]((1,), x.int(), 5, y, BLOCK=32, FLAG=True)  # a new key: JIT again
    after = direct_launch.launch_counts()
    assert (after[0] - before[0], after[1] - before[1]) == (4, 3)
    assert [kinds(fn).count("run") for fn in fns] == [2, 2]


def test_cache_is_bounded_and_the_variable_is_checked(on, monkeypatch):
    fn = FakeJit()
    launch = DirectLauncher(lambda: fn)
    launch.max_entries = 2
    x, y = torch.zeros(8, dtype=torch.int64), torch.zeros(8)
    for block in (16, 32, 64, 64):
        launch((1,), x, 5, y, BLOCK=block, FLAG=True)
    assert kinds(fn) == ["jit", "jit", "jit", "jit"]  # the third key is never kept
    launch((1,), x, 5, y, BLOCK=32, FLAG=True)
    assert kinds(fn)[-1] == "run"
    monkeypatch.setenv(DIRECT_LAUNCH_ENV, "yes")
    with pytest.raises(ValueError, match=DIRECT_LAUNCH_ENV):
        direct_launch.direct_launch_enabled()


def test_round_kernels_still_run_in_the_interpreter_with_it_on(on):
    """With the variable on, the interpreter (CPU) keeps every launch on the JIT path
    and the round kernels give what they give with it off."""
    from vllm_ddtree.tree.store_kernel import store_trees_triton

    state = [torch.full((4, 3), -1, dtype=torch.int64) for _ in range(2)]
    bits = torch.full((4, 4, 1), -1, dtype=torch.int64)
    idx = torch.tensor([2, 0], dtype=torch.int32)
    parents = torch.tensor([[-1, 0, 1], [-1, -1, 0]])
    assert store_trees_triton(idx, parents, parents + 1, torch.zeros(2, 4, 1, dtype=torch.int64),
                              state[0], state[1], bits)
    assert state[0][2].tolist() == [-1, 0, 1] and state[1][0].tolist() == [0, 0, 1]
    from vllm_ddtree.tree.store_kernel import _STORE_TREES_LAUNCH

    assert _STORE_TREES_LAUNCH.direct_launches == 0


def test_hook_check_reads_triton_knobs_hook_chains():
    """Against the installed Triton, not a stub: its empty ``HookChain`` is no hook (the
    first GPU run read it as one and never launched directly); an added hook is."""
    knobs = pytest.importorskip("triton.knobs")
    chain = knobs.runtime.launch_enter_hook
    assert DirectLauncher._hooks_set() is False

    def hook(metadata):
        return None

    if hasattr(chain, "add"):
        chain.add(hook)
        try:
            assert DirectLauncher._hooks_set() is True
        finally:
            chain.remove(hook)
    else:  # an older Triton: a plain attribute
        knobs.runtime.launch_enter_hook = hook
        try:
            assert DirectLauncher._hooks_set() is True
        finally:
            knobs.runtime.launch_enter_hook = chain
    assert DirectLauncher._hooks_set() is False
