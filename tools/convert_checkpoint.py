"""Convert pretrain_diff.py checkpoints to and from Hugging Face folders; upcycle a Transformer into DIFF V2.

    python tools/convert_checkpoint.py mcore-to-hf --load ckpt/ --save hf/ [--iteration N]
        [--dtype bf16|fp16|fp32] [--tokenizer-file cl100k_base.tiktoken] [--overwrite]
    python tools/convert_checkpoint.py hf-to-mcore --load hf/ --save ckpt/ [--dtype bf16|fp16|fp32]
        [--tensor-model-parallel-size N] [--pipeline-model-parallel-size N] [--overwrite]
        [-- PRETRAIN_DIFF_FLAGS ...]
    python tools/convert_checkpoint.py upcycle --load hf/llama_or_transformer_ckpt --save ckpt/diff2 \
        [--dtype bf16|fp16|fp32] [--overwrite] [-- PRETRAIN_DIFF_FLAGS ...]

DIFF checkpoints become transformers' DiffLlamaForCausalLM, Transformer baselines (--no-diff-attention)
LlamaForCausalLM, DIFF V2 a LLaMA-layout folder with its modeling file, and back; Motif's folders (DIFF V1
with PolyNorm) import, and export back to Motif's format with diffmeg's own remote code (an import's
config.json keys come back as they were; lambda vectors in fp32 beside the weights' dtype). All directions
stream one layer at a time (memory: about two layers, whatever the depth) and print a progress line per layer.
mcore-to-hf reads any TP/PP layout (checkpoints are layout-free) and writes config.json, model-*.safetensors
shards with their index, generation_config.json and the tokenizer (cl100k_base with tiktoken's ids, or the
Hugging Face tokenizer the model was trained with). hf-to-mcore writes a weights-only checkpoint (iteration 0,
in the source's dtype unless --dtype) that `pretrain_diff.py --load ckpt/ --finetune` continues from, at any
TP/PP (it prints the command, runnable as printed); flags after `--` are recorded in its args.json as a
pretrain_diff.py run would resolve them. upcycle turns a Transformer (a Hugging Face Llama / Mistral folder or
a transformer-* checkpoint) into a weights-only DIFF V2 checkpoint with the same logits, keeping its
tokenizer. --overwrite replaces only what a conversion writes: in an export folder its files (config, weights
and index, tokenizer, generation config, remote code), keeping every other file; a checkpoint folder holding
anything but a converted checkpoint is refused. See docs/conversion.md.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
import warnings

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # megatron-core compiles fusions at import; not needed here
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
warnings.filterwarnings("ignore", category=FutureWarning)  # deprecations inside megatron-core / torch
warnings.filterwarnings("ignore", category=UserWarning, module="megatron")

import torch  # noqa: E402

from diffmeg.conversion.checkpoint_io import (  # noqa: E402
    release_freed_memory,
)
from diffmeg.conversion.hf_export import export_checkpoint  # noqa: E402
from diffmeg.conversion.hf_import import (  # noqa: E402
    continue_training_command,
    open_hf_folder,
    resolved_pretrain_args,
)
from diffmeg.conversion.mcore_writer import StreamingCheckpointWriter, part_of  # noqa: E402
from diffmeg.conversion.output_dir import (  # noqa: E402
    CONVERTED_CHECKPOINT,
    atomic_output_dir,
    check_output_path,
)
from diffmeg.conversion.progress import Progress, clock  # noqa: E402
from diffmeg.conversion.tokenizer_io import folder_tokenizer  # noqa: E402
from diffmeg.conversion.upcycle_io import open_upcycle_source, upcycled_args, write_upcycled  # noqa: E402
from diffmeg.errors import DiffmegError, cli_errors  # noqa: E402
from diffmeg.runtime import single_process  # noqa: E402

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
        "mcore-to-hf", help="pretrain_diff.py checkpoint -> HF DiffLlama / Llama / DIFF V2 / Motif folder"
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
    e.add_argument("--tokenizer-model", default=None, help="Hugging Face tokenizer (else recorded)")
    e.add_argument("--no-tokenizer", action="store_true", help="write no tokenizer files")
    e.add_argument("--max-shard-size", type=_size, default=_size("5GB"), help="per safetensors file (5GB)")
    e.add_argument(
        "--overwrite", action="store_true", help="replace the export's files in --save (other files stay)"
    )
    i = sub.add_parser(
        "hf-to-mcore",
        help="Hugging Face DiffLlama / Llama / DIFF V2 / Motif folder -> pretrain_diff.py checkpoint",
    )
    i.add_argument("--load", required=True, help="folder with config.json and safetensors weights")
    u = sub.add_parser(
        "upcycle", help="Transformer (HF Llama folder or transformer-* checkpoint) -> DIFF V2 checkpoint"
    )
    u.add_argument("--load", required=True, help="HF Llama / Mistral folder or Transformer checkpoint")
    for q in (i, u):  # both write a weights-only checkpoint
        q.epilog = "-- PRETRAIN_DIFF_FLAGS ...: pretrain_diff.py flags after `--`, recorded in args.json"
        q.add_argument("--save", required=True, help="output checkpoint directory")
        q.add_argument("--tensor-model-parallel-size", type=int, default=1, help="recorded in args.json")
        q.add_argument("--pipeline-model-parallel-size", type=int, default=1, help="recorded in args.json")
        q.add_argument("--seq-length", type=int, default=None, help="default: max_position_embeddings")
        q.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: the source's")
        q.add_argument(
            "--overwrite", action="store_true", help="replace a converted checkpoint in --save (nothing else)"
        )
    return p


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """Our flags, and the pretrain_diff.py flags given after `--` (hf-to-mcore and upcycle)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    args = build_parser().parse_args(argv)
    if extra and args.command == "mcore-to-hf":
        raise DiffmegError("flags after `--` are pretrain_diff.py flags for hf-to-mcore and upcycle only")
    return args, extra


def _torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, DTYPES[name])


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def mcore_to_hf(args: argparse.Namespace) -> None:
    """Stream a megatron-core checkpoint into a Hugging Face folder, one layer at a time."""
    export_checkpoint(
        args.load,
        args.save,
        iteration=args.iteration,
        dtype=_torch_dtype(args.dtype) if args.dtype else None,
        tokenizer_file=args.tokenizer_file,
        tokenizer_model=args.tokenizer_model,
        no_tokenizer=args.no_tokenizer,
        max_shard_size=args.max_shard_size,
        overwrite=args.overwrite,
    )


def hf_to_mcore(args: argparse.Namespace, extra: list[str]) -> None:
    """A DiffLlama / Llama folder -> weights-only megatron-core checkpoint at iteration 0, streamed."""
    start = time.perf_counter()
    check_output_path(args.save, args.overwrite, args.load, CONVERTED_CHECKPOINT)
    folder = open_hf_folder(args.load)
    layout = folder.layout
    tokenizer = folder_tokenizer(args.load)  # the model keeps its tokenizer (copied into the checkpoint)
    resolved = resolved_pretrain_args(
        layout,
        folder.config,
        [*tokenizer.flags(), *extra],
        seq_length=args.seq_length,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
    )
    tokenizer.record(resolved)
    dtype = _torch_dtype(args.dtype) if args.dtype else folder.dtype
    single_process()
    needed = layout.mcore_parameters() * dtype.itemsize
    with atomic_output_dir(args.save, CONVERTED_CHECKPOINT, needed_bytes=needed) as out:
        writer = StreamingCheckpointWriter(out, resolved, dtype)
        progress = Progress("hf-to-mcore", layout.num_layers)
        for block in folder.mcore_blocks(dtype):  # each tensor outside the layers, then layer by layer
            writer.write(block)
            part = part_of(next(iter(block)))
            del block
            release_freed_memory()
            if isinstance(part, int):
                progress.layer_done(part + 1)
            else:
                progress.restart()
        writer.close()
        tokenizer.copy_into(out)
    print(
        f"wrote {args.save} ({layout.architecture} -> iteration 0, weights only, {_dtype_name(dtype)}) in "
        f"{clock(time.perf_counter() - start)}; continue training with:"
    )
    print(f"  {continue_training_command(layout, resolved, args.save, extra)}")


def upcycle(args: argparse.Namespace, extra: list[str]) -> None:
    """A Transformer (HF Llama-family folder or transformer-* checkpoint) -> weights-only DIFF V2."""
    start = time.perf_counter()
    check_output_path(args.save, args.overwrite, args.load, CONVERTED_CHECKPOINT)
    source = open_upcycle_source(args.load)
    layout, resolved = upcycled_args(
        source,
        extra,
        seq_length=args.seq_length,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
    )
    dtype = _torch_dtype(args.dtype) if args.dtype else source.dtype
    print(f"upcycling {args.load}: {source.description}", file=sys.stderr, flush=True)
    write_upcycled(source, args.save, resolved, dtype, Progress("upcycle", layout.num_layers))
    print(
        f"wrote {args.save} (DIFF V2: {layout.num_heads} heads -> {2 * layout.num_heads} query heads over "
        f"{layout.num_kv_heads} KV heads; iteration 0, weights only, {_dtype_name(dtype)}) in "
        f"{clock(time.perf_counter() - start)}; continue training with:"
    )
    print(
        f"  python pretrain_diff.py --use-checkpoint-args --pretrained-checkpoint {shlex.quote(args.save)} "
        f"--load RUN/checkpoints --save RUN/checkpoints --lr ... --train-tokens ... --data-path ..."
    )


@cli_errors(interrupted="nothing was written to --save (the partial output is removed); run it again")
def main(argv: list[str] | None = None) -> int:
    args, extra = parse_args(argv)
    {"mcore-to-hf": lambda: mcore_to_hf(args), "hf-to-mcore": lambda: hf_to_mcore(args, extra),
     "upcycle": lambda: upcycle(args, extra)}[args.command]()  # fmt: skip
    return 0


if __name__ == "__main__":  # megatron-core's checkpoint writer starts a spawn-context process manager
    sys.exit(main())
