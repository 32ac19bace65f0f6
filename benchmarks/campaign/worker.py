"""The train phase's worker protocol: one process per model variant, stepping it when the parent asks.

Several levers act on process-global state (torch's SDPA kernel priority, megatron-core's CUDA-graph
manager, torchao's conversion, TorchDynamo's configuration, the RNG tracker), so two variants compared in
one process would leak into each other. Each variant therefore lives in a worker of its own,
`python3 -m benchmarks.campaign.worker`, which builds pretrain_diff.py's Trainer once
(benchmarks/train_step.py) and then times windows of k optimizer steps on request; the parent
(benchmarks/campaign/interleave.py) alternates the windows of two live workers.

The protocol: JSON lines, requests on the worker's stdin, one reply each on a pipe of its own (`--reply-fd`;
the worker's stdout and stderr stay the phase's log). A worker first imports what it needs and says
`{"ok": true}`: started ahead, it does that while the parent times others. Requests: `build` (the spec:
preset, length, flags, sizes, device; replies with the run's facts: tokens a step, FLOPs a token, the
memory plan, the attention backend, seconds spent), `window` (k steps, the device synchronised before each
clock reading; replies with seconds and the peak memory so far), `profile` (one more step under
torch.profiler). A failed request replies `{"ok": false, "error": ...}` in one line; a worker that dies or
hangs is ended (`WorkerError`), and its variant is reported as failed. A worker no comparison needs is
ended with its whole process tree (`Worker.close`): the process's end frees its GPU memory at once, where
a polite exit would spend seconds tearing down torch and megatron-core.
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import subprocess
import sys
import time
import traceback

from benchmarks.campaign.procs import REPO, end


class WorkerError(Exception):
    """A worker refused a request, died or did not answer in time; the message says which, in one line."""


class Worker:
    """The parent's handle on one worker process."""

    def __init__(
        self, env: dict[str, str], program: tuple[str, ...] = ("-m", "benchmarks.campaign.worker")
    ) -> None:
        """Start the worker (`program`: python3's arguments before `--reply-fd`; tests give a stub)."""
        read_fd, write_fd = os.pipe()
        cmd = [sys.executable, *program, "--reply-fd", str(write_fd)]
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdin=subprocess.PIPE, text=True, pass_fds=(write_fd,),
            start_new_session=True,
        )  # fmt: skip
        os.close(write_fd)
        self.replies = os.fdopen(read_fd, "r")
        self.ready = False

    def request(self, op: str, timeout: float, **fields) -> dict:
        """Send one request; wait up to `timeout` seconds for its reply (the start-up reply first, once)."""
        end_at = time.monotonic() + timeout
        if not self.ready:
            self._reply(end_at, "start")
            self.ready = True
        try:
            self.proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            self.close()
            raise WorkerError(f"worker exited with code {self.proc.returncode} before {op}") from None
        reply = self._reply(end_at, op)
        if not reply.get("ok"):
            raise WorkerError(reply.get("error") or f"{op} failed")
        return reply

    def _reply(self, end_at: float, op: str) -> dict:
        with selectors.DefaultSelector() as sel:
            sel.register(self.replies, selectors.EVENT_READ)
            if not sel.select(timeout=max(0.0, end_at - time.monotonic())):
                self.close()
                raise WorkerError(f"no answer to {op} in time: worker ended")
        line = self.replies.readline()
        if not line:  # its end of the pipe closed: it exited (or is exiting)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            self.close()
            raise WorkerError(f"worker exited with code {self.proc.returncode} during {op} (its log above)")
        return json.loads(line)

    def close(self) -> None:
        """End the process and everything it started (its GPU memory is free once this returns)."""
        end(self.proc)
        for stream in (self.proc.stdin, self.replies):
            try:
                stream.close()
            except OSError:
                pass


# --- the worker process ---------------------------------------------------------------------------


STEPS_AT_MOST = 1000
"""More optimizer steps than any worker takes (a warm-up window, then 6 steps a comparison it is in)."""


class _State:
    trainer = None
    device = "cpu"


def _build(state: _State, spec: dict) -> dict:
    import torch

    from benchmarks import train_step

    state.device = spec["device"]
    train_step.init_process()
    opts = train_step.StepOptions(
        tokens_per_microbatch=spec["tokens_per_microbatch"],
        microbatches=spec["microbatches"],
        iters=STEPS_AT_MOST,  # the run's --train-iters, its schedule and mock data: never outrun
        vocab_size=spec["vocab_size"],
        num_layers=spec["layers"],
        extra_args=list(spec["flags"]),
    )
    args, facts = train_step.run_facts(spec["preset"], spec["seq"], opts, state.device)
    state.trainer = train_step.build_trainer(args)
    if state.device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    backend = train_step.attention_impl(state.trainer.model[0])
    return {**facts, "layers": args.num_layers, "micro_batch_size": args.micro_batch_size,
            "microbatches": spec["microbatches"], "backend": backend}  # fmt: skip


def _sync(state: _State) -> None:
    if state.device == "cuda":
        import torch

        torch.cuda.synchronize()


def _window(state: _State, msg: dict) -> dict:
    _sync(state)
    start = time.perf_counter()
    for _ in range(msg["steps"]):
        state.trainer.train_step()
    _sync(state)
    seconds = time.perf_counter() - start
    mem = None
    if state.device == "cuda":
        import torch

        mem = torch.cuda.max_memory_allocated() / 2**30
    return {"seconds": seconds, "steps": msg["steps"], "mem_gib": mem}


def _profile(state: _State) -> dict:
    from benchmarks import step_profile

    return {"profile": step_profile.profile_step(state.trainer.train_step, state.device)}


def serve(requests, reply) -> None:
    """Answer each request line of `requests` on `reply` until the end of the input."""
    state = _State()
    ops = {
        "build": lambda msg: _build(state, msg["spec"]),
        "window": lambda msg: _window(state, msg),
        "profile": lambda msg: _profile(state),
    }
    for line in requests:
        msg = json.loads(line)
        try:
            out = {"ok": True, **ops[msg["op"]](msg)}
        except Exception as exc:  # noqa: BLE001 - every failure is an answer
            traceback.print_exc()
            out = {"ok": False, "error": one_line(exc)}
        reply.write(json.dumps(out, default=str) + "\n")
        reply.flush()


def one_line(exc: BaseException) -> str:
    """An exception as the one line a row keeps: "OOM" for CUDA's out-of-memory, else type and message."""
    if type(exc).__name__ == "OutOfMemoryError":
        return "OOM"
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}"[:300]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python3 -m benchmarks.campaign.worker", description=__doc__.splitlines()[0]
    )
    p.add_argument("--reply-fd", type=int, required=True, help="the pipe the replies go to")
    a = p.parse_args(argv)
    reply = os.fdopen(a.reply_fd, "w")
    # the imports a build needs, done before the first request: a worker started ahead does them while the
    # parent times others (diffmeg.runtime.setup first: on a CPU it must precede megatron-core's import)
    from diffmeg import runtime

    runtime.setup()
    from benchmarks import train_step  # noqa: F401
    from diffmeg.training import trainer  # noqa: F401

    reply.write(json.dumps({"ok": True, "pid": os.getpid()}) + "\n")
    reply.flush()
    serve(sys.stdin, reply)
    return 0


if __name__ == "__main__":
    sys.exit(main())
