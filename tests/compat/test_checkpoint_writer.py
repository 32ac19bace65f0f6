"""diffmeg.compat.checkpoint_writer: megatron-core's torch_dist saves, sync (threads) and async (a writer).

The first test pins the megatron-core 0.16.1 internals the writer relies on, so an upgrade that changes
them fails here and names what to revisit. The others: a sync save starts no process, an async one one
writer that is reaped and writes the tensors as they were when it was scheduled, what is written loads
back, a writer that dies is a failed save (one line), and a failed fork writes at once.
"""

from __future__ import annotations

import inspect
import multiprocessing
import os
import queue
import signal
import time

import psutil
import pytest
import torch

from diffmeg.checkpoints import begin_checkpoint, checkpoint_path, load_sharded, write_checkpoint
from diffmeg.compat import checkpoint_writer
from diffmeg.compat.checkpoint_writer import AsyncSaves, use_in_process_results_queue
from diffmeg.errors import DiffmegError


def _state(values: torch.Tensor) -> dict:
    from megatron.core.dist_checkpointing import ShardedTensor

    return {"w": ShardedTensor.from_rank_offsets("w", values), "note": "common"}


def _load(root, iteration: int) -> torch.Tensor:
    from megatron.core.dist_checkpointing import ShardedTensor

    template = {"w": ShardedTensor.from_rank_offsets("w", torch.empty(1000))}
    return load_sharded(template, checkpoint_path(str(root), iteration))["w"]


def test_megatron_core_internals_the_writer_relies_on():
    from megatron.core.dist_checkpointing.strategies import async_utils, filesystem_async
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    fs = FileSystemWriterAsync
    # The results queue is a module global that _get_write_results_queue creates only when it is None.
    assert "_results_queue" in vars(filesystem_async)
    assert "if _results_queue is None" in inspect.getsource(filesystem_async._get_write_results_queue)
    assert "self.results_queue.get_nowait()" in inspect.getsource(fs.retrieve_write_results)
    # The save function is (write_preloaded_data_multiproc, transforms, use_msc) + (rank, buckets, queue).
    source = inspect.getsource(fs.get_save_function_and_args)
    assert "partial(self.write_preloaded_data_multiproc, transform_list, self.use_msc)" in source
    assert "[torch.distributed.get_rank(), self.write_buckets, self.results_queue]" in source
    # One file per call of write_preloaded_data (undecorated: __wrapped__), reporting through two queues.
    params = list(inspect.signature(fs.write_preloaded_data.__wrapped__).parameters)
    assert params[:6] == [
        "transform_list",
        "local_proc_idx",
        "write_bucket",
        "results_queue",
        "count_queue",
        "use_fsync",
    ]
    # The callers of AsyncCallsQueue: chosen by _get_async_caller, with these abstract methods.
    assert callable(async_utils.AsyncCallsQueue._get_async_caller)
    assert async_utils.AsyncCaller.__abstractmethods__ == {
        "schedule_async_call",
        "is_current_async_call_done",
        "close",
    }
    assert "async_fn_args[1] = self.preload_fn()" in inspect.getsource(async_utils.AsyncRequest.execute_sync)


def test_a_sync_save_starts_no_process_an_async_one_a_writer_that_writes_a_snapshot(
    single_rank_parallel_state, tmp_path, monkeypatch
):
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    use_in_process_results_queue()
    assert isinstance(filesystem_async._get_write_results_queue(), queue.Queue)
    me = psutil.Process()
    children = {p.pid for p in me.children(recursive=True)}

    weight = torch.arange(1000, dtype=torch.float32)
    write_checkpoint(str(tmp_path), 1, _state(weight), {})  # synchronous: threads of this process
    assert torch.equal(_load(tmp_path, 1), weight)
    assert {p.pid for p in me.children(recursive=True)} == children and not multiprocessing.active_children()

    # Async: the forked writer is held until the tensor has changed in place; the old values are written.
    gate, write = tmp_path / "gate", checkpoint_writer.write_buckets

    def held(*args) -> None:
        while not gate.exists():
            time.sleep(0.01)
        write(*args)

    monkeypatch.setattr(checkpoint_writer, "write_buckets", held)
    saves = AsyncSaves()
    saves.schedule_async_request(begin_checkpoint(str(tmp_path), 2, _state(weight), {}))
    assert saves.maybe_finalize_async_calls(blocking=False) == []  # still writing
    (writer,) = me.children()
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "1"
    weight.add_(1000.0)  # training goes on
    gate.touch()
    assert saves.maybe_finalize_async_calls(blocking=True) == [0]
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert torch.equal(_load(tmp_path, 2), torch.arange(1000, dtype=torch.float32))
    assert not writer.is_running()  # reaped
    assert {p.pid for p in me.children(recursive=True)} == children and not multiprocessing.active_children()
    assert filesystem_async._results_queue.empty()


def test_a_writer_that_dies_is_a_failed_save_and_a_failed_fork_writes_at_once(
    single_rank_parallel_state, tmp_path, monkeypatch
):
    weight = torch.arange(1000, dtype=torch.float32)
    monkeypatch.setattr(checkpoint_writer, "write_buckets", lambda *a: os.kill(os.getpid(), signal.SIGKILL))
    saves = AsyncSaves()
    saves.schedule_async_request(begin_checkpoint(str(tmp_path), 1, _state(weight), {}))
    with pytest.raises(
        DiffmegError, match=r"cannot save iteration 1 .*writer process \d+ ended with signal 9"
    ):
        saves.maybe_finalize_async_calls(blocking=True)
    assert not (tmp_path / "iter_0000001").exists()
    monkeypatch.undo()

    def no_fork():
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(os, "fork", no_fork)
    saves.schedule_async_request(begin_checkpoint(str(tmp_path), 2, _state(weight), {}))
    assert saves.maybe_finalize_async_calls(blocking=False) == [1]  # written already
    assert torch.equal(_load(tmp_path, 2), weight)
