"""benchmarks/campaign/worker.py: the protocol, served in-process, and the parent's handle on a worker that
refuses, dies or hangs (a stub process of a few lines: no model, no megatron-core import)."""

from __future__ import annotations

import io
import json
import os
import sys
import time

import pytest

from benchmarks.campaign import worker


def test_serve_answers_each_request_in_one_line_and_keeps_going_after_a_failure(monkeypatch):
    def build(state, spec):
        if spec["preset"] == "bad":
            raise RuntimeError("no such\nmodel")
        state.trainer = "built"
        return {"tokens_per_step": 64, "backend": "sdpa"}

    monkeypatch.setattr(worker, "_build", build)
    monkeypatch.setattr(worker, "_window", lambda state, msg: {"seconds": 0.5, "steps": msg["steps"]})
    requests = [
        {"op": "build", "spec": {"preset": "bad"}},
        {"op": "build", "spec": {"preset": "good"}},
        {"op": "window", "steps": 3},
        {"op": "nap"},
    ]
    reply = io.StringIO()
    worker.serve((json.dumps(r) + "\n" for r in requests), reply)
    answers = [json.loads(line) for line in reply.getvalue().splitlines()]
    assert answers == [
        {"ok": False, "error": "RuntimeError: no such model"},
        {"ok": True, "tokens_per_step": 64, "backend": "sdpa"},
        {"ok": True, "seconds": 0.5, "steps": 3},
        {"ok": False, "error": "KeyError: 'nap'"},
    ]


_STUB = """
import json, os, sys, time
fd = int(sys.argv[sys.argv.index("--reply-fd") + 1])
reply = os.fdopen(fd, "w")
mode = os.environ["STUB_MODE"]
def send(obj):
    reply.write(json.dumps(obj) + "\\n"); reply.flush()
send({"ok": True})
for line in sys.stdin:
    op = json.loads(line)["op"]
    if mode == "refuse":
        send({"ok": False, "error": "OOM"})
    elif mode == "die":
        sys.exit(3)
    elif mode == "hang":
        time.sleep(60)
    else:
        send({"ok": True, "op": op})
"""


@pytest.mark.parametrize(
    ("mode", "error"),
    [("refuse", "OOM"), ("die", "worker exited with code 3 during window"), ("hang", "no answer to window")],
)
def test_a_worker_that_refuses_dies_or_hangs_is_one_error_and_ends(tmp_path, mode, error):
    stub = tmp_path / "stub.py"
    stub.write_text(_STUB)
    w = worker.Worker({**os.environ, "STUB_MODE": mode}, program=(str(stub),))
    start = time.monotonic()
    with pytest.raises(worker.WorkerError) as exc:
        w.request("window", timeout=2.0, steps=1)
    assert str(exc.value).startswith(error)
    assert time.monotonic() - start < 10
    w.close()
    assert w.proc.poll() is not None


def test_a_worker_answers_until_it_is_ended(tmp_path):
    stub = tmp_path / "stub.py"
    stub.write_text(_STUB)
    w = worker.Worker({**os.environ, "STUB_MODE": "ok"}, program=(str(stub),))
    assert w.request("window", timeout=30.0, steps=2) == {"ok": True, "op": "window"}
    assert w.request("profile", timeout=30.0) == {"ok": True, "op": "profile"}
    w.close()
    assert w.proc.poll() is not None


def test_out_of_memory_is_one_word():
    class OutOfMemoryError(RuntimeError):
        pass

    assert worker.one_line(OutOfMemoryError("CUDA out of memory. Tried to allocate ...")) == "OOM"
    assert worker.one_line(ValueError("a\n  b")) == "ValueError: a b"
    assert sys.executable  # the stub runs on this interpreter
