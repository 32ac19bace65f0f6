"""`pretrain_diff.py --dry-run` checks what would doom the real run: a memory plan over the GPU's memory,
missing datasets, and flags the resolved run ignores (issue 16, item 8)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from diffmeg.data.indexed import IndexedWriter
from diffmeg.errors import DiffmegError
from diffmeg.training.arguments import resolve_args
from diffmeg.training.dry_run import dry_run
from tests.distributed.runner import run_pretrain


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    for var in ("WORLD_SIZE", "SLURM_NTASKS", "RANK", "SLURM_PROCID"):
        monkeypatch.delenv(var, raising=False)


def _dry(argv: list[str], capsys, world_size: int = 1) -> tuple[dict, list[str]]:
    """(the JSON on stdout, the lines on stderr) of a dry run resolved in this process."""
    assert dry_run(resolve_args([*argv, "--dry-run"], world_size=world_size)) == 0
    out, err = capsys.readouterr()
    return json.loads(out), err.splitlines()


def _dataset(prefix, tokens: int, dtype=np.int32) -> str:
    with IndexedWriter(str(prefix), dtype=dtype) as writer:
        writer.add_document(np.arange(tokens, dtype=dtype))
        writer.commit()
    return str(prefix)


def test_a_plan_over_the_gpu_memory_is_a_warning_with_what_shrinks_it(capsys):
    # The case: the 3B recipe in fp32 without the distributed optimizer, 128 GPUs.
    summary, err = _dry(["--model", "diff-3b"], capsys, world_size=128)
    assert summary["memory_per_gpu_gib"]["total"] == pytest.approx(90.4, abs=0.1)
    (warning,) = [line for line in err if line.startswith("warning:")]
    assert "the memory plan needs 90.4 GiB per GPU, which exceeds --gpu-memory-gib 80 (128 GPUs)" in warning
    fixes = ("--bf16", "--use-distributed-optimizer", "--recompute-granularity full", "PRECISION=bf16")
    for fix in (*fixes, "--cross-entropy-chunk-size 2048", "CE_CHUNK_SIZE=2048"):
        assert fix in warning
    assert summary["checks"]["memory_fits"] is False and summary["checks"]["warnings"] == [warning[9:]]

    # The recipe's own layout fits with room to spare; a larger GPU takes the fp32 plan.
    fits = ["--model", "diff-3b", "--bf16", "--use-distributed-optimizer"]
    summary, err = _dry(fits, capsys, world_size=128)
    assert summary["checks"]["memory_fits"] is True and not [x for x in err if x.startswith("warning:")]
    summary, err = _dry(["--model", "diff-3b", "--gpu-memory-gib", "141"], capsys, world_size=128)
    assert summary["checks"]["gpu_memory_gib"] == 141 and summary["checks"]["memory_fits"] is True


def test_a_plan_within_ten_percent_of_the_gpu_memory_is_a_warning(capsys):
    total = _dry(["--model", "diff-tiny"], capsys)[0]["memory_per_gpu_gib"]["total"]
    summary, err = _dry(["--model", "diff-tiny", "--gpu-memory-gib", str(total / 0.95)], capsys)
    (warning,) = [line for line in err if line.startswith("warning:")]
    assert "leaves less than 10% of --gpu-memory-gib" in warning
    assert "set WORLD_SIZE to the run's GPU count" in warning  # a dry run outside a launcher sees 1 GPU
    with pytest.raises(DiffmegError, match="--gpu-memory-gib must be > 0"):
        _dry(["--model", "diff-tiny", "--gpu-memory-gib", "0"], capsys)


def test_every_missing_dataset_is_named_in_one_line(tmp_path, capsys):
    present = _dataset(tmp_path / "web_text_document", 100)
    _dataset(tmp_path / "code_text_document", 10)
    blend = ["0.5", present, "0.3", str(tmp_path / "code_text_document.bin"), "0.2", str(tmp_path / "gone")]
    with pytest.raises(DiffmegError) as info:
        _dry(["--model", "diff-tiny", "--data-path", *blend], capsys)
    message = str(info.value)
    assert "\n" not in message and message.startswith("--data-path: 2 of 3 dataset(s) not found: ")
    assert (
        f"{tmp_path}/code_text_document.bin (no .bin or .idx, give the prefix without the extension)"
        in message
    )
    assert f"{tmp_path}/gone (no .bin or .idx)" in message and present not in message
    (tmp_path / "code_text_document.idx").unlink()
    with pytest.raises(DiffmegError, match=r"code_text_document \(no \.idx\)"):
        _dry(
            ["--model", "diff-tiny", "--data-path", "1", present, "1", str(tmp_path / "code_text_document")],
            capsys,
        )


def test_datasets_found_are_counted_from_their_files(tmp_path, capsys):
    wide = _dataset(tmp_path / "wide", 1000)
    narrow = _dataset(tmp_path / "narrow", 300, dtype=np.uint16)  # 2 bytes a token
    blend = ["--data-path", "0.9", wide, "0.1", narrow, "--split", "1,0,0"]  # one document each
    summary, err = _dry(["--model", "diff-tiny", *blend], capsys)
    assert summary["checks"]["dataset_tokens"] == {wide: 1000, narrow: 300}
    assert summary["checks"]["split_documents"] == {wide: [1, None, None], narrow: [1, None, None]}
    assert "data: 2 dataset(s) found, 1,300 tokens" in err
    summary, _ = _dry(["--model", "diff-tiny"], capsys)  # the builtin corpus is built on first use
    assert summary["checks"]["dataset_tokens"] == {}


def _documents(prefix, count: int) -> str:
    with IndexedWriter(str(prefix)) as writer:
        for _ in range(count):
            writer.add_document(np.arange(20, dtype=np.int32))
        writer.commit()
    return str(prefix)


def test_a_split_or_blend_the_run_refuses_is_refused_by_the_dry_run_in_the_same_line(
    tmp_path, capsys, single_rank_parallel_state
):
    """The dry run calls the run's own `check_blend`: 200 documents under the default 969,30,1 leave the
    test split none (round(0.999 * 200) = 200), which the run refuses and the dry run used to pass as
    '2 dataset(s) found'; and a loss-masked dataset in a blend."""
    from diffmeg.data.loss_mask import MaskedWriter
    from diffmeg.run_config import RunConfig
    from diffmeg.training.data import build_datasets

    a, b = _documents(tmp_path / "a", 200), _documents(tmp_path / "b", 200)
    with MaskedWriter(str(tmp_path / "qa"), dtype=np.int32) as writer:
        writer.add_documents(np.arange(8), np.ones(8), np.array([8]))
        writer.commit()
    base = ["--model", "diff-tiny", "--tokenizer-type", "null", "--vocab-size", "1024"]
    cases = [
        (["--data-path", "0.5", a, "0.5", b], "--split 969,30,1 gives the test split of"),
        (
            ["--data-path", "1", a, "1", str(tmp_path / "qa"), "--split", "1,0,0"],
            "--data-path mixes datasets",
        ),
    ]
    for flags, start in cases:
        with pytest.raises(DiffmegError) as dry:
            _dry([*base, *flags], capsys)
        with pytest.raises(DiffmegError) as run:
            build_datasets(RunConfig.from_args(resolve_args([*base, *flags], world_size=1)))
        assert str(dry.value) == str(run.value) and str(dry.value).startswith(start), str(dry.value)
    summary, _ = _dry([*base, "--data-path", "0.5", a, "0.5", b, "--split", "98,1,1"], capsys)
    assert summary["checks"]["split_documents"] == {a: [196, 2, 2], b: [196, 2, 2]}


def test_the_dry_run_resolves_the_index_cache_as_the_run_does(tmp_path, capsys, monkeypatch):
    """The folder is in the JSON; an unwritable --data-cache-path is the run's one-line refusal."""
    from diffmeg.data.index_cache import resolve_cache_path

    monkeypatch.setenv("DIFFMEG_CACHE_DIR", str(tmp_path / "home"))
    (tmp_path / "data").mkdir()
    prefix = _documents(tmp_path / "data" / "a", 10)
    flags = ["--model", "diff-tiny", "--data-path", prefix, "--split", "1,0,0"]
    summary, _ = _dry(flags, capsys)
    assert summary["checks"]["data_cache_path"] == str(tmp_path / "data" / "cache")
    (tmp_path / "afile").write_text("")
    with pytest.raises(DiffmegError) as dry:
        _dry([*flags, "--data-cache-path", str(tmp_path / "afile" / "c")], capsys)
    with pytest.raises(DiffmegError) as run:
        resolve_cache_path([prefix], str(tmp_path / "afile" / "c"))
    assert str(dry.value) == str(run.value) and str(dry.value).startswith("--data-cache-path ")
    assert (
        _dry(["--model", "diff-tiny"], capsys)[0]["checks"]["data_cache_path"] is None
    )  # builtin: once built


def test_a_truncated_dataset_fails_the_dry_run_and_the_run_in_one_line(tmp_path, capsys):
    """The .idx knows the .bin's size: a copy cut short is named by --dry-run and when the run opens its
    data (parse_data_path), not in a traceback mid-training."""
    from diffmeg.data.gpt_datasets import parse_data_path

    prefix = _dataset(tmp_path / "cut", 1000)
    with open(prefix + ".bin", "r+b") as f:
        f.truncate(1000)
    expected = (
        f"--data-path {prefix}: {prefix}.bin is 1000 bytes but its index cut.idx expects 4000 (1 sequences "
        "of 1 documents): truncated (an interrupted copy?); copy it again or write the dataset again with "
        "tools/preprocess_data.py"
    )
    with pytest.raises(DiffmegError) as info:
        _dry(["--model", "diff-tiny", "--data-path", prefix], capsys)
    assert str(info.value) == expected
    with pytest.raises(DiffmegError) as info:
        parse_data_path([prefix])
    assert str(info.value) == expected


def test_ids_above_the_vocabulary_fail_the_dry_run_and_the_run_in_one_line(
    tmp_path, capsys, single_rank_parallel_state
):
    """Data of a larger vocabulary (cl100k_base ids under `--tokenizer-type null --vocab-size 1024`) is named
    with its largest id when pretrain_diff.py checks it and when the run builds its datasets, not in an index
    error inside the embedding at the first step."""
    import pretrain_diff
    from diffmeg.run_config import RunConfig
    from diffmeg.training.data import build_datasets

    prefix = _dataset(tmp_path / "wide", 2000)  # ids 0..1999
    argv = ["--model", "diff-tiny", "--tokenizer-type", "null", "--vocab-size", "1024", "--data-path", prefix]
    argv += ["--split", "1,0,0"]
    expected = (
        f"dataset {prefix} holds token ids up to 1999, but this run's vocabulary has 1024 (ids 0..1023)"
    )
    with pytest.raises(SystemExit) as exit_info:
        pretrain_diff.main([*argv, "--dry-run"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith(f"error: {expected}") and err.count("\n") == 1, err
    with pytest.raises(DiffmegError) as info:
        build_datasets(RunConfig.from_args(resolve_args(argv, world_size=1)))
    assert str(info.value).startswith(expected)


@pytest.mark.parametrize(
    "argv,note",
    [
        (
            ["--sequence-parallel"],
            "--sequence-parallel is dropped: it splits activations over tensor-parallel",
        ),
        (["--cp-comm-type", "p2p"], "--cp-comm-type p2p has no effect: --context-parallel-size is 1"),
        (["--train-iters", "5", "--train-tokens", "999999"], "--train-tokens is ignored: --train-iters 5"),
        (["--fp8-recipe", "tensorwise"], "--fp8-recipe has no effect without --fp8-format"),
        (["--save-interval", "5"], "--save-interval has no effect without --save"),
        (["--async-save"], "--async-save has no effect without --save"),
        (["--mock-data", "--data-path", "x"], "--data-path is ignored: --mock-data"),
        (
            ["--no-diff-attention", "--lambda-init", "0.5"],
            "--lambda-init has no effect: the Transformer baseline",
        ),
        (["--overlap-grad-reduce"], "--overlap-grad-reduce has no effect: no data-parallel gradient"),
        (["--ddp-bucket-size", "1000"], "--ddp-bucket-size has no effect without --overlap-grad-reduce"),
        (
            ["--num-layers-per-virtual-pipeline-stage", "4"],
            "--num-layers-per-virtual-pipeline-stage 4 has no effect: it equals the 4 layers",
        ),
    ],
)
def test_ignored_flags_are_explained_in_the_dry_run_and_on_a_real_run(argv, note, capsys, monkeypatch):
    summary, err = _dry(["--model", "diff-tiny", *argv], capsys)
    assert [line for line in err if line.startswith("note:")] == [
        f"note: {n}" for n in summary["checks"]["notes"]
    ]
    assert any(n.startswith(note) for n in summary["checks"]["notes"]), summary["checks"]["notes"]
    # A real run resolves its arguments the same way: rank 0 prints the note, other ranks do not.
    args = resolve_args(["--model", "diff-tiny", *argv])
    assert any(line.startswith(f"note: {note}") for line in capsys.readouterr().err.splitlines())
    assert args.dropped_flags == summary["checks"]["notes"]
    monkeypatch.setenv("RANK", "1")
    resolve_args(["--model", "diff-tiny", *argv])
    assert "note:" not in capsys.readouterr().err


def test_flags_that_take_effect_get_no_note(capsys):
    summary, err = _dry(
        ["--model", "diff-tiny", "--sequence-parallel", "--tensor-model-parallel-size", "2"], capsys, 2
    )
    assert summary["parallel"]["sequence_parallel"] is True
    assert summary["checks"]["notes"] == [] and not [x for x in err if x.startswith("note:")]
    summary, err = _dry(["--model", "diff-tiny", "--save", "ckpt", "--async-save"], capsys)
    assert summary["checkpointing"]["async_save"] is True and summary["checks"]["notes"] == []
    assert summary["features"]["async_save"].startswith("on: a writer process per rank")
    unsaved = _dry(["--model", "diff-tiny", "--async-save"], capsys)[0]
    assert unsaved["features"]["async_save"] == "off: nothing is saved (--save)"


def test_pretrain_diff_dry_run_prints_json_then_its_warnings(tmp_path):
    argv = ["--model", "diff-3b", "--sequence-parallel", "--dry-run"]
    proc = run_pretrain(argv, tmp_path, WORLD_SIZE="1")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["checks"]["memory_fits"] is False
    ours = [line for line in proc.stderr.splitlines() if line.startswith(("note:", "warning:"))]
    assert [line.split(":")[0] for line in ours] == ["note", "warning"], proc.stderr


def test_features_say_what_the_run_uses_and_what_each_buys(capsys):
    """Overlapped communication and the interleaved schedule: on with what they buy, or off with why."""
    overlap = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]
    on = _dry(["--model", "diff-tiny", *overlap, "--ddp-bucket-size", "1000000"], capsys, world_size=2)[0]
    params = on["memory_per_gpu_gib"]["parameters_per_gpu"]  # diff-tiny at vocabulary 100288: 27.2M
    f = on["features"]
    assert f["overlap_grad_reduce"] == (
        f"on: the {params * 4 / 2**30:.1f} GiB fp32 gradient reduce-scatter runs under backward in "
        f"~{-(-params // 1_000_000)} buckets of 1,000,000 parameters, not after it"
    )
    assert f["overlap_param_gather"].startswith(f"on: the {params * 4 / 2**30:.1f} GiB all-gather of updated")
    assert f["interleaved_pipeline"] == "off: no pipeline (PP 1)"
    assert on["checks"]["notes"] == []

    off = _dry(["--model", "diff-tiny", "--use-distributed-optimizer"], capsys, world_size=2)[0]["features"]
    assert off["overlap_grad_reduce"].endswith("after backward (--overlap-grad-reduce)")
    assert off["overlap_param_gather"].endswith("after the optimizer step (--overlap-param-gather)")
    alone = _dry(["--model", "diff-tiny", *overlap], capsys)[0]["features"]  # one rank: nothing to overlap
    assert (
        alone["overlap_grad_reduce"]
        == alone["overlap_param_gather"]
        == "off: DP x CP = 1, nothing to communicate"
    )

    pp = ["--model", "diff-tiny", "--pipeline-model-parallel-size", "2", "--global-batch-size", "8"]
    pp += ["--seq-length", "2048"]  # activations of GiB, not the 3-decimal rounding of the plan's figures
    plain = _dry(pp, capsys, world_size=2)[0]  # 4 micro-batches of 2: bubble 1/4
    assert plain["features"]["interleaved_pipeline"].startswith(
        "off: pipeline bubble (PP - 1) / micro-batches = 0.250"
    )
    vp = _dry([*pp, "--num-layers-per-virtual-pipeline-stage", "1"], capsys, world_size=2)[0]
    assert vp["parallel"]["virtual_pipeline_model_parallel_size"] == 2
    assert vp["features"]["interleaved_pipeline"] == (
        "on: 2 model chunks per rank: pipeline bubble 0.125 of a step instead of 0.250, for 2x the "
        "pipeline's point-to-point traffic"
    )
    # The first stage keeps 2.5 of its 4 micro-batches' activations instead of 2 (1 + (PP - 1) / (PP x VP)).
    act = vp["memory_per_gpu_gib"]["activations"] / plain["memory_per_gpu_gib"]["activations"]
    assert act == pytest.approx(1.25, rel=0.01)


def test_tied_output_layer_in_the_count_and_the_memory_plan(capsys):
    """--tie-embeddings-and-output-weights: the model counts one V x H matrix less; the plan holds it once
    with one pipeline stage, but under PP2 the last stage still keeps its copy of the embedding."""
    base = ["--model", "diff2-3b", "--bf16"]
    v_h = 100288 * 3072
    untied, _ = _dry(base, capsys, world_size=8)
    tied, _ = _dry([*base, "--tie-embeddings-and-output-weights"], capsys, world_size=8)
    assert tied["model"]["tie_embeddings_and_output_weights"] is True
    assert untied["model"]["tie_embeddings_and_output_weights"] is False
    assert untied["num_parameters"] == 4_053_543_936 and tied["num_parameters"] == 4_053_543_936 - v_h
    per_gpu = tied["memory_per_gpu_gib"]["parameters_per_gpu"]
    assert per_gpu == untied["memory_per_gpu_gib"]["parameters_per_gpu"] - v_h
    pp2 = ["--pipeline-model-parallel-size", "2"]
    untied, _ = _dry([*base, *pp2], capsys, world_size=8)
    tied, _ = _dry([*base, *pp2, "--tie-embeddings-and-output-weights"], capsys, world_size=8)
    assert tied["memory_per_gpu_gib"] == untied["memory_per_gpu_gib"]


def test_a_warmup_as_long_as_the_run_is_a_warning(capsys):
    """The run stays in warmup (a smoke test of a big recipe may mean it), so a warning, not an error."""
    _, err = _dry(["--model", "diff-tiny", "--train-iters", "5", "--lr-warmup-iters", "5"], capsys)
    warned = [line for line in err if line.startswith("warning: ")]
    assert warned == [
        "warning: --lr-warmup-iters 5 is not shorter than the run's 5 iterations: the learning rate never "
        "reaches --lr 0.001; shorten the warmup (or lengthen the run)"
    ]
    _, err = _dry(["--model", "diff-tiny", "--train-iters", "6", "--lr-warmup-iters", "5"], capsys)
    assert not [line for line in err if line.startswith("warning: ")]


@pytest.mark.parametrize(
    ("flags", "warned"),
    [
        (["--split", "100,0,0", "--eval-interval", "2"], True),
        (["--split", "100,0,0", "--eval-iters", "3"], True),
        (["--split", "100,0,0"], False),  # no evaluation asked for
        (["--split", "100,0,0", "--eval-interval", "2", "--eval-iters", "0"], False),
        (["--split", "90,10,0", "--eval-interval", "2"], False),
    ],
)
def test_evaluation_asked_for_without_a_validation_split_is_a_warning(capsys, flags, warned):
    _, err = _dry(["--model", "diff-tiny", "--train-iters", "40", *flags], capsys)
    lines = [line for line in err if line.startswith("warning: ")]
    assert lines == (
        [
            "warning: --split 100,0,0 gives validation no data: validation will not run, whatever "
            "--eval-interval says; give the valid split a weight (e.g. --split 969,30,1) to evaluate"
        ]
        if warned
        else []
    )
