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
