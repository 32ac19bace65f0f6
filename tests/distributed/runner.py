"""Launch pretrain_diff.py as a real job (plain process or torchrun) and read back its metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT, free_port

TINY = [
    "--model",
    "diff-tiny",
    "--mock-data",
    "--vocab-size",
    "512",
    "--seq-length",
    "64",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "8",
    "--lr-warmup-iters",
    "2",
    "--log-interval",
    "1",
    "--eval-iters",
    "0",
]


def job_env(tmp: Path | None, nproc: int) -> dict[str, str]:
    """The environment of a launched job: this checkout importable, no inherited rank variables."""
    env = dict(
        os.environ,
        TORCHDYNAMO_DISABLE="1",
        PYTHONUNBUFFERED="1",
        OMP_NUM_THREADS="1" if nproc > 1 else os.environ.get("OMP_NUM_THREADS", "2"),
    )
    if tmp is not None:
        env["TMPDIR"] = str(tmp)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.pop("WORLD_SIZE", None)
    env.pop("RANK", None)
    return env


def preloaded_cmd(target: list[str], env: dict[str, str]) -> list[str]:
    """`python TARGET...` (pretrain_diff.py or another training entry point: a script or `-m module`) as a
    process of the preloaded interpreter of its program (tests/preloaded_python.py: the imports, the
    modules pretrain_diff.py imports included, done once per session) for starts in `env`."""
    from tests.preloaded_python import diffmeg_imports, interpreter

    program = target[1] if target[0] == "-m" else target[0]
    return [interpreter(program, env, also=diffmeg_imports(REPO_ROOT / "pretrain_diff.py")), *target]


def launch_cmd(nproc: int, target: list[str]) -> list[str]:
    """`python TARGET...` for one process, else torchrun with `nproc` processes on a free port."""
    if nproc == 1:
        return [sys.executable, *target]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        f"--master_port={free_port()}",
        *target,
    ]


def run_training(
    tmp: Path,
    name: str,
    extra: list[str],
    nproc: int = 1,
    check: bool = True,
    timeout: int = 600,
    target: list[str] | None = None,
) -> subprocess.CompletedProcess:
    """Run one job; metrics land in tmp/name.jsonl, its checkpoint (with --save) in tmp/name. One process
    (nproc 1) starts the preloaded interpreter (`preloaded_cmd`), a torchrun job the real one.

    `target` replaces pretrain_diff.py (e.g. ["-m", "tests.some_module"] with its own entry point)."""
    target = target or [str(REPO_ROOT / "pretrain_diff.py")]
    argv = [*TINY, "--metrics-file", str(tmp / f"{name}.jsonl"), *extra]
    env = job_env(tmp, nproc)
    cmd = launch_cmd(nproc, [*target, *argv]) if nproc > 1 else preloaded_cmd([*target, *argv], env)
    proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{name} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        )
    return proc


def run_saved(
    tmp: Path, name: str, extra: list[str], nproc: int = 1, target: list[str] | None = None
) -> subprocess.CompletedProcess:
    """`run_training` with its checkpoint saved to tmp/name (what `assert_same_run` compares)."""
    return run_training(tmp, name, [*extra, "--save", str(tmp / name)], nproc=nproc, target=target)


def single_rank_runs(folder: str, **runs: list[str]):
    """A module-scoped fixture `single_rank`: a fresh folder holding the single-rank reference run NAME
    (saved) of each NAME=extra flags in `runs`, for a module's parallel layouts to be compared with."""

    @pytest.fixture(scope="module")
    def single_rank(tmp_path_factory) -> Path:
        tmp = tmp_path_factory.mktemp(folder)
        for name, extra in runs.items():
            run_saved(tmp, name, extra)
        return tmp

    return single_rank


def run_pretrain(argv: list[str], cwd: Path, timeout: int = 300, **env: str) -> subprocess.CompletedProcess:
    """`python pretrain_diff.py ARGV` as one plain process in `cwd` (the preloaded interpreter), output
    captured, never raising on failure: no WORLD_SIZE (a dry run plans for one GPU) unless `env` gives it,
    or other variables."""
    environ = dict(os.environ, TORCHDYNAMO_DISABLE="1")
    environ.pop("WORLD_SIZE", None)
    environ.update(env)
    cmd = preloaded_cmd([str(REPO_ROOT / "pretrain_diff.py"), *argv], environ)
    return subprocess.run(cmd, cwd=cwd, env=environ, capture_output=True, text=True, timeout=timeout)


def read_metric(tmp: Path, name: str, key: str) -> dict[int, float]:
    lines = (tmp / f"{name}.jsonl").read_text().splitlines()
    return {r["iteration"]: r[key] for r in map(json.loads, lines) if key in r}


def read_losses(tmp: Path, name: str) -> dict[int, float]:
    return read_metric(tmp, name, "lm_loss")


def load_weights(root, iteration: int | None = None) -> dict:
    """A checkpoint's model weights (its latest, or `iteration`), loaded into a single-rank model
    (checkpoints are layout-free)."""
    import torch

    from diffmeg.checkpoints import load_model_weights

    model, _ = load_model_weights(str(root), iteration)
    return {k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


def assert_same_run(
    tmp: Path,
    ref: str,
    got: str,
    iterations: int,
    weights: bool = True,
    expect: tuple[str, ...] = ("lambda", "head_norm"),
    logged: list[int] | None = None,
) -> None:
    """Losses and grad norms equal to 1e-5 relative at every iteration (or those `got` logged: `logged`);
    final weights equal (weights named after each of `expect` must be among them: the DIFF parameters a
    layout could get wrong)."""
    import pytest

    worst = {}
    for key in ("lm_loss", "grad_norm"):
        a, b = read_metric(tmp, ref, key), read_metric(tmp, got, key)
        assert sorted(b) == (logged or list(range(1, iterations + 1)))
        for it in b:
            assert b[it] == pytest.approx(a[it], rel=1e-5), (
                f"{got} {key} at iteration {it}: {b[it]} vs {a[it]}"
            )
        worst[key] = max(abs(b[it] - a[it]) / abs(a[it]) for it in b)
    if weights:
        assert_same_weights(load_weights(tmp / ref), load_weights(tmp / got), got, iterations, expect)
    # the figures, for `pytest -s` (a closing note's parity table)
    print(f"parity {got} vs {ref}: max relative difference loss {worst['lm_loss']:.2e}, "
          f"grad norm {worst['grad_norm']:.2e} over {len(b)} iterations", flush=True)


def assert_same_weights(
    w_ref: dict, w_got: dict, got: str, iterations: int, expect: tuple[str, ...] = ("lambda", "head_norm")
) -> None:
    """`load_weights` of two runs after `iterations` steps agree (see `assert_same_run`)."""
    assert w_ref.keys() == w_got.keys()
    assert all(any(name in k for k in w_ref) for name in expect), f"weights named {expect} expected"
    # Adam normalises each element's gradient, so an element whose gradient is float noise (a token row
    # seen once or never in the batch) moves by up to lr per step in an arbitrary direction. Everything
    # else must agree to 5e-5 (a missing TP reduction of lambda shows up at ~1e-3); in the vocabulary
    # matrices at most 1 element in 10^4 may drift, and never by more than 2 x lr x iterations.
    for key in w_ref:
        diff = (w_got[key] - w_ref[key]).abs()
        close = diff <= 5e-5 + 1e-4 * w_ref[key].abs()
        if "word_embeddings" in key or "output_layer" in key:
            assert (~close).sum().item() <= max(1, diff.numel() // 10_000), f"{got}: {key}: {diff.max()}"
            assert diff.max().item() <= 2 * 1e-3 * iterations, f"{got}: {key}: {diff.max()}"
        else:
            assert close.all(), f"{got}: {key}: max abs difference {diff.max().item():.3g}"
