"""diffmeg.compat.checkpoint_writer: megatron-core's torch_dist saves, sync (threads) and async (one
persistent writer process per rank).

The first test pins the megatron-core 0.16.1 internals the writer relies on, so an upgrade that changes
them fails here and names what to revisit. The others: a sync save starts no process; async saves go to one
writer that writes the tensors as they were when each save was scheduled (a save waits for the one being
written: the buffer is then free) and that `close` stops, leaving no process and no shared memory; a writer
that dies is a failed save (one line) and the next save starts a new one; a writer that cannot be started
writes at once.
"""

from __future__ import annotations

import inspect
import multiprocessing
import os
import queue
import threading

import psutil
import pytest
import torch

from diffmeg.checkpoints import begin_checkpoint, checkpoint_path, load_sharded
from diffmeg.compat import checkpoint_writer
from diffmeg.compat.checkpoint_writer import AsyncSaves, HoldAfterWrite, use_in_process_results_queue
from diffmeg.errors import DiffmegError
from tests.saves import write_checkpoint


def _state(values: torch.Tensor) -> dict:
    from megatron.core.dist_checkpointing import ShardedTensor

    return {"w": ShardedTensor.from_rank_offsets("w", values), "note": "common"}


def _load(root, iteration: int) -> torch.Tensor:
    from megatron.core.dist_checkpointing import ShardedTensor

    template = {"w": ShardedTensor.from_rank_offsets("w", torch.empty(1000))}
    return load_sharded(template, checkpoint_path(str(root), iteration))["w"]


def _snapshot_fds() -> list[str]:
    """This process's open snapshot buffers (memfds), by name."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if "diffmeg-ckpt-snapshot" in target:
            found.append(target)
    return found


def test_megatron_core_internals_the_writer_relies_on():
    from megatron.core.dist_checkpointing.strategies import async_utils, filesystem_async
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
    from torch.distributed.checkpoint import filesystem

    fs = FileSystemWriterAsync
    # The results queue is a module global that _get_write_results_queue creates only when it is None.
    assert "_results_queue" in vars(filesystem_async)
    assert "if _results_queue is None" in inspect.getsource(filesystem_async._get_write_results_queue)
    assert "self.results_queue.get_nowait()" in inspect.getsource(fs.retrieve_write_results)
    # The save function is (write_preloaded_data_multiproc, transforms, use_msc) + (rank, buckets, queue).
    source = inspect.getsource(fs.get_save_function_and_args)
    assert "partial(self.write_preloaded_data_multiproc, transform_list, self.use_msc)" in source
    assert "[torch.distributed.get_rank(), self.write_buckets, self.results_queue]" in source
    # A bucket is (file path, storage key, (bytes items, tensor items)): the plan sent to the writer.
    assert "os.path.join(self.checkpoint_dir, file_name)," in inspect.getsource(fs.prepare_write_data)
    assert "(bytes_data, tensor_data)," in inspect.getsource(fs.prepare_write_data)
    # One file per call of write_preloaded_data (undecorated: __wrapped__), reporting through two queues;
    # each tensor torch.save'd whole (its storage): the writer gives each view a storage of its own size.
    params = list(inspect.signature(fs.write_preloaded_data.__wrapped__).parameters)
    assert params[:6] == [
        "transform_list",
        "local_proc_idx",
        "write_bucket",
        "results_queue",
        "count_queue",
        "use_fsync",
    ]
    assert "file_name, storage_key, (bytes_data, tensor_data) = write_bucket" in inspect.getsource(
        fs.write_preloaded_data
    )
    assert "torch.save(data, transform_to)" in inspect.getsource(filesystem._write_item)
    mapping = bytearray(256)
    view = checkpoint_writer._tensor_at(mapping, 64, torch.bfloat16, (2, 3))
    assert view.shape == (2, 3) and view.untyped_storage().nbytes() == 12
    # AsyncCallsQueue: one caller from _get_async_caller per scheduled save, completion asked of the oldest
    # unfinalized save's caller, the persistent caller closed by close(); the AsyncCaller interface.
    calls = async_utils.AsyncCallsQueue
    assert "async_caller = self._get_async_caller()" in inspect.getsource(calls.schedule_async_request)
    finalize = inspect.getsource(calls.maybe_finalize_async_calls)
    assert "self.async_calls[0].async_caller.is_current_async_call_done(" in finalize
    assert "self.persistent_caller.close(abort=abort)" in inspect.getsource(calls.close)
    assert async_utils.AsyncCaller.__abstractmethods__ == {
        "schedule_async_call",
        "is_current_async_call_done",
        "close",
    }
    assert "async_fn_args[1] = self.preload_fn()" in inspect.getsource(async_utils.AsyncRequest.execute_sync)


def test_one_writer_writes_each_async_save_as_it_was_scheduled_and_ends_with_close(
    single_rank_parallel_state, tmp_path
):
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    use_in_process_results_queue()
    assert isinstance(filesystem_async._get_write_results_queue(), queue.Queue)
    me = psutil.Process()
    children = {p.pid for p in me.children(recursive=True)}
    others = {p.pid for p in me.children()}
    shm = sorted(os.listdir("/dev/shm"))

    weight = torch.arange(1000, dtype=torch.float32)
    write_checkpoint(str(tmp_path), 1, _state(weight), {})  # synchronous: threads of this process
    assert torch.equal(_load(tmp_path, 1), weight)
    assert {p.pid for p in me.children(recursive=True)} == children and not multiprocessing.active_children()

    # Async: the save of 2 is held back (files written, results not sent) while training changes the
    # weight; the save of 3 waits for it (the buffer is in use until then), then goes to the same writer.
    gate = tmp_path / "gate"
    saves = AsyncSaves()
    saves.after_write = HoldAfterWrite(" held", str(gate))
    saves.schedule_async_request(begin_checkpoint(str(tmp_path), 2, _state(weight), {}))
    (writer,) = _writers(me, others)
    weight.add_(1000.0)  # training goes on
    assert saves.maybe_finalize_async_calls(blocking=False) == []  # still writing
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "1"
    third = threading.Thread(
        target=saves.schedule_async_request, args=(begin_checkpoint(str(tmp_path), 3, _state(weight), {}),)
    )
    third.start()
    third.join(1.0)
    assert third.is_alive(), "the save of 3 did not wait for the save of 2"
    gate.touch()
    third.join()
    weight.add_(1000.0)
    assert saves.maybe_finalize_async_calls(blocking=True) == [0, 1]
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "3"
    assert torch.equal(_load(tmp_path, 2), torch.arange(1000, dtype=torch.float32))
    assert torch.equal(_load(tmp_path, 3), torch.arange(1000, dtype=torch.float32) + 1000)
    assert [p.pid for p in _writers(me, others)] == [writer.pid] and _snapshot_fds()
    assert filesystem_async._results_queue.empty()

    saves.close()
    assert not writer.is_running()  # reaped
    assert {p.pid for p in me.children(recursive=True)} == children and not multiprocessing.active_children()
    assert not _snapshot_fds() and sorted(os.listdir("/dev/shm")) == shm


def _writers(me: psutil.Process, others: set[int]) -> list[psutil.Process]:
    """This process's children but `others`: the preloaded interpreters earlier tests left running
    (tests/preloaded_python.py, stopped when pytest exits)."""
    return [p for p in me.children() if p.pid not in others]


def test_a_writer_that_dies_is_a_failed_save_and_one_that_cannot_start_writes_at_once(
    single_rank_parallel_state, tmp_path, monkeypatch, capfd
):
    weight = torch.arange(1000, dtype=torch.float32)
    me = psutil.Process()
    others = {p.pid for p in me.children()}
    saves = AsyncSaves()
    saves.after_write = HoldAfterWrite(" held until killed")
    saves.schedule_async_request(begin_checkpoint(str(tmp_path), 1, _state(weight), {}))
    (writer,) = _writers(me, others)
    writer.kill()
    died = r"cannot save iteration 1 .*writer process \d+ ended with signal 9"
    with pytest.raises(DiffmegError, match=died):
        saves.maybe_finalize_async_calls(blocking=True)
    assert not (tmp_path / "iter_0000001").exists()
    saves.schedule_async_request(begin_checkpoint(str(tmp_path), 2, _state(weight), {}))  # a new writer
    (second,) = _writers(me, others)
    assert second.pid != writer.pid
    assert saves.maybe_finalize_async_calls(blocking=True) == [1]
    assert torch.equal(_load(tmp_path, 2), weight)
    saves.close()

    def no_memory(*args):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(os, "memfd_create", no_memory)
    saves = AsyncSaves()
    saves.schedule_async_request(begin_checkpoint(str(tmp_path), 3, _state(weight), {}))
    assert saves.maybe_finalize_async_calls(blocking=False) == [0]  # written already
    assert torch.equal(_load(tmp_path, 3), weight) and not _writers(me, others)
    assert "cannot start the checkpoint writer (Cannot allocate memory): writing synchronously" in (
        capfd.readouterr().out
    )
    saves.close()
