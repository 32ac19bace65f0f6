"""Every log sink's names for a `LogRecord`'s figures, in one place: the stdout line's parts, the
tensorboard tags, the --metrics-file keys and the W&B keys. A sink renders its table; none spells a name
of its own, so a figure added to `LogRecord` is one line here per sink that shows it."""

from __future__ import annotations

import math
import string
from dataclasses import dataclass
from typing import Any

from diffmeg.training.hooks import LogRecord

STDOUT: tuple[str, ...] = (
    "iteration {iteration:8d}/{train_iters:8d}",
    "ETA: {eta}",
    "consumed samples: {consumed_samples:12d}",
    "elapsed time per iteration (ms): {elapsed_ms:.1f}",
    "throughput per {device} (TFLOP/s/{device}): {tflops:.3f}",
    "MFU: {mfu:.1%}",
    "learning rate: {lr:.6E}",
    "global batch size: {global_batch_size:5d}",
    "lm loss: {loss:.6E}",
    "loss scale: {loss_scale:.1f}",
    "grad norm: {grad_norm:.3f}",
    "number of skipped iterations: {skipped:3d}",
)
"""The Megatron-style line, part by part (joined by ' | '), formatted with the record's fields plus `eta`
and `device`; a part whose field is None is left out (MFU where the peak is unknown), a missing grad norm
reads nan."""

OPTIONAL = frozenset({"mfu"})
"""Fields a sink leaves out where the record lacks them (rather than writing a missing value)."""


@dataclass(frozen=True)
class SinkNames:
    """One sink's names: `scalars` maps `LogRecord` fields to the sink's names; `lambda_name` is the name
    of each layer's lambda (`{}`: the layer), None where the lambdas go as one mapping (a `lambdas` entry
    of `scalars`); `validation` names the validation loss (`loss`) and perplexity (`ppl`)."""

    scalars: dict[str, str]
    validation: dict[str, str]
    lambda_name: str | None = None
    loss_vs_samples: str | None = None
    """The loss again, against the consumed samples (tensorboard's second x axis)."""


TENSORBOARD = SinkNames(
    scalars={
        "loss": "lm loss",
        "lr": "learning-rate",
        "grad_norm": "grad-norm",
        "tflops": "throughput/tflops-per-gpu",
        "elapsed_ms": "iteration-time-ms",
        "global_batch_size": "batch-size",
        "loss_scale": "loss-scale",
        "mfu": "throughput/mfu",
    },
    validation={"loss": "lm loss validation"},
    lambda_name="lambda/{}",
    loss_vs_samples="lm loss vs samples",
)

METRICS_FILE = SinkNames(
    scalars={
        "iteration": "iteration",
        "loss": "lm_loss",
        "grad_norm": "grad_norm",
        "lr": "lr",
        "consumed_samples": "consumed_samples",
        "elapsed_ms": "elapsed_ms",
        "tflops": "tflops_per_gpu",
        "lambdas": "lambdas",
        "mfu": "mfu",
    },
    validation={"loss": "validation_lm_loss"},
)

WANDB = SinkNames(
    scalars={
        "iteration": "iteration",
        **TENSORBOARD.scalars,
        "tokens_per_second": "throughput/tokens-per-sec",
        "consumed_samples": "consumed-samples",
    },
    validation={"loss": "lm loss validation", "ppl": "lm loss validation ppl"},
    lambda_name="lambda/{}",
)
"""Tensorboard's tags (a project moving between the two finds its charts under the same names), plus the
throughput in tokens and the samples seen; `iteration` is the x axis of every chart."""


def stdout_parts(record: LogRecord, **extra: Any) -> list[str]:
    """`STDOUT`'s parts for `record` (`extra`: the fields a record lacks, `eta` and `device`)."""
    fields = vars(record) | extra
    if fields["grad_norm"] is None:
        fields["grad_norm"] = math.nan
    parts = []
    for part in STDOUT:
        names = [name for _, name, _, _ in string.Formatter().parse(part) if name]
        if all(fields[name] is not None for name in names):
            parts.append(part.format(**fields))
    return parts


def named(record: LogRecord, names: SinkNames, missing: Any = math.nan) -> dict[str, Any]:
    """`record`'s figures under `names` (each layer's lambda its own entry where the sink names them so);
    a missing value (no grad norm) is `missing`, an `OPTIONAL` one left out."""
    out: dict[str, Any] = {}
    for name_of, name in names.scalars.items():
        value = getattr(record, name_of)
        if value is None and name_of in OPTIONAL:
            continue
        out[name] = missing if value is None else value
    if names.lambda_name is not None:
        out.update({names.lambda_name.format(layer): v for layer, v in record.lambdas.items()})
    return out


def perplexity(loss: float) -> float:
    """exp(loss), capped at exp(20): an early loss does not overflow the logs."""
    return math.exp(min(20.0, loss))


def named_validation(loss: float, names: SinkNames) -> dict[str, float]:
    """A validation pass's loss (and perplexity, where the sink names it) under `names`."""
    values = {"loss": loss, "ppl": perplexity(loss)}
    return {name: values[key] for key, name in names.validation.items()}
