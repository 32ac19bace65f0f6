"""A train phase that continues an earlier one (`--continue FILE`): which rows it may reuse, and the merge.

The lever matrix has outgrown one device command (docs/gpu.md, "The commands"), so a second command with
`--phase train --continue FILE` measures only what FILE lacks. A row is reused only for the same run: the
model, sequence length, pretrain_diff.py flags, layers, micro-batches and TorchDynamo on or off
(`run_key`); labels (impl, variant) are not identity, so the lever matrix's off twin can be the base
row of the earlier command. A row with an error (a failure, or `skipped: time budget`) is measured again.
"""

from __future__ import annotations

from collections.abc import Callable

FROM = "from"
"""Row field: the results file whose command measured the row (absent: the file's own command)."""


def run_key(row: dict) -> tuple | None:
    """What makes two train rows the same measurement; None for a row that names no flags (a `fit` row, or
    a file written before rows carried them): such a row is never reused."""
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


def reusable(rows: list[dict], name: str) -> dict[tuple, dict]:
    """The earlier file's measured runs by `run_key`: what a train phase continuing it need not time again.
    Each value holds what the lever matrix and the full-depth fit read, and where it was measured."""
    out: dict[tuple, dict] = {}
    for row in rows:
        key = run_key(row)
        if key is None or row.get("error") or not row.get("tokens_per_s"):
            continue
        out[key] = {
            "tokens_per_s": row["tokens_per_s"],
            "step_s": row.get("step_s"),
            "optimizer_s": row.get("optimizer_s"),
            "error": None,
            "profiled": bool(row.get("profiled")),
            FROM: row.get(FROM) or name,
        }
    return out


def _train_identity(row: dict) -> tuple:
    """The run (one run can stand under several labels: a budget skips each lever asking for it); by its
    labels only where the row names no flags (a `fit` row)."""
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
    row of this command replaces the earlier row of the same identity (an error measured again, a gain
    derived again from its twins)."""
    identity = IDENTITY[table]
    new = {identity(row) for row in current}
    kept = [{**row, FROM: row.get(FROM) or earlier_name} for row in earlier if identity(row) not in new]
    return kept + current
