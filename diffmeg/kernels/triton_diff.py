"""Fused differential flash-attention in Triton: both softmaxes in one pass over K/V, forward and backward.

Same contract as `reference.diff_attention_reference`:
    O = (A1 - lam A2) V,  A_k = softmax(Q_k K_k^T * scale) (causal, queries aligned to the end of the keys)
with q1, q2: [b, h, sq, d], k1, k2: [b, g, sk, d], v: [b, g, sk, 2d], lam a 0-dim tensor.

Forward (one program per query block and head): for each K/V tile, S1 = Q1 K1^T and S2 = Q2 K2^T share the
V tile; each map keeps its own running max and sum (online softmax) and its own fp32 accumulator of width
2d, and O = acc1 / l1 - lam * acc2 / l2 at the end. Saved for the backward: the base-2 log-sum-exps of both
maps and O2 = A2 V (one extra output-sized tensor: the two accumulators cannot be merged in one pass
because their rescaling factors differ, and the backward needs dO . O2).

Backward (FlashAttention-2 style, P1 and P2 recomputed tile by tile from the LSEs), with dP = dO V^T
shared by both maps and delta_k = rowsum(dO * (A_k V)):
    dV   = (A1 - lam A2)^T dO
    dS1  = A1 * (dP - delta1)              dS2 = -lam A2 * (dP - delta2)
    dQ_k = scale dS_k K_k                  dK_k = scale dS_k^T Q_k
    dlam = -sum(dO * A2 V) = -sum(delta2)
delta2 comes from the saved O2 and delta1 from O1 = O + lam O2. dK/dV are one kernel over key blocks
(looping over the query heads of a GQA group, so no atomics), dQ another over query blocks.

CPU: with TRITON_INTERPRET=1 the kernels run on CPU tensors (slow, for tests); bf16 `tl.dot` is wrong in
the interpreter, so test float32/float16 there.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
from dataclasses import dataclass, replace
from types import ModuleType

import torch

from diffmeg.errors import DiffmegError

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SM90_SHARED_MEMORY_BYTES = 232_448  # opt-in shared memory per block on sm_90 (H100, H200): 227 KiB
MAX_HEAD_DIM = 128
_INT32_MAX = 2**31 - 1


def _interpret_requested() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def triton_available() -> bool:
    """True when triton imports and kernels can run: a CUDA GPU, or the interpreter (TRITON_INTERPRET=1)."""
    if importlib.util.find_spec("triton") is None:
        return False
    return torch.cuda.is_available() or _interpret_requested()


def triton_usable(device_type: str) -> bool:
    """Whether the backend can run on tensors of this device type here: compiled kernels on CUDA, or the
    interpreter on CPU. For the backend registry (explicit 'triton', and 'auto' on CUDA)."""
    if importlib.util.find_spec("triton") is None:
        return False
    if device_type == "cuda":
        return torch.cuda.is_available() and not _interpret_requested()
    return device_type == "cpu" and _interpret_requested()


_kernels_module: ModuleType | None = None


def _kernels() -> ModuleType:
    """The kernels module, (re)imported so its `triton.jit` matches the current TRITON_INTERPRET."""
    global _kernels_module
    if _kernels_module is None:
        # needs triton (optional), and is reloaded when TRITON_INTERPRET changes
        from diffmeg.kernels import triton_diff_kernels

        _kernels_module = triton_diff_kernels
    if _kernels_module.INTERPRETED != _interpret_requested():
        _kernels_module = importlib.reload(_kernels_module)
    return _kernels_module


@dataclass(frozen=True)
class TritonDiffConfig:
    """Tile shapes and launch parameters (forward, dK/dV kernel, dQ kernel).

    `v_splits` = 2 gives each forward program one d-wide half of V's 2d columns: half the accumulator
    registers, at the price of computing S1, S2 twice (12d -> 16d FLOPs per query-key pair); 3 gives a
    third (20d; at d = 96 each third is an unpadded 64).
    `split_dkdv` computes dV and dK1/dK2 in two launches ([BN, 2d] accumulators each instead of [BN, 4d]),
    recomputing P1, P2 in both (16d -> 20d FLOPs per pair in that kernel); with `split_dk` too, dK1 and
    dK2 get a launch each ([BN, d] accumulators and one K tile resident; 24d FLOPs per pair).
    Defaults (`default_config`): d=128 from H100 timings (the GPU campaign's kernels phase), d <= 96 from
    ptxas resource usage; benchmarks/attention.py --sweep times the alternatives on a real GPU.
    """

    block_m: int = 64
    block_n: int = 64
    v_splits: int = 1
    num_warps: int = 4
    num_stages: int = 2
    dkdv_block_m: int = 32
    dkdv_block_n: int = 64
    dq_block_m: int = 64
    dq_block_n: int = 32
    bwd_num_warps: int = 4
    bwd_num_stages: int = 2
    split_dkdv: bool = False
    split_dk: bool = False

    def dkdv_passes(self) -> list[tuple[bool, bool, bool]]:
        """(dV, dK1, dK2) made by each launch of the key-block kernel."""
        if not self.split_dkdv:
            return [(True, True, True)]
        if not self.split_dk:
            return [(True, False, False), (False, True, True)]
        return [(True, False, False), (False, True, False), (False, False, True)]


_TUNED: dict[int, TritonDiffConfig] = {}


def set_tuned_config(head_dim: int | None, config: TritonDiffConfig | None) -> None:
    """Use `config` as this process's default tiles at `head_dim` (the GPU campaign: the tiles its
    kernels phase timed fastest); `set_tuned_config(None, None)` forgets every override."""
    if head_dim is None:
        _TUNED.clear()
    elif config is None:
        _TUNED.pop(head_dim, None)
    else:
        _TUNED[head_dim] = config


def default_config(
    head_dim: int,
    interpreted: bool,
    dtype: torch.dtype = torch.bfloat16,
    smem_limit: int = SM90_SHARED_MEMORY_BYTES,
) -> TritonDiffConfig:
    """Tiles for sm_90 in bf16: at d=128 the fastest correct ones an H100 measured, at d <= 96 (not timed
    against alternatives yet) from ptxas resource usage (`python -m diffmeg.kernels.triton_aot --sweep`,
    docs/benchmarks.md): the least-spilling tiles whose dot M dims cover all warps (each Hopper warp owns
    16 rows; fewer rows make warps repeat each other's work).

    Registers are the constraint: the forward holds two [BM, 2d] fp32 accumulators (A1 V, A2 V) and the
    dK/dV kernel [BN, 4d] (dV, dK1, dK2): at d=128 FlashAttention's d=256 budget, twice. Shared memory
    binds only for 4-byte inputs: `fit_shared_memory` shrinks the tiles of `dtype` to `smem_limit` (fp32
    at d=128 would need ~311 KB in the dQ kernel with the bf16 tiles; an H100 block has 227 KiB).
    """
    if interpreted:  # fewer, larger tiles: each program is a Python loop over numpy ops
        return TritonDiffConfig(32, 32, 1, 1, 1, 32, 32, 32, 32, 1, 1)
    return fit_shared_memory(_tiles(head_dim, dtype), head_dim, dtype, smem_limit)


def _tiles(head_dim: int, dtype: torch.dtype) -> TritonDiffConfig:
    """The tuned tiles of this head dim (`set_tuned_config`), else for 2-byte inputs the measured ones
    where an H100 timed candidates (d=128), else the ptxas-chosen ones. 4-byte inputs (tests, debugging)
    keep the ptxas-chosen tiles, which fit_shared_memory shrinks to the limit and which the H100 ran
    correctly; the measured d=128 tiles would shrink to 2-warp programs spilling ~24 KB (ptxas, fp32)."""
    if head_dim in _TUNED:
        return _TUNED[head_dim]
    if head_dim in _MEASURED and torch.empty((), dtype=dtype).element_size() == 2:
        return _MEASURED[head_dim]
    return _ptxas_tiles(head_dim)


_MEASURED = {
    # d=128, measured on an H100 (benchmarks/results/campaign-nvidia-h100-80gb-hbm3-20261124T064253Z.json,
    # the kernels phase): of the seven candidates these tiles are the fastest at every length (fwd+bwd
    # 3.17 ms at 4K against 4.16 for the ptxas-chosen three-pass tiles). The others failed that run's check
    # on dlambda alone, measured then against the cancelled sum (benchmarks/lambda_grad_precision.py: noise
    # of ~1e-3 for torch's path too; the check now uses lambda_grad_scale). One dK/dV pass spills more
    # (ptxas: 1536 B) than three (496 B per launch), which the timings say costs less than the extra FLOPs.
    128: TritonDiffConfig(
        block_m=128,
        block_n=64,
        v_splits=2,
        num_warps=8,
        num_stages=2,
        dkdv_block_m=32,
        dkdv_block_n=128,
        dq_block_m=128,
        dq_block_n=32,
        bwd_num_warps=8,
        bwd_num_stages=2,
    ),  # fmt: skip
}


def _ptxas_tiles(head_dim: int) -> TritonDiffConfig:
    """The tiles chosen from ptxas resource usage for sm_90 in bf16 (no GPU timing)."""
    if head_dim <= 64:  # spill-free forward and dQ; dV / dK passes spill 0 / 56 B
        return TritonDiffConfig(
            block_m=64, block_n=16, v_splits=1, num_warps=4, num_stages=2, dkdv_block_m=16, dkdv_block_n=128,
            dq_block_m=128, dq_block_n=32, bwd_num_warps=8, bwd_num_stages=2, split_dkdv=True,
        )  # fmt: skip
    if head_dim <= 96:
        # d=96 (DIFF-830M), nothing padded (96 = 64 + 32, V thirds of 64): forward spill-free with V in
        # thirds; dV / dK1 / dK2 passes spill 88 / 112 / 112 B; dQ 144 B.
        return TritonDiffConfig(
            block_m=128, block_n=16, v_splits=3, num_warps=8, num_stages=2, dkdv_block_m=16, dkdv_block_n=128,
            dq_block_m=128, dq_block_n=16, bwd_num_warps=8, bwd_num_stages=2, split_dkdv=True, split_dk=True,
        )  # fmt: skip
    # d=128: the forward needs v_splits=2 (two [BM, 2d] accumulators do not fit one warpgroup) and still
    # spills 160 B; dK/dV in three passes spills at most 496 B per launch (one pass: 1536 B, two: 1032 B)
    # at 24d instead of 16d FLOPs per query-key pair; dQ 312 B. The H100 preferred one pass (_MEASURED).
    return TritonDiffConfig(
        block_m=64, block_n=16, v_splits=2, num_warps=4, num_stages=2, dkdv_block_m=16, dkdv_block_n=128,
        dq_block_m=128, dq_block_n=16, bwd_num_warps=8, bwd_num_stages=2, split_dkdv=True, split_dk=True,
    )  # fmt: skip


def shared_memory_limit(device: torch.device | None = None) -> int:
    """Opt-in shared memory per block of a CUDA device, else sm_90's (H100 and H200: 232,448 bytes)."""
    if device is not None and device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return int(getattr(props, "shared_memory_per_block_optin", SM90_SHARED_MEMORY_BYTES))
    return SM90_SHARED_MEMORY_BYTES


def shared_memory_estimate(cfg: TritonDiffConfig, head_dim: int, dtype: torch.dtype) -> dict[str, int]:
    """Upper estimate of each kernel's shared memory in bytes: the tiles a program holds throughout (the
    forward's Q1, Q2; dK/dV's K1, K2, V; dQ's Q1, Q2, dO) plus `num_stages` copies of each tile it
    streams, at the inputs' element size (the dot operands Triton stages in shared memory). Above what
    ptxas reported for every default tile set at d = 64, 96, 128 in bf16 and fp32 (tests/kernels)."""
    e = torch.empty((), dtype=dtype).element_size()
    a, b, split = split_width(head_dim)
    dw = a + b if split else a  # head-dim width of one Q or K tile as launched
    va, vb, vsplit = split_width(2 * head_dim)
    vw = va + vb if vsplit else va  # V / dO width
    qkv = 2 * dw + vw  # Q1 + Q2 + dO, or K1 + K2 + V
    return {
        "fwd": e * (cfg.block_m * 2 * dw + cfg.num_stages * cfg.block_n * (2 * dw + vw // cfg.v_splits)),
        "dkdv": e * qkv * (cfg.dkdv_block_n + cfg.bwd_num_stages * cfg.dkdv_block_m),
        "dq": e * qkv * (cfg.dq_block_m + cfg.bwd_num_stages * cfg.dq_block_n),
    }


def fit_shared_memory(
    cfg: TritonDiffConfig, head_dim: int, dtype: torch.dtype, limit: int = SM90_SHARED_MEMORY_BYTES
) -> TritonDiffConfig:
    """`cfg` with each kernel's held tile rows halved (forward BM, dK/dV BN, dQ BM; warps cut so every
    warp keeps 16 rows), then its pipeline stages, then its streamed tiles, until
    `shared_memory_estimate` fits `limit`.
    Unchanged where it fits (every bf16 default on sm_90); a launch that still cannot fit fails in
    Triton with OutOfResources."""
    for _ in range(32):  # each round halves a tile or drops a stage: 32 reach the smallest
        est = shared_memory_estimate(cfg, head_dim, dtype)
        change: dict[str, int] = {}
        for kernel, held, stages, streamed in (
            ("fwd", "block_m", "num_stages", "block_n"),
            ("dkdv", "dkdv_block_n", "bwd_num_stages", "dkdv_block_m"),
            ("dq", "dq_block_m", "bwd_num_stages", "dq_block_n"),
        ):
            if est[kernel] > limit:
                if getattr(cfg, held) > 16:
                    change[held] = getattr(cfg, held) // 2
                elif getattr(cfg, stages) > 1:
                    change[stages] = getattr(cfg, stages) - 1
                elif getattr(cfg, streamed) > 16:
                    change[streamed] = getattr(cfg, streamed) // 2
        if not change:
            return cfg
        cfg = replace(cfg, **change)
        cfg = replace(
            cfg,
            num_warps=max(1, min(cfg.num_warps, cfg.block_m // 16)),
            bwd_num_warps=max(1, min(cfg.bwd_num_warps, min(cfg.dkdv_block_n, cfg.dq_block_m) // 16)),
        )
    return cfg


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs: exact fp32 products (the GPU default would be tf32); ignored for fp16/bf16.
    return "ieee" if dtype == torch.float32 else "tf32"


def _prepare(t: torch.Tensor) -> torch.Tensor:
    """Unit stride on the last dim and int32-safe offsets inside one (batch, head); copies only if not."""
    seq_span = (t.shape[2] - 1) * t.stride(2) + t.shape[3] if t.shape[2] > 0 else 0
    if t.stride(3) != 1 or seq_span > _INT32_MAX:
        t = t.contiguous()
    return t


def _validate(q1, q2, k1, k2, v, lam) -> None:
    if q1.dim() != 4 or k1.dim() != 4 or v.dim() != 4:
        raise DiffmegError("triton diff attention expects 4-D q/k/v tensors: [b, h, s, d]")
    b, h, sq, d = q1.shape
    _, g, sk, _ = k1.shape
    if q2.shape != q1.shape or k2.shape != k1.shape or k1.shape[0] != b or k1.shape[3] != d:
        raise DiffmegError(
            f"shape mismatch: q1 {tuple(q1.shape)}, q2 {tuple(q2.shape)}, "
            f"k1 {tuple(k1.shape)}, k2 {tuple(k2.shape)}"
        )
    if v.shape != (b, g, sk, 2 * d):
        raise DiffmegError(f"v must be [b, g, sk, 2d] = {(b, g, sk, 2 * d)}, got {tuple(v.shape)}")
    if g == 0 or h % g:
        raise DiffmegError(f"query heads ({h}) must be a multiple of KV heads ({g})")
    if sq > sk or sk == 0:
        raise DiffmegError(
            f"causal attention needs 0 < sq <= sk (queries at the end of the keys); got {sq}, {sk}"
        )
    if d > MAX_HEAD_DIM:
        raise DiffmegError(f"triton diff attention supports head dims up to {MAX_HEAD_DIM}, got {d}")
    dtypes = {t.dtype for t in (q1, q2, k1, k2, v)}
    if len(dtypes) != 1 or q1.dtype not in _SUPPORTED_DTYPES:
        raise DiffmegError(
            f"q/k/v must share one dtype among fp16, bf16, fp32; got {sorted(map(str, dtypes))}"
        )
    devices = {t.device for t in (q1, q2, k1, k2, v)}
    if len(devices) != 1:
        raise DiffmegError(f"q/k/v must be on one device, got {devices}")
    if lam.numel() != 1:
        raise DiffmegError(f"lam must be a single-element tensor, got shape {tuple(lam.shape)}")


def _strides(t: torch.Tensor) -> tuple[int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2)


def split_width(width: int) -> tuple[int, int, bool]:
    """Tile widths for a head dim or V slice: (a, b, True) when width = a + b with a > b >= 16 powers of two
    (96 = 64 + 32, 192 = 128 + 64: two exact tiles, nothing padded); else (a, 16, False) with a the next
    power of two (>= 16 for tl.dot) and the tail masked (b unused)."""
    whole = max(16, _next_pow2(width))
    if whole == width or width < 16:
        return whole, 16, False
    a, b = whole // 2, width - whole // 2
    if b >= 16 and b & (b - 1) == 0:
        return a, b, True
    return whole, 16, False


def _width_meta(d: int, v_width: int) -> dict:
    block_d, block_d2, has_d2 = split_width(d)
    block_dv, block_dv2, has_dv2 = split_width(v_width)
    return dict(
        BLOCK_D=block_d, BLOCK_D2=block_d2, HAS_D2=has_d2, PAD_D=not has_d2 and block_d != d,
        BLOCK_DV=block_dv, BLOCK_DV2=block_dv2, HAS_DV2=has_dv2, PAD_DV=not has_dv2 and block_dv != v_width,
    )  # fmt: skip


def fwd_meta(d: int, sq: int, dtype: torch.dtype, cfg: TritonDiffConfig, store_o2: bool) -> dict:
    """Compile-time parameters and launch options of the forward kernel (shared with triton_aot)."""
    if cfg.v_splits not in (1, 2, 3) or (2 * d) % cfg.v_splits:
        raise DiffmegError(f"v_splits must be 1, 2 or 3 and divide 2d = {2 * d}, got {cfg.v_splits}")
    dv_width = 2 * d // cfg.v_splits
    return dict(
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, **_width_meta(d, dv_width),
        MASK_M=sq % cfg.block_m != 0, STORE_O2=store_o2, PRECISION=_dot_precision(dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip


def preprocess_meta(d: int, sq: int, block_m: int) -> dict:
    block_dv = max(16, _next_pow2(2 * d))  # row sums over 2d: memory-bound, padding costs masked lanes only
    return dict(BLOCK_M=block_m, BLOCK_DV=block_dv, MASK_M=sq % block_m != 0, PAD_DV=block_dv != 2 * d)


def dkdv_meta(
    d: int,
    sq: int,
    sk: int,
    dtype: torch.dtype,
    cfg: TritonDiffConfig,
    passes: tuple[bool, bool, bool] = (True, True, True),
) -> dict:
    """`passes`: which of dV, dK1, dK2 this launch makes (`TritonDiffConfig.dkdv_passes`)."""
    bm, bn = cfg.dkdv_block_m, cfg.dkdv_block_n
    do_dv, do_dk1, do_dk2 = passes
    return dict(
        BLOCK_M=bm, BLOCK_N=bn, **_width_meta(d, 2 * d), MASK_M=sq % bm != 0, MASK_N=sk % bn != 0,
        PRECISION=_dot_precision(dtype), DO_DV=do_dv, DO_DK1=do_dk1, DO_DK2=do_dk2,
        num_warps=cfg.bwd_num_warps, num_stages=cfg.bwd_num_stages,
    )  # fmt: skip


def dq_meta(d: int, sq: int, dtype: torch.dtype, cfg: TritonDiffConfig) -> dict:
    bm, bn = cfg.dq_block_m, cfg.dq_block_n
    return dict(
        BLOCK_M=bm, BLOCK_N=bn, **_width_meta(d, 2 * d), MASK_M=sq % bm != 0,
        PRECISION=_dot_precision(dtype), num_warps=cfg.bwd_num_warps, num_stages=cfg.bwd_num_stages,
    )  # fmt: skip


def _forward(
    q1,
    q2,
    k1,
    k2,
    v,
    lam,
    scale: float,
    cfg: TritonDiffConfig,
    store_o2: bool,
    o2_dtype: torch.dtype | None = None,
):
    """(out, o2, lse1, lse2); o2 = A2 V is kept for the backward in `o2_dtype` (default: the inputs')."""
    kern = _kernels()
    b, h, sq, d = q1.shape
    g, sk = k1.shape[1], k1.shape[2]
    splits = cfg.v_splits
    dv_width = 2 * d // splits
    out = torch.empty((b, h, sq, 2 * d), device=q1.device, dtype=q1.dtype)
    o2 = torch.empty_like(out, dtype=o2_dtype or out.dtype) if store_o2 else out  # else an unused pointer
    lse1 = torch.empty((b, h, sq), device=q1.device, dtype=torch.float32)
    lse2 = torch.empty_like(lse1)
    grid = (_cdiv(sq, cfg.block_m), b * h, splits)
    kern.diff_fwd_kernel[grid](
        q1, q2, k1, k2, v, lam, out, o2, lse1, lse2,
        *_strides(q1), *_strides(q2), *_strides(k1), *_strides(k2), *_strides(v), *_strides(out),
        h, h // g, sq, sk, d, dv_width, scale * math.log2(math.e),
        **fwd_meta(d, sq, q1.dtype, cfg, store_o2),
    )  # fmt: skip
    return out, (o2 if store_o2 else None), lse1, lse2


def _backward(dout, q1, q2, k1, k2, v, lam, out, o2, lse1, lse2, scale: float, cfg: TritonDiffConfig, need):
    kern = _kernels()
    b, h, sq, d = q1.shape
    g, sk = k1.shape[1], k1.shape[2]
    dout = _prepare(dout)
    scale_log2 = scale * math.log2(math.e)

    delta1 = torch.empty((b, h, sq), device=q1.device, dtype=torch.float32)
    delta2 = torch.empty_like(delta1)
    pre_m = 32
    kern.diff_bwd_preprocess_kernel[(_cdiv(sq, pre_m), b * h)](
        out, o2, dout, lam, delta1, delta2, *_strides(out), *_strides(dout), h, sq, 2 * d,
        **preprocess_meta(d, sq, pre_m),
    )  # fmt: skip

    dq1 = dq2 = dk1 = dk2 = dv = None
    common = (
        *_strides(q1), *_strides(q2), *_strides(k1), *_strides(k2), *_strides(v), *_strides(dout),
    )  # fmt: skip
    if need["k"] or need["v"]:
        dk1 = torch.empty((b, g, sk, d), device=k1.device, dtype=k1.dtype)
        dk2 = torch.empty_like(dk1)
        dv = torch.empty((b, g, sk, 2 * d), device=v.device, dtype=v.dtype)
        for passes in cfg.dkdv_passes():
            kern.diff_bwd_dkdv_kernel[(_cdiv(sk, cfg.dkdv_block_n), b * g)](
                q1, q2, k1, k2, v, dout, lam, lse1, lse2, delta1, delta2, dk1, dk2, dv,
                *common, *_strides(dk1), *_strides(dv),
                h, g, h // g, sq, sk, d, 2 * d, scale, scale_log2,
                **dkdv_meta(d, sq, sk, q1.dtype, cfg, passes),
            )  # fmt: skip
    if need["q"]:
        dq1 = torch.empty((b, h, sq, d), device=q1.device, dtype=q1.dtype)
        dq2 = torch.empty_like(dq1)
        kern.diff_bwd_dq_kernel[(_cdiv(sq, cfg.dq_block_m), b * h)](
            q1, q2, k1, k2, v, dout, lam, lse1, lse2, delta1, delta2, dq1, dq2,
            *common, *_strides(dq1),
            h, h // g, sq, sk, d, 2 * d, scale, scale_log2,
            **dq_meta(d, sq, q1.dtype, cfg),
        )  # fmt: skip
    dlam = -delta2.sum() if need["lam"] else None  # dlam = -sum(dO * A2 V), all rows, heads, batch
    return dq1, dq2, dk1, dk2, dv, dlam


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class _DiffAttentionFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q1, q2, k1, k2, v, lam, scale: float, cfg: TritonDiffConfig):
        need_grad = any(ctx.needs_input_grad[:6])
        out, o2, lse1, lse2 = _forward(q1, q2, k1, k2, v, lam, scale, cfg, store_o2=need_grad)
        if need_grad:
            ctx.save_for_backward(q1, q2, k1, k2, v, lam, out, o2, lse1, lse2)
        ctx.scale, ctx.cfg = scale, cfg
        return out

    @staticmethod
    def backward(ctx, dout):
        q1, q2, k1, k2, v, lam, out, o2, lse1, lse2 = ctx.saved_tensors
        ng = ctx.needs_input_grad
        need = {"q": ng[0] or ng[1], "k": ng[2] or ng[3], "v": ng[4], "lam": ng[5]}
        dq1, dq2, dk1, dk2, dv, dlam = _backward(
            dout, q1, q2, k1, k2, v, lam, out, o2, lse1, lse2, ctx.scale, ctx.cfg, need
        )
        if dlam is not None:
            dlam = dlam.to(lam.dtype).reshape(lam.shape)
        return (
            dq1 if ng[0] else None,
            dq2 if ng[1] else None,
            dk1 if ng[2] else None,
            dk2 if ng[3] else None,
            dv if ng[4] else None,
            dlam,
            None,
            None,
        )


def diff_attention_triton(
    q1: torch.Tensor,
    q2: torch.Tensor,
    k1: torch.Tensor,
    k2: torch.Tensor,
    v: torch.Tensor,
    lam: torch.Tensor,
    *,
    scale: float,
    dropout_p: float = 0.0,
    attention_mask: torch.Tensor | None = None,
    config: TritonDiffConfig | None = None,
) -> torch.Tensor:
    """Same contract as `diff_attention_reference`; causal only, no dropout, fp16/bf16/fp32 inputs."""
    if dropout_p > 0.0:
        raise DiffmegError(
            "the triton diff-attention backend has no dropout; "
            "use attention_dropout=0 or the reference backend"
        )
    if attention_mask is not None:
        raise DiffmegError(
            "the triton diff-attention backend is causal-only; use the reference backend for masks"
        )
    if not triton_available():
        raise DiffmegError(
            "the triton backend needs the triton package and a CUDA GPU (or TRITON_INTERPRET=1)"
        )
    if not torch.is_tensor(lam):
        lam = torch.tensor(float(lam), dtype=torch.float32, device=q1.device)
    _validate(q1, q2, k1, k2, v, lam)
    if q1.is_cuda and _interpret_requested():
        raise DiffmegError("TRITON_INTERPRET=1 runs kernels on CPU tensors only; unset it for CUDA tensors")
    if not q1.is_cuda and not _interpret_requested():
        raise DiffmegError("the triton backend needs CUDA tensors (or TRITON_INTERPRET=1 for CPU tensors)")
    lam = lam.reshape(()).to(q1.device)
    if config is None:
        limit = shared_memory_limit(q1.device)
        config = default_config(q1.shape[-1], _interpret_requested(), q1.dtype, limit)
    cfg = config
    q1, q2, k1, k2, v = (_prepare(t) for t in (q1, q2, k1, k2, v))
    if q1.is_cuda:
        with torch.cuda.device(q1.device):
            return _DiffAttentionFn.apply(q1, q2, k1, k2, v, lam, float(scale), cfg)
    return _DiffAttentionFn.apply(q1, q2, k1, k2, v, lam, float(scale), cfg)


__all__ = [
    "TritonDiffConfig",
    "default_config",
    "diff_attention_triton",
    "fit_shared_memory",
    "set_tuned_config",
    "shared_memory_estimate",
    "shared_memory_limit",
    "triton_available",
    "triton_usable",
]
