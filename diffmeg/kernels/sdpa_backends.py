"""Which kernel torch's SDPA tries first (`--sdpa-backend`, the registry's `sdpa_kernel` slot): the contexts.

torch picks among its SDPA kernels by a fixed priority (torch 2.13: flash, memory-efficient, math, cuDNN),
so cuDNN's attention, which can be the faster one on Hopper, never runs unless asked for; only a GPU
measurement says which is faster (the campaign's "cuDNN attention first" lever). Each function here is
one row's implementation: the context both core attentions (`diffmeg.core_attention.CoreAttention`)
enter around their SDPA calls (torch's own order is `contextlib.nullcontext`, entering nothing):
- `cudnn_first` / `flash_first` / `efficient_first`: that kernel first, then torch's order of the others,
  as a priority (`sdpa_kernel(..., set_priority=True)`): a shape the preferred kernel refuses still runs;
- `math_only`: the math kernel only. On CPU torch ignores the priority order (measured: with math listed
  first it still runs its CPU flash kernel), so math is a restriction, which never fails: math takes
  every input.
The GPU kernels are refused where CUDA is absent (`gpu_unavailable`, the rows' check).
"""

from __future__ import annotations

import contextlib
from functools import partial

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

TORCH_ORDER = (
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
    SDPBackend.CUDNN_ATTENTION,
)
"""torch's own priority (`torch._C._get_sdp_priority_order()`, checked by a test), which the other kernels
keep behind the preferred one."""


def _first(kernel: SDPBackend) -> contextlib.AbstractContextManager:
    return sdpa_kernel([kernel, *(k for k in TORCH_ORDER if k != kernel)], set_priority=True)


cudnn_first = partial(_first, SDPBackend.CUDNN_ATTENTION)
flash_first = partial(_first, SDPBackend.FLASH_ATTENTION)
efficient_first = partial(_first, SDPBackend.EFFICIENT_ATTENTION)


def math_only() -> contextlib.AbstractContextManager:
    return sdpa_kernel([SDPBackend.MATH])


def gpu_unavailable(device_type: str | None) -> str | None:
    """The check of the GPU kernels' rows: CUDA on this machine (build time) or CUDA tensors."""
    if (device_type is None and not torch.cuda.is_available()) or device_type not in (None, "cuda"):
        return "the GPU SDPA kernels (cudnn, flash, efficient) need CUDA, which is absent; use auto or math"
    return None
