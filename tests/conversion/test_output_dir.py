"""The folder a conversion writes: --overwrite replaces only the conversion's own entries (an export keeps
the folder's other files, a checkpoint folder holding others is refused), built aside and moved in only
when complete, so a failure or a full disk leaves the previous output as it was."""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from diffmeg.conversion import output_dir
from diffmeg.conversion.output_dir import (
    CONVERTED_CHECKPOINT,
    HF_EXPORT,
    atomic_output_dir,
    check_output_path,
)
from diffmeg.errors import DiffmegError


def tree(path: Path) -> dict[str, str]:
    """Every file under `path` with its text (folders by their files)."""
    return {str(p.relative_to(path)): p.read_text() for p in sorted(path.rglob("*")) if p.is_file()}


def old_export(out: Path) -> None:
    """A previous export in three shards, beside the user's own files."""
    out.mkdir()
    for name in ("config.json", "model.safetensors.index.json", "tokenizer.json"):
        (out / name).write_text("old")
    for i in (1, 2, 3):
        (out / f"model-0000{i}-of-00003.safetensors").write_text("old")
    (out / "README.md").write_text("my model card")
    (out / ".git").mkdir()
    (out / ".git" / "HEAD").write_text("ref")
    (out / "llama").mkdir()
    (out / "llama" / "model.safetensors").write_text("another model")


def test_an_export_replaces_its_own_files_and_keeps_the_others(tmp_path):
    out = tmp_path / "hf"
    old_export(out)
    assert check_output_path(str(out), True, str(tmp_path / "ckpt"), HF_EXPORT) == [
        ".git",
        "README.md",
        "llama",
    ]
    with atomic_output_dir(str(out), HF_EXPORT) as tmp:
        for name in ("config.json", "model.safetensors", "generation_config.json"):
            Path(tmp, name).write_text("new")
    assert tree(out) == {
        ".git/HEAD": "ref",
        "README.md": "my model card",
        "config.json": "new",
        "generation_config.json": "new",
        "llama/model.safetensors": "another model",
        "model.safetensors": "new",
    }  # the old shards, their index and tokenizer went with the old export; nothing temporary is left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_a_failed_conversion_leaves_the_previous_output_as_it_was(tmp_path):
    out = tmp_path / "hf"
    old_export(out)
    before = tree(out)
    with pytest.raises(RuntimeError), atomic_output_dir(str(out), HF_EXPORT) as tmp:
        Path(tmp, "config.json").write_text("half")
        raise RuntimeError("conversion failed")
    assert tree(out) == before and sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == [".git"]

    real_replace = os.replace

    def fail_on_the_new_weights(src, dst):  # a move failing half way through the swap
        if str(src).endswith("model.safetensors") and ".convert-new-" in str(src):
            raise OSError(errno.EIO, "I/O error")
        real_replace(src, dst)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(output_dir.os, "replace", fail_on_the_new_weights)
        with pytest.raises(OSError, match="I/O error"), atomic_output_dir(str(out), HF_EXPORT) as tmp:
            for name in ("config.json", "model.safetensors"):
                Path(tmp, name).write_text("new")
    assert tree(out) == before


def test_a_checkpoint_folder_holding_other_files_is_refused(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    for name in ("iter_0000000", "iter_0000100"):
        (run / name).mkdir()
    (run / "latest_checkpointed_iteration.txt").write_text("100")
    (run / "arguments.json").write_text("{}")
    with pytest.raises(DiffmegError) as info:
        check_output_path(str(run), True, str(tmp_path / "hf"), CONVERTED_CHECKPOINT)
    assert str(info.value) == (
        f"--save {run} holds arguments.json, iter_0000100, which a conversion does not write; --overwrite "
        "replaces only a converted checkpoint (iter_0000000/, latest_checkpointed_iteration.txt, "
        "tokenizer/): choose a new or empty --save folder, or move those out of it"
    )
    with pytest.raises(
        DiffmegError, match=r"already exists; pass --overwrite to replace the files of a conv"
    ):
        check_output_path(str(run), False, str(tmp_path / "hf"), CONVERTED_CHECKPOINT)

    converted = tmp_path / "converted"  # a conversion's own output is replaced whole
    converted.mkdir()
    (converted / "iter_0000000").mkdir()
    (converted / "iter_0000000" / "args.json").write_text("old")
    (converted / "latest_checkpointed_iteration.txt").write_text("0")
    assert check_output_path(str(converted), True, str(tmp_path / "hf"), CONVERTED_CHECKPOINT) == []
    with atomic_output_dir(str(converted), CONVERTED_CHECKPOINT) as tmp:
        Path(tmp, "iter_0000000").mkdir()
        Path(tmp, "iter_0000000", "metadata.json").write_text("new")
    assert tree(converted) == {"iter_0000000/metadata.json": "new"}


def test_a_folder_a_run_holds_is_never_replaced(tmp_path, folder_holder):
    """--overwrite of a checkpoint folder while a run trains into it: one line naming the run, nothing
    touched; once the run ended, the conversion's own entries are replaced (its lock goes with it)."""
    out = tmp_path / "out"
    (out / "iter_0000000").mkdir(parents=True)
    run = folder_holder(out)
    with pytest.raises(DiffmegError, match=rf"^--save {out} is in use by another run: pid {run.pid} on "):
        with atomic_output_dir(str(out), CONVERTED_CHECKPOINT):
            raise AssertionError("never reached")
    assert sorted(os.listdir(out)) == ["iter_0000000", "run.lock"] and os.listdir(tmp_path) == ["out"]
    run.stdin.close()
    run.wait(timeout=60)
    with atomic_output_dir(str(out), CONVERTED_CHECKPOINT) as tmp:
        Path(tmp, "iter_0000000").mkdir()
        Path(tmp, "iter_0000000", "metadata.json").write_text("new")
    assert tree(out) == {"iter_0000000/metadata.json": "new"}


def test_an_empty_folder_needs_no_overwrite_and_temporaries_are_told_apart(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert check_output_path(str(empty), False, str(tmp_path / "src"), CONVERTED_CHECKPOINT) == []
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    (empty / f".convert-new-{int(dead.stdout)}-x").mkdir()  # a killed conversion's: its own, replaced
    assert check_output_path(str(empty), True, str(tmp_path / "src"), CONVERTED_CHECKPOINT) == []
    (empty / f".convert-new-{os.getpid()}-y").mkdir()  # a running one's
    with pytest.raises(DiffmegError, match=rf"^process {os.getpid()} is writing {empty} now"):
        check_output_path(str(empty), True, str(tmp_path / "src"), CONVERTED_CHECKPOINT)


def test_atomic_output_dir_follows_the_umask(tmp_path):
    old = os.umask(0o027)
    try:
        with atomic_output_dir(str(tmp_path / "out"), HF_EXPORT) as tmp:
            with open(f"{tmp}/config.json", "w") as f:
                f.write("x")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "out").stat().st_mode) == 0o750
    assert stat.S_IMODE((tmp_path / "out" / "config.json").stat().st_mode) == 0o640


def test_a_full_disk_is_named_and_the_partial_output_removed(tmp_path):
    """Refused up front when the free space is short; a write failing with ENOSPC (here as DCP reports it,
    wrapped in its CheckpointException) is one line naming the directory, and nothing is left behind."""
    import traceback

    from torch.distributed.checkpoint.api import CheckpointException

    out = tmp_path / "out"
    with pytest.raises(DiffmegError, match=r"free but the conversion writes about 1000000000.00 GB"):
        with atomic_output_dir(str(out), HF_EXPORT, needed_bytes=10**18):
            pass
    full = OSError(errno.ENOSPC, "No space left on device")
    with pytest.raises(DiffmegError) as info:
        with atomic_output_dir(str(out), HF_EXPORT, needed_bytes=1000) as tmp:
            (Path(tmp) / "partial.distcp").write_bytes(b"x" * 100)
            raise CheckpointException("write", {0: (full, traceback.StackSummary())})
    message = str(info.value)
    assert message.startswith(f"disk full writing {out}: partial output removed, {tmp_path} has ")
    assert "free space there or choose another --save" in message and "\n" not in message
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(RuntimeError, match="not a disk problem"):  # anything else passes through
        with atomic_output_dir(str(out), HF_EXPORT):
            raise RuntimeError("not a disk problem")
