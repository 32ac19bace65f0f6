"""Which kernel torch's SDPA tries first (`--sdpa-backend`): one preference for every SDPA call of the model.

torch picks among its SDPA kernels by a fixed priority (torch 2.13: flash, memory-efficient, math, cuDNN),
so cuDNN's attention, which can be the faster one on Hopper, never runs unless asked for; only a GPU
measurement says which is faster (the campaign's "cuDNN attention first" lever).
`sdpa_preference(name)` is the context both core attentions (`diffmeg.core_attention.CoreAttention`:
DIFF V1's SDPA backend and the SDPA core of the baseline and DIFF V2) enter around their SDPA calls:
- `auto`: nothing entered, torch's own choice;
- `cudnn` / `flash` / `efficient`: that kernel first, then torch's order of the others, as a priority
  (`sdpa_kernel(..., set_priority=True)`): a shape the preferred kernel refuses still runs;
- `math`: the math kernel only. On CPU torch ignores the priority order (measured: with math listed
  first it still runs its CPU flash kernel), so math is a restriction, which never fails: math takes
  every input.
The GPU kernels (cudnn, flash, efficient) are refused where CUDA is absent (`unsupported_reason`).
"""

from __future__ import annotations

import contextlib

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from diffmeg.errors import DiffmegError

AUTO = "auto"
_KERNELS = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}
TORCH_ORDER = ("flash", "efficient", "math", "cudnn")
"""torch's own priority (`torch._C._get_sdp_priority_order()`, checked by a test), which the other kernels
keep behind the preferred one."""
SDPA_BACKENDS = (AUTO, *_KERNELS)
"""The names `--sdpa-backend` accepts."""
GPU_ONLY = ("cudnn", "flash", "efficient")


def check_name(name: str) -> None:
    """Refuse a name that is no preference, naming the choices."""
    if name not in SDPA_BACKENDS:
        raise DiffmegError(f"unknown SDPA backend {name!r}; choose one of {', '.join(SDPA_BACKENDS)}")


def unsupported_reason(name: str) -> str | None:
    """Why this preference cannot run on this machine, or None (auto and math run anywhere)."""
    check_name(name)
    if name in GPU_ONLY and not torch.cuda.is_available():
        return f"the {name} SDPA kernel needs CUDA, which this machine lacks (use auto or math)"
    return None


def priority(name: str) -> list[SDPBackend]:
    """The kernels `sdpa_kernel` gets for this preference, first choice first ([] for auto)."""
    check_name(name)
    if name == AUTO:
        return []
    if name == "math":
        return [SDPBackend.MATH]
    return [_KERNELS[name], *(_KERNELS[k] for k in TORCH_ORDER if k != name)]


def sdpa_preference(name: str) -> contextlib.AbstractContextManager:
    """The context to run SDPA calls under for this preference (a no-op for auto)."""
    kernels = priority(name)
    if not kernels:
        return contextlib.nullcontext()
    return sdpa_kernel(kernels, set_priority=len(kernels) > 1)
