"""The command's results file: the phases' rows and figures merged in, written whole each time.

`campaign-<device>-<time>.json` in the command's --out folder, written by a temporary file renamed over it
after every phase and whenever a phase's child saved rows (benchmarks/campaign/runner.py): a command
stopped at any moment, even killed at the device tool's limit, leaves a whole file holding what it
measured. With --continue it is the earlier file merged with this command's (merge.py).
"""

from __future__ import annotations

import copy
import json
import os
import re
from pathlib import Path

from benchmarks.campaign.figures import headlines
from benchmarks.campaign.merge import ContinueError, merged
from benchmarks.campaign.part import clean


def with_part(result: dict, phase: str, part: dict, info: dict) -> dict:
    """`result` with a phase's rows and figures (what its child saved) and its status."""
    out = copy.deepcopy(result)
    for key, value in part.items():
        if key in out:
            out[key] = value
    out["phases"][phase] = info
    out.update(headlines(out))  # from the rows kept, finished or not
    return out


class ResultsFile:
    """The command's results file, `campaign-<device>-<time>.json` in `out`: merged with the continued
    file where there is one, written atomically each time."""

    def __init__(self, out: Path, stamp: str, earlier: dict | None, earlier_name: str | None, ran: list[str]):
        """`earlier`: the --continue file's results (named `earlier_name`); `ran`: this command's phases."""
        self.out, self.stamp, self.ran = out, stamp, ran
        self.earlier, self.earlier_name = earlier, earlier_name
        self.path: Path | None = None
        self.merge_error: str | None = None

    def write(self, result: dict) -> dict:
        """Write `result` (merged, cleaned) whole; returns what was written."""
        if not result["device"]:  # before the env phase named the device: nothing to name the file by
            return result
        final = result
        if self.earlier is not None:
            try:
                final = merged(self.earlier, self.earlier_name, result, self.ran)
                final.update(headlines(final))
                self.merge_error = None
            except ContinueError as exc:
                self.merge_error = str(exc)
        final = clean(final)
        if self.path is None:
            self.path = self.out / f"campaign-{slug(final['device'] or 'unknown')}-{self.stamp}.json"
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(final, indent=1, allow_nan=False) + "\n")
        os.replace(tmp, self.path)
        return final


def slug(text: str) -> str:
    """File-name-safe lower-case form of a device name (letters, digits, '-')."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"
