"""The train phase's plan: which model variants are timed against which, and in what order.

Every figure of the train phase is a comparison of two variants (a model with a set of pretrain_diff.py
flags) whose timed windows are interleaved (benchmarks/campaign/interleave.py): a lever against the same
model without it, or two models on the same path (DIFF V1 against the Transformer: the tokens/s ratio). At
most two variants are alive at a time, so consecutive comparisons share a variant where they can: the one
alive stays (the anchor) and only its new partner is built. The order is what the goals need first
(`comparisons`): at the first length each model's defaults and its fast path (every lever expected to
win), DIFF V1 against the Transformer, DIFF V1's attention candidates on the fast path, FP8 on the fast
path (torchao's FP8 refuses the grad-accum fusion, so its twin is the fast path without that fusion,
itself a leave-one-out run against the fast path), DIFF V2 against the Transformer, grouped DIFF V2 (GDA)
against DIFF V2; then the other lengths; then, while time remains, the
other leave-one-out runs (each lever's share: the fast path without it against the fast path).
"""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.campaign.plan import Plan

ARCHS = ("transformer", "diff", "diff2", "gda")
"""The architectures of `Plan.train_models`, in its order."""
NAMES = {"transformer": "Transformer", "diff": "DIFF V1", "diff2": "DIFF V2", "gda": "GDA 4:1"}
GRAD_ACCUM = "grad-accum fusion"
"""The fast-path lever torchao's FP8 refuses (diffmeg.fusions.torchao_fp8.check_fp8)."""
COMPILED = "compiled layers"
"""The fast-path lever that CUDA graphs (`Plan.train_graphs`) replace in their comparison."""


@dataclass(frozen=True)
class Variant:
    """One model built with one set of flags at one length: one worker process, one train row."""

    model: str
    arch: str
    seq: int
    label: str
    """"defaults", "fast path", or what differs from the fast path."""
    flags: tuple[str, ...]
    profile: bool = False
    """One more step under torch.profiler after its first comparison."""

    @property
    def key(self) -> tuple:
        return (self.model, self.seq, self.flags)


@dataclass(frozen=True)
class Comparison:
    """Two variants timed in alternating windows; gain = median tokens/s of `on` over that of `off`."""

    name: str
    """Unique in the plan (the length is part of it)."""
    kind: str
    """"lever": `on` is `off` with a lever pulled; "ratio": two models on the same path."""
    on: Variant
    off: Variant
    group: str
    note: str = ""


class _Paths:
    """The variants of one plan at one length, by architecture."""

    def __init__(self, plan: Plan, seq: int, profile: bool) -> None:
        self.plan, self.seq, self.profile = plan, seq, profile
        self.models = dict(zip(ARCHS, plan.train_models, strict=False))
        self.fast_levers = dict(plan.train_fast)

    def variant(self, arch: str, label: str, flags: tuple[str, ...], profile: bool = False) -> Variant:
        return Variant(self.models[arch], arch, self.seq, label, flags, profile)

    def defaults(self, arch: str) -> Variant:
        return self.variant(arch, "defaults", ())

    def fast(
        self, arch: str, without: str | None = None, extra: tuple[str, ...] = (), label: str = ""
    ) -> Variant:
        flags = tuple(f for name, fl in self.plan.train_fast if name != without for f in fl)
        if not label:
            label = "fast path" if without is None else f"fast path without {without}"
        return self.variant(arch, label, (*flags, *extra), self.profile and not (without or extra))


def comparisons(plan: Plan) -> list[Comparison]:
    """The train phase's comparisons, in the order they run (module docstring)."""
    first, *others = plan.train_seqs
    out = _first_length(plan, _Paths(plan, first, plan.train_profile))
    for seq in others:
        out += _models(_Paths(plan, seq, False), "other lengths")
    return out + _leave_one_out(plan, _Paths(plan, first, False))


def _ratio(p: _Paths, on: Variant, off: Variant, group: str, path: str = "fast path") -> Comparison:
    name = f"{NAMES[on.arch]} / {NAMES[off.arch]} ({path}) s{p.seq}"
    return Comparison(name, "ratio", on, off, group, f"tokens/s of {NAMES[on.arch]} over {NAMES[off.arch]}")


def _lever(p: _Paths, name: str, on: Variant, off: Variant, group: str, note: str = "") -> Comparison:
    return Comparison(f"{name} ({on.arch}) s{p.seq}", "lever", on, off, group, note)


def _models(p: _Paths, group: str) -> list[Comparison]:
    """Each model's defaults against its fast path, DIFF V1 against the Transformer on the fast path, and
    DIFF V2 against DIFF V1 (each model's fast path is the anchor of its defaults)."""
    out = [
        _lever(p, "fast path vs defaults", p.fast("transformer"), p.defaults("transformer"), group),
        _ratio(p, p.fast("diff"), p.fast("transformer"), group),
        _lever(p, "fast path vs defaults", p.fast("diff"), p.defaults("diff"), group),
    ]
    if "diff2" in p.models:
        out += [
            _ratio(p, p.fast("diff2"), p.fast("diff"), group),
            _lever(p, "fast path vs defaults", p.fast("diff2"), p.defaults("diff2"), group),
        ]
    return out


def _first_length(plan: Plan, p: _Paths) -> list[Comparison]:
    """The models' rows, then DIFF V1's attention candidates, FP8 (with its grad-accum twins) and DIFF V2
    against the Transformer, chained so that one variant of each comparison is alive from the one before."""
    out = _models(p, "models")[:3]  # DIFF V2 comes last here: the Transformer's fast path is alive then
    fast_d = p.fast("diff")
    for backend in plan.train_backends:
        candidate = p.fast("diff", extra=("--diff-attn-backend", backend), label=f"fast path, {backend}")
        note = "sdpa at this length: the path of kernels/sdpa_paths.py's CUDA_CROSSOVERS"
        out.append(_lever(p, f"attention {backend} vs sdpa", candidate, fast_d, "attention", note))
    anchor_t = p.fast("transformer")
    if plan.train_fp8 and GRAD_ACCUM in p.fast_levers:
        note = f"the twin is the fast path without the {GRAD_ACCUM}, which torchao's FP8 refuses"
        fp8 = {arch: p.fast(arch, GRAD_ACCUM, plan.train_fp8, f"fast path without {GRAD_ACCUM}, FP8")
               for arch in ("diff", "transformer")}  # fmt: skip
        bare = {arch: p.fast(arch, GRAD_ACCUM) for arch in ("diff", "transformer")}
        out += [
            _lever(p, f"{GRAD_ACCUM}, leave-one-out", fast_d, bare["diff"], "fp8"),
            _lever(p, "FP8 on the fast path", fp8["diff"], bare["diff"], "fp8", note),
            _ratio(p, fp8["diff"], fp8["transformer"], "fp8", "FP8 fast path"),
            _lever(p, "FP8 on the fast path", fp8["transformer"], bare["transformer"], "fp8", note),
            _lever(p, f"{GRAD_ACCUM}, leave-one-out", anchor_t, bare["transformer"], "fp8"),
        ]
    if "diff2" in p.models:
        out += [
            _ratio(p, p.fast("diff2"), anchor_t, "models"),
            _lever(p, "fast path vs defaults", p.fast("diff2"), p.defaults("diff2"), "models"),
        ]
    if "gda" in p.models:  # grouped DIFF V2 against DIFF V2, whose fast path is alive from the row before
        out.append(_ratio(p, p.fast("gda"), p.fast("diff2"), "models"))
    return out


def _leave_one_out(plan: Plan, p: _Paths) -> list[Comparison]:
    """Each lever's share at the first length: the fast path without it against the fast path (the
    grad-accum fusion's ran with FP8), and CUDA graphs in place of the compiled layers."""
    done = GRAD_ACCUM if plan.train_fp8 else None
    wanted = (
        plan.train_leave_out
        if plan.train_leave_out is not None
        else tuple(
            (arch, name) for arch in ("diff", "transformer") for name, _ in plan.train_fast if name != done
        )
    )
    out = []
    for arch, name in wanted:
        out.append(_lever(p, f"{name}, leave-one-out", p.fast(arch), p.fast(arch, name), "leave-one-out"))
        if name == COMPILED and plan.train_graphs:
            graphs = p.fast(arch, COMPILED, plan.train_graphs, "fast path, CUDA graphs for compiled layers")
            note = "CUDA graphs and compiled layers exclude each other: each against the fast path"
            out.append(_lever(p, "CUDA graphs in place of compiled layers", graphs, p.fast(arch),
                              "leave-one-out", note))  # fmt: skip
    return out


def alive_after(alive: tuple[tuple, ...], comparison: Comparison) -> tuple[tuple[tuple, ...], list[Variant]]:
    """The variants alive (keys, at most two) once `comparison` has its twins, and those to build for it:
    a twin alive from the comparison before stays, every other variant is stopped first (memory)."""
    twins = (comparison.off, comparison.on)
    build = [v for v in twins if v.key not in alive]
    return tuple(v.key for v in twins), build
