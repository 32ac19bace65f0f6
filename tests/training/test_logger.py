"""diffmeg/training/logger.py: a metrics file that cannot be written ends the run in one line."""

from __future__ import annotations

import json

import pytest

from diffmeg.errors import DiffmegError
from diffmeg.training.hooks import LogRecord
from diffmeg.training.logger import TrainingLogger

STEP = dict(
    train_iters=5, consumed_samples=8, elapsed_ms=10.0, tflops=0.0, lr=1e-3, global_batch_size=8, loss=2.5,
    grad_norm=1.0, loss_scale=1.0, lambdas={}, skipped=0, tokens_per_second=51200.0,
)  # fmt: skip


def test_a_full_device_under_the_metrics_file_stops_the_run_in_one_line(capsys):
    logger = TrainingLogger(None, "/dev/full", enabled=True)  # every write: ENOSPC
    with pytest.raises(DiffmegError) as err:
        logger.training(LogRecord(iteration=3, **STEP))
    assert str(err.value) == (
        "cannot write --metrics-file /dev/full at iteration 3: No space left on device; the run stops here "
        "(its earlier records are in that file, every loss in the log above): free space or choose another "
        "--metrics-file"
    )
    assert "lm loss: 2.500000E+00" in capsys.readouterr().out  # the loss is on the log line first


def test_metrics_are_written_as_json_lines(tmp_path):
    path = tmp_path / "m.jsonl"
    logger = TrainingLogger(None, str(path), enabled=True)
    logger.training(LogRecord(iteration=1, **STEP))
    logger.validation(1, 2.25)
    logger.close()
    assert path.read_text().count("\n") == 2 and '"validation_lm_loss": 2.25' in path.read_text()


def test_the_end_summary_says_loss_time_and_where_outputs_went(tmp_path):
    import argparse

    from diffmeg.training.logger import end_summary

    result = {"iteration": 20, "consumed_samples": 160, "lm_loss": 6.123456}
    args = argparse.Namespace(seq_length=64, save=None, metrics_file=None, tensorboard_dir=None)
    assert end_summary(args, result, 83.4) == (
        " done: 20 iterations, 10.24K tokens, final lm loss 6.1235, wall time 1:23 | nothing saved: pass "
        "--save DIR to keep the model"
    )
    (tmp_path / "iter_0000020").mkdir()
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("20")
    args = argparse.Namespace(seq_length=64, save=str(tmp_path), metrics_file="m.jsonl", tensorboard_dir="tb")
    assert end_summary(args, result, 3725).endswith(
        f"wall time 1:02:05 | last checkpoint: {tmp_path}/iter_0000020 | metrics m.jsonl, tensorboard tb"
    )


def test_the_flops_label_names_the_device_kind(capsys, monkeypatch):
    import torch

    for cuda, kind in ((False, "CPU"), (True, "GPU")):
        monkeypatch.setattr(torch.cuda, "is_available", lambda cuda=cuda: cuda)
        TrainingLogger(None, None, enabled=True).training(LogRecord(iteration=1, **STEP))
        assert f"throughput per {kind} (TFLOP/s/{kind}): 0.000 |" in capsys.readouterr().out


def test_every_line_says_the_time_left_and_an_early_line_writes_no_record(tmp_path, capsys):
    path = tmp_path / "m.jsonl"
    logger = TrainingLogger(None, str(path), enabled=True)
    first = STEP | {"train_iters": 7201, "elapsed_ms": 1500.0}
    logger.training(LogRecord(iteration=1, **first, early=True))
    logger.training(LogRecord(iteration=2, **STEP))
    logger.close()
    out = capsys.readouterr().out.splitlines()
    assert "iteration        1/    7201 | ETA: 3:00:00 | " in out[0]  # 7200 iterations of 1.5 s
    assert "iteration        2/       5 | ETA: 0:00 | " in out[1]  # 3 x 10 ms
    assert [json.loads(line)["iteration"] for line in path.read_text().splitlines()] == [2]


def test_a_tensorboard_write_that_fails_is_one_line_also_at_close():
    class Full:
        def add_scalar(self, *args) -> None:
            raise OSError(28, "No space left on device")

        def close(self) -> None:
            raise OSError(28, "No space left on device")

    logger = TrainingLogger(None, None, enabled=True)
    logger.writer, logger.tensorboard_dir = Full(), "tb"
    with pytest.raises(DiffmegError, match=r"^cannot write --tensorboard-dir tb at iteration 3: No space"):
        logger.validation(3, 2.0)
    assert logger.writer is None  # closed once, at the failure: no further scalars
    logger.writer = Full()
    with pytest.raises(DiffmegError) as err:
        logger.close()
    assert str(err.value) == (
        "cannot write --tensorboard-dir tb at the end of the run: No space left on device; free space or "
        "choose another folder for the logs"
    )
