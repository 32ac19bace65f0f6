"""Fixtures for the evaluation tests."""

from __future__ import annotations

import pytest

from tests.eval.helpers import tiny_checkpoints


@pytest.fixture(scope="session")
def tiny_ckpts(tmp_path_factory):
    """Trained diff-tiny and transformer-tiny checkpoints (seq 64, mock vocab 512)."""
    return tiny_checkpoints(tmp_path_factory.getbasetemp())
