"""benchmarks/campaign/source.py: the revision travels with a tree that has no .git."""

from __future__ import annotations

import shutil
import subprocess

from benchmarks.campaign import source


def _git(root, *args):
    cmd = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false", *args]
    return subprocess.run(cmd, cwd=root, check=True, capture_output=True, text=True).stdout.strip()


def test_the_stamp_names_the_revision_where_git_is_gone(tmp_path):
    repo, carried = tmp_path / "repo", tmp_path / "repo" / ".whl"
    (repo / "pkg").mkdir(parents=True)
    (repo / "pkg" / "a.py").write_text("A = 1\n")
    (repo / "README.md").write_text("hi\n")
    _git(repo, "init", "-q")
    _git(repo, "add", "pkg/a.py", "README.md")
    _git(repo, "commit", "-q", "-m", "first")
    revision = _git(repo, "rev-parse", "HEAD")
    assert source.source_revision(repo, carried) == (revision, False, "git")

    stamp = source.write_stamp(carried, repo)
    assert stamp["git_revision"] == revision and sorted(stamp["files"]) == ["README.md", "pkg/a.py"]
    shutil.rmtree(repo / ".git")  # what the GPU machine gets: the working tree and the carried folder
    assert source.source_revision(repo, carried) == (revision, False, "stamp")
    (repo / "pkg" / "a.py").write_text("A = 2\n")  # changed after --prepare: the revision no longer names it
    assert source.source_revision(repo, carried) == (revision, True, "stamp (tree differs)")
    assert source.source_revision(repo, None) == ("unknown", None, "none")
    (carried / source.STAMP_NAME).write_text('{"git_revision": "abc"')  # truncated on the way
    assert source.source_revision(repo, carried) == (
        "unknown",
        None,
        f"none ({source.STAMP_NAME} unreadable)",
    )
    assert source.write_stamp(tmp_path / "elsewhere", repo) == {}  # no checkout: nothing stamped


def test_the_stamp_wins_over_an_older_git_under_a_newer_tree(tmp_path):
    """The first H100 run's copy carried the session's first commit's .git under the newest tree: git said
    that commit, dirty; the stamp, whose digest matches the tree, names the commit the tree is."""
    repo, carried = tmp_path / "repo", tmp_path / "repo" / ".whl"
    (repo / "pkg").mkdir(parents=True)
    (repo / "pkg" / "a.py").write_text("A = 1\n")
    _git(repo, "init", "-q")
    _git(repo, "add", "pkg/a.py")
    _git(repo, "commit", "-q", "-m", "first")
    first = _git(repo, "rev-parse", "HEAD")
    shutil.copytree(repo / ".git", tmp_path / "old-git")
    (repo / "pkg" / "a.py").write_text("A = 2\n")
    _git(repo, "commit", "-q", "-am", "second")
    second = _git(repo, "rev-parse", "HEAD")
    source.write_stamp(carried, repo)
    shutil.rmtree(repo / ".git")
    shutil.copytree(tmp_path / "old-git", repo / ".git")  # the device's copy: old .git, new tree
    assert source.source_revision(repo, carried) == (second, False, "stamp")
    (repo / "pkg" / "a.py").write_text("A = 3\n")  # a tree neither names: git's view, dirty
    assert source.source_revision(repo, carried) == (first, True, "git")
