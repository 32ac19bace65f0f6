"""Fixtures for the data pipeline tests: the BPE file, a loaded tokenizer, a gloo process group."""

from __future__ import annotations

import socket

import pytest

from tests.data.helpers import find_bpe_file


@pytest.fixture(scope="session")
def bpe_file() -> str:
    path = find_bpe_file()
    if path is None:
        pytest.skip("cl100k_base BPE file not found (../shared/data/); set DIFFMEG_TOKENIZER_FILE")
    return path


@pytest.fixture(scope="session")
def tokenizer(bpe_file):
    from diffmeg.data.tiktoken_cl100k import load_tokenizer

    return load_tokenizer(bpe_file)


@pytest.fixture(scope="module")
def gloo():
    """A world-size-1 gloo group (megatron-core's dataset builders require one).

    Reuses a group another fixture already made; one made here is destroyed after the module, so
    later tests find torch.distributed as they expect.
    """
    import torch.distributed as dist

    created = not dist.is_initialized()
    if created:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=1, rank=0)
    yield dist
    if created:
        dist.destroy_process_group()
