"""Differential attention backends behind one signature (see `reference.diff_attention_reference`).

Every backend takes batch-first tensors:
  q1, q2: [b, h, sq, d]   the two query maps of each differential head
  k1, k2: [b, g, sk, d]   the two key maps of each differential KV head (g divides h; GQA)
  v:      [b, g, sk, 2d]  the values of each differential KV head
  lam:    0-dim tensor     lambda (its gradient flows back through the backend)
and returns `(softmax(q1 k1^T s) - lam * softmax(q2 k2^T s)) v` as [b, h, sq, 2d], causal with the
queries aligned to the *end* of the keys (so a KV-cache decode step with sq < sk is causal too).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch

from diffmeg.errors import DiffmegError
from diffmeg.kernels.reference import diff_attention_reference
from diffmeg.kernels.sdpa import diff_attention_sdpa, flash_attn_available
from diffmeg.kernels.triton_diff import diff_attention_triton, triton_usable

DiffAttentionFn = Callable[..., torch.Tensor]


AUTO_BACKEND = "sdpa"
"""What `auto` runs. Measured on an H100 (bf16, 12 heads of d=128, forward+backward; the kernels phase of
benchmarks/results/campaign-nvidia-h100-80gb-hbm3-20261124T064253Z.json): the fused Triton kernel with its
best tiles takes 1.26-1.35x the time of torch's SDPA paths at every length from 2K to 16K, so `auto` is
SDPA (flash kernels) until a kernel beats it; 'triton' stays available by name."""


def backend_name(name: str) -> str:
    """The backend a name stands for (`auto` -> sdpa), refusing names this installation can never run.

    For build time: whether the backend can run on a given device is decided per call from the tensors
    (`resolve_backend`), so a module built on the CPU (use_cpu_initialization, or moved to the GPU later)
    still runs the GPU kernels there.
    """
    if name == "auto":
        return AUTO_BACKEND
    if name in ("reference", "sdpa"):
        return name
    if name == "flash" and not flash_attn_available():
        raise DiffmegError("attention backend 'flash' needs the flash-attn package (GPU builds); use 'sdpa'")
    if name == "triton" and importlib.util.find_spec("triton") is None:
        raise DiffmegError("attention backend 'triton' needs the triton package (pip install triton)")
    if name not in ("flash", "triton"):
        raise DiffmegError(
            f"attention backend {name!r} is not available in this build; use 'sdpa' or 'reference'"
        )
    return name


def resolve_backend(name: str, device_type: str) -> tuple[str, DiffAttentionFn]:
    """Map a backend name (or `auto`) to its function, with a clear error when it cannot run here."""
    if name == "auto":
        name = AUTO_BACKEND
    if name == "reference":
        return name, diff_attention_reference
    if name == "sdpa":
        return name, diff_attention_sdpa
    if name == "flash":
        if device_type != "cuda" or not flash_attn_available():
            raise DiffmegError(
                "attention backend 'flash' needs a CUDA GPU and the flash-attn package; use 'sdpa'"
            )
        from functools import partial

        return name, partial(diff_attention_sdpa, use_flash_attn=True)
    if name == "triton":
        if not triton_usable(device_type):
            raise DiffmegError(
                "attention backend 'triton' needs the triton package and a CUDA GPU "
                "(TRITON_INTERPRET=1 runs it on CPU tensors, slowly); use 'sdpa'"
            )
        return name, diff_attention_triton
    raise DiffmegError(
        f"attention backend {name!r} is not available in this build; use 'sdpa' or 'reference'"
    )
