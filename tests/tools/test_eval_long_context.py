"""tools/eval_long_context.py end to end: two tiny checkpoints (DIFF and Transformer) -> CSV, PNG and
summary.json; and its one-line errors."""

from __future__ import annotations

import csv
import importlib.util
import json
import math

import numpy as np
import pytest

from diffmeg.errors import DiffmegError
from diffmeg.eval.common import CheckpointSet
from diffmeg.eval.long_context import LongContextConfig, run_long_context_eval
from tests.data.helpers import REPO_ROOT
from tests.eval.helpers import (
    CKPT_SEQ_LENGTH,
    checkpoint_args,
    fake_checkpoint,
    periodic_documents,
    write_indexed_dataset,
)
from tests.tools.helpers import run_tool

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def load_tool():
    """tools/eval_long_context.py as a module (tools/ is not a package)."""
    spec = importlib.util.spec_from_file_location(
        "eval_long_context", REPO_ROOT / "tools" / "eval_long_context.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Seven documents; four reach 65 tokens (the default: seq_length 64 + 1)."""
    lengths = [30, 65, 100, 200, 10, 80, 64]
    return write_indexed_dataset(tmp_path_factory.mktemp("corpus") / "docs", periodic_documents(lengths))


def test_two_checkpoints_give_csv_plot_and_summary(tiny_ckpts, corpus, tmp_path):
    out = tmp_path / "out"
    proc = run_tool(
        "eval_long_context",
        "--load", tiny_ckpts["diff"], "--load", tiny_ckpts["transformer"], "--data-prefix", corpus,
        "--output-dir", out, "--csv-every", "8", "--batch-size", "2", "--loss-chunk-size", "16",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    labels = ["DIFF (diff)", "Transformer (transformer)"]

    with open(out / "long_context_nll.csv") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["position", *labels]
    positions = [int(r[0]) for r in rows[1:]]
    assert positions == [0, 8, 16, 24, 32, 40, 48, 56, CKPT_SEQ_LENGTH - 1]
    values = np.array([[float(v) for v in r[1:]] for r in rows[1:]])
    assert values.shape == (9, 2) and np.isfinite(values).all() and (values > 0).all()
    # Two training steps from random init: the NLL is still near ln(512) for both models.
    assert np.all(np.abs(values - math.log(512)) < 1.0)
    assert not np.allclose(values[:, 0], values[:, 1])  # two different models

    png = (out / "long_context_nll.png").read_bytes()
    assert png[:8] == PNG_MAGIC and len(png) > 10_000

    summary = json.loads((out / "summary.json").read_text())
    assert summary["length"] == CKPT_SEQ_LENGTH and summary["min_doc_length"] == CKPT_SEQ_LENGTH + 1
    assert summary["documents"] == [1, 2, 3, 5]
    for entry, label, arch in zip(summary["checkpoints"], labels, ["DIFF", "Transformer"], strict=True):
        assert entry["label"] == label and entry["architecture"] == arch
        assert entry["docs_used"] == 4 and entry["tokens_evaluated"] == 4 * CKPT_SEQ_LENGTH
        assert entry["iteration"] == 2 and not entry["extrapolated"]
        assert entry["final_cumulative_nll"] == pytest.approx(values[-1, labels.index(label)], abs=1e-6)
        assert entry["args"]["diff_attention"] == (arch == "DIFF")
    assert f"cumulative NLL at position {CKPT_SEQ_LENGTH - 1}" in proc.stdout


def test_too_short_documents_are_one_line_error(tiny_ckpts, tmp_path, capsys):
    """The CLI's error path, in-process (a second subprocess would only re-measure import time)."""
    prefix = write_indexed_dataset(tmp_path / "short", periodic_documents([10, 40, 20]))
    with pytest.raises(SystemExit) as exit_info:
        load_tool().main(
            ["--load", str(tiny_ckpts["diff"]), "--data-prefix", prefix, "--output-dir", str(tmp_path)]
        )
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: no document has at least 65 tokens: 3 document(s), the longest has 40; "
        "lower --max-length or --min-doc-length, or use longer documents"
    )


def test_extrapolation_and_short_documents_are_evaluated_with_a_warning(tiny_ckpts, corpus, tmp_path):
    """Beyond the training length (warned); documents shorter than the window count where they reach."""
    messages: list[str] = []
    summary = run_long_context_eval(
        LongContextConfig(
            CheckpointSet([str(tiny_ckpts["diff"])], labels=["d"]),
            data_prefix=corpus,
            max_length=128,
            min_doc_length=80,
            csv_every=1000,
            output_dir=str(tmp_path),
            plot=False,
        ),
        log=messages.append,
    )
    assert any("exceeds d's training length 64" in m for m in messages)
    (entry,) = summary["checkpoints"]
    assert summary["documents"] == [2, 3, 5] and entry["extrapolated"]
    assert entry["tokens_evaluated"] == 99 + 128 + 79
    lines = (tmp_path / "long_context_nll.csv").read_text().splitlines()
    assert [line.split(",")[0] for line in lines] == ["position", "0", "127"]
    assert not (tmp_path / "long_context_nll.png").exists()


def _cfg(tiny_ckpts, corpus, tmp_path, loads=None, labels=None, **kw) -> LongContextConfig:
    base = dict(data_prefix=corpus, output_dir=str(tmp_path / "o"), plot=False)
    checkpoints = CheckpointSet(loads or [str(tiny_ckpts["diff"])], labels)
    return LongContextConfig(checkpoints, **{**base, **kw})


def test_checkpoints_with_another_vocabulary_are_refused(tiny_ckpts, corpus, tmp_path):
    other = fake_checkpoint(
        tmp_path / "big_vocab", {**checkpoint_args(tiny_ckpts["diff"]), "vocab_size": 1024}
    )
    cfg = _cfg(tiny_ckpts, corpus, tmp_path, loads=[str(tiny_ckpts["diff"]), str(other)])
    with pytest.raises(DiffmegError, match=r"different tokenizers/vocabularies: .* \(mock, vocab 512\) vs"):
        run_long_context_eval(cfg)


@pytest.mark.parametrize(
    "change,message",
    [
        (
            {"data_prefix": "/nonexistent/docs"},
            r"--data-prefix /nonexistent/docs: missing /nonexistent/docs.bin",
        ),
        ({"labels": ["a", "b"]}, r"2 --label value\(s\) for 1 --load"),
        ({"loads": ["/nonexistent/ckpt"]}, r"--load /nonexistent/ckpt is not a directory"),
        ({"max_length": 0}, r"--max-length must be >= 1"),
        ({"data_prefix": None, "text_files": ["*.txt"]}, r"--text-files are tokenized with cl100k_base, but"),
        ({"data_prefix": None}, r"exactly one of --data-prefix or --text-files"),
    ],
    ids=["missing-data", "labels", "no-checkpoint", "max-length", "text-with-mock-vocab", "no-data"],
)
def test_bad_inputs_are_diffmeg_errors(tiny_ckpts, corpus, tmp_path, change, message):
    with pytest.raises(DiffmegError, match=message):
        run_long_context_eval(_cfg(tiny_ckpts, corpus, tmp_path, **change))


def test_token_ids_outside_the_vocabulary_are_refused_before_loading(tiny_ckpts, tmp_path, monkeypatch):
    import diffmeg.checkpoints as checkpoints

    docs = periodic_documents([70, 70])
    docs[1][60] = 512  # inside the 65 tokens evaluated
    prefix = write_indexed_dataset(tmp_path / "ids", docs)
    monkeypatch.setattr(checkpoints, "load_model_weights", lambda *a, **k: pytest.fail("loaded a model"))
    with pytest.raises(
        DiffmegError, match=r"document 1 of .* holds token id 512, outside .* vocabulary of 512"
    ):
        run_long_context_eval(_cfg(tiny_ckpts, prefix, tmp_path))


def test_bad_output_dir_is_refused_before_any_work(tiny_ckpts, corpus, tmp_path):
    (tmp_path / "a_file").write_text("")
    with pytest.raises(DiffmegError, match="--output-dir .*a_file exists and is not a directory"):
        run_long_context_eval(_cfg(tiny_ckpts, corpus, tmp_path, output_dir=str(tmp_path / "a_file")))
    blocked = tmp_path / "a_file" / "sub"
    with pytest.raises(DiffmegError, match="--output-dir .*sub is not writable"):
        run_long_context_eval(_cfg(tiny_ckpts, corpus, tmp_path, output_dir=str(blocked)))


def test_text_files_with_a_cl100k_checkpoint_must_match_files(tiny_ckpts, corpus, tmp_path, tokenizer_file):
    args = {
        **checkpoint_args(tiny_ckpts["diff"]),
        "vocab_size": 100288,
        "mock_data": False,
        "tokenizer_type": "cl100k_base",
    }
    cl100k = fake_checkpoint(tmp_path / "cl100k", args)
    cfg = _cfg(
        tiny_ckpts, corpus, tmp_path, loads=[str(cl100k)], data_prefix=None,
        text_files=[str(tmp_path / "*.txt")], tokenizer_file=tokenizer_file,
    )  # fmt: skip
    with pytest.raises(DiffmegError, match=r"--text-files '.*\*\.txt' matches no file"):
        run_long_context_eval(cfg)
    (tmp_path / "a.txt").write_text("only a few words")
    with pytest.raises(
        DiffmegError, match=r"no document has at least 65 tokens: 1 document\(s\), the longest has 4"
    ):
        run_long_context_eval(cfg)
