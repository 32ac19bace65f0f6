"""One exception type for bad user input, so every entry point prints one clear line."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from functools import wraps
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


class DiffmegError(Exception):
    """A problem with the user's input or environment; the message says what to do."""


def stderr(line: str) -> None:
    """A progress or warning line on stderr, flushed: the default `log` of the tools' long functions."""
    print(line, file=sys.stderr, flush=True)


def _shared_error_folder() -> Path | None:
    """A folder every process of this launch on this node sees, or None outside a multi-process launch.

    torchrun gives each worker an error file under one folder per restart attempt (its own scratch
    space); srun's tasks share the job step. A single process has no peers to agree with.
    """
    world = os.environ.get("WORLD_SIZE") or os.environ.get("SLURM_NTASKS") or "1"  # srun sets no WORLD_SIZE
    if not world.isdigit() or int(world) <= 1:
        return None
    elastic = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if elastic:
        return Path(elastic).parent.parent  # .../attempt_N/<local rank>/error.json -> .../attempt_N
    job = os.environ.get("SLURM_JOB_ID")
    if job and "SLURM_PROCID" in os.environ:
        step = os.environ.get("SLURM_STEP_ID", "0")
        return Path(tempfile.gettempdir()) / f"diffmeg-errors-{os.getuid()}" / f"{job}.{step}"
    return None


def _first_to_report(line: str) -> bool:
    """True for the first process of a launch (on this node) to report `line`.

    Every rank of a job usually meets the same bad input and would print the same line N times; the
    first to create the line's marker prints it, the others stay silent. A line only some ranks meet is
    still printed: its marker is its own. No clock is involved: the marker is created exclusively.
    """
    folder = _shared_error_folder()
    if folder is None:
        return True
    marker = folder / f"diffmeg-{hashlib.sha1(line.encode()).hexdigest()[:16]}.reported"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except FileExistsError:
        return False
    except OSError:
        return True  # no shared folder to agree in: better twice than never
    return True


def _tell_torchrun(line: str) -> None:
    """Write `line` as this worker's error file, so torchrun's failure summary names our line as the
    root cause instead of its "To enable traceback see ..." placeholder."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or os.path.exists(path):
        return
    try:
        with open(path, "w") as fp:
            json.dump({"message": line, "timestamp": str(int(time.time()))}, fp)
    except OSError:
        pass


def report_error(line: str) -> None:
    """Print an `error: ...` line once per launch, however many ranks meet it."""
    _tell_torchrun(line)
    if _first_to_report(line):
        print(line, file=sys.stderr, flush=True)


def cli_errors(
    main: Callable[..., T] | None = None, *, interrupted: str | None = None
) -> Callable[..., T] | Callable[[Callable[..., T]], Callable[..., T]]:
    """Turn a `DiffmegError` raised by a CLI entry point into `error: <msg>` on stderr and exit 2.

    `@cli_errors(interrupted="what Ctrl-C leaves behind")` also turns KeyboardInterrupt into
    `error: interrupted; <that>` and exit 130, for tools whose user may stop a long run.
    """
    if main is None:
        return lambda fn: cli_errors(fn, interrupted=interrupted)

    @wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except DiffmegError as exc:
            report_error(f"error: {exc}")
            sys.exit(2)
        except KeyboardInterrupt:
            if interrupted is None:
                raise
            print(f"error: interrupted; {interrupted}", file=sys.stderr, flush=True)
            sys.exit(130)

    return wrapper
