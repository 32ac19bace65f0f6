"""benchmarks/campaign/cache.py: the Triton cache goes out as one archive within the device tool's
per-file limit and comes back where Triton looks for it."""

from __future__ import annotations

import os
import time

from benchmarks.campaign import cache


def _fake_cache(root, entries: int, size: int) -> None:
    """Triton's layout: one folder per compiled kernel (random bytes: an archive cannot shrink them)."""
    for i in range(entries):
        folder = root / f"kernel{i:02d}"
        folder.mkdir(parents=True)
        (folder / "k.cubin").write_bytes(os.urandom(size))
        (folder / f"__grp__k{i}.json").write_text('{"child_paths": {}}')
        stamp = time.time() - 1000 + i  # kernel19 is the newest
        os.utime(folder / "k.cubin", (stamp, stamp))


def test_saved_within_the_limit_newest_first_and_restored(tmp_path):
    source, out, restored = tmp_path / "cache", tmp_path / "out", tmp_path / "restored"
    out.mkdir()
    _fake_cache(source, entries=20, size=20_000)
    saved = cache.save(source, out, limit=150_000)  # room for ~7 of the 20
    assert saved["saved"] == str(out / cache.ARCHIVE_NAME)
    assert (out / cache.ARCHIVE_NAME).stat().st_size == saved["bytes"] <= 150_000
    assert 0 < saved["entries"] < 20 and saved["entries"] + saved["dropped"] == 20
    info = cache.restore(out / cache.ARCHIVE_NAME, restored)
    assert info["error"] is None and info["entries"] == saved["entries"]
    kept = sorted(p.name for p in restored.iterdir())
    assert kept == [f"kernel{i:02d}" for i in range(20 - saved["entries"], 20)]
    for name in kept:
        assert (restored / name / "k.cubin").read_bytes() == (source / name / "k.cubin").read_bytes()
    assert list(out.iterdir()) == [out / cache.ARCHIVE_NAME]  # one file back, at the top of --out

    assert cache.save(tmp_path / "empty", out) is None
    bad = tmp_path / "bad.tar.gz"
    bad.write_bytes(b"not an archive")
    assert cache.restore(bad, restored)["error"].startswith("ReadError")
