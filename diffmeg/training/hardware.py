"""What the device has: the dense peak FLOP/s of the GPUs we run on (the denominator of MFU), and the memory
a rank may still use (what the memory guard holds the plan against).

MFU (model FLOPs utilization) is the model FLOP/s a step reaches (`diffmeg.training.flops`) over the
device's datasheet peak for the precision the matmuls run in. The peaks are the dense ones (no 2:4
sparsity), as the field quotes MFU. The training log and the benchmarks read this one table, so both
report MFU against the same number.

Memory (`device_memory`): on CUDA the GPU's free memory (`torch.cuda.mem_get_info`), on a CPU the memory
available to the process, the smallest of /proc/meminfo's MemAvailable and the headroom of every cgroup
limit above it (v2 `memory.max` - `memory.current`, v1 `memory.limit_in_bytes` - `memory.usage_in_bytes`,
reclaimable file cache counted as free).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import torch

from diffmeg.errors import DiffmegError

GIB = 1024**3

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


NO_LIMIT = 2**60
"""cgroup v1 writes "no limit" as a page-rounded 2^63 - 1; anything above this is no limit."""


@dataclass(frozen=True)
class DeviceMemory:
    """What one rank's device has for the run."""

    device: str
    """Which memory, as the message names it: "cpu" or "cuda:N"."""
    host: str
    available: int
    """Bytes the run may still use there."""
    source: str
    """Where `available` comes from, for the message (e.g. "MemAvailable", "cgroup memory.max 8.0 GiB")."""
    unit: str = ""
    """Which physical memory: the ranks of one host with the same `unit` share it ("" for a CPU: the host's;
    a GPU's UUID, as each rank may see its own GPU as cuda:0)."""

    @property
    def kind(self) -> str:
        """"cuda" or "cpu": the device type, as `PEAK_OVER_PLAN` and the shrink options key it."""
        return "cuda" if self.device.startswith("cuda") else "cpu"


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _stat_field(path: str, name: str) -> int:
    """One field of a cgroup memory.stat (0 when absent)."""
    for line in (_read(path) or "").splitlines():
        key, _, value = line.partition(" ")
        if key == name and value.isdigit():
            return int(value)
    return 0


def mem_available(proc: str = "/proc") -> int | None:
    """/proc/meminfo's MemAvailable in bytes (None where there is none)."""
    for line in (_read(os.path.join(proc, "meminfo")) or "").splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


def _cgroup_dirs(root: str, path: str) -> list[str]:
    """The cgroup directory of this process under `root` and every parent up to `root` (limits nest: the
    tightest one counts). Inside a container the path may not exist under the mount: then `root` itself."""
    dirs, path = [], path.strip("/")
    while path:
        candidate = os.path.join(root, path)
        if os.path.isdir(candidate):
            dirs.append(candidate)
        path = os.path.dirname(path)
    return [*dirs, root]


def cgroup_headroom(proc: str = "/proc", sys_cgroup: str = "/sys/fs/cgroup") -> tuple[int, str] | None:
    """(bytes the tightest cgroup memory limit of this process still allows, which limit), or None when
    no cgroup limits its memory. Usage counts without the inactive file cache, which the kernel reclaims
    before it kills (as `docker stats` and the kubelet count a container's working set)."""
    tightest: tuple[int, str] | None = None
    for line in (_read(os.path.join(proc, "self", "cgroup")) or "").splitlines():
        if line.count(":") < 2:
            continue
        hierarchy, controllers, path = line.split(":", 2)
        if hierarchy == "0" and controllers == "":  # v2 (unified), at the mount or beside v1 ones
            roots = [sys_cgroup, os.path.join(sys_cgroup, "unified")]
            limit_file, usage_file, inactive = "memory.max", "memory.current", "inactive_file"
        elif "memory" in controllers.split(","):
            roots = [os.path.join(sys_cgroup, "memory")]
            limit_file, usage_file = "memory.limit_in_bytes", "memory.usage_in_bytes"
            inactive = "total_inactive_file"
        else:
            continue
        for root in roots:
            for directory in _cgroup_dirs(root, path) if os.path.isdir(root) else []:
                limit = _read(os.path.join(directory, limit_file))
                usage = _read(os.path.join(directory, usage_file))
                if limit is None or not limit.isdigit() or int(limit) >= NO_LIMIT or usage is None:
                    continue
                reclaimable = _stat_field(os.path.join(directory, "memory.stat"), inactive)
                left = max(0, int(limit) - max(0, int(usage) - reclaimable))
                if tightest is None or left < tightest[0]:
                    tightest = (left, f"cgroup {limit_file} {int(limit) / GIB:.1f} GiB")
    return tightest


def cpu_memory(proc: str = "/proc", sys_cgroup: str = "/sys/fs/cgroup") -> tuple[int, str]:
    """(bytes available to this process on this machine, where the figure comes from)."""
    options = []
    if (available := mem_available(proc)) is not None:
        options.append((available, "MemAvailable"))
    if (headroom := cgroup_headroom(proc, sys_cgroup)) is not None:
        options.append(headroom)
    if not options:  # no /proc (not Linux): nothing to compare with
        return NO_LIMIT, "unknown"
    return min(options)


def device_memory() -> DeviceMemory:
    """This rank's device and what it has."""
    host = socket.gethostname()
    if torch.cuda.is_available():
        index = torch.cuda.current_device()
        free, total = torch.cuda.mem_get_info(index)
        unit = str(getattr(torch.cuda.get_device_properties(index), "uuid", index))
        return DeviceMemory(f"cuda:{index}", host, free, f"free of the GPU's {total / GIB:.1f} GiB", unit)
    available, source = cpu_memory()
    return DeviceMemory("cpu", host, available, source)
