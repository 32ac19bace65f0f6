"""Which of the SDPA backend's paths DIFF attention takes, per key length: a table of measured crossovers.

The paths compute the same `A1 V - lam * A2 V` (`diffmeg.kernels.sdpa`):
- `two_call`: one SDPA call per map over V of width 2d (q/k d, V 2d: cuDNN / memory-efficient kernels);
- `split_v`: four calls, each map over each d-wide half of V (equal head sizes: the flash kernels);
- `split_v_batched`: the same four products as ONE SDPA call, the (map, half) pairs stacked on the batch
  axis (one launch, 4x the batch per kernel; costs a copy of q/k and of V's halves).

On CPU the backend always takes `two_call` (no kernel there prefers equal head sizes). On CUDA a length
takes the path of the last crossover at or below it in `CUDA_CROSSOVERS`, `DEFAULT_PATH` below the first.
The next GPU run's timings fill it: `crossovers(timings)` turns {length: {path: ms}} into the table.
"""

from __future__ import annotations

from collections.abc import Mapping

from diffmeg.errors import DiffmegError

PATHS = ("two_call", "split_v", "split_v_batched")
"""The SDPA backend's paths, by name."""

DEFAULT_PATH = "two_call"
"""Where no measurement says otherwise (every length on CPU)."""

CUDA_CROSSOVERS: tuple[tuple[int, str], ...] = ((16384, "split_v"),)
"""(from this many keys up, this path), ascending. Measured on an H100 (bf16, 12 heads of d=128,
forward+backward, benchmarks/results/campaign-nvidia-h100-80gb-hbm3-20261124T071510Z.json): two-call
1.38 / 2.56 / 7.39 / 26.62 ms at 2K / 4K / 8K / 16K, split-V 1.72 / 2.97 / 7.38 / 24.06 ms; 8K is a tie
(0.1%), so two-call keeps it and split-V starts at 16K. `split_v_batched` awaits its first measurement."""


def check_path(path: str) -> None:
    """Refuse a name that is no path, naming the choices."""
    if path not in PATHS:
        raise DiffmegError(f"unknown SDPA path {path!r}; choose one of {', '.join(PATHS)}")


def path_for_length(keys: int, device_type: str, table: tuple[tuple[int, str], ...] = CUDA_CROSSOVERS) -> str:
    """The path for attention over `keys` keys on `device_type` tensors."""
    if device_type != "cuda":
        return DEFAULT_PATH
    chosen = DEFAULT_PATH
    for start, path in table:
        if keys >= start:
            chosen = path
    return chosen


def crossovers(timings: Mapping[int, Mapping[str, float]]) -> tuple[tuple[int, str], ...]:
    """The table for `CUDA_CROSSOVERS` from measured {length: {path: milliseconds}}: an entry wherever the
    fastest path changes, going up in length (below the first entry: `DEFAULT_PATH`). A path within 1% of
    the current one's time does not displace it (a tie is noise, not a crossover)."""
    table: list[tuple[int, str]] = []
    current = DEFAULT_PATH
    for length in sorted(timings):
        row = timings[length]
        for path in row:
            check_path(path)
        best = min(row, key=row.__getitem__)
        if best != current and (current not in row or row[best] < 0.99 * row[current]):
            current = best
            table.append((length, best))
    return tuple(table)
