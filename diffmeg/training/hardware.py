"""What the device can do at most: the dense peak FLOP/s of the GPUs we run on, the denominator of MFU.

MFU (model FLOPs utilization) is the model FLOP/s a step reaches (`diffmeg.training.flops`) over the
device's datasheet peak for the precision the matmuls run in. The peaks are the dense ones (no 2:4
sparsity), as the field quotes MFU. The training log and the benchmarks read this one table, so both
report MFU against the same number.
"""

from __future__ import annotations

import torch

from diffmeg.errors import DiffmegError

PEAK_TFLOPS: dict[str, tuple[float, float | None]] = {
    "H100 SXM": (989.4, 1978.9),
    "H100 80GB HBM3": (989.4, 1978.9),
    "H100 NVL": (835.0, 1670.0),
    "H100 PCIe": (756.0, 1513.0),
    "H200": (989.4, 1978.9),
    "A100": (312.0, None),
}
"""Dense TFLOP/s per fragment of the device name: (bf16 or fp16, fp8); None where there is no fp8."""

PRECISIONS = ("bf16", "fp16", "fp8", "fp32")
"""What the matmuls of a run may compute in (`TrainingConfig.precision`, or fp8 with --fp8-format)."""


def dense_peak_tflops(device_name: str, fp8: bool = False) -> float | None:
    """The dense (no sparsity) 16-bit or fp8 TFLOP/s of a GPU by its name, None if the table lacks it."""
    for key, (half, f8) in PEAK_TFLOPS.items():
        if key in device_name:
            return f8 if fp8 else half
    return None


def peak_tflops(device: torch.device | str, precision: str) -> float | None:
    """The dense peak of `device` (a CUDA device, found by its name) for matmuls in `precision`.

    None on a CPU, on a GPU the table does not know, and for fp32: the table holds no fp32 (or TF32) peak,
    and MFU against a 16-bit peak would understate an fp32 run several times over.
    """
    if precision not in PRECISIONS:
        raise DiffmegError(f"precision {precision!r} has no peak: give one of {', '.join(PRECISIONS)}")
    device = torch.device(device)
    if device.type != "cuda" or precision == "fp32":
        return None
    return dense_peak_tflops(torch.cuda.get_device_name(device), fp8=precision == "fp8")


def model_flops_utilization(tflops: float, peak: float | None) -> float | None:
    """The fraction of the peak that `tflops` (model TFLOP/s per device) reach; None without a peak."""
    return tflops / peak if peak else None
