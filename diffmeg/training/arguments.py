"""Command-line arguments: Megatron-LM's flag names, `--model` presets, one-line validation errors.

Every flag is declared once, on its `diffmeg.run_config` field (name, type, default, choices, range, help,
whether a preset may set it); `build_parser` builds the parser from those declarations. Resolution order
for every value: an explicit flag (or a `--config` file's), else the `--model` preset, else the field's
default. Flags covered by presets therefore default to `None` in the parser and are filled in
`resolve_args`.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import sys
from collections.abc import Sequence
from typing import NamedTuple

from diffmeg import registry
from diffmeg.checkpoints import holds_hf_export, holds_saves
from diffmeg.data.indexed import datasets_in
from diffmeg.data.splits import split_matrix
from diffmeg.data.tokenizers import resolve_tokenizer_args
from diffmeg.errors import DiffmegError
from diffmeg.fusions import grad_accum
from diffmeg.parallel import cp_attention_available
from diffmeg.parallel.validation import validate_cp
from diffmeg.presets import PADDED_VOCAB_SIZE, PRESETS, get_preset, swiglu_ffn_size
from diffmeg.run_config import (
    CheckpointConfig,
    DataConfig,
    LoggingConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    TrainingConfig,
    declared,
)
from diffmeg.runtime import transformer_engine_available
from diffmeg.training import graphs
from diffmeg.training.checkpoint_args import checkpoint_model_args
from diffmeg.training.config_file import read_config
from diffmeg.training.distributed import launch_world_size

DECLARED = (
    ModelConfig,
    ParallelConfig,
    TrainingConfig,
    OptimizerConfig,
    DataConfig,
    CheckpointConfig,
    LoggingConfig,
)
"""The `RunConfig` groups, whose fields declare the flags (`diffmeg.run_config.flag`): `build_parser` adds
them group by group (`_add_declared`); only `--config`, `--model` and the registry's flags are its own."""

DEFAULTS: dict[str, object] = {
    f.name: f.default
    for cls in DECLARED
    for f, decl in declared(cls)
    if decl.preset and f.default is not dataclasses.MISSING and f.default is not None
}
"""Defaults of the flags a preset may set, from their fields (Megatron-LM's where it has one; the others'
is None). The parser leaves them unset, so a preset sits between the default and what the user types."""


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults shown, except an unset one (None: the preset or a derived value, which the help says)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$|^-(inf|infinity|nan)$", re.IGNORECASE)
"""What a flag's value that starts with "-" may be: argparse's own pattern takes `-1` and `-.5` but not
`-1e-3` or `-inf`, which it reads as an unknown flag ("expected one argument")."""


class _Parser(argparse.ArgumentParser):
    """A bad flag answers with a one-line usage before the error, not the 65 lines listing every flag;
    a negative number in any notation is a value (so its range check names the flag)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = NEGATIVE_NUMBER  # argparse reads it while parsing

    def error(self, message: str):
        self.exit(
            2,
            f"usage: {self.prog} [--model PRESET] [FLAGS ...]  (--help lists every flag)\n"
            f"{self.prog}: error: {message}\n",
        )


def _add_registry_flags(parser: argparse.ArgumentParser) -> None:
    """A flag per slot of `diffmeg.registry` that declares one: its choices, its `auto` default and its help
    come from the table, so a row added there is a choice here with no second list to keep."""
    g = parser.add_argument_group("implementations (docs/implementations.md)")
    for s in registry.flagged():
        text = f"{s.purpose}; auto: {' then '.join(s.auto)}, the first that runs here"
        g.add_argument(s.flag, default=registry.AUTO, choices=registry.choices(s.name), help=text)


_TYPES = {"int": int, "float": float, "str": None}


def _add_declared(
    group: argparse._ArgumentGroup, home: type, *guests: type, guests_after: str | None = None
) -> None:
    """The flags a `RunConfig` group's fields declare (`diffmeg.run_config.flag`), with those of `guests`'
    fields listed in this group after `guests_after`'s (default: last): the type and nargs from the field's
    annotation, the default from the field's (None where a preset or the run fills it)."""
    rows = [(f, d) for f, d in declared(home) if d.group in (None, group.title)]
    at = len(rows) if guests_after is None else 1 + [f.name for f, _ in rows].index(guests_after)
    rows[at:at] = [(f, d) for cls in guests for f, d in declared(cls) if d.group == group.title]
    for f, decl in rows:
        option = "--" + f.name.replace("_", "-")
        kind = f.type.removesuffix(" | None")
        default = None if decl.unset or decl.preset or f.default is dataclasses.MISSING else f.default
        if decl.parser_default is not None:
            default = decl.parser_default
        if (
            kind == "bool" and decl.preset
        ):  # --x / --no-x, and no parser default: the preset or DEFAULTS decide
            group.add_argument(
                option, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=decl.help
            )
            continue
        if kind == "bool":
            group.add_argument(option, action="store_true", help=decl.help)
            continue
        options: dict[str, object] = {"default": default, "help": decl.help}
        if kind == "list[str]":
            options["nargs"] = "*"
        elif _TYPES[kind] is not None:
            options["type"] = _TYPES[kind]
        if decl.choices is not None:
            options["choices"] = list(decl.choices)
        if decl.metavar is not None:
            options["metavar"] = decl.metavar
        group.add_argument(option, **options)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="pretrain_diff.py",
        description="Pretrain a Differential Transformer (or its Transformer baseline) on megatron-core.",
        formatter_class=_HelpFormatter,
    )
    p.add_argument(
        "--config",
        metavar="FILE",
        help="take flags from a TOML, YAML or JSON file (keys: the flags' names, flat or in sections named "
        "after the groups below; a run's saved arguments.json is one); flags given here win. docs/config.md",
    )
    g = p.add_argument_group("model")
    g.add_argument("--model", help=f"preset: {', '.join(sorted(PRESETS))}")
    _add_declared(g, ModelConfig)
    _add_registry_flags(p)

    _add_declared(p.add_argument_group("parallelism"), ParallelConfig)

    _add_declared(
        p.add_argument_group("training"), TrainingConfig, OptimizerConfig, guests_after="train_tokens"
    )
    _add_declared(p.add_argument_group("data"), DataConfig)

    _add_declared(p.add_argument_group("checkpointing"), CheckpointConfig, OptimizerConfig)

    _add_declared(p.add_argument_group("logging and evaluation"), LoggingConfig)
    return p


def _explicit(argv: Sequence[str] | None) -> dict[str, object]:
    """Only the flags the user typed (parser defaults blanked), so presets can sit between the two."""
    parser = build_parser()
    for action in parser._actions:
        if action.dest != "help":
            action.default = None
    return {k: v for k, v in vars(parser.parse_args(argv)).items() if v is not None}


def resolve_args(
    argv: Sequence[str] | None = None, world_size: int | None = None, placeholders: bool = False
) -> argparse.Namespace:
    """Parse, apply the preset, fill defaults, derive sizes, and validate (without distributed state).

    `world_size` defaults to the launcher's (`launch_world_size`: WORLD_SIZE, else SLURM_NTASKS, else 1).
    `placeholders`: the arguments a checkpoint records rather than a run to start (an import), where
    `PLACEHOLDERS` may be 0.
    """
    parser = build_parser()
    ns = parser.parse_args(argv)
    explicit = _explicit(argv)
    explicit.pop("config", None)
    recorded: dict[str, object] = {}
    if ns.config is not None:  # the file's values count as typed, below the command line's
        config = read_config(ns.config, parser)
        explicit = {**config.typed_values, **explicit}
        recorded = config.recorded_values  # a saved run's resolved values: where a preset's sit, above it
    for name, value in {**recorded, **explicit}.items():
        setattr(ns, name, value)  # --model, --load, --use-checkpoint-args ... as the file and flags say
    values: dict[str, object] = dict(vars(ns))
    del values["config"]  # the file's values are the run's own: its arguments record them, not the file
    values.update({k: v for k, v in DEFAULTS.items() if values.get(k) is None})
    if ns.model is not None:
        values.update(get_preset(ns.model))
    if ns.use_checkpoint_args:
        values.update(checkpoint_model_args(ns.load, ns.pretrained_checkpoint, typed=explicit))
    values.update(recorded)
    values.update(explicit)
    untie, tie = "untie_embeddings_and_output_weights", "tie_embeddings_and_output_weights"
    if explicit.get(untie) and not explicit.get(tie):
        values[tie] = False  # a typed untie beats a checkpoint's tie (--use-checkpoint-args)
    if "train_tokens" in explicit and "train_iters" not in explicit:
        values["train_iters"] = None  # a token budget typed by the user beats the preset's iteration count
    args = argparse.Namespace(**values)
    args.explicit_flags = sorted(k for k in explicit if k != "model")
    _derive(args, placeholders)
    source = ""
    if world_size is None:
        world_size, source = launch_world_size()
    validate_args(args, world_size=world_size, world_source=source)
    args.dropped_flags = dropped_flags(args, explicit)
    args.run_warnings = run_warnings(args, explicit)
    if os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0":
        for note in args.dropped_flags:
            print(f"note: {note}", file=sys.stderr, flush=True)
        for line in args.run_warnings:
            print(f"warning: {line}", file=sys.stderr, flush=True)
    return args


class Range(NamedTuple):
    """Where a numeric flag's value must lie, as its error line says it: `rule` (">= 1", "> 0", ">= 0",
    "in [0, 1)"), the `unit` it counts and a `hint` after the value."""

    rule: str
    unit: str = ""
    hint: str = ""


_RULES = {
    ">= 1": lambda v: v >= 1,
    ">= 0": lambda v: v >= 0,
    "> 0": lambda v: v > 0,
    "in [0, 1)": lambda v: 0 <= v < 1,
}

RANGES: dict[str, Range] = {
    f.name: Range(*([decl.range] if isinstance(decl.range, str) else decl.range))
    for cls in DECLARED
    for f, decl in declared(cls)
    if decl.range
}
"""Every numeric flag's range (a test holds every int/float flag of the parser to a row here): a value out
of it fails here in one line naming the flag, not deep inside model building or as a silent no-op."""

PLACEHOLDERS = ("train_iters", "train_tokens")
"""Flags an import records as 0 (`resolve_args(..., placeholders=True)`): the continuing run gives its own."""


def _check_ranges(args: argparse.Namespace, placeholders: bool = False) -> None:
    """One line for the first numeric flag out of its `RANGES` row, naming the flag, its range and the
    value (NaN and infinities are in none)."""
    for name, (rule, unit, hint) in RANGES.items():
        value = getattr(args, name, None)
        if value is None or isinstance(value, bool) or (placeholders and name in PLACEHOLDERS and value == 0):
            continue
        if not math.isfinite(value) or not _RULES[rule](value):
            flag = "--" + name.replace("_", "-")
            raise DiffmegError(
                f"{flag} must be {rule}{' ' + unit if unit else ''}, got {value}{'; ' + hint if hint else ''}"
            )


def _derive(args: argparse.Namespace, placeholders: bool = False) -> None:
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"):
        if getattr(args, name) is None:
            raise DiffmegError(f"--{name.replace('_', '-')} is required (or pick a preset with --model)")
    _check_ranges(args, placeholders)
    if args.kv_channels is None:
        # V1: 2h sub-heads of d share the hidden size; V2 and the baseline: h heads of d.
        v1 = args.diff_attention and args.diff_version == 1
        width = 2 * args.num_attention_heads if v1 else args.num_attention_heads
        if args.hidden_size % width:
            raise DiffmegError(
                f"hidden size {args.hidden_size} is not divisible by {width} sub-heads; pass --kv-channels"
            )
        args.kv_channels = args.hidden_size // width
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = swiglu_ffn_size(args.hidden_size)
    if args.num_noise_heads is not None and not args.diff_attention:
        raise DiffmegError(
            "--num-noise-heads groups differential attention's heads: the Transformer baseline "
            "(--no-diff-attention) has no noise heads; leave it out"
        )
    if args.diff_attention and args.num_noise_heads is None:
        args.num_noise_heads = args.num_attention_heads  # the 1:1 DIFF
    if args.num_query_groups is None:  # one KV head per noise head (per head for the 1:1 DIFF)
        args.num_query_groups = args.num_noise_heads if args.diff_attention else args.num_attention_heads
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.tokenizer_type is None:
        args.tokenizer_type = "null" if args.mock_data else "cl100k_base"
    if args.tokenizer_type == "null" and not args.mock_data and args.vocab_size is None:
        raise DiffmegError("--tokenizer-type null needs --vocab-size (one more than the largest token id)")
    resolve_tokenizer_args(args)  # HuggingFaceTokenizer: the folder loads; its fingerprint, its vocab size
    if args.vocab_size is None:
        args.vocab_size = 1024 if args.mock_data else PADDED_VOCAB_SIZE
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size
    if args.train_iters is None:
        if args.train_tokens is None:
            raise DiffmegError("give --train-iters or --train-tokens")
        args.train_iters = math.ceil(args.train_tokens / (args.global_batch_size * args.seq_length))
    if args.lr is None:
        raise DiffmegError("--lr is required (or pick a preset with --model)")
    if args.lr_decay_iters is None:
        # A run shorter than its warmup (a smoke test of a big recipe) simply stays in warmup.
        args.lr_decay_iters = max(args.train_iters, args.lr_warmup_iters + 1)
    if args.data_path is None and not args.mock_data:
        args.data_path = ["builtin"]
    if args.mock_data and args.tokenizer_type != "null":
        raise DiffmegError("--mock-data generates token ids: drop --tokenizer-type cl100k_base")
    if args.tokenizer_type == "null" and not args.mock_data and "builtin" in (args.data_path or []):
        raise DiffmegError("the builtin corpus is cl100k_base text: give --data-path with id datasets")
    if args.transformer_impl == "auto":
        args.transformer_impl = "transformer_engine" if transformer_engine_available() else "local"
    if args.save_interval is None:
        args.save_interval = args.train_iters


def _validate_noise_heads(args: argparse.Namespace, tp: int) -> None:
    """Grouped differential attention's layout, in one line each: the noise heads divide the signal heads, a
    tensor-parallel rank holds whole groups, a group's heads share one KV head."""
    heads, noise, groups = args.num_attention_heads, args.num_noise_heads, args.num_query_groups
    if heads % noise:
        raise DiffmegError(
            f"--num-noise-heads {noise} must divide the {heads} differential heads (--num-attention-heads): "
            f"each noise head serves heads / noise signal heads; e.g. {_divisors_line(heads)}"
        )
    if noise % tp:
        raise DiffmegError(
            f"--num-noise-heads {noise} cannot be split over --tensor-model-parallel-size {tp}: a rank holds "
            f"whole groups of signal heads and their noise head; the TP sizes this model splits over: "
            f"{_tp_sizes_line(args)}"
        )
    if noise % groups:
        raise DiffmegError(
            f"--num-noise-heads {noise} must be a multiple of --num-query-groups {groups}: a group's signal "
            f"and noise heads share one KV head (leave --num-query-groups out for one per noise head)"
        )


def _tp_sizes_line(args: argparse.Namespace) -> str:
    """The tensor-parallel sizes every split of the model admits: heads, KV groups, noise heads (DIFF) and
    the vocabulary each divisible by TP."""
    counts = [args.num_attention_heads, args.num_query_groups, args.vocab_size]
    if args.diff_attention and args.num_noise_heads:
        counts.append(args.num_noise_heads)
    fits = [t for t in range(1, args.num_attention_heads + 1) if all(c % t == 0 for c in counts)]
    return ", ".join(map(str, fits))


def _divisors_line(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def validate_args(args: argparse.Namespace, world_size: int, world_source: str = "") -> None:
    """Every impossible combination gets one line saying what is wrong and what to change.

    `world_source`: the environment variable the world size came from (a layout error names it: a WORLD_SIZE
    left in the shell is otherwise invisible)."""
    origin = f" ({world_source}={world_size} in the environment)" if world_source else ""
    tp, pp, cp = (
        args.tensor_model_parallel_size,
        args.pipeline_model_parallel_size,
        args.context_parallel_size,
    )
    if world_size % (tp * pp * cp):
        raise DiffmegError(
            f"world size {world_size}{origin} is not divisible by TP x PP x CP = {tp} x {pp} x {cp}; "
            f"change the parallel sizes or the number of processes"
        )
    dp = world_size // (tp * pp * cp)
    args.data_parallel_size = dp
    if args.num_layers % pp:
        raise DiffmegError(f"{args.num_layers} layers cannot be split into {pp} pipeline stages evenly")
    heads = args.num_attention_heads
    if heads % tp:
        raise DiffmegError(
            f"{heads} attention heads cannot be split over tensor-model-parallel-size {tp}; the TP sizes "
            f"this model splits over: {_tp_sizes_line(args)}"
        )
    if args.diff_attention:
        _validate_noise_heads(args, tp)
    if args.num_query_groups % tp or heads % args.num_query_groups:
        raise DiffmegError(
            f"--num-query-groups {args.num_query_groups} must divide the {heads} heads "
            f"and be divisible by TP {tp}"
        )
    v2 = args.diff_attention and args.diff_version == 2
    if args.diff_attention and not v2:
        te_ok = cp_attention_available()
    else:  # the baseline's and V2's CP modes are megatron-core's own attention with Transformer Engine
        te_ok = args.transformer_impl == "transformer_engine"
    args.cp_comm_type = validate_cp(
        cp_size=cp,
        comm_type=args.cp_comm_type,
        diff_attention=args.diff_attention,
        # what Ulysses shards whole: V2's h + n query heads (whole noise groups), V1's n groups (n = h: heads)
        heads=heads + args.num_noise_heads if v2 else args.num_noise_heads if args.diff_attention else heads,
        kv_heads=args.num_query_groups,
        tp=tp,
        attention_dropout=0.0 if v2 else args.attention_dropout,
        seq_length=args.seq_length,
        cp_attention_available=te_ok,
        unit="query heads" if v2 else None,
    )
    if args.vocab_size % tp:
        raise DiffmegError(
            f"vocab size {args.vocab_size} is not divisible by tensor-model-parallel-size {tp}"
        )
    if args.sequence_parallel and tp == 1:
        args.sequence_parallel = False  # as Megatron-LM: SP is a TP feature
    if args.sequence_parallel and args.seq_length % tp:
        raise DiffmegError(f"--sequence-parallel needs seq length {args.seq_length} divisible by TP {tp}")
    if args.global_batch_size % (args.micro_batch_size * dp):
        raise DiffmegError(
            f"global batch {args.global_batch_size} is not divisible by "
            f"micro batch {args.micro_batch_size} x "
            f"data-parallel size {dp}{origin}; change the batch sizes or the number of processes"
        )
    _validate_virtual_pipeline(args, pp, dp)
    if args.bf16 and args.fp16:
        raise DiffmegError("choose one of --bf16 and --fp16")
    if args.tie_embeddings_and_output_weights and args.untie_embeddings_and_output_weights:
        raise DiffmegError(
            "--tie-embeddings-and-output-weights and --untie-embeddings-and-output-weights contradict each "
            "other; keep one (untied is the default)"
        )
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        raise DiffmegError(
            "--override-opt-param-scheduler (this run's learning-rate schedule) and "
            "--use-checkpoint-opt-param-scheduler (the checkpoint's) contradict each other; keep one"
        )
    if args.overlap_param_gather and not args.use_distributed_optimizer:
        raise DiffmegError(
            "--overlap-param-gather overlaps the distributed optimizer's parameter all-gather: add "
            "--use-distributed-optimizer"
        )
    if args.overlap_param_gather and not args.overlap_grad_reduce:
        raise DiffmegError("--overlap-param-gather needs --overlap-grad-reduce (as in Megatron-LM)")
    if args.fp8_format is not None and args.transformer_impl != "transformer_engine":
        # TE's FP8 on its spec is megatron-core's own; torchao's on the local spec has `check_fp8`'s rules
        from diffmeg.fusions.torchao_fp8 import check_fp8

        check_fp8(
            args.fp8_recipe,
            args.recompute_granularity,
            None,
            args.gradient_accumulation_fusion,
            emulate=False,
        )
    _validate_graphs(args)
    if args.gradient_accumulation_fusion and (reason := grad_accum.unsupported_reason()) is not None:
        raise DiffmegError(reason)
    if args.lr_warmup_iters >= args.lr_decay_iters:
        raise DiffmegError(
            f"--lr-warmup-iters {args.lr_warmup_iters} exceeds the decay horizon {args.lr_decay_iters}"
        )
    if args.min_lr > args.lr:
        raise DiffmegError(f"--min-lr {args.min_lr} is larger than --lr {args.lr}")
    if args.recompute_granularity == "full" and args.recompute_method is None:
        args.recompute_method = "uniform"
    if args.recompute_method is not None and args.recompute_num_layers is None:
        args.recompute_num_layers = 1
    if args.finetune and args.load is None:
        raise DiffmegError("--finetune needs --load")
    if args.ckpt_step is not None and args.load is None:
        raise DiffmegError("--ckpt-step needs --load (the checkpoint directory whose iteration it names)")
    from diffmeg.storage import check_output  # the logs' outputs, before anything is built (--save: later)

    if args.save is not None and os.path.isdir(args.save) and holds_hf_export(args.save):
        raise DiffmegError(
            f"--save {args.save} holds a Hugging Face model export (config.json and safetensors weights): a "
            "run's checkpoints would be mixed into it; pick another --save folder"
        )
    if not args.mock_data:
        for entry in args.data_path or []:
            if os.path.isdir(entry):
                raise DiffmegError(_data_folder_line(entry))
    if args.export_hf_at_end is not None:
        _check_export_target(args.export_hf_at_end, args.save)
    if args.tensorboard_dir:
        check_output(args.tensorboard_dir, "--tensorboard-dir", folder=True)
    if args.metrics_file:
        check_output(args.metrics_file, "--metrics-file", folder=False)
    if args.wandb_save_dir:
        check_output(args.wandb_save_dir, "--wandb-save-dir", folder=True)


def _check_export_target(target: str, save: str | None) -> None:
    """--export-hf-at-end DIR is refused at the start, not after a week of training, when it cannot be
    written or would share a folder with the checkpoints."""
    from diffmeg.storage import check_output, paths_overlap

    if save is None:
        raise DiffmegError("--export-hf-at-end exports the final checkpoint: it needs --save")
    if paths_overlap(target, save):
        raise DiffmegError(
            f"--export-hf-at-end {target} overlaps --save {save}: a Hugging Face folder and the checkpoints "
            "cannot share a folder; pick a folder beside them (e.g. RUN/hf)"
        )
    if os.path.isdir(target) and holds_saves(target):
        raise DiffmegError(
            f"--export-hf-at-end {target} holds a run's checkpoints; pick another folder for the export"
        )
    check_output(target, "--export-hf-at-end", folder=True)


def _data_folder_line(folder: str) -> str:
    """--data-path names a folder: what it holds and the prefix to pass instead (a dataset is a `.bin`/`.idx`
    pair's path without the extension, not the folder around it)."""
    found = datasets_in(folder)
    if not found:
        return (
            f"--data-path {folder} is a folder, not a dataset, and holds no .bin/.idx dataset: pass the "
            "prefix of a .bin/.idx pair written by tools/preprocess_data.py (its path without the extension)"
        )
    names = [os.path.basename(p) for p in found]
    shown = ", ".join(names[:4]) + (f" (and {len(names) - 4} more)" if len(names) > 4 else "")
    return (
        f"--data-path {folder} is a folder, not a dataset: it holds {len(names)} dataset(s), {shown}; pass "
        f"{os.path.join(folder, names[0])} (the prefix, without .bin/.idx), or several as 'w1 p1 w2 p2 ...'"
    )


def _validate_virtual_pipeline(args: argparse.Namespace, pp: int, dp: int) -> None:
    """--num-layers-per-virtual-pipeline-stage -> `virtual_pipeline_model_parallel_size` (None: no
    interleaving), as Megatron-LM derives it, with megatron-core's interleaved-schedule limits as errors."""
    per_stage = args.num_layers_per_virtual_pipeline_stage
    args.virtual_pipeline_model_parallel_size = None
    if per_stage is None:
        return
    layers = args.num_layers // pp
    if layers % per_stage:  # >= 1: RANGES
        raise DiffmegError(
            f"--num-layers-per-virtual-pipeline-stage {per_stage} must divide the {layers} layers of each of "
            f"the {pp} pipeline stages"
        )
    vp = layers // per_stage
    if vp == 1:
        return  # one chunk per rank: the plain 1F1B schedule (a note says the flag has no effect)
    if pp == 1:
        raise DiffmegError(
            "--num-layers-per-virtual-pipeline-stage interleaves pipeline stages: it needs "
            "--pipeline-model-parallel-size > 1"
        )
    micro = args.global_batch_size // (args.micro_batch_size * dp)
    if micro % pp:
        raise DiffmegError(
            f"the interleaved pipeline schedule needs the micro-batches per step ({micro} = global batch "
            f"{args.global_batch_size} / (micro batch {args.micro_batch_size} x DP {dp})) to be a multiple "
            f"of PP {pp}; change --global-batch-size or --micro-batch-size"
        )
    args.virtual_pipeline_model_parallel_size = vp


def _validate_graphs(args: argparse.Namespace) -> None:
    """--sdpa-backend, --cuda-graph-impl and --compile-layers: where they cannot run, and together."""
    backend = args.sdpa_backend
    reason = registry.entry("sdpa_kernel", backend).unavailable()
    if reason is not None:
        raise DiffmegError(f"--sdpa-backend {backend}: {reason}")
    if args.cuda_graph_impl == "none":
        return
    reason = graphs.cuda_graphs_unsupported_reason()
    if reason is not None:
        raise DiffmegError(f"--cuda-graph-impl local: {reason}; leave the flag out on this machine")
    if args.recompute_granularity == "full":
        raise DiffmegError(
            "--cuda-graph-impl local cannot capture fully recomputed layers (as in Megatron-LM): drop "
            "--recompute-granularity full, or use selective"
        )
    if args.compile_layers:
        raise DiffmegError(
            "--cuda-graph-impl local and --compile-layers both take over each layer's call: measure them one "
            "at a time (keep one of the two flags)"
        )


def dropped_flags(args: argparse.Namespace, explicit: dict[str, object]) -> list[str]:
    """The typed flags the resolved run ignores, each with why (printed as notes by `resolve_args`)."""
    notes = []
    if explicit.get("sequence_parallel") and not args.sequence_parallel:
        notes.append(
            "--sequence-parallel is dropped: it splits activations over tensor-parallel ranks and "
            f"--tensor-model-parallel-size is {args.tensor_model_parallel_size}"
        )
    if "cp_comm_type" in explicit and args.context_parallel_size == 1:
        notes.append(f"--cp-comm-type {explicit['cp_comm_type']} has no effect: --context-parallel-size is 1")
    if "train_tokens" in explicit and "train_iters" in explicit:
        notes.append(f"--train-tokens is ignored: --train-iters {args.train_iters} sets the run's length")
    if "fp8_recipe" in explicit and args.fp8_format is None:
        notes.append("--fp8-recipe has no effect without --fp8-format")
    if not args.diff_attention:
        for name in ("lambda_init", "lambda_std", "diff_attn_backend"):
            if name in explicit:
                flag = "--" + name.replace("_", "-")
                notes.append(f"{flag} has no effect: the Transformer baseline has no differential attention")
    if args.data_parallel_size * args.context_parallel_size == 1:
        for name in ("overlap_grad_reduce", "overlap_param_gather"):
            if explicit.get(name):
                notes.append(
                    f"--{name.replace('_', '-')} has no effect: no data-parallel gradient or parameter "
                    "communication with DP x CP = 1"
                )
    if "ddp_bucket_size" in explicit and not args.overlap_grad_reduce:
        notes.append("--ddp-bucket-size has no effect without --overlap-grad-reduce (one bucket per step)")
    per_stage = explicit.get("num_layers_per_virtual_pipeline_stage")
    if per_stage is not None and args.virtual_pipeline_model_parallel_size is None:
        notes.append(
            f"--num-layers-per-virtual-pipeline-stage {per_stage} has no effect: it equals the "
            f"{args.num_layers // args.pipeline_model_parallel_size} layers of a pipeline stage (one model "
            "chunk per rank)"
        )
    if "save_interval" in explicit and args.save is None:
        notes.append("--save-interval has no effect without --save")
    chunk = explicit.get("cross_entropy_chunk_size")
    tokens = args.micro_batch_size * args.seq_length // args.context_parallel_size  # per rank
    if chunk is not None and chunk >= tokens:
        notes.append(
            f"--cross-entropy-chunk-size {chunk} saves no memory: a rank's micro-batch has only {tokens} "
            "tokens, so the loss runs in one chunk (and recomputes it)"
        )
    for name in ("override_opt_param_scheduler", "use_checkpoint_opt_param_scheduler"):
        if explicit.get(name) and args.load is None:
            notes.append(f"--{name.replace('_', '-')} has no effect without --load (no schedule to resume)")
    if explicit.get("async_save") and args.save is None:
        notes.append("--async-save has no effect without --save")
    if explicit.get("compile_layers") and (reason := graphs.compile_no_effect_reason()) is not None:
        notes.append(f"--compile-layers has no effect: {reason}")
    backend = explicit.get("sdpa_backend", registry.AUTO)
    if backend != registry.AUTO and (reason := _no_sdpa_reason(args)) is not None:
        notes.append(f"--sdpa-backend {backend} has no effect: {reason}")
    if args.mock_data and "data_path" in explicit:
        notes.append("--data-path is ignored: --mock-data generates the data")
    return notes


def run_warnings(args: argparse.Namespace, explicit: dict[str, object]) -> list[str]:
    """What the resolved run will do that its flags suggest it would not, each a line (printed as warnings
    by `resolve_args`, a dry run's included): it runs, but likely not as meant."""
    lines = []
    if args.lr_warmup_iters > 0 and args.lr_warmup_iters >= args.train_iters:
        lines.append(
            f"--lr-warmup-iters {args.lr_warmup_iters} is not shorter than the run's {args.train_iters} "
            f"iterations: the learning rate never reaches --lr {args.lr:g}; shorten the warmup (or lengthen "
            "the run)"
        )
    asks_eval = "eval_interval" in explicit or "eval_iters" in explicit
    if asks_eval and args.eval_iters > 0 and not args.mock_data and split_matrix(args.split)[1] is None:
        lines.append(
            f"--split {args.split} gives validation no data: validation will not run, whatever "
            "--eval-interval says; give the valid split a weight (e.g. --split 969,30,1) to evaluate"
        )
    return lines


def _no_sdpa_reason(args: argparse.Namespace) -> str | None:
    """Why no attention of this run calls torch's SDPA (so `--sdpa-backend` changes nothing), or None."""
    if args.diff_attention and args.diff_version == 1:
        backend = registry.entry("diff_attention", args.diff_attn_backend).name  # auto resolved
        if not backend.startswith("sdpa"):
            return f"DIFF V1's attention backend is {backend}, not torch's SDPA"
        return None
    if args.transformer_impl == "transformer_engine":
        return "the Transformer Engine spec's core attention is TE's own, not torch's SDPA"
    return None
