"""--async-save in real 2-rank jobs, and no process of a job outliving it (issue 23, items 2 and 5).

Three torchrun launches, each ending differently, each read as a cluster user reads a job (output through
a pipe, to its end) and each followed by a check that no process it started is left:
- A (failed): --async-save; the save of iteration 3 completes, the save of 6 is held in flight by the test
  hook (rank 0's writer stops after writing its files) while training goes on to 9, where the final save
  waits for it; then rank 0 is SIGKILLed (its writer dies with it). The tracker still names 3 and
  iteration 6 is not listed as complete.
- B (finished): resumes A from iteration 3 with synchronous saves and trains to 9: the same losses as A,
  which ran 4..9 uninterrupted (exact resume after a kill during an async save).
- C (interrupted): --async-save; SIGTERM reaches both ranks while rank 0's writer of iteration 2 is held
  back (until the test releases it, once the stop is seen waiting): the run waits for it, saves where it
  stopped, exits 0; its losses are A's (an async save does not disturb training).
The job's processes are found by a tag in their environment (every process a rank starts inherits it).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest

from diffmeg.checkpoints import TRACKER_FILE, iteration_dirs
from diffmeg.training.checkpointing import STALL_ASYNC_SAVE_ENV
from tests.conftest import REPO_ROOT
from tests.distributed.runner import TINY, job_env, launch_cmd, read_losses

TAG = "DIFFMEG_TEST_JOB_TAG"
TIMEOUT = 600  # a loaded 2-core CI machine; never a timing assertion


def tagged_processes(tag: str) -> list[int]:
    """Live processes whose environment carries `TAG=tag` (zombies have none)."""
    needle = f"{TAG}={tag}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if needle in environ:
            found.append(int(entry))
    return found


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def describe(pids: list[int]) -> str:
    def cmdline(pid: int) -> str:
        try:
            return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:160]
        except OSError:
            return "?"

    return "; ".join(f"{pid}: {cmdline(pid)}" for pid in pids)


class Job:
    """A torchrun job in its own session, its output read through a pipe by a thread until EOF (which
    comes only when every process holding the pipe, helpers included, has exited)."""

    def __init__(self, tmp: Path, name: str, extra: list[str], env: dict[str, str] | None = None) -> None:
        self.tag, self.tmp, self.name = uuid.uuid4().hex, tmp, name
        metrics = ["--metrics-file", str(tmp / f"{name}.jsonl")]
        argv = [str(REPO_ROOT / "pretrain_diff.py"), *TINY, *metrics, *extra]
        environ = dict(job_env(tmp, 2), **(env or {}), **{TAG: self.tag})
        self.proc = subprocess.Popen(
            launch_cmd(2, argv),
            cwd=tmp,
            env=environ,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.output: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for raw in self.proc.stdout:
            self.output.append(raw.decode(errors="replace"))

    @property
    def text(self) -> str:
        return "".join(self.output)

    def wait_for(self, what: str, check, timeout: float = TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill_all()
                raise AssertionError(f"{self.name}: never saw {what}:\n{self.text[-4000:]}")
            time.sleep(0.2)

    def iterations(self) -> list[int]:
        path = self.tmp / f"{self.name}.jsonl"
        if not path.exists():
            return []
        lines = path.read_text().splitlines()
        return [json.loads(line)["iteration"] for line in lines if line.endswith("}")]

    def rank(self, rank: int) -> int:
        """The pid of a rank (torchrun's child running pretrain_diff.py with RANK=rank)."""
        for pid in tagged_processes(self.tag):
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if (
                f"RANK={rank}".encode() in environ
                and b"pretrain_diff.py" in cmdline
                and _parent(pid) == self.proc.pid
            ):
                return pid
        raise AssertionError(f"{self.name}: rank {rank} not found")

    def end(self, timeout: float = TIMEOUT) -> int:
        """Reap torchrun and read the output to EOF (due at once then: only a process the job left behind
        still holds the pipe); then no process of the job may be left."""
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill_all()
            raise
        self.reader.join(60)
        left = tagged_processes(self.tag)
        if left or self.reader.is_alive():
            self.kill_all()
        assert not self.reader.is_alive(), f"{self.name}: output still open, held by {describe(left)}"
        assert not left, f"{self.name}: processes outlived the job: {describe(left)}"
        return rc

    def kill_all(self) -> None:
        """Clean up after a failed check: SIGKILL every process of this job, by pid."""
        for pid in tagged_processes(self.tag):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _complete(root: Path) -> list[int]:
    return iteration_dirs(str(root))


@pytest.mark.slow
def test_async_save_kill_resume_sigterm_and_no_process_outlives_a_job(tmp_path):
    ckpt = tmp_path / "ckpt"
    common = ["--use-distributed-optimizer", "--save-interval", "3", "--train-iters", "9"]
    started = time.monotonic()

    # A: the save of 6 stays in flight (files written, not finalized) while training runs on to 9.
    a = Job(tmp_path, "a", [*common, "--save", str(ckpt), "--async-save"], {STALL_ASYNC_SAVE_ENV: "6"})
    a.wait_for("the save of iteration 6 held in flight", lambda: "holding its save back" in a.text)
    a.wait_for("iteration 9 trained while the save of 6 is pending", lambda: 9 in a.iterations())
    a.wait_for("the final save waiting for the save of 6", lambda: "background save of iteration 6" in a.text)
    assert (ckpt / TRACKER_FILE).read_text() == "3" and _complete(ckpt) == [3]
    (saving,) = ckpt.glob("iter_0000006.saving-*")  # the save's own folder, iter_0000006 once complete
    assert list(saving.glob("*.distcp")), "iteration 6's files are written"
    killed = time.monotonic()
    os.kill(a.rank(0), signal.SIGKILL)
    assert a.end() != 0
    after_kill = time.monotonic() - killed
    assert (ckpt / TRACKER_FILE).read_text() == "3" and _complete(ckpt) == [3]
    assert json.loads((ckpt / "iter_0000003" / "args.json").read_text())["async_save"] is True
    duration_a = time.monotonic() - started

    # B: resume from 3 (A's partial iteration 6 is named, never removed: B writes its own), synchronous
    # saves, to the end.
    b = Job(tmp_path, "b", [*common, "--save", str(ckpt), "--load", str(ckpt)])
    assert b.end() == 0, b.text[-3000:]
    assert "loaded checkpoint" in b.text and (ckpt / TRACKER_FILE).read_text() == "9"
    assert "holds what earlier saves left" in b.text and saving.is_dir()
    assert _complete(ckpt) == [3, 6, 9]
    straight, resumed = read_losses(tmp_path, "a"), read_losses(tmp_path, "b")
    assert sorted(resumed) == list(range(4, 10))
    for it in range(4, 10):
        assert resumed[it] == pytest.approx(straight[it], rel=1e-6, abs=0), f"iteration {it}"
    duration_b = time.monotonic() - started - duration_a

    # C: SIGTERM to both ranks while the save of 2 is held back: the stop waits for it, then saves.
    ckpt_c, release = tmp_path / "ckpt_c", tmp_path / "release_c"
    c = Job(
        tmp_path,
        "c",
        [*common[:1], "--save-interval", "2", "--train-iters", "9", "--save", str(ckpt_c), "--async-save"],
        {STALL_ASYNC_SAVE_ENV: f"2:{release}"},
    )
    c.wait_for("the save of iteration 2 held back", lambda: "holding its save back" in c.text)
    for rank in (0, 1):
        os.kill(c.rank(rank), signal.SIGTERM)
    c.wait_for("the stop waiting for the save of 2", lambda: "background save of iteration 2" in c.text)
    assert not (ckpt_c / TRACKER_FILE).exists()  # nothing finalized yet
    release.touch()
    assert c.end() == 0, c.text[-3000:]
    stopped = int(c.text.split(" exiting at iteration ")[1].split()[0])
    assert "(SIGTERM)" in c.text
    assert (ckpt_c / TRACKER_FILE).read_text() == str(stopped) and _complete(ckpt_c)[:1] == [2]
    assert stopped in _complete(ckpt_c) and stopped < 9
    interrupted = read_losses(tmp_path, "c")
    for it in range(1, stopped + 1):
        assert interrupted[it] == pytest.approx(straight[it], rel=1e-6, abs=0), f"iteration {it}"
    duration_c = time.monotonic() - started - duration_a - duration_b
    print(
        f"durations: A {duration_a:.0f} s (ended {after_kill:.0f} s after the kill), "
        f"B {duration_b:.0f} s, C {duration_c:.0f} s"
    )
