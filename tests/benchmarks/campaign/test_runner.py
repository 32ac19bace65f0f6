"""benchmarks/campaign/runner.py: the command line and the results file's name."""

from __future__ import annotations

from benchmarks.campaign import runner


def test_file_names_and_arguments():
    assert runner.slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert runner.slug("cpu (x86_64)") == "cpu-x86-64"
    assert runner.main(["--phase", "env,bogus", "--out", "/tmp/never-made"]) == 2
    assert runner.main(["--phase", "memory", "--phase-budget", "memory=lots", "--out", "/tmp/never"]) == 2
    assert runner.main(["--phase", "memory", "--phase-budget", "nap=10", "--out", "/tmp/never"]) == 2
