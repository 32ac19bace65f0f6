"""Convert between pretrain_diff.py checkpoints and Hugging Face DiffLlama / Llama folders.

    python tools/convert_checkpoint.py mcore-to-hf --load ckpt/ --save hf/ [--iteration N]
        [--dtype bf16|fp16|fp32] [--tokenizer-file cl100k_base.tiktoken] [--overwrite]
    python tools/convert_checkpoint.py hf-to-mcore --load hf/ --save ckpt/ [--tensor-model-parallel-size N]
        [--pipeline-model-parallel-size N] [--overwrite] [-- PRETRAIN_DIFF_FLAGS ...]

DIFF checkpoints become transformers' DiffLlamaForCausalLM, Transformer baselines (--no-diff-attention)
LlamaForCausalLM, and back. mcore-to-hf reads any TP/PP layout (checkpoints are layout-free) one layer
at a time and writes config.json, model-*.safetensors shards with their index, generation_config.json
and the cl100k_base tokenizer with tiktoken's ids. hf-to-mcore writes a weights-only checkpoint
(iteration 0) that `pretrain_diff.py --load ckpt/ --finetune` continues from; flags after `--` are
recorded in its args.json as a pretrain_diff.py run would resolve them. See docs/conversion.md.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import warnings

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # megatron-core compiles fusions at import; not needed here
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
warnings.filterwarnings("ignore", category=FutureWarning)  # deprecations inside megatron-core / torch
warnings.filterwarnings("ignore", category=UserWarning, module="megatron")

from diffmeg.errors import DiffmegError, cli_errors  # noqa: E402

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _size(text: str) -> int:
    """'5GB', '500MB', '1024' -> bytes (powers of 1000, as Hugging Face counts shard sizes)."""
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "B": 1}
    upper = text.strip().upper()
    unit = next((u for u in units if upper.endswith(u)), "")
    try:
        value = int(float(upper[: len(upper) - len(unit)].strip()) * units.get(unit, 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 5GB or 500MB)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be > 0, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    e = sub.add_parser(
        "mcore-to-hf", help="pretrain_diff.py checkpoint -> Hugging Face DiffLlama / Llama folder"
    )
    e.add_argument(
        "--load", required=True, help="checkpoint directory (holds latest_checkpointed_iteration.txt)"
    )
    e.add_argument("--iteration", type=int, default=None, help="default: the latest complete one")
    e.add_argument("--save", required=True, help="output folder for the Hugging Face model")
    e.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: the checkpoint's")
    e.add_argument(
        "--tokenizer-file", default=None, help="cl100k_base BPE file (else the checkpoint's / env)"
    )
    e.add_argument("--no-tokenizer", action="store_true", help="write no tokenizer files")
    e.add_argument("--max-shard-size", type=_size, default=_size("5GB"), help="per safetensors file (5GB)")
    e.add_argument("--overwrite", action="store_true", help="replace an existing --save folder")
    i = sub.add_parser(
        "hf-to-mcore", help="Hugging Face DiffLlama / Llama folder -> pretrain_diff.py checkpoint"
    )
    i.add_argument("--load", required=True, help="folder with config.json and safetensors weights")
    i.add_argument("--save", required=True, help="output checkpoint directory")
    i.add_argument("--tensor-model-parallel-size", type=int, default=1, help="recorded in args.json")
    i.add_argument("--pipeline-model-parallel-size", type=int, default=1, help="recorded in args.json")
    i.add_argument("--seq-length", type=int, default=None, help="default: max_position_embeddings")
    i.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="stored weights (fp32)")
    i.add_argument("--overwrite", action="store_true", help="replace an existing --save directory")
    return p


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """Our flags, and the pretrain_diff.py flags given after `--` (hf-to-mcore only)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    args = build_parser().parse_args(argv)
    if extra and args.command != "hf-to-mcore":
        raise DiffmegError("flags after `--` are pretrain_diff.py flags for hf-to-mcore only")
    return args, extra


def _torch_dtype(name: str):
    import torch

    return getattr(torch, DTYPES[name])


def _export_tokenizer(args: argparse.Namespace, ckpt_args: argparse.Namespace, layout):
    """The fast tokenizer to write, or None (with the reason on stderr) when the model has no cl100k vocab."""
    from diffmeg.data.tokenizer import CL100K_N_VOCAB, load_tokenizer

    if args.no_tokenizer:
        return None
    if layout.vocab_size < CL100K_N_VOCAB:
        print(
            f"note: vocabulary {layout.vocab_size} < cl100k_base's {CL100K_N_VOCAB} (a mock-data model): "
            f"writing no tokenizer",
            file=sys.stderr,
        )
        return None
    from diffmeg.conversion.tokenizer_export import build_fast_tokenizer

    tokenizer = load_tokenizer(args.tokenizer_file or getattr(ckpt_args, "tokenizer_file", None))
    return build_fast_tokenizer(tokenizer.encoding, model_max_length=layout.max_position_embeddings)


def mcore_to_hf(args: argparse.Namespace) -> None:
    """Stream a megatron-core checkpoint into a DiffLlama / Llama folder, one layer at a time."""
    import transformers

    from diffmeg.conversion.checkpoint_io import (
        McoreCheckpointReader,
        SafetensorsShardWriter,
        atomic_output_dir,
        check_output_path,
        save_hf_tokenizer,
    )
    from diffmeg.conversion.hf_config import (
        generation_config_dict,
        hf_config_dict,
        layout_from_args,
        transformers_config_class,
    )
    from diffmeg.conversion.mapping import HF_LAYER_PREFIX, mcore_globals_to_hf, mcore_layer_to_hf
    from diffmeg.data.tokenizer import CL100K_N_VOCAB, EOD_ID

    check_output_path(args.save, args.overwrite, args.load)
    reader = McoreCheckpointReader(args.load, args.iteration)  # plain file reads: no process group needed
    layout = layout_from_args(reader.args)
    reader.check(layout)
    dtype = _torch_dtype(args.dtype) if args.dtype else reader.dtype
    eod = EOD_ID if layout.vocab_size >= CL100K_N_VOCAB else None
    config = transformers_config_class(layout)(
        **hf_config_dict(
            layout,
            dtype=str(dtype).removeprefix("torch."),
            bos_token_id=eod,
            eos_token_id=eod,
            initializer_range=float(getattr(reader.args, "init_method_std", 0.02)),
            lambda_std=float(getattr(reader.args, "lambda_std", 0.1)),
        )
    )
    tokenizer = _export_tokenizer(args, reader.args, layout)
    with atomic_output_dir(args.save) as out:
        writer = SafetensorsShardWriter(out, args.max_shard_size)
        writer.add(mcore_globals_to_hf(reader.read_globals(layout), layout, dtype))
        for index in range(layout.num_layers):
            hf_layer = mcore_layer_to_hf(reader.read_layer(layout, index), layout, dtype)
            writer.add({HF_LAYER_PREFIX.format(index) + k: v for k, v in hf_layer.items()})
        shards = writer.close()
        config.save_pretrained(out)
        transformers.GenerationConfig(**generation_config_dict(eod, eod)).save_pretrained(out)
        if tokenizer is not None:
            save_hf_tokenizer(tokenizer, out)
    print(
        f"wrote {args.save}: {layout.architecture}, {layout.num_layers} layers, "
        f"{str(dtype).removeprefix('torch.')}, "
        f"{len(shards)} shard(s), {writer.total_bytes / 1e9:.3f} GB"
        f"{', tokenizer' if tokenizer is not None else ''} (from {reader.path})"
    )


def hf_to_mcore(args: argparse.Namespace, extra: list[str]) -> None:
    """A DiffLlama / Llama folder -> weights-only megatron-core checkpoint at iteration 0."""
    from diffmeg.checkpoints import build_single_rank_model
    from diffmeg.conversion.checkpoint_io import (
        atomic_output_dir,
        check_output_path,
        fill_model,
        write_mcore_checkpoint,
    )
    from diffmeg.conversion.hf_config import pretrain_flags
    from diffmeg.conversion.hf_import import open_hf_folder, resolved_pretrain_args
    from diffmeg.runtime import single_process

    check_output_path(args.save, args.overwrite, args.load)
    folder = open_hf_folder(args.load)
    resolved = resolved_pretrain_args(
        folder.layout,
        folder.config,
        extra,
        seq_length=args.seq_length,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
    )
    dtype = _torch_dtype(args.dtype)
    single_process()
    model = build_single_rank_model(resolved, dtype)
    fill_model(model, folder.mcore_blocks(dtype))
    with atomic_output_dir(args.save) as out:
        write_mcore_checkpoint(out, model, resolved)
    flags = pretrain_flags(folder.layout) + ["--seq-length", str(resolved.seq_length)]
    print(
        f"wrote {args.save} ({folder.layout.architecture} -> iteration 0, weights only, {args.dtype}); "
        f"continue training with:"
    )
    print(f"  python pretrain_diff.py {shlex.join(flags)} --load {shlex.quote(args.save)} --finetune ...")


@cli_errors
def main(argv: list[str] | None = None) -> int:
    args, extra = parse_args(argv)
    if args.command == "mcore-to-hf":
        mcore_to_hf(args)
    else:
        hf_to_mcore(args, extra)
    return 0


if __name__ == "__main__":  # megatron-core's checkpoint writer starts a spawn-context process manager
    sys.exit(main())
