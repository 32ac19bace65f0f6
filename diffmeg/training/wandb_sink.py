"""Weights & Biases as one more log sink (--wandb-project, Megatron-LM's flags): the scalars tensorboard
gets (`diffmeg.training.scalars.WANDB`), the resolved arguments as the W&B config, on the logging rank.

A resumed run continues the same W&B run: its id is kept in the run's W&B folder (`RUN_ID_FILE`:
--wandb-save-dir, else <--save>/wandb) and given back to W&B with resume="allow". `WANDB_MODE=offline`
(a node without network) writes the run under that folder for a later `wandb sync`. Logging never stops
training: a W&B call that fails is one warning line, then the run goes on without W&B.
"""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import string
from collections.abc import Callable
from types import ModuleType

from diffmeg.errors import DiffmegError, stderr
from diffmeg.run_config import RunConfig
from diffmeg.training import scalars
from diffmeg.training.hooks import Callback, LogRecord, TrainerControl

RUN_ID_FILE = "wandb_run_id.txt"
INSTALL = "pip install 'diffmeg[wandb]' (or pip install wandb)"


def import_wandb(load: bool = True) -> ModuleType | None:
    """The wandb package (`load`; else only whether it is there), or one line saying how to install it: a
    run that asked for W&B is refused at the start, on every rank alike, rather than trained without it."""
    missing = DiffmegError(f"--wandb-project needs the wandb package, which is not installed: {INSTALL}")
    if not load:
        try:
            found = importlib.util.find_spec("wandb") is not None
        except ValueError:  # an import of it that was blocked (sys.modules["wandb"] is None)
            found = False
        if not found:
            raise missing
        return None
    try:
        import wandb
    except ImportError as exc:
        raise missing from exc
    return wandb


def wandb_folder(run: RunConfig) -> str | None:
    """Where the W&B run and its id go: --wandb-save-dir, else <--save>/wandb (as Megatron-LM), else
    nowhere of ours (W&B's default, $WANDB_DIR or the working folder; no id kept: no resume)."""
    if run.logging.wandb_save_dir:
        return run.logging.wandb_save_dir
    if run.checkpoint.save:
        return os.path.join(run.checkpoint.save, "wandb")
    return None


def run_id(folder: str | None) -> str:
    """The W&B run id kept in `folder` (a resumed run's), else a new one (8 characters of [a-z0-9], as
    W&B's own), written there first."""
    path = None if folder is None else os.path.join(folder, RUN_ID_FILE)
    if path is not None and os.path.isfile(path):
        with open(path) as f:
            if kept := f.read().strip():
                return kept
    new = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
    if path is not None:
        os.makedirs(folder, exist_ok=True)
        with open(path, "w") as f:
            f.write(new + "\n")
    return new


class WandbSink(Callback):
    """The W&B run of a training run: opened at its start, one history row per logged iteration and per
    validation pass (`iteration` their x axis, so a resume from an earlier checkpoint draws on), closed at
    its end. Built on every rank (each checks that wandb is installed: every rank refuses alike), active
    on the logging rank (the last, which holds the loss)."""

    def __init__(self, run: RunConfig, enabled: bool) -> None:
        self.run = run
        self.enabled = enabled
        self.wandb = import_wandb(load=enabled)
        self.wandb_run = None
        """The open W&B run; None before the start, off the logging rank, and after a failed W&B call."""

    def _guard(self, when: str, call: Callable[[], None]) -> None:
        """`call()`; one that fails is one warning line, and W&B is off for the rest of the run."""
        try:
            call()
        except Exception as exc:  # any fault of the sink: the training is worth more than its W&B charts
            self.wandb_run = None
            why = " ".join(str(exc).split()) or "no message"  # one line, whatever the exception says
            stderr(
                f" warning: W&B logging failed {when} ({type(exc).__name__}: {why}); training goes on "
                f"without W&B (the other logs are complete)"
            )

    def on_train_start(self, trainer: TrainerControl) -> None:
        if not self.enabled:
            return

        def start() -> None:
            logging, folder = self.run.logging, wandb_folder(self.run)
            if folder is not None:
                os.makedirs(folder, exist_ok=True)
            config = json.loads(json.dumps(vars(self.run.to_args()), default=str))  # W&B keeps JSON values
            wandb_run = self.wandb.init(
                project=logging.wandb_project,
                entity=logging.wandb_entity,
                name=logging.wandb_exp_name,
                dir=folder,
                id=run_id(folder),
                resume="allow",
                config=config,
            )
            wandb_run.define_metric(scalars.WANDB.scalars["iteration"])
            wandb_run.define_metric("*", step_metric=scalars.WANDB.scalars["iteration"])
            self.wandb_run = wandb_run

        self._guard("at the start", start)

    def on_log(self, trainer: TrainerControl, record: LogRecord) -> None:
        if self.wandb_run is None or record.early:
            return
        values = scalars.named(record, scalars.WANDB)
        self._guard(f"at iteration {record.iteration}", lambda: self.wandb_run.log(values))

    def on_evaluation(self, trainer: TrainerControl, iteration: int, loss: float) -> None:
        if self.wandb_run is None:
            return
        names = scalars.WANDB
        values = {names.scalars["iteration"]: iteration, **scalars.named_validation(loss, names)}
        self._guard(f"at iteration {iteration}", lambda: self.wandb_run.log(values))

    def on_train_end(self, trainer: TrainerControl) -> None:
        if self.wandb_run is not None:
            self._guard("at the end", self.wandb_run.finish)
            self.wandb_run = None
