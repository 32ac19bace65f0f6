"""Step time of one model in layouts that differ only in one feature, timed in one job: overlapped
data-parallel communication (issue 23, item 1) and the interleaved pipeline schedule (item 4).

    torchrun --nproc_per_node 2 benchmarks/parallel_step.py             # CPU (gloo): the default model
    torchrun --nproc_per_node 8 benchmarks/parallel_step.py --model diff-3b --num-layers 8 --bf16 \\
        --mock-data --seq-length 4096 --micro-batch-size 1              # a GPU node (nccl): DP 8, PP 2 x DP 4

Each item builds two Trainers (pretrain_diff.py's, on mock data, same seed, so the same weights and
batches) and times their `train_step` in turn, A B B A A B ..., so both meet the same host (a shared or
noisy host changes speed over minutes); each rank holds both models at once. A step's time is the slowest
rank's, from a barrier to the end of `train_step` (CUDA synchronized); with --overlap-param-gather a
step's all-gathers run in the next step's forward, which is timed with it. Prints per variant the median,
min and max of --steps steps after --warmup, the ratio of the medians and the median of the ratios of the
steps taken side by side (less sensitive to the host's drift), and what the feature should buy; the
largest difference of the two variants' losses and grad norms shows that both trained the same model.
- overlap: DP = world size, the distributed optimizer, without and with --overlap-grad-reduce and
  --overlap-param-gather and --ddp-bucket-size (without them megatron-core reduces one bucket per buffer;
  default 1M parameters on CPU, megatron-core's on GPU); --dp-microbatches micro-batches per rank.
- interleaved: PP = --pipeline-size (DP = world / PP), --pp-microbatches micro-batches per rank, without
  and with --num-layers-per-virtual-pipeline-stage (layers / PP / --chunks); the bubble the schedule
  predicts is the dry run's, (PP - 1) / micro-batches, divided by the chunks. megatron-core keeps the
  number of virtual stages in global state: the script sets it before each variant's step.
Other arguments are pretrain_diff.py's (defaults on CPU: CPU_FLAGS). On CPU each rank uses one thread.
On one host of 2 cores the ranks share them, so CPU figures show that the features work and what they
cost or buy on gloo, not what GPUs with NCCL get. Prints a table; never a timed test.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

CPU_FLAGS = [
    "--model", "diff-tiny", "--mock-data", "--vocab-size", "8192", "--hidden-size", "512",
    "--num-attention-heads", "4", "--kv-channels", "64", "--ffn-hidden-size", "1344",
    "--seq-length", "256", "--micro-batch-size", "2", "--lr-warmup-iters", "2", "--eval-iters", "0",
]  # fmt: skip
"""diff-tiny's 4 layers at hidden 512 (head dim 64): 20.8M parameters, 60% of them in the layers."""
OVERLAP = ["--overlap-grad-reduce", "--overlap-param-gather"]


@dataclass
class Variant:
    label: str
    flags: list[str]
    chunks: int | None = None
    """Virtual pipeline stages (None: no interleaving), set in megatron-core's state around each step."""
    trainer: object = None
    times: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--items", nargs="+", choices=["overlap", "interleaved"], default=None)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=2, help="first steps per variant left out")
    parser.add_argument(
        "--ddp-bucket-size",
        type=int,
        default=None,
        help="parameters per bucket (default 1M on CPU: several for the small model; megatron-core's on GPU)",
    )
    parser.add_argument("--dp-microbatches", type=int, default=1, help="per rank, overlap item")
    parser.add_argument("--pipeline-size", type=int, default=2)
    parser.add_argument("--pp-microbatches", type=int, default=4, help="per rank, interleaved item")
    parser.add_argument("--chunks", type=int, default=2, help="model chunks per rank with interleaving")
    bench, flags = parser.parse_known_args()

    import torch
    from megatron.core import parallel_state

    from benchmarks import model_flags
    from diffmeg import runtime
    from diffmeg.training.arguments import resolve_args

    flags, on_cpu = model_flags(flags, CPU_FLAGS)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    items = bench.items or (["overlap", "interleaved"] if world > 1 else [])
    if world == 1 or not items:
        raise SystemExit("launch with torchrun --nproc_per_node N (N >= 2): both items need several ranks")
    base = resolve_args(flags, world_size=world)
    mbs, iters = base.micro_batch_size, bench.warmup + bench.steps + 1
    common = [*flags, "--train-iters", str(iters)]
    load = os.getloadavg()

    sections = []
    if "overlap" in items:
        layout = [*common, "--use-distributed-optimizer"]
        layout += ["--global-batch-size", str(world * mbs * bench.dp_microbatches)]
        bucket = bench.ddp_bucket_size or (1_000_000 if on_cpu else None)
        overlap = [*OVERLAP, *(["--ddp-bucket-size", str(bucket)] if bucket else [])]  # only used with them
        pair = [Variant("dist-opt", layout), Variant("dist-opt + overlaps", [*layout, *overlap])]
        sections.append(("overlap", pair))
    if "interleaved" in items:
        pp, chunks = bench.pipeline_size, bench.chunks
        per_stage = base.num_layers // pp
        if world % pp or per_stage % chunks:
            raise SystemExit(
                f"{base.num_layers} layers over PP {pp} do not split into {chunks} chunks per rank, or "
                f"{world} ranks are not a multiple of PP: change --pipeline-size, --chunks or --num-layers"
            )
        layout = [*common, "--pipeline-model-parallel-size", str(pp)]
        layout += ["--global-batch-size", str(world // pp * mbs * bench.pp_microbatches)]
        vp = ["--num-layers-per-virtual-pipeline-stage", str(per_stage // chunks)]
        interleaved = Variant(f"interleaved 1F1B, {chunks} chunks", [*layout, *vp], chunks)
        pair = [Variant("1F1B", layout), interleaved]
        sections.append(("interleaved", pair))

    rank = int(os.environ.get("RANK", "0"))
    log = print if rank == 0 else (lambda *a, **k: None)
    device = "CPU, 1 thread per rank" if on_cpu else torch.cuda.get_device_name()
    log(f"{world} ranks ({device}); host: {os.cpu_count()} CPUs, load average {load[0]:.1f} at start")
    log(f"model: {' '.join(flags)}")
    try:
        for item, pair in sections:
            if parallel_state.model_parallel_is_initialized():  # the next item has another layout
                parallel_state.destroy_model_parallel()
            for variant in pair:
                variant.trainer = _build(variant)
            _time(pair, bench.warmup + bench.steps)
            _report(item, pair, bench, log)
        log(f"load average at end: {os.getloadavg()[0]:.1f}")
    finally:
        runtime.teardown()
    return 0


def _virtual_stages(chunks: int | None) -> None:
    """megatron-core's global virtual-pipeline state for a run with `chunks` model chunks per rank."""
    from megatron.core import parallel_state

    parallel_state.set_virtual_pipeline_model_parallel_world_size(chunks)
    parallel_state.set_virtual_pipeline_model_parallel_rank(0 if chunks else None)


def _build(variant: Variant):
    from diffmeg.run_config import RunConfig
    from diffmeg.training.arguments import resolve_args
    from diffmeg.training.trainer import Trainer

    _virtual_stages(variant.chunks)
    with contextlib.redirect_stdout(io.StringIO()):  # the run summaries would interleave with the table
        trainer = Trainer(RunConfig.from_args(resolve_args(variant.flags)), callbacks=[])
    for chunk in trainer.model:
        chunk.train()
    return trainer


def _time(pair: list[Variant], steps: int) -> None:
    """`steps` train steps of each variant, in turns A B B A ...; times are the slowest rank's."""
    import time

    import torch

    from diffmeg import collectives

    for step in range(steps):
        for variant in pair if step % 2 == 0 else reversed(pair):
            _virtual_stages(variant.chunks)
            torch.distributed.barrier()
            start = time.perf_counter()
            out = variant.trainer.train_step()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            variant.times.append(time.perf_counter() - start)
            variant.losses.append(float(out.loss) if out.loss is not None else float("nan"))
            variant.grad_norms.append(float(out.grad_norm) if out.grad_norm is not None else float("nan"))
    for variant in pair:
        variant.times = collectives.all_reduce(variant.times, op=collectives.MAX).tolist()


def _max_difference(a: list[float], b: list[float]) -> float:
    """Largest |a - b| / |a| over the steps, over every rank that holds the values."""
    from diffmeg import collectives

    pairs = [(x, y) for x, y in zip(a, b, strict=True) if x == x and y == y]  # x == x: not NaN
    local = [abs(x - y) / max(abs(x), 1e-30) for x, y in pairs]
    return float(collectives.all_reduce([max(local, default=0.0)], op=collectives.MAX).item())


def _report(item: str, pair: list[Variant], bench: argparse.Namespace, log) -> None:
    from diffmeg.training import ddp
    from diffmeg.training.dry_run import features, pipeline_bubble

    trainer = pair[0].trainer
    p = trainer.run.parallel
    runs = [variant.trainer.run for variant in pair]
    micro = trainer.run.num_microbatches
    tokens = trainer.run.training.micro_batch_size * trainer.run.model.seq_length
    layout = f"DP {p.data_parallel_size}" if item == "overlap" else f"PP {p.pipeline_model_parallel_size}"
    if item == "interleaved" and p.data_parallel_size > 1:
        layout += f" x DP {p.data_parallel_size}"
    title = {"overlap": "overlapped data-parallel communication", "interleaved": "interleaved pipeline"}
    log("")
    log(
        f"{title[item]}: {layout}, {trainer.num_parameters / 1e6:.1f}M parameters, {micro} x {tokens} "
        f"tokens per rank a step (micro-batches x tokens); {bench.steps} steps after {bench.warmup} warmup"
    )
    extra = "buckets" if item == "overlap" else " bubble"
    log(f"{'variant':<28} {extra:>7} {'median ms':>10} {'min ms':>8} {'max ms':>8}")
    medians = []
    for variant, run in zip(pair, runs, strict=True):
        timed = variant.times[bench.warmup :]
        medians.append(statistics.median(timed))
        column = (
            f"{ddp.bucket_count(variant.trainer.model):>7}"
            if item == "overlap"
            else f"{pipeline_bubble(run):>7.3f}"
        )
        log(
            f"{variant.label:<28} {column} {medians[-1] * 1000:>10.0f} {min(timed) * 1000:>8.0f} "
            f"{max(timed) * 1000:>8.0f}"
        )
    ratio = medians[1] / medians[0]
    paired = statistics.median(b / a for a, b in zip(*(v.times[bench.warmup :] for v in pair), strict=True))
    losses = _max_difference(pair[0].losses, pair[1].losses)
    norms = _max_difference(pair[0].grad_norms, pair[1].grad_norms)
    log(f"with / without: {ratio:.3f}x the median step time, {paired:.3f}x the median of steps side by side")
    log(f"same training: losses differ by at most {losses:.1e} (relative), grad norms by {norms:.1e}")
    if item == "overlap":
        log(f"should buy: {features(runs[1])['overlap_grad_reduce']}")
        log(f"            {features(runs[1])['overlap_param_gather']}")
    else:
        b0, b1 = pipeline_bubble(runs[0]), pipeline_bubble(runs[1])
        log(
            f"should buy: {features(runs[1])['interleaved_pipeline']}; a step of (1 + bubble) x compute "
            f"takes {(1 + b1) / (1 + b0):.3f}x as long if the traffic were free"
        )


if __name__ == "__main__":  # the dist-checkpoint writer uses a spawn context: the guard is required
    sys.exit(main())
