"""Checkpoints and Hugging Face folders shared by the conversion, convert-tool and generate tests.

Each is built once per pytest session (several test modules use the same ones) by running the real
programs as processes (of their preloaded interpreters, tests/preloaded_python.py: the imports done once):
pretrain_diff.py for trained diff-tiny checkpoints, tools/convert_checkpoint.py for conversions, and
`hf_helper.py` for everything transformers does.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import torch

from tests.conftest import REPO_ROOT
from tests.tools.helpers import run_tool, tool_env

HF_HELPER = Path(__file__).with_name("hf_helper.py")
TRAIN_ITERS = 2  # enough for lambda and the head-norm weight to leave their init
LAYOUT_FLAGS = {
    "tp1": ([], 1),
    "tp2": (["--tensor-model-parallel-size", "2"], 2),
    "pp2": (["--pipeline-model-parallel-size", "2"], 2),
}
# diff-tiny's shape (runner.TINY: vocab 512, seq 64) as a DiffLlama config: 8 = 2 x 4 DIFF heads.
TINY_HF = {
    "vocab_size": 512,
    "hidden_size": 256,
    "intermediate_size": 640,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "head_dim": 32,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
}
# GQA (4 DIFF heads over 2 DIFF KV heads, r = 2), the full cl100k vocabulary (so a tokenizer is
# exported), a non-default RoPE base, the output layer tied to the embedding (no lm_head stored).
GQA_HF = {
    "vocab_size": 100288,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 16,
    "max_position_embeddings": 128,
    "rope_parameters": {"rope_type": "default", "rope_theta": 50000.0},
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
}


def cached(factory, name: str, build: Callable[[Path], None]) -> Path:
    """`base_temp/conversion-cache/name`, built by `build(path)` the first time any test asks for it."""
    root = factory.getbasetemp() / "conversion-cache"
    root.mkdir(exist_ok=True)
    path, done = root / name, root / f"{name}.done"
    if not done.exists():
        shutil.rmtree(path, ignore_errors=True)
        build(path)
        done.touch()
    return path


def trained_tiny(factory, layout: str = "tp1") -> Path:
    """diff-tiny (vocab 512, seq 64) trained TRAIN_ITERS steps in `layout`, same seed: same model."""
    from tests.distributed.runner import run_training

    def build(path: Path) -> None:
        flags, nproc = LAYOUT_FLAGS[layout]
        extra = ["--train-iters", str(TRAIN_ITERS), "--save", str(path), *flags]
        run_training(path.parent, path.name, extra, nproc=nproc)

    return cached(factory, f"trained-{layout}", build)


def tool_main(tool: str):
    """`main` of tools/<tool>.py imported into this process (for refusals and quick in-process runs)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"diffmeg_tool_{tool}", REPO_ROOT / "tools" / f"{tool}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def refused(capsys, tool: str, *argv) -> str:
    """The one-line error (exit status 2) of tools/<tool>.py run in-process with `argv`."""
    import pytest

    with pytest.raises(SystemExit) as exit_info:
        tool_main(tool)([str(a) for a in argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    return err


def convert(*args) -> subprocess.CompletedProcess:
    """tools/convert_checkpoint.py as a user runs it (never raises)."""
    return run_tool("convert_checkpoint", *args)


def convert_ok(*args) -> subprocess.CompletedProcess:
    proc = convert(*args)
    assert proc.returncode == 0, f"convert_checkpoint {args[0]} failed:\n{proc.stdout}\n{proc.stderr[-3000:]}"
    return proc


def exported_tiny(factory) -> Path:
    """The trained TP=1 diff-tiny checkpoint exported with mcore-to-hf (fp32, small shards)."""
    ckpt = trained_tiny(factory, "tp1")
    return cached(
        factory,
        "exported-tiny",
        lambda path: convert_ok("mcore-to-hf", "--load", ckpt, "--save", path, "--max-shard-size", "2MB"),
    )


HF_MODULES = (
    "transformers.models.auto.modeling_auto",
    "transformers.models.auto.tokenization_auto",
    "transformers.models.llama.modeling_llama",
    "transformers.models.diffllama.modeling_diffllama",
    "transformers.generation.utils",
)
"""What hf_helper.py imports as it runs (preloaded with it)."""


def hf_helper(*args, verbosity: str = "error") -> subprocess.CompletedProcess:
    """tests/conversion/hf_helper.py in a fresh process (transformers without diffmeg's CPU patches), with
    transformers' log `verbosity` ("warning": what a user sees) and no terminal to prompt on: a process of
    its preloaded interpreter (transformers' imports done once per session, tests/preloaded_python.py)."""
    from tests.preloaded_python import interpreter

    env = tool_env(HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY=verbosity)
    proc = subprocess.run(
        [interpreter(HF_HELPER, env, also=HF_MODULES), str(HF_HELPER), *map(str, args)],
        cwd=REPO_ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"hf_helper {args[0]} failed:\n{proc.stderr[-3000:]}"
    return proc


def roundtrip_prompts(vocab_size: int) -> list[torch.Tensor]:
    """Prompts of 1, 11 and 40 tokens (ids tiktoken can produce when the vocabulary is cl100k's)."""
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, min(vocab_size, 100256), (n,), generator=gen) for n in (1, 11, 40)]


def random_hf(factory, name: str, config: dict, seed: int = 0) -> tuple[Path, dict]:
    """A randomly initialised DiffLlama folder (lambda vectors N(0, 0.3), norms in [0.5, 1.5]) and
    transformers' outputs for `roundtrip_prompts` after reloading it with from_pretrained."""

    def build(path: Path) -> None:
        prompts = path.parent / f"{path.name}-prompts.pt"
        torch.save(roundtrip_prompts(config["vocab_size"]), prompts)
        results = path.parent / f"{path.name}-hf.pt"
        hf_helper(
            "random",
            "--out",
            path,
            "--config",
            json.dumps(config),
            "--seed",
            seed,
            "--prompts",
            prompts,
            "--results",
            results,
        )

    path = cached(factory, name, build)
    return path, torch.load(path.parent / f"{path.name}-hf.pt")


def hf_outputs(
    tmp: Path, model_dir: Path, prompts: list[torch.Tensor], generate: int = 0, dtype: str = "float32"
) -> dict:
    """Logits (fp32, or `dtype`) and greedy continuations of `from_pretrained(model_dir)`."""
    tmp.mkdir(parents=True, exist_ok=True)
    prompt_file, out_file = tmp / "prompts.pt", tmp / "hf_out.pt"
    torch.save(prompts, prompt_file)
    hf_helper(
        "run", "--model", model_dir, "--prompts", prompt_file, "--out", out_file, "--generate", generate,
        "--dtype", dtype,
    )  # fmt: skip
    return torch.load(out_file)


@torch.no_grad()
def our_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """fp32 logits [s, V] of our megatron-core model for one prompt [s]."""
    positions = torch.arange(ids.numel()).unsqueeze(0)
    return model(input_ids=ids.unsqueeze(0), position_ids=positions, attention_mask=None)[0].float()


def max_relative_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """Largest difference relative to the largest logit (per-element ratios blow up near zero)."""
    return float((ours - theirs).abs().max() / theirs.abs().max())


def read_safetensors_folder(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face folder (single file or index)."""
    from safetensors.torch import load_file

    index = directory / "model.safetensors.index.json"
    files = (
        set(json.loads(index.read_text())["weight_map"].values()) if index.exists() else {"model.safetensors"}
    )
    tensors: dict[str, torch.Tensor] = {}
    for name in sorted(files):
        tensors.update(load_file(str(directory / name)))
    return tensors


def no_leftovers(path: Path) -> bool:
    """Neither the output nor a temporary sibling of it exists (a refused conversion wrote nothing)."""
    siblings = [p for p in path.parent.iterdir() if p.name.startswith(f".{path.name}.tmp-")]
    return not path.exists() and not siblings and not os.path.lexists(path)


# A prompt whose cl100k ids are all < 512, so the vocab-512 mock-data model can take it as text.
GENERATE_PROMPT = "in the is a on a"
GENERATE_PROMPT_IDS = [258, 279, 374, 264, 389, 264]
GENERATE_TOKENS = 12


def tiny_prompts() -> list[torch.Tensor]:
    """The generation prompt, then random prompts of 1, 17 and 64 tokens (the trained length)."""
    gen = torch.Generator().manual_seed(0)
    random = [torch.randint(0, 512, (n,), generator=gen) for n in (1, 17, 64)]
    return [torch.tensor(GENERATE_PROMPT_IDS), *random]


def tiny_hf_reference(factory) -> dict:
    """transformers' logits for `tiny_prompts()` and greedy continuations, from the exported diff-tiny."""
    exported = exported_tiny(factory)
    cache = cached(
        factory,
        "exported-tiny-hf-outputs",
        lambda path: hf_outputs(path, exported, tiny_prompts(), GENERATE_TOKENS),
    )
    return torch.load(cache / "hf_out.pt")


IMPORTS = {  # name: (random DiffLlama config, hf-to-mcore flags)
    "mha": (
        TINY_HF,
        ("--seq-length", "64"),
    ),  # diff-tiny's shape: pretrain_diff.py's TINY runs continue from it
    "gqa": (GQA_HF, ("--tensor-model-parallel-size", "2")),
}


def imported(factory, name: str) -> tuple[Path, Path]:
    """(random DiffLlama folder, its hf-to-mcore checkpoint) for IMPORTS[name]."""
    config, flags = IMPORTS[name]
    source, _ = random_hf(factory, f"random-{name}", config)
    ckpt = cached(
        factory,
        f"imported-{name}",
        lambda path: convert_ok("hf-to-mcore", "--load", source, "--save", path, *flags),
    )
    return source, ckpt


def exported_eval(factory, arch: str) -> tuple[Path, Path]:
    """(checkpoint, its mcore-to-hf export) of tests/eval's tiny `arch` ("diff": DiffLlama,
    "transformer": Llama), trained once per session and shared with the evaluation and analysis tests."""
    from tests.eval.helpers import tiny_checkpoints

    ckpt = tiny_checkpoints(factory.getbasetemp())[arch]
    folder = cached(
        factory,
        f"exported-eval-{arch}",
        lambda path: convert_ok("mcore-to-hf", "--load", ckpt, "--save", path),
    )
    return ckpt, folder


# A random Llama: GQA (r = 2), the full cl100k vocabulary (a tokenizer is exported), non-default RoPE base
# and epsilon, untied.
LLAMA_GQA_HF = {
    "model_type": "llama",
    "vocab_size": 100288,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 128,
    "rope_parameters": {"rope_type": "default", "rope_theta": 50000.0},
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}


def hf_folder_variant(source: Path, dst: Path, drop: tuple[str, ...] = (), **config_changes) -> Path:
    """A copy of an HF folder with config.json fields changed and files removed (bad-input tests)."""
    shutil.copytree(source, dst)
    for name in drop:
        (dst / name).unlink()
    if config_changes:
        config = json.loads((dst / "config.json").read_text())
        config.update(config_changes)
        (dst / "config.json").write_text(json.dumps(config))
    return dst
