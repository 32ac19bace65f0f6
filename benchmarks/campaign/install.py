"""Preparing the machine: the wheels of missing packages, installed offline (the GPU machine has no
internet; docs/gpu.md says which wheels to bring)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

REQUIRED = "megatron-core"
"""The package the GPU machine lacks and the campaign cannot run without."""


def install_wheels(wheel_dir: Path, log: Callable[[str], None]) -> dict:
    """Install (no index, no dependencies resolved) each wheel whose distribution/version is missing.
    Returns {folder, found, installed, exit_code, error}; a missing or empty folder is an error, never
    "everything installed"."""
    info: dict = {"folder": str(wheel_dir), "found": [], "installed": [], "exit_code": None, "error": None}
    if not wheel_dir.is_dir():
        info["error"] = f"no folder {wheel_dir}"
    else:
        info["found"] = sorted(w.name for w in wheel_dir.glob("*.whl"))
        if not info["found"]:
            info["error"] = f"no wheels in {wheel_dir}"
    if info["error"]:
        log(
            f"wheels: {info['error']}: nothing installed (bring the wheels and carry the folder: docs/gpu.md)"
        )
        return info
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
        log(f"wheels: every wheel in {wheel_dir} is installed already ({', '.join(info['found'])})")
        return info
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
        if str(target) not in sys.path:
            sys.path.insert(0, str(target))
    info["installed"], info["exit_code"] = [w.name for w in todo], proc.returncode
    log(f"wheels: installed {', '.join(info['installed'])} (exit {proc.returncode})")
    if proc.returncode != 0:
        info["error"] = f"pip exited with {proc.returncode}"
        log(proc.stderr[-2000:])
    return info


def missing_requirement(info: dict | None) -> str | None:
    """A one-line error where megatron-core is neither installed nor among the wheels, else None."""
    importlib.invalidate_caches()
    if importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core"):
        return None
    where = f" ({info['error']})" if info and info.get("error") else ""
    return (
        f"{REQUIRED} is not installed and no wheel provided it{where}: download its wheel into .whl and "
        "pass --wheels .whl (docs/gpu.md, 'Wheels to bring')"
    )
