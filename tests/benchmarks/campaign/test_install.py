"""benchmarks/campaign/install.py: wheels of missing packages, installed offline."""

from __future__ import annotations

from benchmarks.campaign import install


def test_installed_wheels_are_not_installed_again(tmp_path, monkeypatch):
    import importlib.metadata

    version = importlib.metadata.version("pytest")
    (tmp_path / f"pytest-{version}-py3-none-any.whl").write_bytes(b"")
    calls = []
    monkeypatch.setattr(install.subprocess, "run", lambda *a, **k: calls.append(a))
    assert install.install_wheels(tmp_path, lambda line: None) == [] and calls == []
