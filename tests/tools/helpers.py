"""Running the tools as subprocesses, as users run them."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.data.helpers import REPO_ROOT


def tool_env(**extra: str) -> dict[str, str]:
    """This environment minus launcher variables, with TorchDynamo off and warnings quiet."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI", "SLURM_"))}
    env.update(TORCHDYNAMO_DISABLE="1", PYTHONWARNINGS="ignore", **extra)
    return env


def tool_cmd(tool: str, *args) -> list[str]:
    return [sys.executable, str(REPO_ROOT / "tools" / f"{tool}.py"), *map(str, args)]


def run_tool(tool: str, *args, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python tools/<tool>.py args...`` from the repository root; never raises on failure. In this
    process's `tool_env()` (no `env`) the tool is a process of its preloaded interpreter (its imports done
    once per session: tests/preloaded_python.py)."""
    cmd = tool_cmd(tool, *args)
    if env is None:
        from tests.preloaded_python import diffmeg_imports, interpreter

        env = tool_env()
        cmd[0] = interpreter(cmd[1], env, also=diffmeg_imports(cmd[1]))
    return subprocess.run(
        cmd,
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
