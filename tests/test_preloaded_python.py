"""tests/preloaded_python.py: a start of the preloaded interpreter behaves as a real start of the program
(output, exit status, signals, environment, streams), and what it cannot serve faithfully is refused."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.preloaded_python import preloaded_python

PROGRAM = """
import os, sys, warnings
print("imported", flush=True)
warnings.warn("said as it is imported")
os.environ["SET_BY_IMPORT"] = "yes"


def main(argv):
    print("main", argv, os.getcwd(), os.environ.get("SET_BY_IMPORT"), os.environ.get("ASKED"))
    if argv[:1] == ["fail"]:
        raise ValueError("boom")
    if argv[:1] == ["wait"]:
        import time
        try:
            print("waiting", flush=True)
            time.sleep(60)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
            return 130
    if argv[:1] == ["read"]:
        print(sys.stdin.read().upper())
    return len(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(the preloaded interpreter of a small program, the program, the environment of its starts)."""
    folder = tmp_path_factory.mktemp("preloaded")
    program = folder / "program.py"
    program.write_text(PROGRAM)
    env = {k: v for k, v in os.environ.items() if k != "SET_BY_IMPORT"}
    with preloaded_python(folder / "server", str(program), env=env) as python:
        yield str(python), str(program), env


def start(served, *argv, python: str | None = None, **kwargs) -> subprocess.CompletedProcess:
    interpreter, program, env = served
    kwargs.setdefault("env", env)
    return subprocess.run([python or interpreter, program, *argv], capture_output=True, text=True, **kwargs)


def test_a_start_prints_and_exits_as_a_real_one(served, tmp_path):
    got = start(served, "a", "b", cwd=tmp_path, env=dict(served[2], ASKED="1"))
    real = start(served, "a", "b", cwd=tmp_path, env=dict(served[2], ASKED="1"), python=sys.executable)
    assert got.returncode == real.returncode == 2
    assert got.stdout == real.stdout == f"imported\nmain ['a', 'b'] {tmp_path} yes 1\n"
    assert got.stderr == real.stderr and "said as it is imported" in got.stderr
    failed = start(served, "fail")
    assert failed.returncode == 1 and failed.stderr.rstrip().endswith("ValueError: boom")
    assert start(served, "read", input="hello").stdout.endswith("\nHELLO\n")


def test_signals_reach_the_run(served):
    interpreter, program, env = served
    proc = subprocess.Popen([interpreter, program, "wait"], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline() == "imported\n"
    assert proc.stdout.readline().startswith("main")
    assert proc.stdout.readline() == "waiting\n"
    proc.send_signal(signal.SIGINT)
    assert proc.stdout.read() == "interrupted\n" and proc.wait(timeout=60) == 130
    proc = subprocess.Popen([interpreter, program, "wait"], stdout=subprocess.PIPE, text=True, env=env)
    while "waiting" not in proc.stdout.readline():
        time.sleep(0.01)
    proc.terminate()
    assert proc.wait(timeout=60) == -signal.SIGTERM  # killed by the signal, as a real process would be


def test_what_it_cannot_serve_faithfully_is_refused(served):
    other = start(served, env=dict(served[2], OMP_NUM_THREADS="7"))
    assert other.returncode == 1 and other.stdout == ""
    assert other.stderr == (
        "preloaded python: OMP_NUM_THREADS differ(s) from the server's environment:"
        " use the real interpreter\n"
    )
    option = subprocess.run([served[0], "-u", served[1]], capture_output=True, text=True, env=served[2])
    assert option.returncode == 1 and f"serves {served[1]} only, not ['-u', " in option.stderr
