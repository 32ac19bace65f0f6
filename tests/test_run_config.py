"""The typed run configuration: grouped fields, and the flat arguments (args.json) back exactly."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from diffmeg import registry
from diffmeg.errors import DiffmegError
from diffmeg.run_config import RunConfig
from diffmeg.training.arguments import resolve_args


@pytest.mark.parametrize(
    "argv,world",
    [
        (["--model", "diff-tiny", "--mock-data"], 1),
        (["--model", "transformer-tiny", "--save", "/c", "--load", "/c", "--ckpt-step", "4", "--verbose"], 1),
        (["--model", "diff-3b", "--tensor-model-parallel-size", "2", "--sequence-parallel", "--bf16"], 16),
    ],
)
def test_flat_arguments_round_trip(argv, world):
    args = resolve_args(argv, world_size=world)
    run = RunConfig.from_args(args)
    assert vars(run.to_args()) == vars(args)


def test_groups_are_typed_and_unknown_flags_travel_in_extra():
    args = resolve_args(
        [
            "--model",
            "diff-3b",
            "--tensor-model-parallel-size",
            "2",
            "--bf16",
            "--ckpt-step",
            "7",
            "--load",
            "/c",
        ],
        world_size=16,
    )
    run = RunConfig.from_args(args)
    assert (run.model.preset, run.model.num_layers, run.model.architecture) == ("diff-3b", 28, "DIFF")
    assert run.parallel.data_parallel_size == 8 and run.parallel.world_size == 16
    assert run.training.precision == "bf16" and run.optim.lr == args.lr
    assert (run.checkpoint.load, run.checkpoint.ckpt_step) == ("/c", 7)
    assert run.tokens_per_step == args.global_batch_size * args.seq_length
    assert run.num_microbatches == args.global_batch_size // (args.micro_batch_size * 8)
    assert "explicit_flags" in run.extra and run.logging.dry_run is False
    assert "hidden_size" not in run.extra


def test_missing_fields_are_an_error_unless_partial():
    args = resolve_args(["--model", "diff-tiny", "--mock-data"], world_size=1)
    old = argparse.Namespace(
        **{k: v for k, v in vars(args).items() if k not in ("cp_comm_type", "num_layers")}
    )
    with pytest.raises(DiffmegError, match="num_layers"):
        RunConfig.from_args(old)
    run = RunConfig.from_args(old, partial=True)  # e.g. an args.json from before a field existed
    assert run.parallel.cp_comm_type is None and run.model.num_layers is None
    assert vars(run.to_args()) == vars(old)  # what was read, nothing added


def test_every_flag_is_one_declared_field():
    """The parser is the declarations: each declared field is a flag of its type and default, and every flag
    but --config, --model and the registry's is a declared field (adding a field adds the flag)."""
    from diffmeg.run_config import declared
    from diffmeg.training.arguments import DECLARED, build_parser

    actions = {a.dest: a for a in build_parser()._actions if a.option_strings and a.dest != "help"}
    fields = {f.name: (f, d) for cls in DECLARED for f, d in declared(cls)}
    own = {"config", "model", *(s.field for s in registry.flagged())}
    assert set(actions) - own == set(fields)
    for name, (f, decl) in fields.items():
        action = actions[name]
        assert action.option_strings[0] == "--" + name.replace("_", "-")
        assert action.help == decl.help and bool(action.help), name
        if decl.choices is not None:
            assert list(action.choices) == list(decl.choices), name
        if not (decl.preset or decl.unset or decl.parser_default is not None):
            missing = f.default is dataclasses.MISSING  # required, derived when not given
            assert action.default == (None if missing else f.default), name
