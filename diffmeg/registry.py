"""The table of interchangeable implementations: a slot per op, a row per implementation of it.

A row (`Entry`) names its slot, its name, its code as a `module:attr` string, imported only when the row
is chosen (reading the table loads no kernel, GPU package or megatron-core module), one line saying what
it is, and where it cannot run everywhere its check: another `module:attr`, a function beside the code,
`(device_type) -> str | None`, the one-line reason with the fix, or None where it runs (device_type None:
at build time, is it installed?; "cpu"/"cuda": for tensors of that device type).

A slot (`Slot`) says what `auto` tries, first choice first, and what that order rests on (a results file,
or why it waits), and what chooses in it: a flag, declared here once, or the layer spec. From a slot's
flag follow the argument parser's flag and choices (`diffmeg.training.arguments`), the run
configuration's field (`RunConfig.impls`, named as the flag) and what an args.json without it meant
(`auto`: `diffmeg.checkpoints.SAVED_ARGS_DEFAULTS`); from the rows, docs/implementations.md
(`markdown_tables`) and the GPU campaign's levers (`levers`: the rows that are GPU candidates).

A new implementation is its module (beside its eager twin), its row here and its test. Read by the model
config (names), the builders (`select`), the flags, the campaign and the docs; megatron-core's own
switches (`--cross-entropy-loss-fusion`, `--gradient-accumulation-fusion`) stay its config booleans.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from diffmeg.errors import DiffmegError

AUTO = "auto"
SPECS = ("local", "transformer_engine")
"""The layer spec families (`--transformer-impl`): megatron-core's local modules or Transformer Engine's."""
H100_RESULTS = "benchmarks/results/campaign-nvidia-h100-80gb-hbm3-20261124T071510Z.json"


@dataclass(frozen=True)
class Slot:
    """An op with interchangeable implementations."""

    name: str
    what: str
    """What its implementations are, as an error message names one ("differential attention backend")."""
    purpose: str
    """What the choice covers (the flag's help and the docs say it)."""
    auto: tuple[str, ...]
    """What `auto` tries, first choice first: the first that can run at build time (of the spec's family,
    where a spec chooses)."""
    rests_on: str
    """Why `auto` is that order: the results file that measured it, or why it waits."""
    flag: str | None = None
    """The flag that chooses (default `auto`); None: the layer spec (`--transformer-impl`) chooses."""

    @property
    def field(self) -> str | None:
        """The flag's name in the parsed arguments, args.json and `RunConfig.impls` (`norm_impl`)."""
        return self.flag.removeprefix("--").replace("-", "_") if self.flag else None


@dataclass(frozen=True)
class Entry:
    """One implementation of a slot's op."""

    slot: str
    name: str
    """Its name in flags, configs and docs, unique within the slot."""
    target: str
    """`module:attr` of the implementation: a function, or a module class for a spec."""
    description: str
    check: str | None = None
    """`module:attr` of its availability check (`unavailable`); None: it runs everywhere."""
    spec: str | None = None
    """The layer spec family it belongs to (`SPECS`); None: any. A flag offers every entry but the
    Transformer Engine spec's own, which that spec chooses."""
    lever: str | None = None
    """Its name in the GPU campaign's lever matrix while it is a candidate `auto` does not try yet."""

    def load(self) -> Any:
        """The implementation (imported now)."""
        return _attr(self.target)

    def unavailable(self, device_type: str | None = None) -> str | None:
        """Why it cannot run (at build time, or for tensors of `device_type`), in one line; None: it can."""
        return _attr(self.check)(device_type) if self.check else None


def _attr(path: str) -> Any:
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


_TE_CHECK = "diffmeg.runtime:transformer_engine_unavailable"
_NOT_MEASURED = "not yet measured on a GPU: the lever matrix times the candidates (docs/gpu.md)"

SLOTS = (
    Slot(
        "diff_attention",
        "differential attention backend",
        "DIFF V1's attention kernels",
        ("sdpa",),
        f"the fastest DIFF backend an H100 measured ({H100_RESULTS}, against the Triton kernel since "
        "removed); its path per key length: `kernels/sdpa_paths.py`",
        "--diff-attn-backend",
    ),
    Slot(
        "sdpa_kernel",
        "SDPA kernel preference",
        "the kernel torch's SDPA tries first in every core attention (DIFF V1's SDPA backends, the "
        "baseline's and DIFF V2's SDPA core)",
        ("torch",),
        _NOT_MEASURED,
        "--sdpa-backend",
    ),
    Slot(
        "core_attention",
        "core attention",
        "the core attention of the Transformer baseline and DIFF V2",
        ("transformer_engine", "sdpa"),
        "each spec's own core",
    ),
    Slot(
        "norm",
        "norm",
        "the local spec's block and final RMSNorm and DIFF V1's head norm (the Transformer Engine spec "
        "keeps TE's block norms)",
        ("transformer_engine", "local"),
        f"each spec's own norm; {_NOT_MEASURED}",
        "--norm-impl",
    ),
    Slot(
        "fp8_linear",
        "FP8 linear converter",
        "the local spec's linears under `--fp8-format` (the Transformer Engine spec's are TE's: "
        "megatron-core runs them in FP8 from the config)",
        ("torchao",),
        "the only one",
    ),
    Slot(
        "optimizer",
        "optimizer step",
        "the step after backward: grad norm, clipping, AdamW, the copy to the weights",
        ("megatron",),
        _NOT_MEASURED,
        "--optimizer-impl",
    ),
)

_SDPA = "diffmeg.kernels.sdpa"
_SDPA_KERNELS = "diffmeg.kernels.sdpa_backends"
ENTRIES = (
    Entry("diff_attention", "reference", "diffmeg.kernels.reference:diff_attention_reference",
          "plain math in the input dtype (float64 for the golden tests); materialises both maps; custom "
          "masks and attention dropout"),
    Entry("diff_attention", "sdpa", f"{_SDPA}:diff_attention_sdpa",
          "torch SDPA, combined in fp32; the path per key length from measured crossovers "
          "(`kernels/sdpa_paths.py`: two calls sharing V, or split-V on a GPU where it measured faster)"),
    Entry("diff_attention", "sdpa_two_call", f"{_SDPA}:diff_attention_two_call",
          "torch SDPA, always two calls sharing V of width 2d (a path `sdpa` chooses among)"),
    Entry("diff_attention", "sdpa_split_v_batched", f"{_SDPA}:diff_attention_split_v_batched",
          "torch SDPA, split-V's four products as one call stacked on the batch axis (one launch)",
          lever="attention sdpa_split_v_batched vs sdpa"),
    Entry("diff_attention", "sdpa_split_v", f"{_SDPA}:diff_attention_split_v",
          "torch SDPA, always four calls over V's d-wide halves (equal head sizes: flash kernels on a GPU)",
          lever="attention sdpa_split_v vs sdpa"),
    Entry("sdpa_kernel", "torch", "contextlib:nullcontext",
          "torch's own order (torch 2.13: flash, memory-efficient, math, cuDNN)"),
    Entry("sdpa_kernel", "cudnn", f"{_SDPA_KERNELS}:cudnn_first",
          "cuDNN's attention first, torch's order behind it (cuDNN takes DIFF's V of 2d in one call)",
          f"{_SDPA_KERNELS}:gpu_unavailable", lever="cuDNN attention first"),
    Entry("sdpa_kernel", "flash", f"{_SDPA_KERNELS}:flash_first", "the flash kernel first, torch's order "
          "behind it", f"{_SDPA_KERNELS}:gpu_unavailable"),
    Entry("sdpa_kernel", "efficient", f"{_SDPA_KERNELS}:efficient_first", "the memory-efficient kernel "
          "first, torch's order behind it", f"{_SDPA_KERNELS}:gpu_unavailable"),
    Entry("sdpa_kernel", "math", f"{_SDPA_KERNELS}:math_only",
          "the math kernel only (on a CPU torch ignores priorities, so it restricts), for checks"),
    Entry("core_attention", "sdpa", "diffmeg.core_attention:SDPACoreAttention",
          "diffmeg's `SDPACoreAttention`: torch SDPA without the score matrix", spec="local"),
    Entry("core_attention", "transformer_engine", "megatron.core.extensions.transformer_engine:"
          "TEDotProductAttention", "megatron-core's `TEDotProductAttention` (context-parallel modes)",
          _TE_CHECK, spec="transformer_engine"),
    Entry("norm", "local", "diffmeg.fusions.rms_norm:RMSNorm",
          "diffmeg's fp32 RMSNorm (`fusions/rms_norm.py`), sequence-parallel capable", spec="local"),
    Entry("norm", "torch", "diffmeg.fusions.rms_norm:TorchRMSNorm",
          "the same RMSNorm through torch's `F.rms_norm`: one fused kernel each way on CUDA, no fp32 copy of "
          "the input", spec="local", lever="torch norm"),
    Entry("norm", "transformer_engine", "megatron.core.extensions.transformer_engine:TENorm",
          "Transformer Engine's norm, fused into the following linear where the spec allows", _TE_CHECK,
          spec="transformer_engine"),
    Entry("fp8_linear", "torchao", "diffmeg.fusions.torchao_fp8:TorchaoFp8",
          "torchao's float8 training on megatron-core's parallel linears (`fusions/torchao_fp8.py`): "
          "tensorwise scaling over `torch._scaled_mm` (Ada/Hopper), QKV, out-proj and MLP",
          "diffmeg.fusions.torchao_fp8:converter_unavailable", spec="local"),
    Entry("optimizer", "megatron", "diffmeg.fusions.optimizer_step:keep_megatron_step",
          "megatron-core's step as built: its fused Adam where Transformer Engine or apex is installed, "
          "else torch's AdamW and Python fallbacks (a host sync per tensor for the grad norm)"),
    Entry("optimizer", "fused", "diffmeg.fusions.optimizer_step:apply_fused_step",
          "grad norm and clip on the device, one `_foreach_copy_` to the weights, torch's fused AdamW (CUDA "
          "and CPU): no host read in a step (`fusions/optimizer_step.py`); not beside megatron-core's own "
          "fused Adam (Transformer Engine or apex)", "diffmeg.fusions.optimizer_step:fused_step_unavailable",
          lever="fused optimizer"),
)  # fmt: skip


RETIRED_AT = "e01f101"
"""The commit that last holds the names in `RETIRED` (`git show e01f101:diffmeg/kernels/flex.py`)."""
RETIRED: dict[str, tuple[str, ...]] = {"diff_attention": ("flash", "flex")}
"""Names that left their slot because no measurement picked them (flash-attn: not on the lent GPUs, whose
flash kernel `sdpa_split_v` runs through torch; FlexAttention: never timed): a config or a saved args.json
naming one is refused in one line saying so."""


def slot(name: str) -> Slot:
    """The slot called `name`."""
    for s in SLOTS:
        if s.name == name:
            return s
    raise DiffmegError(f"no implementation slot {name!r}; the slots are {', '.join(s.name for s in SLOTS)}")


def flagged() -> tuple[Slot, ...]:
    """The slots a flag chooses in."""
    return tuple(s for s in SLOTS if s.flag)


def entries(slot_name: str) -> tuple[Entry, ...]:
    """The slot's rows, in the table's order."""
    slot(slot_name)
    return tuple(e for e in ENTRIES if e.slot == slot_name)


def names(slot_name: str) -> tuple[str, ...]:
    """Every row's name (the spec's own included)."""
    return tuple(e.name for e in entries(slot_name))


def choices(slot_name: str) -> tuple[str, ...]:
    """What the slot's flag and config field accept: `auto` and every entry but the TE spec's own."""
    return (AUTO, *(e.name for e in entries(slot_name) if e.spec != "transformer_engine"))


def check_name(slot_name: str, name: str) -> None:
    """Refuse a name the slot's flag does not offer, whether or not it can run here."""
    if name in choices(slot_name):
        return
    s = slot(slot_name)
    problem = f"unknown {s.what} {name!r} (not available in this build)"
    if name in RETIRED.get(s.name, ()):
        problem = f"{s.what} {name!r} left the package (no measurement picked it; git keeps it at "
        problem += f"{RETIRED_AT})"
    elif name in names(s.name):
        problem = f"{s.what} {name!r} is the Transformer Engine spec's own (--transformer-impl chooses it)"
    raise DiffmegError(f"{problem}; choose one of {', '.join(choices(s.name))}")


def entry(slot_name: str, name: str) -> Entry:
    """The slot's row called `name` (`auto`: resolved), without checking that it can run."""
    name = resolve(slot_name) if name == AUTO else name
    found = [e for e in entries(slot_name) if e.name == name]
    if not found:
        check_name(slot_name, name)  # no such row: refused, naming the choices
    return found[0]


def resolve(slot_name: str, name: str = AUTO, spec: str | None = None) -> str:
    """The name `name` stands for at build time: `auto` becomes the slot's first choice that can run here
    (of `spec`'s family, given one); a name this installation can never run is refused in one line."""
    if spec is not None and spec not in SPECS:
        raise DiffmegError(f"unknown layer spec {spec!r}; choose one of {', '.join(SPECS)}")
    if name != AUTO:
        if (reason := entry(slot_name, name).unavailable()) is not None:
            raise DiffmegError(reason)
        return name
    order = [e for e in (entry(slot_name, n) for n in slot(slot_name).auto) if spec in (None, e.spec)]
    for candidate in order:
        if candidate.unavailable() is None:
            return candidate.name
    if not order:
        raise DiffmegError(f"no {slot(slot_name).what} of the {spec} spec is registered")
    raise DiffmegError(order[0].unavailable())  # the first choice's reason: what to change


def select(
    slot_name: str, name: str = AUTO, device_type: str | None = None, *, spec: str | None = None
) -> Entry:
    """The row to run: `name` (`auto` resolved, among `spec`'s family given one) checked for this
    installation and, given a `device_type`, for tensors of that device type; its reason in one line where
    it cannot run."""
    chosen = entry(slot_name, resolve(slot_name, name, spec))
    if device_type is not None and (reason := chosen.unavailable(device_type)) is not None:
        raise DiffmegError(reason)
    return chosen


def levers(slot_name: str) -> tuple[tuple[str, tuple[str, str]], ...]:
    """The slot's GPU candidates as the campaign's levers: (lever name, the flags that pull it)."""
    return tuple((e.lever, (slot(e.slot).flag, e.name)) for e in entries(slot_name) if e.lever)


def markdown_tables() -> str:
    """docs/implementations.md's tables: the slots (what chooses, what `auto` tries and why), the rows."""
    lines = ["| slot | covers | chosen by | auto tries | which rests on |", "|---|---|---|---|---|"]
    for s in SLOTS:
        by = f"`{s.flag}`" if s.flag else "the spec (`--transformer-impl`)"
        auto = ", then ".join(f"`{name}`" for name in s.auto)
        lines.append(f"| `{s.name}` | {s.purpose} | {by} | {auto} | {s.rests_on} |")
    lines += [
        "",
        "| slot | implementation | what it is | code | spec | GPU lever |",
        "|---|---|---|---|---|---|",
    ]
    for e in ENTRIES:
        spec = f"`{e.spec}`" if e.spec else "any"
        code = e.target.removeprefix("diffmeg.")
        lines.append(f"| `{e.slot}` | `{e.name}` | {e.description} | `{code}` | {spec} | {e.lever or ''} |")
    return "\n".join(lines) + "\n"
