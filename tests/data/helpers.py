"""Helpers shared by the data and tools tests."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[2]


def find_bpe_file() -> str | None:
    """$DIFFMEG_TOKENIZER_FILE, else ../shared/data/cl100k_base.tiktoken beside the checkout."""
    path = os.environ.get("DIFFMEG_TOKENIZER_FILE") or str(
        REPO_ROOT.parent / "shared" / "data" / "cl100k_base.tiktoken"
    )
    return path if Path(path).is_file() else None


def write_jsonl(path: Path, records: list) -> Path:
    """One line per record, raw UTF-8 (escaped only where UTF-8 cannot carry it, e.g. a lone
    surrogate); str records are written verbatim (for malformed lines)."""
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            line = record if isinstance(record, str) else json.dumps(record, ensure_ascii=False)
            try:
                line.encode("utf-8")
            except UnicodeEncodeError:
                line = json.dumps(record)
            f.write(line + "\n")
    return path


def write_dataset(prefix, docs, dtype=np.int32) -> str:
    """An indexed dataset of `docs` (lists of token ids), written with diffmeg's writer."""
    from diffmeg.data.indexed import IndexedWriter

    with IndexedWriter(str(prefix), dtype=dtype) as w:
        for doc in docs:
            w.add_document(np.asarray(doc, dtype=dtype))
        w.commit()
    return str(prefix)


def leftovers(directory: Path) -> list[str]:
    """Files that would look like (part of) a dataset: .bin/.idx and temporary outputs."""
    return sorted(
        p.name for p in Path(directory).rglob("*") if p.suffix in (".bin", ".idx") or ".tmp-" in p.name
    )


def read_documents(prefix: str) -> list[np.ndarray]:
    """Every document's tokens of an indexed dataset, in order (documents may span sequences)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(prefix)
    doc_idx = dataset.document_indices
    out = []
    for d in range(len(doc_idx) - 1):
        parts = [dataset.get(s) for s in range(doc_idx[d], doc_idx[d + 1])]
        out.append(np.concatenate(parts) if parts else np.zeros(0, dtype=dataset.index.dtype))
    return out
