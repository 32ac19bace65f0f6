"""The typed run configuration: the resolved command line, grouped by concern.

`diffmeg.training.arguments` parses and validates Megatron-LM's flat flags into an `argparse.Namespace`;
`RunConfig.from_args` converts it once, and everything after the entry point (the Trainer, checkpointing,
the builders) reads typed groups: `run.model.hidden_size`, `run.optim.lr`, `run.checkpoint.save`.

Every flag is declared here, once, on its field (`flag(...)`: help, choices, range, whether a preset may
set it; type and default are the field's own), and the parser is built from these declarations
(`diffmeg.training.arguments.build_parser`): adding a flag is adding a field. Every field is named as its
flag (`--hidden-size` -> `hidden_size`), so `to_args()` gives the flat form
back exactly: it is used only to write `args.json` (and the run directory's arguments.json), from which
the offline readers (single-rank models of checkpoints, conversion) build a RunConfig again
(`from_args(args, partial=True)`); the model config (`diffmeg.model.transformer_config`), the FLOPs and
memory estimates, the data and the dry run read the typed groups; the implementation choices are one
dict, `impls`, keyed by the flags the registry's slots declare (`diffmeg.registry.flagged`). It stands
below the model (nothing here imports more than torch and the registry's table), so every floor that
builds a model can hold one. Resolved values no group knows (`explicit_flags`, `dropped_flags`, ...)
travel in `extra`, so nothing resolved is ever dropped.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from diffmeg import registry
from diffmeg.errors import DiffmegError

_FLAG = "flag"
"""Field metadata key: the flat argument name where it differs from the field's (`preset` <- `model`)."""

_DECL = "declared"
"""Field metadata key: the field's command-line flag (`Flag`), from which `diffmeg.training.arguments` builds
the parser: a flag declared here is declared nowhere else."""


@dataclass(frozen=True)
class Flag:
    """A field's flag, `--` + the field's name with dashes: its parser type, nargs and default follow from
    the field's annotation and default (`bool`: an on/off switch; `list[str]`: several values)."""

    help: str | None = None
    choices: tuple | None = None
    metavar: str | None = None
    preset: bool = False
    """A `--model` preset may set it: the parser leaves it None (no "default" in --help), and its field's
    default (if any) fills it where neither a flag nor the preset did (`arguments.DEFAULTS`)."""
    unset: bool = False
    """The parser leaves it None (no "default" in --help): the run derives it."""
    range: str | tuple[str, ...] | None = None
    """The numeric flag's range (`diffmeg.training.arguments.Range`): its rule (">= 1", ">= 0", ...), or
    the rule, the unit it counts and a hint."""
    parser_default: Any = None
    """The parser's default where it is not the field's (`--transformer-impl auto`, which the run resolves);
    None: the field's."""
    group: str | None = None
    """The parser group it is listed in, where not its own class's (`--override-opt-param-scheduler`, an
    optimizer field, among the checkpointing flags)."""


def flag(default: Any = dataclasses.MISSING, **declaration: Any) -> Any:
    """A field with its command-line flag (`Flag`'s keywords)."""
    return field(default=default, metadata={_DECL: Flag(**declaration)})


def declared(cls: type) -> list[tuple[dataclasses.Field, Flag]]:
    """The fields of a group that declare a flag, in declaration order (the parser's and --help's)."""
    return [(f, f.metadata[_DECL]) for f in dataclasses.fields(cls) if _DECL in f.metadata]


LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root")

SHAPE_SIZES = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "num_noise_heads",
    "kv_channels",
    "vocab_size",
)
"""The `ModelConfig` sizes that set a model's tensor shapes."""
SHAPE_FIELDS = (*SHAPE_SIZES, "diff_attention", "diff_version", "mlp_activation")
"""Everything that sets a model's tensor shapes and names (every iteration of a run has the same; PolyNorm's
weights are not SwiGLU's): the one list the
checks of a checkpoint against a run and `--use-checkpoint-args` read."""


@dataclass(kw_only=True)
class ModelConfig:
    """The network: sizes, attention kind and initialisation (heads counted as `--num-attention-heads`)."""

    preset: str | None = field(default=None, metadata={_FLAG: "model"})
    """The `--model` preset the sizes came from (None: all given as flags)."""
    num_layers: int = flag(preset=True, help="transformer layers (else the --model preset's)", range=">= 1")
    hidden_size: int = flag(preset=True, help="model width (else the preset's)", range=">= 1")
    ffn_hidden_size: int = flag(
        preset=True,
        help="SwiGLU inner width (default: the preset's, else 8/3 x hidden rounded up to 64)",
        range=">= 1",
    )
    num_attention_heads: int = flag(
        preset=True,
        help="DIFF: differential heads h (each 2 sub-heads of kv-channels, V of 2x); baseline: heads",
        range=">= 1",
    )
    """DIFF: differential heads (2 sub-heads of `kv_channels` each); baseline: heads."""
    group_query_attention: bool = flag(False, help="use --num-query-groups KV groups (Megatron-LM's flag)")
    num_query_groups: int = flag(preset=True, help="DIFF: differential KV heads (K1/K2 pairs)", range=">= 1")
    num_noise_heads: int | None = flag(
        None,
        preset=True,
        help="grouped differential attention (GDA, Motif's): n noise heads shared by the "
        "--num-attention-heads signal heads, h / n each (a multiple of --num-query-groups, whose default "
        "it becomes). Default: as many as the signal heads (the classic 1:1 DIFF; the gda-* presets set 4:1)",
        range=">= 1",
    )
    """n: noise heads of grouped differential attention, dividing the h differential heads (Motif's name);
    h (the command line's default) is the 1:1 DIFF. None: h, as in runs that predate the flag, and the
    Transformer baseline, which has none."""
    kv_channels: int = flag(
        preset=True, help="head dim d (default hidden / (2h) for DIFF, hidden / h else)", range=">= 1"
    )
    seq_length: int = flag(preset=True, help="tokens per sample (else the preset's)", range=">= 1")
    max_position_embeddings: int = flag(
        preset=True, help="positions the model is built for (default: --seq-length)", range=">= 1"
    )
    vocab_size: int = flag(
        preset=True, help="padded vocabulary size (default: the tokenizer's, 100288)", range=">= 1"
    )
    """Padded vocabulary size."""
    rotary_base: float = flag(10000.0, help="RoPE base", range="> 0")
    init_method_std: float = flag(0.02, help="standard deviation of the weight init", range=">= 0")
    norm_epsilon: float = flag(1e-5, help="RMSNorm epsilon", range="> 0")
    hidden_dropout: float = flag(0.0, help="dropout after attention and MLP", range="in [0, 1)")
    attention_dropout: float = flag(0.0, help="dropout on attention probabilities", range="in [0, 1)")
    diff_attention: bool = flag(
        True,
        preset=True,
        help="differential attention (the default, except for the transformer-* presets); "
        "--no-diff-attention builds the FLOP-matched Transformer baseline instead",
    )
    """False: the FLOP-matched Transformer baseline."""
    diff_version: int = flag(
        1,
        preset=True,
        choices=(1, 2),
        help="differential attention version: 1, the paper's (default); 2, DIFF V2 (2h query heads over "
        "ordinary GQA attention, per-token sigmoid lambda, no head norm). The diff2-* presets set 2",
    )
    """1: the paper's differential attention; 2: DIFF V2."""
    lambda_init: str = flag(
        "exp",
        help="'exp' (the paper's layer-wise schedule), 'motif' (Motif's checkpoints' schedule, one layer "
        "later: lambda_init from their 0-based layer_idx - 1) or a constant in [0, 1)",
    )
    mlp_activation: str = flag(
        "swiglu",
        choices=("swiglu", "poly_norm"),
        help="the gated MLP's activation: swiglu, or poly_norm (Motif's PolyNorm: w0 norm(z^3) + "
        "w1 norm(z^2) + w2 norm(z) + b over the FFN dimension)",
    )
    """The gated MLP's activation: swiglu, or Motif's poly_norm."""
    lambda_std: float = flag(0.1, help="standard deviation of the lambda vectors' init", range=">= 0")
    transformer_impl: str = flag(
        "local",
        parser_default="auto",
        choices=("auto", "local", "transformer_engine"),
        help="auto: Transformer Engine when installed and on GPU, else megatron-core local",
    )
    """What the run resolved `auto` to (an args.json without the field: local)."""
    tie_embeddings_and_output_weights: bool = flag(
        False,
        help="one matrix for the word embedding and the output layer (Llama 3.2 1B/3B, many small models; "
        "an upcycled or imported tied model records it). Default: untied, as every preset",
    )
    """One matrix for the word embedding and the output layer (False, the default and what an args.json
    without the field means: the output layer is its own matrix)."""
    untie_embeddings_and_output_weights: bool = flag(
        False,
        help="Megatron-LM's flag for diffmeg's default: the output layer is a matrix of its own (wins over "
        "a tie taken from --use-checkpoint-args, for a checkpoint of its own)",
    )
    """Megatron-LM's flag for the default (untied); refused together with the tie flag."""

    @property
    def architecture(self) -> str:
        if not self.diff_attention:
            return "Transformer"
        name = "DIFF" if self.diff_version == 1 else "DIFF V2"
        noise = self.num_noise_heads
        if noise is not None and noise != self.num_attention_heads:  # grouped: signal to noise heads
            name += f" GDA {self.num_attention_heads // noise}:1"
        return name


@dataclass(kw_only=True)
class ParallelConfig:
    """How the job is split: model-parallel sizes (data parallel is what remains of the world)."""

    tensor_model_parallel_size: int = flag(1, help="tensor-parallel ranks", range=">= 1")
    pipeline_model_parallel_size: int = flag(1, help="pipeline stages", range=">= 1")
    context_parallel_size: int = flag(
        1, help="context-parallel ranks (the sequence split over them)", range=">= 1"
    )
    cp_comm_type: str | None = flag(
        None,
        choices=("ulysses", "p2p", "all_gather", "a2a", "a2a+p2p"),
        help="context-parallel attention: ulysses (DIFF default; diffmeg's all-to-all, any backend, no TE) "
        "or megatron-core's Transformer Engine CP: p2p (ring; baseline default), all_gather, a2a",
    )
    sequence_parallel: bool = flag(
        False, help="split activations over the tensor-parallel ranks (needs TP > 1)"
    )
    use_distributed_optimizer: bool = flag(False, help="shard the optimizer state over data-parallel ranks")
    overlap_grad_reduce: bool = flag(
        False, help="reduce gradients bucket by bucket during backward (megatron-core DDP), not after it"
    )
    """Reduce gradients in buckets during backward (megatron-core DDP's `overlap_grad_reduce`)."""
    overlap_param_gather: bool = flag(
        False,
        help="all-gather the distributed optimizer's updated parameters bucket by bucket during the next "
        "forward, not after the optimizer step (needs --use-distributed-optimizer and --overlap-grad-reduce)",
    )
    """All-gather the distributed optimizer's parameters in buckets during the next forward."""
    ddp_bucket_size: int | None = flag(
        None,
        help="parameters per data-parallel communication bucket with --overlap-grad-reduce (default: "
        "megatron-core's max(40M, 1M x DP))",
        range=(">= 1", "parameter"),
    )
    """Parameters per DDP bucket with overlap (None: megatron-core's default, max(40M, 1M x DP))."""
    num_layers_per_virtual_pipeline_stage: int | None = flag(
        None,
        help="interleaved 1F1B pipeline schedule: each pipeline rank holds (layers / PP) / this model chunks "
        "(virtual stages); its bubble shrinks by that factor",
        range=">= 1",
    )
    virtual_pipeline_model_parallel_size: int | None = None
    """Derived by validation: model chunks per pipeline rank of the interleaved schedule (None: one)."""
    distributed_backend: str = flag(
        "auto",
        choices=("auto", "nccl", "gloo"),
        help="torch.distributed backend (auto: nccl on GPU, gloo on CPU)",
    )
    distributed_timeout_minutes: int = flag(10, help="collective timeout", range=">= 1")
    data_parallel_size: int = 1
    """Derived by validation from the world size."""

    @property
    def model_chunks(self) -> int:
        """Model chunks (virtual pipeline stages) on each rank."""
        return self.virtual_pipeline_model_parallel_size or 1

    @property
    def world_size(self) -> int:
        return (
            self.data_parallel_size
            * self.tensor_model_parallel_size
            * self.pipeline_model_parallel_size
            * self.context_parallel_size
        )


@dataclass(kw_only=True)
class TrainingConfig:
    """Batches, length of the run, precision, recomputation and the seed."""

    micro_batch_size: int = flag(
        1, preset=True, help="samples per rank per forward pass (default 1, or the preset's)", range=">= 1"
    )
    global_batch_size: int = flag(
        preset=True,
        help="samples per optimizer step (default: --micro-batch-size x data-parallel ranks)",
        range=">= 1",
    )
    train_iters: int = flag(
        preset=True,
        help="optimizer steps (or give --train-tokens)",
        range=(">= 1", "", "a run of no iterations trains nothing"),
    )
    train_tokens: int | None = flag(
        None,
        preset=True,
        help="alternative to --train-iters: total training tokens",
        range=(">= 1", "", "a run of no tokens trains nothing"),
    )
    # (the parser lists OptimizerConfig's flags here: diffmeg.training.arguments.build_parser)
    bf16: bool = flag(False, help="bfloat16 mixed precision")
    fp16: bool = flag(False, help="float16 mixed precision with loss scaling")
    fp8_format: str | None = flag(
        None,
        choices=("e4m3", "hybrid"),
        help="FP8 linears: Transformer Engine's on its spec; torchao's on the local spec (an Ada/Hopper GPU, "
        "with --fp8-recipe tensorwise)",
    )
    fp8_recipe: str = flag(
        "delayed",
        choices=("delayed", "tensorwise"),
        help="FP8 scaling (Transformer Engine's recipes; torchao's FP8 on the local spec is tensorwise)",
    )
    recompute_granularity: str | None = flag(
        None,
        choices=("full", "selective"),
        help="activation recomputation: full layers or selective (attention only)",
    )
    recompute_method: str | None = flag(
        None, choices=("uniform", "block"), help="which layers full recomputation covers (default uniform)"
    )
    recompute_num_layers: int | None = flag(
        None, help="layers per recomputed group (default 1)", range=">= 1"
    )
    cross_entropy_chunk_size: int | None = flag(
        None,
        metavar="TOKENS",
        help="compute the output layer and the loss over this many tokens at a time, recomputing each "
        "chunk's logits in backward: the whole [tokens, vocab] logits never exist (long context). "
        "Default: megatron-core's loss over the whole logits",
        range=(">= 1", "token", "leave it out for the unchunked loss"),
    )
    """Tokens per chunk of the output layer + loss (`diffmeg.fusions.cross_entropy`); None: whole logits."""
    cross_entropy_loss_fusion: bool = flag(
        False,
        help="megatron-core's native fused cross entropy (its steps compiled, the softmax made in place of "
        "the fp32 logits; bf16 gradients, so --bf16 only). Default: megatron-core's unfused loss",
    )
    """megatron-core's native fused cross entropy (the registry's `loss` entry `fused`; bf16 runs)."""
    compile_layers: bool = flag(
        False,
        help="wrap each transformer layer in torch.compile (static shapes, one graph a layer) once the model "
        "is built; compile time goes into the first steps (GPU: diffmeg disables torch.compile on CPU)",
    )
    """Each transformer layer wrapped in `torch.compile` once built (`diffmeg.training.graphs`; GPU)."""
    cuda_graph_impl: str = flag(
        "none",
        choices=("none", "local"),
        help="megatron-core's CUDA graphs: local captures each transformer layer's forward and backward "
        "after its warmup steps and replays them (GPU; not with full recomputation or --compile-layers)",
    )
    """megatron-core's CUDA graphs: "none", or "local" (its per-layer graphs, captured after warmup)."""
    gradient_accumulation_fusion: bool = flag(
        False,
        help="add each weight gradient of megatron-core's linears straight into DDP's fp32 main_grad in one "
        "GEMM (no bf16 weight gradient, no separate add): apex's extension where installed, else torch's "
        "fp32-output addmm (diffmeg.fusions.grad_accum). CUDA only; not with torchao's FP8. Default: off",
    )
    """Weight gradients of megatron-core's linears added straight into DDP's fp32 main_grad in one GEMM
    (megatron-core's `gradient_accumulation_fusion`; `diffmeg.fusions.grad_accum` where apex is absent)."""
    no_memory_guard: bool = flag(
        False,
        help="start even when the memory plan (--dry-run shows it) does not fit the device: the GPU's free "
        "memory, or on a CPU the memory available to the process and its cgroup (diffmeg's guard refuses "
        "such a run before building the model)",
    )
    """Start even when the memory plan does not fit the device (`diffmeg.training.memory`)."""
    seed: int = flag(1234, help="random seed of weights and data order", range=">= 0")
    deterministic_mode: bool = flag(
        False,
        help="deterministic kernels (torch.use_deterministic_algorithms, a fixed cuBLAS workspace, "
        "megatron-core's deterministic embedding): bit-exact reruns and resumes, somewhat slower",
    )
    """Deterministic kernels: megatron-core's own choices read it from the model config."""
    exit_interval: int | None = flag(None, help="exit (after saving) at this iteration", range=">= 1")
    """Save and exit at the first iteration divisible by this."""

    @property
    def params_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.bf16 else torch.float16 if self.fp16 else torch.float32

    @property
    def precision(self) -> str:
        return "bf16" if self.bf16 else "fp16" if self.fp16 else "fp32"


@dataclass(kw_only=True)
class OptimizerConfig:
    """AdamW and the learning-rate schedule."""

    lr: float = flag(
        preset=True,
        group="training",
        help="peak learning rate (required unless the preset sets one)",
        range=">= 0",
    )
    min_lr: float = flag(
        0.0,
        preset=True,
        group="training",
        help="learning rate at the end of the decay (default 0)",
        range=">= 0",
    )
    lr_warmup_iters: int = flag(
        0, preset=True, group="training", help="linear warmup steps (default 0)", range=">= 0"
    )
    lr_decay_iters: int = flag(
        group="training", help="default: --train-iters (at least warmup + 1)", range=">= 1"
    )
    lr_decay_style: str = flag(
        "linear",
        preset=True,
        group="training",
        choices=LR_DECAY_STYLES,
        help="learning-rate schedule after warmup (default linear)",
    )
    weight_decay: float = flag(
        0.01, preset=True, group="training", help="AdamW weight decay (default 0.01)", range=">= 0"
    )
    adam_beta1: float = flag(
        0.9, preset=True, group="training", help="AdamW beta1 (default 0.9)", range="in [0, 1)"
    )
    adam_beta2: float = flag(
        0.999, preset=True, group="training", help="AdamW beta2 (default 0.999)", range="in [0, 1)"
    )
    adam_eps: float = flag(1e-8, group="training", help="AdamW epsilon", range=">= 0")
    clip_grad: float = flag(1.0, group="training", help="gradient-norm clipping (0: none)", range=">= 0")
    override_opt_param_scheduler: bool = flag(
        False,
        group="checkpointing",
        help="resuming: the learning-rate schedule of these flags (--lr, --min-lr, --lr-warmup-iters, "
        "--lr-decay-iters, --lr-decay-style, --weight-decay) from the checkpoint's iteration on, where they "
        "differ from the checkpoint's (without it or the next flag such a difference is refused)",
    )
    """Resuming: this run's schedule where it differs from the checkpoint's (Megatron-LM's flag)."""
    use_checkpoint_opt_param_scheduler: bool = flag(
        False,
        group="checkpointing",
        help="resuming: keep the checkpoint's learning-rate schedule, whatever these flags say",
    )
    """Resuming: the checkpoint's schedule, whatever this run's flags say (Megatron-LM's flag)."""


@dataclass(kw_only=True)
class DataConfig:
    """Where the tokens come from (the parser's "data" group: each field's flag is declared here)."""

    data_path: list[str] | None = flag(None, help="prefix, or 'w1 p1 w2 p2 ...', or 'builtin'")
    """Prefixes (`w1 p1 w2 p2 ...`), or ["builtin"]; None with mock data."""
    mock_data: bool = flag(False, help="synthetic data (no tokenizer needed)")
    split: str = flag("969,30,1", help="train,valid,test weights of every dataset")
    data_cache_path: str | None = flag(
        None,
        help="where dataset index caches go (default: cache/ beside the first dataset, or "
        "$DIFFMEG_CACHE_DIR/datasets/ when that folder is read-only; multi-node without a shared home: "
        "set it)",
    )
    tokenizer_file: str | None = flag(None, help="local cl100k_base BPE file (else $DIFFMEG_TOKENIZER_FILE)")
    tokenizer_type: str = flag(
        "cl100k_base",
        unset=True,
        choices=("cl100k_base", "HuggingFaceTokenizer", "null"),
        help="null: the data are token ids below --vocab-size with no tokenizer (generated corpora; "
        "the default with --mock-data); HuggingFaceTokenizer: the folder --tokenizer-model (a model "
        "imported or upcycled from Hugging Face keeps its tokenizer)",
    )
    tokenizer_model: str | None = flag(
        None, help="Hugging Face tokenizer folder (with --tokenizer-type HuggingFaceTokenizer)"
    )
    """The Hugging Face tokenizer folder of `--tokenizer-type HuggingFaceTokenizer`."""
    tokenizer_fingerprint: str | None = None
    """Derived: sha256 of that tokenizer's vocabulary (checked against checkpoints and datasets)."""
    num_workers: int = flag(0, help="data-loader worker processes", range=">= 0")


@dataclass(kw_only=True)
class CheckpointConfig:
    """Saving and resuming (the parser's "checkpointing" group, with two flags of `OptimizerConfig`)."""

    save: str | None = flag(None, help="checkpoint folder (default: nothing saved)")
    load: str | None = flag(
        None, help="checkpoint folder to resume from (its latest iteration, or --ckpt-step)"
    )
    save_interval: int | None = flag(
        None, help="iterations between checkpoints (default: only at the end)", range=">= 1"
    )
    async_save: bool = flag(
        False,
        help="write checkpoints in the background while training continues (Megatron-LM's flag; the "
        "tracker names a checkpoint once every rank's files are written)",
    )
    """Write checkpoints in the background (megatron-core's async torch_dist save) while training goes on."""
    export_hf_at_end: str | None = flag(
        None,
        metavar="DIR",
        help="when training ends (the last iteration, a SIGTERM or --exit-interval stop), also write the "
        "final checkpoint as a Hugging Face folder DIR (mcore-to-hf's export; an earlier export's files "
        "in DIR are replaced, others stay); a failed export is one warning and leaves the checkpoint as is",
    )
    """The Hugging Face folder the final checkpoint is exported to once training ends (pretrain_diff.py)."""
    no_load_optim: bool = flag(False, help="resume the weights without the optimizer state")
    no_load_rng: bool = flag(False, help="resume without the random-number state")
    finetune: bool = flag(False, help="load weights only; reset iteration, optimizer and scheduler")
    pretrained_checkpoint: str | None = flag(
        None,
        help="initialise weights from this checkpoint when --load holds none yet (continued training, "
        "e.g. the 64K extension); a requeued job then resumes from --load",
    )
    """Weights to start from when --load holds no checkpoint yet (continued training)."""
    use_checkpoint_args: bool = flag(
        False,
        help="take the model's shape and tokenizer from the args.json of the checkpoint the run starts from "
        "(--load's latest, else --pretrained-checkpoint's), e.g. an upcycled or imported model; flags win",
    )
    """The model's shape and tokenizer came from the checkpoint the run starts from (args.json)."""
    ckpt_step: int | None = flag(
        None,
        help="resume from this iteration of --load instead of the latest (e.g. when the latest is damaged)",
        range=">= 1",
    )
    """Resume from this iteration of --load instead of the tracker's (Megatron-LM's --ckpt-step)."""


@dataclass(kw_only=True)
class LoggingConfig:
    """What is reported, where and how often (evaluation included; the parser's "logging and evaluation"
    group, the dry run's flags too)."""

    log_interval: int = flag(10, help="iterations between log lines", range=">= 1")
    eval_interval: int = flag(1000, help="iterations between validation passes", range=">= 1")
    eval_iters: int = flag(10, help="validation batches per pass (0: none)", range=">= 0")
    tensorboard_dir: str | None = flag(None, help="write TensorBoard scalars there (default: none)")
    metrics_file: str | None = flag(None, help="also write every logged iteration as a JSON line")
    wandb_project: str | None = flag(
        None, help="also log to Weights & Biases, in this project (default: no W&B)"
    )
    """W&B logging (`diffmeg.training.wandb_sink`) when given."""
    wandb_exp_name: str | None = flag(None, help="the W&B run's name (default: W&B's)")
    wandb_save_dir: str | None = flag(
        None, help="where the W&B run (offline: WANDB_MODE=offline) and its id go (default: <--save>/wandb)"
    )
    wandb_entity: str | None = flag(None, help="the W&B team or user the project belongs to (default: yours)")
    dry_run: bool = flag(False, help="print the resolved configuration as JSON and exit")
    gpu_memory_gib: float = flag(
        80.0,
        help="GPU memory the run targets: --dry-run warns when its per-GPU memory plan does not fit",
        range="> 0",
    )
    verbose: bool = flag(
        False, help="print every resolved argument at start (always written to arguments.json beside --save)"
    )
    """Print the full resolved arguments at start (they are always written to the run directory)."""


_GROUPS = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "training": TrainingConfig,
    "optim": OptimizerConfig,
    "data": DataConfig,
    "checkpoint": CheckpointConfig,
    "logging": LoggingConfig,
}


def _flag(f: dataclasses.Field) -> str:
    return f.metadata.get(_FLAG, f.name)


@dataclass(kw_only=True)
class RunConfig:
    """One training run, as resolved and validated by `diffmeg.training.arguments.resolve_args`."""

    model: ModelConfig
    parallel: ParallelConfig
    training: TrainingConfig
    optim: OptimizerConfig
    data: DataConfig
    checkpoint: CheckpointConfig
    logging: LoggingConfig
    impls: dict[str, str] = field(default_factory=dict)
    """The implementation each flag of `diffmeg.registry` chose, under the flag's name (`norm_impl`): a name
    of its slot, or `auto` (also where the flat arguments lack the flag)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Resolved flags no group reads (`dry_run`, `explicit_flags`, ...), kept for `to_args()`."""
    defaulted: frozenset[str] = frozenset()
    """Flags the flat arguments lacked (filled with defaults here), left out again by `to_args()`."""

    @classmethod
    def from_args(cls, args: argparse.Namespace | dict, partial: bool = False) -> RunConfig:
        """Group the flat resolved arguments.

        `partial`: for flat arguments that may lack fields (an old checkpoint's args.json, a test's
        hand-made Namespace): a missing field takes its default, or None where it has none. Without it a
        missing field without default is an error (the entry point always has every field).
        """
        flat = dict(args) if isinstance(args, dict) else dict(vars(args))
        groups, defaulted = {}, set()
        for name, cls_ in _GROUPS.items():
            values = {}
            for f in dataclasses.fields(cls_):
                key = _flag(f)
                if key in flat:
                    values[f.name] = flat.pop(key)
                    continue
                defaulted.add(key)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                    if not partial:
                        raise DiffmegError(f"the run arguments lack {key!r}")
                    values[f.name] = None
            groups[name] = cls_(**values)
        impls = {}
        for s in registry.flagged():
            if s.field not in flat:
                defaulted.add(s.field)
            impls[s.field] = flat.pop(s.field, registry.AUTO)
        return cls(**groups, impls=impls, extra=flat, defaulted=frozenset(defaulted))

    def to_args(self) -> argparse.Namespace:
        """The flat arguments (Megatron-LM's names): for args.json and the flat-argument readers."""
        flat: dict[str, Any] = {}
        for name in _GROUPS:
            group = getattr(self, name)
            for f in dataclasses.fields(group):
                if _flag(f) not in self.defaulted:
                    flat[_flag(f)] = getattr(group, f.name)
        flat.update({name: value for name, value in self.impls.items() if name not in self.defaulted})
        flat.update(self.extra)
        return argparse.Namespace(**dict(sorted(flat.items())))

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per rank per step."""
        t = self.training
        return t.global_batch_size // (t.micro_batch_size * self.parallel.data_parallel_size)

    @property
    def tokens_per_step(self) -> int:
        return self.training.global_batch_size * self.model.seq_length
