from __future__ import annotations

import json
import logging
import os

import numpy as np
import pytest

from diffmeg.data.gpt_datasets import build_gpt_datasets, epoch_note, parse_data_path
from diffmeg.data.indexed import IndexedWriter
from diffmeg.data.tokenizers import NULL, build_tokenizer
from diffmeg.errors import DiffmegError
from tests.data.helpers import write_dataset


def make_dataset(prefix, n_docs: int, token: int, length: int = 50) -> str:
    """n_docs documents of ``length`` copies of ``token`` (so a sample's source is recognisable)."""
    with IndexedWriter(str(prefix)) as w:
        for _ in range(n_docs):
            w.add_document(np.full(length, token, dtype=np.int32))
        w.commit()
    return str(prefix)


@pytest.fixture(scope="module")
def two_prefixes(tmp_path_factory):
    d = tmp_path_factory.mktemp("blend")
    return make_dataset(d / "a", 400, token=11), make_dataset(d / "b", 300, token=22)


def test_parse_data_path(two_prefixes):
    a, b = two_prefixes
    assert parse_data_path([a]) == ([a], None)
    assert parse_data_path(["0.3", a, "7", b]) == ([a, b], [0.3, 7.0])
    assert parse_data_path(["builtin"]) == (["builtin"], None)  # built on first use


@pytest.mark.parametrize(
    "values,match",
    [
        ([], "empty"),
        (["0.3", "A", "0.7"], "has 3 values"),
        (["A", "B"], "weight 'A' is not a number"),
        (["-1", "A"], "must be > 0"),
        (["0", "A"], "must be > 0"),
        (["nan", "A"], "must be > 0"),
    ],
)
def test_parse_data_path_errors(values, match):
    with pytest.raises(DiffmegError, match=match):
        parse_data_path(values)


def test_parse_data_path_missing_files(two_prefixes, tmp_path):
    a, _ = two_prefixes
    with pytest.raises(DiffmegError, match=r"missing .*nope\.bin and .*nope\.idx"):
        parse_data_path([str(tmp_path / "nope")])
    with pytest.raises(DiffmegError, match="without the extension"):
        parse_data_path([a + ".bin"])
    (tmp_path / "half.idx").write_bytes(b"")
    with pytest.raises(DiffmegError, match=r"missing \S*half\.bin$"):
        parse_data_path(["1", a, "1", str(tmp_path / "half")])


def test_blend_draws_in_proportion_to_weights(gloo, tokenizer, two_prefixes, tmp_path):
    a, b = two_prefixes
    train, valid, test = build_gpt_datasets(
        ["0.25", a, "0.75", b], "90,8,2", 32, 1234, (2000, 200, 50), tokenizer, str(tmp_path / "cache")
    )
    for dataset, size in ((train, 2000), (valid, 200), (test, 50)):
        counts = np.bincount(np.asarray(dataset.dataset_index), minlength=2)
        assert counts.sum() == len(dataset) >= size
        assert abs(counts[0] - 0.25 * len(dataset)) <= 1 and abs(counts[1] - 0.75 * len(dataset)) <= 1
    for i in range(0, 200, 7):  # each sample really comes from the dataset the index names
        sample = train[i]
        token = 11 if int(sample["dataset_id"]) == 0 else 22
        assert set(sample["tokens"].tolist()) <= {token} and sample["tokens"].shape == (32,)


def test_order_is_deterministic_and_seeded(gloo, tokenizer, two_prefixes, tmp_path):
    a, _ = two_prefixes
    args = ([a], "98,1,1", 16)
    first, _, _ = build_gpt_datasets(*args, 7, (500, 10, 10), tokenizer, str(tmp_path / "c1"))
    again, _, _ = build_gpt_datasets(*args, 7, (500, 10, 10), tokenizer, str(tmp_path / "c2"))
    other, _, _ = build_gpt_datasets(*args, 8, (500, 10, 10), tokenizer, str(tmp_path / "c3"))
    order = lambda ds: [int(ds.shuffle_index[i]) for i in range(len(ds))]  # noqa: E731
    assert order(first) == order(again) and order(first) != order(other)
    for k in (0, 123, 499):  # resuming at consumed sample k reads the same sample
        assert first[k]["tokens"].tolist() == again[k]["tokens"].tolist()


def test_zero_document_split_fails_instead_of_hanging(gloo, tokenizer, tmp_path):
    small = make_dataset(tmp_path / "small", 3, token=5)
    with pytest.raises(DiffmegError, match=r"the valid split of \S*small no documents .*'969,0,0'"):
        build_gpt_datasets([small], "969,30,1", 8, 1, (10, 10, 10), tokenizer, str(tmp_path / "c"))
    train, valid, test = build_gpt_datasets(
        [small], "1,0,0", 8, 1, (10, 0, 0), tokenizer, str(tmp_path / "c")
    )
    assert len(train) >= 10 and valid is None and test is None


@pytest.mark.parametrize("asked, noted", [(124, False), (125, True), (126, False), (248, False)])
def test_a_train_split_exceeded_by_a_sliver_is_noted(tmp_path, gloo, asked, noted):
    prefix = write_dataset(tmp_path / "d", [[3] * 50] * 40)  # 2000 tokens: 124 samples of 16 (+1) an epoch
    tokenizer = build_tokenizer(NULL, vocab_size=64)
    train, _, _ = build_gpt_datasets([prefix], "1,0,0", 16, 1, (asked, 0, 0), tokenizer, str(tmp_path / "c"))
    note = epoch_note(train, train_iters=asked)  # one sample per iteration
    if not noted:
        assert note is None
        return
    assert note == (
        f"note: {prefix}'s train split holds 124 samples and the run asks {asked}: 2 epochs are indexed for "
        f"{100 * (asked / 124 - 1):.2f}% more; --train-iters 124 stays in one epoch"
    )


def _megatron_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith("megatron.core")]


def test_a_blend_caches_its_indices_beside_the_data_without_a_word(
    gloo, tmp_path, caplog, capfd, monkeypatch
):
    """With no --data-cache-path a blend's indices, its BlendedDataset's included, go to cache/ beside the
    first dataset, and megatron-core says nothing (it warned 'Cannot save the BlendedDataset indexes because
    path_to_cache is None' for every split of every blended run)."""
    from diffmeg.data.tiktoken_cl100k import IdTokenizer

    monkeypatch.setenv("DIFFMEG_CACHE_DIR", str(tmp_path / "home"))
    (tmp_path / "data").mkdir()
    a, b = (
        make_dataset(tmp_path / "data" / "a", 40, token=11),
        make_dataset(tmp_path / "data" / "b", 30, token=22),
    )
    tokenizer = IdTokenizer(64)
    caplog.set_level(logging.WARNING)
    first = build_gpt_datasets(["1", a, "3", b], "90,8,2", 16, 3, (200, 20, 5), tokenizer, None)
    assert _megatron_lines(caplog) == [] and capfd.readouterr().err == ""
    cached = sorted(p.name.split("-", 1)[1] for p in (tmp_path / "data" / "cache").iterdir())
    for split in ("train", "valid", "test"):
        assert f"BlendedDataset-{split}-dataset_index.npy" in cached
        assert cached.count(f"GPTDataset-{split}-shuffle_index.npy") == 2  # one per dataset
    assert not (tmp_path / "home").exists()
    build_gpt_datasets(["1", a], "90,8,2", 16, 3, (200, 20, 5), tokenizer, None)  # a weighted single dataset
    assert _megatron_lines(caplog) == [] and capfd.readouterr().err == ""
    again = build_gpt_datasets(
        ["1", a, "3", b], "90,8,2", 16, 3, (200, 20, 5), tokenizer, None
    )  # a cache hit
    assert [first[0][k]["tokens"].tolist() for k in range(0, 200, 9)] == [
        again[0][k]["tokens"].tolist() for k in range(0, 200, 9)
    ]


def test_a_read_only_dataset_folder_uses_the_per_user_cache(
    gloo, tmp_path, capfd, caplog, monkeypatch, read_only_view
):
    """The cluster case: before, 45 lines of megatron-core ending 'Failed to write dataset materials to the
    data cache directory'; now the run uses the per-user cache and says so in one line."""
    from diffmeg.data.index_cache import user_cache
    from diffmeg.data.tiktoken_cl100k import IdTokenizer

    monkeypatch.setenv("DIFFMEG_CACHE_DIR", str(tmp_path / "home"))
    (tmp_path / "shared").mkdir()
    make_dataset(tmp_path / "shared" / "a", 40, token=11)
    make_dataset(tmp_path / "shared" / "b", 30, token=22)
    view = read_only_view(tmp_path / "shared")
    a, b = str(view / "a"), str(view / "b")
    caplog.set_level(logging.WARNING)
    train, _, _ = build_gpt_datasets(["1", a, "1", b], "1,0,0", 16, 3, (100, 0, 0), IdTokenizer(64), None)
    assert len(train) >= 100 and _megatron_lines(caplog) == []
    cache = user_cache(a)
    (line,) = capfd.readouterr().err.splitlines()
    assert line.startswith(f"data: {view} cannot be written, so the dataset index cache is {cache} ")
    assert any(name.endswith("BlendedDataset-train-dataset_index.npy") for name in os.listdir(cache))
    assert sorted(os.listdir(view)) == sorted(os.listdir(tmp_path / "shared"))  # nothing written there


def _rank_worker(rank: int, world: int, port: int, folder: str) -> None:
    """One rank of `test_every_rank_uses_the_folder_rank_0_resolved`: its own per-user cache (as on nodes
    whose homes differ) and the data folder reported unwritable; writes the samples it reads."""
    import torch.distributed as dist

    from diffmeg.data.tiktoken_cl100k import IdTokenizer

    os.environ["DIFFMEG_CACHE_DIR"] = os.path.join(folder, f"home{rank}")
    data, real_access = os.path.join(folder, "shared"), os.access
    os.access = lambda path, mode, *a, **k: (  # noqa: E731
        False
        if mode & os.W_OK and os.path.abspath(path).startswith(data)
        else real_access(path, mode, *a, **k)
    )
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=world, rank=rank)
    try:
        blend = ["1", os.path.join(data, "a"), "1", os.path.join(data, "b")]
        train, _, _ = build_gpt_datasets(blend, "1,0,0", 16, 3, (100, 0, 0), IdTokenizer(64), None)
        samples = [train[k]["tokens"].tolist() for k in range(0, 100, 7)]
        with open(os.path.join(folder, f"rank{rank}.json"), "w") as f:
            json.dump(samples, f)
    finally:
        dist.destroy_process_group()


def test_every_rank_uses_the_folder_rank_0_resolved(tmp_path):
    """megatron-core builds the indices on rank 0 and the others read them, so the folder is rank 0's answer
    on every rank: rank 1, whose own per-user cache is elsewhere, reads rank 0's and never writes its own."""
    import torch.multiprocessing as mp

    from tests.conftest import free_port

    (tmp_path / "shared").mkdir()
    make_dataset(tmp_path / "shared" / "a", 40, token=11)
    make_dataset(tmp_path / "shared" / "b", 30, token=22)
    mp.start_processes(_rank_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, start_method="spawn")
    assert (tmp_path / "home0" / "datasets").is_dir() and not (tmp_path / "home1").exists()
    assert not (tmp_path / "shared" / "cache").exists()
    samples = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert samples[0] == samples[1] and len(samples[0]) == 15
