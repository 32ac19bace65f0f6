"""benchmarks/data_scale.py runs end to end on small sparse datasets: a cold start reads each byte of the
`.bin` once per job, split across the ranks, and a restart none (one run at 2 ranks: the spawns are the
cost)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT
from tests.distributed.runner import job_env

ROW = re.compile(r"^ +(\S+) +(\d) +(cold|restart) +([\d.]+) +[\d.]+ / +\d+ +[\d.]+ / +\d+$", re.M)


def _rows(tmp_path, *flags: str) -> dict[tuple[str, str], float]:
    argv = [sys.executable, str(REPO_ROOT / "benchmarks" / "data_scale.py"), "--tokens", "4e6"]
    argv += ["--ranks", "2", "--dir", str(tmp_path), *flags]
    proc = subprocess.run(argv, env=job_env(tmp_path, 2), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = {(m[2], m[3]): float(m[4]) for m in ROW.finditer(proc.stdout)}
    assert len(rows) == 2, proc.stdout
    assert not list(tmp_path.glob("diffmeg-data-scale-*")), "the benchmark removes its own folder"
    return rows


@pytest.mark.slow
def test_a_cold_start_reads_the_bin_once_per_job_and_a_restart_none(tmp_path):
    rows = _rows(tmp_path)
    assert rows[("2", "cold")] == pytest.approx(4e6 * 4 / 1e9 / 2, abs=0.01)  # half the int32 GB a rank
    assert rows[("2", "restart")] == 0
