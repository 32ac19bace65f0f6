"""benchmarks/campaign/procs.py: a phase's process ends with everything it started, its rows kept."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from benchmarks.campaign import procs

# A fake phase: one row, then a process in a session of its own (as pytest and the pretrain_diff.py runs
# are started) and one in the phase's own group (as a checkpoint writer's helper), their ids written down,
# then a second row, then it hangs (or exits, with "exit").
_PHASE = """
import json, os, subprocess, sys, time
part, pids, mode = sys.argv[1:4]
def save(rows):
    with open(part + ".tmp", "w") as f:
        json.dump({"_status": "ok", "_error": None, "attention": rows}, f)
    os.replace(part + ".tmp", part)
row = {"impl": "baseline sdpa", "seq": 4096, "head_dim": 128}
save([row])
own = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
same = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
with open(pids, "w") as f:
    json.dump([own.pid, same.pid], f)
save([row, {**row, "impl": "diff sdpa split-v"}])
print("two rows kept", flush=True)
if mode == "exit":
    os._exit(0)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for a reaper is gone for our purpose)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def _run_fake_phase(tmp_path: Path, mode: str, budget: float) -> tuple[dict, list[int], list[str]]:
    part_file, pids = tmp_path / "part" / "kernels.json", tmp_path / "pids.json"
    part_file.parent.mkdir()
    cmd = [sys.executable, "-c", _PHASE, str(part_file), str(pids), mode]
    lines: list[str] = []
    part, _ = procs.run_phase_process(cmd, budget, {"PATH": "/usr/bin:/bin"}, lines.append, part_file)
    return part, json.loads(pids.read_text()), lines


def test_a_phase_killed_mid_run_keeps_its_rows_and_leaves_no_process(tmp_path):
    part, pids, lines = _run_fake_phase(tmp_path, "hang", budget=6.0)
    assert part["_status"] == "timeout" and part["_error"] == "killed after 6s"
    assert [r["impl"] for r in part["attention"]] == ["baseline sdpa", "diff sdpa split-v"]
    assert "two rows kept" in lines
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if _alive(p)], "a process the phase started outlived it"


def test_a_finished_phase_leaves_no_helper_in_its_group(tmp_path):
    part, pids, _ = _run_fake_phase(tmp_path, "exit", budget=60.0)
    assert part["_status"] == "ok" and len(part["attention"]) == 2
    own_session, same_group = pids
    deadline = time.monotonic() + 5
    while _alive(same_group) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(same_group)
    procs.end_tree(own_session)  # an orphan in a session of its own is its starter's to end (gpu_tests, runs)


def test_dynamo_runs_as_pretrain_diff_runs_it():
    """On a GPU the train and memory phases compile megatron-core's fusions (as pretrain_diff.py does);
    nothing compiles on a CPU or in the phases that train no model."""
    assert procs.torchdynamo_disable("train", "cuda") == procs.torchdynamo_disable("memory", "cuda") == "0"
    assert {procs.torchdynamo_disable(p, "cuda") for p in ("env", "tests", "kernels")} == {"1"}
    assert {procs.torchdynamo_disable(p, "cpu") for p in ("train", "memory")} == {"1"}
