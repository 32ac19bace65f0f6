"""A train phase that continues an earlier one (`--continue FILE`): what it skips, and how rows merge.

The plan (benchmarks/campaign/train_plan.py) outgrows one device command, so a second command with
`--continue FILE` times only the comparisons FILE lacks or holds with an error: a comparison is the unit,
since its gain needs both twins' windows from one process pair. A comparison is known by its name, which
holds the models, the labels and the length; `--continue` takes only a file of the same clean revision on
the same GPU (merge.py), so the name stands for the same flags and layer count. In the merged file the
earlier rows are kept (named by the file that measured them) and a row measured again replaces its
earlier one.
"""

from __future__ import annotations

from collections.abc import Callable

FROM = "from"
"""Row field: the results file whose command measured the row (absent: the file's own command)."""


def measured_comparisons(levers: list[dict]) -> set[str]:
    """Names of the earlier file's comparisons measured without error (interleaved windows and a gain)."""
    return {
        row["lever"]
        for row in levers
        if row.get("gain") is not None and not row.get("error") and "off_windows" in row
    }


def run_key(row: dict) -> tuple | None:
    """What makes two train rows the same run: model, length, pretrain_diff.py flags, layers, micro-batches,
    TorchDynamo on or off; None for a row that names no flags (a file written before rows carried them)."""
    if not isinstance(row.get("flags"), list):
        return None
    return (
        row["model"],
        row["seq"],
        tuple(row["flags"]),
        row.get("layers"),
        row.get("microbatches"),
        bool(row.get("torch_compile")),
    )


def _train_identity(row: dict) -> tuple:
    """The run; by its labels only where the row names no flags."""
    key = run_key(row)
    if key is not None:
        return ("run", *key)
    return ("labels", row["model"], row["impl"], row["seq"], row.get("variant"), row.get("layers"))


def _lever_identity(row: dict) -> tuple:
    return (row["lever"], row["model"], row["seq"])


IDENTITY: dict[str, Callable[[dict], tuple]] = {"train": _train_identity, "levers": _lever_identity}
"""The row tables a continued train phase adds to instead of replacing, and what makes two rows one."""


def combined(table: str, earlier: list[dict], current: list[dict], earlier_name: str) -> list[dict]:
    """The earlier file's rows (marked with the file that measured them) and this command's after them; a
    row of this command replaces the earlier row of the same identity (a comparison or a variant measured
    again)."""
    identity = IDENTITY[table]
    new = {identity(row) for row in current}
    kept = [{**row, FROM: row.get(FROM) or earlier_name} for row in earlier if identity(row) not in new]
    return kept + current
