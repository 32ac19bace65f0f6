"""diffmeg.checkpoints' writer and reader when things go wrong: a full disk while saving (a fault injected at
the writer) and a damaged checkpoint (the file that failed, the iteration, the others to pick from)."""

from __future__ import annotations

import errno
import os

import pytest
import torch

from diffmeg import checkpoints
from diffmeg.checkpoints import TRACKER_FILE, load_sharded, read_tracker
from diffmeg.errors import DiffmegError
from tests.saves import write_checkpoint


def _state(iteration: int) -> dict:
    from megatron.core.dist_checkpointing import ShardedTensor

    weight = torch.arange(1000, dtype=torch.float32) + iteration
    return {"w": ShardedTensor.from_rank_offsets("w", weight), "iteration": iteration}


def _load(root, iteration: int, pick_flag: str = "--iteration") -> torch.Tensor:
    from megatron.core.dist_checkpointing import ShardedTensor

    template = {"w": ShardedTensor.from_rank_offsets("w", torch.empty(1000))}
    return load_sharded(template, checkpoints.checkpoint_path(str(root), iteration), pick_flag)["w"]


def _fail_mid_write(exc: BaseException):
    """dist_checkpointing.save that writes part of a shard, then fails as a full disk makes it fail."""

    def save(state, path, *args, **kwargs):
        with open(os.path.join(path, "__0_0.distcp"), "wb") as f:
            f.write(b"\0" * 4096)
        raise exc

    return save


@pytest.mark.parametrize(
    "fault",
    [
        OSError(errno.ENOSPC, "No space left on device"),
        RuntimeError("[enforce fail at inline_container.cc:783] . unexpected pos 704 vs 598"),
    ],
    ids=["ENOSPC", "torch-zip-writer"],
)
def test_disk_full_while_saving_is_one_line_and_loses_nothing(
    single_rank_parallel_state, tmp_path, monkeypatch, fault
):
    """Issue 16, item 3: the line names the directory, free space and size; the partial iter_N is gone;
    the tracker still names the previous checkpoint, which still loads."""
    from megatron.core import dist_checkpointing

    root = tmp_path / "ckpt"
    write_checkpoint(str(root), 1, _state(1), {"seq_length": 8})
    monkeypatch.setattr(dist_checkpointing, "save", _fail_mid_write(fault))
    monkeypatch.setattr(checkpoints, "free_bytes", lambda path: 3 * 2**20)
    with pytest.raises(DiffmegError) as err:
        write_checkpoint(str(root), 2, _state(2), {"seq_length": 8}, expected_bytes=40 * 2**20)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"disk full while saving iteration 2 to {root}: 3.0 MiB free")
    assert (
        "the checkpoint needs about 40.0 MiB" in message
        and "removed this save's partial iter_0000002" in message
    )
    assert "the latest checkpoint is still iteration 1" in message
    assert not (root / "iter_0000002").exists() and read_tracker(str(root)) == 1
    assert checkpoints.leftovers(str(root)) == []
    monkeypatch.undo()
    assert torch.equal(_load(root, 1), torch.arange(1000, dtype=torch.float32) + 1)


def test_another_save_failure_is_one_line_too(single_rank_parallel_state, tmp_path, monkeypatch):
    from megatron.core import dist_checkpointing

    root = tmp_path / "ckpt"
    monkeypatch.setattr(dist_checkpointing, "save", _fail_mid_write(PermissionError(errno.EACCES, "denied")))
    with pytest.raises(
        DiffmegError, match=r"cannot save iteration 3 to .*: \[Errno 13\] denied; .*no earlier"
    ):
        write_checkpoint(str(root), 3, _state(3), {}, expected_bytes=100)
    assert not (root / "iter_0000003").exists() and not (root / TRACKER_FILE).exists()


@pytest.mark.parametrize("where", ["writing", "tracker"])
def test_a_failed_save_removes_only_what_it_wrote(single_rank_parallel_state, tmp_path, monkeypatch, where):
    """Two runs on one folder (2026-11-27): run A's complete iteration 2 is the latest; run B's save of
    iteration 2 fails, while writing its files or at the tracker, after its folder took the name iter_2.
    B's cleanup removes B's files only: A's iter_2 is intact, still the latest, and the line says so."""
    from megatron.core import dist_checkpointing

    root = tmp_path / "ckpt"
    write_checkpoint(str(root), 2, _state(2), {"seed": 1})  # run A
    if where == "writing":
        monkeypatch.setattr(dist_checkpointing, "save", _fail_mid_write(OSError(errno.EIO, "I/O error")))
    else:

        def no_tracker(root, iteration):
            raise OSError(errno.EIO, "I/O error")

        monkeypatch.setattr(checkpoints, "write_tracker", no_tracker)
    with pytest.raises(DiffmegError) as err:
        write_checkpoint(str(root), 2, _state(20), {"seed": 2})  # run B
    assert str(err.value) == (
        f"cannot save iteration 2 to {root}: [Errno 5] I/O error; removed this save's partial iter_0000002, "
        f"the latest checkpoint is still iteration 2 in {TRACKER_FILE}"
    )
    monkeypatch.undo()
    assert sorted(os.listdir(root)) == ["iter_0000002", TRACKER_FILE]
    assert checkpoints.read_checkpoint_args(str(root))[0].seed == 1
    assert torch.equal(_load(root, 2), torch.arange(1000, dtype=torch.float32) + 2)


def test_a_save_of_an_existing_iteration_keeps_the_earlier_one(single_rank_parallel_state, tmp_path, capsys):
    """A run that went back (--ckpt-step) or started over in the folder replaces iter_N only once its own
    is complete, and keeps the earlier one under another name: no save deletes what it did not write."""
    root = tmp_path / "ckpt"
    write_checkpoint(str(root), 2, _state(2), {"seed": 1})
    write_checkpoint(str(root), 2, _state(20), {"seed": 2})
    (kept,) = checkpoints.leftovers(str(root))
    assert kept.startswith("iter_0000002.replaced-")
    assert f" {root}/iter_0000002 was there already (an earlier save of iteration 2): kept as {kept}" in (
        capsys.readouterr().out
    )
    assert checkpoints.read_checkpoint_args(str(root))[0].seed == 2
    assert torch.equal(_load(root, 2), torch.arange(1000, dtype=torch.float32) + 20)
    os.rename(root / kept, root / "iter_0000001")  # what it holds is A's checkpoint, whole
    assert torch.equal(_load(root, 1), torch.arange(1000, dtype=torch.float32) + 2)


def test_a_damaged_checkpoint_names_the_file_and_the_alternatives(single_rank_parallel_state, tmp_path):
    """Issue 16, item 4: not "remove the directory" but which file, which iteration, and what else loads."""
    root = tmp_path / "ckpt"
    for it in (1, 2, 3):
        write_checkpoint(str(root), it, _state(it), {})
    shard = next((root / "iter_0000003").glob("*.distcp"))
    shard.write_bytes(b"garbage")
    with pytest.raises(DiffmegError) as err:
        _load(root, 3, "--ckpt-step")
    message = str(err.value)
    assert message.startswith(
        f"cannot load checkpoint iteration 3 of {root}: iter_0000003/{shard.name} is 7 bytes"
    )
    assert message.endswith(f"other complete iterations in {root}: 1, 2; start from one with --ckpt-step N")
    assert "remove" not in message and "\n" not in message


def test_damage_inside_a_chunk_is_found(single_rank_parallel_state, tmp_path):
    root = tmp_path / "ckpt"
    write_checkpoint(str(root), 1, _state(1), {})
    shard = next((root / "iter_0000001").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[:64] = b"x" * 64  # the first chunk's zip header: same size, unreadable
    shard.write_bytes(bytes(data))
    found = checkpoints.damaged_file(str(root / "iter_0000001"))
    assert found is not None and found[0] == f"iter_0000001/{shard.name}" and "unreadable" in found[1]
    with pytest.raises(DiffmegError, match="no other complete iteration"):
        _load(root, 1)


def test_an_intact_checkpoint_has_no_damaged_file(single_rank_parallel_state, tmp_path):
    write_checkpoint(str(tmp_path), 5, _state(5), {})
    assert checkpoints.damaged_file(str(tmp_path / "iter_0000005")) is None


def test_disk_full_in_a_background_write_is_one_line_at_its_finalize(single_rank_parallel_state, tmp_path):
    """--async-save: the write fails in the writer process (its files lead to /dev/full: the kernel's own
    ENOSPC); finalizing it (on every rank) raises the same one line, the partial iter_N is removed and the
    tracker keeps the previous checkpoint."""
    from diffmeg.compat.checkpoint_writer import AsyncSaves

    root = tmp_path / "ckpt"
    write_checkpoint(str(root), 1, _state(1), {})
    saves = AsyncSaves()
    request = checkpoints.begin_checkpoint(str(root), 2, _state(2), {}, expected_bytes=2**20)
    for path, _, _ in request.async_fn_args[1]:  # megatron-core's write buckets: one file each
        os.symlink("/dev/full", path)
    saves.schedule_async_request(request)
    (saving,) = root.glob("iter_0000002.saving-*")  # the save's own folder: iter_N only when complete
    assert not (root / "iter_0000002").exists()
    with pytest.raises(DiffmegError) as err:
        saves.maybe_finalize_async_calls(blocking=True)
    saves.close()
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"disk full while saving iteration 2 to {root}")
    assert "removed this save's partial iter_0000002, the latest checkpoint is still iteration 1" in message
    assert not saving.exists() and not (root / "iter_0000002").exists() and read_tracker(str(root)) == 1
    assert saves.get_num_unfinalized_calls() == 0


def test_an_abandoned_background_save_removes_its_own_files(single_rank_parallel_state, tmp_path):
    """Training that stops on an error while an --async-save checkpoint is written never finalizes it: its
    folder goes (rank 0 made it), the folder of another run's unfinished save stays."""
    from diffmeg.compat.checkpoint_writer import AsyncSaves, HoldAfterWrite

    root = tmp_path / "ckpt"
    write_checkpoint(str(root), 1, _state(1), {})
    (root / "iter_0000002.saving-node7-4242-a1b2c3").mkdir()  # another run's, which died writing it
    saves = AsyncSaves()
    saves.after_write = HoldAfterWrite(" held until killed")
    saves.schedule_async_request(checkpoints.begin_checkpoint(str(root), 2, _state(2), {}))
    assert len(checkpoints.leftovers(str(root))) == 2
    saves.close(abort=True)
    checkpoints.abandon_save(str(root), 2)
    assert checkpoints.leftovers(str(root)) == ["iter_0000002.saving-node7-4242-a1b2c3"]
    assert read_tracker(str(root)) == 1 and checkpoints.iteration_dirs(str(root)) == [1]


def test_every_reader_names_a_truncated_file_and_a_corrupt_common_pt_the_same_way(
    single_rank_parallel_state, tmp_path
):
    """One corrupt-checkpoint message for every reader: mcore-to-hf's streaming reader names a truncated
    .distcp with its byte counts before writing anything (pick with --iteration), and a resumed run names
    a corrupt common.pt (never torch's advice to unpickle it unsafely)."""
    from diffmeg.conversion.checkpoint_io import McoreCheckpointReader
    from diffmeg.run_config import RunConfig
    from diffmeg.training.arguments import resolve_args
    from diffmeg.training.checkpointing import CheckpointManager

    root = tmp_path / "ckpt"
    for it in (1, 2):
        write_checkpoint(str(root), it, _state(it), {})
    shard = next((root / "iter_0000002").glob("*.distcp"))
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size // 2)
    with pytest.raises(DiffmegError) as err:
        McoreCheckpointReader(str(root))
    assert str(err.value).startswith(
        f"cannot load checkpoint iteration 2 of {root}: iter_0000002/{shard.name} is {size // 2} bytes, its "
        "index expects"
    )
    assert str(err.value).endswith(f"in {root}: 1; start from one with --iteration N")

    (root / "iter_0000001" / "common.pt").write_bytes(b"not a pickle")
    args = resolve_args(["--model", "diff-tiny", "--mock-data", "--load", str(root), "--ckpt-step", "1"], 1)
    manager = CheckpointManager(RunConfig.from_args(args), log=lambda line: None)
    with pytest.raises(DiffmegError) as err:
        manager.resolve()  # the common state is read at start
    message = str(err.value)
    assert message.startswith(f"cannot load checkpoint iteration 1 of {root}: iter_0000001/common.pt cannot")
    assert "weights_only" not in message and "\n" not in message


def test_a_checkpoint_folder_carries_its_tokenizer_and_finds_it_where_it_lies(tmp_path):
    """carry_tokenizer copies a run's Hugging Face tokenizer into {root}/tokenizer once and names it
    relative; locate_tokenizer resolves it wherever the folder now lies, and falls back to that copy for a
    checkpoint written before (an absolute path that is gone)."""
    from diffmeg.checkpoints import carry_tokenizer, locate_tokenizer

    source, root = tmp_path / "upcycle" / "tokenizer", tmp_path / "run"
    source.mkdir(parents=True)
    (source / "tokenizer.json").write_text('{"v": 1}')
    args = {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": str(source), "lr": 1.0}
    assert carry_tokenizer(str(root), args) == {**args, "tokenizer_model": "tokenizer"}
    assert (root / "tokenizer" / "tokenizer.json").read_text() == '{"v": 1}'
    assert args["tokenizer_model"] == str(source)  # the run's own arguments are untouched
    assert carry_tokenizer(str(root), args)["tokenizer_model"] == "tokenizer"  # the same files: no copy
    (source / "tokenizer.json").write_text('{"v": 2}')
    with pytest.raises(DiffmegError, match=r"run/tokenizer holds another tokenizer than this run's"):
        carry_tokenizer(str(root), args)
    cl100k = {"tokenizer_type": "cl100k_base", "tokenizer_model": None}
    assert carry_tokenizer(str(tmp_path / "other"), cl100k) is cl100k and not (tmp_path / "other").exists()

    moved = tmp_path / "moved"
    root.rename(moved)
    relative = {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": "tokenizer"}
    assert locate_tokenizer(str(moved), relative)["tokenizer_model"] == str(moved / "tokenizer")
    old = {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": str(tmp_path / "gone" / "tokenizer")}
    assert locate_tokenizer(str(moved), old)["tokenizer_model"] == str(moved / "tokenizer")
    there = {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": str(source)}
    assert locate_tokenizer(str(moved), there) == there  # an older absolute path that still exists


# ------------------------------------------------------------------------ which iteration a reader loads


def _complete(root, *iterations: int, tracker: int | None = None) -> str:
    """iter_N directories with args.json (what a finished save leaves), and the tracker if given."""
    for it in iterations:
        (root / f"iter_{it:07d}").mkdir(parents=True)
        (root / f"iter_{it:07d}" / checkpoints.ARGS_FILE).write_text("{}")
    if tracker is not None:
        (root / TRACKER_FILE).write_text(str(tracker))
    return str(root)


@pytest.mark.parametrize(
    "iteration,tracker,expected",
    [
        (7, 4, "--iteration 7: {root}/iter_0000007 is missing; "),
        (6, 4, "--iteration 6: {root}/iter_0000006 is incomplete (no args.json: an unfinished save); "),
        (None, 7, f"{TRACKER_FILE} in {{root}} names iteration 7, but {{root}}/iter_0000007 is missing; "),
        (None, 6, f"{TRACKER_FILE} in {{root}} names iteration 6, but {{root}}/iter_0000006 is incomplete"),
        (None, None, f"{{root}} has no {TRACKER_FILE}: its last save did not finish; "),
    ],
    ids=["missing", "incomplete", "tracker-missing", "tracker-incomplete", "no-tracker"],
)
def test_a_missing_iteration_is_one_line_listing_the_complete_ones(tmp_path, iteration, tracker, expected):
    """Every reader (the tools' --iteration through read_checkpoint_args and model_source, training's
    --ckpt-step) resolves through `resolve_iteration`: what was asked, what is there, what loads instead."""
    from diffmeg.model_source import read_checkpoint_info

    root = _complete(tmp_path / "run", 2, 4, tracker=tracker)
    (tmp_path / "run" / "iter_0000006").mkdir()  # a save that died before its args.json
    for read in (checkpoints.read_checkpoint_args, read_checkpoint_info):
        with pytest.raises(DiffmegError) as err:
            read(root, iteration)
        message = str(err.value)
        assert message.startswith(expected.format(root=root)), message
        assert message.endswith(f"complete iterations in {root}: 2, 4; start from one with --iteration N")
        assert "\n" not in message
    assert checkpoints.resolve_iteration(root, 2) == 2
    with pytest.raises(DiffmegError, match=r"--ckpt-step 5: .* start from one with --ckpt-step N$"):
        checkpoints.resolve_iteration(root, 5, "--ckpt-step")


def test_no_complete_iteration_says_none_and_a_folder_without_one_says_what_it_is(tmp_path):
    died, hf = tmp_path / "died", tmp_path / "hf"
    (died / "iter_0000003").mkdir(parents=True)
    with pytest.raises(DiffmegError) as err:
        checkpoints.read_checkpoint_args(str(died))
    assert str(err.value).endswith(f"no complete iteration in {died}; point the run at another checkpoint")

    (tmp_path / "empty").mkdir()
    with pytest.raises(DiffmegError, match=r"^--load .*/empty is not a checkpoint directory \(no "):
        checkpoints.read_checkpoint_args(str(tmp_path / "empty"), 3)
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    with pytest.raises(DiffmegError) as err:
        checkpoints.resolve_iteration(str(hf))
    assert str(err.value) == (
        f"--load {hf} is a Hugging Face model folder (config.json), not a pretrain_diff.py checkpoint; "
        f"convert it with: python tools/convert_checkpoint.py hf-to-mcore --load {hf} --save CKPT_DIR"
    )
