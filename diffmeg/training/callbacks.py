"""The callbacks of a pretrain_diff.py run (the hooks and the records they receive: `diffmeg.training.hooks`):
the NaN guard, the logs (stdout, tensorboard, --metrics-file; W&B in `diffmeg.training.wandb_sink`), signals,
--exit-interval and background saves, and `default_callbacks`, the list a run gets.
"""

from __future__ import annotations

import math
import os
import signal
from collections.abc import Callable

from diffmeg import collectives
from diffmeg.errors import DiffmegError
from diffmeg.run_config import RunConfig
from diffmeg.training.hooks import Callback, LogRecord, StepOutput, TrainerControl
from diffmeg.training.logger import TrainingLogger
from diffmeg.training.wandb_sink import WandbSink


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
    Megatron-style stdout lines, tensorboard scalars and --metrics-file, each as `diffmeg.training.scalars`
    names a `LogRecord`'s figures (the model's FLOP/s and MFU come in the record).

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

    def on_train_start(self, trainer: TrainerControl) -> None:
        run = self.run
        self.logger = TrainingLogger(run.logging.tensorboard_dir, run.logging.metrics_file, self.enabled)
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
        self._write(trainer, lambda: self.logger.training(record))

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
    if run.logging.wandb_project is not None:
        callbacks.insert(2, WandbSink(run, enabled=is_logging_rank))  # after the logs: a line, then W&B
    if run.checkpoint.async_save and run.checkpoint.save is not None:
        callbacks.append(BackgroundSaves())
    return callbacks
