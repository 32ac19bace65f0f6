"""A Python interpreter with a program's imports already done, for tests that start the program many times.

Importing torch and megatron-core costs seconds per process, and tearing them down at exit seconds more;
the suite starts pretrain_diff.py, the tools and transformers dozens of times to test what follows the
imports. `preloaded_python(folder, program)` starts one server process that runs the program's top level
(its imports and definitions; not its `if __name__ == "__main__":` block) once, and writes
`folder/python`, an executable that stands in for `python3` to run that program: each start sends its
command line, working directory, environment and standard streams to the server, which forks a child for
it (a fresh process: nothing one run does reaches the next) that runs the program's main block, and
returns the child's exit status (a death by signal as such); SIGINT, SIGTERM, SIGHUP and SIGUSR1/2 sent to
it reach the child. `interpreter(program)` is the one per program (and import-time environment) that this
pytest session shares.

What a start sees as a real one would: what the top level printed (replayed on its stdout and stderr) and
wrote into os.environ, its own environment, arguments, folder and streams (buffered as PYTHONUNBUFFERED
says), `__main__` and sys.path, an exit through threads joined, atexit handlers and flushed streams. What
differs: the top level ran once, in the server's environment, so a start must agree with it where imports
read the environment (IMPORT_TIME variables; PYTHONPATH up to duplicates) or it is refused in one line
(exit status 1), as is any command line but the program's (`python PROGRAM.py ARGS` or `python -m
PROGRAM ARGS`); the modules' teardown after the atexit handlers is skipped. /proc/PID/environ and cmdline
of a child are the server's: a test that finds processes by them, or one about the interpreter starting,
uses the real one.

Run as a program, this file is the server: `python tests/preloaded_python.py SOCKET PROGRAM [MODULE...]`.
"""

from __future__ import annotations

import array
import ast
import atexit
import contextlib
import functools
import io
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import types
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
IMPORT_TIME = (
    "PYTHON",
    "OMP_",
    "MKL_",
    "KMP_",
    "GOMP_",
    "TORCH",
    "CUDA",
    "HF_",
    "TRANSFORMERS_",
    "TOKENIZERS_",
    "MALLOC_",
    "GLIBC_TUNABLES",
    "LD_",
)
"""Prefixes of the variables modules may read as they are imported, and the C library and loader as the
process starts (`MALLOC_MMAP_THRESHOLD_`, `LD_PRELOAD`): a start must agree with the server."""
PER_START = ("PYTHONUNBUFFERED", "PYTHON")
"""Not among them: honoured per start (PYTHONUNBUFFERED), or no interpreter's (the scripts' PYTHON knob)."""

LIMITS = (
    "RLIMIT_AS",
    "RLIMIT_CORE",
    "RLIMIT_CPU",
    "RLIMIT_DATA",
    "RLIMIT_FSIZE",
    "RLIMIT_NOFILE",
    "RLIMIT_STACK",
)
"""The resource limits a start passes on to its run, as a process passes them on to its children."""

CLIENT = """#!{python} -IS
# Stands in for `python3` (tests/preloaded_python.py): runs the command line in a fork of the server at
# {socket}, with this process's working directory, environment and standard streams.
import array, json, os, signal, socket, sys

argv = sys.argv[1:]
import resource

umask = os.umask(0)
os.umask(umask)
limits = {{name: resource.getrlimit(getattr(resource, name)) for name in {limits!r}}}
ignored = [int(n) for n in signal.Signals if signal.getsignal(n) is signal.SIG_IGN and n != signal.SIGPIPE]
process = {{"umask": umask, "limits": limits, "ignored": ignored}}
payload = json.dumps({{"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ), **process}}).encode()
server = socket.socket(socket.AF_UNIX)
server.connect({socket!r})
fds = array.array("i", [0, 1, 2])
server.sendmsg([len(payload).to_bytes(8, "big") + payload], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
replies = server.makefile("r")
kind, _, value = replies.readline().strip().partition(" ")
if kind != "pid":
    sys.exit(f"preloaded python: {{value or 'the server closed the connection'}}")
child = int(value)


def forward(number, frame):
    try:
        os.kill(child, number)
    except ProcessLookupError:
        pass


for number in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
    if number not in ignored:
        signal.signal(number, forward)
kind, _, value = replies.readline().strip().partition(" ")
code = int(value) if kind == "exit" else 1
if code < 0:  # killed by a signal: so is this process, so its parent sees the same status
    if -code not in (signal.SIGKILL, signal.SIGSTOP):
        signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
sys.exit(code)
"""


class Server:
    """A running server and its client, `python`, in `folder`."""

    def __init__(
        self, folder: Path, program: str | Path, also: Sequence[str] = (), env: dict[str, str] | None = None
    ) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.sockets = tempfile.mkdtemp(prefix="diffmeg-python-")  # a socket's path is short (108 bytes)
        address = os.path.join(self.sockets, "server")
        with open(folder / "server.log", "w") as log:
            self.process = subprocess.Popen(
                [sys.executable, __file__, address, str(program), *also],
                cwd=REPO_ROOT,
                env=dict(env if env is not None else os.environ),
                stdin=subprocess.PIPE,  # closed when this process ends: the server then ends too
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                start_new_session=True,
            )
        if self.process.stdout.readline() != "ready\n":
            self.process.wait(timeout=60)
            self.stop()
            log_text = (folder / "server.log").read_text()[-3000:]
            raise RuntimeError(f"the preloaded Python did not start: {log_text}")
        self.python = folder / "python"
        self.python.write_text(CLIENT.format(python=sys.executable, socket=address, limits=LIMITS))
        self.python.chmod(0o755)

    def retire(self) -> None:
        """Stop serving (at the server's next look, a second at most); runs in flight go on to their end."""
        if not self.process.stdin.closed:
            self.process.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=10)
        shutil.rmtree(self.sockets, ignore_errors=True)

    def stop(self) -> None:
        """Retire, and kill every process the server forked."""
        self.retire()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()


@contextlib.contextmanager
def preloaded_python(
    folder: Path, program: str | Path, also: Sequence[str] = (), env: dict[str, str] | None = None
) -> Iterator[Path]:
    """Yield `folder/python`, an interpreter for `program` (a script's path, or a module's name for `-m`)
    whose top level, and the modules in `also` (those it imports as it runs), are imported once, in `env`
    (default: this process's environment; its PYTHONPATH must find them): the environment its starts must
    have where imports read it. On exit the server is stopped, with every process it forked."""
    server = Server(folder, program, also, env)
    try:
        yield server.python
    finally:
        server.stop()


LIVE_SERVERS = 4
"""At most this many servers of `interpreter` serve at once (~0.5 GB each with megatron-core); the least
recently used one retires when another starts (its runs in flight go on)."""
_SERVERS: OrderedDict[tuple, Server] = OrderedDict()
_RETIRED: list[Server] = []
_LOCK = threading.Lock()


def interpreter(program: str | Path, env: dict[str, str] | None = None, also: Sequence[str] = ()) -> str:
    """The preloaded interpreter of `program` (a script's path, e.g. pretrain_diff.py or tools/generate.py,
    or a module's name) and `also`, for starts in `env` (default: this process's environment): one server
    per program and import-time environment, started at its first use, stopped when this process exits."""
    env = dict(env if env is not None else os.environ)
    key = (str(program), tuple(also), tuple(sorted(_import_time(env).items())))
    with _LOCK:  # test helpers start runs from threads
        if key not in _SERVERS:
            while len(_SERVERS) >= LIVE_SERVERS:
                _, old = _SERVERS.popitem(last=False)
                old.retire()
                _RETIRED.append(old)
            _SERVERS[key] = Server(Path(tempfile.mkdtemp(prefix="diffmeg-preloaded-")), program, also, env)
        _SERVERS.move_to_end(key)
        return str(_SERVERS[key].python)


@functools.cache
def diffmeg_imports(script: str | Path) -> tuple[str, ...]:
    """The diffmeg modules `script` imports, in its functions too (entry points import them in main(), so
    that --help is quick): what to preload with it (`also`), read from its source once per session."""
    tree = ast.parse(Path(script).read_text())
    names = [a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names]
    names += [node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module]
    return tuple(sorted({name for name in names if name.split(".")[0] == "diffmeg"}))


@atexit.register
def _stop_servers() -> None:
    for server in [*_SERVERS.values(), *_RETIRED]:
        server.stop()
        shutil.rmtree(server.python.parent, ignore_errors=True)
    _SERVERS.clear()
    _RETIRED.clear()


# ----------------------------------------------------------------------------------------------- the server


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    """The client's request and its three stream descriptors."""
    fds = array.array("i")
    data, ancillary, _, _ = conn.recvmsg(1 << 16, socket.CMSG_SPACE(3 * fds.itemsize))
    for level, kind, raw in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(raw[: len(raw) - len(raw) % fds.itemsize])
    size = int.from_bytes(data[:8], "big")
    data = data[8:]
    while len(data) < size:
        data += conn.recv(size - len(data))
    return json.loads(data), list(fds)


def _import_time(env: dict[str, str]) -> dict[str, str]:
    """What of `env` imports may read: the IMPORT_TIME variables, PYTHONPATH as its distinct folders."""
    found = {k: v for k, v in env.items() if k.startswith(IMPORT_TIME) and k not in PER_START}
    if "PYTHONPATH" in found:
        folders = [os.path.abspath(p) for p in found["PYTHONPATH"].split(os.pathsep) if p]
        found["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(folders))
    return found


def _refusal(program: Program, request: dict, server_env: dict[str, str]) -> str | None:
    """Why this start cannot be served (None: it can)."""
    if not program.runs(request["argv"], request["cwd"]):
        what = f"-m {program.module_name}" if program.spec else program.path
        return f"serves {what} only, not {request['argv'][:2]}: use the real interpreter"
    ours, theirs = _import_time(request["env"]), _import_time(server_env)
    differ = sorted(k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k))
    if differ:
        return f"{', '.join(differ)} differ(s) from the server's environment: use the real interpreter"
    return None


def _streams() -> None:
    """sys.stdin/stdout/stderr on descriptors 0-2, buffered as a new interpreter's would be."""
    sys.stdin = open(0, closefd=False)  # noqa: SIM115
    if os.environ.get("PYTHONUNBUFFERED"):  # as -u: no buffer under the text layer
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
        sys.stderr = io.TextIOWrapper(
            io.FileIO(2, "w", closefd=False), write_through=True, errors="backslashreplace"
        )
    else:
        sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115  (line-buffered on a terminal only)
        sys.stderr = open(2, "w", buffering=1, closefd=False, errors="backslashreplace")  # noqa: SIM115


def _is_main_block(node: ast.stmt) -> bool:
    """`if __name__ == "__main__":`"""
    test = node.test if isinstance(node, ast.If) else None
    return (
        isinstance(test, ast.Compare)
        and isinstance(test.left, ast.Name)
        and test.left.id == "__name__"
        and len(test.ops) == 1
        and isinstance(test.ops[0], ast.Eq)
        and [getattr(c, "value", None) for c in test.comparators] == ["__main__"]
    )


class Program:
    """The program as `__main__`: its top level run here, its main block run by each start."""

    def __init__(self, program: str) -> None:
        import importlib.util

        self.spec = None if program.endswith(".py") else importlib.util.find_spec(program)
        self.module_name = None if self.spec is None else program
        self.path = os.path.abspath(program) if self.spec is None else self.spec.origin
        tree = ast.parse(Path(self.path).read_text(), self.path)
        futures = [n for n in tree.body if isinstance(n, ast.ImportFrom) and n.module == "__future__"]
        top = ast.Module([n for n in tree.body if not _is_main_block(n)], [])
        self.main_block = compile(
            ast.Module([*futures, *(n for n in tree.body if _is_main_block(n))], []), self.path, "exec"
        )
        self.module = types.ModuleType("__main__")
        self.module.__file__ = self.path
        self.module.__spec__ = self.spec
        if self.spec is not None:
            self.module.__package__ = self.spec.parent
            self.module.__loader__ = self.spec.loader
        with self._as_main(os.getcwd()):
            exec(compile(top, self.path, "exec"), self.module.__dict__)

    def _path0(self, cwd: str) -> str:
        """sys.path[0] of `python PROGRAM` (its folder) or `python -m PROGRAM` (the folder it runs in)."""
        return os.path.dirname(self.path) if self.spec is None else cwd

    @contextlib.contextmanager
    def _as_main(self, cwd: str) -> Iterator[None]:
        """sys.path[0] and sys.modules["__main__"] as `python PROGRAM` has them."""
        first = self._path0(cwd)
        main = sys.modules.get("__main__")
        sys.path.insert(0, first)
        sys.modules["__main__"] = self.module
        try:
            yield
        finally:
            sys.modules["__main__"] = main
            sys.path.remove(first)

    def runs(self, argv: list[str], cwd: str) -> bool:
        """Whether `python ARGV` (from `cwd`) is this program."""
        if self.spec is not None:
            return argv[:2] == ["-m", self.module_name]
        return bool(argv) and os.path.abspath(os.path.join(cwd, argv[0])) == self.path

    def run(self, argv: list[str]) -> int:
        """Run the main block as `python ARGV` would, in this (forked) process; its exit status."""
        sys.argv = [self.path if self.spec is not None else argv[0], *argv[1 + (self.spec is not None) :]]
        sys.path.insert(0, self._path0(os.getcwd()))
        sys.modules["__main__"] = self.module
        try:
            exec(self.main_block, self.module.__dict__)
        except SystemExit as stop:
            if stop.code is None or isinstance(stop.code, int):
                return stop.code or 0
            print(stop.code, file=sys.stderr)
            return 1
        except KeyboardInterrupt:  # as the interpreter ends then: the traceback, then killed by SIGINT
            sys.excepthook(*sys.exc_info())
            sys.stderr.flush()
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        except BaseException:
            sys.excepthook(*sys.exc_info())
            return 1
        return 0


def _serve_one(conn: socket.socket, program: Program, loaded: dict) -> None:
    """In a fork of the server: run one request in a fork of its own, reporting its pid, then its status."""
    request, fds = _receive(conn)
    refusal = _refusal(program, request, loaded["env"])
    if refusal:
        conn.sendall(f"refused {refusal}\n".encode())
        os._exit(0)
    pid = os.fork()
    if pid == 0:  # the run: a process like a new interpreter's after the program's top level
        conn.close()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        # What a process inherits from its parent: the file mode mask, resource limits, ignored signals.
        os.umask(request["umask"])
        for name, limit in request["limits"].items():
            if resource.getrlimit(getattr(resource, name)) != tuple(limit):
                resource.setrlimit(getattr(resource, name), tuple(limit))
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for number in request["ignored"]:
            signal.signal(number, signal.SIG_IGN)
        os.chdir(request["cwd"])
        tempfile.tempdir = None  # gettempdir() reads TMPDIR again: the start's
        os.environ.clear()
        os.environ.update(request["env"])
        for key, value in loaded["environ"].items():  # what the top level wrote into os.environ
            if request["env"].get(key) == loaded["env"].get(key):
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        for fd, data in enumerate(loaded["output"], start=1):
            os.write(fd, data)
        _streams()
        code = program.run(request["argv"])
        # The interpreter's exit as a program sees it: threads joined, atexit handlers, streams flushed. Not
        # the teardown of every module that follows (~2.5 s with torch and megatron-core loaded).
        threading._shutdown()
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code & 0xFF)
    for fd in fds:
        os.close(fd)
    conn.sendall(f"pid {pid}\n".encode())
    _, status = os.waitpid(pid, 0)
    conn.sendall(f"exit {os.waitstatus_to_exitcode(status)}\n".encode())
    os._exit(0)


def _load(program: str, also: Sequence[str]) -> tuple[Program, dict]:
    """The program's top level and `also` imported; what that printed (stdout, stderr) and wrote into
    os.environ (None: removed), and the environment it ran in."""
    import importlib

    env = dict(os.environ)
    printed = [tempfile.TemporaryFile(), tempfile.TemporaryFile()]
    saved = [os.dup(1), os.dup(2)]
    for fd, file in enumerate(printed, start=1):
        os.dup2(file.fileno(), fd)
    loaded = Program(program)
    for name in also:
        importlib.import_module(name)
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, old in enumerate(saved, start=1):
        os.dup2(old, fd)
        os.close(old)
    output = []
    for file in printed:
        file.seek(0)
        output.append(file.read())
    environ = {k: os.environ.get(k) for k in env.keys() | os.environ.keys()}
    return loaded, {
        "env": env,
        "output": output,
        "environ": {k: v for k, v in environ.items() if v != env.get(k)},
    }


def _check_forks(program: str) -> None:
    """A fork copies only the calling thread. The BLAS libraries' idle thread servers (numpy's and scipy's
    OpenBLAS start one as they load) are rebuilt in the child, but a Python thread, or OpenMP's pool once
    torch ran a parallel operation, would be dead there (the child hangs in its first parallel operation):
    refuse to serve then."""
    if threading.active_count() > 1:
        raise SystemExit(f"{program}'s imports started a thread: a fork would lose it")
    if "torch" not in sys.modules:
        return
    pid = os.fork()
    if pid == 0:
        import torch

        torch.ones(256, 256) @ torch.ones(256, 256)  # a parallel operation, as a child's first
        os._exit(0)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            if os.waitstatus_to_exitcode(status) == 0:
                return
            raise SystemExit(f"a fork of {program}'s imports failed a torch operation ({status})")
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise SystemExit(f"a fork of {program}'s imports hangs in a torch operation: they ran one in parallel")


def serve(address: str, program: str, also: Sequence[str]) -> None:
    import select

    loaded_program, loaded = _load(program, also)
    _check_forks(program)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C of the test session is not the server's
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(address)
        listener.listen(64)
        print("ready", flush=True)
        while True:
            readable, _, _ = select.select([listener, sys.stdin], [], [], 1.0)
            with contextlib.suppress(ChildProcessError):  # reap finished handlers (their CPU time
                while os.waitpid(-1, os.WNOHANG)[0]:  # then counts in the test session's)
                    pass
            if sys.stdin in readable:  # the test session ended
                return
            if listener not in readable:
                continue
            conn, _ = listener.accept()
            if os.fork() == 0:
                listener.close()
                _serve_one(conn, loaded_program, loaded)
            conn.close()


if __name__ == "__main__":
    del sys.path[0]  # this file's folder (tests/): not on the program's path
    serve(sys.argv[1], sys.argv[2], sys.argv[3:])
