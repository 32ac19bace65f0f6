"""Where a run's dataset indices are cached (diffmeg.data.index_cache): beside the data when it can be written
there, else a per-user cache said in one line; an unwritable --data-cache-path is refused in one line.

Root writes through file modes, so the folder is reported unwritable to the process (`deny_writes`) where the
logic is under test, and made really read-only (`read_only_view`: chmod, or a read-only bind mount as root)
where the run's behaviour is."""

from __future__ import annotations

import os

import pytest

from diffmeg.data.index_cache import (
    beside_data,
    megatron_prefixes,
    resolve_cache_path,
    user_cache,
)
from diffmeg.errors import DiffmegError
from tests.data.helpers import write_dataset


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    home = tmp_path / "home-cache"
    monkeypatch.setenv("DIFFMEG_CACHE_DIR", str(home))
    return home


@pytest.fixture
def deny_writes(monkeypatch):
    """`deny(folder)`: os.access reports `folder` and everything under it unwritable, as for a non-root user
    on a read-only share."""
    real = os.access
    denied: list[str] = []

    def access(path, mode, *args, **kwargs):
        inside = any(
            os.path.abspath(path) == d or os.path.abspath(path).startswith(d + os.sep) for d in denied
        )
        if inside and mode & os.W_OK:
            return False
        return real(path, mode, *args, **kwargs)

    monkeypatch.setattr(os, "access", access)
    return lambda folder: denied.append(os.path.abspath(folder))


def _data(folder, name="corpus"):
    folder.mkdir(parents=True, exist_ok=True)
    return write_dataset(folder / name, [[1, 2, 3, 4]] * 4)


def test_a_writable_dataset_folder_keeps_its_cache_beside_the_data(tmp_path, cache_home):
    prefix = _data(tmp_path / "data")
    assert resolve_cache_path([prefix], None) == (str(tmp_path / "data" / "cache"), None)
    other = _data(tmp_path / "elsewhere", "code")  # a blend: one folder, beside its first dataset
    assert resolve_cache_path([prefix, other], None)[0] == str(tmp_path / "data" / "cache")
    assert not (tmp_path / "data" / "cache").exists() and not cache_home.exists()  # resolving creates nothing


def test_an_unwritable_dataset_folder_uses_the_per_user_cache_and_says_so(tmp_path, cache_home, deny_writes):
    prefix = _data(tmp_path / "shared")
    deny_writes(tmp_path / "shared")
    path, note = resolve_cache_path([prefix], None)
    assert path == user_cache(prefix) and path.startswith(str(cache_home / "datasets" / "shared-"))
    assert "\n" not in note and note.startswith(f"data: {tmp_path / 'shared'} cannot be written, so the ")
    assert f"dataset index cache is {path} (--data-cache-path DIR chooses another;" in note
    assert "a multi-node run without a shared home needs one every node sees" in note


def test_a_really_read_only_folder_uses_the_per_user_cache(tmp_path, cache_home, read_only_view):
    source = tmp_path / "src"
    _data(source)
    view = read_only_view(source)
    path, note = resolve_cache_path([str(view / "corpus")], None)
    assert path == user_cache(str(view / "corpus")) and note.startswith(f"data: {view} cannot be written")


def test_per_user_caches_are_keyed_by_folder(tmp_path, cache_home):
    a, b = _data(tmp_path / "x" / "data"), _data(tmp_path / "y" / "data")  # two folders of one name
    assert user_cache(a) != user_cache(b)
    assert os.path.basename(user_cache(a)).startswith("data-")
    assert user_cache(a) == user_cache(str(tmp_path / "x" / "data" / "other"))  # one folder, one cache
    os.symlink(tmp_path / "x" / "data", tmp_path / "link")
    assert user_cache(str(tmp_path / "link" / "corpus")) == user_cache(a)  # the real folder names it


def test_megatron_core_gets_absolute_prefixes(tmp_path, monkeypatch):
    """Its md5 file names cover the dataset path: relative ones would be one name for two datasets."""
    monkeypatch.chdir(tmp_path)
    assert megatron_prefixes(["data/corpus", "/abs/code"]) == [str(tmp_path / "data" / "corpus"), "/abs/code"]


def test_an_unwritable_data_cache_path_is_one_line(tmp_path, cache_home, deny_writes):
    prefix = _data(tmp_path / "data")
    given = tmp_path / "caches"
    given.mkdir()
    deny_writes(given)
    with pytest.raises(DiffmegError) as info:
        resolve_cache_path([prefix], str(given / "run1"))
    assert str(info.value) == (
        f"--data-cache-path {given / 'run1'}: no permission to write in {given}; "
        "choose another --data-cache-path"
    )
    (tmp_path / "afile").write_text("")  # refused for root too: a file where the folder should be made
    with pytest.raises(DiffmegError, match=r"^--data-cache-path \S+/afile/c: \S+/afile is a file, so the "):
        resolve_cache_path([prefix], str(tmp_path / "afile" / "c"))
    writable = str(tmp_path / "mine")
    assert resolve_cache_path([prefix], writable) == (writable, None)
    deny_writes(tmp_path / "data")  # a given folder is used whatever the data's folder allows
    assert resolve_cache_path([prefix], writable) == (writable, None)


def test_a_really_read_only_data_cache_path_is_one_line(tmp_path, cache_home, read_only_view):
    prefix = _data(tmp_path / "data")
    (tmp_path / "shared").mkdir()
    view = read_only_view(tmp_path / "shared")
    with pytest.raises(DiffmegError) as info:
        resolve_cache_path([prefix], str(view))
    assert str(info.value).startswith(f"--data-cache-path {view}") and "\n" not in str(info.value)
    assert str(info.value).endswith("; choose another --data-cache-path")


def test_nowhere_to_write_is_one_line(tmp_path, cache_home, deny_writes):
    prefix = _data(tmp_path / "shared")
    deny_writes(tmp_path / "shared")
    deny_writes(cache_home.parent)
    with pytest.raises(DiffmegError) as info:
        resolve_cache_path([prefix], None)
    assert str(info.value) == (
        f"the dataset index cache can be written neither beside the data ({beside_data(prefix)}) nor in the "
        f"per-user cache ({user_cache(prefix)}); pass --data-cache-path DIR, a folder you can write "
        "(on storage every node sees)"
    )
