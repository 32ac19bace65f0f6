"""One exception type for bad user input, so every entry point prints one clear line."""

from __future__ import annotations

import sys
from collections.abc import Callable
from functools import wraps
from typing import TypeVar

T = TypeVar("T")


class DiffmegError(Exception):
    """A problem with the user's input or environment; the message says what to do."""


def cli_errors(main: Callable[..., T]) -> Callable[..., T]:
    """Turn a `DiffmegError` raised by a CLI entry point into `error: <msg>` on stderr and exit 2."""

    @wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except DiffmegError as exc:
            print(f"error: {exc}", file=sys.stderr, flush=True)
            sys.exit(2)

    return wrapper
