"""A dataset's token-id range: recorded by diffmeg's writers, computed once (and cached, keyed by the .bin's
size and mtime) for data from elsewhere, and checked against a run's vocabulary in one line."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

from diffmeg.data import token_range as tr
from diffmeg.data.gpt_datasets import build_gpt_datasets
from diffmeg.data.indexed import merge_datasets
from diffmeg.data.tokenizers import (
    CL100K,
    NULL,
    TokenizerRecord,
    build_tokenizer,
    check_vocabulary,
    write_dataset_record,
)
from diffmeg.errors import DiffmegError
from tests.data.helpers import write_dataset


def foreign(prefix, docs, dtype=np.int32) -> str:
    """A dataset as Megatron-LM's own tools write it: megatron-core's builder, no diffmeg files beside it."""
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for doc in docs:
        builder.add_document(np.asarray(doc, dtype=dtype), [len(doc)])
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


@pytest.fixture
def no_scan(monkeypatch):
    """Fail any scan of a .bin: the range must come from a record or a cache."""

    def scan(prefix, chunk_tokens=tr.CHUNK_TOKENS, part=(0, 1)):
        raise AssertionError(f"{prefix}.bin scanned again")

    monkeypatch.setattr(tr, "scan_range", scan)


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("DIFFMEG_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(tr, "_IN_MEMORY", {})
    return tmp_path / "cache"


def test_the_writer_records_the_range_of_what_it_wrote(tmp_path, no_scan):
    prefix = write_dataset(tmp_path / "d", [[7, 3, 900], [], [42]])
    record = json.loads((tmp_path / "d.ids.json").read_text())
    assert (record["min_id"], record["max_id"]) == (3, 900)
    assert record["bin_bytes"] == os.path.getsize(f"{prefix}.bin")
    assert tr.token_range(prefix) == (3, 900)
    merged = merge_datasets([prefix, write_dataset(tmp_path / "e", [[1000, 5]])], str(tmp_path / "m"))
    assert merged.ids == (3, 1000) and tr.token_range(str(tmp_path / "m")) == (3, 1000)


def test_data_from_elsewhere_is_scanned_once_then_read_from_its_cache(tmp_path, monkeypatch):
    prefix = foreign(tmp_path / "mlm", [[5, 6, 100276], [9]])
    assert not (tmp_path / "mlm.ids.json").exists()
    scans = []
    real_scan = tr.scan_range
    monkeypatch.setattr(tr, "scan_range", lambda p, part=(0, 1): scans.append(p) or real_scan(p, 2, part))
    assert tr.token_range(prefix) == (5, 100276) and len(scans) == 1  # chunks of 2 tokens: 3 chunks
    assert json.loads((tmp_path / "mlm.ids.json").read_text())["max_id"] == 100276
    monkeypatch.setattr(tr, "_IN_MEMORY", {})  # a new process: the file beside the data answers
    assert tr.token_range(prefix) == (5, 100276) and len(scans) == 1

    foreign(tmp_path / "mlm", [[5, 6, 7], [9]])  # the file changed (size and mtime): scanned again
    assert tr.token_range(prefix) == (5, 9) and len(scans) == 2


def test_a_read_only_data_folder_caches_in_the_cache_dir(tmp_path, monkeypatch, cache_dir):
    prefix = foreign(tmp_path / "ro", [[1, 2, 3]])
    monkeypatch.setattr(tr, "RANGE_SUFFIX", ".bin/ids.json")  # unwritable beside the data (ro.bin is a file)
    assert tr.token_range(prefix) == (1, 3)
    (entry,) = (cache_dir / "token_ranges").iterdir()
    assert json.loads(entry.read_text())["max_id"] == 3
    monkeypatch.setattr(tr, "_IN_MEMORY", {})
    monkeypatch.setattr(tr, "scan_range", lambda *a, **k: pytest.fail("scanned again"))
    assert tr.token_range(prefix) == (1, 3)


def test_ids_above_the_vocabulary_are_one_line(tmp_path):
    ok = write_dataset(tmp_path / "ok", [[1, 2, 1023]])
    big = write_dataset(tmp_path / "big", [[1, 100257, 5]])
    write_dataset_record(big, TokenizerRecord(CL100K))
    check_vocabulary([ok], 1024)
    with pytest.raises(DiffmegError) as info:
        check_vocabulary([ok, big], 1024)
    message = str(info.value)
    assert "\n" not in message, message
    assert message.startswith(
        f"dataset {big} holds token ids up to 100257, but this run's vocabulary has 1024 "
    )
    assert "--tokenizer-type cl100k_base" in message and "--vocab-size above 100257" in message
    with pytest.raises(DiffmegError, match=f"dataset {ok} holds the negative token id -1"):
        check_vocabulary([write_dataset(tmp_path / "ok", [[-1, 4]])], 1024)


def test_the_dataset_builder_checks_every_prefix_of_a_blend(tmp_path, gloo):
    a = write_dataset(tmp_path / "a", [[3] * 50] * 40)
    b = foreign(tmp_path / "b", [[3] * 49 + [2000]] * 40)
    blend, args = ["0.5", a, "0.5", b], ("1,0,0", 16, 1, (8, 0, 0), build_tokenizer(NULL, vocab_size=2048))
    refusal = rf"^dataset {b} holds token ids up to 2000, .* has 1024 \(ids 0\.\.1023\)"
    with pytest.raises(DiffmegError, match=refusal):
        build_gpt_datasets(blend, *args, str(tmp_path / "c"), vocab_size=1024)
    train, _, _ = build_gpt_datasets(blend, *args, str(tmp_path / "c"), vocab_size=2048)
    assert len(train) >= 8


def _extremes_everywhere(tmp_path) -> str:
    """A dataset from elsewhere of 61 tokens (uneven over 2 and 3 parts) whose smallest and largest ids
    sit in each part: every part's own range differs, so a lost part changes the combined one."""
    ids = np.arange(1000, 1061)
    ids[[0, 20, 40]] = [7, 8, 9]
    ids[[19, 39, 60]] = [5000, 5001, 5002]
    return foreign(tmp_path / "parts", [ids[:30].tolist(), ids[30:].tolist()])


@pytest.mark.parametrize("parts", [2, 3])
def test_the_parts_of_a_split_scan_make_the_whole(tmp_path, parts):
    prefix = _extremes_everywhere(tmp_path)
    whole = tr.scan_range(prefix, chunk_tokens=4)
    assert whole == (7, 5002)
    ranges = [tr.scan_range(prefix, chunk_tokens=4, part=(i, parts)) for i in range(parts)]
    assert len(set(ranges)) == parts  # each part has its own extremes
    combined = None
    for ids in ranges:
        combined = tr.combine(combined, ids)
    assert combined == whole


def _split_scan_worker(rank: int, port: int, prefix: str, cache: str, results: str) -> None:
    import torch.distributed as dist

    os.environ["DIFFMEG_CACHE_DIR"] = os.path.join(cache, "home")
    tr.RANGE_SUFFIX = ".bin/ids.json"  # the data folder is read-only (parts.bin is a file)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=3)
    try:
        parts = []
        real_scan = tr.scan_range
        tr.scan_range = lambda p, chunk_tokens=4, part=(0, 1): parts.append(part) or real_scan(p, 4, part)
        if rank == 1:  # one rank already holds it: all must still scan together, none may wait alone
            tr._IN_MEMORY[tr._memory_key(prefix)] = (7, 5002)
        first = tr.token_range(prefix, cache_dir=os.path.join(cache, "job"), collective=True)
        tr._IN_MEMORY.clear()  # the next job: the record under the job's cache answers every rank
        second = tr.token_range(prefix, cache_dir=os.path.join(cache, "job"), collective=True)
        with open(os.path.join(results, f"{rank}.json"), "w") as f:
            json.dump({"first": first, "second": second, "parts": parts}, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_three_ranks_split_the_scan_and_keep_one_record_under_the_data_cache_path(tmp_path):
    import torch.multiprocessing as mp

    from tests.conftest import free_port

    prefix = _extremes_everywhere(tmp_path)
    results = tmp_path / "results"
    results.mkdir()
    mp.spawn(_split_scan_worker, args=(free_port(), prefix, str(tmp_path), str(results)), nprocs=3)
    seen = [json.loads((results / f"{rank}.json").read_text()) for rank in range(3)]
    for rank, got in enumerate(seen):
        assert tuple(got["first"]) == tuple(got["second"]) == (7, 5002)
        assert got["parts"] == [[rank, 3]]  # one share each, and nothing read by the second job
    (entry,) = (tmp_path / "job" / "token_ranges").iterdir()
    assert json.loads(entry.read_text())["max_id"] == 5002
    assert not (tmp_path / "home").exists()  # the job's cache, not one node's home
