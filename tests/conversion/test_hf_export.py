"""`pretrain_diff.py --export-hf-at-end DIR` (diffmeg.conversion.hf_export): the run's final checkpoint
also lands as a Hugging Face folder, the same files as `mcore-to-hf` writes from it, loading in
transformers; a failed or skipped export is one warning that leaves the checkpoint as it was; a target that
cannot work is refused before training starts."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from diffmeg.conversion.hf_export import export_at_end
from tests.conversion.helpers import convert_ok, hf_helper, read_safetensors_folder, trained_tiny
from tests.distributed.runner import TINY, run_pretrain, run_training


def digest(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def test_a_stopped_run_exports_its_last_checkpoint_as_mcore_to_hf_would(tmp_path):
    save, export = tmp_path / "run" / "checkpoints", tmp_path / "run" / "hf"
    extra = [
        "--train-iters",
        "4",
        "--exit-interval",
        "2",
        "--save",
        str(save),
        "--export-hf-at-end",
        str(export),
    ]
    proc = run_training(tmp_path, "run", extra)
    assert "exporting iteration 2 to" in proc.stderr, proc.stderr[-2000:]
    assert "warning" not in proc.stderr.lower(), proc.stderr[-2000:]

    by_hand = tmp_path / "by_hand"
    convert_ok("mcore-to-hf", "--load", save, "--iteration", "2", "--save", by_hand)
    assert json.loads((export / "config.json").read_text()) == json.loads(
        (by_hand / "config.json").read_text()
    )
    ours, theirs = read_safetensors_folder(export), read_safetensors_folder(by_hand)
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)

    prompts, out = tmp_path / "prompts.pt", tmp_path / "out.pt"
    torch.save([torch.tensor([1, 7, 42, 3])], prompts)
    hf_helper("run", "--model", export, "--prompts", prompts, "--out", out)
    result = torch.load(out)
    assert result["class"] == "DiffLlamaForCausalLM"
    assert result["logits"][0].shape == (4, 512) and torch.isfinite(result["logits"][0]).all()


def test_a_failed_export_is_one_warning_and_leaves_the_checkpoint_as_it_was(tmp_path_factory, tmp_path):
    ckpt = trained_tiny(tmp_path_factory)
    before = digest(ckpt)
    in_the_way = tmp_path / "hf"
    in_the_way.write_text("a file where the export should go")
    lines: list[str] = []
    assert not export_at_end(str(ckpt), str(in_the_way), 2, interrupted=False, log=lines.append)
    (warning,) = [line for line in lines if line.startswith("warning:")]
    assert "is not a directory" in warning and "checkpoint iteration 2" in warning
    assert f"mcore-to-hf --load {ckpt} --iteration 2 --save {in_the_way} --overwrite" in warning
    assert digest(ckpt) == before and in_the_way.read_text().startswith("a file")


@pytest.mark.parametrize(
    "interrupted, iteration, why", [(True, 2, "interrupted"), (False, 5, "not the final")]
)
def test_an_interrupted_run_or_one_without_its_final_checkpoint_is_not_exported(
    tmp_path_factory, tmp_path, interrupted, iteration, why
):
    ckpt = trained_tiny(tmp_path_factory)
    lines: list[str] = []
    assert not export_at_end(str(ckpt), str(tmp_path / "hf"), iteration, interrupted, log=lines.append)
    assert (
        len(lines) == 1
        and why in lines[0]
        and "export by hand: python tools/convert_checkpoint.py" in lines[0]
    )
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--export-hf-at-end", "{tmp}/hf"], "it needs --save"),
        (["--save", "{tmp}/ckpt", "--export-hf-at-end", "{tmp}/ckpt/hf"], "overlaps --save"),
        (["--save", "{tmp}/ckpt", "--export-hf-at-end", "{ckpt}"], "holds a run's checkpoints"),
    ],
)
def test_a_target_that_cannot_work_is_refused_before_training(tmp_path_factory, tmp_path, flags, says):
    ckpt = trained_tiny(tmp_path_factory)
    argv = [*TINY, "--train-iters", "2", *(f.format(tmp=tmp_path, ckpt=ckpt) for f in flags), "--dry-run"]
    proc = run_pretrain(argv, tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error: --export-hf-at-end") and says in proc.stderr, proc.stderr
    assert proc.stderr.count("\n") == 1
