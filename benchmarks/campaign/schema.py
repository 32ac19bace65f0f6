"""The results file of one campaign run (`python3 -m benchmarks.campaign`), as report.py reads it.

Top-level figures are null where the run did not measure them (a phase not selected, skipped, or failed);
row lists are empty then. Every file names its machine, date and git revision, and `device_type` says
whether its numbers come from a GPU: report.py renders GPU tables from "cuda" files only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SCHEMA = "diffmeg-campaign/1"
PHASES = ("env", "tests", "kernels", "train", "memory")
PHASE_STATUSES = ("ok", "partial", "failed", "timeout", "not run")

_NUM = (int, float)
_OPT_NUM = (int, float, type(None))
_OPT_STR = (str, type(None))
_OPT_BOOL = (bool, type(None))

# Row fields every row must carry (more are allowed), with the types they may hold.
ROW_FIELDS: dict[str, dict[str, tuple]] = {
    "attention": {
        "impl": (str,),
        "seq": (int,),
        "batch": (int,),
        "head_dim": (int,),
        "fwd_ms": _OPT_NUM,
        "bwd_ms": _OPT_NUM,
        "tflops": _OPT_NUM,
        "error": _OPT_STR,
    },
    "train": {
        "model": (str,),
        "impl": (str,),
        "seq": (int,),
        "tokens_per_s": _OPT_NUM,
        "mfu": _OPT_NUM,
        "error": _OPT_STR,
    },
    "memory": {"layout": (str,), "estimated_gib": _OPT_NUM, "measured_gib": _OPT_NUM, "error": _OPT_STR},
    "levers": {
        "lever": (str,),
        "model": (str,),
        "seq": (int,),
        "off_tokens_per_s": _OPT_NUM,
        "on_tokens_per_s": _OPT_NUM,
        "gain": _OPT_NUM,
        "error": _OPT_STR,
    },
    "gpu_train_run": {
        "model": (str,),
        "iterations": (int,),
        "loss_first": _OPT_NUM,
        "loss_last": _OPT_NUM,
        "resume_exact": _OPT_BOOL,
        "generation_ok": _OPT_BOOL,
        "error": _OPT_STR,
    },
}

# Top-level keys and their types (lists of rows are checked with ROW_FIELDS).
TOP_LEVEL: dict[str, tuple] = {
    "schema": (str,),
    "date": (str,),
    "machine": (dict,),
    "git_revision": (str,),
    "git_dirty": _OPT_BOOL,
    "device": (str,),
    "device_type": (str,),
    "smoke": (bool,),
    "phases": (dict,),
    "versions": (dict,),
    "bf16_matmul_tflops": _OPT_NUM,
    "tests": (dict, type(None)),
    "attention": (list,),
    "train": (list,),
    "diff_vs_transformer_ratio_4k": _OPT_NUM,
    "flop_bound_4k": _OPT_NUM,
    "diff_vs_transformer_ratio_2k": _OPT_NUM,
    "flop_bound_2k": _OPT_NUM,
    "flop_bound_3b_4k": _OPT_NUM,
    "memory": (list,),
    "gpu_train_run": (list,),
}
# Keys added after the first files of this schema: absent from older files, typed where present.
OPTIONAL_TOP_LEVEL: dict[str, tuple] = {
    "git_source": _OPT_STR,  # where git_revision came from: "git", "stamp", "stamp (tree differs)", "none"
    "peak_bf16_tflops": _OPT_NUM,  # the GPU's dense bf16 peak (datasheet): the MFU denominator
    "wheels": (dict, type(None)),  # what --wheels found and installed
    "continues": (list,),  # earlier results files of the same revision and GPU merged in (--continue)
    "levers": (list,),  # the train phase's lever matrix: each lever's gain, tokens/s on over its off twin
}
# Keys of the fused Triton kernel, which left the package (docs/gpu.md, "The first GPU run"): the files
# under benchmarks/results/ written before hold them, report.py shows them as history; no run writes them.
RETIRED_TOP_LEVEL: dict[str, tuple] = {
    "triton_candidates": (list,),  # each tile configuration's float64 check
    "triton_best": (dict, type(None)),  # the fastest correct tiles at 4K
    "fused_speedup_vs_best_unfused_4k": _OPT_NUM,
    "triton_cache": (dict, type(None)),  # the Triton cache archive restored before and saved after
}


def empty_result() -> dict[str, Any]:
    """Every key present, nothing measured."""
    out: dict[str, Any] = {}
    for key, types in {**TOP_LEVEL, **OPTIONAL_TOP_LEVEL}.items():
        if list in types:
            out[key] = []
        elif type(None) in types:
            out[key] = None
        elif dict in types:
            out[key] = {}
        elif bool in types:
            out[key] = False
        else:
            out[key] = ""
    out["schema"] = SCHEMA
    out["phases"] = {p: {"status": "not run", "seconds": None, "error": None} for p in PHASES}
    return out


def validate(result: Any) -> list[str]:
    """Problems with a results object (empty when it follows the schema)."""
    if not isinstance(result, dict):
        return ["the results file must hold a JSON object"]
    problems = []
    if result.get("schema") != SCHEMA:
        problems.append(f"schema is {result.get('schema')!r}, expected {SCHEMA!r}")
    for key, types in TOP_LEVEL.items():
        if key not in result:
            problems.append(f"missing top-level key {key!r}")
        elif not _is(result[key], types):
            problems.append(f"{key!r} has type {type(result[key]).__name__}")
    for key, types in {**OPTIONAL_TOP_LEVEL, **RETIRED_TOP_LEVEL}.items():
        if key in result and not _is(result[key], types):
            problems.append(f"{key!r} has type {type(result[key]).__name__}")
    if result.get("device_type") not in ("cuda", "cpu"):
        problems.append(f"device_type must be 'cuda' or 'cpu', got {result.get('device_type')!r}")
    phases = result.get("phases")
    if isinstance(phases, dict):
        for name, info in phases.items():
            if name not in PHASES:
                problems.append(f"unknown phase {name!r}")
            elif not isinstance(info, dict) or info.get("status") not in PHASE_STATUSES:
                problems.append(f"phase {name!r} needs a status among {PHASE_STATUSES}")
    for table, fields in ROW_FIELDS.items():
        rows = result.get(table)
        if not isinstance(rows, list):
            continue
        for i, row in enumerate(rows):
            if not isinstance(row, dict):
                problems.append(f"{table}[{i}] is not an object")
                continue
            for name, types in fields.items():
                if name not in row:
                    problems.append(f"{table}[{i}] lacks {name!r}")
                elif not _is(row[name], types):
                    problems.append(f"{table}[{i}].{name} has type {type(row[name]).__name__}")
    return problems


def _is(value: Any, types: tuple) -> bool:
    if isinstance(value, bool) and bool not in types:
        return False  # bool is an int subclass: not a number here
    return isinstance(value, types)


def read(path: Path) -> dict[str, Any]:
    """A results file, parsed and checked against the schema; ValueError saying what is wrong."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"not readable JSON ({exc})") from None
    problems = validate(data)
    if problems:
        raise ValueError("; ".join(problems[:5]))
    return data
