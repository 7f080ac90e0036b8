"""Detect host synchronisations (device -> host waits) in a region of PyTorch code.

A DDTree round must not make the CPU wait for the GPU: every such wait stalls the
host while the device drains its queue, and breaks CUDA-graph capture. On CUDA the
waits come from a handful of aten ops (a scalar read, a data-dependent output
shape, a blocking copy); :class:`HostSyncDetector` records them from inside a
``TorchDispatchMode``, plus the Python-level calls that never reach the dispatcher
on CPU tensors. It works on CPU tensors, so CPU tests can assert that the round
path of a GPU engine is sync-free::

    with assert_no_host_sync():
        tree = build_ddtree(logits, budget)

What it flags (each event has a kind; all kinds except ``async_copy`` count):

* ``sync``: ops that read device data on the host or size their output from it:
  ``aten._local_scalar_dense`` / ``aten.item`` (``.item()``, ``int(t)``,
  ``float(t)``, ``bool(t)``, ``if t:``, ``range(t)``, and indexing with a 0-dim
  integer tensor, which PyTorch turns into an int), ``aten.is_nonzero``,
  ``aten.equal``, ``aten.allclose``, ``aten.nonzero`` (``torch.nonzero``,
  one-argument ``torch.where``, ``argwhere``), ``aten.masked_select``, the
  ``unique`` family, ``aten.bincount``, ``aten.histc``, ``tensor_split`` at tensor
  indices, ``aten.repeat_interleave`` with tensor repeats and no ``output_size``,
  ``aten.index`` / ``aten.index_put_`` with a boolean or uint8 index (``t[mask]``,
  ``t[mask] = v``) and ``aten.masked_fill`` with a device tensor as the value. With
  autograd off (``torch.inference_mode``, as in ``DDTreeSpeculator.propose``)
  composite ops arrive undecomposed (``aten.item``, ``aten.where``, ``aten.to``);
  both forms are covered.
* ``d2h``: copies of device tensors to the host: ``.tolist()``, ``.numpy()``
  (and ``np.asarray(t)``), ``.cpu()``, ``.to("cpu")`` (patched Python methods: on
  CPU tensors they dispatch no aten op), ``aten.copy_`` into a host tensor, and on
  real devices ``aten._to_copy`` / ``aten.to`` to the CPU, all without
  ``non_blocking``.
* ``h2d``: host data turned into a tensor inside the region (``aten.lift_fresh``
  of a tensor with at least one dimension: ``torch.tensor(list)``, indexing with a
  Python list) and, on real devices, blocking host-to-device copies: PyTorch ends
  a blocking copy from pageable memory with a stream synchronize.
* ``explicit``: ``torch.cuda.synchronize``, ``torch.accelerator.synchronize``,
  ``torch.cuda.Stream.synchronize``, ``torch.cuda.Event.synchronize``.
* ``async_copy`` (recorded, not counted): ``non_blocking`` copies between host and
  device; the host must wait on an event before it reads the data.

Device tensors on a CPU run: with ``cpu_as_device=True`` (the default) every CPU
tensor counts as a device tensor, except tensors passed as ``host_tensors`` or to
:meth:`HostSyncDetector.mark_host`, tensors made from host data inside the region
(``torch.tensor``, ``torch.from_numpy``) and results of ops whose tensor inputs
are all host tensors. So ``int(query_start_loc_cpu.max())`` on a marked host
tensor is not flagged, while the same read of a tensor the round computed is.
NumPy arrays are never tensors: ``input_batch.cu_num_logits_np.tolist()`` is host
work and is not flagged. Pass ``cpu_as_device=False`` on a GPU run to flag only
tensors that really live on a device.

What it cannot see:

* work below the dispatcher: syncs inside a C++ / CUDA kernel or a custom op
  (e.g. a Triton kernel that reads a device scalar), and the caching allocator's
  ``cudaFree`` / ``cudaMalloc`` when it must grow or release memory;
* CUDA-graph replays (no ops are dispatched) and work on other threads than the
  ones that dispatch inside the region;
* on CPU runs, ``.to(device)`` where ``device`` is a ``torch.device("cpu")`` object
  (it cannot tell "to the runner's device" from "to the host"; only the string
  ``"cpu"`` and ``.cpu()`` count), and host-to-device copies of tensors made
  before the region;
* a 0-dim ``torch.tensor(5, device="cuda")`` (a small blocking copy on a GPU): 0-dim
  host tensors are not flagged, since PyTorch makes one for every Python scalar
  written with ``t[idx] = 5``, which needs no copy;
* Triton kernel launches (Python calls, no aten op; their first-call JIT and
  autotuning), which the CPU tests replace by fakes;
* ``aten.any`` / ``aten.all`` / ``max`` by themselves (they stay on the device;
  reading their result is a ``_local_scalar_dense``, which is flagged).

The GPU-side complement is ``evals/count_host_syncs.py`` (profiler trace of real
decode steps).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import weakref
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "COUNTED_KINDS",
    "HostSyncDetector",
    "HostSyncError",
    "HostSyncEvent",
    "assert_no_host_sync",
]

COUNTED_KINDS = ("sync", "d2h", "h2d", "explicit")

_aten = torch.ops.aten

# Ops that always need device data on the host (scalar read or data-dependent shape).
_SCALAR_READ = ("reads a device scalar (.item(), int(), bool(), `if t`, or indexing with "
                "a 0-dim tensor)")
# Composite ops (item, where(cond), ...) reach the dispatch mode undecomposed when
# autograd is off (torch.inference_mode), so both forms are listed.
_SYNC_OPS = {
    _aten._local_scalar_dense.default: _SCALAR_READ,
    _aten.item.default: _SCALAR_READ,
    _aten.is_nonzero.default: "bool() of a device tensor",
    _aten.equal.default: "torch.equal returns a Python bool",
    _aten.allclose.default: "torch.allclose returns a Python bool",
    _aten.nonzero.default: "output size depends on the data (nonzero / where(cond))",
    _aten.where.default: "output size depends on the data (one-argument where)",
    _aten.argwhere.default: "output size depends on the data",
    _aten.nonzero_numpy.default: "output size depends on the data",
    _aten.tensor_split.tensor_indices_or_sections: "reads the split points on the host",
    _aten.masked_select.default: "output size depends on the data",
    _aten._unique.default: "output size depends on the data",
    _aten._unique2.default: "output size depends on the data",
    _aten.unique_consecutive.default: "output size depends on the data",
    _aten.unique_dim.default: "output size depends on the data",
    _aten.unique_dim_consecutive.default: "output size depends on the data",
    _aten.bincount.default: "output size depends on the data (max of the input)",
    _aten.histc.default: "reads the data range on the host",
}

_BOOL_INDEX_OPS = {
    _aten.index.Tensor,
    _aten.index_put.default,
    _aten.index_put_.default,
    _aten._index_put_impl_.default,
}

_MASKED_FILL_TENSOR_OPS = {_aten.masked_fill.Tensor, _aten.masked_fill_.Tensor}

_REPEAT_INTERLEAVE_OPS = {_aten.repeat_interleave.Tensor, _aten.repeat_interleave.self_Tensor}

_WATCHED_OPS = (set(_SYNC_OPS) | _BOOL_INDEX_OPS | _MASKED_FILL_TENSOR_OPS
                | _REPEAT_INTERLEAVE_OPS
                | {_aten.lift_fresh.default, _aten.copy_.default, _aten._to_copy.default})

_HINTS = {
    "aten._local_scalar_dense.default": "keep the value on the device (torch.where, "
    "index with t.view(1) instead of a 0-dim t)",
    "aten.item.default": "keep the value on the device (torch.where, index with t.view(1) "
    "instead of a 0-dim t)",
    "aten.nonzero.default": "use a fixed-size mask with torch.where, or nonzero_static",
    "aten.index.Tensor": "boolean-mask indexing has a data-dependent shape: torch.where "
    "or masked_fill on fixed shapes",
    "aten.index_put_.default": "t[mask] = v: use torch.where / masked_fill_",
    "aten.repeat_interleave.Tensor": "pass output_size=",
    "aten.lift_fresh.default": "build host-made tables once (cached, before graph capture)",
}
_KIND_HINTS = {
    "d2h": "keep the data on the device, or copy non_blocking into pinned memory and wait "
    "on an event outside the round",
    "h2d": "copy non_blocking from pinned memory, or build the table once before the round",
    "explicit": "do not synchronize inside the round",
}

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_THIS_FILE = os.path.abspath(__file__)
_REPO_ROOT = Path(__file__).resolve().parents[2]
_PROJECT_DIRS = tuple(
    str(_REPO_ROOT / d) + os.sep for d in ("vllm_ddtree", "attention_backends", "patches")
)
_TESTING_DIR = str(_REPO_ROOT / "vllm_ddtree" / "testing") + os.sep
_PROJECT_PREFIXES = ("vllm_ddtree/", "attention_backends/", "patches/")
_TESTING_PREFIX = "vllm_ddtree/testing/"
_SKIP_DIRS = (_TORCH_DIR, os.path.dirname(contextlib.__file__) + os.sep + "contextlib.py")


def _short_path(filename: str) -> str:
    path = os.path.abspath(filename)
    root = str(_REPO_ROOT) + os.sep
    if path.startswith(root):
        return path[len(root):]
    marker = "site-packages" + os.sep
    if marker in path:
        return path.split(marker, 1)[1]
    return path


@dataclass(frozen=True)
class HostSyncEvent:
    """One flagged operation.

    Attributes:
        kind: ``sync``, ``d2h``, ``h2d``, ``explicit`` or ``async_copy``.
        op: the aten overload (``aten.nonzero.default``) or Python call
            (``tensor.tolist``).
        site: ``path:line in function`` of the innermost caller outside torch
            (paths relative to the repository root, or to site-packages).
        origin: innermost frame in the project's runtime code (``vllm_ddtree/``,
            ``attention_backends/``, ``patches/``; not ``vllm_ddtree/testing/``), or
            ``""`` when the region's own code made the call.
        why: what makes the op wait for the device.
        stack: up to 8 ``path:line in function`` frames, innermost first.
    """

    kind: str
    op: str
    site: str
    origin: str
    why: str
    stack: tuple[str, ...] = field(default=(), compare=False)

    @property
    def counted(self) -> bool:
        return self.kind in COUNTED_KINDS

    def describe(self) -> str:
        """``[kind] op at site <- project callers: why; fix: hint``."""
        callers = [f for f in self.stack[1:] if f.startswith(_PROJECT_PREFIXES)
                   and not f.startswith(_TESTING_PREFIX)][:3]
        where = " <- ".join([self.site, *callers])
        hint = _HINTS.get(self.op, _KIND_HINTS.get(self.kind))
        text = f"[{self.kind}] {self.op} at {where}: {self.why}"
        return f"{text}; fix: {hint}" if hint else text


class HostSyncError(AssertionError):
    """Raised by :func:`assert_no_host_sync` with the detector's report."""


# Python-level tensor methods that never reach the dispatcher for CPU tensors.
_PATCHED_TENSOR_METHODS = ("tolist", "numpy", "cpu", "to")
_ACTIVE: list[HostSyncDetector] = []
_PATCH_LOCK = threading.Lock()
_saved_methods: dict[tuple[object, str], tuple[bool, object]] = {}
_local = threading.local()


def _inside_patched_call() -> bool:
    return getattr(_local, "depth", 0) > 0


def _named_args(func, args: tuple, kwargs: dict) -> dict:
    """The op's arguments by schema name (positional and keyword)."""
    names = [arg.name for arg in func._schema.arguments]
    named = dict(zip(names, args, strict=False))
    named.update(kwargs)
    return named


def _flatten_tensors(obj) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _flatten_tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _flatten_tensors(item)


def _target_device(args: tuple, kwargs: dict) -> torch.device | str | None:
    """The device argument of ``Tensor.to(...)``, as given (None when absent)."""
    if "device" in kwargs and kwargs["device"] is not None:
        return kwargs["device"]
    for arg in args:
        if isinstance(arg, (str, torch.device)):
            return arg
        if isinstance(arg, torch.Tensor):
            return arg.device
        if isinstance(arg, int) and not isinstance(arg, bool):
            return torch.device("cuda", arg)
    return None


def _is_cpu(device) -> bool:
    return device is not None and torch.device(device).type == "cpu"


class HostSyncDetector(TorchDispatchMode):
    """Record host synchronisations of the code run inside ``with detector:``.

    Args:
        cpu_as_device: treat CPU tensors as device tensors (a CPU run standing in
            for a GPU run); see the module docstring.
        host_tensors: tensors that live on the host in the real engine (pinned
            staging buffers, ``*_cpu`` views); reading them is not a sync.

    Attributes:
        events: every :class:`HostSyncEvent`, in order.
    """

    def __init__(self, *, cpu_as_device: bool = True,
                 host_tensors: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self.cpu_as_device = cpu_as_device
        self.events: list[HostSyncEvent] = []
        # id -> weakref; a WeakSet would compare tensors with `==` on hash matches.
        self._host: dict[int, weakref.ref] = {}
        self.mark_host(*host_tensors)

    # -- results ---------------------------------------------------------------------

    @property
    def syncs(self) -> list[HostSyncEvent]:
        """The counted events (every kind but ``async_copy``)."""
        return [e for e in self.events if e.counted]

    def count(self, kind: str | None = None) -> int:
        """Number of counted events, or of events of ``kind``."""
        if kind is None:
            return len(self.syncs)
        return sum(e.kind == kind for e in self.events)

    def summary(self) -> Counter:
        """``Counter`` of ``(kind, op, site)`` over the counted events."""
        return Counter((e.kind, e.op, e.site) for e in self.syncs)

    def report(self) -> str:
        """Human-readable list of the counted events, grouped by call site."""
        syncs = self.syncs
        if not syncs:
            return "no host synchronisation"
        grouped = Counter(e.describe() for e in syncs)
        lines = [f"{len(syncs)} host synchronisation(s):"]
        lines += [f"  {n}x {text}" for text, n in grouped.items()]
        return "\n".join(lines)

    def clear(self) -> None:
        self.events.clear()

    def mark_host(self, *tensors: torch.Tensor) -> None:
        """Declare ``tensors`` host-resident (see ``host_tensors``)."""
        for t in tensors:
            self._add_host(t)

    def _add_host(self, t: torch.Tensor) -> None:
        key = id(t)
        self._host[key] = weakref.ref(t, lambda _, key=key, host=self._host: host.pop(key, None))

    def _is_host(self, t: torch.Tensor) -> bool:
        ref = self._host.get(id(t))
        return ref is not None and ref() is t

    # -- classification --------------------------------------------------------------

    def is_device(self, t: torch.Tensor) -> bool:
        """Whether ``t`` stands for a device tensor."""
        if t.device.type == "meta":
            return False
        if t.device.type != "cpu":
            return True
        return self.cpu_as_device and not self._is_host(t)

    def _record(self, kind: str, op: str, why: str) -> None:
        frames = []
        frame = sys._getframe(1)
        while frame is not None:
            filename = os.path.abspath(frame.f_code.co_filename)
            if filename != _THIS_FILE and not filename.startswith(_SKIP_DIRS):
                frames.append((filename, frame.f_lineno, frame.f_code.co_name))
            frame = frame.f_back
        text = [f"{_short_path(f)}:{line} in {name}" for f, line, name in frames]
        origin = next(
            (t for (f, _, _), t in zip(frames, text, strict=True)
             if f.startswith(_PROJECT_DIRS) and not f.startswith(_TESTING_DIR)),
            "",
        )
        site = text[0] if text else "<unknown>"
        self.events.append(HostSyncEvent(kind, op, site, origin, why, tuple(text[:8])))

    def _check_op(self, func, args: tuple, kwargs: dict) -> None:
        if func not in _WATCHED_OPS and func.overloadpacket is not _aten.to:
            return
        name = str(func)
        a = _named_args(func, args, kwargs)
        if func in _SYNC_OPS:
            first = next(_flatten_tensors(args), None)
            if first is None or self.is_device(first):
                self._record("sync", name, _SYNC_OPS[func])
        elif func in _REPEAT_INTERLEAVE_OPS:
            repeats = a.get("repeats")
            if (isinstance(repeats, torch.Tensor) and a.get("output_size") is None
                    and self.is_device(repeats)):
                self._record("sync", name, "output size is the sum of the repeats")
        elif func in _BOOL_INDEX_OPS:
            if self.is_device(a["self"]) and any(
                i is not None and i.dtype in (torch.bool, torch.uint8) for i in a["indices"]
            ):
                self._record("sync", name, "boolean-mask index: output size depends on "
                             "the data")
        elif func in _MASKED_FILL_TENSOR_OPS:
            value = a.get("value")
            if isinstance(value, torch.Tensor) and self.is_device(value):
                self._record("sync", name, "masked_fill reads a device value on the host")
        elif func is _aten.lift_fresh.default:
            if a["self"].dim() > 0:
                self._record("h2d", name, "tensor made from host data; on a GPU it "
                             "needs a host-to-device copy")
        elif func is _aten.copy_.default:
            self._check_copy(name, a["src"], self.is_device(a["self"]),
                             bool(a.get("non_blocking")))
        else:  # _to_copy, and to.* when autograd is off
            src = a["self"]
            device = a.get("device")
            if isinstance(a.get("other"), torch.Tensor):
                device = a["other"].device
            # A CPU -> CPU copy (dtype change) is no device change, even when CPU
            # tensors stand for device tensors.
            if device is not None and torch.device(device).type != src.device.type:
                self._check_copy(name, src, torch.device(device).type != "cpu",
                                 bool(a.get("non_blocking")))

    def _check_copy(self, name: str, src: torch.Tensor, dst_is_device: bool,
                    non_blocking: bool) -> None:
        src_is_device = self.is_device(src)
        if src_is_device and not dst_is_device:
            self._record("async_copy" if non_blocking else "d2h", name,
                         "device-to-host copy")
        # A 0-dim CPU source is a scalar: `copy_` fills from it without a transfer.
        elif dst_is_device and not src_is_device and src.dim() > 0:
            self._record("async_copy" if non_blocking else "h2d", name,
                         "blocking host-to-device copy (ends with a stream synchronize)")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not _inside_patched_call():
            self._check_op(func, args, kwargs)
        out = func(*args, **kwargs)
        self._propagate_host(func, args, kwargs, out)
        return out

    def _propagate_host(self, func, args: tuple, kwargs: dict, out) -> None:
        """Results of host-only computations are host tensors too."""
        outputs = list(_flatten_tensors(out))
        if not outputs:
            return
        if func is _aten.lift_fresh.default or kwargs.get("pin_memory"):
            host = True
        else:
            inputs = list(_flatten_tensors((args, kwargs)))
            host = bool(inputs) and all(self._is_host(t) for t in inputs)
        if host:
            inputs_ids = {id(t) for t in _flatten_tensors(args)}
            for t in outputs:
                if id(t) not in inputs_ids or func is _aten.lift_fresh.default:
                    self._add_host(t)

    # -- Python-level hooks ----------------------------------------------------------

    def _check_method(self, name: str, tensor: torch.Tensor, args: tuple,
                      kwargs: dict) -> None:
        if not self.is_device(tensor):
            return
        if name in ("tolist", "numpy", "cpu"):
            self._record("d2h", f"tensor.{name}", "copies device data to the host")
        elif name == "to":
            device = _target_device(args, kwargs)
            explicit_cpu = (isinstance(device, str) and device.startswith("cpu")) or (
                tensor.device.type != "cpu" and _is_cpu(device))
            if explicit_cpu:
                blocking = not kwargs.get("non_blocking", False)
                self._record("d2h" if blocking else "async_copy", "tensor.to",
                             "copies device data to the host")

    def _check_explicit(self, name: str) -> None:
        self._record("explicit", name, "blocks until the device is idle")

    def __enter__(self):
        with _PATCH_LOCK:
            if not _ACTIVE:
                _install_patches()
            _ACTIVE.append(self)
        try:
            return super().__enter__()
        except BaseException:
            self._deactivate()
            raise

    def __exit__(self, exc_type, exc, tb):
        try:
            return super().__exit__(exc_type, exc, tb)
        finally:
            self._deactivate()

    def _deactivate(self) -> None:
        with _PATCH_LOCK:
            if self in _ACTIVE:
                _ACTIVE.remove(self)
            if not _ACTIVE:
                _remove_patches()


def _tensor_method_wrapper(name: str, original):
    def wrapper(self, *args, **kwargs):
        if not _inside_patched_call():
            for detector in list(_ACTIVE):
                detector._check_method(name, self, args, kwargs)
        # Ops this call dispatches (e.g. `_to_copy` of a CUDA `.cpu()`) are part of
        # the event just recorded.
        _local.depth = getattr(_local, "depth", 0) + 1
        try:
            return original(self, *args, **kwargs)
        finally:
            _local.depth -= 1

    wrapper.__name__ = name
    wrapper.__wrapped__ = original
    return wrapper


def _explicit_sync_wrapper(name: str, original):
    def wrapper(*args, **kwargs):
        if not _inside_patched_call():
            for detector in list(_ACTIVE):
                detector._check_explicit(name)
        return original(*args, **kwargs)

    wrapper.__name__ = name
    wrapper.__wrapped__ = original
    return wrapper


def _explicit_sync_targets() -> list[tuple[object, str, str]]:
    targets = [(torch.cuda, "synchronize", "torch.cuda.synchronize"),
               (torch.cuda.Stream, "synchronize", "torch.cuda.Stream.synchronize"),
               (torch.cuda.Event, "synchronize", "torch.cuda.Event.synchronize")]
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and hasattr(accelerator, "synchronize"):
        targets.append((accelerator, "synchronize", "torch.accelerator.synchronize"))
    return targets


def _patch(owner, attr: str, wrapper) -> None:
    _saved_methods[(owner, attr)] = (attr in vars(owner), getattr(owner, attr))
    setattr(owner, attr, wrapper)


def _install_patches() -> None:
    for name in _PATCHED_TENSOR_METHODS:
        _patch(torch.Tensor, name, _tensor_method_wrapper(name, getattr(torch.Tensor, name)))
    for owner, attr, label in _explicit_sync_targets():
        _patch(owner, attr, _explicit_sync_wrapper(label, getattr(owner, attr)))


def _remove_patches() -> None:
    for (owner, attr), (own, original) in _saved_methods.items():
        if own:
            setattr(owner, attr, original)
        else:
            delattr(owner, attr)
    _saved_methods.clear()


@contextlib.contextmanager
def assert_no_host_sync(*, cpu_as_device: bool = True,
                        host_tensors: Iterable[torch.Tensor] = ()) -> Iterator[HostSyncDetector]:
    """Run the block under a :class:`HostSyncDetector`; raise :class:`HostSyncError`
    (an ``AssertionError``) with its report if anything counted was recorded."""
    detector = HostSyncDetector(cpu_as_device=cpu_as_device, host_tensors=host_tensors)
    with detector:
        yield detector
    if detector.syncs:
        raise HostSyncError(detector.report())
