"""diffmeg/training/hardware.py: the dense peaks by device name, none on a CPU, MFU as their fraction; the
memory a CPU process may use (MemAvailable and its cgroup limits)."""

from __future__ import annotations

import pytest
import torch

from diffmeg.errors import DiffmegError
from diffmeg.training import hardware
from diffmeg.training.hardware import GIB, cpu_memory


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


NO_LIMIT_V1 = "9223372036854771712"  # what cgroup v1 writes for "no limit"


def _machine(tmp_path, cgroup: str, files: dict[str, int | str], available_gib: float = 20.0):
    """A fake /proc (this process's cgroup line, MemAvailable) and /sys/fs/cgroup with `files`."""
    proc, sys_cgroup = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text(cgroup + "\n")
    kib = int(available_gib * GIB / 1024)
    (proc / "meminfo").write_text(f"MemTotal: {2 * kib} kB\nMemFree: {kib} kB\nMemAvailable: {kib} kB\n")
    for name, value in files.items():
        path = sys_cgroup / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{value}\n")
    return str(proc), str(sys_cgroup)


def test_cgroup_v2_limit_with_reclaimable_cache(tmp_path):
    """memory.max 8 GiB, 3 GiB used of which 1 GiB is inactive file cache: 6 GiB left, below MemAvailable."""
    files = {
        "job/memory.max": 8 * GIB,
        "job/memory.current": 3 * GIB,
        "job/memory.stat": f"anon {2 * GIB}\ninactive_file {GIB}",
        "memory.max": "max",  # the root: no limit
        "memory.current": 5 * GIB,
    }
    assert cpu_memory(*_machine(tmp_path, "0::/job", files)) == (6 * GIB, "cgroup memory.max 8.0 GiB")


def test_cgroup_v1_the_tightest_limit_on_the_path_counts(tmp_path):
    files = {
        "memory/docker/memory.limit_in_bytes": 12 * GIB,
        "memory/docker/memory.usage_in_bytes": 2 * GIB,
        "memory/docker/abc/memory.limit_in_bytes": 4 * GIB,
        "memory/docker/abc/memory.usage_in_bytes": GIB,
        "memory/memory.limit_in_bytes": NO_LIMIT_V1,
        "memory/memory.usage_in_bytes": 9 * GIB,
    }
    machine = _machine(tmp_path, "5:cpu:/\n4:memory:/docker/abc", files)
    assert cpu_memory(*machine) == (3 * GIB, "cgroup memory.limit_in_bytes 4.0 GiB")


def test_without_a_cgroup_limit_memavailable_counts(tmp_path):
    files = {"memory/memory.limit_in_bytes": NO_LIMIT_V1, "memory/memory.usage_in_bytes": GIB}
    machine = _machine(tmp_path, "4:memory:/process_api/1", files, available_gib=3.0)
    assert cpu_memory(*machine) == (3 * GIB, "MemAvailable")
