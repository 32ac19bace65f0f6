"""Host reads counted on a CPU: the calls that make the host wait for the GPU on a CUDA run.

On a GPU, reading a device tensor's values into Python (`.item()`, `float(t)`, `bool(t)` and `if t:`,
`.tolist()`, `torch.equal`, `torch.tensor([t, ...])`) and every operator whose output shape is the data's
(`nonzero`, `masked_select`, `unique`, `t[mask]`) waits until the stream has run everything queued before
it. On a CPU nothing waits, but the same calls are made: `host_reads()` records them, so a test can say
"no sync here" before any GPU is lent. Not counted, because a GPU does not wait for them either: a Python
scalar written through a mask (`t[mask] = 0`: for a CUDA tensor torch makes the scalar a CPU tensor and
masked-fills with it; megatron-core's cross entropy does this twice per micro-batch, its vocab-parallel
embedding under TP too, and a CPU profile shows each as an `item`), and what torch's C++ kernels read of
their own CPU arguments.
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten
READ_OPS = {
    _aten._local_scalar_dense.default: "item",  # item(), float(), int(), bool(), `if t:`
    _aten.equal.default: "equal",
    _aten.nonzero.default: "nonzero",
    _aten.masked_select.default: "masked_select",
    _aten._unique2.default: "unique",
    _aten.unique_dim.default: "unique",
    _aten.unique_consecutive.default: "unique",
}
"""Operators that read device values (the first two) or size their output by them."""
_INDEX_OPS = (_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default)
_TORCH = str(Path(torch.__file__).parent)


def _where() -> str:
    """The innermost caller outside torch and this module, as `path:line`."""
    for frame in reversed(traceback.extract_stack()):
        if not frame.filename.startswith(_TORCH) and frame.filename != __file__:
            return f"{frame.filename.split('site-packages/')[-1]}:{frame.lineno}"
    return "?"


def _tensors_in(data) -> int:
    """How many tensors a (nested) list or tuple holds."""
    if isinstance(data, list | tuple):
        return sum(1 if isinstance(x, torch.Tensor) else _tensors_in(x) for x in data)
    return 0


def _masked_index(func, args) -> bool:
    """`t[mask]`, or a write of more than one value through a mask (both run nonzero on the mask). One
    value is written by masked_fill_, from a CPU scalar on a GPU: no read."""
    if func not in _INDEX_OPS:
        return False
    if not any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1]):
        return False
    return func is _aten.index.Tensor or args[2].numel() != 1


class _Recorder(TorchDispatchMode):
    """Every operator below autograd, forward and backward: the reads among them."""

    def __init__(self, reads: list[str]) -> None:
        super().__init__()
        self.reads = reads

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        what = READ_OPS.get(func) or ("boolean-mask index" if _masked_index(func, args) else None)
        if what is not None:
            self.reads.append(f"{what} at {_where()}")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def host_reads() -> Iterator[list[str]]:
    """Collect every host read made inside the block into the list it yields, one `what at path:line`
    each (the innermost caller outside torch)."""
    reads: list[str] = []

    def reading(what: str, original: Callable) -> Callable:
        def counted(self, *args, **kwargs):
            reads.append(f"{what} at {_where()}")
            return original(self, *args, **kwargs)

        return counted

    def gathering(name: str, original: Callable) -> Callable:
        def counted(data, *args, **kwargs):  # one read per tensor in the list it is given
            reads.extend(f"torch.{name} of a tensor at {_where()}" for _ in range(_tensors_in(data)))
            return original(data, *args, **kwargs)

        return counted

    # not operators on a CPU: patched where Python calls them
    patches = [(torch.Tensor, n, reading(n, getattr(torch.Tensor, n))) for n in ("tolist", "numpy")]
    patches += [(torch, n, gathering(n, getattr(torch, n))) for n in ("tensor", "as_tensor")]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, patched in patches:
        setattr(owner, name, patched)
    try:
        with _Recorder(reads):
            yield reads
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)
