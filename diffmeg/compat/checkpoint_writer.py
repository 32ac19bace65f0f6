"""megatron-core's distributed-checkpoint writes without helper processes that outlive their rank.

megatron-core 0.16.1's torch_dist save (`FileSystemWriterAsync`) starts processes on every rank, and none
of them ends with the rank:
- `filesystem_async._get_write_results_queue` starts a multiprocessing `spawn` Manager (a server process)
  for its results queue at the first save, and with it multiprocessing's resource tracker. Both inherit the
  job's stdout. A SIGKILLed rank leaves them running (the Manager is shut down only by its parent's exit
  handlers), so whatever reads the job's output to its end (`| tee`, a test) waits forever (issue 23, item 5).
- `write_preloaded_data_multiproc` forks one writer per file on every save (sync or async), and
  `TemporalAsyncCaller` forks the rank per async save: a SIGKILLed rank's writers write on. Its
  `PersistentAsyncCaller` is a multiprocessing `spawn` process fed through multiprocessing queues (with
  the resource tracker), which nothing ties to its rank's life either.

Here:
- the results queue is a `queue.Queue` (`use_in_process_results_queue`): no Manager, no resource tracker;
- a synchronous save (`run_now`) writes its files in threads of the rank, each with megatron-core's own
  `write_preloaded_data`;
- an async save (`WriterCaller`, the one caller of megatron-core's `AsyncCallsQueue`, which keeps the
  cross-rank completion check and the finalize functions) goes to ONE persistent writer process per rank,
  a plain `subprocess` of a small entry (`serve`) started once: the training process is never forked (a
  fork per save made training copy every page it wrote while the fork lived, measured on CPU in
  docs/benchmarks.md, and forked a process that runs CUDA and NCCL). The snapshot is a host buffer in
  shared memory (`SnapshotBuffer`: a memfd, created once, grown when a checkpoint needs more, freed with
  the last process that maps it, so nothing is left on disk or in /dev/shm), mapped by the rank and the
  writer. A save copies this rank's tensors into it (one copy on CPU; a device-to-host copy on CUDA, into
  the buffer registered as pinned memory when CUDA allows it), writes the plan there too (megatron-core's
  write buckets with each tensor replaced by its place in the buffer) and sends the writer its place over
  a pipe; training goes on. The writer rebuilds the tensors as views of its mapping, writes the files with
  `write_preloaded_data` (no further processes) and sends the results back over a second pipe. A save
  while the previous one is being written waits for it first (the buffer is then free again).
- The writer dies with its rank: the kernel SIGKILLs it when the thread that started it ends
  (PR_SET_PDEATHSIG, set first thing, before its slow imports; so it is started from the training
  loop's thread), it exits at once if its rank died before that, and at EOF on its command pipe. It
  ignores SIGINT, SIGTERM and SIGUSR1 (its rank decides when it ends) and sees no GPU.
- A writer that dies fails its save (one line at the finalize: "... writer process N ended with signal
  9") and the next save starts a new one; a writer or a buffer that cannot be had (ENOMEM) makes the save
  write synchronously instead, said in one line.
The planning, the file layout and the finalize functions (`.metadata`, `metadata.json`) are megatron-core's.
`tests/compat/test_checkpoint_writer.py` checks the megatron-core internals this relies on, so an upgrade
that changes them fails there.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import pickle
import queue
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
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
    first, as its `preload_fn` does), with the writes in threads of this process instead of forked processes.
    Called on every rank."""
    if request.async_fn is not None:
        transforms, use_msc, rank, buckets, results_queue = _writer_args(request)
        write_buckets(transforms, use_msc, rank, _to_host(buckets), results_queue)
    torch.distributed.barrier()
    for finalize in request.finalize_fns:
        finalize()


def _to_host(buckets: list[WriteBucket]) -> list[WriteBucket]:
    """The buckets with every CUDA tensor copied to host memory (`write_preloaded_data` writes host tensors
    only); host tensors stay as they are (a synchronous write reads them before training goes on)."""
    staged = []
    for path, key, (bytes_data, tensor_data) in buckets:
        host = [(item, t if t.is_cpu else t.to("cpu", non_blocking=True)) for item, t in tensor_data]
        staged.append((path, key, (bytes_data, host)))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return staged


@dataclass
class HoldAfterWrite:
    """A test hook for the writer (picklable: it runs in the writer process): once the files are written,
    print `message` and hold the results back until `release` exists (None: until the writer is killed)."""

    message: str
    release: str | None = None

    def __call__(self) -> None:
        print(self.message, flush=True)
        while not (self.release and os.path.exists(self.release)):
            time.sleep(0.1)


# ----------------------------------------------------------------------------------------------------
# Messages between a rank and its writer: a pickle behind its length, on a pipe

_HEADER = struct.Struct("<Q")
_NOTHING = object()
"""What `_Inbox.take` returns when no whole message has arrived (and it was told not to wait)."""


def _send(fd: int, message: object) -> None:
    """Write one message to a pipe (blocking until it is all written)."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    view = memoryview(_HEADER.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view) :]


def _receive(fd: int) -> object | None:
    """Read one message from a pipe, waiting for it; None at EOF (the other end is closed)."""
    header = _read_exactly(fd, _HEADER.size)
    data = None if header is None else _read_exactly(fd, _HEADER.unpack(header)[0])
    return None if data is None else pickle.loads(data)


def _read_exactly(fd: int, size: int) -> bytes | None:
    data = bytearray()
    while len(data) < size:
        chunk = os.read(fd, size - len(data))
        if not chunk:
            return None
        data += chunk
    return bytes(data)


class _Inbox:
    """The writer's messages to its rank, read without blocking the training loop (unless asked to)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        os.set_blocking(fd, False)
        try:  # room for a big save's results, so the writer rarely waits for the next poll (Linux)
            import fcntl  # POSIX only

            fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, 1 << 20)
        except (ImportError, AttributeError, OSError):
            pass
        self.data = bytearray()
        self.eof = False

    def take(self, block: bool) -> object:
        """The next message, or `_NOTHING` if none has arrived whole and not `block`; EOFError once the
        writer closed its end (it exited) with no whole message left."""
        while True:
            if len(self.data) >= _HEADER.size:
                (size,) = _HEADER.unpack_from(self.data)
                end = _HEADER.size + size
                if len(self.data) >= end:
                    message = pickle.loads(bytes(self.data[_HEADER.size : end]))
                    del self.data[:end]
                    return message
            if self.eof:
                raise EOFError
            try:
                chunk = os.read(self.fd, 1 << 20)
            except BlockingIOError:
                if not block:
                    return _NOTHING
                poller = select.poll()  # not select.select: a rank's fds may number above 1024
                poller.register(self.fd, select.POLLIN)
                poller.poll()
                continue
            self.eof = not chunk
            self.data += chunk

    def close(self) -> None:
        os.close(self.fd)


# ----------------------------------------------------------------------------------------------------
# The snapshot: shared memory that the rank fills and its writer reads

_ALIGN = 64
"""Where each tensor starts in the buffer (a multiple of every dtype's size, so each is a view of it)."""


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)  # page tables filled once, at mapping


class SnapshotBuffer:
    """This rank's snapshot of a save: an anonymous shared-memory file (memfd) mapped here and in the
    writer, created once and grown (never shrunk) when a checkpoint needs more. Its pages are allocated when
    it grows (ENOMEM then, not SIGBUS at a copy) and stay mapped, so later saves copy without page faults.
    With CUDA it is registered as pinned memory, so device-to-host copies run at full speed."""

    def __init__(self) -> None:
        self.fd = os.memfd_create("diffmeg-ckpt-snapshot", os.MFD_CLOEXEC)
        self.capacity = 0
        self.mapping: mmap.mmap | None = None
        self.flat: torch.Tensor | None = None
        """The whole mapping as uint8; each tensor is copied into a view of it."""
        self.pinned = False

    def reserve(self, nbytes: int) -> None:
        """Make the buffer hold at least `nbytes` (raises OSError, e.g. ENOMEM, if it cannot)."""
        if nbytes <= self.capacity:
            return
        capacity = _round_up(nbytes + nbytes // 8, 1 << 21)  # a little room: checkpoints vary a little
        self._unmap()
        try:
            os.ftruncate(self.fd, capacity)
            os.posix_fallocate(self.fd, 0, capacity)
            self.mapping = mmap.mmap(self.fd, capacity, flags=_MAP_FLAGS)
        except OSError:
            os.ftruncate(self.fd, 0)
            self.capacity = 0
            raise
        self.capacity = capacity
        self.flat = torch.frombuffer(self.mapping, dtype=torch.uint8)
        self._pin()

    def fill(self, buckets: list[WriteBucket], layout: list[WriteBucket], plan: bytes, at: int) -> None:
        """Copy the buckets' tensors to their places in `layout` (see `_layout`), and the plan to `at`."""
        from_device = False
        for (_, _, (_, tensors)), (_, _, (_, places)) in zip(buckets, layout, strict=True):
            for (_, tensor), (_, (offset, dtype, shape)) in zip(tensors, places, strict=True):
                size = tensor.numel() * tensor.element_size()
                if size:
                    view = self.flat[offset : offset + size].view(dtype).view(shape)
                    view.copy_(tensor, non_blocking=not tensor.is_cpu)
                    from_device |= not tensor.is_cpu
        if from_device:
            torch.cuda.synchronize()
        self.mapping[at : at + len(plan)] = plan

    def _pin(self) -> None:
        if not torch.cuda.is_available():
            return
        try:
            cudart = torch.cuda.cudart()
            error = cudart.cudaHostRegister(self.flat.data_ptr(), self.capacity, 0)
            self.pinned = error == cudart.cudaError.success
        except (RuntimeError, AttributeError, AssertionError):
            self.pinned = False  # pageable memory: the copies are slower, not wrong

    def _unmap(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.flat.data_ptr())
        # Dropped, not closed: the mapping is unmapped with its last view (a copy's may still be alive).
        self.mapping, self.flat, self.pinned = None, None, False

    def close(self) -> None:
        self._unmap()
        os.close(self.fd)
        self.capacity = 0


def _layout(buckets: list[WriteBucket], use_msc: bool) -> tuple[list[WriteBucket], int]:
    """The buckets as the writer gets them: each tensor replaced by (offset in the buffer, dtype, shape),
    paths absolute (the writer may not share the rank's working directory forever); and the bytes their
    tensors take in the buffer. Bytes items stay as they are."""
    layout, offset = [], 0
    for path, key, (bytes_data, tensors) in buckets:
        places = []
        for item, tensor in tensors:
            places.append((item, (offset, tensor.dtype, tuple(tensor.shape))))
            offset = _round_up(offset + tensor.numel() * tensor.element_size(), _ALIGN)
        layout.append((path if use_msc else os.path.abspath(path), key, (bytes_data, places)))
    return layout, offset


def _tensor_at(mapping: mmap.mmap, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """The tensor at `offset` of the writer's mapping, as a view with a storage of its own size (torch.save
    writes a tensor's whole storage)."""
    numel = 1
    for n in shape:
        numel *= n
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(mapping, dtype=dtype, count=numel, offset=offset).view(shape)


# ----------------------------------------------------------------------------------------------------
# The writer process

PR_SET_NAME, PR_SET_PDEATHSIG = 15, 1

_ENTRY = """\
import ctypes, os, signal, sys
try:  # first of all, before the slow imports: the kernel SIGKILLs this process when its rank dies
    ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
except (OSError, AttributeError):
    pass  # serve() watches the rank instead
for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
    signal.signal(sig, signal.SIG_IGN)  # the rank decides when its writer ends
if os.getppid() != int(sys.argv[1]):
    os._exit(1)  # the rank died before the prctl
from diffmeg.compat.checkpoint_writer import serve
serve(*map(int, sys.argv[1:]))
"""
"""The writer's command line program (`python -P -c _ENTRY RANK_PID COMMAND_FD RESULT_FD BUFFER_FD`)."""


def _exit_with_parent(parent: int) -> None:
    """Make the kernel SIGKILL this process when its parent dies (Linux: PR_SET_PDEATHSIG; else a thread
    watching the parent), and exit at once if the parent is already gone."""
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


def serve(parent: int, command_fd: int, result_fd: int, buffer_fd: int) -> None:
    """The writer's loop: for each save its rank announces (buffer size, plan offset, plan length), map the
    buffer, rebuild the write buckets from the plan, write the files, send the results (or the error). Ends
    at EOF on the command pipe (the rank closed it, or died)."""
    _exit_with_parent(parent)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):  # the rank decides; SIGKILL still ends it
        signal.signal(sig, signal.SIG_IGN)
    mapping: mmap.mmap | None = None
    while (command := _receive(command_fd)) is not None:
        capacity, at, length = command
        try:
            if mapping is None or len(mapping) < capacity:
                mapping = None  # unmapped with its last view (the previous save's are gone)
                mapping = mmap.mmap(buffer_fd, capacity, flags=_MAP_FLAGS)
            transforms, use_msc, rank, layout, after_write = pickle.loads(mapping[at : at + length])
            buckets = [
                (path, key, (bytes_data, [(item, _tensor_at(mapping, *place)) for item, place in places]))
                for path, key, (bytes_data, places) in layout
            ]
            results: queue.Queue = queue.Queue()
            write_buckets(transforms, use_msc, rank, buckets, results, after_write)
            del buckets
            outcome = results.get()
        except Exception as exc:  # a plan that cannot be read: the save fails, the writer goes on
            outcome = RuntimeError(f"checkpoint writer {os.getpid()}: {exc!r}")
        try:
            try:
                _send(result_fd, outcome)
            except (pickle.PicklingError, TypeError, AttributeError):  # an unpicklable exception
                _send(result_fd, RuntimeError(f"checkpoint write failed: {outcome!r}"))
        except OSError:  # the rank is gone
            break


def _writer_env() -> dict[str, str]:
    """The rank's environment, with this checkout importable and no GPU visible."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    return env


class WriterCaller(AsyncCaller):
    """megatron-core's `AsyncCaller` for every async save of a rank, with the one persistent writer process
    (see the module docstring). At most one save is written at a time; completion is still agreed by all
    ranks (`sync_all_async_calls`) before megatron-core's queue finalizes a save."""

    def __init__(self) -> None:
        self.after_write: Callable[[], None] | None = None
        """Given to the writer with the next save (a picklable `HoldAfterWrite`: a test hook)."""
        self.proc: subprocess.Popen | None = None
        self.command_fd: int | None = None
        self.inbox: _Inbox | None = None
        self.buffer: SnapshotBuffer | None = None
        self.in_flight: queue.Queue | None = None
        """megatron-core's results queue of the save the writer is writing (None: it is idle)."""
        self.unfinished = 0
        """Saves scheduled and not yet found done on every rank (only the newest can be in flight)."""

    def start(self) -> None:
        """Start the writer if it is not running (raises OSError if it cannot be started)."""
        if self.proc is not None and self.proc.poll() is None:
            return
        self._stop_writer()  # one that died: reaped, its pipes closed
        if self.buffer is None:
            self.buffer = SnapshotBuffer()
        command_r, command_w = os.pipe()
        result_r, result_w = os.pipe()
        fds = (command_r, result_w, self.buffer.fd)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-P", "-c", _ENTRY, str(os.getpid()), *map(str, fds)],
                pass_fds=fds,
                stdin=subprocess.DEVNULL,
                env=_writer_env(),
            )
        except BaseException:
            for fd in (command_w, result_r):
                os.close(fd)
            raise
        finally:
            os.close(command_r)
            os.close(result_w)
        self.command_fd, self.inbox = command_w, _Inbox(result_r)
        logger.debug("checkpoint writer %d started", self.proc.pid)

    def schedule_async_call(self, async_req: AsyncRequest) -> None:
        after_write, self.after_write = self.after_write, None
        if async_req.async_fn is not None:  # else nothing to write on this rank
            self._schedule(async_req, after_write)
        self.unfinished += 1  # once scheduled: megatron-core's queue holds it from now on

    def _schedule(self, async_req: AsyncRequest, after_write: Callable[[], None] | None) -> None:
        """Copy the save's tensors and plan into the buffer and hand them to the writer."""
        transforms, use_msc, rank, buckets, results_queue = _writer_args(async_req)
        self._collect(block=True)  # the buffer is free once the previous save is written
        layout, end = _layout(buckets, use_msc)
        plan = pickle.dumps(
            (transforms, use_msc, rank, layout, after_write), protocol=pickle.HIGHEST_PROTOCOL
        )
        try:
            self.start()
            self.buffer.reserve(end + len(plan))
        except OSError as exc:  # e.g. ENOMEM: write now instead, said in one line
            print(
                f" cannot start the checkpoint writer ({exc.strerror or exc}): writing synchronously",
                flush=True,
            )
            write_buckets(transforms, use_msc, rank, _to_host(buckets), results_queue, after_write)
            return
        self.buffer.fill(buckets, layout, plan, end)
        self.in_flight = results_queue
        try:
            _send(self.command_fd, (self.buffer.capacity, end, len(plan)))
        except OSError:
            pass  # the writer died since `start`: `_collect` finds its end and fails this save

    def _collect(self, block: bool) -> None:
        """Hand the in-flight save's results (or why there are none) to megatron-core's results queue once
        they are here; with `block`, wait for them."""
        if self.in_flight is None:
            return
        try:
            results = self.inbox.take(block)
        except EOFError:
            results = RuntimeError(
                f"the checkpoint writer process {self.proc.pid} ended with {self._ending()}"
            )
            self._stop_writer()
        if results is not _NOTHING:
            self.in_flight.put(results)
            self.in_flight = None

    def _ending(self) -> str:
        """How the writer ended (it closed its result pipe: it is exiting, or has)."""
        try:
            code = self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        return f"signal {-code}" if code < 0 else f"exit status {code}"

    def is_current_async_call_done(self, blocking: bool = False, no_dist: bool = False) -> bool:
        if self.unfinished == 1:  # the save asked about is the newest one: it may still be written
            self._collect(block=blocking)
        alive = int(self.unfinished == 1 and self.in_flight is not None)
        done = not alive if no_dist else bool(self.sync_all_async_calls(alive))
        if done:
            self.unfinished = max(0, self.unfinished - 1)
        return done

    def close(self, abort: bool = False) -> None:
        """Stop the writer and free the buffer. A save still being written is waited for, or with `abort`
        killed (its checkpoint is then never finalized: the tracker keeps the previous one)."""
        if abort and self.in_flight is not None:
            self.proc.kill()
            self.in_flight = None  # abandoned: no results of it reach megatron-core's queue
        self._collect(block=True)
        self._stop_writer()
        if self.buffer is not None:
            self.buffer.close()
            self.buffer = None

    def _stop_writer(self) -> None:
        """EOF on the writer's command pipe (it exits between saves), then reap it."""
        if self.command_fd is not None:
            os.close(self.command_fd)
            self.command_fd = None
        if self.proc is not None:
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None
        if self.inbox is not None:
            self.inbox.close()
            self.inbox = None

    def __del__(self) -> None:
        # Unclosed (dropped without `close`): EOF makes the writer exit once it finished any save.
        if getattr(self, "command_fd", None) is not None:
            try:
                os.close(self.command_fd)
            except OSError:
                pass


class AsyncSaves(AsyncCallsQueue):
    """megatron-core's `AsyncCallsQueue` (scheduling, cross-rank completion, finalize functions) with one
    `WriterCaller` for all its saves. `after_write`, when set, goes with the next scheduled save."""

    def __init__(self) -> None:
        super().__init__(persistent=True)
        self.after_write: Callable[[], None] | None = None

    def _get_async_caller(self) -> WriterCaller:
        caller = self.caller
        caller.after_write, self.after_write = self.after_write, None
        return caller

    @property
    def caller(self) -> WriterCaller:
        if self.persistent_caller is None:
            self.persistent_caller = WriterCaller()
        return self.persistent_caller

    def close(self, abort: bool = False) -> None:
        """megatron-core's: finalize what is pending (with `abort`: nothing), then stop the writer. Results of
        abandoned saves are left behind in a results queue no later save reads."""
        abandoned = abort and bool(self.async_calls)
        super().close(abort)
        if abandoned:
            filesystem_async._results_queue = None
            use_in_process_results_queue()

    def start(self) -> None:
        """Start the writer now rather than at the first save (its imports take seconds). One that cannot
        be started is tried again, and said, at that save."""
        try:
            self.caller.start()
        except OSError as exc:
            logger.debug("checkpoint writer not started: %s", exc)
