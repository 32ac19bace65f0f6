"""Ctrl-C in a tool that writes datasets (tools/make_mqar_data.py), sent as a real SIGINT while it writes:
exit 130, one line, and neither a dataset that looks complete nor a temporary left behind."""

from __future__ import annotations

import glob
import signal
import subprocess
import time

from tests.data.helpers import REPO_ROOT
from tests.tools.helpers import tool_cmd, tool_env


def test_sigint_while_writing_is_one_line_rc_130_and_no_output_left(tmp_path):
    prefix = tmp_path / "mqar"
    cmd = tool_cmd("make_mqar_data", "--output-prefix", prefix, "--pairs", "8", "--documents", "10000000")
    proc = subprocess.Popen(
        cmd,
        cwd=REPO_ROOT,
        env=tool_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        # Ctrl-C's default back: a suite started as a background job of a non-interactive shell (`.ci/run &`)
        # ignores SIGINT, and an ignored SIGINT is inherited, so Python would never raise KeyboardInterrupt.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 240
    while not glob.glob(f"{prefix}*.tmp-*") and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)  # until the writer has opened its temporaries
    assert proc.poll() is None, "the tool ended before it was interrupted"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err.decode()[-3000:]
    assert err.decode().strip().splitlines() == ["error: interrupted; incomplete outputs were removed"]
    assert sorted(p.name for p in tmp_path.iterdir()) == []
