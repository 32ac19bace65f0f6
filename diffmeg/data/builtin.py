"""The default corpus (``--data-path builtin``): real English text that every Python install has.

Generated, never committed: the ``pydoc_data`` help topics (the text of ``help("if")`` etc.) and
the docstrings of the standard library's modules, classes and functions, read with ``ast`` (no
module is imported, so nothing runs). About 2 MB of text, 500K tokens, several thousand
documents, in a fixed order: topics sorted by name, then source files sorted by path with their
definitions in source order.

It is written as JSONL and tokenized with ``--append-eod`` into
``$DIFFMEG_CACHE_DIR/builtin/<key>/builtin_text_document`` (``~/.cache/diffmeg`` by default),
where ``<key>`` hashes this generator's version, the tokenizer (cl100k_base, or a Hugging Face
tokenizer's vocabulary: a run with ``--tokenizer-type HuggingFaceTokenizer`` gets the corpus in its ids)
and the bytes of every source file
it reads: another Python version gets its own cache entry and an unchanged one is reused. Builds
are serialised with a file lock, and under torch.distributed rank 0 builds before the others look.
"""

from __future__ import annotations

import ast
import fcntl
import hashlib
import importlib.util
import json
import os
import sysconfig
from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist

from diffmeg.data.hf_tokenizer import HF_TOKENIZER, HFTokenizer
from diffmeg.data.indexed import exists
from diffmeg.data.preprocess import PreprocessConfig, output_prefix, preprocess
from diffmeg.errors import DiffmegError, stderr
from diffmeg.storage import atomic_write, default_cache_dir

GENERATOR_VERSION = 1
_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "encodings"}
"""Tests are code, not prose; encodings/ is a hundred copies of one generated docstring."""
_MIN_BYTES = 200_000
BUILD_CPU_SECONDS = 5
"""About how long a first build takes on one idle core (measured: 5.0 s of CPU time with Python 3.11's
standard library, 2.6 MB of text; the wall time grows with the machine's load)."""


def _topics_file() -> str | None:
    try:
        spec = importlib.util.find_spec("pydoc_data.topics")
    except ImportError:
        return None
    return spec.origin if spec is not None and spec.origin and os.path.isfile(spec.origin) else None


def _stdlib_files() -> list[tuple[str, str]]:
    """(relative path, absolute path) of the standard library's .py files, sorted."""
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in _SKIP_DIRS)
        for name in sorted(names):
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                files.append((os.path.relpath(path, root), path))
    return sorted(files)


def corpus_key(tokenizer_id: str = "cl100k_base") -> str:
    """Hash of everything the corpus is made from: generator version, tokenizer, source bytes."""
    digest = hashlib.sha256(f"diffmeg-builtin-v{GENERATOR_VERSION}\0{tokenizer_id}\0".encode())
    topics = _topics_file()
    for rel, path in ([("pydoc_data/topics.py", topics)] if topics else []) + _stdlib_files():
        digest.update(rel.encode() + b"\0")
        with open(path, "rb") as f:
            digest.update(hashlib.sha256(f.read()).digest())
    return digest.hexdigest()


def iter_documents() -> Iterator[str]:
    """The corpus, one document at a time, in its fixed order."""
    if _topics_file():
        from pydoc_data.topics import topics  # large, and absent from some installs (_topics_file)

        for name in sorted(topics):
            if topics[name].strip():
                yield topics[name].strip()
    for rel, path in _stdlib_files():
        module = rel[:-3].replace(os.sep, ".").removesuffix(".__init__")
        yield from _module_documents(module, path)


def _module_documents(module: str, path: str) -> Iterator[str]:
    """The module docstring, then one document per top-level class (with its methods) or function."""
    try:
        with open(path, "rb") as f:
            tree = ast.parse(f.read(), filename=path)
    except (SyntaxError, ValueError, OSError):
        return  # e.g. files written for another Python version
    doc = ast.get_docstring(tree)
    if doc:
        yield f"Module {module}\n\n{doc}"
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            parts = [_section(f"{module}.{node.name}", ast.get_docstring(node))]
            for child in node.body:
                if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                    parts.append(_section(f"{module}.{node.name}.{child.name}", ast.get_docstring(child)))
            text = "\n\n".join(p for p in parts if p)
            if text:
                yield text
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            text = _section(f"{module}.{node.name}", ast.get_docstring(node))
            if text:
                yield text


def _section(title: str, doc: str | None) -> str:
    return f"{title}\n\n{doc}" if doc and doc.strip() else ""


def write_jsonl(path: str) -> tuple[int, int]:
    """Write the corpus as JSONL (``{"text": ...}`` per line) atomically; returns (documents, bytes)."""
    docs = size = 0
    with atomic_write(path, encoding="utf-8") as f:
        for text in iter_documents():
            f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
            docs += 1
            size += len(text.encode("utf-8"))
        if size < _MIN_BYTES:
            raise DiffmegError(
                f"this Python install has only {size} bytes of documentation text (no stdlib sources or "
                "pydoc_data?); preprocess your own data with tools/preprocess_data.py and pass --data-path"
            )
    return docs, size


@contextmanager
def _locked(path: str) -> Iterator[None]:
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _entry_dir(cache_dir: str | None, tokenizer_id: str) -> str:
    return os.path.join(cache_dir or default_cache_dir(), "builtin", corpus_key(tokenizer_id)[:20])


def builtin_jsonl(cache_dir: str | None = None) -> str:
    """Path of the corpus as JSONL (generated on first use), e.g. as benchmark input."""
    directory = _entry_dir(cache_dir, "cl100k_base")
    path = os.path.join(directory, "builtin.jsonl")
    if not os.path.isfile(path):
        os.makedirs(directory, exist_ok=True)
        with _locked(directory + ".lock"):
            if not os.path.isfile(path):
                write_jsonl(path)
    return path


def builtin_corpus(tokenizer=None, cache_dir: str | None = None) -> str:
    """Prefix of the tokenized builtin corpus, building and caching it on first use.

    With torch.distributed initialised, rank 0 builds first and the others follow after a barrier
    (a cache hit on shared storage; on node-local storage one rank per node builds, under the lock).
    """
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        prefix, error = None, None
        if dist.get_rank() == 0:
            try:
                prefix = _get_or_build(tokenizer, cache_dir)
            except BaseException as exc:  # still reach the barrier, so the others do not hang
                error = exc
        dist.barrier()
        if error is not None:
            raise error
        return prefix if prefix is not None else _get_or_build(tokenizer, cache_dir)
    return _get_or_build(tokenizer, cache_dir)


def _get_or_build(tokenizer, cache_dir: str | None) -> str:
    hf = isinstance(tokenizer, HFTokenizer)  # a Hugging Face tokenizer: an entry per vocabulary
    source = getattr(tokenizer, "source", None)
    tokenizer_file = None if hf or source in (None, "<tiktoken cache>") else source
    directory = _entry_dir(cache_dir, f"hf-{tokenizer.fingerprint}" if hf else "cl100k_base")
    prefix = output_prefix(os.path.join(directory, "builtin"), "text")
    if exists(prefix):
        return prefix
    os.makedirs(directory, exist_ok=True)
    with _locked(directory + ".lock"):
        if exists(prefix):
            return prefix
        stderr(
            f"building the builtin corpus (first use: about {BUILD_CPU_SECONDS} s on an idle core, longer on "
            f"a busy one; later runs reuse it) in {directory}"
        )
        jsonl = builtin_jsonl(cache_dir) if hf else os.path.join(directory, "builtin.jsonl")
        if not os.path.isfile(jsonl):
            write_jsonl(jsonl)
        cfg = PreprocessConfig(
            inputs=[jsonl],
            output_prefix=os.path.join(directory, "builtin"),
            append_eod=True,
            workers=1,
            log_interval=0,
            tokenizer_file=tokenizer_file,
            tokenizer_type=HF_TOKENIZER if hf else "cl100k_base",
            tokenizer_model=source if hf else None,
            overwrite=True,
        )
        preprocess(cfg, log=lambda line: None)
    return prefix
