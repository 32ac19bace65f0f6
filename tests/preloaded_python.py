"""A Python interpreter with a program's imports already done, for tests that start it many times.

Importing megatron-core costs seconds per process; a test that runs a script twenty times (every recipe's
`DRY_RUN=1`, each starting `$PYTHON pretrain_diff.py ... --dry-run`) pays it twenty times to test what
follows the imports. `preloaded_python(folder, modules)` starts one server process that imports
`modules` once and writes `folder/python`, an executable that stands in for `python3`: each start sends
its command line, working directory, environment and standard streams to the server, which forks a child
for it (a fresh process: nothing one run does reaches the next) and returns its exit status.

What differs from a real start: the imports ran once, under the server's environment (so a variable read at
import time, e.g. TORCHDYNAMO_DISABLE, is the server's), and the interpreter's own options (`-u`, `-O`) are
not accepted. Only a script path or `-m module` is run. A test that is about the interpreter starting (its
import-time warnings, its start-up) uses the real one.

Run as a program, this file is the server: `python -m tests.preloaded_python SOCKET MODULE...`.
"""

from __future__ import annotations

import array
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from tests.conftest import REPO_ROOT

CLIENT = """#!{python} -IS
# Stands in for `python3` (tests/preloaded_python.py): runs the command line in a fork of the server at
# {socket}, with this process's working directory, environment and standard streams.
import array, json, os, socket, sys

payload = json.dumps({{"argv": sys.argv[1:], "cwd": os.getcwd(), "env": dict(os.environ)}}).encode()
with socket.socket(socket.AF_UNIX) as server:
    server.connect({socket!r})
    fds = array.array("i", [0, 1, 2])
    server.sendmsg([len(payload).to_bytes(8, "big") + payload], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
    reply = b""
    while chunk := server.recv(64):
        reply += chunk
code = int(reply or b"1")
sys.exit(code if code >= 0 else 128 - code)  # killed by signal N: 128 + N, as a shell reports it
"""


@contextlib.contextmanager
def preloaded_python(
    folder: Path, modules: Sequence[str], env: dict[str, str] | None = None
) -> Iterator[Path]:
    """Yield `folder/python`, an interpreter whose starts share one import of `modules` (importable names;
    pretrain_diff.py's is `pretrain_diff`). The server runs with `env` (default: this process's) and this
    checkout on its path, and is stopped on exit."""
    folder.mkdir(parents=True, exist_ok=True)
    sockets = tempfile.mkdtemp(prefix="diffmeg-python-")  # a socket's path must be short (108 bytes)
    address = os.path.join(sockets, "server")
    environ = dict(env if env is not None else os.environ)
    environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), environ.get("PYTHONPATH")]))
    with open(folder / "server.log", "w") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "tests.preloaded_python", address, *modules],
            cwd=REPO_ROOT,
            env=environ,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )
    try:
        if server.stdout.readline() != "ready\n":
            server.wait(timeout=60)
            raise RuntimeError(
                f"the preloaded Python did not start: {(folder / 'server.log').read_text()[-3000:]}"
            )
        client = folder / "python"
        client.write_text(CLIENT.format(python=sys.executable, socket=address))
        client.chmod(0o755)
        yield client
    finally:
        server.kill()
        server.wait()
        shutil.rmtree(sockets, ignore_errors=True)


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


def _run(argv: list[str]) -> int:
    """`python ARGV` in this (forked) process: a script path or `-m module`, run as __main__."""
    import runpy

    try:
        if argv[:1] == ["-m"]:
            sys.argv = [argv[1], *argv[2:]]
            sys.path.insert(0, os.getcwd())
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        elif argv and not argv[0].startswith("-"):
            sys.argv = list(argv)
            sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
            runpy.run_path(argv[0], run_name="__main__")
        else:
            print(f"preloaded python: runs a script or -m module, not {argv[:1]}", file=sys.stderr)
            return 2
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            return stop.code or 0
        print(stop.code, file=sys.stderr)
        return 1
    except BaseException:
        import traceback

        traceback.print_exc()
        return 1
    return 0


def _serve_one(conn: socket.socket) -> None:
    """In a fork of the server: run one request in a fork of its own, then send its exit status."""
    import atexit
    import signal

    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    request, fds = _receive(conn)
    pid = os.fork()
    if pid == 0:
        conn.close()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.stdin = open(0, closefd=False)
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        code = _run(request["argv"])
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code & 0xFF)
    for fd in fds:
        os.close(fd)
    _, status = os.waitpid(pid, 0)
    conn.sendall(str(os.waitstatus_to_exitcode(status)).encode())
    conn.close()
    os._exit(0)


def serve(address: str, modules: Sequence[str]) -> None:
    import importlib
    import signal

    for name in modules:
        importlib.import_module(name)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the request handlers are reaped as they end
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(address)
        listener.listen(64)
        print("ready", flush=True)
        while True:
            conn, _ = listener.accept()
            if os.fork() == 0:
                listener.close()
                _serve_one(conn)
            conn.close()


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2:])
