"""Shared fixtures: a single-process gloo group with megatron-core's parallel state (TP=PP=1)."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
"""What `diffmeg.training.distributed.initialize_distributed` writes into os.environ, as torchrun would."""


@pytest.fixture(autouse=True)
def launcher_variables_stay_put():
    """A test that runs the Trainer in-process leaves the launcher variables in os.environ; restore them so
    no later test inherits them. A Slurm job submitted with this process's environment takes an inherited
    MASTER_PORT over its job id's, and three recipe jobs side by side then collide on one port (seen when
    a Trainer test ran before tests/slurm)."""
    saved = {key: os.environ.get(key) for key in LAUNCHER_VARIABLES}
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="session")
def single_rank_parallel_state():
    """torch.distributed (gloo, world 1) and megatron-core model-parallel groups, for the session."""
    import torch

    from diffmeg import runtime
    from diffmeg.compat import model_parallel_manual_seed

    runtime.setup()
    from megatron.core import parallel_state

    if not torch.distributed.is_initialized():
        if parallel_state.model_parallel_is_initialized():  # stale groups of a destroyed process group
            parallel_state.destroy_model_parallel()
        torch.distributed.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", world_size=1, rank=0
        )
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
    model_parallel_manual_seed(1234)
    yield parallel_state


@pytest.fixture
def tokenizer_file() -> str:
    """The cl100k_base BPE file shipped beside the checkout (never committed into it)."""
    path = os.environ.get("DIFFMEG_TOKENIZER_FILE") or str(
        REPO_ROOT.parent / "shared" / "data" / "cl100k_base.tiktoken"
    )
    if not Path(path).is_file():
        pytest.skip(f"cl100k_base BPE file not found at {path}; set DIFFMEG_TOKENIZER_FILE")
    return path


HOLD_FOLDER = """
import sys
from diffmeg.folder_lock import FolderLock

lock = FolderLock(sys.argv[1])
print(lock.acquire(), flush=True)
sys.stdin.read()  # until the test closes stdin (or kills this process)
lock.release()
"""


@pytest.fixture
def folder_holder():
    """Start a plain process holding a folder's `diffmeg.folder_lock` until its stdin closes (returned once
    it holds it; `env` adds variables, e.g. SLURM_JOB_ID). Every one left running is killed at teardown."""
    import subprocess

    started: list[subprocess.Popen] = []

    def start(folder, **env: str) -> subprocess.Popen:
        environ = {k: v for k, v in os.environ.items() if k != "SLURM_JOB_ID"}
        environ.update(PYTHONPATH=str(REPO_ROOT), **env)
        proc = subprocess.Popen(
            [sys.executable, "-c", HOLD_FOLDER, str(folder)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=environ,
        )
        started.append(proc)
        assert proc.stdout.readline() == "None\n"
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture
def read_only_view(tmp_path):
    """`view(folder)`: `folder`'s files where this process really cannot write them, as on a cluster's
    shared read-only storage. Not root: the folder itself, made 0555 (restored after). Root, whom file modes
    do not stop: a read-only bind mount of it under tmp_path (unmounted after). Skips where neither holds
    (root without mount privileges); the tests of the same logic with a folder reported unwritable run
    everywhere."""
    import subprocess

    undo: list = []

    def mount(*args: str) -> None:
        proc = subprocess.run(["mount", *args], capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot make a read-only bind mount as root here: {proc.stderr.strip()}")

    def view(folder: Path) -> Path:
        if os.geteuid() != 0:
            folder.chmod(0o555)
            undo.append(lambda: folder.chmod(0o755))
            target = folder
        else:
            target = tmp_path / f"ro-{folder.name}"
            target.mkdir()
            mount("--bind", str(folder), str(target))
            undo.append(lambda: subprocess.run(["umount", "-l", str(target)], check=False))
            mount("-o", "remount,bind,ro", str(target))
        try:
            (target / ".probe").touch()
        except OSError:
            return target
        pytest.skip(f"{target} is still writable")

    yield view
    for step in reversed(undo):
        step()
