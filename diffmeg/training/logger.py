"""Megatron-style log lines, tensorboard scalars and an optional JSON-lines metrics file; at start the
one-line run summary and the run's arguments (arguments.json)."""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable

import torch

from diffmeg.checkpoints import ARGUMENTS_FILE, checkpoint_path, read_tracker
from diffmeg.errors import DiffmegError
from diffmeg.run_config import RunConfig
from diffmeg.training import scalars
from diffmeg.training.hooks import LogRecord


def _device_kind() -> str:
    """What the FLOP/s of a log line are per: a GPU, or (a run without one) a CPU process."""
    return "GPU" if torch.cuda.is_available() else "CPU"


def _ts() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S")


class TrainingLogger:
    """Lives on the logging rank (the last one, which holds the loss, as in Megatron-LM)."""

    def __init__(self, tensorboard_dir: str | None, metrics_file: str | None, enabled: bool) -> None:
        self.enabled = enabled
        self.writer = None
        self.metrics = None
        self.metrics_file = metrics_file
        self.tensorboard_dir = tensorboard_dir
        self.device = _device_kind()
        if not enabled:
            return
        if tensorboard_dir:
            # loads tensorboard (seconds): only for runs that write its scalars
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=tensorboard_dir, max_queue=1000)
        if metrics_file:
            os.makedirs(os.path.dirname(os.path.abspath(metrics_file)), exist_ok=True)
            self.metrics = open(metrics_file, "a")

    def arguments(self, run: RunConfig, num_parameters: int) -> None:
        """The run in one line; its full arguments into `ARGUMENTS_FILE` beside the checkpoints (--save),
        else beside --metrics-file (a write that fails is a note: the run goes on), and with --verbose on
        stdout."""
        if not self.enabled:
            return
        text = json.dumps(dict(sorted(vars(run.to_args()).items())), indent=2, default=str)
        directory = run.checkpoint.save
        if directory is None and self.metrics_file is not None:
            directory = os.path.dirname(os.path.abspath(self.metrics_file))
        path = None if directory is None else os.path.join(directory, ARGUMENTS_FILE)
        try:
            if path is not None:
                os.makedirs(directory, exist_ok=True)
                with open(path, "w") as f:
                    f.write(text + "\n")
        except OSError as exc:
            print(f" could not write the arguments to {path}: {exc.strerror or exc}", flush=True)
            path = None
        print(run_summary(run, num_parameters, path), flush=True)
        if run.logging.verbose:
            print("------------------------ arguments ------------------------", flush=True)
            print(text, flush=True)
            print("-------------------- end of arguments ---------------------", flush=True)

    def training(self, record: LogRecord) -> None:
        """One logged iteration, as `diffmeg.training.scalars` names its figures for each sink; MFU is shown
        where it is known. The line's ETA is the time left to `train_iters` at this line's time per
        iteration. An `early` record (after the run's first iteration) goes to stdout only."""
        if not self.enabled:
            return
        eta = _duration(max(0, record.train_iters - record.iteration) * record.elapsed_ms / 1000)
        parts = scalars.stdout_parts(record, eta=eta, device=self.device)
        print(f" [{_ts()}] " + " | ".join(parts) + " |", flush=True)
        if record.early:
            return
        if self.writer is not None:
            values = scalars.named(record, scalars.TENSORBOARD)
            vs_samples = scalars.TENSORBOARD.loss_vs_samples

            def write(writer) -> None:
                for name, value in values.items():
                    writer.add_scalar(name, value, record.iteration)
                writer.add_scalar(vs_samples, record.loss, record.consumed_samples)
                writer.flush()

            self._write_tensorboard(record.iteration, write)
        if self.metrics is not None:
            self._write_metrics(record.iteration, scalars.named(record, scalars.METRICS_FILE, missing=None))

    def _write_metrics(self, iteration: int, record: dict) -> None:
        """One JSON line, flushed; a failed write (a full disk) ends the run in one line, never silently."""
        try:
            self.metrics.write(json.dumps(record) + "\n")
            self.metrics.flush()
        except OSError as exc:
            metrics, self.metrics = self.metrics, None  # closed once, here: its buffer cannot be written
            with contextlib.suppress(OSError):
                metrics.close()
            raise DiffmegError(
                f"cannot write --metrics-file {self.metrics_file} at iteration {iteration}: "
                f"{exc.strerror or exc}; the run stops here (its earlier records are in that file, every "
                f"loss in the log above): free space or choose another --metrics-file"
            ) from exc

    def _write_tensorboard(self, iteration: int, write: Callable[[object], None]) -> None:
        """`write(writer)`, flushed; a failed write (a full disk: tensorboard's writer thread raises it at
        the next call) ends the run in one line, as the metrics file's does."""
        try:
            write(self.writer)
        except OSError as exc:
            writer, self.writer = self.writer, None  # no further scalars: its event file cannot grow
            with contextlib.suppress(OSError):
                writer.close()
            raise DiffmegError(
                f"cannot write --tensorboard-dir {self.tensorboard_dir} at iteration {iteration}: "
                f"{exc.strerror or exc}; the run stops here (the losses are in the log above): free space "
                f"or choose another --tensorboard-dir"
            ) from exc

    def validation(self, iteration: int, loss: float) -> None:
        if not self.enabled:
            return
        line = (
            f" validation loss at iteration {iteration} | lm loss value: {loss:.6E} | "
            f"lm loss PPL: {scalars.perplexity(loss):.6E} | "
        )
        print("-" * len(line) + "\n" + line + "\n" + "-" * len(line), flush=True)
        if self.writer is not None:
            values = scalars.named_validation(loss, scalars.TENSORBOARD)

            def write(writer) -> None:
                for name, value in values.items():
                    writer.add_scalar(name, value, iteration)
                writer.flush()

            self._write_tensorboard(iteration, write)
        if self.metrics is not None:
            names = scalars.METRICS_FILE
            record = {names.scalars["iteration"]: iteration, **scalars.named_validation(loss, names)}
            self._write_metrics(iteration, record)

    def close(self) -> None:
        """Close both logs; a last write that fails there is one line too (the metrics file first)."""
        metrics, self.metrics = self.metrics, None
        writer, self.writer = self.writer, None
        failed = []
        for flag, path, log in (
            ("--metrics-file", self.metrics_file, metrics),
            ("--tensorboard-dir", self.tensorboard_dir, writer),
        ):
            try:
                if log is not None:
                    log.close()
            except OSError as exc:
                failed.append(f"cannot write {flag} {path} at the end of the run: {exc.strerror or exc}")
        if failed:
            raise DiffmegError(f"{'; '.join(failed)}; free space or choose another folder for the logs")


def _duration(seconds: float) -> str:
    """H:MM:SS (M:SS under an hour), as the end summary's wall time."""
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{secs:02d}" if minutes >= 60 else f"{minutes}:{secs:02d}"


def _count(n: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(int(n))


def run_summary(run: RunConfig, num_parameters: int, arguments_file: str | None) -> str:
    """The run in one line (model, parameters, tokens per step, data, layout, where the arguments are):
    printed at start instead of the full argument dump, which goes to `arguments_file` (and --verbose)."""
    m, t, p = run.model, run.training, run.parallel
    name = m.preset or "custom model"
    if run.data.mock_data:
        data = "mock (synthetic token ids)"
    elif run.data.data_path == ["builtin"]:
        data = "builtin corpus (Python's documentation text)"
    else:
        data = " ".join(run.data.data_path or [])
    ranks = f"{p.world_size} rank{'s' if p.world_size > 1 else ''}"
    layout = (
        f"DP {p.data_parallel_size} TP {p.tensor_model_parallel_size} PP {p.pipeline_model_parallel_size}"
    )
    layout += f" CP {p.context_parallel_size}"
    where = f"arguments in {arguments_file}" if arguments_file else "arguments: --verbose prints them"
    tied = " (output layer tied to the embedding)" if m.tie_embeddings_and_output_weights else ""
    return (
        f" {name} ({m.architecture}): {_count(num_parameters)} parameters{tied}, {m.num_layers} layers, "
        f"hidden {m.hidden_size}, {m.num_attention_heads} heads | {run.tokens_per_step:,} tokens/step "
        f"(global batch {t.global_batch_size} x {m.seq_length}), {t.train_iters:,} iterations, {t.precision} "
        f"| data: {data} | {ranks} ({layout}) | {where}"
    )


def end_summary(args, result: dict, seconds: float) -> str:
    """The run's last line: iterations, tokens, final loss, wall time, and where its checkpoint and logs
    went (or that nothing was saved), so a finished run never ends without a word."""
    wall = _duration(seconds)
    loss = result.get("lm_loss")
    tokens = result["consumed_samples"] * args.seq_length
    line = (
        f" done: {result['iteration']:,} iterations, {_count(tokens)} tokens"
        + (f", final lm loss {loss:.4f}" if loss is not None else "")
        + f", wall time {wall}"
    )
    latest = read_tracker(args.save) if args.save and os.path.isdir(args.save) else None
    if latest is not None:
        line += f" | last checkpoint: {checkpoint_path(args.save, latest)}"
    else:
        line += " | nothing saved: pass --save DIR to keep the model"
    logs = [
        f"{name} {path}"
        for name, path in (("metrics", args.metrics_file), ("tensorboard", args.tensorboard_dir))
        if path
    ]
    return line + (f" | {', '.join(logs)}" if logs else "")
