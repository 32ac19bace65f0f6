"""diffmeg.cli: the shared flags, flags to config fields by name (every tool's flag reaches its
config), and the printed table."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import pytest

from diffmeg import cli
from diffmeg.eval.common import CheckpointSet, EvalConfig
from tests.data.helpers import REPO_ROOT


def load_tool(name: str):
    """tools/<name>.py as a module (tools/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@dataclass
class ToyConfig(EvalConfig):
    samples: int = 3
    tokenizer_file: str | None = None


def test_shared_flags_fill_the_shared_fields():
    p = cli.parser("doc", output_dir="toy", tokenizer=True)
    p.add_argument("--samples", type=int, default=3)
    args = cli.parse(p, ["--load", "a", "b", "--label", "A", "B", "--iteration", "5", "--samples", "7"])
    cfg = cli.config(ToyConfig, args)
    assert cfg.checkpoints == CheckpointSet(["a", "b"], ["A", "B"], [5])
    assert (cfg.samples, cfg.seed, cfg.output_dir, cfg.dtype, cfg.plot) == (7, 1234, "toy", "float32", True)
    args = cli.parse(p, ["--load", "a", "--load", "b", "--no-plot", "--dtype", "bfloat16", "--seed", "3"])
    cfg = cli.config(ToyConfig, args, samples=9)
    assert cfg.checkpoints.loads == ["a", "b"] and cfg.checkpoints.iterations is None
    assert (cfg.plot, cfg.dtype, cfg.seed, cfg.samples) == (False, "bfloat16", 3, 9)


def test_a_flag_without_a_field_is_a_programming_error():
    p = cli.parser(None, output_dir="toy")
    p.add_argument("--sample-count", type=int, default=3)  # the field is called `samples`
    with pytest.raises(TypeError, match=r"ToyConfig has no field for the flag\(s\) \['sample_count'\]"):
        cli.config(ToyConfig, cli.parse(p, ["--load", "a"]))


def test_optional_shared_flags_are_left_out():
    p = cli.parser(None, output_dir="toy", iteration=False, plot=False)
    args = cli.parse(p, ["--load", "a"])
    assert not hasattr(args, "iteration") and not hasattr(args, "no_plot")
    assert not hasattr(args, "tokenizer_file")
    with pytest.raises(SystemExit):
        cli.parse(p, ["--load", "a", "--iteration", "2"])


@pytest.mark.parametrize(
    "tool,config,argv,field,value",
    [
        ("attention_scores", "attention_scores:AttentionScoresConfig", ["--samples", "2"], "samples", 2),
        ("activation_stats", "activation_stats:ActivationStatsConfig", ["--tokens", "9"], "tokens", 9),
        ("quantize_eval", "quantize:QuantizeEvalConfig", ["--bits", "16", "8"], "bits", [16, 8]),
        ("eval_needle", "needle_eval:NeedleEvalConfig", ["--needles", "3"], "needles", [3]),
        ("eval_long_context", "long_context:LongContextConfig", ["--data-prefix", "d", "--num-docs", "4"],
         "num_docs", 4),
    ],
)  # fmt: skip
def test_every_tool_flag_reaches_its_config(tool, config, argv, field, value):
    import importlib

    module, name = config.split(":")
    cls = getattr(importlib.import_module(f"diffmeg.eval.{module}"), name)
    args = load_tool(tool).parse_args(["--load", "ckpt", "--output-dir", "out", "--no-plot", *argv])
    cfg = cli.config(cls, args)
    assert getattr(cfg, field) == value
    assert (cfg.checkpoints.loads, cfg.output_dir, cfg.plot) == (["ckpt"], "out", False)


def test_harness_flags_reach_its_config():
    pytest.importorskip("lm_eval")
    from diffmeg.eval.harness import HarnessConfig

    argv = ["--load", "ckpt", "--tasks", "paper", "x.yaml", "--limit", "5", "--num-fewshot", "0"]
    cfg = cli.config(HarnessConfig, load_tool("eval_harness").parse_args(argv))
    assert (cfg.tasks, cfg.limit, cfg.num_fewshot, cfg.output_dir) == (
        ["paper", "x.yaml"],
        5.0,
        0,
        "harness_eval",
    )
    assert cfg.checkpoints.loads == ["ckpt"]


def test_needle_corpus_flags_reach_its_config():
    from diffmeg.eval.needle_corpus import NeedleCorpusConfig

    args = load_tool("make_needle_corpus").parse_args(
        ["--output-prefix", "x", "--documents", "5", "--seed", "2"]
    )
    cfg = cli.config(NeedleCorpusConfig, args)
    assert (cfg.output_prefix, cfg.documents, cfg.seed, cfg.vocab_size) == ("x", 5, 2, 512)


def test_print_table_aligns_text_left_and_numbers_right(capsys):
    cli.print_table(
        [
            {"checkpoint": "DIFF (a)", "bits": 16, "acc": 0.5},
            {"checkpoint": "T", "bits": 4, "acc": float("nan")},
        ]
    )
    assert capsys.readouterr().out.splitlines() == [
        "checkpoint bits    acc",
        "DIFF (a)     16 0.5000",
        "T             4    nan",
    ]


def test_parse_quiets_the_process(monkeypatch):
    monkeypatch.delenv("TORCHDYNAMO_DISABLE", raising=False)
    cli.parse(cli.parser(None, output_dir="x"), ["--load", "a"])
    assert os.environ["TORCHDYNAMO_DISABLE"] == "1"
