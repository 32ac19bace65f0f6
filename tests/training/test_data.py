"""pretrain_diff.py's data messages (diffmeg.training.data): a blended run prints nothing of megatron-core's
index cache, a read-only dataset folder trains with one line about the per-user cache, an unwritable
--data-cache-path and a split the run refuses are each one line, the dry run's line included (issue 43)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.data.helpers import write_dataset
from tests.distributed.runner import run_pretrain

SMALL = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16"]
SMALL += ["--vocab-size", "256", "--tokenizer-type", "null", "--micro-batch-size", "2"]
SMALL += ["--global-batch-size", "2", "--train-iters", "2", "--lr", "1e-3", "--log-interval", "1"]
SMALL += ["--eval-iters", "1", "--eval-interval", "2"]
MEGATRON_CACHE_WORDS = ("path_to_cache", "BlendedDataset", "GPTDataset", "data cache directory", "Traceback")


@pytest.fixture
def datasets(tmp_path) -> Path:
    """tmp/data/{a,b}: 200 documents of 60 ids each."""
    folder = tmp_path / "data"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for name in ("a", "b"):
        write_dataset(folder / name, [rng.integers(0, 250, 60).tolist() for _ in range(200)])
    return folder


def _run(tmp_path: Path, flags: list[str]):
    return run_pretrain([*SMALL, *flags], tmp_path, DIFFMEG_CACHE_DIR=str(tmp_path / "home"))


def _quiet(output: str) -> None:
    assert not [line for line in output.splitlines() if any(w in line for w in MEGATRON_CACHE_WORDS)], output


def test_a_blended_run_says_nothing_about_the_index_cache(tmp_path, datasets):
    proc = _run(tmp_path, ["--split", "98,1,1", "--data-path", "0.5", "data/a", "0.5", "data/b"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    _quiet(proc.stdout + proc.stderr)
    assert " done: 2 iterations" in proc.stdout
    assert any("BlendedDataset-train" in p.name for p in (datasets / "cache").iterdir())


def test_a_read_only_dataset_folder_trains_with_one_line_about_the_cache(tmp_path, datasets, read_only_view):
    view = read_only_view(datasets)
    proc = _run(tmp_path, ["--split", "98,1,1", "--data-path", "0.5", f"{view}/a", "0.5", f"{view}/b"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    _quiet(proc.stdout + proc.stderr)
    (line,) = [x for x in proc.stderr.splitlines() if "dataset index cache" in x]
    assert line.startswith(f"data: {view} cannot be written, so the dataset index cache is {tmp_path}/home/")
    assert "--data-cache-path DIR chooses another" in line


def test_an_unwritable_data_cache_path_is_one_line_in_the_run_and_the_dry_run(tmp_path, datasets):
    (tmp_path / "afile").write_text("")
    flags = ["--split", "98,1,1", "--data-path", "data/a", "--data-cache-path", "afile/cache"]
    expected = (
        f"error: --data-cache-path {tmp_path}/afile/cache: {tmp_path}/afile is a file, so the folder cannot "
        "be made under it"
    )
    for extra in ([], ["--dry-run"]):
        proc = _run(tmp_path, [*flags, *extra])
        assert proc.returncode == 2 and proc.stderr.splitlines()[-1] == expected, proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr and " iteration " not in proc.stdout


def test_a_split_the_run_refuses_is_refused_by_the_dry_run_with_the_same_line(tmp_path, datasets):
    """200 documents under the default --split 969,30,1: the test split gets none."""
    flags = ["--data-path", "0.5", "data/a", "0.5", "data/b"]
    run, dry = _run(tmp_path, flags), _run(tmp_path, [*flags, "--dry-run"])
    expected = (
        "error: --split 969,30,1 gives the test split of data/a no documents (it has 200 documents); use "
        "more data or a split such as '969,30,0'"
    )
    for proc in (run, dry):
        assert proc.returncode == 2 and proc.stderr.splitlines()[-1] == expected, proc.stderr[-3000:]
    assert "dataset(s) found" not in dry.stderr
