"""One exception type for bad user input, so every entry point prints one clear line."""

from __future__ import annotations

import sys
from collections.abc import Callable
from functools import wraps
from typing import TypeVar

T = TypeVar("T")


class DiffmegError(Exception):
    """A problem with the user's input or environment; the message says what to do."""


def stderr(line: str) -> None:
    """A progress or warning line on stderr, flushed: the default `log` of the tools' long functions."""
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
            print(f"error: {exc}", file=sys.stderr, flush=True)
            sys.exit(2)
        except KeyboardInterrupt:
            if interrupted is None:
                raise
            print(f"error: interrupted; {interrupted}", file=sys.stderr, flush=True)
            sys.exit(130)

    return wrapper
