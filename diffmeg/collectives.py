"""Small collectives (flags, counters, logged scalars, rank-0 verdicts) in one place, on the right device.

NCCL reduces CUDA tensors only ("No backend type associated with device type cpu"), gloo reduces CPU
tensors; a tensor made with `torch.tensor(...)` lands on the CPU whatever the backend, which passes every
CPU test and stops the first GPU run at its first step. So every small collective in diffmeg makes its
tensor here, on the device of the group's backend. tests/test_collectives.py scans the package
and fails if another module reduces a freshly made tensor directly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

from diffmeg.errors import DiffmegError

SUM = torch.distributed.ReduceOp.SUM
MAX = torch.distributed.ReduceOp.MAX

SUM_GRAD_OVER_TP_ATTR = "diffmeg_sum_grad_over_tp"
"""Marks a TP-replicated parameter whose per-rank gradient covers only that rank's share of the work (DIFF's
lambda vectors and head norm: its heads; PolyNorm's weights: its part of the FFN dimension): the step sums
it over the TP group once (`diffmeg.training.grads`)."""
T = TypeVar("T")


def backend_name(group=None) -> str:
    """The backend of `group` (default: the world), lower case, e.g. "nccl", "gloo", "cpu:gloo,cuda:nccl"."""
    return str(torch.distributed.get_backend(group)).lower()


def collective_device(group=None) -> torch.device:
    """Where `group`'s backend reduces: CUDA for NCCL (also when the group has a CPU backend beside it),
    the CPU for gloo and MPI, else the accelerator when there is one."""
    backend = backend_name(group)
    if "nccl" in backend:
        return _cuda()
    if backend in ("gloo", "mpi"):
        return torch.device("cpu")
    return _cuda() if torch.cuda.is_available() else torch.device("cpu")


def _cuda() -> torch.device:
    """This rank's CUDA device (the one `initialize_distributed` selected)."""
    return torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else None)


def small_tensor(values: Sequence[float], dtype: torch.dtype = torch.float64, group=None) -> torch.Tensor:
    """`values` as a 1-D tensor on the device `group`'s backend reduces on."""
    return torch.tensor(list(values), dtype=dtype, device=collective_device(group))


def all_reduce(
    values: torch.Tensor | Sequence[float], op=SUM, group=None, dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """All-reduce `values` over `group` and return the result (a tensor on the backend's device).

    A tensor already on that device is reduced in place; one elsewhere is copied there first.
    """
    if isinstance(values, torch.Tensor):
        device = collective_device(group)
        tensor = values if values.device == device else values.to(device)
    else:
        tensor = small_tensor(values, dtype, group)
    torch.distributed.all_reduce(tensor, op=op, group=group)
    return tensor


def any_rank(flag: bool, group=None) -> bool:
    """True on every rank if `flag` is true on any rank (one tiny all-reduce and a host read)."""
    return bool(all_reduce([1.0 if flag else 0.0], op=MAX, group=group).item() > 0)


def on_rank0(check: Callable[[], T]) -> T:
    """Run `check` on rank 0 only and return its result on every rank; if it raises `DiffmegError`, every
    rank raises the same one-line error (so no rank waits in a collective for a rank that stopped)."""
    message = result = None
    if torch.distributed.get_rank() == 0:
        try:
            result = check()
        except DiffmegError as exc:
            message = str(exc)
    box = [message, result]
    torch.distributed.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise DiffmegError(box[0])
    return box[1]
