"""What the Trainer and its callbacks share, so that neither imports the other: the records a hook
receives (`StepOutput`, `LogRecord`), the Trainer as a callback sees it (`TrainerControl`, which
`diffmeg.training.trainer.Trainer` implements) and the `Callback` base (OLMo-core's idiom).

The Trainer calls every callback's hooks in list order:
- `on_train_start(trainer)` before the first step, `on_train_end(trainer)` after the last (also on errors);
- `on_step_end(trainer, out)` after every optimizer step, with the loss still on the device: no host sync
  here (the signal check's one-flag all-reduce is the exception: every rank must stop at the same step);
- `on_losses(trainer, losses)` when the pending losses reached the host ({iteration: loss}; once per
  logging interval, and before a save or a stop);
- `on_log(trainer, record)` at logging steps; `on_evaluation(trainer, iteration, loss)` after evaluation.

A callback stops the run with `trainer.request_stop(reason)`; the Trainer then saves (with --save) and exits.
The concrete callbacks are in `diffmeg.training.callbacks` (and the W&B sink in
`diffmeg.training.wandb_sink`); the names each log sink gives a record's scalars in
`diffmeg.training.scalars`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


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
    """Where the model is."""
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
    """One logged iteration, everything every log sink shows (stdout, tensorboard, --metrics-file, W&B):
    the derived figures (throughput, TFLOP/s, MFU) are worked out once, where the record is made, so a new
    sink reuses them instead of computing its own."""

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
    tokens_per_second: float
    """Throughput of the whole job (every rank), over the same iterations as `elapsed_ms`."""
    tflops: float
    """The model's FLOP/s per device (GPU, or CPU process), in TFLOP/s."""
    mfu: float | None = None
    """`tflops` as a fraction of the device's dense peak; None where the peak is unknown."""
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
