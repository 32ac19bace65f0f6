"""Fake train-phase workers: scripted window timings, no model (tests of benchmarks/campaign/interleave.py,
train.py and the runner's continued train phase)."""

from __future__ import annotations

from collections.abc import Callable

from benchmarks.campaign.worker import WorkerError

TOKENS_PER_STEP = 100


class FakeWorkers:
    """`spawn` gives a FakeWorker. `tokens_per_s(spec, n)`: the n-th window's tokens/s of a worker built from
    `spec` (n = 0 is its warm-up window); `fail(spec, op, n)`: an error string to refuse that request with.
    `now` is a fake clock: a window moves it on by the seconds it reports, another request by `cost[op]`."""

    def __init__(
        self,
        tokens_per_s: Callable[[dict, int], float] = lambda spec, n: 100.0 + len(spec["flags"]),
        fail: Callable[[dict, str, int], str | None] = lambda spec, op, n: None,
        cost: dict[str, float] | None = None,
    ) -> None:
        self.tokens_per_s, self.fail = tokens_per_s, fail
        self.cost = {"build": 0.0, "profile": 0.0, **(cost or {})}
        self.now = 0.0
        self.calls: list[tuple] = []
        """(op, model, flags, steps or None) in order."""
        self.built: list[tuple] = []
        self.alive: set[int] = set()
        self.max_alive = 0
        self.spawned = 0

    def spawn(self) -> FakeWorker:
        self.spawned += 1
        return FakeWorker(self)

    def clock(self) -> float:
        return self.now


class FakeWorker:
    def __init__(self, factory: FakeWorkers) -> None:
        self.factory, self.spec, self.windows = factory, None, 0

    def request(self, op: str, timeout: float, **fields) -> dict:
        f = self.factory
        f.now += f.cost.get(op, 0.0)
        if op == "build":
            self.spec = fields["spec"]
        key = (self.spec["preset"], tuple(self.spec["flags"]))
        f.calls.append((op, *key, fields.get("steps")))
        error = f.fail(self.spec, op, self.windows)
        if error:
            raise WorkerError(error)
        if op == "build":
            f.built.append(key)
            f.alive.add(id(self))
            f.max_alive = max(f.max_alive, len(f.alive))
            return {"ok": True, "tokens_per_step": TOKENS_PER_STEP, "flops_per_token": 1e9,
                    "flops_per_token_full_square": 1.1e9, "estimated_gib": 1.0, "layers": self.spec["layers"],
                    "micro_batch_size": 1, "microbatches": 1, "backend": "sdpa"}  # fmt: skip
        if op == "window":
            tps = f.tokens_per_s(self.spec, self.windows)
            self.windows += 1
            seconds = TOKENS_PER_STEP * fields["steps"] / tps
            f.now += seconds
            return {"ok": True, "seconds": seconds, "steps": fields["steps"], "mem_gib": 2.0}
        if op == "profile":
            return {"ok": True, "profile": {"total_ms": 1.0}}
        return {"ok": True}

    def close(self) -> None:
        self.factory.alive.discard(id(self))
