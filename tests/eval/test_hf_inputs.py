"""Hugging Face DiffLlama / Llama folders as evaluation inputs: their info from config.json alone, one-line
refusals, and the long-context evaluation of an export equal to that of its source checkpoint."""

from __future__ import annotations

import json

import numpy as np
import pytest

from diffmeg.errors import DiffmegError
from diffmeg.eval.common import CheckpointSet, default_labels
from diffmeg.eval.long_context import LongContextConfig, run_long_context_eval
from diffmeg.model_source import CheckpointInfo, read_checkpoint_info
from tests.conversion.helpers import exported_eval, hf_folder_variant
from tests.eval.helpers import periodic_documents, write_indexed_dataset


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """{arch: (checkpoint, Hugging Face export)} of the tiny DIFF and Transformer checkpoints."""
    return {arch: exported_eval(tmp_path_factory, arch) for arch in ("diff", "transformer")}


def test_info_of_a_folder_comes_from_config_json_without_weights(exports, monkeypatch):
    from diffmeg.conversion.checkpoint_io import HFCheckpointReader

    def no_weights(self, names):
        raise AssertionError("read_checkpoint_info read weights")

    monkeypatch.setattr(HFCheckpointReader, "get", no_weights)
    for arch, expected in (("diff", "DIFF"), ("transformer", "Transformer")):
        ckpt, folder = exports[arch]
        info = read_checkpoint_info(str(folder))
        assert (info.hf, info.iteration, info.path, info.architecture) == (True, None, str(folder), expected)
        assert info.seq_length == 256  # max_position_embeddings of the diff-tiny shape (trained at 64)
        assert (info.vocab_size, info.tokenizer) == (512, "mock")
        source = read_checkpoint_info(str(ckpt))
        for key in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels"):
            assert info.args[key] == source.args[key], key
    assert default_labels([read_checkpoint_info(str(f)) for _, f in exports.values()]) == [
        "DIFF (exported-eval-diff)",
        "Transformer (exported-eval-transformer)",
    ]


def test_cl100k_vocabulary_folder_reads_as_cl100k(tmp_path_factory):
    from tests.conversion.helpers import LLAMA_GQA_HF, random_hf

    folder, _ = random_hf(tmp_path_factory, "random-llama-gqa", LLAMA_GQA_HF)
    info = read_checkpoint_info(str(folder))
    assert (info.architecture, info.tokenizer, info.vocab_size, info.seq_length) == (
        "Transformer",
        "cl100k_base",
        100288,
        128,
    )


def test_duplicate_labels_of_a_folder_name_it_hf():
    infos = [
        CheckpointInfo("a/x", 2, "a/x/iter_0000002", {}),
        CheckpointInfo("b/x", None, "b/x", {}, hf=True),
    ]
    assert default_labels(infos) == ["DIFF (x @ 2)", "DIFF (x @ hf)"]


def test_bad_folders_are_one_line_errors(exports, tmp_path):
    _, folder = exports["transformer"]
    with pytest.raises(DiffmegError, match="--iteration 3 does not apply to .* a Hugging Face folder"):
        read_checkpoint_info(str(folder), 3)
    mistral = hf_folder_variant(folder, tmp_path / "mistral", model_type="mistral")
    bin_only = hf_folder_variant(
        folder, tmp_path / "bin", drop=("model.safetensors.index.json", "model-00001-of-00001.safetensors")
    )
    (bin_only / "pytorch_model.bin").write_bytes(b"")
    for bad, message in ((mistral, "model_type 'mistral'"), (bin_only, "holds PyTorch .bin weights")):
        with pytest.raises(DiffmegError, match=message) as info:
            read_checkpoint_info(str(bad))
        assert "\n" not in str(info.value)


def test_long_context_of_exports_equals_their_checkpoints(exports, tmp_path):
    """Mixed inputs in one run: Llama export == Transformer checkpoint exactly; DiffLlama export ==
    DIFF checkpoint to fp32 rounding (its head-norm weight is folded into o_proj)."""
    prefix = write_indexed_dataset(tmp_path / "docs", periodic_documents([70, 80, 65]))
    loads = [str(p) for arch in ("diff", "transformer") for p in exports[arch]]
    summary = run_long_context_eval(
        LongContextConfig(
            CheckpointSet(loads),
            data_prefix=prefix,
            max_length=64,
            num_docs=3,
            output_dir=str(tmp_path / "out"),
            plot=False,
        ),
        log=lambda message: None,
    )
    by_load = {c["load"]: c for c in summary["checkpoints"]}
    assert [by_load[p]["iteration"] for p in loads] == [2, None, 2, None]
    (diff, diff_hf), (base, base_hf) = (
        (by_load[str(p)] for p in exports[a]) for a in ("diff", "transformer")
    )
    assert base_hf["mean_nll_per_token"] == base["mean_nll_per_token"]
    assert base_hf["final_cumulative_nll"] == base["final_cumulative_nll"]
    np.testing.assert_allclose(diff_hf["mean_nll_per_token"], diff["mean_nll_per_token"], rtol=1e-6)
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["checkpoints"][1]["args"][
        "tokenizer_type"
    ]
