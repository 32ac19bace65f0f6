"""benchmarks/campaign/install.py: wheels of missing packages, installed offline."""

from __future__ import annotations

import importlib.metadata

from benchmarks.campaign import install, runner


def test_installed_wheels_are_not_installed_again(tmp_path, monkeypatch):
    version = importlib.metadata.version("pytest")
    (tmp_path / f"pytest-{version}-py3-none-any.whl").write_bytes(b"")
    calls, lines = [], []
    monkeypatch.setattr(install.subprocess, "run", lambda *a, **k: calls.append(a))
    info = install.install_wheels(tmp_path, lines.append)
    assert info["installed"] == [] and info["error"] is None and calls == []
    assert lines == [
        f"wheels: every wheel in {tmp_path} is installed already (pytest-{version}-py3-none-any.whl)"
    ]


def test_a_missing_or_empty_wheel_folder_is_said_so(tmp_path, monkeypatch):
    """Not "everything installed": the folder is named as missing, and without megatron-core the
    command stops before any phase with the fix (here megatron-core is made to look absent)."""
    lines = []
    info = install.install_wheels(tmp_path / "nope", lines.append)
    assert info["error"] == f"no folder {tmp_path / 'nope'}" and info["installed"] == []
    assert lines[0].startswith(f"wheels: no folder {tmp_path / 'nope'}: nothing installed")
    assert install.install_wheels(tmp_path, lines.append)["error"] == f"no wheels in {tmp_path}"
    assert install.missing_requirement(info) is None  # megatron-core is installed here

    real = install.importlib.util.find_spec
    monkeypatch.setattr(
        install.importlib.util,
        "find_spec",
        lambda name, *a: None if name.startswith("megatron") else real(name),
    )
    problem = install.missing_requirement(info)
    assert problem.startswith("megatron-core is not installed and no wheel provided it (no folder")
    assert "--wheels .whl" in problem
    out = tmp_path / "out"
    assert (
        runner.main(["--smoke", "--device", "cpu", "--out", str(out), "--wheels", str(tmp_path / "nope")])
        == 2
    )
    log = next(out.glob("campaign-*.log")).read_text()
    assert "campaign: megatron-core is not installed" in log and "=== phase" not in log
