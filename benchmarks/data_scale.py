"""Start-up of a run on a large dataset from elsewhere: the token-id range (its record, else a scan of the
`.bin`) and megatron-core's index build, on a cold start and on a restart, at 1 and 2 ranks.

    python3 benchmarks/data_scale.py [--tokens 1e9 1e10] [--ranks 1 2] [--unsplit] [--dir DIR]

Each dataset is synthetic, as a Megatron-LM-tokenized corpus arrives: 1000-token documents, the `.idx`
written directly, the `.bin` a sparse file (no disk used; its reads cost the page cache and the memory
bus, not the disk: on a shared file system a scan is slower still). Nothing diffmeg records sits beside
it, so a cold start scans. Per phase: seconds (the slowest rank) and the peak RSS of the largest rank
(MiB, the process's peak so far, so a phase that allocates nothing repeats the one before). `--unsplit`:
every rank scans the whole `.bin` (before issue 48), for comparison. `--tokens 1e11` adds 100B tokens
(400 GB sparse; minutes per scan). Model build and the first step do not depend on the data's size (the
issue's probe: 1.3 s to build diff-tiny) and are not timed here.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import struct
import sys
import tempfile
import time
import warnings

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from diffmeg.data import token_range as tr  # noqa: E402
from diffmeg.data.gpt_datasets import build_gpt_datasets  # noqa: E402
from diffmeg.data.tokenizers import NULL, build_tokenizer  # noqa: E402
from diffmeg.errors import cli_errors  # noqa: E402

DOC_TOKENS = 1000
SEQ_LENGTH = 4096
VOCAB = 100288
PHASES = ("range", "index build")


def write_sparse_dataset(prefix: str, tokens: int) -> None:
    """`{prefix}.bin` of `tokens` int32 zeros as a sparse file and its `.idx` in megatron-core's format."""
    docs = tokens // DOC_TOKENS
    with open(prefix + ".bin", "wb") as f:
        f.truncate(docs * DOC_TOKENS * 4)
    lengths = np.full(docs, DOC_TOKENS, dtype=np.int32)
    pointers = np.arange(docs, dtype=np.int64) * (DOC_TOKENS * 4)
    document_indices = np.arange(docs + 1, dtype=np.int64)  # one sequence per document
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", 4))  # version 1, int32
        f.write(struct.pack("<Q", docs) + struct.pack("<Q", docs + 1))
        f.write(lengths.tobytes() + pointers.tobytes() + document_indices.tobytes())


def drop_cached_pages(path: str) -> None:
    """Evict the file's pages from the page cache (no root needed), so every cold start reads it afresh."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _part_bytes(prefix: str, part: tuple[int, int]) -> int:
    """Bytes of the `.bin` in part (index, parts) of a scan."""
    count = os.path.getsize(prefix + ".bin") // 4
    index, parts = part
    return (count * (index + 1) // parts - count * index // parts) * 4


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _start(prefix: str, cache: str, samples: int, split: bool) -> dict[str, list[float]]:
    """One start: (seconds, peak MiB) per phase on this rank."""
    out = {}
    read = []
    scan = tr.scan_range
    tr.scan_range = lambda p, part=(0, 1): read.append(_part_bytes(p, part)) or scan(p, part=part)
    torch.distributed.barrier()
    begin = time.perf_counter()
    tr.token_range(prefix, cache, collective=split)
    torch.distributed.barrier()
    out["range"] = [time.perf_counter() - begin, _peak_mib()]
    out["read"] = [sum(read) / 1e9, 0.0]
    tr.scan_range = scan
    begin = time.perf_counter()
    tokenizer = build_tokenizer(NULL, vocab_size=VOCAB)
    build_gpt_datasets([prefix], "1,0,0", SEQ_LENGTH, 1, (samples, 0, 0), tokenizer, cache, vocab_size=VOCAB)
    torch.distributed.barrier()
    out["index build"] = [time.perf_counter() - begin, _peak_mib()]
    return out


def _worker(rank: int, world: int, port: int, prefix: str, cache: str, samples: int, split: bool, out: str):
    torch.set_num_threads(1)
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        cold = _start(prefix, cache, samples, split)
        tr._IN_MEMORY.clear()  # a restart is a new process: only the records on disk answer
        restart = _start(prefix, cache, samples, split)
        with open(os.path.join(out, f"{rank}.json"), "w") as f:
            json.dump({"cold": cold, "restart": restart}, f)
    finally:
        torch.distributed.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@cli_errors
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=float, nargs="+", default=[1e9, 1e10])
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    p.add_argument("--unsplit", action="store_true", help="every rank scans the whole .bin (before)")
    p.add_argument("--dir", default=None, help="where the sparse datasets go (default: a temporary folder)")
    args = p.parse_args()
    root = tempfile.mkdtemp(prefix="diffmeg-data-scale-", dir=args.dir)
    mode = "unsplit (every rank scans the whole .bin)" if args.unsplit else "split over the ranks"
    print(f"{DOC_TOKENS}-token documents, seq {SEQ_LENGTH}, one epoch of samples; range scan {mode}")
    header = " ".join(f"{ph + ' s / MiB':>20}" for ph in PHASES)
    print(f"{'tokens':>8} {'ranks':>5} {'start':>8} {'GB read a rank':>15} {header}")
    try:
        for tokens in args.tokens:
            prefix = os.path.join(root, f"d{tokens:.0e}")
            write_sparse_dataset(prefix, int(tokens))
            samples = (int(tokens) // DOC_TOKENS * DOC_TOKENS - 1) // SEQ_LENGTH
            for world in args.ranks:
                cache = os.path.join(root, f"cache-{tokens:.0e}-{world}")
                out = os.path.join(root, f"out-{tokens:.0e}-{world}")
                os.makedirs(out)
                drop_cached_pages(prefix + ".bin")
                os.environ["DIFFMEG_CACHE_DIR"] = os.path.join(root, f"home-{tokens:.0e}-{world}")
                mp.spawn(
                    _worker,
                    args=(world, _free_port(), prefix, cache, samples, not args.unsplit, out),
                    nprocs=world,
                )
                ranks = [json.load(open(os.path.join(out, f"{r}.json"))) for r in range(world)]
                for start in ("cold", "restart"):
                    cells = []
                    for phase in PHASES:
                        seconds = max(r[start][phase][0] for r in ranks)
                        mib = max(r[start][phase][1] for r in ranks)
                        cells.append(f"{seconds:>10.2f} / {mib:>7.0f}")
                    read = max(r[start]["read"][0] for r in ranks)
                    row = " ".join(f"{c:>20}" for c in cells)
                    print(f"{tokens:>8.0e} {world:>5} {start:>8} {read:>15.2f} {row}", flush=True)
            os.remove(prefix + ".bin")
    finally:
        shutil.rmtree(root, ignore_errors=True)  # only what this run made: its own temporary folder


if __name__ == "__main__":
    main()
