from __future__ import annotations

import errno
import gzip
import importlib.util
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from diffmeg.data import indexed
from diffmeg.data import preprocess as pp
from diffmeg.data.indexed import merge_datasets
from diffmeg.data.preprocess import (
    PreprocessConfig,
    Segment,
    detect_rank,
    find_inputs,
    preprocess,
    split_segments,
)
from diffmeg.data.tiktoken_cl100k import EOD_ID
from diffmeg.errors import DiffmegError
from tests.data.helpers import leftovers, read_documents, write_jsonl

LONG = " ".join(f"word{i % 997} ünïcödé {i}" for i in range(40_000))  # ~1 MB, about 180K tokens
RECORDS = [
    {"text": "Hello world.", "title": "greeting", "id": 1},
    {"text": "", "title": "empty text"},
    {"text": "naïve café — 日本語 🙂 \u2028 and a lone surrogate \ud800 <|endoftext|>", "title": ""},
    {"text": LONG, "title": "long"},
    *({"text": f"document {i}: " + "lorem ipsum " * (i % 50), "title": f"t{i}"} for i in range(300)),
]


@pytest.fixture
def corpus(tmp_path):
    return write_jsonl(tmp_path / "corpus.jsonl", RECORDS)


def expected(tokenizer, records, key, append_eod):
    return [tokenizer.tokenize(r[key]) + ([EOD_ID] if append_eod else []) for r in records]


def run(tmp_path, inputs, name="out", rank=0, world_size=1, **kwargs):
    kwargs.setdefault("log_interval", 0)
    cfg = PreprocessConfig(inputs=[str(p) for p in inputs], output_prefix=str(tmp_path / name), **kwargs)
    return preprocess(cfg, rank=rank, world_size=world_size, log=lambda line: None)


def docs(prefix):
    return [d.tolist() for d in read_documents(prefix)]


@pytest.mark.parametrize(
    "workers,partitions,append_eod", [(1, 1, True), (2, 1, False), (2, 2, True), (3, 2, False)]
)
def test_round_trip(tmp_path, corpus, tokenizer, bpe_file, monkeypatch, workers, partitions, append_eod):
    monkeypatch.setattr(pp, "BATCH_BYTES", 4096)  # many batches, and cuts inside the file
    result = run(
        tmp_path,
        [corpus],
        json_keys=["text", "title"],
        append_eod=append_eod,
        workers=workers,
        partitions=partitions,
        tokenizer_file=bpe_file,
    )
    assert result.documents == len(RECORDS) and result.skipped == 0
    for key in ("text", "title"):
        assert result.outputs[key] == str(tmp_path / f"out_{key}_document")
        assert docs(result.outputs[key]) == expected(tokenizer, RECORDS, key, append_eod)
    assert result.tokens == sum(map(len, expected(tokenizer, RECORDS, "text", append_eod)))
    assert leftovers(tmp_path) == sorted(
        f"out_{k}_document.{e}" for k in ("text", "title") for e in ("bin", "idx")
    )


def test_compressed_text_and_blank_lines(tmp_path, tokenizer, bpe_file):
    zstandard = pytest.importorskip("zstandard", reason="zstandard not installed (dev extra)")
    lines = [{"text": f"record {i} é"} for i in range(50)]
    write_jsonl(tmp_path / "a.jsonl", lines[:10] + ["", "   "])  # blank lines are not records
    with gzip.open(tmp_path / "b.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(f'{{"text": "{r["text"]}"}}\n' for r in lines[10:30])
    raw = "".join(f'{{"text": "{r["text"]}"}}\n' for r in lines[30:]).encode()
    (tmp_path / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(raw))
    (tmp_path / "d.txt").write_text("A whole file\n\nis one document.\n", encoding="utf-8")
    inputs = [tmp_path / n for n in ("a.jsonl", "b.jsonl.gz", "c.jsonl.zst", "d.txt")]
    result = run(tmp_path, inputs, append_eod=True, tokenizer_file=bpe_file)
    texts = [r["text"] for r in lines] + ["A whole file\n\nis one document.\n"]
    assert docs(result.outputs["text"]) == [tokenizer.tokenize(t) + [EOD_ID] for t in texts]


def test_ranks_split_the_input_and_merge_to_the_single_process_result(tmp_path, bpe_file, monkeypatch):
    monkeypatch.setattr(pp, "BATCH_BYTES", 2048)
    files = [write_jsonl(tmp_path / f"f{i}.jsonl", RECORDS[4 + 60 * i : 64 + 60 * i]) for i in range(4)]
    single = run(tmp_path, files, name="single", tokenizer_file=bpe_file, append_eod=True)
    shards = [
        run(tmp_path, files, "multi", rank, 3, tokenizer_file=bpe_file, append_eod=True).outputs["text"]
        for rank in range(3)
    ]
    assert shards[1] == str(tmp_path / "multi-rank00001-of-00003_text_document")
    merge_datasets(shards, str(tmp_path / "merged"))
    assert docs(str(tmp_path / "merged")) == docs(single.outputs["text"])


def test_split_segments_is_contiguous_and_cuts_at_lines(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [{"text": "x" * (i % 37)} for i in range(500)])
    with gzip.open(tmp_path / "b.jsonl.gz", "wt") as f:
        f.write('{"text": "gz"}\n')
    (tmp_path / "c.txt").write_text("")  # empty file: still one (empty) document
    files = find_inputs([str(tmp_path / "*")])
    data = (tmp_path / "a.jsonl").read_bytes()
    whole = [Segment(f, 0, f.size) for f in files]
    for n in (1, 2, 3, 7, 600):
        parts = split_segments(whole, n)
        assert len(parts) == n
        flat = [s for part in parts for s in part]
        assert [s.file.path for s in flat if s.file.path.endswith(".gz")] == [str(tmp_path / "b.jsonl.gz")]
        a = [s for s in flat if s.file.path.endswith("a.jsonl")]
        assert a[0].start == 0 and a[-1].end == len(data)
        assert all(x.end == y.start for x, y in zip(a, a[1:], strict=False))
        assert all(data[s.start - 1 : s.start] == b"\n" for s in a if s.start)
        assert [s.file.path for s in flat][-1].endswith("c.txt")
    sizes = [sum(s.nbytes for s in part) for part in split_segments(whole[:1], 4)]
    assert max(sizes) - min(sizes) < 200  # balanced to within a line or so


def test_bad_line_names_file_and_line(tmp_path, bpe_file, monkeypatch):
    monkeypatch.setattr(pp, "BATCH_BYTES", 512)
    good = [{"text": f"ok {i}"} for i in range(200)]
    path = write_jsonl(tmp_path / "in.jsonl", good[:150] + ['{"text": "unterminated'] + good[150:])
    for workers, partitions in ((1, 1), (2, 2)):  # line 151 is in the second partition
        with pytest.raises(DiffmegError, match=r"in\.jsonl:151: invalid JSON .*--skip-bad-lines"):
            run(tmp_path, [path], tokenizer_file=bpe_file, workers=workers, partitions=partitions)
        assert leftovers(tmp_path) == []


@pytest.mark.parametrize(
    "line,reason",
    [
        ('{"title": "no text"}', "missing key 'text'"),
        ('{"text": 42}', "key 'text' is int, not a string"),
        ('["text"]', "expected a JSON object, got list"),
        (b'{"text": "\xff\xfe"}', "not valid UTF-8"),
    ],
)
def test_bad_record_kinds(tmp_path, bpe_file, line, reason):
    path = tmp_path / "in.jsonl"
    raw = line if isinstance(line, bytes) else line.encode()
    path.write_bytes(b'{"text": "fine"}\n' + raw + b"\n")
    with pytest.raises(DiffmegError, match=rf"in\.jsonl:2: {reason}"):
        run(tmp_path, [path], tokenizer_file=bpe_file)


def test_skip_bad_lines_counts_and_keeps_keys_aligned(tmp_path, tokenizer, bpe_file):
    records = ['{"text": "a", "title": "A"}', "{oops", '{"text": "b"}', '{"text": "c", "title": "C"}']
    path = write_jsonl(tmp_path / "in.jsonl", records)
    result = run(tmp_path, [path], json_keys=["text", "title"], skip_bad_lines=True, tokenizer_file=bpe_file)
    assert (result.documents, result.skipped) == (2, 2)
    assert docs(result.outputs["text"]) == [tokenizer.tokenize("a"), tokenizer.tokenize("c")]
    assert docs(result.outputs["title"]) == [tokenizer.tokenize("A"), tokenizer.tokenize("C")]


def test_refuses_to_overwrite_before_doing_work(tmp_path, corpus, bpe_file):
    run(tmp_path, [corpus], tokenizer_file=bpe_file)
    before = (tmp_path / "out_text_document.bin").stat().st_mtime_ns
    with pytest.raises(DiffmegError, match="out_text_document.bin already exists; pass --overwrite"):
        run(tmp_path, [corpus], tokenizer_file=bpe_file, append_eod=True)
    assert (tmp_path / "out_text_document.bin").stat().st_mtime_ns == before
    result = run(tmp_path, [corpus], tokenizer_file=bpe_file, append_eod=True, overwrite=True)
    assert docs(result.outputs["text"])[0][-1] == EOD_ID


def test_input_errors(tmp_path, bpe_file):
    with pytest.raises(DiffmegError, match="matches no file"):
        find_inputs([str(tmp_path / "*.jsonl")])
    with pytest.raises(DiffmegError, match="does not exist"):
        find_inputs([str(tmp_path / "missing.jsonl")])
    (tmp_path / "data.csv").write_bytes(b"")
    with pytest.raises(DiffmegError, match="unsupported file type"):
        find_inputs([str(tmp_path / "data.csv")])
    (tmp_path / "data.parquet").write_bytes(b"")  # read as Parquet (diffmeg/data/tables.py): not one
    reason = (
        "cannot be read as Parquet: its footer is damaged"
        if importlib.util.find_spec("pyarrow")
        else ("needs the pyarrow package: pip install 'diffmeg\\[tables\\]'")
    )
    with pytest.raises(DiffmegError, match=f"data.parquet {reason}"):
        find_inputs([str(tmp_path / "data.parquet")])
    (tmp_path / "cut.txt.gz").write_bytes(gzip.compress(b"a text cut short" * 10)[:15])
    with pytest.raises(DiffmegError, match=r"cannot read \S+cut\.txt\.gz: Compressed file ended before"):
        find_inputs([str(tmp_path / "cut.txt.gz")])  # its first bytes are read before any work
    (tmp_path / "a.txt").write_text("x")
    with pytest.raises(DiffmegError, match="plain-text inputs carry only the 'text' field"):
        run(tmp_path, [tmp_path / "a.txt"], json_keys=["body"], tokenizer_file=bpe_file)
    with pytest.raises(DiffmegError, match="--json-keys"):
        PreprocessConfig(inputs=["x"], output_prefix="y", json_keys=["a", "a"])
    with pytest.raises(DiffmegError, match="--workers"):
        PreprocessConfig(inputs=["x"], output_prefix="y", workers=0)


def test_detect_rank_from_launcher_variables(monkeypatch):
    for var in ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_SIZE", "PMI_RANK", "PMIX_RANK"):
        monkeypatch.delenv(var, raising=False)
    for var in ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS"):
        monkeypatch.delenv(var, raising=False)
    assert detect_rank() == (0, 1, "single process")
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "4")  # an sbatch script, not an srun step: one process
    assert detect_rank()[:2] == (0, 1)
    monkeypatch.setenv("SLURM_PROCID", "3")
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "4")
    assert detect_rank()[:2] == (3, 4)
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # no mpi4py: the launcher's variables
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "1")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    assert detect_rank() == (1, 2, "Open MPI environment")


class _FillingFile:
    """A data file on a disk with ``room`` bytes left: the write that does not fit fails with ENOSPC."""

    def __init__(self, f, room: int) -> None:
        self._f, self._room = f, room

    def write(self, data) -> int:
        if len(data) > self._room:
            raise OSError(errno.ENOSPC, "No space left on device")
        self._room -= len(data)
        return self._f.write(data)

    def __getattr__(self, name):
        return getattr(self._f, name)


def _fill_disk_after(monkeypatch, room: int) -> None:
    """Every indexed-dataset writer (in this process and forked ones) runs out of space after ``room``."""

    class Builder(indexed.IndexedDatasetBuilder):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.data_file = _FillingFile(self.data_file, room)

    monkeypatch.setattr(indexed, "IndexedDatasetBuilder", Builder)


@pytest.mark.parametrize("partitions", [1, 2])
def test_full_disk_is_one_line_and_removes_partial_outputs(tmp_path, bpe_file, monkeypatch, partitions):
    corpus = write_jsonl(tmp_path / "small.jsonl", RECORDS[4:])  # ~60 KB of tokens in small writes
    monkeypatch.setattr(pp, "BATCH_BYTES", 1024)
    _fill_disk_after(monkeypatch, 20_000)
    with pytest.raises(DiffmegError) as info:
        run(tmp_path, [corpus], tokenizer_file=bpe_file, workers=partitions, partitions=partitions)
    message = str(info.value)
    assert "\n" not in message
    where = re.escape(str(tmp_path))
    assert re.match(rf"disk full in {where}: [\d.]+ \w+ free after [\d.]+ KiB of output", message), message
    written = float(re.search(r"after ([\d.]+) KiB", message).group(1)) * 1024
    assert 1024 < written <= partitions * 20_000 + 4096, message  # on disk when the write failed
    assert "partial output was removed" in message
    assert leftovers(tmp_path) == []


def test_outputs_follow_the_umask(tmp_path, corpus, bpe_file):
    """Datasets are shared files: group-writable under umask 002, never private like mkstemp's 0600."""
    old = os.umask(0o002)
    try:
        for partitions in (1, 2):
            name = f"p{partitions}"
            run(
                tmp_path,
                [corpus],
                name=name,
                tokenizer_file=bpe_file,
                workers=partitions,
                partitions=partitions,
            )
            merge_datasets([str(tmp_path / f"{name}_text_document")], str(tmp_path / f"{name}_merged"))
    finally:
        os.umask(old)
    outputs = sorted(p for p in tmp_path.iterdir() if p.suffix in (".bin", ".idx"))
    assert len(outputs) == 8
    assert {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in outputs} == {
        p.name: "0o664" for p in outputs
    }


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()  # reaped: the pid names no process (until the system reuses it)
    return proc.pid


def test_stale_temporaries_of_dead_processes_go_and_those_of_live_ones_stop_the_run(
    tmp_path, corpus, bpe_file
):
    prefix = tmp_path / "out_text_document"
    dead = _dead_pid()
    stale = [f"{prefix}.bin.tmp-{dead}", f"{prefix}.idx.tmp-{dead}"]
    for path in stale:
        Path(path).write_bytes(b"partial")
    scratch = tmp_path / f"out_text_document.tmp-{dead}-x1y2"  # a killed --partitions run's shards
    scratch.mkdir()
    (scratch / "part00000_text.bin").write_bytes(b"partial")
    unrelated = tmp_path / "other_text_document.bin.tmp-1"
    unrelated.write_bytes(b"another output's")
    lines: list[str] = []
    cfg = PreprocessConfig(inputs=[str(corpus)], output_prefix=str(tmp_path / "out"), tokenizer_file=bpe_file)
    preprocess(cfg, log=lines.append)
    removed = [line for line in lines if line.startswith("removed")]
    assert len(removed) == 1 and f"process {dead}, which no longer runs" in removed[0], lines
    assert all(path in removed[0] for path in [*stale, str(scratch)])
    assert not scratch.exists() and unrelated.exists()
    assert leftovers(tmp_path) == [
        "other_text_document.bin.tmp-1",
        "out_text_document.bin",
        "out_text_document.idx",
    ]

    live = tmp_path / f"new_text_document.bin.tmp-{os.getppid()}"  # our parent is certainly running
    live.write_bytes(b"being written")
    cfg = PreprocessConfig(inputs=[str(corpus)], output_prefix=str(tmp_path / "new"), tokenizer_file=bpe_file)
    with pytest.raises(DiffmegError, match=rf"process {os.getppid()} is writing the same output now"):
        preprocess(cfg, log=lines.append)
    assert live.read_bytes() == b"being written"


def test_an_empty_input_is_refused_and_nothing_is_written(tmp_path, bpe_file):
    """An empty corpus (an unfinished copy) would give a 0-document dataset with rc 0 and fail training."""
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DiffmegError, match=r"every input file is empty \(0 bytes\), nothing to tokenize"):
        run(tmp_path, [str(tmp_path / "empty.jsonl")], tokenizer_file=bpe_file)
    with gzip.open(tmp_path / "nothing.jsonl.gz", "wt") as f:
        f.write("")
    with pytest.raises(DiffmegError, match=r"nothing\.jsonl\.gz holds no documents \(0 bad lines skipped\)"):
        run(tmp_path, [str(tmp_path / "nothing.jsonl.gz")], name="gz", tokenizer_file=bpe_file)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.jsonl", "nothing.jsonl.gz"]


def test_progress_is_timed_not_counted_by_default(monkeypatch):
    """A line every --log-seconds (a few for any corpus), not one per 1000 documents; --log-interval N
    still counts documents and 0 prints none."""
    now = [100.0]
    monkeypatch.setattr(pp.time, "time", lambda: now[0])
    lines: list[str] = []
    progress = pp._Progress(10_000, None, lines.append, "", seconds=10.0)
    for _ in range(5000):  # 5000 documents in 5 s: no line yet
        now[0] += 0.001
        progress.update(1, 1)
    assert lines == []
    now[0] += 6.0
    progress.update(1, 1)
    assert len(lines) == 1 and lines[0].startswith("processed 5001 documents")
    counted = pp._Progress(10_000, 1000, lines.append, "")
    for _ in range(2500):
        counted.update(1, 1)
    assert len(lines) == 3
    silent = pp._Progress(10_000, 0, lines.append, "")
    now[0] += 100
    silent.update(10_000, 10_000)
    assert len(lines) == 3
    with pytest.raises(DiffmegError, match="--log-seconds must be > 0, got 0"):
        PreprocessConfig(inputs=["x"], output_prefix="y", log_seconds=0)


def _compressed(kind: str, data: bytes) -> bytes:
    import bz2

    import zstandard

    return {"gz": gzip.compress, "zst": zstandard.ZstdCompressor().compress, "bz2": bz2.compress}[kind](data)


@pytest.mark.parametrize(
    "name,content,message",
    [
        (
            "data.jsonl",
            ("gz", b'{"text": "a"}\n'),
            "data.jsonl is gzip-compressed data without a .gz or .zst suffix, so it cannot be read as named; "
            "rename it to {d}/data.jsonl.gz",
        ),
        (
            "data.txt",
            ("zst", b"some text"),
            "data.txt is zstd-compressed data without a .gz or .zst suffix, so it cannot be read as named; "
            "rename it to {d}/data.txt.zst",
        ),
        (
            "data.jsonl.zst",
            ("gz", b'{"text": "a"}\n'),
            "data.jsonl.zst is gzip-compressed data named .zst, so it cannot be read as named; rename it to "
            "{d}/data.jsonl.gz",
        ),
        (
            "data.jsonl",
            ("bz2", b'{"text": "a"}\n'),
            "data.jsonl is bzip2-compressed data without a .gz or .zst suffix, so it cannot be read as "
            "named; decompress it first, e.g. bzip2 -dc {d}/data.jsonl > {d}/data.plain.jsonl",
        ),
        (
            "rows.json",
            (None, b'\xef\xbb\xbf [{"text": "a"},\n {"text": "b"}]\n'),
            "rows.json is a JSON array ([{{...}}, {{...}}]), not JSON Lines (one object per line); "
            "convert it first, e.g. jq -c '.[]' {d}/rows.json > {d}/rows.jsonl",
        ),
        (
            "rows.jsonl.gz",
            ("gz", b'[{"text": "a"}, {"text": "b"}]'),
            "rows.jsonl.gz is a JSON array ([{{...}}, {{...}}]), not JSON Lines (one object per line); "
            "convert it first, e.g. gzip -dc {d}/rows.jsonl.gz | jq -c '.[]' > {d}/rows.lines.jsonl",
        ),
        (
            "one.json",
            (None, b'{\n  "text": "a"\n}\n'),
            "one.json holds pretty-printed JSON (an object over several lines), not JSON Lines (one "
            "object per line); convert it first, e.g. jq -c . {d}/one.json > {d}/one.jsonl",
        ),
    ],
)
def test_an_input_that_is_not_what_its_name_says_is_named_before_any_work(tmp_path, name, content, message):
    """Each would otherwise fail on its first line with "not valid UTF-8" / "invalid JSON" and the advice
    to pass --skip-bad-lines, which would drop every line."""
    kind, data = content
    (tmp_path / name).write_bytes(_compressed(kind, data) if kind else data)
    with pytest.raises(DiffmegError) as info:
        find_inputs([str(tmp_path / name)])
    assert str(info.value) == f"--input {tmp_path}/" + message.format(d=tmp_path)
    (tmp_path / "fine.jsonl").write_bytes(b'{"text": "[not an array]"}\n')  # JSON Lines stay accepted
    (tmp_path / "fine.txt").write_bytes(b"[a text that starts with a bracket]")
    assert [f.kind for f in find_inputs([str(tmp_path / "fine.jsonl"), str(tmp_path / "fine.txt")])] == [
        "jsonl",
        "text",
    ]


def test_an_output_prefix_naming_a_folder_is_refused(tmp_path):
    (tmp_path / "data").mkdir()
    for prefix in (f"{tmp_path}/data/", f"{tmp_path}/data"):
        with pytest.raises(DiffmegError) as info:
            PreprocessConfig(inputs=["x.jsonl"], output_prefix=prefix)
        assert str(info.value) == (
            f"--output-prefix {prefix} names a folder, not the start of the output files' names; give a name "
            f"inside it, e.g. --output-prefix {tmp_path}/data/corpus"
        )
    with pytest.raises(DiffmegError, match=r"--output-prefix \S+/data/ names a folder"):  # merge: as is
        merge_datasets([str(tmp_path / "a")], f"{tmp_path}/data/")
    assert list((tmp_path / "data").iterdir()) == []


def test_overwrite_replaces_only_the_prefix_files_and_never_with_nothing(tmp_path, corpus, bpe_file):
    """--overwrite replaces {prefix}_{key}_document's .bin/.idx/.tokenizer.json/.ids.json; the folder's other
    files stay; an input of no documents is refused before it replaces the previous dataset."""
    run(tmp_path, [corpus], tokenizer_file=bpe_file)
    (tmp_path / "notes.txt").write_text("mine")
    run(tmp_path, [corpus], name="other", tokenizer_file=bpe_file)
    bad = write_jsonl(tmp_path / "bad.jsonl", ["not json", "{oops"])
    others = {p.name: p.read_bytes() for p in tmp_path.iterdir() if not p.name.startswith("out_")}
    before = docs(str(tmp_path / "out_text_document"))
    with pytest.raises(DiffmegError, match=r"bad\.jsonl holds no documents \(2 bad lines skipped\)"):
        run(tmp_path, [bad], tokenizer_file=bpe_file, skip_bad_lines=True, overwrite=True)
    assert docs(str(tmp_path / "out_text_document")) == before

    result = run(tmp_path, [corpus], tokenizer_file=bpe_file, append_eod=True, overwrite=True)
    assert docs(result.outputs["text"])[0][-1] == EOD_ID
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if not p.name.startswith("out_")} == others
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("out_")) == [
        "out_text_document.bin",
        "out_text_document.ids.json",
        "out_text_document.idx",
        "out_text_document.tokenizer.json",
    ]

    for suffix in (".bin", ".idx"):  # a loss mask of the dataset there would be read with the new tokens
        (tmp_path / f"out_text_document.loss_mask{suffix}").write_bytes(b"")
    with pytest.raises(DiffmegError, match=r"out_text_document\.loss_mask\.bin/\.idx is the loss mask of"):
        run(tmp_path, [corpus], tokenizer_file=bpe_file, overwrite=True)


@pytest.mark.parametrize(
    "encoding,bom,named,iconv",
    [
        ("utf-16", True, "UTF-16LE text (it starts with a byte-order mark)", "UTF-16"),  # Python writes LE
        ("utf-16-be", False, "UTF-16BE text", "UTF-16BE"),
        ("utf-32-le", False, "UTF-32LE text", "UTF-32LE"),
        ("utf-32", True, "UTF-32LE text (it starts with a byte-order mark)", "UTF-32"),
    ],
)
def test_utf16_and_utf32_inputs_are_named_with_the_conversion(tmp_path, encoding, bom, named, iconv):
    """Every line of them would otherwise be "not valid UTF-8; fix it or pass --skip-bad-lines"."""
    text = '{"text": "caf\u00e9 and more text"}\n{"text": "second line"}\n'
    (tmp_path / "wide.jsonl").write_bytes(text.encode(encoding))
    with pytest.raises(DiffmegError) as info:
        find_inputs([str(tmp_path / "wide.jsonl")])
    assert str(info.value) == (
        f"--input {tmp_path}/wide.jsonl is {named}, not UTF-8; convert it first, e.g. iconv -f {iconv} -t "
        f"UTF-8 {tmp_path}/wide.jsonl > {tmp_path}/wide.utf8.jsonl"
    )
    with gzip.open(tmp_path / "wide.txt.gz", "wb") as f:
        f.write("a plain text document".encode(encoding))
    with pytest.raises(DiffmegError) as info:
        find_inputs([str(tmp_path / "wide.txt.gz")])
    assert str(info.value).endswith(
        f"e.g. gzip -dc {tmp_path}/wide.txt.gz | iconv -f {iconv} -t UTF-8 > {tmp_path}/wide.utf8.txt"
    )
    (tmp_path / "ascii.jsonl").write_bytes(b'{"text": "ascii \\u0000 is escaped in JSON"}\n')
    assert pp.wide_encoding((tmp_path / "ascii.jsonl").read_bytes()) is None


@pytest.mark.parametrize("partitions,append_eod", [(1, False), (2, True)])
def test_a_corpus_of_empty_texts_is_refused_and_nothing_is_written(
    tmp_path, bpe_file, partitions, append_eod
):
    """Documents of no tokens (the text is in another field) made a dataset of nothing with rc 0."""
    path = write_jsonl(tmp_path / "c.jsonl", [{"text": "", "body": f"the text {i}"} for i in range(40)])
    with pytest.raises(DiffmegError) as info:
        run(tmp_path, [path], tokenizer_file=bpe_file, partitions=partitions, append_eod=append_eod)
    assert str(info.value) == (
        f"--input {path} holds 40 documents whose 'text' texts are all empty (0 tokens); nothing written: "
        f"check that --json-keys names the field with the text"
    )
    assert leftovers(tmp_path) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl"]
