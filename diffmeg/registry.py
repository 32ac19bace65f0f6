"""The one selector of implementations: every choice between interchangeable implementations of an op.

Each `Implementation` names its slot (the op it implements), says what it is, whether it can run here
(`missing`: the one-line reason it cannot, at build time or for tensors of a device type) and how to get
it (`load`). `auto` picks, per slot, the first entry of `AUTO_ORDER` that can run (a layer spec: the first of
its own family, `Implementation.spec`). Read by:
- the model config's validation (`DiffTransformerConfig`: a name must be one of the slot's),
- the argument parser (`--diff-attn-backend`'s choices and help),
- the builders (`diffmeg.attention`, `diffmeg.layer_specs`, `diffmeg.model`: `select`),
- the docs: docs/implementations.md is `markdown_table()`, checked by tests/test_registry.py.

A new implementation (a fused norm, a fused loss, another FP8 GEMM) is one entry in `IMPLEMENTATIONS`
(and its name in `AUTO_ORDER` where `auto` should prefer it). Like megatron-core's `BackendSpecProvider` and
`select_cross_entropy`, but one table for every op.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from diffmeg.errors import DiffmegError
from diffmeg.runtime import transformer_engine_available

# Implementations and their checks are imported only when one is asked for: reading the table (names,
# choices, the docs) loads no kernel, GPU package or megatron-core module.

AUTO = "auto"
SPECS = ("local", "transformer_engine")
"""The layer spec families (`--transformer-impl`): megatron-core's local modules or Transformer Engine's."""


@dataclass(frozen=True)
class Slot:
    """An op with interchangeable implementations."""

    name: str
    """How code and docs name it."""
    what: str
    """What its implementations are, as an error message names one ("differential attention backend")."""
    chosen_by: str
    """What decides which implementation a run uses (a flag, the spec)."""


@dataclass(frozen=True)
class Implementation:
    """One implementation of a slot's op."""

    slot: str
    """The op it implements (a `Slot`'s name)."""
    name: str
    """Its name in flags, configs and docs, unique within the slot."""
    description: str
    """What it is and when to use it (the docs table shows it)."""
    load: Callable[[], object]
    """Returns the implementation: a function, or a module class for a spec."""
    missing: Callable[[str | None], str | None] = lambda device_type: None
    """Why it cannot run, as a one-line error saying the fix, or None when it can. `device_type` None asks
    at build time (is it installed?); "cpu"/"cuda" asks for tensors of that device type."""
    spec: str | None = None
    """The layer spec family it belongs to (`SPECS`), for slots a spec chooses in: a spec takes the first
    entry of the slot's `AUTO_ORDER` of its own family that can run. None: any spec (a flag chooses)."""


def _flash_missing(device_type: str | None) -> str | None:
    from diffmeg.kernels.sdpa import flash_attn_available  # lazy: loads when this entry is checked

    if device_type is None and not flash_attn_available():
        return "attention backend 'flash' needs the flash-attn package (GPU builds); use 'sdpa'"
    if device_type is not None and (device_type != "cuda" or not flash_attn_available()):
        return "attention backend 'flash' needs a CUDA GPU and the flash-attn package; use 'sdpa'"
    return None


def _te_missing(what: str, fix: str) -> Callable[[str | None], str | None]:
    def missing(device_type: str | None) -> str | None:
        if transformer_engine_available() and device_type in (None, "cuda"):
            return None
        return f"{what} needs transformer_engine and a CUDA GPU; {fix}"

    return missing


def _diff_reference() -> Callable:
    from diffmeg.kernels.reference import diff_attention_reference  # lazy: loads when this entry is chosen

    return diff_attention_reference


def _diff_sdpa() -> Callable:
    from diffmeg.kernels.sdpa import diff_attention_sdpa  # lazy: loads when this entry is chosen

    return diff_attention_sdpa


def _diff_sdpa_path(path: str) -> Callable[[], Callable]:
    def load() -> Callable:
        from functools import partial

        from diffmeg.kernels.sdpa import diff_attention_sdpa

        return partial(diff_attention_sdpa, path=path)

    return load


def _diff_flash() -> Callable:
    from diffmeg.kernels.sdpa import diff_attention_sdpa  # lazy: loads when this entry is chosen

    return partial(diff_attention_sdpa, use_flash_attn=True)


def _flex_missing(device_type: str | None) -> str | None:
    from diffmeg.kernels.flex import flex_attention_available

    if not flex_attention_available():
        return "attention backend 'flex' needs torch >= 2.5 (FlexAttention); use 'sdpa'"
    if device_type is not None and device_type != "cuda":
        return "attention backend 'flex' needs a CUDA GPU (FlexAttention has no CPU backward); use 'sdpa'"
    return None


def _diff_flex() -> Callable:
    from diffmeg.kernels.flex import diff_attention_flex

    return diff_attention_flex


def _sdpa_core() -> type:
    from diffmeg.core_attention import SDPACoreAttention  # lazy: loads when this entry is chosen

    return SDPACoreAttention


def _te_dot_product_attention() -> type:
    from megatron.core.extensions.transformer_engine import TEDotProductAttention  # optional GPU dependency

    return TEDotProductAttention


def _local_norm() -> type:
    from diffmeg.fusions.rms_norm import RMSNorm  # lazy: loads when this entry is chosen

    return RMSNorm


def _torch_norm() -> type:
    from diffmeg.fusions.rms_norm import TorchRMSNorm

    return TorchRMSNorm


def _te_norm() -> type:
    from megatron.core.extensions.transformer_engine import TENorm  # optional GPU dependency

    return TENorm


def _megatron_loss() -> Callable:
    # lazy: loads when this entry is chosen
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    return vocab_parallel_cross_entropy


def _fused_loss() -> Callable:
    from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy

    return fused_vocab_parallel_cross_entropy


def _megatron_optimizer_step() -> Callable:
    from diffmeg.fusions.optimizer_step import keep_megatron_step  # lazy: loads when this entry is chosen

    return keep_megatron_step


def _fused_optimizer_missing(device_type: str | None) -> str | None:
    from diffmeg.fusions.optimizer_step import megatron_has_fused_adam  # lazy: loads when checked

    if megatron_has_fused_adam():
        return (
            "--optimizer-impl fused steps torch's AdamW, but megatron-core steps Transformer Engine's or "
            "apex's fused Adam here; use --optimizer-impl megatron"
        )
    return None


def _fused_optimizer_step() -> Callable:
    from diffmeg.fusions.optimizer_step import apply_fused_step  # lazy: loads when this entry is chosen

    return apply_fused_step


def _chunked_loss() -> Callable:
    from diffmeg.fusions.cross_entropy import linear_cross_entropy  # lazy: loads when this entry is chosen

    return linear_cross_entropy


def _torchao_fp8_missing(device_type: str | None) -> str | None:
    from diffmeg.fusions.torchao_fp8 import fp8_unsupported_reason

    if device_type not in (None, "cuda"):
        return "FP8 linears need a CUDA GPU (Ada/Hopper or newer) outside emulation; leave out --fp8-format"
    # at build: installed (emulation needs no more); for CUDA tensors, the GPU too (all rules: check_fp8)
    return fp8_unsupported_reason(emulate=device_type is None)


def _torchao_fp8() -> type:
    from diffmeg.fusions.torchao_fp8 import TorchaoFp8

    return TorchaoFp8


SLOTS = (
    Slot("diff_attention", "differential attention backend", "`--diff-attn-backend` (DIFF V1)"),
    Slot(
        "core_attention",
        "core attention",
        "the spec (`--transformer-impl`): the Transformer baseline's and DIFF V2's core",
    ),
    Slot(
        "norm",
        "norm",
        "the spec (`--transformer-impl`), or `--norm-impl` on the local spec: the blocks' and the final "
        "RMSNorm, and DIFF V1's head norm",
    ),
    Slot(
        "loss",
        "training loss",
        "`--cross-entropy-chunk-size` (set: chunked), `--cross-entropy-loss-fusion` (set: fused)",
    ),
    Slot(
        "fp8_linear",
        "FP8 linear converter",
        "`--fp8-format` on the local spec (the Transformer Engine spec's linears are TE's: megatron-core "
        "runs them in FP8 from the config)",
    ),
    Slot(
        "optimizer",
        "optimizer step",
        "`--optimizer-impl`: the step after backward (grad norm, clipping, AdamW, the copy to the weights)",
    ),
)

IMPLEMENTATIONS = (
    Implementation(
        "diff_attention",
        "reference",
        "plain math in the input dtype (float64 for the golden tests); materialises both maps; custom masks "
        "and attention dropout",
        _diff_reference,
    ),
    Implementation(
        "diff_attention",
        "sdpa",
        "torch SDPA, combined in fp32; the path per key length from measured crossovers "
        "(`kernels/sdpa_paths.py`: two calls sharing V, or split-V on a GPU where it measured faster)",
        _diff_sdpa,
    ),
    Implementation(
        "diff_attention",
        "sdpa_two_call",
        "torch SDPA, always two calls sharing V of width 2d (a candidate `sdpa` chooses among)",
        _diff_sdpa_path("two_call"),
    ),
    Implementation(
        "diff_attention",
        "sdpa_split_v",
        "torch SDPA, always four calls over V's d-wide halves (equal head sizes: flash kernels on a GPU)",
        _diff_sdpa_path("split_v"),
    ),
    Implementation(
        "diff_attention",
        "sdpa_split_v_batched",
        "torch SDPA, split-V's four products as one call stacked on the batch axis (one launch)",
        _diff_sdpa_path("split_v_batched"),
    ),
    Implementation(
        "diff_attention",
        "flash",
        "flash-attn, four calls over V's halves (GPU, the flash-attn package)",
        _diff_flash,
        _flash_missing,
    ),
    Implementation(
        "diff_attention",
        "flex",
        "FlexAttention, two calls over V of width 2d, torch.compile'd (GPU; a measured candidate)",
        _diff_flex,
        _flex_missing,
    ),
    Implementation(
        "core_attention",
        "sdpa",
        "diffmeg's `SDPACoreAttention`: torch SDPA without the score matrix (the local spec)",
        _sdpa_core,
        spec="local",
    ),
    Implementation(
        "core_attention",
        "transformer_engine",
        "megatron-core's `TEDotProductAttention` (the Transformer Engine spec; context-parallel modes)",
        _te_dot_product_attention,
        _te_missing("TEDotProductAttention", "use --transformer-impl local"),
        spec="transformer_engine",
    ),
    Implementation(
        "norm",
        "local",
        "diffmeg's fp32 RMSNorm (`fusions/rms_norm.py`), sequence-parallel capable (the local spec)",
        _local_norm,
        spec="local",
    ),
    Implementation(
        "norm",
        "torch",
        "the same RMSNorm through torch's `F.rms_norm`: one fused kernel each way on CUDA, no fp32 copy of "
        "the input (a GPU candidate, not yet measured)",
        _torch_norm,
        spec="local",
    ),
    Implementation(
        "norm",
        "transformer_engine",
        "Transformer Engine's norm, fused into the following linear where the spec allows",
        _te_norm,
        _te_missing("Transformer Engine's norm", "use --transformer-impl local"),
        spec="transformer_engine",
    ),
    Implementation(
        "loss",
        "megatron",
        "megatron-core's vocabulary-parallel cross entropy over the whole logits (GPTModel's own loss)",
        _megatron_loss,
    ),
    Implementation(
        "loss",
        "fused",
        "megatron-core's native fused vocabulary-parallel cross entropy (`cross_entropy_loss_fusion`, "
        "'native'): its steps compiled, the fp32 logits turned into the softmax in place and the gradient "
        "returned in bf16 (bf16 runs only; a GPU candidate, not yet measured)",
        _fused_loss,
    ),
    Implementation(
        "loss",
        "chunked",
        "diffmeg's output projection + cross entropy in chunks of tokens, logits recomputed in backward "
        "(`fusions/cross_entropy.py`)",
        _chunked_loss,
    ),
    Implementation(
        "fp8_linear",
        "torchao",
        "torchao's float8 training on megatron-core's parallel linears (`fusions/torchao_fp8.py`): "
        "tensorwise scaling over `torch._scaled_mm` (Ada/Hopper), QKV, out-proj and MLP",
        _torchao_fp8,
        _torchao_fp8_missing,
        spec="local",
    ),
    Implementation(
        "optimizer",
        "megatron",
        "megatron-core's step as built: its fused Adam where Transformer Engine or apex is installed, else "
        "torch's AdamW and Python fallbacks (a host sync per tensor for the grad norm)",
        _megatron_optimizer_step,
    ),
    Implementation(
        "optimizer",
        "fused",
        "the same optimizer with the grad norm and clip on the device, one `_foreach_copy_` to the model's "
        "weights, torch's fused AdamW (CUDA and CPU): no host read in a step, `fusions/optimizer_step.py`; "
        "not where megatron-core has a fused Adam of its own (Transformer Engine or apex)",
        _fused_optimizer_step,
        _fused_optimizer_missing,
    ),
)

AUTO_ORDER: dict[str, tuple[str, ...]] = {
    # SDPA picks its path per key length from measured crossovers (kernels/sdpa_paths.py); the other
    # backends are candidates by name.
    "diff_attention": ("sdpa",),
    "core_attention": ("transformer_engine", "sdpa"),
    "norm": ("transformer_engine", "local"),
    # The fused candidates (the 'torch' norm, the 'fused' loss) are chosen by name only until the lever
    # matrix has timed them on a GPU (docs/gpu.md).
    "loss": ("megatron",),
    "fp8_linear": ("torchao",),
    # megatron-core's step until the lever matrix's "fused optimizer" lever measures the fused one faster
    # on a GPU; 'fused' cannot run where megatron-core steps a fused Adam of its own (TE or apex).
    "optimizer": ("megatron",),
}
"""Per slot, what `auto` tries, first choice first: the first that can run (at build time) is taken."""


def slot(name: str) -> Slot:
    """The slot called `name`."""
    for s in SLOTS:
        if s.name == name:
            return s
    raise DiffmegError(f"no implementation slot {name!r}; the slots are {', '.join(s.name for s in SLOTS)}")


def implementations(slot_name: str) -> tuple[Implementation, ...]:
    """The slot's implementations, in the table's order."""
    slot(slot_name)
    return tuple(i for i in IMPLEMENTATIONS if i.slot == slot_name)


def names(slot_name: str) -> tuple[str, ...]:
    """The slot's implementation names."""
    return tuple(i.name for i in implementations(slot_name))


def choices(slot_name: str) -> tuple[str, ...]:
    """What a flag or config field choosing in this slot accepts: `auto` and every name."""
    return (AUTO, *names(slot_name))


def check_name(slot_name: str, name: str) -> None:
    """Refuse a name that is neither `auto` nor one of the slot's, whether or not it can run here."""
    if name not in choices(slot_name):
        raise DiffmegError(
            f"unknown {slot(slot_name).what} {name!r} (not available in this build); "
            f"choose one of {', '.join(choices(slot_name))}"
        )


def resolve(slot_name: str, name: str = AUTO, spec: str | None = None) -> str:
    """The name `name` stands for at build time: `auto` becomes the slot's first choice that can run here
    (of `spec`'s family, given one); a name this installation can never run is refused in one line."""
    check_name(slot_name, name)
    if name != AUTO:
        reason = implementation(slot_name, name).missing(None)
        if reason is not None:
            raise DiffmegError(reason)
        return name
    if spec is not None and spec not in SPECS:
        raise DiffmegError(f"unknown layer spec {spec!r}; choose one of {', '.join(SPECS)}")
    order = [
        c for c in AUTO_ORDER[slot_name] if spec is None or implementation(slot_name, c).spec in (None, spec)
    ]
    for candidate in order:
        if implementation(slot_name, candidate).missing(None) is None:
            return candidate
    if not order:
        raise DiffmegError(f"no {slot(slot_name).what} of the {spec} spec is registered")
    reason = implementation(slot_name, order[0]).missing(None)  # the first choice's reason: what to change
    raise DiffmegError(reason or f"no {slot(slot_name).what} runs here")


def implementation(slot_name: str, name: str) -> Implementation:
    """The slot's entry called `name` (no availability check)."""
    if name == AUTO:
        name = resolve(slot_name, name)
    check_name(slot_name, name)
    return next(i for i in implementations(slot_name) if i.name == name)


def select(
    slot_name: str, name: str = AUTO, device_type: str | None = None, *, spec: str | None = None
) -> Implementation:
    """The implementation to run: `name` (or `auto`, resolved, among `spec`'s family given one) checked for
    this installation and, given a `device_type`, for tensors of that device type; its reason in one line
    where it cannot run."""
    chosen = implementation(slot_name, resolve(slot_name, name, spec))
    if device_type is not None:
        reason = chosen.missing(device_type)
        if reason is not None:
            raise DiffmegError(reason)
    return chosen


def markdown_table() -> str:
    """docs/implementations.md's table: every slot, what chooses in it, its implementations and `auto`."""
    lines = [
        "| slot | chosen by | implementation | what it is | spec | auto tries |",
        "|---|---|---|---|---|---|",
    ]
    for s in SLOTS:
        for i in implementations(s.name):
            rank = AUTO_ORDER[s.name].index(i.name) + 1 if i.name in AUTO_ORDER[s.name] else None
            auto = f"choice {rank}" if rank else "by name only"
            spec = f"`{i.spec}`" if i.spec else "any"
            lines.append(f"| `{s.name}` | {s.chosen_by} | `{i.name}` | {i.description} | {spec} | {auto} |")
    return "\n".join(lines) + "\n"
