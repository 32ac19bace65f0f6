"""Preparing the machine: the wheels of missing packages, installed offline."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path


def install_wheels(wheel_dir: Path, log: Callable[[str], None]) -> list[str]:
    """Install (no index, no dependencies resolved) each wheel whose distribution/version is missing."""
    todo = []
    for wheel in sorted(wheel_dir.glob("*.whl")):
        name, version = wheel.name.split("-")[:2]
        try:
            if importlib.metadata.version(name) == version:
                continue
        except importlib.metadata.PackageNotFoundError:
            pass
        todo.append(wheel)
    if not todo:
        log(f"wheels: everything in {wheel_dir} is installed")
        return []
    cmd = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--no-compile", "-q"]
    proc = subprocess.run(cmd + [str(w) for w in todo], capture_output=True, text=True)
    if proc.returncode != 0:  # a read-only environment: a private target on the path instead
        target = Path(tempfile.gettempdir()) / "diffmeg-site"
        proc = subprocess.run(
            cmd + ["--target", str(target)] + [str(w) for w in todo], capture_output=True, text=True
        )
        os.environ["PYTHONPATH"] = os.pathsep.join(
            p for p in [str(target), os.environ.get("PYTHONPATH", "")] if p
        )
    log(f"wheels: installed {', '.join(w.name for w in todo)} (exit {proc.returncode})")
    if proc.returncode != 0:
        log(proc.stderr[-2000:])
    return [w.name for w in todo]
