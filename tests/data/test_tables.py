"""Tables as preprocessing inputs (diffmeg/data/tables.py): Parquet, Arrow files and save_to_disk folders
give the same datasets, byte for byte, as the same texts in JSON lines, read a row group at a time."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from diffmeg.data import preprocess as pp
from diffmeg.data import tables
from diffmeg.data.indexed import merge_datasets
from diffmeg.data.preprocess import PreprocessConfig, find_inputs, preprocess
from diffmeg.errors import DiffmegError
from tests.data.helpers import leftovers, write_jsonl

pa = pytest.importorskip("pyarrow", reason="pyarrow not installed (pip install 'diffmeg[tables]')")
pq = pytest.importorskip("pyarrow.parquet")

TEXTS = [
    "Hello world.",
    "",
    "naïve café — 日本語 🙂 <|endoftext|>",
    *(f"document {i}: " + "lorem ipsum " * (i % 23) for i in range(120)),
]
TITLES = [f"title {i}" for i in range(len(TEXTS))]


def run(tmp_path: Path, inputs, name: str, **kwargs):
    kwargs.setdefault("log_interval", 0)
    cfg = PreprocessConfig(inputs=[str(p) for p in inputs], output_prefix=str(tmp_path / name), **kwargs)
    return preprocess(cfg, log=lambda line: None)


def outputs(tmp_path: Path, name: str, keys=("text",)) -> dict[str, bytes]:
    """The bytes of every file a run wrote for ``name``."""
    return {
        f"{key}{suffix}": (tmp_path / f"{name}_{key}_document{suffix}").read_bytes()
        for key in keys
        for suffix in (".bin", ".idx", ".tokenizer.json")  # .ids.json records the .bin's mtime
    }


def write_parquet(path: Path, texts: list, row_group_size: int, **columns) -> Path:
    pq.write_table(pa.table({"text": texts, **columns}), path, row_group_size=row_group_size)
    return path


@pytest.fixture
def reference(tmp_path, bpe_file):
    """The JSONL run of TEXTS/TITLES: the bytes every table input must reproduce."""
    jsonl = write_jsonl(
        tmp_path / "ref.jsonl", [{"text": t, "title": s} for t, s in zip(TEXTS, TITLES, strict=True)]
    )
    run(tmp_path, [jsonl], "ref", json_keys=["text", "title"], append_eod=True, tokenizer_file=bpe_file)
    return outputs(tmp_path, "ref", ("text", "title"))


@pytest.mark.parametrize("workers,partitions", [(1, 1), (3, 1), (2, 2), (3, 3)])
def test_parquet_row_groups_give_the_jsonl_bytes(
    tmp_path, bpe_file, reference, monkeypatch, workers, partitions
):
    monkeypatch.setattr(pp, "BATCH_BYTES", 300)  # several batches in each row group
    shard = write_parquet(
        tmp_path / "fineweb-000.parquet", TEXTS, 17, title=TITLES, id=list(range(len(TEXTS)))
    )
    assert pq.ParquetFile(shard).metadata.num_row_groups == 8
    result = run(
        tmp_path,
        [shard],
        "pq",
        json_keys=["text", "title"],
        append_eod=True,
        workers=workers,
        partitions=partitions,
        tokenizer_file=bpe_file,
    )
    assert (result.documents, result.skipped) == (len(TEXTS), 0)
    assert outputs(tmp_path, "pq", ("text", "title")) == reference
    assert [n for n in leftovers(tmp_path) if n.startswith("pq")] == sorted(
        f"pq_{k}_document.{e}" for k in ("text", "title") for e in ("bin", "idx")
    )


def test_a_glob_of_parquet_shards_and_ranks_keep_the_order(tmp_path, bpe_file, reference):
    for i, cut in enumerate(range(0, len(TEXTS), 50)):
        write_parquet(
            tmp_path / f"shard-{i:03d}.parquet", TEXTS[cut : cut + 50], 9, title=TITLES[cut : cut + 50]
        )
    kwargs = dict(json_keys=["text", "title"], append_eod=True, tokenizer_file=bpe_file, log_interval=0)
    run(tmp_path, [tmp_path / "shard-*.parquet"], "glob", **kwargs)
    assert outputs(tmp_path, "glob", ("text", "title")) == reference
    cfg = PreprocessConfig(
        inputs=[str(tmp_path / "shard-*.parquet")], output_prefix=str(tmp_path / "r"), **kwargs
    )
    shards = [preprocess(cfg, rank, 3, log=lambda line: None).outputs["text"] for rank in range(3)]
    merge_datasets(shards, str(tmp_path / "merged_text_document"))
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"merged_text_document{suffix}").read_bytes() == reference[f"text{suffix}"]


def test_save_to_disk_folder_and_arrow_files_give_the_jsonl_bytes(tmp_path, bpe_file, reference):
    datasets = pytest.importorskip("datasets")
    saved = tmp_path / "saved"
    datasets.Dataset.from_dict({"title": TITLES, "text": TEXTS}).save_to_disk(str(saved), num_shards=3)
    files = tables.saved_dataset_files(str(saved))
    assert [Path(f).name for f in files] == [f"data-0000{i}-of-00003.arrow" for i in range(3)]
    kwargs = dict(json_keys=["text", "title"], append_eod=True, tokenizer_file=bpe_file)
    run(tmp_path, [saved], "from_saved", workers=2, partitions=2, **kwargs)
    assert outputs(tmp_path, "from_saved", ("text", "title")) == reference

    table = pa.table({"text": TEXTS, "title": TITLES})
    with pa.OSFile(str(tmp_path / "file.arrow"), "wb") as sink:  # the IPC file format (Feather v2)
        with pa.ipc.new_file(sink, table.schema) as writer:
            for batch in table.to_batches(max_chunksize=31):
                writer.write_batch(batch)
    run(tmp_path, [tmp_path / "file.arrow"], "arrow", workers=2, partitions=2, **kwargs)
    assert outputs(tmp_path, "arrow", ("text", "title")) == reference


def test_a_dataset_dict_and_a_folder_are_named_with_what_to_pass(tmp_path):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"text": ["a"]})
    datasets.DatasetDict({"train": ds, "validation": ds}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DiffmegError) as info:
        find_inputs([str(tmp_path / "dd")])
    assert str(info.value) == (
        f"--input {tmp_path}/dd is a DatasetDict (splits: train, validation); pass one split's folder, e.g. "
        f"--input {tmp_path}/dd/train"
    )
    assert find_inputs([str(tmp_path / "dd" / "train")])[0].kind == "table"
    (tmp_path / "shards").mkdir()
    for i in range(3):
        write_parquet(tmp_path / "shards" / f"s{i}.parquet", ["x"], 1)
    with pytest.raises(DiffmegError) as info:
        find_inputs([str(tmp_path / "shards")])
    assert str(info.value) == (
        f"--input {tmp_path}/shards is a folder of 3 .parquet files; pass a glob such as "
        f"'{tmp_path}/shards/*.parquet'"
    )
    (tmp_path / "nothing").mkdir()
    with pytest.raises(
        DiffmegError, match=r"nothing is a folder holding no input file; pass files or a glob"
    ):
        find_inputs([str(tmp_path / "nothing")])


def test_a_missing_column_names_the_columns_there_are(tmp_path, bpe_file):
    shard = write_parquet(tmp_path / "s.parquet", ["a", "b"], 1, url=["u1", "u2"])
    with pytest.raises(DiffmegError) as info:
        run(tmp_path, [shard], "out", json_keys=["content"], tokenizer_file=bpe_file)
    assert str(info.value) == (
        f"--input {shard} has no column 'content' (its columns: text, url); pass --json-keys with the column "
        f"that holds the text"
    )
    assert leftovers(tmp_path) == []


def test_a_null_or_non_string_row_is_a_bad_row(tmp_path, bpe_file, tokenizer):
    texts = ["one", "two", None, "four", "five", None]
    shard = write_parquet(tmp_path / "s.parquet", texts, 2)
    for workers, partitions in ((1, 1), (2, 2)):
        with pytest.raises(DiffmegError) as info:
            run(tmp_path, [shard], "out", tokenizer_file=bpe_file, workers=workers, partitions=partitions)
        assert str(info.value) == (
            f"{shard}: row group 1, row 0 (counted from 0): column 'text' is null; fix it or pass "
            "--skip-bad-lines"
        )
        assert leftovers(tmp_path) == []
    result = run(tmp_path, [shard], "out", tokenizer_file=bpe_file, skip_bad_lines=True)
    assert (result.documents, result.skipped) == (4, 2)
    numbers = write_parquet(tmp_path / "n.parquet", ["a"], 1, body=[7])
    with pytest.raises(
        DiffmegError, match=r"row group 0, row 0 \(counted from 0\): column 'body' is int, not a"
    ):
        run(tmp_path, [numbers], "num", json_keys=["body"], tokenizer_file=bpe_file)


def test_a_damaged_parquet_file_is_one_line_naming_the_file_and_row_group(tmp_path, bpe_file):
    good = [f"row {i} " * 5 for i in range(30)]
    shard = tmp_path / "s.parquet"
    pq.write_table(
        pa.table({"text": good}), shard, row_group_size=10, use_dictionary=False, compression="NONE"
    )
    data = bytearray(shard.read_bytes())
    offset = pq.ParquetFile(shard).metadata.row_group(1).column(0).data_page_offset
    data[offset : offset + 16] = b"\xff" * 16  # row group 1's page header
    damaged = tmp_path / "damaged.parquet"
    damaged.write_bytes(bytes(data))
    with pytest.raises(DiffmegError) as info:
        run(tmp_path, [damaged], "out", tokenizer_file=bpe_file)
    message = str(info.value)
    assert message.startswith(f"{damaged}: row group 1 cannot be read (") and "\n" not in message, message
    assert message.endswith("the file is damaged: download or copy it again")
    assert leftovers(tmp_path) == []
    cut = tmp_path / "cut.parquet"
    cut.write_bytes(bytes(data[: len(data) // 2]))
    with pytest.raises(
        DiffmegError, match=rf"^--input {cut} cannot be read as Parquet: its footer is damaged"
    ):
        run(tmp_path, [cut], "out", tokenizer_file=bpe_file)


def test_a_cut_arrow_stream_names_the_record_batch(tmp_path):
    table = pa.table({"text": [f"t{i}" * 50 for i in range(40)]})
    path = tmp_path / "data-00000-of-00001.arrow"
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=10):
            writer.write_batch(batch)
    layout = tables.read_layout(str(path))
    assert (layout.format, layout.rows) == ("arrow-stream", (10, 10, 10, 10))
    path.write_bytes(path.read_bytes()[: layout.bounds[2] + 200])
    with pytest.raises(DiffmegError, match=rf"^--input {path}: record batch \d cannot be read as Arrow \("):
        tables.read_layout(str(path))


def _cache_as_hub_dataset(cache: Path, repo: str, parquet: Path) -> None:
    """Put `parquet` in the `datasets` cache folder `cache` as the prepared train split of the Hub dataset
    `repo`, as `load_dataset(repo)` leaves it on a node with network (none here to download it)."""
    from datasets.packaged_modules.parquet.parquet import Parquet

    builder = Parquet(
        cache_dir=str(cache), data_files={"train": str(parquet)}, dataset_name=repo.split("/")[1]
    )
    builder.download_and_prepare()
    target = cache / repo.replace("/", "___") / "default" / "0.0.0" / "local"
    target.parent.mkdir(parents=True)
    shutil.move(builder.cache_dir, target)


def test_hf_dataset_from_the_local_cache_offline(tmp_path, bpe_file, reference, monkeypatch):
    """hf:NAME reads the cached split's Arrow files; tests/tools/test_preprocess_data.py: one not cached."""
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    before = (datasets.config.HF_HUB_OFFLINE, os.environ.get("HF_HUB_OFFLINE"))
    write_parquet(tmp_path / "rows.parquet", TEXTS, 50, title=TITLES)
    _cache_as_hub_dataset(tmp_path / "cache", "someone/tiny", tmp_path / "rows.parquet")
    run(
        tmp_path,
        ["hf:someone/tiny"],
        "hf",
        json_keys=["text", "title"],
        append_eod=True,
        tokenizer_file=bpe_file,
    )
    assert outputs(tmp_path, "hf", ("text", "title")) == reference
    with pytest.raises(DiffmegError) as info:
        find_inputs(["hf:someone/tiny:test"])
    assert (
        str(info.value)
        == """--input hf:someone/tiny:test: Unknown split "test". Should be one of ['train']."""
    )
    assert (
        datasets.config.HF_HUB_OFFLINE,
        os.environ.get("HF_HUB_OFFLINE"),
    ) == before  # offline for the call


def test_hf_names_are_parsed():
    assert tables.parse_hf("hf:HuggingFaceFW/fineweb") == ("HuggingFaceFW/fineweb", None, "train")
    assert tables.parse_hf("hf:user/name:test") == ("user/name", None, "test")
    assert tables.parse_hf("hf:user/name:sample-10BT:train") == ("user/name", "sample-10BT", "train")
    with pytest.raises(DiffmegError, match="expected hf:NAME, hf:NAME:SPLIT or hf:NAME:CONFIG:SPLIT"):
        tables.parse_hf("hf:name:")
