"""Process-group start-up under torchrun, srun (SLURM_* variables) or a single plain process."""

from __future__ import annotations

import datetime
import os
import re
import socket

import torch

from diffmeg.errors import DiffmegError


def slurm_master_port(job_id: str) -> int:
    """The rendezvous port of a Slurm job: 20000-31999, from its job id."""
    return 20000 + int(job_id) % 12000


def first_host(nodelist: str) -> str:
    """First host of a Slurm node list such as `gpu[003-005,9],cpu1` -> `gpu003`."""
    head = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist.strip())
    if head is None:
        raise DiffmegError(f"cannot parse SLURM_JOB_NODELIST {nodelist!r}; set MASTER_ADDR")
    prefix, ranges = head.group(1), head.group(3)
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def resolve_launch_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT from torchrun, srun, or a lone process."""
    env = dict(os.environ if env is None else env)
    if "RANK" in env and "WORLD_SIZE" in env:  # torchrun (or a user who set them)
        env.setdefault("LOCAL_RANK", "0")
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        env["RANK"], env["WORLD_SIZE"] = env["SLURM_PROCID"], env["SLURM_NTASKS"]
        env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
        if "MASTER_ADDR" not in env:
            nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "127.0.0.1"
            env["MASTER_ADDR"] = first_host(nodelist)
        # Same port on every task of the job, different between jobs sharing a node, and below Linux's
        # ephemeral range (32768+) where another program's outgoing connection may already hold it.
        env.setdefault("MASTER_PORT", str(slurm_master_port(env.get("SLURM_JOB_ID", "0"))))
    else:
        env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        env.setdefault("MASTER_ADDR", "127.0.0.1")
        env.setdefault("MASTER_PORT", str(_free_port()))
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    env.setdefault("MASTER_PORT", "29500")
    return env


def initialize_distributed(backend: str = "auto", timeout_minutes: int = 10) -> tuple[int, int]:
    """Start torch.distributed (nccl on GPU, gloo on CPU) and return (rank, world_size)."""
    env = resolve_launch_env()
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ[key] = env[key]
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    if torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise DiffmegError("--distributed-backend nccl needs CUDA; use gloo on CPU")
        torch.cuda.set_device(int(env["LOCAL_RANK"]) % torch.cuda.device_count())
    try:
        torch.distributed.init_process_group(
            backend=backend, rank=rank, world_size=world, timeout=datetime.timedelta(minutes=timeout_minutes)
        )
    except torch.distributed.DistNetworkError as exc:
        if "EADDRINUSE" not in str(exc):
            raise
        raise DiffmegError(
            f"MASTER_PORT {env['MASTER_PORT']} on {env['MASTER_ADDR']} is already in use (another run on "
            "this node, or a MASTER_PORT inherited from the shell): unset MASTER_PORT (under Slurm each job "
            "takes one from its job id) or set a free one"
        ) from None
    return rank, world
