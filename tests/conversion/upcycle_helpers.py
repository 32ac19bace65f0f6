"""Tiny Llama-family folders with a tokenizer of their own, built in the test (no downloads), and their
upcycled checkpoints: shared by the upcycling, tokenizer and Slurm recipe tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from diffmeg.conversion.hf_config import hf_config_dict
from diffmeg.conversion.layout import LlamaLayout
from tests.conversion.helpers import cached, convert_ok

TOKENIZER_TEXT = [
    "the quick brown fox jumps over the lazy dog. ",
    "Upcycling turns a Llama into DIFF V2 with the same logits; training then separates the query pairs.",
    "def main():\n    return 0\n",
]
TOKENIZER_IDS = 300
"""Ids of the tiny tokenizer (specials included); the tiny models' vocabulary is 320 (a multiple of 64)."""


def tiny_llama_layout(heads: int = 4, kv_heads: int = 2) -> LlamaLayout:
    """2 layers, hidden 64, head dim 16, FFN 128, vocabulary 320, 64 positions, RoPE base 5000, eps 1e-6."""
    return LlamaLayout(
        num_layers=2,
        hidden_size=64,
        ffn_hidden_size=128,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=16,
        vocab_size=320,
        max_position_embeddings=64,
        rotary_base=5000.0,
        norm_eps=1e-6,
    )


def save_tiny_tokenizer(directory: Path) -> None:
    """A byte-level BPE tokenizer of 300 ids with Llama's conventions: `<s>` (1) starts every encoded text,
    `</s>` (2) is the end of sequence. Trained on fixed text: the same tokenizer every time."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_IDS,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TOKENIZER_TEXT * 10, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(str(directory))


def write_llama_folder(
    directory: Path,
    layout: LlamaLayout,
    *,
    tied: bool = False,
    seed: int = 0,
    model_type: str = "llama",
    **config,
) -> dict[str, torch.Tensor]:
    """A Hugging Face Llama folder (config.json, model.safetensors in fp32, the tiny tokenizer) with random
    weights away from their init (norms in [0.5, 1.5]); `tied`: no lm_head stored. Returns the tensors."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True)
    values = hf_config_dict(layout, dtype="float32", bos_token_id=1, eos_token_id=2)
    values.update(model_type=model_type, tie_word_embeddings=tied, **config)
    if model_type != "llama":
        values["architectures"] = [f"{model_type.capitalize()}ForCausalLM"]
    (directory / "config.json").write_text(json.dumps(values, indent=2))
    gen = torch.Generator().manual_seed(seed)
    shapes = dict(layout.hf_global_shapes())
    for i in range(layout.num_layers):
        shapes.update({f"model.layers.{i}.{k}": s for k, s in layout.hf_layer_shapes().items()})
    if tied:
        del shapes["lm_head.weight"]
    tensors = {}
    for name, shape in shapes.items():
        if "norm" in name:
            tensors[name] = torch.empty(shape).uniform_(0.5, 1.5, generator=gen)
        else:
            tensors[name] = torch.randn(shape, generator=gen) * 0.08
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    save_tiny_tokenizer(directory)
    return tensors


def llama_folder(
    factory, name: str = "llama-gqa", *, tied: bool = False, heads: int = 4, kv_heads: int = 2
) -> Path:
    """A tiny random Llama folder, built once per session."""
    return cached(
        factory, name, lambda path: write_llama_folder(path, tiny_llama_layout(heads, kv_heads), tied=tied)
    )


def upcycled(factory, source: Path, name: str, *flags) -> Path:
    """`convert_checkpoint.py upcycle` of `source`, once per session."""
    return cached(factory, name, lambda path: convert_ok("upcycle", "--load", source, "--save", path, *flags))
