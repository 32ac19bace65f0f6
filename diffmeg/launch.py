"""`python3 -m diffmeg.launch ...`: torchrun with the same flags, quiet when a worker stopped on bad input.

torchrun treats any non-zero worker exit as a crash: it logs the exit code, then raises its
ChildFailedError, a 30-line traceback of its own code under the worker's one-line `error:`. Every
worker that stops on a `DiffmegError` leaves that line in its torchrun error file
(`diffmeg.errors.report_error`), and one of them has printed it. When every failed worker did so, or was
only stopped by torchrun because of it, this launcher adds nothing and exits with the worker's code. Any
other failure (a crash, a signal, a bug's traceback) is reported exactly as torchrun reports it.
"""

from __future__ import annotations

import logging
import signal
import sys
from collections.abc import Sequence

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.run import parse_args, run

#: What torchrun logs on a worker's failure before it raises; its failure summary repeats both, so for a
#: failure of ours (one line, already printed) they would be noise, and for any other failure the summary
#: still holds them.
_REPEATED_BY_THE_SUMMARY = ("failed (exitcode", "closing signal")


class _DropRepeats(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(part in message for part in _REPEATED_BY_THE_SUMMARY)


def _is_ours(failure: ProcessFailure) -> bool:
    return str(failure.message).startswith("error: ")


def our_failure(error: ChildFailedError) -> ProcessFailure | None:
    """The failure of a worker that stopped on a one-line `error:` of ours (its error file says so),
    when every other failed worker did too or was only stopped by torchrun's SIGTERM because of it;
    else None (a crash: torchrun's report is the right one)."""
    failures = list(error.failures.values())
    if not all(_is_ours(f) or f.exitcode == -signal.SIGTERM for f in failures):
        return None
    return next((f for f in failures if _is_ours(f)), None)


def main(argv: Sequence[str] | None = None) -> int:
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_DropRepeats())
    try:
        run(parse_args(list(argv) if argv is not None else None))
    except ChildFailedError as error:
        failure = our_failure(error)
        if failure is None:
            raise
        return failure.exitcode
    return 0


if __name__ == "__main__":
    sys.exit(main())
