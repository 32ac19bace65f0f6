"""Megatron-style log lines, tensorboard scalars and an optional JSON-lines metrics file; the one-line run
summary printed at start."""

from __future__ import annotations

import json
import math
import os
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from diffmeg.training.run_config import RunConfig


def _ts() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S")


class TrainingLogger:
    """Lives on the logging rank (the last one, which holds the loss, as in Megatron-LM)."""

    def __init__(self, tensorboard_dir: str | None, metrics_file: str | None, enabled: bool) -> None:
        self.enabled = enabled
        self.writer = None
        self.metrics = None
        if not enabled:
            return
        if tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=tensorboard_dir, max_queue=1000)
        if metrics_file:
            os.makedirs(os.path.dirname(os.path.abspath(metrics_file)), exist_ok=True)
            self.metrics = open(metrics_file, "a")

    def training(
        self,
        *,
        iteration: int,
        train_iters: int,
        consumed_samples: int,
        elapsed_ms: float,
        tflops: float,
        lr: float,
        global_batch_size: int,
        loss: float,
        grad_norm: float | None,
        loss_scale: float,
        lambdas: dict[str, float],
        skipped: int,
    ) -> None:
        if not self.enabled:
            return
        gn = "nan" if grad_norm is None else f"{grad_norm:.3f}"
        print(
            f" [{_ts()}] iteration {iteration:8d}/{train_iters:8d} | "
            f"consumed samples: {consumed_samples:12d} | "
            f"elapsed time per iteration (ms): {elapsed_ms:.1f} | "
            f"throughput per GPU (TFLOP/s/GPU): {tflops:.3f} | "
            f"learning rate: {lr:.6E} | global batch size: {global_batch_size:5d} | lm loss: {loss:.6E} | "
            f"loss scale: {loss_scale:.1f} | grad norm: {gn} | number of skipped iterations: {skipped:3d} |",
            flush=True,
        )
        if self.writer is not None:
            scalars = {
                "lm loss": loss,
                "learning-rate": lr,
                "grad-norm": grad_norm or math.nan,
                "throughput/tflops-per-gpu": tflops,
                "iteration-time-ms": elapsed_ms,
                "batch-size": global_batch_size,
                "loss-scale": loss_scale,
            }
            scalars.update({f"lambda/{k}": v for k, v in lambdas.items()})
            for name, value in scalars.items():
                self.writer.add_scalar(name, value, iteration)
            self.writer.add_scalar("lm loss vs samples", loss, consumed_samples)
            self.writer.flush()
        if self.metrics is not None:
            record = {
                "iteration": iteration,
                "lm_loss": loss,
                "grad_norm": grad_norm,
                "lr": lr,
                "consumed_samples": consumed_samples,
                "elapsed_ms": elapsed_ms,
                "tflops_per_gpu": tflops,
                "lambdas": lambdas,
            }
            self.metrics.write(json.dumps(record) + "\n")
            self.metrics.flush()

    def validation(self, iteration: int, loss: float) -> None:
        if not self.enabled:
            return
        ppl = math.exp(min(20.0, loss))
        line = (
            f" validation loss at iteration {iteration} | lm loss value: {loss:.6E} | "
            f"lm loss PPL: {ppl:.6E} | "
        )
        print("-" * len(line) + "\n" + line + "\n" + "-" * len(line), flush=True)
        if self.writer is not None:
            self.writer.add_scalar("lm loss validation", loss, iteration)
            self.writer.flush()
        if self.metrics is not None:
            self.metrics.write(json.dumps({"iteration": iteration, "validation_lm_loss": loss}) + "\n")
            self.metrics.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.metrics is not None:
            self.metrics.close()


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
