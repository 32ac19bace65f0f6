"""Flag resolution (explicit > preset > default) and one-line errors for impossible layouts."""

from __future__ import annotations

import re

import pytest

from diffmeg.errors import DiffmegError
from diffmeg.training.arguments import RANGES, build_parser, resolve_args


def test_explicit_flags_override_preset(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "16")
    a = resolve_args(
        ["--model", "diff-3b", "--lr", "1e-4", "--tensor-model-parallel-size", "2", "--micro-batch-size", "2"]
    )
    assert a.lr == 1e-4 and a.num_layers == 28 and a.kv_channels == 128
    assert a.data_parallel_size == 8 and a.lr_decay_iters == a.train_iters
    assert a.explicit_flags == ["lr", "micro_batch_size", "tensor_model_parallel_size"]


def test_short_smoke_run_of_a_big_recipe_stays_in_warmup(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    a = resolve_args(["--model", "diff-3b", "--train-iters", "4"])
    assert a.lr_decay_iters == 1001


PP2 = ["--model", "diff-tiny", "--pipeline-model-parallel-size", "2"]  # 4 layers: 2 per stage
TIE_AND_UNTIE = ["--model", "diff-tiny", "--tie-embeddings-and-output-weights"] + [
    "--untie-embeddings-and-output-weights"
]
VP1 = ["--num-layers-per-virtual-pipeline-stage", "1"]
BOTH_SCHEDULES = ["--override-opt-param-scheduler", "--use-checkpoint-opt-param-scheduler"]


@pytest.mark.parametrize(
    "argv,world,match",
    [
        (["--model", "diff-tiny", "--tensor-model-parallel-size", "3"], 3, "heads cannot be split"),
        (  # the sizes that fit: heads, KV groups and the 100288-entry vocabulary (2^6 x 1567) divide by them
            ["--model", "diff-3b", "--tensor-model-parallel-size", "8"],
            8,
            r"^12 attention heads cannot be split over tensor-model-parallel-size 8; the TP sizes this model "
            r"splits over: 1, 2, 4$",
        ),
        (["--model", "diff-tiny", "--pipeline-model-parallel-size", "3"], 3, "pipeline stages"),
        (["--model", "diff-tiny", "--tensor-model-parallel-size", "2"], 3, "not divisible by TP x PP x CP"),
        (
            ["--model", "diff-tiny", "--global-batch-size", "6", "--micro-batch-size", "4"],
            1,
            "global batch 6",
        ),
        (["--model", "diff-tiny", "--bf16", "--fp16"], 1, "one of --bf16 and --fp16"),
        (
            TIE_AND_UNTIE,
            1,
            "^--tie-embeddings-and-output-weights and --untie-embeddings-and-output-weights contradict each "
            r"other; keep one \(untied is the default\)$",
        ),
        (["--model", "diff-tiny", "--fp8-format", "hybrid"], 1, "Transformer Engine"),
        (["--model", "nope"], 1, "unknown model preset"),
        (["--num-layers", "2"], 1, "--hidden-size is required"),
        (["--model", "diff-tiny", "--min-lr", "1"], 1, "larger than --lr"),
        (["--model", "diff-tiny", "--seq-length", "0"], 1, r"^--seq-length must be >= 1, got 0$"),
        (["--model", "diff-tiny", "--seq-length", "-8"], 1, r"^--seq-length must be >= 1, got -8$"),
        (["--model", "diff-tiny", "--micro-batch-size", "0"], 1, r"^--micro-batch-size must be >= 1, got 0$"),
        (["--model", "diff-tiny", "--lr=-1e-3"], 1, r"^--lr must be >= 0, got -0.001$"),
        (["--model", "diff-tiny", "--lr", "nan"], 1, r"^--lr must be >= 0, got nan$"),
        (["--model", "diff-tiny", "--train-iters", "-1"], 1, r"^--train-iters must be >= 1, got -1; a run "),
        (
            ["--model", "diff-tiny", "--train-iters", "0"],
            1,
            r"^--train-iters must be >= 1, got 0; a run of no iterations trains nothing$",
        ),
        (["--model", "diff-tiny", "--train-tokens", "0"], 1, r"^--train-tokens must be >= 1, got 0; a run "),
        (["--model", "diff-tiny", *BOTH_SCHEDULES], 1, r"contradict each other; keep one$"),
        (["--model", "diff-tiny", "--finetune"], 1, "--finetune needs --load"),
        (["--model", "diff-tiny", "--overlap-param-gather"], 2, "add --use-distributed-optimizer"),
        (
            ["--model", "diff-tiny", "--overlap-param-gather", "--use-distributed-optimizer"],
            2,
            "--overlap-param-gather needs --overlap-grad-reduce",
        ),
        (["--model", "diff-tiny", "--ddp-bucket-size", "0"], 2, "--ddp-bucket-size must be >= 1"),
        (
            [*PP2, "--num-layers-per-virtual-pipeline-stage", "3"],
            2,
            "must divide the 2 layers of each of the 2 pipeline stages",
        ),
        (["--model", "diff-tiny", *VP1], 1, "needs --pipeline-model-parallel-size > 1"),
        (
            [*PP2, *VP1, "--global-batch-size", "6", "--micro-batch-size", "2"],
            2,
            r"per step \(3 = global batch 6 / \(micro batch 2 x DP 1\)\) to be a multiple of PP 2",
        ),
    ],
)
def test_impossible_arguments(monkeypatch, argv, world, match):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    with pytest.raises(DiffmegError, match=match):
        resolve_args(argv)


def test_fp8_on_the_local_spec_is_torchaos_and_needs_the_tensorwise_recipe(monkeypatch):
    """Where torchao's FP8 can run (faked: an FP8-capable GPU), the local spec takes --fp8-format with
    --fp8-recipe tensorwise and refuses the delayed recipe in one line naming the fix."""
    pytest.importorskip("torchao.float8")
    from diffmeg.fusions import torchao_fp8

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setattr(torchao_fp8, "fp8_unsupported_reason", lambda emulate: None)
    local = ["--model", "diff-tiny", "--transformer-impl", "local", "--fp8-format", "hybrid"]
    with pytest.raises(
        DiffmegError, match="is torchao's FP8, which scales per tensor: add --fp8-recipe tensorwise$"
    ):
        resolve_args(local)
    assert resolve_args([*local, "--fp8-recipe", "tensorwise"]).fp8_format == "hybrid"


def test_an_explicit_token_budget_beats_the_presets_iteration_count(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    a = resolve_args(["--model", "diff-tiny", "--train-tokens", "102400"])  # the preset says 300 iterations
    assert a.train_iters == 102400 // (4 * 256)
    both = resolve_args(["--model", "diff-tiny", "--train-tokens", "102400", "--train-iters", "7"])
    assert both.train_iters == 7


TINY = ["--model", "diff-tiny"]
BARE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "2", "--seq-length", "32"]
BARE += ["--lr", "1e-3", "--train-iters", "1"]  # no preset: no vocabulary size from anywhere


def test_tokenizer_type_defaults_and_null_corpora(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert resolve_args(["--model", "diff-tiny"]).tokenizer_type == "cl100k_base"
    assert resolve_args(["--model", "diff-tiny", "--mock-data"]).tokenizer_type == "null"
    a = resolve_args(
        ["--model", "diff-tiny", "--tokenizer-type", "null", "--vocab-size", "512", "--data-path", "/d/ids"]
    )
    assert (a.tokenizer_type, a.vocab_size) == ("null", 512)


@pytest.mark.parametrize(
    "argv,match",
    [
        (BARE + ["--tokenizer-type", "null", "--data-path", "/d/ids"], "needs --vocab-size"),
        (TINY + ["--tokenizer-type", "null", "--vocab-size", "512"], "builtin corpus is cl100k_base text"),
        (TINY + ["--mock-data", "--tokenizer-type", "cl100k_base"], "drop --tokenizer-type"),
    ],
)
def test_tokenizer_type_errors(monkeypatch, argv, match):
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(DiffmegError, match=match):
        resolve_args(argv)


def test_virtual_pipeline_size_is_derived_as_megatron_lm_does(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    a = resolve_args([*PP2, *VP1, "--global-batch-size", "8", "--micro-batch-size", "2"])
    assert a.virtual_pipeline_model_parallel_size == 2 and a.data_parallel_size == 2
    # One chunk of the stage's 2 layers is the plain schedule (as in Megatron-LM: no interleaving).
    plain = resolve_args([*PP2, "--num-layers-per-virtual-pipeline-stage", "2"])
    assert plain.virtual_pipeline_model_parallel_size is None
    assert resolve_args(PP2).virtual_pipeline_model_parallel_size is None


def test_a_bad_flag_gets_a_short_usage_line_then_the_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        resolve_args(["--model", "diff-tiny", "--lr"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "usage: pretrain_diff.py [--model PRESET] [FLAGS ...]  (--help lists every flag)",
        "pretrain_diff.py: error: argument --lr: expected one argument",
    ]


@pytest.mark.parametrize("value", ["-1e-3", "-1E-3", "-.5e+2", "-inf", "-1"])
def test_a_negative_number_in_any_notation_is_a_value_and_gets_the_range_line(monkeypatch, value):
    """argparse takes `-1` but reads `-1e-3` as an unknown flag ("expected one argument"): every notation
    reaches the range check, which names the flag."""
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(DiffmegError, match=rf"^--lr must be >= 0, got {float(value)}$"):
        resolve_args(["--model", "diff-tiny", "--lr", value])


def _numeric_flags() -> dict[str, type]:
    return {a.dest: a.type for a in build_parser()._actions if a.type in (int, float) and not a.choices}


def test_every_numeric_flag_has_a_range():
    assert sorted(set(_numeric_flags()) - set(RANGES)) == []
    assert sorted(set(RANGES) - set(_numeric_flags())) == []  # no row for a flag that is gone


@pytest.mark.parametrize("name", sorted(RANGES))
def test_every_numeric_flag_out_of_its_range_is_one_line_naming_it(monkeypatch, name):
    """The value just outside each range, typed as a user would (a separate token, negative or not)."""
    monkeypatch.setenv("WORLD_SIZE", "1")
    rule = RANGES[name].rule
    kind = _numeric_flags()[name]
    bad = {">= 1": "0", ">= 0": "-1" if kind is int else "-1e-3", "> 0": "0", "in [0, 1)": "1"}[rule]
    flag = "--" + name.replace("_", "-")
    with pytest.raises(DiffmegError, match="^" + re.escape(f"{flag} must be {rule}")) as err:
        resolve_args(["--model", "diff-tiny", flag, bad])
    assert f"got {kind(float(bad))}" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("variable", ["WORLD_SIZE", "SLURM_NTASKS"])
def test_a_layout_error_names_the_world_size_variable(monkeypatch, variable):
    """A WORLD_SIZE (or salloc's SLURM_NTASKS) left in the shell sets the data-parallel size unseen: the
    batch error names the variable and that it came from the environment."""
    for key in ("WORLD_SIZE", "RANK", "SLURM_NTASKS", "SLURM_PROCID"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv(variable, "8")
    with pytest.raises(DiffmegError) as err:
        resolve_args(["--model", "diff-tiny", "--global-batch-size", "4", "--micro-batch-size", "1"])
    assert str(err.value) == (
        f"global batch 4 is not divisible by micro batch 1 x data-parallel size 8 ({variable}=8 in the "
        "environment); change the batch sizes or the number of processes"
    )


@pytest.mark.parametrize("weights", ["model.safetensors", "model.safetensors.index.json"])
def test_save_into_a_hugging_face_export_is_refused(tmp_path, weights):
    """A folder the exporter wrote (config.json with safetensors weights, one file or sharded) is no place
    for a run's checkpoints."""
    export = tmp_path / "hf"
    export.mkdir()
    (export / "config.json").write_text("{}")
    (export / weights).write_text("{}")
    with pytest.raises(DiffmegError) as err:
        resolve_args(["--model", "diff-tiny", "--save", str(export)], world_size=1)
    assert str(err.value) == (
        f"--save {export} holds a Hugging Face model export (config.json and safetensors weights): a run's "
        "checkpoints would be mixed into it; pick another --save folder"
    )
    (export / weights).unlink()  # config.json alone is no export
    assert resolve_args(["--model", "diff-tiny", "--save", str(export)], world_size=1).save == str(export)


def test_a_data_path_that_is_a_folder_names_the_datasets_inside(tmp_path):
    """`--data-path FOLDER`: the folder and the prefixes it holds (what to pass), not missing .bin/.idx."""
    import numpy as np

    from diffmeg.data.indexed import IndexedWriter

    folder = tmp_path / "data"
    folder.mkdir()
    with pytest.raises(DiffmegError) as err:
        resolve_args(["--model", "diff-tiny", "--data-path", str(folder)], world_size=1)
    assert str(err.value) == (
        f"--data-path {folder} is a folder, not a dataset, and holds no .bin/.idx dataset: pass the prefix "
        "of a .bin/.idx pair written by tools/preprocess_data.py (its path without the extension)"
    )
    for name in ("web_text_document", "code_text_document"):
        with IndexedWriter(str(folder / name), dtype=np.int32) as writer:
            writer.add_document(np.arange(8, dtype=np.int32))
            writer.commit()
    (folder / "notes.txt").write_text("")
    with pytest.raises(DiffmegError) as err:
        resolve_args(["--model", "diff-tiny", "--data-path", "1", str(folder)], world_size=1)
    assert str(err.value) == (
        f"--data-path {folder} is a folder, not a dataset: it holds 2 dataset(s), code_text_document, "
        f"web_text_document; pass {folder}/code_text_document (the prefix, without .bin/.idx), or several as "
        "'w1 p1 w2 p2 ...'"
    )
