"""Launcher environments: torchrun, srun (SLURM_* only) and a lone process all resolve to one layout."""

from __future__ import annotations

import pytest

from diffmeg.training.distributed import first_host, resolve_launch_env


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
    import os
    import socket
    import subprocess
    import sys

    from tests.conftest import REPO_ROOT

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
