"""The one check of a context-parallel layout, shared by the config and the command line."""

from __future__ import annotations

from diffmeg.errors import DiffmegError

TE_CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")
"""megatron-core's `cp_comm_type` values (Megatron-LM's `--cp-comm-type`), all done inside TE's attention."""

CP_COMM_TYPES = ("ulysses", *TE_CP_COMM_TYPES)
"""`--cp-comm-type` choices: diffmeg's all-to-all plus megatron-core's."""


def validate_cp(
    *,
    cp_size: int,
    comm_type: str | None,
    diff_attention: bool,
    heads: int,
    kv_heads: int,
    tp: int,
    attention_dropout: float = 0.0,
    seq_length: int | None = None,
    cp_attention_available: bool | None = None,
    unit: str | None = None,
) -> str:
    """Resolve `comm_type` (None: `ulysses` for DIFF, `p2p` for the baseline) and check the layout.

    `heads`/`kv_heads` count what moves as a whole inside attention: differential heads and KV heads
    for DIFF V1, query and KV heads for DIFF V2 (`unit` names them), ordinary heads for the baseline.
    `seq_length` and `cp_attention_available` (whether megatron-core's CP attention can be built here)
    are checked when given: the command line knows them before any work, a config built in a test may
    not. Returns the resolved comm type.
    """
    comm = comm_type or ("ulysses" if diff_attention else "p2p")
    if comm not in CP_COMM_TYPES:  # also rejects megatron-core's per-layer lists
        raise DiffmegError(f"--cp-comm-type must be one of {', '.join(CP_COMM_TYPES)}, got {comm!r}")
    if not diff_attention and comm == "ulysses":
        raise DiffmegError(
            "--cp-comm-type ulysses is the differential core's all-to-all; the Transformer baseline uses "
            "megatron-core's Transformer Engine attention: choose p2p, all_gather or a2a"
        )
    if cp_size <= 1:
        return comm
    if comm == "a2a+p2p":
        raise DiffmegError(
            "--cp-comm-type a2a+p2p needs megatron-core's hierarchical CP groups, which diffmeg does not "
            "create; use p2p, all_gather, a2a or (DIFF) ulysses"
        )
    if comm in ("ulysses", "a2a") and ((heads // tp) % cp_size or (kv_heads // tp) % cp_size):
        kind = unit or ("differential heads" if diff_attention else "heads")
        alternative = (
            "; --cp-comm-type p2p or all_gather (Transformer Engine) need not" if diff_attention else ""
        )
        raise DiffmegError(
            f"--context-parallel-size {cp_size} with --cp-comm-type {comm} shards whole {kind} inside "
            f"attention: {heads // tp} heads and {kv_heads // tp} KV heads per TP rank must both be "
            f"divisible by it{alternative}"
        )
    if seq_length is not None and seq_length % (2 * cp_size):
        raise DiffmegError(f"--seq-length {seq_length} must be divisible by 2 x CP = {2 * cp_size}")
    if comm != "ulysses":
        if cp_attention_available is False and diff_attention:
            raise DiffmegError(
                f"--cp-comm-type {comm} runs megatron-core's TEDotProductAttention, which needs "
                f"transformer_engine and a CUDA GPU; use --cp-comm-type ulysses (diffmeg's all-to-all)"
            )
        if cp_attention_available is False:
            raise DiffmegError(
                "context parallelism for the Transformer baseline uses megatron-core's attention with "
                "Transformer Engine on a GPU (--transformer-impl transformer_engine); "
                "use --context-parallel-size 1"
            )
        if diff_attention and attention_dropout > 0:
            raise DiffmegError(
                f"--cp-comm-type {comm} runs DIFF's two maps as separate TE calls, which cannot share one "
                f"dropout of their difference; use --attention-dropout 0 or --cp-comm-type ulysses"
            )
    return comm
