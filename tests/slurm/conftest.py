"""A real one-node Slurm on localhost for the recipe tests (scripts/local_slurm.sh), once per session.

Run as root on a machine without Slurm, this installs slurm-wlm and munge with apt-get (README "Tests");
DIFFMEG_SKIP_SLURM=1 opts out: the live Slurm tests skip and nothing is installed. Skipped with a reason
when it cannot start (not root, no Slurm and no apt-get); with DIFFMEG_REQUIRE_SLURM=1 (CI) those cases
fail instead, so the recipes are really exercised there.
Each session gets its own cluster directory, ports and job ids, so concurrent test runs do not collide.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.slurm.helpers import LOCAL_SLURM, REQUIRE_ENV, SKIP_ENV, Cluster, clean_env, port_pair


def _unavailable(reason: str):
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{REQUIRE_ENV}=1 but a local Slurm cannot be started: {reason}")
    pytest.skip(f"local Slurm not available: {reason} (set {REQUIRE_ENV}=1 to make this an error)")


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    if os.environ.get(SKIP_ENV) == "1":
        _unavailable(f"{SKIP_ENV}=1 (nothing is installed or started)")
    if os.geteuid() != 0:
        _unavailable("needs root (munged runs as user munge, slurmd as root)")
    have_slurm = all(shutil.which(c) for c in ("slurmctld", "slurmd", "sbatch", "munged"))
    if not have_slurm and not shutil.which("apt-get"):
        _unavailable("slurm-wlm/munge are not installed and apt-get is missing")
    # munged needs every directory above its socket world-executable: a fresh directory under /tmp.
    directory = Path(f"/tmp/diffmeg-slurm-pytest-{os.getpid()}")
    port = port_pair()
    env = clean_env(
        LOCAL_SLURM_DIR=str(directory),
        LOCAL_SLURM_PORT=str(port),
        # Two 2-task jobs side by side (the recipes are single-threaded while they start up).
        LOCAL_SLURM_CPUS=os.environ.get("DIFFMEG_SLURM_TEST_CPUS", "4"),
        # Job ids (hence MASTER_PORT, diffmeg.training.distributed.slurm_master_port) differ between
        # test sessions.
        LOCAL_SLURM_FIRST_JOB_ID=str(random.randrange(1000, 12000)),
    )
    start = subprocess.run(
        ["bash", str(LOCAL_SLURM), "start"], env=env, capture_output=True, text=True, timeout=900
    )
    if start.returncode != 0:
        subprocess.run(["bash", str(LOCAL_SLURM), "stop"], env=env, capture_output=True, timeout=120)
        _unavailable(f"scripts/local_slurm.sh start failed: {start.stderr.strip()[-2000:]}")
    match = re.search(r"^export SLURM_CONF=(\S+)$", start.stdout, re.M)
    assert match, start.stdout
    env["SLURM_CONF"] = match.group(1)
    cluster = Cluster(directory=directory, env=env)
    try:
        yield cluster
    finally:
        subprocess.run(["scancel", "--user=root"], env=env, capture_output=True, timeout=60)
        subprocess.run(["bash", str(LOCAL_SLURM), "stop"], env=env, capture_output=True, timeout=120)
        shutil.rmtree(directory, ignore_errors=True)
