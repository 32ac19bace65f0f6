r"""Generate text from a pretrain_diff.py checkpoint (any TP/PP it was saved at) or a Hugging Face DiffLlama /
Llama / DIFF V2 folder (mapped into our model in memory, as the evaluation tools read it), with a KV cache.

    python tools/generate.py --load ckpt/ --prompt "The capital of France is" --max-new-tokens 32 --greedy
    python tools/generate.py --load ckpt/ --prompt "Once" --max-new-tokens 64 --temperature 0.8 --top-p 0.95 \
        --seed 0 --json
    python tools/generate.py --load hf/ --prompt "The capital of France is" --max-new-tokens 32 --greedy

Stops at <|endoftext|> (100257), or at its own tokenizer's end of sequence for a model imported or upcycled
from Hugging Face. --json prints one object: prompt, prompt_ids, output_ids, output_text, stop_reason
("eod" or "length").
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # megatron-core compiles fusions at import; not needed here
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
warnings.filterwarnings("ignore", category=FutureWarning)  # deprecations inside megatron-core / torch
warnings.filterwarnings("ignore", category=UserWarning, module="megatron")

from diffmeg.errors import DiffmegError, cli_errors  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load", required=True, help="checkpoint directory or Hugging Face model folder")
    p.add_argument(
        "--iteration", type=int, default=None, help="checkpoint iteration (default: the latest complete one)"
    )
    p.add_argument("--prompt", required=True, help="text to continue")
    p.add_argument("--max-new-tokens", type=int, required=True, help="tokens to generate at most")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--greedy", action="store_true", help="argmax decoding")
    mode.add_argument("--temperature", type=float, default=None, help="sampling temperature (default 1.0)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass (default 1.0)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: nondeterministic)")
    p.add_argument("--json", action="store_true", help="print ids and text as one JSON object")
    p.add_argument(
        "--tokenizer-file", default=None, help="cl100k_base BPE file (else the checkpoint's / env)"
    )
    p.add_argument(
        "--tokenizer-model",
        default=None,
        help="Hugging Face tokenizer folder of an imported / upcycled model (else the checkpoint's own)",
    )
    p.add_argument("--no-cache", action="store_true", help="recompute the whole sequence every step (slow)")
    args = p.parse_args(argv)
    if args.greedy and args.top_p is not None:
        p.error("--top-p applies to sampling; drop it or --greedy")
    return args


@cli_errors(interrupted="nothing was written")
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.max_new_tokens < 0:
        raise DiffmegError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    from diffmeg.data.tiktoken_cl100k import EOD_ID, load_tokenizer
    from diffmeg.generation import SamplingConfig, check_length, decode, generate
    from diffmeg.model_source import load_checkpoint_model, read_checkpoint_info
    from diffmeg.runtime import single_process

    sampling = SamplingConfig(
        greedy=args.greedy,
        temperature=1.0 if args.temperature is None else args.temperature,
        top_p=1.0 if args.top_p is None else args.top_p,
        seed=args.seed,
    )
    info = read_checkpoint_info(args.load, args.iteration)  # fails fast on a wrong --load
    ckpt_args = argparse.Namespace(**info.args)
    eod = EOD_ID
    if getattr(ckpt_args, "tokenizer_type", None) == "HuggingFaceTokenizer" or args.tokenizer_model:
        from diffmeg.data.tokenizers import text_tokenizer  # an imported / upcycled model's own tokenizer

        tokenizer = text_tokenizer(ckpt_args, tokenizer_model=args.tokenizer_model)
        eod, prompt_ids = tokenizer.eod, tokenizer.encode_documents([args.prompt])[0]  # its own bos
    else:
        tokenizer = load_tokenizer(args.tokenizer_file or getattr(ckpt_args, "tokenizer_file", None))
        prompt_ids = tokenizer.tokenize(args.prompt)
    check_length(ckpt_args, len(prompt_ids), args.max_new_tokens)
    single_process()
    model = load_checkpoint_model(info)
    result = generate(
        model, prompt_ids, args.max_new_tokens, sampling, eod_id=eod, use_cache=not args.no_cache
    )
    text = decode(tokenizer, result.output_ids, eod)
    if args.json:
        record = {
            "prompt": args.prompt,
            "prompt_ids": result.prompt_ids,
            "output_ids": result.output_ids,
            "output_text": text,
            "stop_reason": result.stop_reason,
        }
        print(json.dumps(record, ensure_ascii=False))
    else:
        print(args.prompt + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
