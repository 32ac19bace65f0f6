"""A multi-rank job's bad input is one line, once: `diffmeg.errors.report_error` lets one process of a
launch print it and leaves it in torchrun's error file; `python3 -m diffmeg.launch` (torchrun with the same
flags) then adds no traceback of its own, while a real crash is still reported as torchrun reports it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from diffmeg.errors import report_error

REPO = Path(__file__).resolve().parents[1]

# Workers that import only diffmeg.errors (no torch): the launches cost torchrun's own start, no more.
BAD_INPUT = """
import os, sys
sys.path.insert(0, {repo!r})
from diffmeg.errors import DiffmegError, cli_errors

@cli_errors
def main():
    raise DiffmegError("global batch 3 is not divisible by 2; change the batch size")

main()
"""

CRASH = """
import os
if os.environ["RANK"] == "1":
    raise ValueError("a bug on rank 1")
"""


def launch(tmp_path: Path, launcher: list[str], body: str) -> subprocess.CompletedProcess:
    script = tmp_path / "worker.py"
    script.write_text(body.format(repo=str(REPO)))
    env = {**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(tmp_path)}
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID"):
        env.pop(name, None)
    return subprocess.run(
        [*launcher, "--nproc_per_node", "2", "--master-port", "0", str(script)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error: ")]


def test_the_launcher_prints_a_bad_input_of_every_rank_once_and_nothing_else(tmp_path):
    proc = launch(tmp_path, [sys.executable, "-m", "diffmeg.launch"], BAD_INPUT)
    assert proc.returncode == 2, proc.stderr
    assert error_lines(proc.stderr) == ["error: global batch 3 is not divisible by 2; change the batch size"]
    assert "Traceback" not in proc.stderr and "ChildFailedError" not in proc.stderr, proc.stderr
    assert "failed (exitcode" not in proc.stderr, proc.stderr


def test_plain_torchrun_prints_it_once_and_its_summary_names_it_as_the_root_cause(tmp_path):
    proc = launch(tmp_path, [sys.executable, "-m", "torch.distributed.run"], BAD_INPUT)
    assert proc.returncode != 0
    assert len(error_lines(proc.stderr)) == 1, proc.stderr
    root_cause = proc.stderr.split("Root Cause")[1]
    assert "traceback : error: global batch 3 is not divisible by 2" in root_cause, proc.stderr


def test_a_crash_is_still_reported_as_torchrun_reports_it(tmp_path):
    proc = launch(tmp_path, [sys.executable, "-m", "diffmeg.launch"], CRASH)
    assert proc.returncode != 0
    assert "ValueError: a bug on rank 1" in proc.stderr, proc.stderr
    assert "ChildFailedError" in proc.stderr and "exitcode  : 1" in proc.stderr, proc.stderr


@pytest.fixture
def srun_task(monkeypatch, tmp_path):
    """The environment of one of srun's tasks of a 2-task job step."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)  # re-read TMPDIR
    task = {"SLURM_NTASKS": "2", "SLURM_JOB_ID": "41", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1"}
    monkeypatch.delenv("WORLD_SIZE", raising=False)  # srun sets none
    for name, value in task.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    return tmp_path


def test_the_tasks_of_one_job_step_print_the_same_line_once_and_different_lines_each(srun_task, capsys):
    report_error("error: the same for every rank")
    report_error("error: the same for every rank")  # a second task of the step
    report_error("error: only this rank's file is unreadable")
    assert capsys.readouterr().err.splitlines() == [
        "error: the same for every rank",
        "error: only this rank's file is unreadable",
    ]
    markers = srun_task / f"diffmeg-errors-{os.getuid()}"
    assert list(markers.iterdir()) == [markers / "41.0"]  # one folder per job step, in TMPDIR


def test_a_single_process_always_prints(monkeypatch, capsys):
    for name in ("WORLD_SIZE", "SLURM_NTASKS", "TORCHELASTIC_ERROR_FILE", "SLURM_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    report_error("error: one")
    report_error("error: one")
    assert capsys.readouterr().err.splitlines() == ["error: one", "error: one"]
