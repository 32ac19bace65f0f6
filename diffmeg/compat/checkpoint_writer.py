"""megatron-core's distributed-checkpoint writes without helper processes that outlive their rank.

megatron-core 0.16.1's torch_dist save (`FileSystemWriterAsync`) starts processes on every rank, and none
of them ends with the rank:
- `filesystem_async._get_write_results_queue` starts a multiprocessing `spawn` Manager (a server process)
  for its results queue at the first save, and with it multiprocessing's resource tracker. Both inherit the
  job's stdout. A SIGKILLed rank leaves them running (the Manager is shut down only by its parent's exit
  handlers), so whatever reads the job's output to its end (`| tee`, a test) waits forever (issue 23, item 5).
- `write_preloaded_data_multiproc` forks one writer per file on every save (sync or async), and
  `TemporalAsyncCaller` forks the rank per async save: a SIGKILLed rank's writers write on.

Here:
- the results queue is a `queue.Queue` (`use_in_process_results_queue`): no Manager, no resource tracker;
- a synchronous save (`run_now`) writes its files in threads of the rank, each with megatron-core's own
  `write_preloaded_data`;
- an async save (`ForkAsyncCaller`, for megatron-core's `AsyncCallsQueue`, which keeps the cross-rank
  completion check and the finalize functions) forks one writer process, as megatron-core's default
  `TemporalAsyncCaller` does: the fork's copy-on-write memory is the snapshot of the tensors (CUDA tensors
  are copied to host first), and the writes run beside training without sharing its GIL (a thread cannot:
  `torch.save` holds the GIL while it writes, measured to stall the training thread for seconds). The
  writer is killed by the kernel when its rank dies (PR_SET_PDEATHSIG), writes its files itself (no
  further forks) and reports its results through a pipe. A writer that dies without results fails the
  save (one line at its finalize); a fork that fails (ENOMEM) writes synchronously instead.
The planning, the file layout and the finalize functions (`.metadata`, `metadata.json`) are megatron-core's.
`tests/compat/test_checkpoint_writer.py` checks the megatron-core internals this relies on, so an upgrade
that changes them fails there.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import pickle
import queue
import signal
import sys
import threading
import time
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
    """Execute a save request synchronously, like `AsyncRequest.execute_sync` (CUDA tensors copied to host
    first, as its `preload_fn` does), with the writes in threads of this process instead of forked ones.
    Called on every rank."""
    if request.async_fn is not None:
        transforms, use_msc, rank, buckets, results_queue = _writer_args(request)
        write_buckets(transforms, use_msc, rank, _to_host(buckets), results_queue)
    torch.distributed.barrier()
    for finalize in request.finalize_fns:
        finalize()


def _to_host(buckets: list[WriteBucket]) -> list[WriteBucket]:
    """The buckets with every CUDA tensor copied to host memory (the forked writer cannot read the GPU);
    host tensors stay as they are: the fork's copy-on-write pages keep their values at the fork."""
    staged = []
    for path, key, (bytes_data, tensor_data) in buckets:
        host = [(item, t if t.is_cpu else t.to("cpu", non_blocking=True)) for item, t in tensor_data]
        staged.append((path, key, (bytes_data, host)))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return staged


PR_SET_NAME, PR_SET_PDEATHSIG = 15, 1


def _exit_with_parent(parent: int) -> None:
    """Make the kernel SIGKILL this (forked) process when its parent dies (Linux: PR_SET_PDEATHSIG; else a
    thread watching the parent), and exit at once if the parent is already gone."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl")
        libc.prctl(PR_SET_NAME, b"diffmeg-ckpt", 0, 0, 0)  # how ps and top name it
    except (OSError, AttributeError):

        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(1.0)
            os._exit(1)

        threading.Thread(target=watch, daemon=True).start()
    if os.getppid() != parent:
        os._exit(1)


class _PipeResults:
    """The results queue of the forked writer: its one `put` goes, pickled, to the parent's pipe."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def put(self, results) -> None:
        try:
            data = pickle.dumps(results)
        except Exception as exc:  # an unpicklable exception from a write
            data = pickle.dumps(RuntimeError(f"checkpoint write failed: {exc!r}"))
        with os.fdopen(self.fd, "wb") as pipe:
            pipe.write(data)


def _writer_main(parent: int, read_fd: int, write_fd: int, args: tuple) -> None:
    """The forked writer: write this rank's files, send the results, exit (never returns)."""
    code = 1
    transforms, use_msc, rank, buckets, after_write = args
    try:
        os.close(read_fd)
        gc.disable()  # a collection here could free the parent's CUDA tensors (megatron-core does the same)
        _exit_with_parent(parent)
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):  # the rank decides; SIGKILL still ends it
            signal.signal(sig, signal.SIG_IGN)
        write_buckets(transforms, use_msc, rank, buckets, _PipeResults(write_fd), after_write)
        code = 0
    except BaseException as exc:  # the parent reports a writer that ended without results
        os.write(2, f"checkpoint writer {os.getpid()} of rank {rank}: {exc!r}\n".encode())
    finally:
        os._exit(code)


class ForkAsyncCaller(AsyncCaller):
    """megatron-core's `AsyncCaller` with the background write in a forked process of this rank that dies
    with it (see the module docstring). Completion is still agreed by all ranks (`sync_all_async_calls`)."""

    def __init__(self, after_write: Callable[[], None] | None = None) -> None:
        self.after_write = after_write
        self.pid: int | None = None
        self.reader: threading.Thread | None = None
        self.payload = bytearray()
        self.results_queue = None

    def schedule_async_call(self, async_req: AsyncRequest) -> None:
        if async_req.async_fn is None:
            return  # nothing to write on this rank
        transforms, use_msc, rank, buckets, self.results_queue = _writer_args(async_req)
        staged = _to_host(buckets)
        args = (transforms, use_msc, rank, staged, self.after_write)
        read_fd, write_fd = os.pipe()
        for stream in (sys.stdout, sys.stderr):  # else the child would print their buffers again
            stream.flush()
        parent = os.getpid()
        try:
            pid = os.fork()
        except OSError as exc:  # e.g. ENOMEM under strict overcommit: write now instead, said in one line
            os.close(read_fd)
            os.close(write_fd)
            print(f" cannot fork the checkpoint writer ({exc.strerror}): writing synchronously", flush=True)
            write_buckets(transforms, use_msc, rank, staged, self.results_queue, self.after_write)
            return
        if pid == 0:
            _writer_main(parent, read_fd, write_fd, args)
        os.close(write_fd)
        self.pid = pid
        self.reader = threading.Thread(target=self._read, args=(read_fd,), name="diffmeg-ckpt-results")
        self.reader.daemon = True
        self.reader.start()

    def _read(self, fd: int) -> None:
        """Drain the writer's pipe until it exits (reading as it writes: a full pipe would block it)."""
        with os.fdopen(fd, "rb") as pipe:
            while chunk := pipe.read(1 << 16):
                self.payload += chunk

    def _collect(self) -> None:
        """Reap the finished writer; hand its results (or why there are none) to megatron-core's queue."""
        _, status = os.waitpid(self.pid, 0)
        try:
            results = pickle.loads(bytes(self.payload))
        except Exception:
            how = f"signal {-os.waitstatus_to_exitcode(status)}" if os.WIFSIGNALED(status) else "no results"
            results = RuntimeError(f"the checkpoint writer process {self.pid} ended with {how}")
        self.results_queue.put(results)
        self.pid, self.reader, self.payload = None, None, bytearray()

    def is_current_async_call_done(self, blocking: bool = False, no_dist: bool = False) -> bool:
        if self.reader is not None:
            self.reader.join(None if blocking else 0)
            if not self.reader.is_alive():
                self._collect()
        alive = int(self.reader is not None)
        return not alive if no_dist else bool(self.sync_all_async_calls(alive))

    def close(self, abort: bool = False) -> None:
        if self.pid is not None and abort:
            os.kill(self.pid, signal.SIGKILL)
        if self.reader is not None:
            self.reader.join()
            self._collect()

    def __del__(self) -> None:
        pass


class AsyncSaves(AsyncCallsQueue):
    """megatron-core's `AsyncCallsQueue` (scheduling, cross-rank completion, finalize functions) with
    `ForkAsyncCaller`s. `after_write`, when set, is given to the caller of the next scheduled request."""

    def __init__(self) -> None:
        super().__init__(persistent=False)
        self.after_write: Callable[[], None] | None = None

    def _get_async_caller(self) -> AsyncCaller:
        caller, self.after_write = ForkAsyncCaller(self.after_write), None
        return caller
