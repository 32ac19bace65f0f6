"""The memory guard: the device's memory (GPU free, or a CPU's MemAvailable and cgroup limits), the plan
against it with the ranks that share it, and the refusal line through the Trainer (and its go-on flag)."""

from __future__ import annotations

import pytest

from diffmeg.errors import DiffmegError
from diffmeg.run_config import RunConfig
from diffmeg.training import memory_guard
from diffmeg.training.arguments import resolve_args
from diffmeg.training.memory import GIB, estimate_memory
from diffmeg.training.memory_guard import DeviceMemory, cpu_memory, memory_verdict
from tests.training.helpers import SMALL

NO_LIMIT_V1 = "9223372036854771712"  # what cgroup v1 writes for "no limit"


def _machine(tmp_path, cgroup: str, files: dict[str, int | str], available_gib: float = 20.0):
    """A fake /proc (this process's cgroup line, MemAvailable) and /sys/fs/cgroup with `files`."""
    proc, sys_cgroup = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text(cgroup + "\n")
    kib = int(available_gib * GIB / 1024)
    (proc / "meminfo").write_text(f"MemTotal: {2 * kib} kB\nMemFree: {kib} kB\nMemAvailable: {kib} kB\n")
    for name, value in files.items():
        path = sys_cgroup / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{value}\n")
    return str(proc), str(sys_cgroup)


def test_cgroup_v2_limit_with_reclaimable_cache(tmp_path):
    """memory.max 8 GiB, 3 GiB used of which 1 GiB is inactive file cache: 6 GiB left, below MemAvailable."""
    files = {
        "job/memory.max": 8 * GIB,
        "job/memory.current": 3 * GIB,
        "job/memory.stat": f"anon {2 * GIB}\ninactive_file {GIB}",
        "memory.max": "max",  # the root: no limit
        "memory.current": 5 * GIB,
    }
    assert cpu_memory(*_machine(tmp_path, "0::/job", files)) == (6 * GIB, "cgroup memory.max 8.0 GiB")


def test_cgroup_v1_the_tightest_limit_on_the_path_counts(tmp_path):
    files = {
        "memory/docker/memory.limit_in_bytes": 12 * GIB,
        "memory/docker/memory.usage_in_bytes": 2 * GIB,
        "memory/docker/abc/memory.limit_in_bytes": 4 * GIB,
        "memory/docker/abc/memory.usage_in_bytes": GIB,
        "memory/memory.limit_in_bytes": NO_LIMIT_V1,
        "memory/memory.usage_in_bytes": 9 * GIB,
    }
    machine = _machine(tmp_path, "5:cpu:/\n4:memory:/docker/abc", files)
    assert cpu_memory(*machine) == (3 * GIB, "cgroup memory.limit_in_bytes 4.0 GiB")


def test_without_a_cgroup_limit_memavailable_counts(tmp_path):
    files = {"memory/memory.limit_in_bytes": NO_LIMIT_V1, "memory/memory.usage_in_bytes": GIB}
    machine = _machine(tmp_path, "4:memory:/process_api/1", files, available_gib=3.0)
    assert cpu_memory(*machine) == (3 * GIB, "MemAvailable")


def _run(*flags: str) -> RunConfig:
    return RunConfig.from_args(resolve_args(["--model", "diff-tiny", "--mock-data", *flags], world_size=1))


def _cpu(available_gib: float, host: str = "node1") -> DeviceMemory:
    return DeviceMemory("cpu", host, int(available_gib * GIB), "MemAvailable")


def test_the_64k_case_is_refused_in_one_line_naming_plan_limit_and_fixes():
    """The user's `--seq-length 65536` on diff-tiny (CPU): 1185 GiB planned on a 23 GB machine."""
    run = _run("--seq-length", "65536")
    plan = estimate_memory(run, on_gpu=False)
    line = memory_verdict(plan, [_cpu(20.3)], run)
    assert line.startswith(f"the memory plan needs {plan.total / GIB:.1f} GiB per rank (activations ")
    assert "but this machine has 20.3 GiB (MemAvailable): the run would run out of memory" in line
    for fix in ("--recompute-granularity full", "--micro-batch-size 1", "--cross-entropy-chunk-size 2048"):
        assert fix in line
    assert "--seq-length" in line and "context-parallel" in line and "--bf16" not in line  # slow on a CPU
    assert line.endswith("; or --no-memory-guard to start anyway") and "\n" not in line


def test_the_ranks_on_one_machine_share_it():
    """Four CPU ranks of a 1.45 GiB plan need ~6.4 GiB of one machine, not 1.6 GiB each of four."""
    run = _run()
    plan = estimate_memory(run, on_gpu=False)
    assert memory_verdict(plan, [_cpu(5.0, "node1")] * 4, run) is not None
    assert memory_verdict(plan, [_cpu(5.0, f"node{i}") for i in range(4)], run) is None
    line = memory_verdict(plan, [_cpu(5.0, "node1")] * 4, run)
    assert "for the 4 ranks of this run on this machine" in line


def test_ranks_that_each_see_their_own_gpu_as_cuda0_do_not_share_it():
    """Slurm's per-task GPU binding: every rank's GPU is cuda:0; the UUIDs tell them apart."""
    run = _run("--seq-length", "4096")
    plan = estimate_memory(run, on_gpu=True)
    gpus = [DeviceMemory("cuda:0", "node1", int(plan.total), "free", f"GPU-{i}") for i in range(8)]
    assert memory_verdict(plan, gpus, run) is None
    assert "for the 2 ranks of this run on cuda:0" in memory_verdict(plan, gpus[:1] * 2, run)


def test_a_gpu_is_compared_with_its_free_memory_at_the_allocators_share_of_the_plan():
    run = _run("--seq-length", "4096")
    plan = estimate_memory(run, on_gpu=True)
    fits = DeviceMemory("cuda:0", "node1", int(0.95 * plan.total), "free of the GPU's 79.1 GiB")
    assert memory_verdict(plan, [fits], run) is None  # the allocator peaks near 0.9x the plan
    short = DeviceMemory("cuda:0", "node1", int(0.8 * plan.total), "free of the GPU's 79.1 GiB")
    assert "but cuda:0 has" in memory_verdict(plan, [short], run)


@pytest.fixture
def small_machine(monkeypatch):
    """The probe of this machine's memory faked: 1 MiB available."""
    monkeypatch.setattr(memory_guard, "cpu_memory", lambda: (2**20, "MemAvailable"))


def test_the_trainer_refuses_before_the_model_is_built(
    single_rank_parallel_state, small_machine, monkeypatch
):
    from diffmeg.training import trainer as trainer_module

    built = []
    monkeypatch.setattr(trainer_module, "build_training_objects", lambda run: built.append(run))
    run = RunConfig.from_args(resolve_args(SMALL, world_size=1))
    with pytest.raises(DiffmegError, match=r"^the memory plan needs .* but this machine has 0\.0 GiB") as err:
        trainer_module.Trainer(run, callbacks=[])
    assert "--no-memory-guard to start anyway" in str(err.value) and built == []


def test_no_memory_guard_starts_anyway(single_rank_parallel_state, small_machine):
    from diffmeg.training.builders import release_training_objects
    from diffmeg.training.trainer import Trainer

    trainer = Trainer(RunConfig.from_args(resolve_args([*SMALL, "--no-memory-guard"], world_size=1)), [])
    try:
        assert trainer.train_step().iteration == 1
    finally:
        release_training_objects(trainer.model_config, trainer.model)
