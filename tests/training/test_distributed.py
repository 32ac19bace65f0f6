"""Launcher environments: torchrun, srun (SLURM_* only) and a lone process all resolve to one layout."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from diffmeg.errors import DiffmegError
from diffmeg.training.distributed import first_host, launch_world_size, launcher_problem, resolve_launch_env
from tests.conftest import REPO_ROOT, free_port


@pytest.mark.parametrize(
    "nodelist,host",
    [
        ("node7", "node7"),
        ("gpu[003-005,9]", "gpu003"),
        ("gpu[12,14],cpu1", "gpu12"),
        ("a-b-1,a-b-2", "a-b-1"),
    ],
)
def test_first_host(nodelist, host):
    assert first_host(nodelist) == host


def test_torchrun_env_wins():
    env = resolve_launch_env(
        {
            "RANK": "3",
            "WORLD_SIZE": "4",
            "MASTER_ADDR": "h",
            "MASTER_PORT": "1",
            "SLURM_PROCID": "0",
            "SLURM_NTASKS": "8",
        }
    )
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == ("3", "4", "0")


def test_srun_env():
    env = resolve_launch_env(
        {
            "SLURM_PROCID": "5",
            "SLURM_NTASKS": "16",
            "SLURM_LOCALID": "1",
            "SLURM_JOB_NODELIST": "dgx[010-011]",
            "SLURM_JOB_ID": "123456",
        }
    )
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == ("5", "16", "1")
    assert env["MASTER_ADDR"] == "dgx010" and env["MASTER_PORT"] == str(20000 + 123456 % 12000)


def test_lone_process():
    env = resolve_launch_env({})
    assert (env["RANK"], env["WORLD_SIZE"]) == ("0", "1") and int(env["MASTER_PORT"]) > 0


def test_a_rendezvous_port_in_use_is_one_line(tmp_path):
    """Two runs on one node with the same MASTER_PORT (a port inherited from the shell): the second stops
    in one line naming the port and the fix, not in torch's DistNetworkError traceback."""
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        env = {
            **os.environ,
            "RANK": "0",
            "WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        code = (
            "from diffmeg.errors import DiffmegError\n"
            "from diffmeg.training.distributed import initialize_distributed\n"
            "try:\n    initialize_distributed('gloo')\nexcept DiffmegError as exc:\n    print(exc)\n"
        )
        proc = subprocess.run(
            [sys.executable, "-c", code], env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
        )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines() == [
        f"MASTER_PORT {port} on 127.0.0.1 is already in use (another run on this node, or a MASTER_PORT "
        "inherited from the shell): unset MASTER_PORT (under Slurm each job takes one from its job id) or "
        "set a free one"
    ]


LAUNCHED = {
    "torchrun": {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
        "TORCHELASTIC_RUN_ID": "none",
    },
    "srun": {"SLURM_PROCID": "1", "SLURM_NTASKS": "4", "SLURM_JOB_ID": "7"},
    "rank variables by hand": {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"},
    "one process": {"RANK": "0", "WORLD_SIZE": "1"},
    "nothing": {},
    "WORLD_SIZE 1 alone": {"WORLD_SIZE": "1"},
}


@pytest.mark.parametrize("env", LAUNCHED.values(), ids=LAUNCHED.keys())
def test_what_launchers_set_is_no_problem(env):
    assert launcher_problem(env) is None
    assert resolve_launch_env(env)["WORLD_SIZE"] == str(launch_world_size(env)[0])


LEFT_IN_THE_SHELL = {
    "WORLD_SIZE and RANK": (
        {"WORLD_SIZE": "2", "RANK": "0"},
        "WORLD_SIZE=2 and RANK=0 are set in the environment but no launcher started this process (no "
        "MASTER_ADDR, no TORCHELASTIC_RUN_ID): `unset WORLD_SIZE RANK` for a single process, or launch with "
        "torchrun --nproc_per_node 2",
    ),
    "WORLD_SIZE alone": (
        {"WORLD_SIZE": "8"},
        "WORLD_SIZE=8 is set in the environment but RANK is not, so no launcher started this process: unset "
        "WORLD_SIZE for a single process, or launch with torchrun --nproc_per_node 8",
    ),
    "salloc's SLURM_NTASKS": (
        {"SLURM_NTASKS": "4", "SLURM_JOB_ID": "7"},
        "SLURM_NTASKS=4 is set but this process was not started by srun (no SLURM_PROCID): launch it with "
        "srun (one task per GPU), or unset SLURM_NTASKS for a single process",
    ),
}


@pytest.mark.parametrize("env,line", LEFT_IN_THE_SHELL.values(), ids=LEFT_IN_THE_SHELL.keys())
def test_launch_variables_no_launcher_set_are_one_line(env, line):
    with pytest.raises(DiffmegError) as err:
        resolve_launch_env(env)
    assert str(err.value) == line


def _plain_env(**launch: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return {**env, "PYTHONPATH": str(REPO_ROOT), "TORCHDYNAMO_DISABLE": "1", **launch}


def test_a_plain_python_with_world_size_left_stops_before_any_rendezvous(tmp_path):
    """`WORLD_SIZE=2 RANK=0 python pretrain_diff.py` (no torchrun): one line at once, not the 10-minute
    distributed timeout."""
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO_ROOT / "pretrain_diff.py"),
            "--model",
            "diff-tiny",
            "--lr-warmup-iters",
            "0",
        ],
        env=_plain_env(WORLD_SIZE="2", RANK="0"),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [f"error: {LEFT_IN_THE_SHELL['WORLD_SIZE and RANK'][1]}"]


@pytest.mark.parametrize("rank", [0, 1])
def test_ranks_started_by_hand_whose_peers_never_come_stop_in_one_line(rank):
    """RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT all set by hand, the other rank never started: rank 0 waits
    for it, rank 1 for rank 0's store, each only the patience given, then one line naming the variables."""
    port = free_port()
    code = (
        "from diffmeg.errors import DiffmegError\n"
        "from diffmeg.training.distributed import initialize_distributed\n"
        "try:\n    initialize_distributed('gloo', patience_s=1)\n"
        "except DiffmegError as exc:\n    print(exc)\n"
    )
    env = _plain_env(WORLD_SIZE="2", RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    fix = (
        "within 1 s, and no launcher (torchrun, srun) started this process: `unset WORLD_SIZE RANK "
        "MASTER_ADDR MASTER_PORT` for a single process, or start all 2 ranks with torchrun --nproc_per_node 2"
    )
    waited = {
        0: f"only 1 of WORLD_SIZE=2 ranks reached the rendezvous at 127.0.0.1:{port} ",
        1: f"rank 1 could not reach rank 0's rendezvous at MASTER_ADDR 127.0.0.1 MASTER_PORT {port} ",
    }
    assert proc.stdout.strip().splitlines() == [waited[rank] + fix]


def test_ranks_started_by_hand_meet(tmp_path):
    """Two ranks started by hand (no launcher) with the same variables join one group and all-reduce."""
    code = (
        "import torch\n"
        "from diffmeg.training.distributed import initialize_distributed\n"
        "initialize_distributed('gloo')\n"
        "t = torch.ones(1)\ntorch.distributed.all_reduce(t)\nprint(int(t.item()))\n"
        "torch.distributed.destroy_process_group()\n"
    )
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            env=_plain_env(WORLD_SIZE="2", RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=port),
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    assert [out.strip() for out, _ in outs] == ["2", "2"]
