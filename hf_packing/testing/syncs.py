"""Count the host syncs a piece of code issues, and the tensors it makes from host data, by the Python frame that
issued them (a CPU proxy for the GPU).

On a GPU these ops make the host wait until the device has drained its queue; on CPU they run without waiting,
but the same ops are issued, so counting them on CPU predicts the GPU step's syncs::

    aten op (TorchDispatchMode)                 why it waits for the device
    _local_scalar_dense                         .item(), int(t), bool(t), `if t:`: a value read on the host
    nonzero, masked_select, boolean index       output shape depends on the data
    masked_scatter_backward                     the same (the gradient of the scattered source, by the mask)
    unique*, repeat_interleave (no output_size) output shape depends on the data

``Tensor.tolist()`` copies device memory to the host without a dispatched scalar op, so a dispatch mode never
sees it; `SyncCounter` records it separately (``host_reads``, through a ``TorchFunctionMode``), because on a
GPU it waits too. ``torch._assert_async`` is not a sync (it raises on the device) and is not counted.

Tensors created from host data inside the counted block are recorded as ``creations`` (a ``TorchFunctionMode``,
and ``torch.from_numpy``, which no mode sees, swapped for the block): on a GPU each is a host-to-device copy from
pageable memory, which ends in a stream synchronisation, and it is invisible to the dispatch mode::

    call                                             counted as
    torch.tensor / as_tensor / asarray (host data)   tensor / as_tensor / asarray   (Python numbers, lists, numpy)
    torch.from_numpy(array)                          from_numpy
    t.new_tensor(host data)                          new_tensor
    cpu_tensor.to(device) / .cuda() / dst.copy_(cpu_tensor), to or into an accelerator     h2d

A creation counts wherever its tensor lands: on CPU the step runs on host tensors and the target device cannot
tell it apart, so ``torch.tensor(lengths)`` counts as ``torch.tensor(lengths, device="cuda")`` would. Factories
with no host data (``zeros``, ``full``, ``arange``) are kernels on the device and are not counted.

Each sync is attributed to the first stack frame outside torch (``torch/``, ``torch.utils``, this module), e.g.
``hf_packing/ops/loss.py:123 linear_cross_entropy_sum`` or ``transformers/models/qwen2_vl/modeling_qwen2_vl.py:..``.
"""

from __future__ import annotations

import collections
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_TORCH_DIR = str(Path(torch.__file__).parent)
_THIS_FILE = str(Path(__file__))
#: the folder holding the hf_packing package (a checkout's root), so origins read ``hf_packing/...``, ``tests/...``
_REPO_DIR = str(Path(__file__).parents[2]) + "/"
_ALWAYS_SYNC = {
    "aten::_local_scalar_dense",
    "aten::nonzero",
    "aten::masked_select",
    "aten::masked_scatter_backward",  # selects the source's gradient by the mask (masked_select's size, on CUDA)
    "aten::_unique",
    "aten::_unique2",
    "aten::unique_dim",
    "aten::unique_consecutive",
    "aten::unique_dim_consecutive",
}


def _is_sync(func: Any, args: tuple, kwargs: dict) -> bool:
    name = func._schema.name
    if name in _ALWAYS_SYNC:
        return True
    if name == "aten::repeat_interleave":  # the Tensor-repeats overloads; an int repeat has a known size
        return func._overloadname != "self_int" and kwargs.get("output_size") is None
    if name in ("aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())
    return False


def origin() -> str:
    """``path:line function`` of the innermost stack frame outside torch and this module."""
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        path = frame.f_code.co_filename
        if not path.startswith(_TORCH_DIR) and path != _THIS_FILE:
            if "site-packages/" in path:
                path = path.split("site-packages/", 1)[1]
            elif path.startswith(_REPO_DIR):  # a checkout, whatever its folder is called (even hf_packing/)
                path = path[len(_REPO_DIR) :]
            return f"{path}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back
    return "<torch>"


class _Dispatch(TorchDispatchMode):
    def __init__(self, counter: SyncCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_sync(func, args, kwargs):
            self.counter.syncs[(func._schema.name.removeprefix("aten::"), origin())] += 1
        return func(*args, **kwargs)


#: factories whose first argument is the data: host data (anything but a tensor) makes a host-to-device copy
_FROM_DATA = {torch.tensor: "tensor", torch.as_tensor: "as_tensor", torch.asarray: "asarray"}


def _is_accelerator(device: Any) -> bool:
    if isinstance(device, int):  # a bare index means a CUDA device
        return True
    if isinstance(device, (str, torch.device)):
        return torch.device(device).type not in ("cpu", "meta")
    return False


def _to_device(args: tuple, kwargs: dict) -> Any:
    """The target device of ``Tensor.to(...)``'s arguments (``None`` if it names none)."""
    device = kwargs.get("device")
    for arg in args[1:]:
        if isinstance(arg, (str, torch.device, int)) and not isinstance(arg, bool):
            device = arg
        elif isinstance(arg, torch.Tensor):  # .to(other): its device
            device = arg.device
    return device


def _creation(func: Any, args: tuple, kwargs: dict) -> str | None:
    """What `SyncCounter` records ``func(*args, **kwargs)`` as in ``creations``, or ``None``."""
    name = _FROM_DATA.get(func)
    if name is not None:
        data = args[0] if args else kwargs.get("data", kwargs.get("obj"))
        return None if isinstance(data, torch.Tensor) else name
    if func is torch.Tensor.new_tensor:
        data = args[1] if len(args) > 1 else kwargs.get("data")
        return None if isinstance(data, torch.Tensor) else "new_tensor"
    if func is torch.Tensor.to and args and isinstance(args[0], torch.Tensor) and args[0].device.type == "cpu":
        return "h2d" if _is_accelerator(_to_device(args, kwargs)) else None
    if func is torch.Tensor.cuda and args and isinstance(args[0], torch.Tensor) and args[0].device.type == "cpu":
        return "h2d"
    if func is torch.Tensor.copy_ and len(args) > 1 and isinstance(args[1], torch.Tensor):
        return "h2d" if args[1].device.type == "cpu" and _is_accelerator(args[0].device) else None
    return None


class _Function(TorchFunctionMode):
    def __init__(self, counter: SyncCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.tolist:
            self.counter.host_reads[("tolist", origin())] += 1
        else:
            made = _creation(func, args, kwargs)
            if made is not None:
                self.counter.creations[(made, origin())] += 1
        return func(*args, **kwargs)


class SyncCounter:
    """Context manager: counts syncing ops (``syncs``), ``tolist`` host reads (``host_reads``) and tensors created
    from host data (``creations``), each by origin.

    ``syncs`` / ``host_reads`` / ``creations``: ``Counter`` keyed by ``(op, "path:line function")``.
    """

    def __init__(self) -> None:
        self.syncs: collections.Counter[tuple[str, str]] = collections.Counter()
        self.host_reads: collections.Counter[tuple[str, str]] = collections.Counter()
        self.creations: collections.Counter[tuple[str, str]] = collections.Counter()
        self._modes = (_Function(self), _Dispatch(self))
        self._from_numpy: Callable[..., torch.Tensor] = torch.from_numpy

    def __enter__(self) -> SyncCounter:
        for mode in self._modes:
            mode.__enter__()
        original = self._from_numpy = torch.from_numpy  # a C function no mode sees: counted by a stand-in

        def from_numpy(array):
            self.creations[("from_numpy", origin())] += 1
            return original(array)

        torch.from_numpy = from_numpy
        return self

    def __exit__(self, *exc) -> None:
        torch.from_numpy = self._from_numpy
        for mode in reversed(self._modes):
            mode.__exit__(*exc)

    @property
    def total(self) -> int:
        """Syncing ops, every origin."""
        return sum(self.syncs.values())

    @property
    def created(self) -> int:
        """Tensors created from host data, every origin."""
        return sum(self.creations.values())

    def by(self, package: str, kind: str = "syncs") -> int:
        """Events of ``kind`` (``"syncs"``, ``"host_reads"`` or ``"creations"``) whose origin path starts with
        ``package`` (e.g. ``"hf_packing/"``, ``"transformers/"``)."""
        return sum(n for (_, where), n in getattr(self, kind).items() if where.startswith(package))

    def report(self) -> str:
        """The totals and one line per (op, origin), for a test's or benchmark's printout."""

        def lines(counter: collections.Counter) -> list[str]:
            return [f"{n:4d}  {op:24s} {where}" for (op, where), n in sorted(counter.items(), key=lambda kv: kv[0][1])]

        reads = sum(self.host_reads.values())
        return "\n".join(
            [
                f"syncs: {self.total}",
                *lines(self.syncs),
                f"tolist host reads: {reads}",
                *lines(self.host_reads),
                f"host-data creations: {self.created}",
                *lines(self.creations),
            ]
        )
