"""diffmeg/training/hardware.py: the dense peaks by device name, none on a CPU, MFU as their fraction."""

from __future__ import annotations

import pytest
import torch

from diffmeg.errors import DiffmegError
from diffmeg.training import hardware


@pytest.mark.parametrize(
    ("name", "fp8", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", False, 989.4),
        ("NVIDIA H100 80GB HBM3", True, 1978.9),
        ("NVIDIA H100 PCIe", False, 756.0),
        ("NVIDIA H200", False, 989.4),
        ("NVIDIA A100-SXM4-80GB", False, 312.0),
        ("NVIDIA A100-SXM4-80GB", True, None),  # no fp8 on Ampere
        ("NVIDIA GeForce RTX 4090", False, None),
    ],
)
def test_dense_peaks_by_device_name(name, fp8, peak):
    assert hardware.dense_peak_tflops(name, fp8=fp8) == peak


def test_a_gpu_by_its_name_and_precision_a_cpu_never(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    gpu = torch.device("cuda", 0)
    assert hardware.peak_tflops(gpu, "bf16") == hardware.peak_tflops("cuda", "fp16") == 989.4
    assert hardware.peak_tflops(gpu, "fp8") == 1978.9
    assert hardware.peak_tflops(gpu, "fp32") is None  # a 16-bit peak would understate an fp32 run
    assert hardware.peak_tflops(torch.device("cpu"), "bf16") is None
    with pytest.raises(DiffmegError, match=r"precision 'tf32' has no peak: give one of bf16, fp16"):
        hardware.peak_tflops(gpu, "tf32")


def test_mfu_is_the_fraction_of_a_known_peak():
    assert hardware.model_flops_utilization(445.23, 989.4) == pytest.approx(0.45)
    assert hardware.model_flops_utilization(445.23, None) is None
