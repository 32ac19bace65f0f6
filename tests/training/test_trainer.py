"""The Trainer in process, on a one-layer model: hooks, host syncs, the NaN guard, stops, pinned batches."""

from __future__ import annotations

import json
import math
import os
import sys

import pytest
import torch

from diffmeg.errors import DiffmegError
from diffmeg.run_config import RunConfig
from diffmeg.training import data as training_data
from diffmeg.training.arguments import resolve_args
from diffmeg.training.callbacks import Callback, NanGuard, default_callbacks

SMALL = ["--num-layers", "1", "--hidden-size", "64", "--num-attention-heads", "2", "--seq-length", "32"]
SMALL += ["--mock-data", "--vocab-size", "128", "--micro-batch-size", "2", "--global-batch-size", "4"]
SMALL += ["--lr", "1e-3", "--eval-iters", "0"]


@pytest.fixture
def trainer_of(single_rank_parallel_state, monkeypatch):
    """Build a Trainer for extra flags in this process (the launcher variables it sets are restored)."""
    from diffmeg.training.trainer import Trainer

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        # setenv first: monkeypatch then removes at teardown what the Trainer sets where nothing was set
        # (a leaked MASTER_PORT made later tests' jobs collide on one port)
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)

    def build(*flags: str, callbacks=None, extra_callbacks=()):
        run = RunConfig.from_args(resolve_args([*SMALL, *flags], world_size=1))
        if callbacks is None:
            callbacks = [*default_callbacks(run, is_logging_rank=True), *extra_callbacks]
        return Trainer(run, callbacks=callbacks)

    return build


class Recorder(Callback):
    def __init__(self) -> None:
        self.events: list[tuple] = []

    def on_train_start(self, trainer) -> None:
        self.events.append(("start",))

    def on_step_end(self, trainer, out) -> None:
        assert isinstance(out.loss, torch.Tensor)  # still on the device: nothing synced yet
        self.events.append(("step", out.iteration))

    def on_losses(self, trainer, losses) -> None:
        self.events.append(("losses", sorted(losses)))

    def on_log(self, trainer, record) -> None:
        self.events.append(("log", record.iteration, record.loss))

    def on_train_end(self, trainer) -> None:
        self.events.append(("end",))


def test_hooks_and_one_host_read_of_the_losses_per_logging_interval(trainer_of, monkeypatch, capsys):
    """Issue 17, item 10: between logging steps the losses stay on the device; each logging step brings
    them (with lambdas and loss scale) to the host in one copy. The one other read is the signal flag."""
    recorder = Recorder()
    trainer = trainer_of("--train-iters", "6", "--log-interval", "3", extra_callbacks=[recorder])
    reads: list[tuple[int, str]] = []

    def counting(method):
        def wrapper(self, *args, **kwargs):
            caller = sys._getframe(1)
            if f"{os.sep}diffmeg{os.sep}" in caller.f_code.co_filename:
                reads.append((trainer.state.iteration, caller.f_code.co_name))
            return method(self, *args, **kwargs)

        return wrapper

    monkeypatch.setattr(torch.Tensor, "item", counting(torch.Tensor.item))
    monkeypatch.setattr(torch.Tensor, "tolist", counting(torch.Tensor.tolist))
    summary = trainer.train()
    monkeypatch.undo()

    # the run's first iteration is read too, for the early progress line (issue 31)
    assert [r for r in reads if r[1] != "any_rank"] == [(1, "_to_host"), (3, "_to_host"), (6, "_to_host")]
    assert [r[0] for r in reads if r[1] == "any_rank"] == [1, 2, 3, 4, 5, 6]  # one flag per step
    kinds = [e[0] for e in recorder.events]
    assert kinds == [
        "start",
        "step",
        "losses",
        "log",
        "step",
        "step",
        "losses",
        "log",
        "step",
        "step",
        "step",
        "losses",
        "log",
        "end",
    ]
    assert recorder.events[2] == ("losses", [1]) and recorder.events[6] == ("losses", [2, 3])
    logged = [e for e in recorder.events if e[0] == "log"]
    assert [e[1] for e in logged] == [1, 3, 6] and summary["lm_loss"] == logged[-1][2]
    out = capsys.readouterr().out
    assert "iteration        3/       6 | ETA: " in out and "iteration        1/       6 | ETA: " in out


def test_a_progress_line_after_the_first_iteration_only_on_stdout(trainer_of, tmp_path, capsys):
    """Issue 31: the first line comes after iteration 1 (a resume's first too), not after --log-interval;
    it is no metrics record (those stay one per --log-interval); every line says the time left."""
    import re

    metrics = tmp_path / "metrics.jsonl"
    records = LogRecords()
    flags = ["--train-iters", "4", "--log-interval", "2", "--metrics-file", str(metrics)]
    trainer_of(*flags, extra_callbacks=[records]).train()
    assert [(r.iteration, r.early) for r in records.records] == [(1, True), (2, False), (4, False)]
    assert [json.loads(line)["iteration"] for line in metrics.read_text().splitlines()] == [2, 4]
    lines = [line for line in capsys.readouterr().out.splitlines() if "lm loss: " in line]
    assert [re.search(r"iteration +(\d+)/ +4 \| ETA: (\d+:\d\d) \|", line).group(1) for line in lines] == [
        "1",
        "2",
        "4",
    ]
    assert lines[-1].split("ETA: ")[1].startswith("0:00 |")  # nothing left at the last iteration


def test_a_callback_stops_the_run_after_saving(trainer_of, tmp_path, capsys):
    class StopAtTwo(Callback):
        def on_step_end(self, trainer, out) -> None:
            if out.iteration == 2:
                trainer.request_stop("test")

    ckpt = str(tmp_path / "ckpt")
    trainer = trainer_of(
        "--train-iters", "5", "--save", ckpt, "--log-interval", "10", extra_callbacks=[StopAtTwo()]
    )
    summary = trainer.train()
    assert (summary["iteration"], summary["stop_reason"], summary["exit_code"]) == (2, "test", 0)
    assert open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read() == "2"
    assert " exiting at iteration 2 (test)" in capsys.readouterr().out


def test_nan_guard_names_the_first_bad_iteration():
    with pytest.raises(DiffmegError, match=r"lm loss is nan at iteration 2; stopping"):
        NanGuard().on_losses(None, {3: math.nan, 1: 2.0, 2: math.nan})
    NanGuard().on_losses(None, {1: 2.0})


def test_a_nan_loss_is_never_saved(trainer_of, tmp_path):
    """Losses reach the host at the latest before a save: a run saving every step and logging rarely
    stops at its first non-finite loss, and its last checkpoint is the step before it."""
    ckpt = tmp_path / "ckpt"
    flags = ["--train-iters", "40", "--log-interval", "100", "--save", str(ckpt), "--save-interval", "1"]
    flags += ["--lr", "1e6", "--min-lr", "1e6", "--clip-grad", "0", "--lr-warmup-iters", "0"]
    trainer = trainer_of(*flags)
    with pytest.raises(DiffmegError, match=r"lm loss is (nan|inf) at iteration (\d+)") as err:
        trainer.train()
    bad = int(str(err.value).split("at iteration ")[1].split(";")[0])
    assert bad > 1 and (ckpt / "latest_checkpointed_iteration.txt").read_text() == str(bad - 1)


def test_batches_are_pinned_and_copied_asynchronously_for_cuda(single_rank_parallel_state, monkeypatch):
    pinned, copies = [], []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: pinned.append(self.shape) or self)
    batches = training_data.microbatches(training_data.MockTokenDataset(64, 8, 0), 0, 2, 1, pin_memory=True)
    batch = next(batches)
    assert len(pinned) == 4  # tokens, labels, loss mask, positions

    def to(self, device, non_blocking=False):
        copies.append((str(device), non_blocking))
        return self

    monkeypatch.setattr(torch.Tensor, "to", to)
    training_data.to_device(batch, torch.device("cuda", 0))
    training_data.to_device(batch, torch.device("cpu"))
    assert copies == [("cuda:0", True)] * 4 + [("cpu", False)] * 4


def test_evaluation_runs_at_its_interval(trainer_of, capsys):
    class Evaluations(Callback):
        seen: list[tuple[int, float]] = []

        def on_evaluation(self, trainer, iteration, loss) -> None:
            self.seen.append((iteration, loss))

    trainer = trainer_of(
        "--train-iters", "4", "--eval-iters", "2", "--eval-interval", "2", extra_callbacks=[Evaluations()]
    )
    trainer.train()
    assert [it for it, _ in Evaluations.seen] == [2, 4]
    assert all(math.isfinite(loss) and 0 < loss < 10 for _, loss in Evaluations.seen)
    assert trainer.evaluate() == Evaluations.seen[-1][1]  # the same first batches every time, weights as at 4
    assert " validation loss at iteration 4 | lm loss value: " in capsys.readouterr().out


class LogRecords(Callback):
    def __init__(self) -> None:
        self.records: list = []

    def on_log(self, trainer, record) -> None:
        self.records.append(record)


def test_the_log_shows_mfu_where_the_device_peak_is_known(trainer_of, monkeypatch, tmp_path, capsys):
    """A GPU the peak table knows (a fake name here) puts MFU in the log line and the metrics file; a CPU,
    whose peak no table holds, shows none. The Trainer works it out from the run and the device, once, into
    the log record every sink shows."""
    from diffmeg.training import hardware, trainer

    def run(name: str) -> tuple:
        metrics = tmp_path / name / "metrics.jsonl"
        flags = ["--train-iters", "2", "--log-interval", "2", "--metrics-file", str(metrics)]
        trainer_of(*flags).train()
        return json.loads(metrics.read_text().splitlines()[-1]), capsys.readouterr().out

    logged, out = run("cpu")
    assert "throughput per CPU (TFLOP/s/CPU): " in out and "MFU" not in out and "mfu" not in logged

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    asked = []

    def as_on_a_gpu(device: torch.device, precision: str) -> float | None:
        asked.append((device.type, precision))  # the model stays on the CPU; its peak is looked up as a GPU's
        return hardware.peak_tflops(torch.device("cuda", 0), "bf16")

    monkeypatch.setattr(trainer, "peak_tflops", as_on_a_gpu)
    logged, out = run("gpu")
    tflops, mfu = logged["tflops_per_gpu"], logged["mfu"]
    assert asked == [("cpu", "fp32")] and mfu == pytest.approx(tflops / 989.4)
    assert f"(TFLOP/s/CPU): {tflops:.3f} | MFU: {100 * mfu:.1f}% | learning rate: " in out


class FailingWriter:
    """A tensorboard writer on a full disk: its writer thread's ENOSPC comes back at the next call."""

    def add_scalar(self, *args) -> None:
        raise OSError(28, "No space left on device")

    def flush(self) -> None:
        raise OSError(28, "No space left on device")

    def close(self) -> None:
        raise OSError(28, "No space left on device")


@pytest.mark.parametrize("log", ["--metrics-file", "--tensorboard-dir"])
def test_a_log_write_error_saves_then_stops_in_one_line(log, trainer_of, tmp_path, capsys, monkeypatch):
    """Issue 31: a log that cannot be written (a full disk) ends the run at once, after every rank agreed
    and saved the next step with --save: nothing trained is lost, and the error says where it went."""
    import signal

    from diffmeg.training import callbacks as callbacks_module

    ckpt = str(tmp_path / "ckpt")
    flags = ["--train-iters", "6", "--log-interval", "2", "--save", ckpt, "--save-interval", "100"]
    run = RunConfig.from_args(resolve_args([*SMALL, *flags], world_size=1))
    callbacks = default_callbacks(run, is_logging_rank=True)

    opened = callbacks_module.TrainingLogger

    def failing_logger(*args, **kwargs):  # the logger the metrics callback opens at the start
        logger = opened(*args, **kwargs)
        if log == "--metrics-file":
            logger.metrics, logger.metrics_file = open("/dev/full", "a"), "/dev/full"  # every write: ENOSPC
        else:
            logger.writer, logger.tensorboard_dir = FailingWriter(), "tb"
        return logger

    monkeypatch.setattr(callbacks_module, "TrainingLogger", failing_logger)
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(DiffmegError) as err:
        trainer_of(*flags, callbacks=callbacks).train()
    where = "/dev/full" if log == "--metrics-file" else "tb"
    assert str(err.value).startswith(f"cannot write {log} {where} at iteration 2: No space left on device;")
    assert str(err.value).endswith(f"; the last step is saved in {ckpt}: resume with --load {ckpt}")
    assert "\n" not in str(err.value)
    assert open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read() == "3"
    assert " exiting at iteration 3 (a log write failed)" in capsys.readouterr().out
    assert signal.getsignal(signal.SIGINT) is before  # every callback's end ran after the error
