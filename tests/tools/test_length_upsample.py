from __future__ import annotations

import errno
import os
import stat

import numpy as np
import pytest

from diffmeg.data.gpt_datasets import parse_data_path
from diffmeg.data.indexed import IndexedWriter
from tests.tools.helpers import run_tool


def test_prints_the_data_path_and_writes_the_weights_file(tmp_path):
    lengths = [10, 300, 20, 500, 30]
    with IndexedWriter(str(tmp_path / "corpus")) as w:
        for n in lengths:
            w.add_document(np.ones(n, dtype=np.int32))
        w.commit()
    args = f"--input {tmp_path}/corpus --output-prefix {tmp_path}/up --target-length 256 --long-factor 2"
    proc = run_tool("length_upsample", *args.split(), "--train-tokens", "10000")
    assert proc.returncode == 0, proc.stderr
    values = proc.stdout.split()
    assert values == (tmp_path / "up_weights.txt").read_text().split()
    prefixes, weights = parse_data_path(values)
    assert prefixes == [str(tmp_path / "up_short"), str(tmp_path / "up_long")]
    short, long = 60, 800
    assert np.allclose(weights, [short / (short + 2 * long), 2 * long / (short + 2 * long)], rtol=1e-5)
    assert "epochs" in proc.stderr and "long [256, inf): 2 docs, 800 tokens" in proc.stderr

    args = f"--input {tmp_path}/corpus --output-prefix {tmp_path}/up2 --edges 100 200 --factors 1 2"
    proc = run_tool("length_upsample", *args.split())
    assert proc.returncode == 2 and "--factors needs 3 values" in proc.stderr


def test_outputs_follow_the_umask(tmp_path):
    with IndexedWriter(str(tmp_path / "corpus")) as w:
        for n in (10, 300):
            w.add_document(np.ones(n, dtype=np.int32))
        w.commit()
    old = os.umask(0o002)
    try:
        args = f"--input {tmp_path}/corpus --output-prefix {tmp_path}/up --target-length 256"
        proc = run_tool("length_upsample", *args.split())
    finally:
        os.umask(old)
    assert proc.returncode == 0, proc.stderr
    outputs = sorted(p.name for p in tmp_path.glob("up*"))
    assert outputs == [f"up_{b}.{x}" for b in ("long", "short") for x in ("bin", "ids.json", "idx")] + [
        "up_upsample.json",
        "up_weights.txt",
    ]
    assert {name: stat.S_IMODE((tmp_path / name).stat().st_mode) for name in outputs} == dict.fromkeys(
        outputs, 0o664
    )


def test_full_disk_is_one_line_and_leaves_only_the_input(tmp_path, monkeypatch):
    from diffmeg.data import indexed, upsample

    with IndexedWriter(str(tmp_path / "corpus")) as w:
        for n in (10, 300):
            w.add_document(np.ones(n, dtype=np.int32))
        w.commit()
    real = IndexedWriter.add_document

    def fill(self, tokens, lengths=None):
        if self.documents:  # the second document of a bucket no longer fits
            raise OSError(errno.EDQUOT, "Disk quota exceeded")
        real(self, tokens, lengths)

    monkeypatch.setattr(indexed.IndexedWriter, "add_document", fill)
    with pytest.raises(indexed.DiskFullError, match=rf"^disk full in {tmp_path}: "):
        upsample.length_upsample([str(tmp_path / "corpus")], str(tmp_path / "up"), target_length=1 << 20)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.bin", "corpus.ids.json", "corpus.idx"]
