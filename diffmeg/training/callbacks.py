"""What happens around each training step, as callbacks of the Trainer (OLMo-core's idiom).

The Trainer calls every callback's hooks in list order:
- `on_train_start(trainer)` before the first step, `on_train_end(trainer)` after the last (also on errors);
- `on_step_end(trainer, out)` after every optimizer step, with the loss still on the device: no host sync
  here (the signal check's one-flag all-reduce is the exception: every rank must stop at the same step);
- `on_losses(trainer, losses)` when the pending losses reached the host ({iteration: loss}; once per
  logging interval, and before a save or a stop);
- `on_log(trainer, record)` at logging steps; `on_evaluation(trainer, iteration, loss)` after evaluation.

A callback stops the run with `trainer.request_stop(reason)`; the Trainer then saves (with --save) and exits.
This module is the interface between the two: the records a hook receives (`StepOutput`, `LogRecord`) and
what a callback may ask of the Trainer (`TrainerControl`, which `diffmeg.training.trainer.Trainer`
implements), so callbacks never import the Trainer.
"""

from __future__ import annotations

import math
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from diffmeg import collectives
from diffmeg.errors import DiffmegError
from diffmeg.run_config import RunConfig
from diffmeg.training.flops import train_flops_per_iteration
from diffmeg.training.hardware import model_flops_utilization, peak_tflops
from diffmeg.training.logger import TrainingLogger


class BackgroundWrites(Protocol):
    """Checkpoint saves still being written (`diffmeg.training.checkpointing.CheckpointManager`)."""

    def poll(self) -> None:
        """Finalize a background save once every rank has written its files; never waits for them."""

    def close(self) -> None:
        """Stop the background writer (after the last save was waited for)."""


class TrainerControl(Protocol):
    """The Trainer as its callbacks see it (`diffmeg.training.trainer.Trainer` implements this)."""

    checkpoints: BackgroundWrites
    device: torch.device
    """Where the model is (the logs' MFU reads its peak)."""
    num_parameters: int
    """Of the whole model, over every rank."""

    def request_stop(self, reason: str, interrupted: bool = False) -> None:
        """Save (with --save) and stop after this step; `interrupted`: Ctrl-C (the exit status says so)."""


@dataclass
class StepOutput:
    """One optimizer step, as the callbacks see it (nothing here forced a host sync)."""

    iteration: int
    loss: torch.Tensor | None
    """This rank's mean over its micro-batches (a device scalar); None off the last pipeline stage."""
    grad_norm: float | torch.Tensor | None
    """A float from megatron-core's step; a 0-dim device tensor from the fused one (read it at log steps)."""
    update_ok: bool


@dataclass
class LogRecord:
    """One logged iteration: what the Megatron-style line, tensorboard and the metrics file show."""

    iteration: int
    train_iters: int
    consumed_samples: int
    elapsed_ms: float
    """Per iteration, over the iterations since the last record."""
    lr: float
    global_batch_size: int
    loss: float
    grad_norm: float | None
    loss_scale: float
    lambdas: dict[str, float]
    skipped: int
    early: bool = False
    """The line after the run's first iteration, before its first --log-interval: stdout only (no metrics
    or tensorboard record), so a slow start is not minutes of silence."""


class Callback:
    """Base class: every hook does nothing."""

    def on_train_start(self, trainer: TrainerControl) -> None:
        pass

    def on_step_end(self, trainer: TrainerControl, out: StepOutput) -> None:
        pass

    def on_losses(self, trainer: TrainerControl, losses: dict[int, float]) -> None:
        pass

    def on_log(self, trainer: TrainerControl, record: LogRecord) -> None:
        pass

    def on_evaluation(self, trainer: TrainerControl, iteration: int, loss: float) -> None:
        pass

    def on_train_end(self, trainer: TrainerControl) -> None:
        pass


class NanGuard(Callback):
    """Stop with one line at the first iteration whose loss is not finite (before anything is saved)."""

    def on_losses(self, trainer: TrainerControl, losses: dict[int, float]) -> None:
        for iteration in sorted(losses):
            if not math.isfinite(losses[iteration]):
                raise DiffmegError(
                    f"lm loss is {losses[iteration]} at iteration {iteration}; stopping (lower --lr, check "
                    f"the data, or resume from the last checkpoint)"
                )


class MetricsLogger(Callback):
    """The logs of a run, on the logging rank: at the start the run in one line and its arguments
    (`TrainingLogger.arguments`: once every start-up check passed, so a refused run writes none); then
    Megatron-style stdout lines, tensorboard scalars and --metrics-file, with the model's FLOP/s and their
    share of the device's dense peak (MFU, `diffmeg.training.hardware`; none where the peak is unknown: a
    CPU, a GPU the table lacks, an fp32 run).

    A log that cannot be written (a full disk under --metrics-file or --tensorboard-dir) stops the run:
    every rank saves after the next step (the ranks agree in `SignalHandler`), then the error is one line
    saying where that checkpoint went.
    """

    def __init__(self, run: RunConfig, enabled: bool, stop: Callable[[str], None] | None = None) -> None:
        self.run = run
        self.enabled = enabled
        self.logger: TrainingLogger | None = None
        """Opened by `on_train_start`, closed by `on_train_end`: a run's logs live as long as its training."""
        self.stop = stop
        self.failure: DiffmegError | None = None
        self.flops_per_iteration = 0.0
        self.peak_tflops: float | None = None

    def on_train_start(self, trainer: TrainerControl) -> None:
        run, training = self.run, self.run.training  # the matmuls' precision picks MFU's peak
        self.logger = TrainingLogger(run.logging.tensorboard_dir, run.logging.metrics_file, self.enabled)
        self.flops_per_iteration = train_flops_per_iteration(run)
        self.peak_tflops = peak_tflops(trainer.device, "fp8" if training.fp8_format else training.precision)
        self.logger.arguments(run, trainer.num_parameters)

    def _write(self, trainer: TrainerControl, write: Callable[[], None]) -> None:
        try:
            write()
        except DiffmegError as exc:
            self.failure = self.failure or exc
            if self.stop is not None:
                self.stop("a log write failed")

    def on_step_end(self, trainer: TrainerControl, out: StepOutput) -> None:
        if self.failure is not None and self.stop is None:  # no agreement wired (one rank): stop here
            trainer.request_stop("a log write failed")

    def on_log(self, trainer: TrainerControl, record: LogRecord) -> None:
        tflops = self.flops_per_iteration / record.elapsed_ms * 1e3 / self.run.parallel.world_size / 1e12
        mfu = model_flops_utilization(tflops, self.peak_tflops)
        self._write(trainer, lambda: self.logger.training(**vars(record), tflops=tflops, mfu=mfu))

    def on_evaluation(self, trainer: TrainerControl, iteration: int, loss: float) -> None:
        self._write(trainer, lambda: self.logger.validation(iteration, loss))

    def on_train_end(self, trainer: TrainerControl) -> None:
        try:
            if self.logger is not None:
                self.logger.close()
        except DiffmegError as exc:  # the last write, at close
            self.failure = self.failure or exc
        if self.failure is not None:
            save = self.run.checkpoint.save
            saved = (
                f"the last step is saved in {save}: resume with --load {save}"
                if save
                else "nothing saved (no --save)"
            )
            raise DiffmegError(f"{self.failure}; {saved}") from self.failure


class SignalHandler(Callback):
    """SIGTERM, SIGUSR1 (Slurm's pre-timeout signal) and SIGINT (Ctrl-C): save and exit after this step.

    A second Ctrl-C exits at once, without saving. Installed for the training loop only: before it, Ctrl-C
    is an ordinary KeyboardInterrupt (the entry point turns it into one line). A stop that one rank
    decides alone (`stop_soon`: a log it cannot write) goes through the same agreement, so every rank
    saves the same step.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)

    def __init__(self) -> None:
        self.received: str | None = None
        self.local: str | None = None
        self._previous: dict[int, object] = {}

    def stop_soon(self, reason: str) -> None:
        """Stop every rank after the next step (saving with --save), for a reason only this rank knows."""
        self.local = self.local or reason

    def on_train_start(self, trainer: TrainerControl) -> None:
        for sig in self.SIGNALS:
            try:
                self._previous[sig] = signal.signal(sig, self._handler)
            except ValueError:  # not the main thread (e.g. a test driving the Trainer from a thread)
                pass

    def _handler(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if signum == signal.SIGINT and self.received == "SIGINT":
            # os.write: printing from a handler could re-enter a buffered write the main thread is in
            os.write(2, b"error: second Ctrl-C: exiting at once, without saving\n")
            os._exit(130)
        self.received = self.received or name
        if signum == signal.SIGINT:
            os.write(
                2, b" Ctrl-C: saving (with --save), then exiting after this step; Ctrl-C again exits now\n"
            )

    def on_step_end(self, trainer: TrainerControl, out: StepOutput) -> None:
        if collectives.any_rank(self.received is not None or self.local is not None):
            reason = self.received or self.local or "a signal on another rank"
            trainer.request_stop(reason, interrupted=self.received == "SIGINT")

    def on_train_end(self, trainer: TrainerControl) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()


class ExitInterval(Callback):
    """--exit-interval N: save and exit at the first iteration divisible by N."""

    def __init__(self, interval: int | None) -> None:
        self.interval = interval

    def on_step_end(self, trainer: TrainerControl, out: StepOutput) -> None:
        if self.interval and out.iteration % self.interval == 0:
            trainer.request_stop(f"--exit-interval {self.interval}")


class BackgroundSaves(Callback):
    """--async-save: after every step, finalize the checkpoint written in the background once every rank's
    files are on disk, so the tracker moves soon after (Megatron-LM checks every iteration too)."""

    def on_step_end(self, trainer: TrainerControl, out: StepOutput) -> None:
        trainer.checkpoints.poll()

    def on_train_end(self, trainer: TrainerControl) -> None:
        trainer.checkpoints.close()  # the writer process ends with training, not only with the process


def default_callbacks(run: RunConfig, is_logging_rank: bool) -> list[Callback]:
    """The callbacks of a pretrain_diff.py run; the NaN guard comes before the logger (no NaN is logged)."""
    signals = SignalHandler()
    callbacks = [
        NanGuard(),
        MetricsLogger(run, enabled=is_logging_rank, stop=signals.stop_soon),
        signals,
        ExitInterval(run.training.exit_interval),
    ]
    if run.checkpoint.async_save and run.checkpoint.save is not None:
        callbacks.append(BackgroundSaves())
    return callbacks
