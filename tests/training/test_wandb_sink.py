"""diffmeg/training/wandb_sink.py: an offline W&B run of pretrain_diff.py and its resume, read back from
W&B's own run files; wandb missing; a W&B call that fails."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import pytest

from diffmeg.errors import DiffmegError
from diffmeg.run_config import RunConfig
from diffmeg.training.arguments import resolve_args
from diffmeg.training.callbacks import default_callbacks
from diffmeg.training.wandb_sink import RUN_ID_FILE
from tests.distributed.runner import read_metric, run_training
from tests.training.helpers import SMALL


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """W&B without network, its every file under tmp_path (no home folder, no cache of the user's)."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    for name in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home"))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)


def wandb_records(path: Path):
    """The records of a `.wandb` file (W&B's run log: a 7-byte header, then LevelDB's log format of 32 KiB
    blocks whose chunks hold `wandb.proto` Records), as wandb-core writes them."""
    from wandb.proto import wandb_internal_pb2

    data, block, pos, pending = path.read_bytes(), 32768, 7, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header: zeros
            pos += block - pos % block
            continue
        length, kind = struct.unpack_from("<HB", data, pos + 4)
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def read_run(path: Path) -> tuple[str, dict, list[dict]]:
    """(run id, config, history rows) of one offline run's `.wandb` file."""
    run_id, config, rows = None, {}, []
    for record in wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run_id = record.run.run_id
            config |= {item.key: json.loads(item.value_json) for item in record.run.config.update}
        elif kind == "history":
            rows.append(
                {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json)
                    for item in record.history.item
                }
            )
    return run_id, config, rows


def test_an_offline_run_and_its_resume_log_every_scalar_to_one_wandb_run(tmp_path, offline):
    pytest.importorskip("wandb")
    ckpt = tmp_path / "ckpt"
    flags = ["--lr-decay-iters", "4", "--eval-interval", "2", "--eval-iters", "1", "--save", str(ckpt)]
    flags += ["--load", str(ckpt), "--wandb-project", "diffmeg-test", "--wandb-exp-name", "tiny"]
    run_training(tmp_path, "a", ["--train-iters", "2", *flags])
    run_training(tmp_path, "b", ["--train-iters", "4", *flags])  # the resume, from iteration 2

    kept = (ckpt / "wandb" / RUN_ID_FILE).read_text().strip()
    files = sorted((ckpt / "wandb" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert [f.name for f in files] == [f"run-{kept}.wandb"] * 2  # two starts, one W&B run
    runs = [read_run(f) for f in files]
    assert [run_id for run_id, _, _ in runs] == [kept, kept]
    config = runs[0][1]
    assert config["wandb_project"] == "diffmeg-test" and config["train_iters"] == 2
    assert runs[1][1]["train_iters"] == 4 and config["num_layers"] == 4

    rows = [row for _, _, history in runs for row in history]
    train = [row for row in rows if "lm loss" in row]
    losses = read_metric(tmp_path, "a", "lm_loss") | read_metric(tmp_path, "b", "lm_loss")
    assert train, rows
    assert [row["iteration"] for row in train] == [1, 2, 3, 4]
    assert [row["lm loss"] for row in train] == pytest.approx([losses[i] for i in (1, 2, 3, 4)])
    lambdas = read_metric(tmp_path, "a", "lambdas")[1]
    assert len(lambdas) == 4
    names = {"learning-rate", "grad-norm", "batch-size", "throughput/tokens-per-sec"}
    names |= {"throughput/tflops-per-gpu", "iteration-time-ms", "consumed-samples"}
    names |= {f"lambda/{layer}" for layer in lambdas}
    for row in train:
        assert names <= row.keys(), sorted(names - row.keys())
        assert row["batch-size"] == 8 and row["throughput/tokens-per-sec"] > 0
    assert train[0]["lambda/" + next(iter(lambdas))] == pytest.approx(next(iter(lambdas.values())))
    validation = [row for row in rows if "lm loss validation" in row]
    assert [row["iteration"] for row in validation] == [2, 4]
    assert all(row["lm loss validation ppl"] > 1 for row in validation)


def test_without_wandb_the_run_is_refused_on_every_rank_in_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` fails as where it is not installed
    run = RunConfig.from_args(resolve_args([*SMALL, "--wandb-project", "p"], world_size=1))
    for logging_rank in (True, False):
        with pytest.raises(DiffmegError) as err:
            default_callbacks(run, is_logging_rank=logging_rank)
        assert str(err.value) == (
            "--wandb-project needs the wandb package, which is not installed: pip install 'diffmeg[wandb]' "
            "(or pip install wandb)"
        )


def test_a_failing_wandb_call_is_one_warning_and_training_goes_on(
    single_rank_parallel_state, offline, tmp_path, capsys, monkeypatch
):
    wandb = pytest.importorskip("wandb")
    from diffmeg.training.builders import release_training_objects
    from diffmeg.training.trainer import Trainer

    def full_disk(self, *args, **kwargs) -> None:
        raise OSError(28, "No space left on device")

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(key, "")  # what the Trainer sets is removed again at the end
        monkeypatch.delenv(key)
    monkeypatch.setattr(wandb.sdk.wandb_run.Run, "log", full_disk)
    metrics = tmp_path / "metrics.jsonl"
    flags = ["--train-iters", "4", "--log-interval", "2", "--metrics-file", str(metrics)]
    flags += ["--wandb-project", "p", "--wandb-save-dir", str(tmp_path / "wb")]
    trainer = Trainer(RunConfig.from_args(resolve_args([*SMALL, *flags], world_size=1)))
    try:
        summary = trainer.train()
    finally:
        wandb.finish()  # the W&B run the failure left open (the sink calls W&B no more)
        release_training_objects(trainer.model_config, trainer.model)
    assert summary["iteration"] == 4 and summary["stop_reason"] is None
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert warnings == [
        " warning: W&B logging failed at iteration 2 (OSError: [Errno 28] No space left on device); "
        "training goes on without W&B (the other logs are complete)"
    ]
    assert [json.loads(line)["iteration"] for line in metrics.read_text().splitlines()] == [2, 4]
