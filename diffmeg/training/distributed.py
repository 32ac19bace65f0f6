"""Process-group start-up under torchrun, srun (SLURM_* variables) or a single plain process, and
megatron-core's model-parallel state for a run's layout."""

from __future__ import annotations

import datetime
import os
import re
import socket
import time
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


def launch_world_size(env: dict[str, str] | None = None) -> tuple[int, str]:
    """The world size a launcher gave this process and the variable it came from (`WORLD_SIZE`,
    `SLURM_NTASKS`, or "" for a lone process), chosen as `resolve_launch_env` chooses: the argument check
    (which may plan a layout from WORLD_SIZE alone, as a dry run does) and the launch agree."""
    env = os.environ if env is None else env
    if "WORLD_SIZE" in env and ("RANK" in env or "SLURM_PROCID" not in env):
        return int(env["WORLD_SIZE"]), "WORLD_SIZE"
    if "SLURM_NTASKS" in env:
        return int(env["SLURM_NTASKS"]), "SLURM_NTASKS"
    return 1, ""


def launcher_problem(env: dict[str, str]) -> str | None:
    """Why the launch variables left in `env` cannot come from a launcher, or None.

    The rule: every launcher that asks for more than one process sets a rank with it (torchrun and
    torch.distributed.launch set RANK and MASTER_ADDR, torchrun also TORCHELASTIC_RUN_ID; srun sets
    SLURM_PROCID next to SLURM_NTASKS). So WORLD_SIZE > 1 without RANK, SLURM_NTASKS > 1 without
    SLURM_PROCID (an salloc or sbatch shell, no srun), and RANK with WORLD_SIZE > 1 but none of
    MASTER_ADDR, TORCHELASTIC_RUN_ID and SLURM_PROCID are variables left in a shell: a plain `python`
    would wait for ranks that never start, until the distributed timeout.
    """
    world, source = launch_world_size(env)
    if world <= 1:
        return None
    if source == "SLURM_NTASKS" and "SLURM_PROCID" not in env:
        return (
            f"SLURM_NTASKS={world} is set but this process was not started by srun (no SLURM_PROCID): launch "
            "it with srun (one task per GPU), or unset SLURM_NTASKS for a single process"
        )
    if source != "WORLD_SIZE":
        return None
    if "RANK" not in env:
        return (
            f"WORLD_SIZE={world} is set in the environment but RANK is not, so no launcher started "
            "this process: unset WORLD_SIZE for a single process, or launch with torchrun "
            f"--nproc_per_node {world}"
        )
    if not any(key in env for key in ("MASTER_ADDR", "TORCHELASTIC_RUN_ID", "SLURM_PROCID")):
        left = " ".join(key for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT") if key in env)
        return (
            f"WORLD_SIZE={world} and RANK={env['RANK']} are set in the environment but no launcher started "
            f"this process (no MASTER_ADDR, no TORCHELASTIC_RUN_ID): `unset {left}` for a single process, or "
            f"launch with torchrun --nproc_per_node {world}"
        )
    return None


def resolve_launch_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT from torchrun, srun, or a lone process; a
    `launcher_problem` is an error."""
    env = dict(os.environ if env is None else env)
    problem = launcher_problem(env)
    if problem is not None:
        raise DiffmegError(problem)
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


RENDEZVOUS_PATIENCE_S = 60.0
"""How long ranks started by hand (RANK/WORLD_SIZE/MASTER_ADDR set, neither torchrun nor srun) wait for each
other before stopping; launched ranks wait the full distributed timeout (srun's tasks may import slowly on a
busy shared file system; torchrun's workers start after its own rendezvous)."""


def _hand_started(env: dict[str, str]) -> bool:
    """More than one rank, and neither torchrun nor srun started this one."""
    return int(env["WORLD_SIZE"]) > 1 and not any(k in env for k in ("TORCHELASTIC_RUN_ID", "SLURM_PROCID"))


def _reachable(addr: str, port: int, patience_s: float) -> bool:
    """Whether something listens at addr:port within `patience_s` (polled with plain sockets, quietly:
    c10d's own client prints a C++ error and stack for each failed try before it gives up)."""
    deadline = time.monotonic() + patience_s
    while True:
        try:
            socket.create_connection((addr, port), timeout=1.0).close()
            return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.5)


def _joined_store(env: dict[str, str], patience_s: float, timeout: datetime.timedelta):
    """A TCPStore all WORLD_SIZE ranks joined within `patience_s`, else a one-line error naming the
    variables: the rendezvous of ranks started by hand, which never completes when the others never start."""
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    addr, port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
    fix = (
        f"`unset WORLD_SIZE RANK MASTER_ADDR MASTER_PORT` for a single process, or start all {world} ranks "
        f"with torchrun --nproc_per_node {world}"
    )
    unreachable = (
        f"rank {rank} could not reach rank 0's rendezvous at MASTER_ADDR {addr} MASTER_PORT {port} "
        f"within {patience_s:g} s, and no launcher (torchrun, srun) started this process: {fix}"
    )
    patience = datetime.timedelta(seconds=patience_s)
    if rank != 0 and not _reachable(addr, port, patience_s):  # before c10d's client: it logs every retry
        raise DiffmegError(unreachable)
    try:
        store = torch.distributed.TCPStore(
            addr, port, world, rank == 0, timeout=patience, wait_for_workers=False, multi_tenant=True
        )
    except torch.distributed.DistError as exc:
        if "EADDRINUSE" in str(exc):
            raise  # initialize_distributed's line for a port in use
        raise DiffmegError(unreachable) from None
    joined = store.add("diffmeg/joined", 1)
    deadline = time.monotonic() + patience_s
    while joined < world and time.monotonic() < deadline:
        time.sleep(0.2)
        joined = store.add("diffmeg/joined", 0)
    if joined < world:
        raise DiffmegError(
            f"only {joined} of WORLD_SIZE={world} ranks reached the rendezvous at {addr}:{port} within "
            f"{patience_s:g} s, and no launcher (torchrun, srun) started this process: {fix}"
        )
    store.set_timeout(timeout)
    return store


def initialize_distributed(
    backend: str = "auto", timeout_minutes: int = 10, patience_s: float = RENDEZVOUS_PATIENCE_S
) -> tuple[int, int]:
    """Start torch.distributed (nccl on GPU, gloo on CPU) and return (rank, world_size).

    Ranks started by hand (`_hand_started`) meet on a store of their own first, so a rank whose peers never
    start stops after `patience_s` in one line instead of the distributed timeout."""
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
    timeout = datetime.timedelta(minutes=timeout_minutes)
    try:
        store = _joined_store(env, patience_s, timeout) if _hand_started(env) else None
        torch.distributed.init_process_group(
            backend=backend, rank=rank, world_size=world, timeout=timeout, store=store
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
