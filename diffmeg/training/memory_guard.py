"""The memory plan against the device, before the model is built: a run that cannot fit stops in one line.

`check_memory_plan` (one call from the Trainer, collective) compares `estimate_memory`'s plan for the
busiest rank with what each rank's device has: on CUDA the GPU's free memory (`torch.cuda.mem_get_info`),
on a CPU the memory available to the process, the smallest of /proc/meminfo's MemAvailable and the
headroom of every cgroup limit above it (v2 `memory.max` - `memory.current`, v1 `memory.limit_in_bytes` -
`memory.usage_in_bytes`, reclaimable file cache counted as free). Ranks on one machine share its memory
(ranks on one GPU share the GPU), so a CPU job's local ranks are counted together.

The plan is an estimate, measured against the real peak (docs/notes.md, docs/gpu.md): an H100's allocator
peaked at 0.88-0.90 of it, a CPU's resident memory (what the OOM killer sees) runs 10-30% over it. The
guard expects `PEAK_OVER_PLAN` times the plan (the favourable end of each: it refuses only runs that do
not fit even then) and refuses a run whose expected peak exceeds what the device has; `--no-memory-guard`
starts it anyway (the plan may be wrong for a setting it does not model).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import torch

from diffmeg.errors import DiffmegError
from diffmeg.run_config import RunConfig
from diffmeg.training.memory import GIB, MemoryEstimate, estimate_memory, shrink_options

PEAK_OVER_PLAN = {"cpu": 1.1, "cuda": 0.9}
"""Expected peak over the plan: a CPU's resident memory runs 10-30% over it (freed blocks glibc keeps;
docs/notes.md), an H100's allocator peaked at 0.88-0.90 of it (docs/gpu.md, the memory phase)."""

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


def memory_verdict(plan: MemoryEstimate, devices: list[DeviceMemory], run: RunConfig) -> str | None:
    """The refusal line when the expected peak of the ranks sharing a device exceeds what it has, else
    None. `devices`: every rank's (the same list on every rank, so every rank decides the same)."""
    shared: dict[tuple[str, str, str], list[DeviceMemory]] = {}
    for device in devices:
        shared.setdefault((device.host, device.device, device.unit), []).append(device)
    worst = None  # (how far over, the tightest device of the group, ranks sharing it)
    for group in shared.values():
        tightest = min(group, key=lambda d: d.available)
        need = _expected_peak(plan, tightest) * len(group)
        if need > tightest.available and (worst is None or need / max(tightest.available, 1) > worst[0]):
            worst = (need / max(tightest.available, 1), tightest, len(group))
    if worst is None:
        return None
    _, device, ranks = worst
    gib = plan.as_gib()
    kind = "cuda" if device.device.startswith("cuda") else "cpu"
    terms = (
        f"activations {gib['activations']:.1f}, loss {gib['loss_peak']:.1f}, weights, gradients and "
        f"optimizer {gib['weights'] + gib['gradients'] + gib['optimizer']:.1f} GiB"
    )
    peak = _expected_peak(plan, device) / GIB
    if kind == "cpu":
        expected = f"resident memory runs ~10% over the plan: {peak:.1f} GiB expected"
        where = "this machine"
    else:
        expected = f"the GPU allocator peaks near 0.9x the plan: {peak:.1f} GiB expected"
        where = device.device
    if ranks > 1:
        expected += f" per rank, {peak * ranks:.1f} for the {ranks} ranks of this run on {where}"
    fixes = ", ".join(flag for flag, _ in shrink_options(run, on_gpu=kind == "cuda"))
    return (
        f"the memory plan needs {plan.total / GIB:.1f} GiB per rank ({terms}; {expected}), but {where} has "
        f"{device.available / GIB:.1f} GiB ({device.source}): the run would run out of memory. To shrink it: "
        f"{fixes} (--dry-run shows the plan); or --no-memory-guard to start anyway"
    )


def _expected_peak(plan: MemoryEstimate, device: DeviceMemory) -> float:
    """Bytes one rank is expected to hold at its peak on `device` (`PEAK_OVER_PLAN`)."""
    return PEAK_OVER_PLAN["cuda" if device.device.startswith("cuda") else "cpu"] * plan.total


def check_memory_plan(run: RunConfig) -> None:
    """Refuse the run on every rank, in one line, when its plan cannot fit a rank's device (collective:
    every rank probes its own device, then all decide on everyone's figures). `--no-memory-guard`: no
    check."""
    if run.training.no_memory_guard:
        return
    mine = device_memory()
    devices = [mine]
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        devices = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(devices, mine)
    verdict = memory_verdict(estimate_memory(run), devices, run)
    if verdict is not None:
        raise DiffmegError(verdict)
