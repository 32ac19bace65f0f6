"""Phase `train`: tokens/s and MFU of a 3B-wide model cut to what fits, DIFF against the Transformer.

Each model is pretrain_diff.py's Trainer on mock data, built by benchmarks/train_step.py and timed by its
own `Trainer.train_step`, megatron-core's fusions compiled by TorchDynamo on a GPU (the runner leaves it
on for this phase there). MFU is reported against the GPU's dense bf16 peak (`mfu`, the field's
definition, which the 45% goal uses) and against the matmul rate the env phase measured
(`mfu_vs_matmul`), and with attention counted as the full square (`mfu_full_square`, Megatron-LM's
convention). With `Plan.train_profile` each row at the first length runs one more step under
torch.profiler: its `profile` says where the step's time goes. After the first length's rows comes the
lever matrix (`Plan.train_levers`: each lever's off twin, then its on run, in this one process; a twin
timed before is reused) and its `levers` rows with each gain; on a GPU then the full-depth rows
(`Plan.train_full_depth`). The distributed optimizer and overlap are levers there: on one GPU DP is 1,
so overlap can only show its overhead, never its gain.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.campaign.part import Part
from benchmarks.campaign.plan import DIST_OPT, OVERLAP, FullDepth, Plan, device_of
from benchmarks.campaign.resume import FROM, reusable, run_key

OVERLAP_ARGS = OVERLAP
"""pretrain_diff.py's overlapped data-parallel communication (Megatron-LM's flags; docs/recipes.md)."""
VARIANTS = {
    "dist-opt": DIST_OPT,
    "dist-opt+overlap": (*DIST_OPT, *OVERLAP_ARGS),
}
VARIANT_NOTE = "one GPU: DP=1, so overlap can only show its overhead here, not its gain"


def phase_train(a: argparse.Namespace, part: Part, deadline: float, plan: Plan) -> None:
    import torch

    from benchmarks import train_step

    device = device_of(a)
    train_step.init_process()
    layers = fit_layers(plan, device)
    compiled = not torch._dynamo.config.disable
    print(f"TorchDynamo (megatron-core's fusions compiled): {compiled}", flush=True)
    print(train_step.format_header(), flush=True)
    timer = _Timer(a, part, deadline, plan, device, layers, compiled)
    if getattr(a, "continue_from", None):  # the runner passes it on only for the same GPU
        from benchmarks.campaign import schema

        earlier = Path(a.continue_from)
        timer.reuse(schema.read(earlier)["train"], earlier.name)
    fits = _fits if device == "cuda" else None  # the full-depth rows: GPU only
    run_matrix(timer, plan, train_runs(plan), full_depth_fits=fits)
    train_step.close_process()


def train_runs(plan: Plan) -> list[tuple[str, str | None]]:
    """(preset, DIFF backend) of the rows at each length: the Transformer, DIFF per backend, DIFF V2 where
    it has a preset."""
    from benchmarks import train_step
    from diffmeg.presets import PRESETS

    base = train_step.baseline_of(plan.train_diff)
    v2 = plan.train_diff.replace("diff-", "diff2-", 1)
    runs: list[tuple[str, str | None]] = [(base, None)]
    runs += [(plan.train_diff, b) for b in plan.train_backends]
    if v2 in PRESETS:  # DIFF V2 (attention by megatron-core's own core): its presets are diff2-*
        runs.append((v2, None))
    return runs


def run_matrix(
    timer: _Timer,
    plan: Plan,
    runs: list[tuple[str, str | None]],
    full_depth_fits: Callable[[Plan, str, FullDepth, int, str], bool] | None,
) -> None:
    """Every run of the train phase in its order: the rows of the first length (profiled), the lever
    matrix and the full-depth rows (where `full_depth_fits` is given: a GPU), then the other lengths; the
    headline figures come first, so a short budget skips the rest."""
    from benchmarks import train_step

    base = train_step.baseline_of(plan.train_diff)
    for i, seq in enumerate(plan.train_seqs):
        for preset, backend in runs:
            impl = backend or ("baseline" if preset == base else "auto")
            row = {"model": preset, "impl": impl, "seq": seq, "variant": None}
            flags = ("--diff-attn-backend", backend) if backend else ()
            timer.run(row, preset, flags, profile=plan.train_profile and i == 0)
        if i == 0:  # the headline figures before the second length: a short budget skips that one
            lever_matrix(timer, plan, seq)
            if plan.train_full_depth and full_depth_fits is not None:
                full_depth(timer, plan.train_full_depth, full_depth_fits)


class _Timer:
    """Runs one model for the train phase, writes its row, and remembers its result by run (`run_key`:
    model, seq, flags, layers, micro-batches, TorchDynamo) so the lever matrix reuses a twin
    the rows above already timed, and a continued phase (`reuse`) one the earlier command timed."""

    def __init__(self, a, part: Part, deadline: float, plan: Plan, device: str, layers: int, compiled):
        self.a, self.part, self.deadline, self.plan, self.device = a, part, deadline, plan, device
        self.layers, self.compiled = layers, compiled
        self.done: dict[tuple, dict] = {}
        self.reused: set[tuple] = set()

    def reuse(self, rows: list[dict], name: str) -> None:
        """Runs of an earlier results file (`name`) measured without error: not timed again here."""
        earlier = reusable(rows, name)
        self.done.update(earlier)
        print(f"--continue {name}: {len(earlier)} runs measured there are not timed again", flush=True)

    def run(
        self,
        row: dict,
        preset: str,
        flags: tuple[str, ...],
        *,
        profile: bool = False,
        layers: int | None = None,
        microbatches: int | None = None,
        seq: int | None = None,
        amortize_dp: int | None = None,
    ) -> dict:
        """The result of `preset` with `flags` (timed now unless timed before), its row added when timed.
        With `amortize_dp` the optimizer step is timed alone and the row also gets tokens/s as a
        `amortize_dp`-way distributed optimizer would see it."""
        seq = seq or row["seq"]
        row = {
            **row,
            "arch": _arch(preset),
            "torch_compile": self.compiled,
            "flags": list(flags),
            "layers": layers or self.layers,
            "microbatches": microbatches or self.plan.train_microbatches,
            "profiled": profile,
        }
        key = run_key(row)
        hit = self.done.get(key)
        if hit is not None and (hit["profiled"] or not profile):  # a profile asked for is measured
            if hit.get(FROM) and key not in self.reused:
                self.reused.add(key)
                self.part.set(_reused=len(self.reused))
                what = f"{preset} s{seq} {' '.join(flags) or '(no flags)'}"
                print(f"reused from {hit[FROM]}: {what}", flush=True)
            return hit
        if time.monotonic() > self.deadline:
            self.part.add(
                "train", {**row, "tokens_per_s": None, "mfu": None, "error": "skipped: time budget"}
            )
            self.part.set(_status="partial", _error="some runs skipped: time budget")
            return {"tokens_per_s": None, "error": "skipped: time budget", "step_s": None, FROM: None}
        r = self.measure(preset, seq, flags, row, amortize=amortize_dp is not None)
        row.update(train_row(r, self.device, self.a.peak, self.a.roof))
        if amortize_dp and r.get("step_s") and r.get("optimizer_s") is not None:
            tokens, opt_s = r["tokens_per_s"] * r["step_s"], r["optimizer_s"]
            row["optimizer_s"] = opt_s
            row["tokens_per_s_amortized"] = tokens / (r["step_s"] - opt_s + opt_s / amortize_dp)
            row["amortize_dp"] = amortize_dp
        self.part.add("train", row)
        self.done[key] = {
            "tokens_per_s": r["tokens_per_s"], "step_s": r.get("step_s"), "optimizer_s": r.get("optimizer_s"),
            "error": r["error"], "profiled": profile, FROM: None,
        }  # fmt: skip
        return self.done[key]

    def measure(self, preset: str, seq: int, flags: tuple[str, ...], row: dict, *, amortize: bool) -> dict:
        """Time one run (benchmarks/train_step.py) as `row` describes it; its train_step result."""
        import torch

        from benchmarks import step_profile, train_step

        opts = train_step.StepOptions(
            tokens_per_microbatch=self.plan.train_tokens_per_microbatch,
            microbatches=row["microbatches"],
            warmup=self.plan.train_warmup,
            iters=self.plan.train_iters,
            vocab_size=self.plan.vocab_size,
            num_layers=row["layers"],
            extra_args=list(flags),
            profile=row["profiled"],
            time_optimizer=amortize,
        )
        r = train_step.run_one(preset, seq, opts, self.device)
        print(train_step.format_row(r, self.a.peak if self.device == "cuda" else None), flush=True)
        if r["profile"]:
            print(f"  one step: {step_profile.format_share(r['profile'])}", flush=True)
        if self.device == "cuda":
            torch.cuda.empty_cache()
        return r


class _Rehearsal(_Timer):
    """A timer that times nothing: it lists the runs the train phase would time, in order (`--plan`)."""

    def __init__(self, plan: Plan, layers: int) -> None:
        a = argparse.Namespace(peak=None, roof=None)
        super().__init__(a, Part(None), float("inf"), plan, "cuda", layers, True)
        self.runs: list[dict] = []

    def measure(self, preset: str, seq: int, flags: tuple[str, ...], row: dict, *, amortize: bool) -> dict:
        self.runs.append(row)
        sizes = {"layers": row["layers"], "microbatches": row["microbatches"]}
        return {**dict.fromkeys(TRAIN_STEP_FIELDS), **sizes, "tokens_per_s": 1.0, "step_s": 1.0}


TRAIN_STEP_FIELDS = ("backend", "layers", "mbs", "microbatches", "tokens_per_s", "tflops", "flops_per_token",
                     "mem_gib", "estimated_gib", "resident_gib", "left_gib", "profile", "step_s",
                     "optimizer_s", "error")  # fmt: skip
"""What `train_row` reads of a benchmarks/train_step.py result."""


def planned_runs(plan: Plan, full_depth_fits: bool = True) -> list[dict]:
    """The rows the train phase times on a GPU, in order, each twin once: the plan's first layer count, the
    full-depth model where `full_depth_fits` (else its cuts). What `--plan` prints and docs/gpu.md cites."""
    timer = _Rehearsal(plan, plan.train_layers[0])
    fits = lambda *_: full_depth_fits  # noqa: E731
    run_matrix(timer, plan, train_runs(plan), full_depth_fits=fits)
    return timer.runs


def measured_seconds_a_run(results: Path) -> tuple[float, str, int, float] | None:
    """Seconds a train run took in the newest GPU results file whose train phase finished: (seconds a
    run, file name, rows, phase seconds), the phase's time over its rows (process start, layer fit and
    compilation included); None where no file has one."""
    from benchmarks.campaign import schema

    for path in sorted(results.glob("campaign-*.json"), reverse=True):  # names end in their UTC time
        try:
            r = schema.read(path)
        except ValueError:
            continue
        info = r["phases"].get("train") or {}
        if r["device_type"] == "cuda" and info.get("status") == "ok" and info.get("seconds") and r["train"]:
            return info["seconds"] / len(r["train"]), path.name, len(r["train"]), info["seconds"]
    return None


def plan_lines(plan: Plan, results: Path) -> list[str]:
    """`--plan`: the train phase's runs in order and their count, with a time estimate where a finished GPU
    train phase is on file under `results`."""
    runs = planned_runs(plan)
    cut = len(planned_runs(plan, full_depth_fits=False))
    kind = "smoke" if plan.train_full_depth is None else "GPU"
    out = [f"train phase, {kind} plan, {plan.train_layers[0]} layers (the first of {plan.train_layers} "
           "that the memory plan fits):"]  # fmt: skip
    for i, row in enumerate(runs, start=1):
        what = f"{row['impl']} {row['variant']}" if row["variant"] else row["impl"]
        other = f", {row['layers']} layers" if row["layers"] != runs[0]["layers"] else ""
        profiled = " (profiled)" if row["profiled"] else ""
        out.append(f"  {i:3d} {row['model']:16s} s{row['seq']:<5d} {what}{profiled}{other}")
    levers = [row for row in runs if row["impl"] == "lever"]
    full = [row for row in runs if row["impl"] == "full-depth"]
    lengths = " and ".join(str(seq) for seq in plan.train_seqs)
    rows = len(runs) - len(levers) - len(full)
    total = (
        f"{len(runs)} train runs: {rows} rows of the models at {lengths}, {len(levers)} lever runs for "
        f"{len(plan.train_levers)} levers (twins timed once)"
    )
    if plan.train_full_depth is None:
        return [*out, total]
    out.append(
        f"{total}, {len(full)} full-depth runs ({cut - len(runs) + len(full)} where the full model does not "
        "fit: its cuts)"
    )
    measured = measured_seconds_a_run(results)
    if measured is not None:
        each, name, rows, seconds = measured
        out.append(
            f"estimate: {each:.1f} s a run (the train phase of benchmarks/results/{name}: {rows} rows in "
            f"{seconds:.1f} s), {each * (len(runs) - len(full)):.0f} s for the {len(runs) - len(full)} runs "
            "besides the full-depth ones, which step 28 layers and 16 micro-batches each"
        )
    return out


def lever_matrix(timer: _Timer, plan: Plan, seq: int) -> None:
    """Each lever's off twin then its on run at `seq` (a twin timed before, here or in the continued file,
    is reused), and a `levers` row with the gain: tokens/s on over off, and where each twin was timed."""
    base = timer.plan.train_diff
    models = {"diff": base, "transformer": _baseline(base)}
    for lever in plan.train_levers:
        preset = models[lever.arch]
        results = {}
        for state, flags in (("off", lever.off), ("on", lever.on)):
            row = {"model": preset, "impl": "lever", "seq": seq, "variant": f"{lever.name}: {state}"}
            if lever.note:
                row["note"] = lever.note
            results[state] = timer.run(row, preset, flags)
        off, on = results["off"], results["on"]
        ok = off["tokens_per_s"] and on["tokens_per_s"]
        timer.part.add("levers", {
            "lever": lever.name, "model": preset, "seq": seq, "on": list(lever.on), "off": list(lever.off),
            "off_tokens_per_s": off["tokens_per_s"], "on_tokens_per_s": on["tokens_per_s"],
            "gain": on["tokens_per_s"] / off["tokens_per_s"] if ok else None,
            "error": None if ok else (on["error"] or off["error"]), "note": lever.note,
            "off_from": off.get(FROM), "on_from": on.get(FROM),
        })  # fmt: skip


def full_depth(
    timer: _Timer, full: FullDepth, fits: Callable[[Plan, str, FullDepth, int, str], bool] | None = None
) -> None:
    """The full model where its memory plan fits (`fits`, default `_fits`); else each fallback cut and a
    straight-line fit of the step time over layers, extrapolated to full depth (`fit` rows)."""
    from diffmeg.presets import get_preset

    for preset in full.models:
        total = get_preset(preset)["num_layers"]
        fit = (fits or _fits)(timer.plan, preset, full, total, timer.device)
        cuts = [total] if fit else list(full.fallback_layers)
        measured = []
        for layers in cuts:
            row = {"model": preset, "impl": "full-depth" if fit else f"cut {layers}", "seq": full.seq,
                   "variant": f"full depth, {full.microbatches} micro-batches"}  # fmt: skip
            r = timer.run(row, preset, (), layers=layers, microbatches=full.microbatches, seq=full.seq,
                          amortize_dp=full.amortize_dp)  # fmt: skip
            if r.get("step_s"):
                measured.append((layers, r))
        if not fit and len(measured) >= 2:
            timer.part.add("train", fitted_row(preset, full, total, measured))


def fitted_row(preset: str, full: FullDepth, total: int, measured: list[tuple[int, dict]]) -> dict:
    """A row for `total` layers from the step times of two or more cuts (a straight line over layers)."""
    (l0, r0), (l1, r1) = measured[0], measured[-1]
    slope = (r1["step_s"] - r0["step_s"]) / (l1 - l0)
    step_s = r0["step_s"] + slope * (total - l0)
    tokens = r0["tokens_per_s"] * r0["step_s"]
    return {
        "model": preset, "impl": "fit", "seq": full.seq, "arch": _arch(preset), "layers": total,
        "variant": f"fit over {l0} and {l1} layers", "tokens_per_s": tokens / step_s, "mfu": None,
        "error": None,
    }  # fmt: skip


def _baseline(preset: str) -> str:
    from benchmarks import train_step

    return train_step.baseline_of(preset) or preset


def _fits(plan: Plan, preset: str, full: FullDepth, layers: int, device: str) -> bool:
    """Whether `layers` of `preset` at the full-depth shape fit 85% of this GPU by the memory plan."""
    import torch

    from benchmarks import train_step
    from diffmeg.run_config import RunConfig
    from diffmeg.training.memory import estimate_memory

    opts = train_step.StepOptions(
        tokens_per_microbatch=plan.train_tokens_per_microbatch,
        microbatches=full.microbatches,
        num_layers=layers,
    )
    run = RunConfig.from_args(train_step.resolve_run_args(preset, full.seq, opts, device))
    return estimate_memory(run, on_gpu=True).total <= 0.85 * torch.cuda.get_device_properties(0).total_memory


def train_row(r: dict, device: str, peak: float | None, roof: float | None) -> dict:
    """A train_step result as a campaign row. MFU against the dense bf16 peak (causal half square, ours,
    and `mfu_full_square`, Megatron-LM's convention) and against the measured matmul rate (none on a CPU:
    its steps run fp32)."""
    tflops = r["tflops"] if device == "cuda" else None
    full = r.get("tflops_full_square") if device == "cuda" else None
    return {
        "backend": r["backend"],
        "layers": r["layers"],
        "micro_batch_size": r["mbs"],
        "microbatches": r["microbatches"],
        "tokens_per_s": r["tokens_per_s"],
        "tflops": r["tflops"],
        "mfu": tflops / peak if (tflops and peak) else None,
        "mfu_full_square": full / peak if (full and peak) else None,
        "mfu_vs_matmul": tflops / roof if (tflops and roof) else None,
        "flops_per_token": r["flops_per_token"],
        "mem_gib": r["mem_gib"],
        "estimated_gib": r["estimated_gib"],
        "resident_gib": r["resident_gib"],
        "left_gib": r["left_gib"],
        "profile": r["profile"],
        "step_s": r.get("step_s"),  # what a continued phase's full-depth fit reads of this row
        "error": r["error"],
    }


def _arch(preset: str) -> str:
    return (
        "transformer"
        if preset.startswith("transformer-")
        else "diff2"
        if preset.startswith("diff2-")
        else "diff"
    )


def fit_layers(plan: Plan, device: str) -> int:
    """The most layers (of plan.train_layers) whose memory plan fits 85% of this GPU (DIFF and baseline)."""
    if device != "cuda":
        return plan.train_layers[-1]
    import torch

    from benchmarks import train_step
    from diffmeg.run_config import RunConfig
    from diffmeg.training.memory import estimate_memory

    free = 0.85 * torch.cuda.get_device_properties(0).total_memory
    for layers in plan.train_layers:
        opts = train_step.StepOptions(
            tokens_per_microbatch=plan.train_tokens_per_microbatch,
            microbatches=plan.train_microbatches,
            num_layers=layers,
        )
        need = max(
            estimate_memory(
                RunConfig.from_args(train_step.resolve_run_args(p, max(plan.train_seqs), opts, device)),
                on_gpu=True,
            ).total
            for p in (plan.train_diff, train_step.baseline_of(plan.train_diff))
        )
        if need <= free:
            return layers
    return plan.train_layers[-1]
