"""The shell scripts themselves: shellcheck-clean, and scripts/local_slurm.sh is idempotent and stops
what it started."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.slurm.helpers import LOCAL_SLURM, REPO_ROOT, port_pair

SCRIPTS = sorted(
    [*REPO_ROOT.glob("slurm/*.sh"), *REPO_ROOT.glob("examples/*.sh"), *REPO_ROOT.glob("scripts/*slurm*.sh")]
)


@pytest.mark.skipif(
    shutil.which("shellcheck") is None, reason="shellcheck is not installed (apt-get install shellcheck)"
)
def test_shellcheck_clean():
    proc = subprocess.run(
        ["shellcheck", "-x", *[str(p.relative_to(REPO_ROOT)) for p in SCRIPTS]],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout


def test_every_script_is_strict_bash():
    for path in SCRIPTS:
        text = path.read_text()
        if path.name != "common.sh":  # sourced by the recipes, which set the options
            assert text.startswith("#!/usr/bin/env bash\n"), path
            assert "\nset -euo pipefail\n" in text, path


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def test_local_slurm_usage():
    proc = subprocess.run(["bash", str(LOCAL_SLURM)], capture_output=True, text=True)
    assert proc.returncode == 2 and "usage:" in proc.stderr


def test_local_slurm_is_idempotent_and_stops_by_pid(slurm_cluster):
    env = {**slurm_cluster.env}
    again = subprocess.run(["bash", str(LOCAL_SLURM), "start"], env=env, capture_output=True, text=True)
    assert again.returncode == 0 and "already running" in again.stderr
    assert again.stdout.strip() == f"export SLURM_CONF={env['SLURM_CONF']}"
    status = subprocess.run(["bash", str(LOCAL_SLURM), "status"], env=env, capture_output=True, text=True)
    assert status.returncode == 0 and "slurmd: running" in status.stdout

    # A second, independent cluster beside the session's: start, stop, and nothing of it is left.
    directory = Path(f"/tmp/diffmeg-slurm-pytest-second-{os.getpid()}")
    second = {**env, "LOCAL_SLURM_DIR": str(directory), "LOCAL_SLURM_PORT": str(port_pair())}
    second.pop("SLURM_CONF")
    try:
        start = subprocess.run(
            ["bash", str(LOCAL_SLURM), "start"], env=second, capture_output=True, text=True, timeout=120
        )
        assert start.returncode == 0, start.stderr
        pids = [int((directory / f"{d}.pid").read_text()) for d in ("munged", "slurmctld", "slurmd")]
        assert all(_alive(pid) for pid in pids)
        stop = subprocess.run(["bash", str(LOCAL_SLURM), "stop"], env=second, capture_output=True, text=True)
        assert stop.returncode == 0
        assert not any(_alive(pid) for pid in pids)
        status = subprocess.run(
            ["bash", str(LOCAL_SLURM), "status"], env=second, capture_output=True, text=True
        )
        assert status.returncode == 3 and "slurmctld: stopped" in status.stdout
        # The session's cluster is untouched.
        assert slurm_cluster.run("sinfo", "-h", "-o", "%T").stdout.strip() in ("idle", "mixed", "allocated")
    finally:
        subprocess.run(["bash", str(LOCAL_SLURM), "stop"], env=second, capture_output=True)
        shutil.rmtree(directory, ignore_errors=True)


def test_skip_slurm_never_calls_apt_get(tmp_path):
    """DIFFMEG_SKIP_SLURM=1: local_slurm.sh refuses to install, even as root with apt-get at hand."""
    fake = tmp_path / "bin"
    fake.mkdir()
    for name, body in (("id", "echo 0"), ("apt-get", f"touch {tmp_path}/apt-get-was-called")):
        (fake / name).write_text(f"#!/bin/sh\n{body}\n")
        (fake / name).chmod(0o755)
    env = {
        "PATH": str(fake),
        "DIFFMEG_SKIP_SLURM": "1",
        "LOCAL_SLURM_DIR": str(tmp_path / "c"),
        "LOCAL_SLURM_CPUS": "2",
    }
    bash = shutil.which("bash")
    proc = subprocess.run(
        [bash, str(LOCAL_SLURM), "start"], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 1 and "DIFFMEG_SKIP_SLURM=1 (no apt-get)" in proc.stderr, proc.stderr
    assert not (tmp_path / "apt-get-was-called").exists()


def test_skip_slurm_skips_the_live_tests():
    env = {**os.environ, "DIFFMEG_SKIP_SLURM": "1"}
    env.pop("DIFFMEG_REQUIRE_SLURM", None)
    test = "tests/slurm/test_scripts.py::test_local_slurm_is_idempotent_and_stops_by_pid"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", test],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0 and "1 skipped" in proc.stdout, proc.stdout[-2000:]
    assert "DIFFMEG_SKIP_SLURM=1 (nothing is installed or started)" in proc.stdout


def test_jobs_never_inherit_the_launcher_variables(monkeypatch):
    """A MASTER_PORT left in the submitting process's environment would override each job's own port
    (from its job id) and collide between jobs side by side on one node."""
    from tests.slurm.helpers import clean_env

    monkeypatch.setenv("MASTER_PORT", "40851")
    monkeypatch.setenv("RANK", "0")
    env = clean_env(DRY_RUN="1")
    assert "MASTER_PORT" not in env and "RANK" not in env and env["DRY_RUN"] == "1"
