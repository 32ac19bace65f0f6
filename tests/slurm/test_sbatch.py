"""Every recipe, submitted to a real (local) Slurm with the CPU/tiny override, trains, checkpoints and
logs; a job stopped by SIGUSR1 (Slurm's pre-timeout signal) requeues itself and resumes; the 64K
extension starts from the 3B run's checkpoint. All jobs are submitted at once and run side by side."""

from __future__ import annotations

import json
import re
import sys

import pytest

from tests.slurm.helpers import REPO_ROOT, Job, clean_env, submit

# The CPU override: two tasks, diff-tiny, mock data, a few iterations, everything on one rank
# layout. --vocab-size keeps the output layer small; the recipes' --bf16 and distributed optimizer stay.
TINY = (
    "--mock-data --vocab-size 1024 --seq-length 64 --max-position-embeddings 64 --train-iters 4 "
    "--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --context-parallel-size 1 "
    "--micro-batch-size 1 --global-batch-size 2 --log-interval 1 --eval-iters 0"
)
CPU_ALLOCATION = ["--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=0"]
SIDE_BY_SIDE = ["--oversubscribe"]  # lifts the recipes' --exclusive so two test jobs share the node
SIGNAL_ITERS = 40


@pytest.fixture(scope="module")
def jobs(slurm_cluster, tmp_path_factory) -> dict[str, Job]:
    runs = tmp_path_factory.mktemp("runs")
    outs = tmp_path_factory.mktemp("slurm_out")
    base = clean_env(RUNS_ROOT=str(runs), PYTHON=sys.executable)

    def go(name, script, args, extra, *, exact=False, env=None, sbatch=(), run_name, signal_after=None):
        env = {**base, "EXTRA_ARGS": extra, **(env or {})}
        # The exact form from the issue is submitted from the checkout with a relative path; the others
        # from elsewhere with an absolute one, so the recipe has to find the checkout through Slurm.
        return submit(
            slurm_cluster,
            name,
            f"slurm/{script}" if exact else str(REPO_ROOT / "slurm" / script),
            args,
            [*CPU_ALLOCATION, *([] if exact else SIDE_BY_SIDE), *sbatch],
            env,
            outs,
            runs / run_name,
            REPO_ROOT if exact else outs,
            signal_after=signal_after,
        )

    submitted = {}
    submitted["diff_3b_1T"] = go(
        "diff_3b_1T", "diff_3b_1T.sh", [], f"--model diff-tiny {TINY}", exact=True, run_name="diff-3b-1T"
    )
    submitted["signal"] = go(
        "signal",
        "diff_3b_1T.sh",
        [],
        f"--model diff-tiny {TINY} --train-iters {SIGNAL_ITERS}",
        env={"RUN_NAME": "signal-resume"},
        run_name="signal-resume",
        signal_after="| lm loss",
    )
    submitted["transformer_3b_1T"] = go(
        "transformer_3b_1T",
        "transformer_3b_1T.sh",
        [],
        f"--model transformer-tiny {TINY}",
        run_name="transformer-3b-1T",
    )
    submitted["diff_scaling"] = go(
        "diff_scaling",
        "diff_scaling.sh",
        ["transformer-830m"],
        f"--model transformer-tiny {TINY}",
        run_name="transformer-830m",
    )
    submitted["diff_13b"] = go(
        "diff_13b", "diff_13b.sh", [], f"--model diff-tiny {TINY}", run_name="diff-13.1b"
    )
    submitted["diff_3b_64k"] = go(
        "diff_3b_64k",
        "diff_3b_64k.sh",
        [],
        f"--model diff-tiny {TINY}",
        sbatch=[f"--dependency=afterok:{submitted['diff_3b_1T'].job_id}"],
        run_name="diff-3b-64k",
    )
    return submitted


def _job_dir(job: Job):
    return job.run_dir / "jobs" / job.job_id


def _tracker(job: Job) -> int:
    return int((job.run_dir / "checkpoints" / "latest_checkpointed_iteration.txt").read_text())


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", ["diff_3b_1T", "transformer_3b_1T", "diff_scaling", "diff_13b", "diff_3b_64k"]
)
def test_recipe_trains_under_slurm(jobs, name):
    job = jobs[name]
    rc, log = job.wait(
        check_sbatch=name == "diff_3b_1T"
    )  # the exact command: sbatch --wait's own status
    assert rc == 0, f"{name}: job {job.job_id} exited {rc}\n{log[-4000:]}"
    assert "lm loss" in log, log[-4000:]
    assert re.search(r"iteration\s+4/\s+4 \|", log), log[-4000:]
    assert _tracker(job) == 4
    job_dir = _job_dir(job)
    config = json.loads((job_dir / "config.json").read_text())
    assert config["parallel"]["world_size"] == 2
    assert config["schedule"]["train_iters"] == 4
    assert config["checkpointing"]["save"] == str(job.run_dir / "checkpoints")
    assert re.search(r"^sha: \S+", (job_dir / "git.txt").read_text(), re.M)
    assert "lm loss" in (job_dir / "train.log").read_text()
    command = (job_dir / "command.sh").read_text()
    assert command.startswith("srun ") and "--ntasks=2" in command
    assert (job.run_dir / "metrics.jsonl").read_text().count('"lm_loss"') >= 4


@pytest.mark.slow
def test_64k_extension_starts_from_the_3b_checkpoint(jobs):
    rc, log = jobs["diff_3b_64k"].wait()
    assert rc == 0, log[-4000:]
    init = jobs["diff_3b_1T"].run_dir / "checkpoints"
    command = (_job_dir(jobs["diff_3b_64k"]) / "command.sh").read_text()
    assert f"--pretrained-checkpoint {init}" in command and "--model diff-3b-64k" in command
    assert "--recompute-granularity full" in command
    # The 3B run's weights (its last iteration, 4), but iteration 1 of this run's own schedule.
    assert f"initialised weights from pretrained checkpoint {init} (iteration 4)" in log
    assert re.search(r"iteration\s+1/\s+4 \|", log)


@pytest.mark.slow
def test_signalled_job_requeues_and_resumes(jobs):
    job = jobs["signal"]
    rc, log = job.wait()
    assert job.signalled_at is not None, "the job finished before SIGUSR1 could be sent"
    assert rc == 0, log[-4000:]
    stopped = re.search(r"exiting at iteration (\d+)", log)
    assert stopped, log[-4000:]
    first_stop = int(stopped.group(1))
    assert 1 <= first_stop < SIGNAL_ITERS
    assert f"stopped at iteration {first_stop} of {SIGNAL_ITERS}; requeueing job {job.job_id}" in log
    assert f"job {job.job_id} (restart 1)" in log
    assert f"loaded checkpoint from {job.run_dir / 'checkpoints'} at iteration {first_stop}" in log
    # The second run continues where the first stopped, and finishes.
    second = log[log.index("(restart 1)") :]
    first_logged = re.search(rf"iteration\s+(\d+)/\s+{SIGNAL_ITERS} \|", second)
    assert first_logged and int(first_logged.group(1)) == first_stop + 1
    assert re.search(rf"iteration\s+{SIGNAL_ITERS}/\s+{SIGNAL_ITERS} \|", second)
    assert _tracker(job) == SIGNAL_ITERS
