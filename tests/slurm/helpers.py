"""Helpers of the Slurm recipe tests: a clean environment, the local cluster, jobs in flight."""

from __future__ import annotations

import os
import random
import re
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.conftest import LAUNCHER_VARIABLES

REPO_ROOT = Path(__file__).resolve().parents[2]
LOCAL_SLURM = REPO_ROOT / "scripts" / "local_slurm.sh"
REQUIRE_ENV = "DIFFMEG_REQUIRE_SLURM"
SKIP_ENV = "DIFFMEG_SKIP_SLURM"
"""Set to 1: never install or start a local Slurm; the live Slurm tests skip."""
# Knobs of the recipes that must not leak from the caller's environment into the tests.
RECIPE_KNOBS = (
    "DRY_RUN NODES GPUS_PER_NODE TP PP CP DP MICRO_BATCH SEQUENCE_PARALLEL DIST_OPTIMIZER PRECISION "
    "RECOMPUTE DATA_PATH RUNS_ROOT RUN_NAME RUN_DIR CKPT_DIR TB_DIR INIT_CKPT CONTAINER_IMAGE "
    "CONTAINER_MOUNTS PYTHON SRUN_ARGS CONFIG EXTRA_ARGS AUTO_REQUEUE MAX_RESTARTS SAVE_INTERVAL "
    "LOG_INTERVAL EVAL_INTERVAL EVAL_ITERS ARCH DIFFMEG_ROOT WORLD_SIZE RANK GPU_MEMORY_GIB "
    "TOKENS SEQ_LENGTH GLOBAL_BATCH LR MIN_LR WARMUP "  # slurm/upcycle_diff2.sh's
    "SIZE MOTIF_FOLDER"  # slurm/motif_continue.sh's
).split()
JOB_TIMEOUT_S = 900


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment for a job, without recipe knobs, SLURM_* or the launcher variables
    (each job's tasks take those from Slurm: the port from the job id)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in RECIPE_KNOBS and k not in LAUNCHER_VARIABLES and not k.startswith("SLURM_")
    }
    env.update(extra)
    return env


def port_pair() -> int:
    """A port p with p and p+1 free (slurmctld, slurmd), outside MASTER_PORT's 20000-31999 range."""
    for _ in range(200):
        port = random.randrange(41000, 49000)
        try:
            for p in (port, port + 1):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port
    raise RuntimeError("no two adjacent free ports")


@dataclass
class Cluster:
    directory: Path
    env: dict[str, str]

    def run(self, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, env=self.env, capture_output=True, text=True, check=check, timeout=60)

    def job_state(self, job_id: str) -> tuple[str, str]:
        """(state, reason) from squeue, or ("", "") once the job left the queue."""
        out = self.run("squeue", "-h", "-j", job_id, "-o", "%T %r", check=False).stdout.split()
        return (out[0], out[1]) if len(out) >= 2 else ("", "")


TERMINAL = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
}


@dataclass
class Job:
    """One `sbatch --wait` in flight, watched through scontrol: a requeued job is made to start at once
    (Slurm holds it back ~2 minutes), SIGUSR1 is sent once `signal_after` appears in its output if asked,
    and completion is seen within a second (sbatch --wait itself polls at up to 32 s intervals)."""

    name: str
    cluster: Cluster
    proc: subprocess.Popen
    output: Path
    run_dir: Path
    signal_after: str | None = None
    job_id: str = ""
    signalled_at: float | None = None
    exit_code: int | None = None  # from scontrol, once the job is over
    _result: tuple[int, str] | None = None
    _stop: threading.Event = field(default_factory=threading.Event)

    def start_watcher(self) -> None:
        line = self.proc.stdout.readline()  # "Submitted batch job N", printed at submission
        match = re.search(r"Submitted batch job (\d+)", line)
        if not match:
            rest = self.proc.communicate(timeout=30)
            raise RuntimeError(f"sbatch failed for {self.name}: {line}{rest[0]}{rest[1]}")
        self.job_id = match.group(1)
        threading.Thread(target=self._watch, daemon=True).start()

    def _requeue_pending(self) -> bool:
        """Whether the job's last run announced a requeue that no later run has started after: its
        output holds as many "requeueing job N" lines as run headers "job N (restart k)". A job
        requeueing itself passes through CANCELLED (its old run) before PENDING; read from the output,
        that passage is told from the end of the job without a timing guess."""
        if not self.output.exists():
            return False
        text = self.output.read_text(errors="replace")
        if "scontrol requeue was refused" in text:
            return False
        requeues = len(re.findall(rf"requeueing job {self.job_id} to resume", text))
        runs = len(re.findall(rf"job {self.job_id} \(restart \d+\)", text))
        return requeues > 0 and requeues >= runs

    def _watch(self) -> None:
        while not self._stop.is_set():
            fields = dict(
                kv.split("=", 1)
                for kv in self.cluster.run(
                    "scontrol", "-o", "show", "job", self.job_id, check=False
                ).stdout.split()
                if "=" in kv
            )
            state, reason = fields.get("JobState", ""), fields.get("Reason", "")
            if state in TERMINAL and not self._requeue_pending():
                code, sig = (int(x) for x in fields.get("ExitCode", "0:0").split(":"))
                self.exit_code = code if sig == 0 else 128 + sig
                return
            if state == "PENDING" and reason == "BeginTime":
                self.cluster.run("scontrol", "update", f"JobId={self.job_id}", "StartTime=now", check=False)
            if self.signal_after and self.signalled_at is None and state == "RUNNING":
                if self.output.exists() and self.signal_after in self.output.read_text(errors="replace"):
                    self.cluster.run("scancel", "--signal=USR1", self.job_id, check=False)
                    self.signalled_at = time.time()
            time.sleep(0.3)

    def wait(self, check_sbatch: bool = False) -> tuple[int, str]:
        """(the job's exit status, its Slurm output file). With check_sbatch, also wait for sbatch --wait
        itself and require the same status from it."""
        if self._result is None:
            deadline = time.time() + JOB_TIMEOUT_S
            while self.exit_code is None and time.time() < deadline:
                time.sleep(0.2)
            if self.exit_code is None:
                self._stop.set()
                self.cluster.run("scancel", self.job_id, check=False)
                raise TimeoutError(f"{self.name} (job {self.job_id}) did not finish in {JOB_TIMEOUT_S} s")
            if check_sbatch:
                self.proc.wait(timeout=120)
                assert self.proc.returncode == self.exit_code, (self.proc.returncode, self.exit_code)
            else:
                self.proc.terminate()  # stops waiting; the job is over
            text = self.output.read_text(errors="replace") if self.output.exists() else ""
            self._result = (self.exit_code, text)
        return self._result


def submit(
    cluster: Cluster,
    name: str,
    script: str,
    script_args: list[str],
    sbatch_args: list[str],
    env: dict[str, str],
    out_dir: Path,
    run_dir: Path,
    cwd: Path,
    signal_after: str | None = None,
) -> Job:
    output = out_dir / f"{name}.out"
    cmd = ["sbatch", "--wait", f"--output={output}", f"--job-name={name}", *sbatch_args, script, *script_args]
    proc = subprocess.Popen(
        cmd, env={**cluster.env, **env}, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    job = Job(name, cluster, proc, output, run_dir, signal_after=signal_after)
    job.start_watcher()
    return job
