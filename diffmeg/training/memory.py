"""Per-GPU memory plan: weights, gradients, optimizer state and activations, before anything is queued;
and the guard that holds it against the device before the model is built.

Activation terms count what autograd keeps for backward in *our* layer (checked tensor by tensor with
`torch.autograd.graph.saved_tensors_hooks` in tests/training/test_memory.py), per token and layer:
  local RMSNorm (x, normed, output; fp32 internals)       3 x H  (x2: input norm and pre-MLP norm)
  attention, fused kernels (GPU: q, k, v, both map outputs, head-norm input/normed, proj input)
                                                           6 Q + K + V       (Q = 2h d, K = V = 2g d)
  attention, math path (CPU SDPA when V is 2d wide, reference): q1/q2, k1/k2 and V expanded to
  every head, both probability maps, o2, head-norm input/normed, proj input
                                                           7 Q + 2 h s
  baseline attention (SDPA core of the local spec, or TE): post-RoPE q and k, the fused QKV output, the
  output, an fp32 log-sum-exp per head                     3 Q + 3 K + heads   (Q = h d, K = g d)
  DIFF V2: the baseline's terms over its 2h query heads (Q = 2h d, K = g d), plus the fp32 sigmoid(lambda)
  (h), the combined heads going into the output projection (h d), and under bf16/fp16 the fp32 copy of
  the core output that the pair combination keeps for lambda's gradient (4 bytes x Q)
`attention_kernel` says which attention terms apply to the model that is built.
  SwiGLU MLP, unfused (CPU): fc1 output, silu, product, fc2 input                      5 F
  SwiGLU MLP, fused (GPU: transformer_config turns bias_activation_fusion on): megatron-core's
  SwiGLUFunction keeps fc1's output and recomputes the rest; fc2 keeps its input         3 F
Selective recompute keeps only the core's inputs; full recompute keeps each layer's input. The loss
adds the logits, the fp32 softmax and its gradient ([tokens, V / TP] each) at its peak; the chunked loss
(`--cross-entropy-chunk-size`, `loss_peak_bytes`) one chunk's logits and their fp32 copy (softmax, then
gradient), the weight's fp32 gradient accumulator and one chunk's product in the model dtype, the gathered
input under sequence parallelism and the input's gradient. Under full recompute the peak is the larger
of the loss and one recomputed layer (which lives only after the loss). Tensor
parallelism divides attention/MLP terms (and the norm terms under sequence parallelism); context
parallelism divides tokens; the first pipeline stage holds min(PP, micro-batches) micro-batches. Under the
interleaved schedule (v model chunks per rank) it holds the chunk-micro-batches of its warmup plus one,
min(2 (PP - 1) + (v - 1) PP + 1, v x micro-batches), each of 1/v of its layers: (1 + (PP - 1) / (PP v))
times the plain schedule's activations once there are enough micro-batches.

The guard (`check_memory_plan`, one call from the Trainer, collective) compares the plan for the busiest
rank with what each rank's device has (`diffmeg.training.hardware.device_memory`: a GPU's free memory, a
CPU's available memory under its cgroup limits). Ranks on one machine share its memory (ranks on one GPU
share the GPU), so a CPU job's local ranks are counted together. The plan is an estimate, measured against
the real peak (docs/notes.md, docs/gpu.md): an H100's allocator peaked at 0.88-0.90 of it, a CPU's resident
memory (what the OOM killer sees) runs 10-30% over it. The guard expects `PEAK_OVER_PLAN` times the plan
(the favourable end of each: it refuses only runs that do not fit even then) and refuses a run whose
expected peak exceeds what the device has; `--no-memory-guard` starts it anyway (the plan may be wrong for
a setting it does not model).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from diffmeg import registry
from diffmeg.config import count_parameters
from diffmeg.errors import DiffmegError
from diffmeg.run_config import RunConfig
from diffmeg.training.hardware import GIB, DeviceMemory, device_memory

CHUNK_HINT = 2048
"""The chunked loss's chunk size a memory message proposes (the 64K recipe's)."""

PEAK_OVER_PLAN = {"cpu": 1.1, "cuda": 0.9}
"""Expected peak over the plan: a CPU's resident memory runs 10-30% over it (freed blocks glibc keeps;
docs/notes.md), an H100's allocator peaked at 0.88-0.90 of it (docs/gpu.md, the memory phase)."""


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU on the busiest rank (the first pipeline stage, or the only one)."""

    parameters: int
    """The rank's parameters."""
    weights: float
    gradients: float
    optimizer: float
    activations: float
    loss_peak: float
    model_parameters: int
    """The whole model's (a tied output layer counted once), for what is sized by the model: the run's
    summary line, a checkpoint."""

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations + self.loss_peak

    def as_gib(self) -> dict[str, float]:
        counts = ("parameters", "model_parameters")
        out = {k: round(v / GIB, 3) for k, v in asdict(self).items() if k not in counts}
        out["total"] = round(self.total / GIB, 3)
        out["parameters_per_gpu"] = self.parameters
        return out


def _param_bytes(run: RunConfig) -> int:
    return 2 if (run.training.bf16 or run.training.fp16) else 4


def _is_v2(run: RunConfig) -> bool:
    return bool(run.model.diff_attention) and run.model.diff_version == 2


def attention_kernel(run: RunConfig, on_gpu: bool) -> str:
    """What the built model's attention keeps for backward: "fused" (flash-style kernels: q, k, v, the
    output and a log-sum-exp) or "maps" (both probability maps, the math path).

    The Transformer baseline and DIFF V2 always run fused attention (the local spec's SDPA core, or TE's);
    DIFF V1 follows its backend (diffmeg.kernels): sdpa (each path) is fused on a GPU (flash, cuDNN or
    memory-efficient kernels) but the math path on a CPU (V twice as wide as q), reference keeps the maps.
    """
    model = run.model
    if not model.diff_attention or _is_v2(run):
        return "fused"
    backend = run.impls["diff_attn_backend"]
    if backend == registry.AUTO:
        backend = registry.resolve("diff_attention")  # the slot's first choice that runs here
    if on_gpu and backend.startswith("sdpa"):
        return "fused"
    return "maps"


def activation_bytes_per_microbatch(run: RunConfig, on_gpu: bool) -> float:
    """Bytes autograd keeps for one micro-batch on one rank (all layers of the stage)."""
    return _activations(run, on_gpu)[0]


def _activations(run: RunConfig, on_gpu: bool) -> tuple[float, float]:
    """(bytes kept for one micro-batch, bytes of one layer's activations per micro-batch)."""
    model, parallel, training = run.model, run.parallel, run.training
    tp, cp = parallel.tensor_model_parallel_size, parallel.context_parallel_size
    b_act = _param_bytes(run)
    tokens = training.micro_batch_size * model.seq_length / cp
    d, H, F = model.kv_channels, model.hidden_size, model.ffn_hidden_size
    v2 = _is_v2(run)
    sub = 2 if model.diff_attention else 1
    heads = model.num_attention_heads  # DIFF heads, or baseline heads
    # query (sub-)heads: V1 and V2 h + n (2h for the 1:1 DIFF), the baseline h
    query_heads = heads + (model.num_noise_heads or heads) if model.diff_attention else heads
    q = query_heads * d / tp
    k = (1 if v2 else sub) * model.num_query_groups * d / tp
    out = 2 * heads * d / tp  # V1's combined heads (h of 2d): o1, the projection input
    noise_out = 2 * (model.num_noise_heads or heads) * d / tp  # V1's noise maps' outputs (o2)
    # V2 beside its core: sigmoid(lambda) in fp32, the combined heads (projection input), and the fp32 copy
    # of the core output kept by the combination when the core runs in bf16/fp16.
    v2_extra = (4 * heads / tp + b_act * heads * d / tp + (4 * q if b_act != 4 else 0)) if v2 else 0.0
    proj_in = out if model.diff_attention and not v2 else q
    te = model.transformer_impl == "transformer_engine"
    # Norm blocks: TE fuses the norm into the next linear (keeps input and normalised input); ours keeps
    # x, the fp32 normalised tensor and the output (fp32 internals cost 4 bytes under bf16 too).
    norm = 2 * b_act * H if te else (4 + 4 + b_act) * H if b_act == 2 else 12 * H
    if parallel.sequence_parallel:
        norm /= tp
    fused_attention = attention_kernel(run, on_gpu) == "fused"
    if training.recompute_granularity == "selective":
        # The checkpoint keeps its inputs: post-RoPE q and k, and v, a view that keeps the whole fused
        # QKV output (q + 2k wide) alive; plus the projection input.
        attn = b_act * (2 * q + 3 * k + proj_in) + v2_extra
    elif v2:
        attn = b_act * (3 * q + 3 * k) + 4 * query_heads / tp + v2_extra  # + an fp32 log-sum-exp a head
    elif model.diff_attention and fused_attention:
        # q, k, v, o1, o2 and the projection input in the activation dtype; head-norm input and
        # normalised tensor in fp32.
        attn = b_act * (q + k + k + out + noise_out + out) + 8 * out
    elif model.diff_attention:
        # the maps of the signal and the noise heads over the full sequence
        per_head_scores = (query_heads / tp / cp) * model.seq_length * cp
        # GQA on the math path: a map whose query heads outnumber the KV heads keeps V repeated for them (2d
        # a head; the signal map's h, the noise map's n) in place of the one V of g heads the maps share
        # (what torch's CPU math kernel saved, tests/training/test_memory.py)
        noise, groups = model.num_noise_heads or heads, model.num_query_groups
        repeats = [2 * n_map * d / tp for n_map in (heads, noise) if n_map != groups]
        repeated = sum(repeats) - (2 * groups * d / tp if repeats else 0)
        attn = 4 * (7 * q + repeated) + 4 * per_head_scores  # the math path runs in fp32
    else:
        # SDPACoreAttention (the local spec) or TE's fused attention: post-RoPE q and k, the fused QKV
        # output (V is a view of it), the output, and an fp32 log-sum-exp per head (measured on CPU; the
        # projection input is the norms' share, as for DIFF).
        attn = b_act * (3 * q + 3 * k) + 4 * heads / tp
    mlp = (3 if on_gpu else 5) * b_act * F / tp  # fused SwiGLU on a GPU (bias_activation_fusion)
    if model.mlp_activation == "poly_norm":
        # fc1's output (the Function keeps the gate, the product the up half of it), PolyNorm's output and
        # fc2's input, plus three fp32 reciprocal RMS values a token (diffmeg.fusions.poly_norm)
        mlp = 4 * b_act * F / tp + 4 * 3
    rope = 2 * 2 * 4 * d * cp / training.micro_batch_size  # fp32 cos/sin for q and k, per sequence
    per_layer_per_token = 2 * norm + attn + mlp + rope
    layers = model.num_layers // parallel.pipeline_model_parallel_size
    if training.recompute_granularity == "full":
        # Only each layer's input is kept; one layer's activations exist again while it is recomputed
        # in backward, after the loss's logits are gone (counted with the loss peak, not here).
        stored = layers * b_act * H * (1 / tp if parallel.sequence_parallel else 1) * tokens
    else:
        stored = layers * per_layer_per_token * tokens
    stored += (b_act * H + 2 * norm) * tokens  # embedding output, final norm, output-layer input
    return stored, per_layer_per_token * tokens


def loss_peak_bytes(run: RunConfig, chunk_size: int | None) -> float:
    """Bytes the loss of one micro-batch adds at its peak on the last stage (`chunk_size` None: the whole
    logits, megatron-core's loss; else `diffmeg.fusions.cross_entropy` over that many tokens at a time)."""
    model, parallel, training = run.model, run.parallel, run.training
    b_act = _param_bytes(run)
    tokens = training.micro_batch_size * model.seq_length / parallel.context_parallel_size
    vocab = model.vocab_size / parallel.tensor_model_parallel_size
    if not chunk_size:
        return tokens * vocab * (b_act + 4 + 4)  # logits, fp32 softmax, its gradient
    chunk, weight = min(chunk_size, tokens) * vocab, vocab * model.hidden_size  # elements
    if b_act == 4:  # fp32 logits are the softmax and the gradient; the weight's gradient is summed in place
        loss = 4 * chunk + 4 * weight
    else:  # the fp32 copy of a chunk's logits (softmax, gradient) next to the logits, then the gradient
        # in the model dtype and its product with the input next to the weight's fp32 gradient sum
        loss = max((b_act + 4) * chunk + 4 * weight, b_act * chunk + (4 + b_act) * weight)
    gathered = parallel.sequence_parallel and parallel.tensor_model_parallel_size > 1
    hidden = tokens * model.hidden_size * b_act * (2 if gathered else 1)  # (gathered input,) its gradient
    return loss + hidden + 3 * 4 * tokens  # + the fp32 loss, max and sum per token


def in_flight_microbatches(pp: int, chunks: int, num_micro: int) -> float:
    """Micro-batches whose activations the first pipeline rank holds at its peak, in units of all its
    layers: min(PP, M) under 1F1B; under the interleaved schedule its warmup plus one chunk-micro-batches
    (megatron-core's count), each of 1/chunks of its layers."""
    if chunks == 1:
        return min(pp, num_micro)
    return min(2 * (pp - 1) + (chunks - 1) * pp + 1, chunks * num_micro) / chunks


def estimate_memory(run: RunConfig, on_gpu: bool | None = None) -> MemoryEstimate:
    """The plan for the busiest rank of the run."""
    parallel, training = run.parallel, run.training
    if on_gpu is None:
        on_gpu = torch.cuda.is_available()
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    whole, params = count_parameters(run.model), count_parameters(run.model, tp, pp)  # the model's, a rank's
    weights = params * _param_bytes(run)
    gradients = params * 4  # DDP reduces gradients in an fp32 buffer
    master = 4 if (training.bf16 or training.fp16) else 0  # fp32 main params next to bf16/fp16 weights
    optimizer = params * (8 + master)  # Adam's two moments in fp32
    if parallel.use_distributed_optimizer:
        optimizer /= parallel.data_parallel_size * parallel.context_parallel_size
    num_micro = run.num_microbatches
    chunks = parallel.model_chunks
    in_flight = in_flight_microbatches(pp, chunks, num_micro)
    stored, one_layer = _activations(run, on_gpu)
    activations = in_flight * stored
    loss_peak = loss_peak_bytes(run, training.cross_entropy_chunk_size)
    if training.recompute_granularity == "full":
        loss_peak = max(loss_peak, one_layer)  # the recomputed layer lives only after the loss
    return MemoryEstimate(params, weights, gradients, optimizer, activations, loss_peak, whole)


def shrink_options(run: RunConfig, on_gpu: bool = True) -> list[tuple[str, str]]:
    """What shrinks this run's plan, as (flag, the Slurm recipes' knob), the likeliest first: for the dry
    run's warning and the memory guard's refusal (`on_gpu` False: no bf16 proposal, slow on a CPU)."""
    model, parallel, training = run.model, run.parallel, run.training
    options = []
    if training.precision == "fp32" and on_gpu:
        options.append(("--bf16", "PRECISION=bf16"))
    if (
        not parallel.use_distributed_optimizer
        and parallel.data_parallel_size * parallel.context_parallel_size > 1
    ):
        options.append(("--use-distributed-optimizer", "DIST_OPTIMIZER=1"))
    if training.recompute_granularity != "full":
        options.append(("--recompute-granularity full", "RECOMPUTE=full"))
    if training.micro_batch_size > 1:
        options.append(("--micro-batch-size 1", "MICRO_BATCH=1"))
    tokens = training.micro_batch_size * model.seq_length // parallel.context_parallel_size
    if not training.cross_entropy_chunk_size and tokens > CHUNK_HINT:
        options.append((f"--cross-entropy-chunk-size {CHUNK_HINT}", f"CE_CHUNK_SIZE={CHUNK_HINT}"))
    options.append(("a shorter --seq-length", "EXTRA_ARGS='--seq-length N'"))
    options.append(("more tensor/pipeline/context-parallel ranks", "TP, PP, CP"))
    return options


def memory_verdict(plan: MemoryEstimate, devices: list[DeviceMemory], run: RunConfig) -> str | None:
    """The refusal line when the expected peak of the ranks sharing a device exceeds what it has, else
    None. `devices`: every rank's (the same list on every rank, so every rank decides the same)."""
    shared: dict[tuple[str, str, str], list[DeviceMemory]] = {}
    for device in devices:
        shared.setdefault((device.host, device.device, device.unit), []).append(device)
    worst = None  # (how far over, the tightest device of the group, ranks sharing it)
    for group in shared.values():
        tightest = min(group, key=lambda d: d.available)
        need = _expected_peak(plan, tightest) * len(group)
        over = need / max(tightest.available, 1)
        if need > tightest.available and (worst is None or over > worst[0]):
            worst = (over, tightest, len(group))
    if worst is None:
        return None
    _, device, ranks = worst
    gib = plan.as_gib()
    kind = device.kind
    terms = (
        f"activations {gib['activations']:.1f}, loss {gib['loss_peak']:.1f}, weights, gradients and "
        f"optimizer {gib['weights'] + gib['gradients'] + gib['optimizer']:.1f} GiB"
    )
    peak = _expected_peak(plan, device) / GIB
    if kind == "cpu":
        expected = f"resident memory runs ~10% over the plan: {peak:.1f} GiB expected"
        where = "this machine"
    else:
        expected = f"the GPU allocator peaks near 0.9x the plan: {peak:.1f} GiB expected"
        where = device.device
    if ranks > 1:
        expected += f" per rank, {peak * ranks:.1f} for the {ranks} ranks of this run on {where}"
    fixes = ", ".join(flag for flag, _ in shrink_options(run, on_gpu=kind == "cuda"))
    return (
        f"the memory plan needs {plan.total / GIB:.1f} GiB per rank ({terms}; {expected}), but {where} has "
        f"{device.available / GIB:.1f} GiB ({device.source}): the run would run out of memory. To shrink it: "
        f"{fixes} (--dry-run shows the plan); or --no-memory-guard to start anyway"
    )


def _expected_peak(plan: MemoryEstimate, device: DeviceMemory) -> float:
    """Bytes one rank is expected to hold at its peak on `device` (`PEAK_OVER_PLAN`)."""
    return PEAK_OVER_PLAN[device.kind] * plan.total


def check_memory_plan(run: RunConfig) -> MemoryEstimate:
    """The run's plan on this machine (`estimate_memory`); the run refused on every rank, in one line, when
    the plan cannot fit a rank's device (collective: every rank probes its own device, then all decide on
    everyone's figures). `--no-memory-guard`: not checked."""
    plan = estimate_memory(run)
    if run.training.no_memory_guard:
        return plan
    mine = device_memory()
    devices = [mine]
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        devices = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(devices, mine)
    verdict = memory_verdict(plan, devices, run)
    if verdict is not None:
        raise DiffmegError(verdict)
    return plan
