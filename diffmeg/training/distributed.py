"""Process-group start-up under torchrun, srun (SLURM_* variables) or a single plain process, and
megatron-core's model-parallel state for a run's layout."""

from __future__ import annotations

import datetime
import os
import re
import socket
from typing import NamedTuple

import torch
from megatron.core import parallel_state

from diffmeg.errors import DiffmegError
from diffmeg.run_config import ParallelConfig


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


class ModelParallelSizes(NamedTuple):
    """megatron-core's model-parallel layout: the run's, or the one a process has set up already."""

    tensor: int
    pipeline: int
    context: int
    virtual_pipeline: int | None
    """Model chunks per pipeline rank of the interleaved schedule (None: no interleaving)."""

    @classmethod
    def set_up(cls) -> ModelParallelSizes:
        """The layout megatron-core's parallel state holds now."""
        return cls(
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_world_size(),
            parallel_state.get_context_parallel_world_size(),
            parallel_state.get_virtual_pipeline_model_parallel_world_size(),
        )


def initialize_model_parallel(parallel: ParallelConfig) -> tuple[int, int]:
    """Process groups (`initialize_distributed`) and megatron-core's model-parallel state for the run's
    layout; (rank, world size)."""
    rank, world = initialize_distributed(parallel.distributed_backend, parallel.distributed_timeout_minutes)
    if world != parallel.world_size:
        raise DiffmegError(f"world size {world} does not match the layout validated from WORLD_SIZE")
    sizes = ModelParallelSizes(
        tensor=parallel.tensor_model_parallel_size,
        pipeline=parallel.pipeline_model_parallel_size,
        context=parallel.context_parallel_size,
        virtual_pipeline=parallel.virtual_pipeline_model_parallel_size,
    )
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=sizes.tensor,
            pipeline_model_parallel_size=sizes.pipeline,
            context_parallel_size=sizes.context,
            virtual_pipeline_model_parallel_size=sizes.virtual_pipeline,
        )
    elif sizes != ModelParallelSizes.set_up():  # a process that already set up megatron-core (tests)
        raise DiffmegError(
            f"megatron-core's parallel state is set up for another layout than TP/PP/CP/VP {tuple(sizes)}"
        )
    return rank, world
