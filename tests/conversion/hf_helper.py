"""The Hugging Face side of the conversion tests, run as its own process (as users run transformers).

It must not share a process with diffmeg's CPU compat patches: with those patches and an initialised
torch.distributed, `from_pretrained` leaves DiffLlama's RoPE `inv_freq` buffer uninitialised (see
docs/conversion.md), which would make every comparison meaningless.

    python hf_helper.py random --out DIR --config JSON --seed S [--prompts IN.pt --results OUT.pt]
    python hf_helper.py run --model DIR --prompts IN.pt --out OUT.pt [--generate N] [--dtype float64]
    python hf_helper.py load --model DIR --text TEXT --out OUT.json

`random` saves a random DiffLlama (or Llama: "model_type": "llama" in the config) as safetensors
(and, with --prompts, runs it reloaded like `run`);
`run` writes {"logits": [logits per prompt, fp32 unless --dtype], "generated": [greedy ids per prompt] (if
asked; with the KV cache), "generated_nocache": [the same without the cache], "transformers": version,
"class": model class name, "tied": lm_head is the input embedding's tensor};
`load` reads the folder as a user's script does: AutoConfig and AutoTokenizer without `trust_remote_code`,
then AutoModelForCausalLM with it, and writes {"config": config class, "ids": the tokenizer's ids of TEXT,
"class": model class}; whatever transformers prints on the way goes to this process's stdout and stderr.
"""

from __future__ import annotations

import argparse
import json

import torch


def make_random(out: str, config: dict, seed: int) -> None:
    """A DiffLlama (or, with "model_type": "llama" in `config`, a Llama) with every tensor away from its
    init: lambda vectors N(0, 0.3), norms around 1."""
    import transformers

    config = dict(config)
    name = {"diffllama": "DiffLlama", "llama": "Llama"}[config.pop("model_type", "diffllama")]
    config_class = getattr(transformers, f"{name}Config")
    model_class = getattr(transformers, f"{name}ForCausalLM")
    torch.manual_seed(seed)
    model = model_class(config_class(**config)).float()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lambda" in name:
                param.normal_(0.0, 0.3)  # lambda = exp(lq1.lk1) - exp(lq2.lk2) + init, far from init
            elif "norm" in name:
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0.0, 0.05)
    model.save_pretrained(out, safe_serialization=True)


def run(model_dir: str, prompts: list[torch.Tensor], generate: int, dtype: str = "float32") -> dict:
    import transformers
    from transformers import AutoModelForCausalLM

    # trust_remote_code: DIFF V2 folders carry their modeling file (auto_map); others ignore it
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, dtype), trust_remote_code=True
    ).eval()
    tied = model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    result: dict = {
        "class": type(model).__name__,
        "logits": [],
        "generated": [],
        "generated_nocache": [],
        "tied": tied,
        "transformers": transformers.__version__,
    }
    with torch.no_grad():
        for ids in prompts:
            logits = model(ids.unsqueeze(0)).logits[0]  # [s, V]
            result["logits"].append(logits if dtype == "float64" else logits.float())
            if generate:
                for use_cache, key in ((True, "generated"), (False, "generated_nocache")):
                    out = model.generate(
                        ids.unsqueeze(0),
                        attention_mask=torch.ones_like(ids).unsqueeze(0),
                        max_new_tokens=generate,
                        do_sample=False,
                        pad_token_id=0,
                        use_cache=use_cache,
                    )
                    result[key].append(out[0, ids.numel() :].tolist())
    return result


def load(model_dir: str, text: str) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, trust_remote_code=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return {"config": type(config).__name__, "ids": ids, "class": type(model).__name__}


def main() -> None:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("random")
    r.add_argument("--out", required=True)
    r.add_argument("--config", required=True)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--prompts", default=None)
    r.add_argument("--results", default=None)
    g = sub.add_parser("run")
    g.add_argument("--model", required=True)
    g.add_argument("--prompts", required=True)
    g.add_argument("--out", required=True)
    g.add_argument("--generate", type=int, default=0)
    g.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    q = sub.add_parser("load")
    q.add_argument("--model", required=True)
    q.add_argument("--text", required=True)
    q.add_argument("--out", required=True)
    args = p.parse_args()
    if args.cmd == "load":
        with open(args.out, "w") as f:
            json.dump(load(args.model, args.text), f)
    elif args.cmd == "random":
        make_random(args.out, json.loads(args.config), args.seed)
        if args.prompts:
            torch.save(run(args.out, torch.load(args.prompts), 0), args.results)
    else:
        torch.save(run(args.model, torch.load(args.prompts), args.generate, args.dtype), args.out)


if __name__ == "__main__":
    main()
