"""megatron-core's distributed-checkpoint writes, run in threads of the rank instead of helper processes.

megatron-core 0.16.1's torch_dist save (`FileSystemWriterAsync`) starts processes on every rank, and none
of them ends with the rank:
- `filesystem_async._get_write_results_queue` starts a multiprocessing `spawn` Manager (a server process)
  for its results queue at the first save, and with it multiprocessing's resource tracker. Both inherit the
  job's stdout. A SIGKILLed rank leaves them running (the Manager is shut down only by its parent's exit
  handlers), so whatever reads the job's output to its end (`| tee`, a test) waits forever (issue 23, item 5).
- `write_preloaded_data_multiproc` forks one writer per file on every save (sync or async);
  `TemporalAsyncCaller` forks the whole rank per async save, `PersistentAsyncCaller` spawns a worker.

Here the same work runs in threads: the results queue is a `queue.Queue`, the files of a save are written
by megatron-core's own `write_preloaded_data` in one thread each, and `ThreadAsyncCaller` is an
`AsyncCaller` whose background write is a thread (`ThreadAsyncCallsQueue` hands it to megatron-core's
`AsyncCallsQueue`, which keeps the cross-rank completion check and the finalize functions). A thread dies
with its process, so no process a run starts outlives it. torch.distributed.checkpoint's own `async_save`
uses a thread by default too. The planning, the file layout, the finalize functions (`.metadata`,
`metadata.json`) are megatron-core's, unchanged.

An async save needs a snapshot: a forked caller gets one from copy-on-write, a thread does not, so
`ThreadAsyncCaller` copies every tensor of the save to fresh host memory before training continues (the
device-to-host copy megatron-core's preload makes on GPU; on CPU a clone). Synchronous saves write the live
tensors (nothing changes them before the write returns).

`tests/compat/test_checkpoint_writer.py` checks the megatron-core internals this relies on, so an upgrade
that changes them fails there.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from functools import partial

import torch
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.dist_checkpointing.strategies.async_utils import (
    AsyncCaller,
    AsyncCallsQueue,
    AsyncRequest,
)
from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

logger = logging.getLogger(__name__)

WriteBucket = tuple  # (file path, storage key, (bytes items, tensor items)): megatron-core's WriteBucket


def use_in_process_results_queue() -> None:
    """Make megatron-core's writer report its results through a `queue.Queue` instead of starting a
    multiprocessing Manager (a server process) for them. Idempotent; call before any save."""
    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def _writer_args(request: AsyncRequest) -> tuple[list, bool, int, list[WriteBucket], object]:
    """(transforms, use_msc, rank, write buckets, results queue) of a torch_dist save request, whose
    `async_fn` is `partial(FileSystemWriterAsync.write_preloaded_data_multiproc, transforms, use_msc)`."""
    fn = request.async_fn
    if not (isinstance(fn, partial) and fn.func is FileSystemWriterAsync.write_preloaded_data_multiproc):
        raise TypeError(f"not a torch_dist save request of megatron-core's FileSystemWriterAsync: {fn!r}")
    transforms, use_msc = fn.args
    rank, buckets, results_queue = request.async_fn_args
    return transforms, use_msc, rank, buckets, results_queue


def write_buckets(
    transforms: list,
    use_msc: bool,
    rank: int,
    buckets: list[WriteBucket],
    results_queue,
    after_write: Callable[[], None] | None = None,
) -> None:
    """`write_preloaded_data_multiproc` with threads for processes: each bucket (one file) is written by
    megatron-core's `write_preloaded_data` (fsync'ed) in a thread of its own; the per-file results, or the
    first error, go into `results_queue` as megatron-core's finalize step expects them.

    `after_write` runs once every file is written, before the results are reported (a test hook)."""
    write_one = FileSystemWriterAsync.write_preloaded_data.__wrapped__  # without its process-wide gc.disable
    local: queue.Queue = queue.Queue()
    count: queue.Queue = queue.Queue()
    threads = []
    for index, bucket in enumerate(buckets):
        count.put(index)
        kwargs = {"use_msc": True} if use_msc else {}
        threads.append(
            threading.Thread(
                target=write_one,
                args=(transforms, index, bucket, local, count, True),
                kwargs=kwargs,
                name=f"diffmeg-ckpt-write-{index}",
                daemon=True,
            )
        )
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    results: dict | Exception = {}
    while not local.empty():
        index, outcome = local.get()
        if isinstance(outcome, Exception):
            results = outcome
            break
        results[index] = outcome
    if after_write is not None:
        after_write()
    logger.debug("rank %d wrote %d checkpoint files", rank, len(buckets))
    results_queue.put(results)


def run_now(request: AsyncRequest) -> None:
    """Execute a save request synchronously, like `AsyncRequest.execute_sync`, with the writes in threads
    of this process instead of forked ones. Called on every rank."""
    if request.async_fn is not None:
        write_buckets(*_writer_args(request))
    torch.distributed.barrier()
    for finalize in request.finalize_fns:
        finalize()


def _host_snapshot(buckets: list[WriteBucket]) -> list[WriteBucket]:
    """The buckets with every tensor copied to fresh host memory (CPU tensors cloned: training goes on
    changing the originals in place while the copy is written)."""
    staged = []
    for path, key, (bytes_data, tensor_data) in buckets:
        copies = [
            (item, t.detach().clone() if t.device.type == "cpu" else t.detach().to("cpu", non_blocking=True))
            for item, t in tensor_data
        ]
        staged.append((path, key, (bytes_data, copies)))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return staged


class ThreadAsyncCaller(AsyncCaller):
    """megatron-core's `AsyncCaller` with the background write in a thread of this rank (a snapshot of the
    tensors is taken first, on the caller's thread). Completion is still agreed by all ranks
    (`sync_all_async_calls`)."""

    def __init__(self, after_write: Callable[[], None] | None = None) -> None:
        self.thread: threading.Thread | None = None
        self.after_write = after_write

    def schedule_async_call(self, async_req: AsyncRequest) -> None:
        if async_req.async_fn is None:
            return  # nothing to write on this rank
        transforms, use_msc, rank, buckets, results_queue = _writer_args(async_req)
        staged = _host_snapshot(buckets)
        self.thread = threading.Thread(
            target=write_buckets,
            args=(transforms, use_msc, rank, staged, results_queue, self.after_write),
            name="diffmeg-ckpt-writer",
            daemon=True,  # a rank that fails mid-save exits without it; the save is never finalized
        )
        self.thread.start()

    def is_current_async_call_done(self, blocking: bool = False, no_dist: bool = False) -> bool:
        if blocking and self.thread is not None:
            self.thread.join()
        alive = int(self.thread is not None and self.thread.is_alive())
        done = not alive if no_dist else bool(self.sync_all_async_calls(alive))
        if done:
            self.close()
        return done

    def close(self, abort: bool = False) -> None:
        if self.thread is not None and not abort:
            self.thread.join()
        self.thread = None

    def __del__(self) -> None:
        pass


class ThreadAsyncCallsQueue(AsyncCallsQueue):
    """megatron-core's `AsyncCallsQueue` (scheduling, cross-rank completion, finalize functions) with
    `ThreadAsyncCaller`s. `after_write`, when set, is given to the caller of the next scheduled request."""

    def __init__(self) -> None:
        super().__init__(persistent=False)
        self.after_write: Callable[[], None] | None = None

    def _get_async_caller(self) -> AsyncCaller:
        caller, self.after_write = ThreadAsyncCaller(self.after_write), None
        return caller
