"""A phase's results: one JSON file, rewritten after every row so a killed phase loses nothing kept."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path


class Part:
    """A phase's results, written to disk after every row so a killed child loses nothing kept."""

    def __init__(self, path: Path | None) -> None:
        """`path` None: kept in memory only (a rehearsal of the phase, `--plan`)."""
        self.path, self.data = path, {"_status": "ok", "_error": None}

    def set(self, **kw) -> None:
        self.data.update(kw)
        self.save()

    def add(self, table: str, row: dict) -> None:
        self.data.setdefault(table, []).append(row)
        self.save()

    def save(self) -> None:
        if self.path is None:
            return
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, default=json_default))
        os.replace(tmp, self.path)


def json_default(o):
    if isinstance(o, float) and not math.isfinite(o):
        return None
    return str(o)


def clean(value):
    """NaN/inf to None (JSON has neither), recursively."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [clean(v) for v in value]
    return value
