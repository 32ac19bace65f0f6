"""--split (diffmeg/data/splits.py): the split string and the splits that come out without tokens."""

from __future__ import annotations

import numpy as np
import pytest

from diffmeg.data.indexed import IndexedWriter
from diffmeg.data.splits import check_splits_nonempty, split_matrix
from diffmeg.errors import DiffmegError


def test_split_without_tokens_and_empty_dataset(tmp_path):
    with IndexedWriter(str(tmp_path / "d")) as w:
        for n in (5, 5, 5, 0):
            w.add_document(np.ones(n, dtype=np.int32))
        w.commit()
    with pytest.raises(DiffmegError, match="test split .* 1 documents but no tokens"):
        check_splits_nonempty([str(tmp_path / "d")], "3,0,1")
    with IndexedWriter(str(tmp_path / "e")) as w:
        w.add_document(np.ones(0, dtype=np.int32))
        w.commit()
    with pytest.raises(DiffmegError, match="holds no tokens"):
        check_splits_nonempty([str(tmp_path / "e")], "1")


@pytest.mark.parametrize("split", ["", "a,b", "1,2,3,4", "0,0,0", "-1,2"])
def test_bad_split_strings(split):
    with pytest.raises(DiffmegError, match="--split"):
        split_matrix(split)
