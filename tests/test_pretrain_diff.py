"""pretrain_diff.py as users run it: dry run JSON, one-line errors, NaN stop, fresh starts, unusable or full
save targets, corrupt checkpoints and --ckpt-step, Ctrl-C."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import threading
from pathlib import Path

import pytest

from diffmeg.folder_lock import LOCK_FILE
from tests.conftest import REPO_ROOT
from tests.distributed.runner import TINY, job_env, launch_cmd, read_losses, run_pretrain, run_training


def test_dry_run_resolves_the_3b_recipe(tmp_path):
    argv = ["--model", "diff-3b", "--tensor-model-parallel-size", "2", "--dry-run"]
    proc = run_pretrain(argv, tmp_path, WORLD_SIZE="256")
    assert proc.returncode == 0, proc.stderr
    cfg = json.loads(proc.stdout)
    assert cfg["model"]["num_attention_heads"] == 12 and cfg["model"]["head_dim"] == 128
    assert cfg["model"]["value_head_dim"] == 256
    assert cfg["parallel"]["data_parallel_size"] == 128
    assert cfg["batch"]["tokens_per_batch"] == 4 * 2**20
    assert cfg["schedule"]["total_tokens"] >= 1e12
    assert cfg["num_parameters"] == pytest.approx(3.79e9, rel=0.01)
    assert cfg["flops_per_step"] > 0


def test_impossible_layout_is_one_line(tmp_path):
    argv = ["--model", "diff-tiny", "--tensor-model-parallel-size", "3", "--dry-run"]
    proc = run_pretrain(argv, tmp_path, WORLD_SIZE="3")
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and proc.stderr.startswith("error: ")


def test_nan_loss_stops_with_iteration(tmp_path):
    proc = run_training(
        tmp_path,
        "nan",
        [
            "--train-iters",
            "30",
            "--lr",
            "1e6",
            "--min-lr",
            "1e6",
            "--clip-grad",
            "0",
            "--lr-warmup-iters",
            "0",
        ],
        check=False,
    )
    assert proc.returncode == 2
    assert "error: lm loss is" in proc.stderr and "at iteration" in proc.stderr


def _error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr[-3000:]
    return lines[0]


def test_corrupt_checkpoint_names_the_file_and_ckpt_step_resumes_an_earlier_one(tmp_path):
    ckpt = tmp_path / "ckpt"
    decay = ["--lr-decay-iters", "4"]  # one schedule for the runs of different lengths below
    run_training(tmp_path, "a", ["--train-iters", "2", *decay, "--save-interval", "1", "--save", str(ckpt)])
    for f in (ckpt / "iter_0000002").glob("*.distcp"):
        f.write_bytes(b"garbage")
    arguments = (ckpt / "arguments.json").read_text()
    proc = run_training(
        tmp_path, "b", ["--train-iters", "4", *decay, "--load", str(ckpt), "--save", str(ckpt)], check=False
    )
    assert proc.returncode == 2
    line = _error_line(proc.stderr)
    assert re.match(
        rf"error: cannot load checkpoint iteration 2 of {ckpt}: iter_0000002/__0_\d\.distcp is 7 bytes", line
    )
    assert line.endswith(f"other complete iterations in {ckpt}: 1; start from one with --ckpt-step N")
    # nothing already written was touched: a run refused before training writes nothing
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert (ckpt / "arguments.json").read_text() == arguments and not (ckpt / LOCK_FILE).exists()
    # Megatron-LM's --ckpt-step: resume from the intact iteration 1, exactly where the first run was then.
    proc = run_training(
        tmp_path,
        "c",
        ["--train-iters", "3", *decay, "--load", str(ckpt), "--ckpt-step", "1", "--save", str(ckpt)],
    )
    assert f"loaded checkpoint from {ckpt} at iteration 1" in proc.stdout
    resumed = read_losses(tmp_path, "c")
    assert sorted(resumed) == [2, 3] and resumed[2] == read_losses(tmp_path, "a")[2]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "3"


def test_unfinished_save_is_not_marked_latest(tmp_path):
    ckpt = tmp_path / "ckpt"
    # The requeue-friendly form on its first start: --load names the --save directory, not there yet.
    both = ["--lr-decay-iters", "3", "--save", str(ckpt), "--load", str(ckpt)]  # the resumed run's schedule
    proc = run_training(tmp_path, "a", ["--train-iters", "2", *both])
    assert f" no checkpoint in {ckpt}, starting from scratch" in proc.stdout
    # One summary line instead of the argument dump, which is in the run directory.
    assert "end of arguments" not in proc.stdout
    assert re.search(
        rf"^ diff-tiny \(DIFF\): 3\.28M parameters, .* arguments in {ckpt}/arguments.json$", proc.stdout, re.M
    )
    assert json.loads((ckpt / "arguments.json").read_text())["save"] == str(ckpt)
    (ckpt / "iter_0000004").mkdir()  # a save that died half way: never in the tracker
    proc = run_training(tmp_path, "b", ["--train-iters", "3", *both])
    assert "at iteration 2" in proc.stdout
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "3"


def test_a_typo_in_load_or_an_unusable_save_stops_before_training(tmp_path):
    proc = run_training(
        tmp_path,
        "typo",
        ["--train-iters", "2", "--load", str(tmp_path / "ckpt_typo"), "--save", str(tmp_path / "new" / "c")],
        check=False,
    )
    assert proc.returncode == 2 and "does not exist" in _error_line(proc.stderr)
    assert not (tmp_path / "new").exists()  # made for the run's lock, then found empty: removed
    proc = run_training(tmp_path, "nosave", ["--train-iters", "2", "--save", "/proc/nope"], check=False)
    assert proc.returncode == 2 and "iteration " not in proc.stdout
    assert _error_line(proc.stderr).startswith("error: --save /proc/nope cannot be created: ")


@pytest.fixture
def small_filesystem(tmp_path):
    """A 60 MiB tmpfs: room for one diff-tiny checkpoint of the runner's shape (about 39 MiB), not two."""
    mount = tmp_path / "small"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (the fault-injection test covers the writer)")
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=60m", "tmpfs", str(mount)], capture_output=True
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_disk_full_while_saving_on_a_small_filesystem(tmp_path, small_filesystem):
    ckpt = small_filesystem / "ckpt"
    proc = run_training(
        tmp_path, "full", ["--train-iters", "3", "--save", str(ckpt), "--save-interval", "1"], check=False
    )
    assert proc.returncode == 2
    line = _error_line(proc.stderr)
    assert line.startswith(f"error: disk full while saving iteration 2 to {ckpt}: ")
    assert re.search(r"\d+(\.\d)? [KMG]?i?B free, the checkpoint needs about 3\d\.\d MiB", line), line
    assert "the latest checkpoint is still iteration 1" in line
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "1"
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("iter_")) == ["iter_0000001"]


def _start(tmp_path, extra: list[str]) -> subprocess.Popen:
    argv = [str(REPO_ROOT / "pretrain_diff.py"), *TINY, *extra]
    return subprocess.Popen(
        launch_cmd(1, argv),
        cwd=tmp_path,
        env=job_env(tmp_path, 1),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _read_until(proc: subprocess.Popen, pattern: str, seen: list[str], timeout: float = 600) -> None:
    """Append output lines to `seen` until one matches `pattern` (the process is killed after `timeout`)."""
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    try:
        for line in proc.stdout:
            seen.append(line)
            if re.search(pattern, line):
                return
        raise AssertionError(f"no line matching {pattern!r}:\n{''.join(seen)[-3000:]}")
    finally:
        timer.cancel()


def _interrupt_after_first_step(tmp_path, until: str) -> tuple[subprocess.Popen, list[str], Path]:
    """A 1000-step run saving to tmp_path/ckpt, sent SIGINT once it logs its first step: the process, its
    output up to the line matching `until`, the checkpoint folder."""
    ckpt = tmp_path / "ckpt"
    proc = _start(tmp_path, ["--train-iters", "1000", "--save", str(ckpt)])
    seen: list[str] = []
    _read_until(proc, r"iteration +1/", seen)
    proc.send_signal(signal.SIGINT)
    _read_until(proc, until, seen)
    return proc, seen, ckpt


def test_ctrl_c_saves_and_exits_with_one_line(tmp_path):
    """Issue 16, item 5: SIGINT as SIGTERM: a checkpoint at the current step, one line, no traceback."""
    proc, seen, ckpt = _interrupt_after_first_step(tmp_path, r"exiting at iteration \d+ \(SIGINT\)")
    seen += proc.stdout.readlines()
    assert proc.wait(timeout=300) == 130
    out = "".join(seen)
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-3000:]
    stopped = re.search(r"exiting at iteration (\d+) \(SIGINT\)", out).group(1)
    assert f"saved checkpoint at iteration {stopped}" in out
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == stopped


def test_a_second_ctrl_c_exits_at_once(tmp_path):
    proc, seen, ckpt = _interrupt_after_first_step(tmp_path, r"Ctrl-C again exits now")
    proc.send_signal(signal.SIGINT)
    seen += proc.stdout.readlines()
    assert proc.wait(timeout=120) == 130
    out = "".join(seen)
    assert "error: second Ctrl-C: exiting at once, without saving" in out
    assert "Traceback" not in out and "exiting at iteration" not in out, out[-3000:]
    assert not (ckpt / "latest_checkpointed_iteration.txt").exists()


def test_a_second_run_on_a_save_folder_is_refused_and_the_first_keeps_its_files(tmp_path):
    """2026-11-27: two runs on one --save folder (a requeued job overlapping its predecessor, a script
    started twice) wrote into each other. The second is refused in one line naming the first, before it
    writes anything; the first's arguments and checkpoint stay its own."""
    from diffmeg.checkpoints import read_checkpoint_args

    ckpt, host, job = tmp_path / "ckpt", socket.gethostname(), os.environ.get("SLURM_JOB_ID")
    first = _start(tmp_path, ["--train-iters", "1000", "--save", str(ckpt), "--seed", "1"])
    seen: list[str] = []
    _read_until(first, r"iteration +1/", seen)
    arguments = (ckpt / "arguments.json").read_text()
    second = run_training(
        tmp_path, "second", ["--train-iters", "2", "--save", str(ckpt), "--seed", "2"], check=False
    )
    first.send_signal(signal.SIGTERM)  # saves and exits
    seen += first.stdout.readlines()
    assert first.wait(timeout=300) == 0, "".join(seen)[-3000:]
    assert second.returncode == 2
    line = _error_line(second.stderr)
    owner = f"pid {first.pid} on {host}" + (f" (Slurm job {job})" if job else "")
    assert line.startswith(f"error: --save {ckpt} is in use by another run: {owner}, started "), line
    stop = f"scancel {job}" if job else f"kill {first.pid} on {host}"
    assert line.endswith(f"; wait for it to end, stop it ({stop}), or choose another --save"), line
    assert (ckpt / "arguments.json").read_text() == arguments
    stopped = int(re.search(r"exiting at iteration (\d+)", "".join(seen)).group(1))
    names = ["arguments.json", f"iter_{stopped:07d}", "latest_checkpointed_iteration.txt"]
    assert sorted(os.listdir(ckpt)) == names  # the lock is gone with its run
    assert read_checkpoint_args(str(ckpt))[0].seed == 1


def test_recompute_and_bf16_match_the_plain_run(tmp_path):
    from tests.distributed.runner import read_losses

    base = ["--train-iters", "3"]
    run_training(tmp_path, "plain", [*base, "--tensorboard-dir", str(tmp_path / "tb")])
    run_training(tmp_path, "full", [*base, "--recompute-granularity", "full"])
    run_training(tmp_path, "selective", [*base, "--recompute-granularity", "selective"])
    run_training(tmp_path, "bf16", [*base, "--bf16"])
    plain = read_losses(tmp_path, "plain")
    assert read_losses(tmp_path, "full") == plain
    assert read_losses(tmp_path, "selective") == plain
    for it, loss in read_losses(tmp_path, "bf16").items():
        assert loss == pytest.approx(plain[it], rel=1e-3)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert {"lm loss", "learning-rate", "grad-norm", "throughput/tflops-per-gpu"} <= set(tags)
    assert any(t.startswith("lambda/layer") for t in tags)
    assert [e.value for e in events.Scalars("lm loss")] == pytest.approx([plain[i] for i in (1, 2, 3)])


def test_a_run_and_its_resume_are_quiet_and_end_with_the_summary(tmp_path):
    """Issue 31: no third-party deprecation warning on start or checkpoint load (filtered at the entry
    point, not only in the test suite), and the last line says loss, time and where the checkpoint went."""
    ckpt = tmp_path / "ckpt"
    for iters in ("1", "2"):
        flags = ["--train-iters", iters, "--lr-decay-iters", "3", "--load", str(ckpt), "--save", str(ckpt)]
        proc = run_training(tmp_path, "a", flags)
        assert "Warning" not in proc.stderr, proc.stderr[-3000:]
        last = proc.stdout.strip().splitlines()[-1]
        summary = rf" done: {iters} iterations, [\d.]+K? tokens, final lm loss \d+\.\d+, wall time \d+:\d\d"
        assert re.match(summary, last), last
        assert last.endswith(f"| last checkpoint: {ckpt}/iter_000000{iters} | metrics {tmp_path}/a.jsonl")


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_full_device_under_the_metrics_file_saves_then_stops_every_rank_in_one_line(tmp_path, nproc):
    """Issue 31: a log write error mid-run (/dev/full: every write is ENOSPC) ends the run at once: the
    ranks agree, save the next step, and exit; one line names the file, the fix and the checkpoint."""
    ckpt = tmp_path / "ckpt"
    flags = ["--train-iters", "6", "--log-interval", "2", "--metrics-file", "/dev/full", "--save", str(ckpt)]
    proc = run_training(tmp_path, "full", [*flags, "--save-interval", "100"], nproc=nproc, check=False)
    if nproc == 1:
        assert proc.returncode == 2 and _error_line(proc.stderr)
    assert proc.returncode != 0  # with two ranks torchrun's own report of the rank's exit 2 follows
    assert [line for line in proc.stderr.splitlines() if line.startswith("error: ")] == [
        "error: cannot write --metrics-file /dev/full at iteration 2: No space left on device; the run stops "
        "here (its earlier records are in that file, every loss in the log above): free space or choose "
        f"another --metrics-file; the last step is saved in {ckpt}: resume with --load {ckpt}"
    ]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
