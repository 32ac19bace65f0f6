"""tools/convert_checkpoint.py end to end: exports transformers loads as DiffLlamaForCausalLM with our
logits, imports that round-trip exactly and continue training, and bad input refused before writing.

transformers always runs in its own process (tests/conversion/hf_helper.py); our model runs here.
"""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO_ROOT
from tests.conversion.helpers import (
    IMPORTS,
    convert,
    convert_ok,
    exported_tiny,
    imported,
    max_relative_error,
    no_leftovers,
    our_logits,
    random_hf,
    read_safetensors_folder,
    roundtrip_prompts,
    tiny_hf_reference,
    tiny_prompts,
    tool_main,
    trained_tiny,
)
from tests.conversion.helpers import refused as refused_by
from tests.data.helpers import find_bpe_file
from tests.tools.helpers import tool_cmd, tool_env


@pytest.mark.hf_export
def test_export_loads_as_diffllama_with_our_logits(tmp_path_factory, single_rank_parallel_state):
    from tests.builders import load_model

    exported = exported_tiny(tmp_path_factory)
    config = json.loads((exported / "config.json").read_text())
    assert config["architectures"] == ["DiffLlamaForCausalLM"] and config["model_type"] == "diffllama"
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (8, 8, 32)
    index = json.loads((exported / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # --max-shard-size 2MB: several shards
    assert (exported / "generation_config.json").exists()
    assert not (exported / "tokenizer.json").exists()  # a vocab-512 mock-data model has no cl100k tokenizer

    reference = tiny_hf_reference(tmp_path_factory)
    assert reference["class"] == "DiffLlamaForCausalLM"
    version = reference["transformers"]  # transformers' generate, with its KV cache as without it
    assert reference["generated"] == reference["generated_nocache"], f"transformers {version}: KV cache"
    model, _ = load_model(str(trained_tiny(tmp_path_factory, "tp1")))
    for ids, theirs in zip(tiny_prompts(), reference["logits"], strict=True):
        assert max_relative_error(our_logits(model, ids), theirs) < 1e-4, ids.numel()


@pytest.mark.parametrize("name", list(IMPORTS))
def test_random_diffllama_round_trips_exactly(tmp_path_factory, single_rank_parallel_state, name):
    from tests.builders import load_model

    config, _ = IMPORTS[name]
    source, ckpt = imported(tmp_path_factory, name)
    args = json.loads((ckpt / "iter_0000000" / "args.json").read_text())
    assert args["num_attention_heads"] == config["num_attention_heads"] // 2  # DIFF heads
    assert args["num_query_groups"] == config["num_key_value_heads"] // 2
    tied = config.get("tie_word_embeddings", False)  # "gqa": tied, kept tied both ways
    assert args["tie_embeddings_and_output_weights"] == tied
    tokenizer_file = find_bpe_file()
    out = tmp_path_factory.mktemp(f"roundtrip-{name}") / "hf"
    extra = ["--tokenizer-file", tokenizer_file] if tokenizer_file else ["--no-tokenizer"]
    convert_ok("mcore-to-hf", "--load", ckpt, "--save", out, *extra)

    original, back = read_safetensors_folder(source), read_safetensors_folder(out)
    assert back.keys() == original.keys() and ("lm_head.weight" in back) != tied
    for key in original:
        assert back[key].dtype == original[key].dtype and torch.equal(back[key], original[key]), key
    old, new = json.loads((source / "config.json").read_text()), json.loads((out / "config.json").read_text())
    for field in ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim"):
        assert new[field] == old[field], field
    assert new["tie_word_embeddings"] == old.get("tie_word_embeddings", False) == tied
    assert new["rope_parameters"]["rope_theta"] == old["rope_parameters"]["rope_theta"]

    # Our model, loaded from the imported checkpoint, computes transformers' logits.
    _, reference = random_hf(tmp_path_factory, f"random-{name}", config)
    assert reference["class"] == "DiffLlamaForCausalLM" and reference["tied"] == tied
    model, _ = load_model(str(ckpt))
    assert (model.output_layer.weight is None) == tied
    for ids, theirs in zip(roundtrip_prompts(config["vocab_size"]), reference["logits"], strict=True):
        assert max_relative_error(our_logits(model, ids), theirs) < 1e-4, ids.numel()

    if config["vocab_size"] >= 100277 and tokenizer_file:
        from transformers import AutoTokenizer

        from diffmeg.data.tiktoken_cl100k import load_tokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(out))
        text = "Grüße, 世界! 🙂 x = 1_000_000\n\n  done<|endoftext|>"
        assert tokenizer.encode(text) == load_tokenizer(tokenizer_file).encoding.encode(
            text, allowed_special="all"
        )
        assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 100257


@pytest.mark.slow
def test_imported_checkpoint_continues_training(tmp_path_factory):
    """pretrain_diff.py --load <hf-to-mcore output> starts from the imported weights (with or without
    --finetune: the import is marked weights-only, so no optimizer state is asked for)."""
    from tests.distributed.runner import read_losses, run_training

    _, ckpt = imported(tmp_path_factory, "mha")
    tmp = tmp_path_factory.mktemp("continue")
    proc = run_training(tmp, "cont", ["--load", str(ckpt), "--finetune", "--train-iters", "1"])
    assert f"loaded checkpoint from {ckpt}" in proc.stdout
    loss = read_losses(tmp, "cont")[1]
    plain = run_training(tmp, "plain", ["--load", str(ckpt), "--train-iters", "1"])
    assert f"loaded checkpoint from {ckpt} at iteration 0" in plain.stdout
    assert read_losses(tmp, "plain")[1] == loss
    # Random DiffLlama weights (std 0.05, norms up to 1.5) give a loss above a fresh init's log(512).
    assert math.isfinite(loss) and abs(loss - math.log(512)) > 0.05


@pytest.mark.slow
def test_imported_checkpoint_loads_at_other_layouts(tmp_path_factory):
    """The streamed import is layout-free like a training checkpoint: TP=2 and PP=2 jobs loading it start
    from the loss the TP=1 job starts from (up to the layouts' reduction order)."""
    from tests.distributed.runner import read_losses, run_training

    _, ckpt = imported(tmp_path_factory, "mha")
    tmp = tmp_path_factory.mktemp("layouts")
    losses = {}
    for name, flags in (
        ("tp1", []),
        ("tp2", ["--tensor-model-parallel-size", "2"]),
        ("pp2", ["--pipeline-model-parallel-size", "2"]),
    ):
        nproc = 2 if flags else 1
        proc = run_training(tmp, name, ["--load", str(ckpt), "--train-iters", "1", *flags], nproc=nproc)
        assert f"loaded checkpoint from {ckpt}" in proc.stdout
        losses[name] = read_losses(tmp, name)[1]
    assert losses["tp2"] == pytest.approx(losses["tp1"], rel=1e-5), losses
    assert losses["pp2"] == pytest.approx(losses["tp1"], rel=1e-5), losses


# ---------------------------------------------------------------------------------- bad input


def refused(capsys, *argv) -> str:
    return refused_by(capsys, "convert_checkpoint", *argv)


def edited_checkpoint(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    args_file = next(dst.glob("iter_*")) / "args.json"
    args = json.loads(args_file.read_text())
    args.update(changes)
    args_file.write_text(json.dumps(args))
    return dst


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"lambda_init": "0.5"}, "cannot express a constant lambda_init"),
        ({"norm_epsilon": 1e-6}, "one epsilon for every RMSNorm"),
        ({"diff_attention": False}, "describes the Transformer baseline"),
        ({"ffn_hidden_size": 512}, "shape mismatch for 'decoder.layers.mlp.linear_fc1.weight'"),
        ({"num_query_groups": 2}, "shape mismatch for 'decoder.layers.self_attention.linear_qkv.weight'"),
        (  # V1-style GDA with SwiGLU: Motif's format holds grouped V1 models with PolyNorm only
            {"num_noise_heads": 2},
            "V1-style grouped differential attention (--num-noise-heads 2 for 4 heads) has no Hugging Face "
            "export with a SwiGLU MLP",
        ),
    ],
)
def test_mcore_to_hf_refuses_what_diffllama_cannot_express(
    tmp_path_factory, tmp_path, capsys, single_rank_parallel_state, changes, message
):
    ckpt = edited_checkpoint(trained_tiny(tmp_path_factory, "tp1"), tmp_path / "ckpt", **changes)
    assert message in refused(capsys, "mcore-to-hf", "--load", ckpt, "--save", tmp_path / "hf")
    assert no_leftovers(tmp_path / "hf")


def test_not_a_checkpoint_is_refused(tmp_path, capsys, single_rank_parallel_state):
    (tmp_path / "empty").mkdir()
    assert "is not a checkpoint directory (no latest_checkpointed_iteration.txt" in refused(
        capsys, "mcore-to-hf", "--load", tmp_path / "empty", "--save", tmp_path / "hf"
    )
    assert "is not a directory" in refused(
        capsys, "mcore-to-hf", "--load", tmp_path / "missing", "--save", tmp_path / "hf"
    )
    assert "has no config.json" in refused(
        capsys, "hf-to-mcore", "--load", tmp_path / "empty", "--save", tmp_path / "ckpt"
    )
    (tmp_path / "hf-model").mkdir()
    (tmp_path / "hf-model" / "config.json").write_text("{}")
    assert (
        "is a Hugging Face model folder (config.json), not a pretrain_diff.py checkpoint; convert it with: "
        f"python tools/convert_checkpoint.py hf-to-mcore --load {tmp_path / 'hf-model'} --save"
        in refused(capsys, "mcore-to-hf", "--load", tmp_path / "hf-model", "--save", tmp_path / "hf")
    )
    assert no_leftovers(tmp_path / "hf") and no_leftovers(tmp_path / "ckpt")


def test_hf_to_mcore_refuses_bad_folders(tmp_path_factory, tmp_path, capsys, single_rank_parallel_state):
    source, _ = imported(tmp_path_factory, "mha")

    def edited(name: str, **changes) -> Path:
        folder = tmp_path / name
        shutil.copytree(source, folder)
        config = json.loads((folder / "config.json").read_text())
        config.update(changes)
        (folder / "config.json").write_text(json.dumps(config))
        return folder

    cases = [
        (edited("llama", model_type="llama"), "tensor(s) a Llama model does not have"),
        (edited("ffn", intermediate_size=512), "shape mismatch for 'model.layers.0.mlp.gate_proj.weight'"),
        (edited("eps", rms_norm_eps=1e-6), "head-norm epsilon"),
        (
            edited("rope", rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}),
            "scaled RoPE",
        ),
    ]
    for folder, message in cases:
        assert message in refused(capsys, "hf-to-mcore", "--load", folder, "--save", tmp_path / "ckpt")
    clash = ["--", "--seq-length", "64", "--hidden-size", "128"]  # the model's shape comes from config.json
    assert "--hidden-size come(s) from config.json" in refused(
        capsys, "hf-to-mcore", "--load", source, "--save", tmp_path / "ckpt", *clash
    )
    assert no_leftovers(tmp_path / "ckpt")


def test_existing_output_needs_overwrite(tmp_path_factory, tmp_path, capsys, single_rank_parallel_state):
    ckpt = trained_tiny(tmp_path_factory, "tp1")
    out = tmp_path / "hf"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    proc = convert("mcore-to-hf", "--load", ckpt, "--save", out)  # as users see it: one line, exit 2
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith("error: ")
    assert "already exists; pass --overwrite" in proc.stderr
    assert (out / "keep.txt").read_text() == "mine"
    assert "overlaps --load" in refused(capsys, "mcore-to-hf", "--load", ckpt, "--save", ckpt / "inside")
    (out / "models").mkdir()  # the user's: --overwrite replaces the export's files only
    (out / "models" / "model.safetensors").write_text("another model")
    (out / "model-00001-of-00002.safetensors").write_text("a previous export's shard")
    tool_main("convert_checkpoint")(["mcore-to-hf", "--load", str(ckpt), "--save", str(out), "--overwrite"])
    assert (out / "keep.txt").read_text() == "mine" and (out / "config.json").exists()
    assert (out / "models" / "model.safetensors").read_text() == "another model"
    assert not (out / "model-00001-of-00002.safetensors").exists()
    assert (
        capsys.readouterr().err.splitlines()[-1]
        == f"note: kept keep.txt, models in {out} (not an export's files)"
    )
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]
    # a training run's checkpoint folder is not a conversion's to replace: refused, nothing touched
    run = tmp_path / "run"
    (run / "iter_0000002").mkdir(parents=True)
    (run / "latest_checkpointed_iteration.txt").write_text("2")
    err = refused(capsys, "hf-to-mcore", "--load", out, "--save", run, "--overwrite")
    assert f"--save {run} holds iter_0000002, which a conversion does not write; --overwrite replaces" in err
    assert sorted(p.name for p in run.iterdir()) == ["iter_0000002", "latest_checkpointed_iteration.txt"]


# ---------------------------------------------------------------------------------- dtype, modes, full disks


def bf16_copy(source: Path, dst: Path) -> Path:
    """The folder with its weights in bf16 (as a bf16 model's save_pretrained writes it)."""
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    config = json.loads((source / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    tensors = {k: v.to(torch.bfloat16) for k, v in read_safetensors_folder(source).items()}
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    assert load_file(str(dst / "model.safetensors")).keys() == tensors.keys()
    return dst


def test_import_keeps_the_source_dtype_unless_asked(tmp_path_factory, tmp_path, single_rank_parallel_state):
    """A bf16 folder imports as a bf16 checkpoint (no fp32 copy) and exports back bit for bit; --dtype fp32
    widens it exactly. Both directions print a progress line per layer."""
    from diffmeg.conversion.checkpoint_io import McoreCheckpointReader

    source, _ = imported(tmp_path_factory, "mha")
    bf16 = bf16_copy(source, tmp_path / "bf16")
    proc = convert_ok("hf-to-mcore", "--load", bf16, "--save", tmp_path / "ckpt")
    assert "weights only, bfloat16" in proc.stdout
    layers = [line for line in proc.stderr.splitlines() if line.startswith("hf-to-mcore: layer ")]
    assert len(layers) == 4 and layers[-1].startswith("hf-to-mcore: layer 4/4, ") and "ETA 0:00" in layers[-1]
    reader = McoreCheckpointReader(str(tmp_path / "ckpt"))
    assert reader.dtype == torch.bfloat16
    proc = convert_ok("mcore-to-hf", "--load", tmp_path / "ckpt", "--save", tmp_path / "back")
    assert sum(line.startswith("mcore-to-hf: layer ") for line in proc.stderr.splitlines()) == 4
    original, back = read_safetensors_folder(bf16), read_safetensors_folder(tmp_path / "back")
    assert back.keys() == original.keys()
    for key in original:
        assert back[key].dtype == torch.bfloat16 and torch.equal(back[key], original[key]), key

    convert_ok("hf-to-mcore", "--load", bf16, "--save", tmp_path / "fp32", "--dtype", "fp32")
    wide = McoreCheckpointReader(str(tmp_path / "fp32"))
    assert wide.dtype == torch.float32
    layout = layout_of(wide)
    assert torch.equal(
        wide.read_layer(layout, 2)["mlp.linear_fc2.weight"],
        original["model.layers.2.mlp.down_proj.weight"].float(),
    )


def layout_of(reader):
    from diffmeg.conversion.hf_config import layout_from_args

    return layout_from_args(reader.args)


def modes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): stat.S_IMODE(p.stat().st_mode) for p in [root, *root.rglob("*")]}


def test_outputs_follow_the_umask(tmp_path_factory, tmp_path):
    """Every file both directions write (shards, index, configs, tokenizer, checkpoint files) is created as
    the user's other files are: 0666 and 0777 less the umask (issue 16: shards were 0600)."""
    source, _ = imported(tmp_path_factory, "gqa")  # the cl100k vocabulary: the tokenizer is exported too
    tokenizer_file = find_bpe_file()

    def run(*args) -> None:
        proc = subprocess.run(
            tool_cmd("convert_checkpoint", *args),
            cwd=REPO_ROOT, env=tool_env(), capture_output=True, text=True, timeout=300,
            preexec_fn=lambda: os.umask(0o027),
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]

    run("hf-to-mcore", "--load", source, "--save", tmp_path / "ckpt")
    extra = ["--tokenizer-file", tokenizer_file] if tokenizer_file else ["--no-tokenizer"]
    run("mcore-to-hf", "--load", tmp_path / "ckpt", "--save", tmp_path / "hf", *extra)
    for root in (tmp_path / "ckpt", tmp_path / "hf"):
        found = modes(root)
        expected = {name: 0o750 if (root / name).is_dir() else 0o640 for name in found}
        assert found == expected, root
    names = set(modes(tmp_path / "hf"))
    assert {"config.json", "generation_config.json", "model.safetensors.index.json"} <= names
    assert any(n.endswith(".safetensors") for n in names)
    if tokenizer_file:
        assert {"tokenizer.json", "tokenizer_config.json"} <= names


def error_after_progress(capsys, *argv) -> str:
    """The one-line error (exit status 2) of a conversion that failed after it started (progress lines
    before it on stderr)."""
    with pytest.raises(SystemExit) as exit_info:
        tool_main("convert_checkpoint")([str(a) for a in argv])
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("error: ") and all(" layer " in line for line in lines[:-1]), lines
    return lines[-1]


def test_a_full_disk_mid_write_is_one_line_and_leaves_nothing(
    tmp_path_factory, tmp_path, capsys, monkeypatch
):
    """ENOSPC inside either writer (DCP's for checkpoints, ours for shards): one line naming the directory
    and its free space, the partial output removed, an existing output untouched."""
    import torch.distributed.checkpoint.filesystem as dcp_filesystem

    from diffmeg.conversion import safetensors_io

    source, ckpt = imported(tmp_path_factory, "mha")
    full = OSError(errno.ENOSPC, "No space left on device")

    def no_space(*args, **kwargs):
        raise full

    with monkeypatch.context() as patch:
        patch.setattr(dcp_filesystem, "_write_item", no_space)
        err = refused(capsys, "hf-to-mcore", "--load", source, "--save", tmp_path / "ckpt")
    assert err.startswith(
        f"error: disk full writing {tmp_path / 'ckpt'}: partial output removed, {tmp_path} has "
    )
    assert no_leftovers(tmp_path / "ckpt")

    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "keep.txt").write_text("mine")
    with monkeypatch.context() as patch:
        patch.setattr(safetensors_io._Shard, "write", no_space)
        err = error_after_progress(
            capsys, "mcore-to-hf", "--load", ckpt, "--save", tmp_path / "hf", "--overwrite", "--no-tokenizer"
        )
    assert "disk full writing" in err and "free space there or choose another --save" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"] and (tmp_path / "hf" / "keep.txt").exists()


def test_a_real_full_disk(tmp_path_factory, tmp_path, capsys):
    """On a small tmpfs (needs root and mount): too small up front is refused before writing; room for the
    weights but not for the files' headers fails mid-write, reported as a full disk, nothing left."""
    source, _ = imported(tmp_path_factory, "mha")
    mount = tmp_path / "small"
    mount.mkdir()
    weights = 4 * sum(
        t.numel() for t in read_safetensors_folder(source).values()
    )  # fp32, DIFF head norms aside
    # Room for the weights but not for the files around them (torch.save headers, metadata, args.json).
    size = weights + 64 * 1024
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], capture_output=True
    ).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        (mount / "filler").write_bytes(b"\0" * (size - weights // 2))  # leave half the weights' size
        err = refused(capsys, "hf-to-mcore", "--load", source, "--save", mount / "ckpt")
        assert err.startswith(f"error: {mount} has ") and "free but the conversion writes about" in err
        (mount / "filler").unlink()
        err = error_after_progress(capsys, "hf-to-mcore", "--load", source, "--save", mount / "ckpt")
        assert err.startswith(f"error: disk full writing {mount / 'ckpt'}: partial output removed"), err
        assert sorted(p.name for p in mount.iterdir()) == []
    finally:
        subprocess.run(["umount", str(mount)], check=True)


INTERRUPT_AT_FIRST_LAYER = """
import runpy, sys
from diffmeg.conversion.progress import Progress
def stop(self, done):
    raise KeyboardInterrupt  # Ctrl-C while the first layer is written
Progress.layer_done = stop
sys.argv = ["tools/convert_checkpoint.py", *sys.argv[1:]]
runpy.run_path("tools/convert_checkpoint.py", run_name="__main__")
"""


def test_ctrl_c_during_a_conversion_is_one_line_rc_130_and_leaves_nothing(tmp_path_factory, tmp_path):
    from tests.conversion.upcycle_helpers import llama_folder

    source = llama_folder(tmp_path_factory, "llama-gqa-tied", tied=True)
    out = tmp_path / "out" / "diff2"
    argv = ["upcycle", "--load", str(source), "--save", str(out)]
    proc = subprocess.run(
        [sys.executable, "-c", INTERRUPT_AT_FIRST_LAYER, *argv],
        cwd=REPO_ROOT,
        env=tool_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 130, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: interrupted; nothing was written to --save (the partial output is removed); run it again"
    )
    assert not out.exists() and os.listdir(out.parent) == []


def test_an_unwritable_save_is_named_before_any_work(tmp_path_factory, tmp_path, capsys):
    """Every direction checks --save up front (storage.check_output): no permission, a file in the way."""
    from tests.conversion.upcycle_helpers import llama_folder

    source = llama_folder(tmp_path_factory, "llama-gqa-tied", tied=True)
    err = refused(capsys, "upcycle", "--load", source, "--save", "/proc/sys/diff2")
    assert err == "error: --save /proc/sys/diff2: no permission to write in /proc/sys; choose another --save"
    (tmp_path / "file").write_text("x")
    err = refused(capsys, "hf-to-mcore", "--load", source, "--save", tmp_path / "file/c")
    assert err.endswith(f"{tmp_path}/file is a file, so the folder cannot be made under it")
