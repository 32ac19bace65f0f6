"""`--config FILE` (diffmeg.training.config_file): TOML, YAML and JSON files of flags, nested in the parser's
groups or flat, overridden by the command line; one-line errors for a bad key or value; a run's saved
arguments.json repeats the run; the example 13B config is the recipe's run."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from diffmeg.errors import DiffmegError
from diffmeg.run_config import RunConfig
from diffmeg.training.arguments import build_parser, resolve_args
from diffmeg.training.config_file import RECORDED
from tests.slurm.helpers import REPO_ROOT, clean_env

TINY = ["--model", "diff-tiny", "--mock-data"]

NESTED = """\
[model]
model = "diff-tiny"
num-layers = 2
no-diff-attention = true

[training]
train-iters = 7
micro-batch-size = 2
global-batch-size = 4
lr = 3e-3
lr-decay-style = "cosine"

[data]
mock-data = true

["logging and evaluation"]
log-interval = 3
"""
FLAT = """\
model = "diff-tiny"
num_layers = 2
diff-attention = false
train_iters = 7
micro-batch-size = 2
global_batch_size = 4
lr = 0.003
lr_decay_style = "cosine"
mock_data = true
log-interval = 3
"""
SAME_FLAGS = ["--model", "diff-tiny", "--num-layers", "2", "--no-diff-attention", "--train-iters", "7"]
SAME_FLAGS += ["--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "3e-3"]
SAME_FLAGS += ["--lr-decay-style", "cosine", "--mock-data", "--log-interval", "3"]
"""What NESTED and FLAT say, as flags."""


def _file(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _refused(argv: list[str]) -> str:
    with pytest.raises(DiffmegError) as err:
        resolve_args(argv, world_size=1)
    message = str(err.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("text", [NESTED, FLAT], ids=["nested", "flat"])
def test_a_toml_config_is_its_flags_and_the_command_line_wins(tmp_path, text):
    config = _file(tmp_path, "run.toml", text)
    got = resolve_args(["--config", config, "--train-iters", "9", "--lr", "1e-3"], world_size=1)
    want = resolve_args([*SAME_FLAGS, "--train-iters", "9", "--lr", "1e-3"], world_size=1)
    assert vars(got) == vars(want)
    assert got.train_iters == 9 and got.lr == 1e-3 and got.num_layers == 2 and not got.diff_attention
    assert got.lr_decay_style == "cosine" and got.log_interval == 3 and "config" not in vars(got)


def test_a_yaml_config_with_lists_booleans_and_yamls_own_number_spelling(tmp_path):
    pytest.importorskip("yaml")
    config = _file(
        tmp_path,
        "run.yaml",
        "model: diff-tiny\n"
        "training:\n  lr: 3e-4\n  train-iters: 5\n  bf16: true\n"  # PyYAML reads 3e-4 as a string
        "data:\n  data-path: [0.7, /data/web, 0.3, /data/code]\n"
        "sequence-parallel: false\n",
    )
    got = resolve_args(["--config", config, "--train-iters", "6"], world_size=1)
    flags = ["--model", "diff-tiny", "--lr", "3e-4", "--bf16", "--data-path", "0.7", "/data/web", "0.3"]
    want = resolve_args([*flags, "/data/code", "--train-iters", "6"], world_size=1)
    explicit = set(got.explicit_flags)
    assert explicit == set(want.explicit_flags) | {"sequence_parallel"}
    got.explicit_flags = want.explicit_flags
    assert vars(got) == vars(want)
    assert got.data_path == ["0.7", "/data/web", "0.3", "/data/code"] and got.bf16 and got.train_iters == 6


def test_a_words_string_is_a_list_flags_value(tmp_path):
    config = _file(tmp_path, "run.toml", 'data-path = "0.7 /data/web 0.3 /data/code"\nmodel = "diff-tiny"\n')
    assert resolve_args(["--config", config], world_size=1).data_path == [
        "0.7",
        "/data/web",
        "0.3",
        "/data/code",
    ]


def test_yaml_without_pyyaml_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "yaml", None)  # `import yaml` raises ImportError
    config = _file(tmp_path, "run.yml", "model: diff-tiny\n")
    assert "PyYAML is not installed: pip install pyyaml" in _refused(["--config", config])


@pytest.mark.parametrize(
    "text, match",
    [
        ("trian-iters = 5\n", "unknown key 'trian-iters'; the nearest flag is --train-iters"),
        ("[trainig]\nlr = 1e-3\n", "unknown key 'trainig'; the nearest flag is [training]"),
        (
            "[training]\nlr-warmup = 3\n",
            "unknown key [training] 'lr-warmup'; the nearest flag is --lr-warmup-iters",
        ),
        ("[model]\nlr = 1e-3\n", "key 'lr' is a flag of [training], not of [model]"),
        ("train-iters = 5\ntrain_iters = 6\n", "'train_iters' and 'train-iters' set the same flag"),
        ("config = 'other.toml'\n", "a config file cannot name another one"),
    ],
)
def test_a_bad_key_is_one_line_naming_it_and_the_nearest_flag(tmp_path, text, match):
    config = _file(tmp_path, "run.toml", text if "[" in text else 'model = "diff-tiny"\n' + text)
    message = _refused(["--config", config])
    assert message.startswith(f"--config {config}: ") and match in message


@pytest.mark.parametrize(
    "text, match",
    [
        (
            'train-iters = "many"',
            "key 'train-iters' (--train-iters) must be an integer, got 'many' (a string)",
        ),
        ("train-iters = 2.5", "key 'train-iters' (--train-iters) must be an integer, got 2.5 (a number)"),
        ('bf16 = "yes"', "key 'bf16' (--bf16) must be a boolean (true or false), got 'yes' (a string)"),
        ("lr = true", "key 'lr' (--lr) must be a number, got True (a boolean)"),
        ("data-path = 5", "key 'data-path' (--data-path) must be a list (or a string of words"),
        ("save = [1, 2]", "key 'save' (--save) must be a string, got [1, 2] (a list)"),
        ('lr-decay-style = "cos"', "key 'lr-decay-style' must be one of constant, linear, cosine"),
        ("diff-version = 3", "key 'diff-version' must be one of 1, 2, got 3"),
        ("[training.lr]\nx = 1", "key [training] 'lr' (--lr) must be a number, got {'x': 1} (a table)"),
    ],
)
def test_a_value_of_the_wrong_type_is_one_line_naming_the_key_and_the_type(tmp_path, text, match):
    config = _file(tmp_path, "run.toml", 'model = "diff-tiny"\n' + text + "\n")
    assert match in _refused(["--config", config])


@pytest.mark.parametrize(
    "name, text, match",
    [
        ("run.ini", "", "give a .toml, .yaml (.yml) or .json file"),
        ("run.toml", "lr = ", "is not valid TOML"),
        ("run.json", "[1, 2]", "the file must hold a table of flags, not a list"),
        ("missing.toml", None, "no such file"),
    ],
)
def test_a_file_that_is_no_config_is_one_line(tmp_path, name, text, match):
    config = str(tmp_path / name) if text is None else _file(tmp_path, name, text)
    assert match in _refused(["--config", config])


def test_a_value_out_of_range_is_refused_as_the_flags_is(tmp_path):
    config = _file(tmp_path, "run.toml", 'model = "diff-tiny"\ntrain-iters = 0\n')
    assert _refused(["--config", config]) == _refused(["--model", "diff-tiny", "--train-iters", "0"])


def _saved_arguments(tmp_path: Path, argv: list[str]) -> tuple[dict, str]:
    """Resolve `argv` as a run would and write its arguments.json with the run's own writer."""
    from diffmeg.training.logger import TrainingLogger

    args = resolve_args([*argv, "--save", str(tmp_path / "ckpt")], world_size=1)
    TrainingLogger(None, None, enabled=True).arguments(RunConfig.from_args(args), num_parameters=1)
    return vars(args), str(tmp_path / "ckpt" / "arguments.json")


def test_a_runs_saved_arguments_repeat_it_and_a_flag_changes_one_value(tmp_path):
    argv = [*TINY, "--lr", "1e-3", "--train-iters", "40", "--no-diff-attention", "--global-batch-size", "2"]
    first, saved = _saved_arguments(tmp_path, [*argv, "--sequence-parallel", "--seed", "7"])
    assert set(json.loads(Path(saved).read_text())) - {a.dest for a in build_parser()._actions} <= RECORDED
    again = vars(resolve_args(["--config", saved], world_size=1))
    assert again == {**first, "dropped_flags": []}  # TP 1 had dropped --sequence-parallel, recorded False
    assert first["dropped_flags"] and not first["sequence_parallel"]
    shorter = vars(resolve_args(["--config", saved, "--train-iters", "30"], world_size=1))
    changed = {k for k in first if first[k] != shorter[k]}
    assert changed == {"train_iters", "dropped_flags"}  # the schedule stays the run's
    assert shorter["lr_decay_iters"] == first["lr_decay_iters"] == 40 and shorter["save_interval"] == 40


def test_a_saved_token_budget_given_again_derives_the_iterations_again(tmp_path):
    first, saved = _saved_arguments(tmp_path, [*TINY, "--train-tokens", "4096"])
    assert (
        first["train_iters"] == 4096 // (first["seq_length"] * first["global_batch_size"])
        and "train_iters" not in first["explicit_flags"]
    )
    assert vars(resolve_args(["--config", saved], world_size=1)) == first
    again = resolve_args(["--config", saved, "--train-tokens", "8192"], world_size=1)
    assert again.train_iters == 2 * first["train_iters"]


def test_a_null_leaves_the_flag_to_the_preset(tmp_path):
    config = _file(tmp_path, "run.json", json.dumps({"model": "diff-tiny", "num_layers": None, "lr": 2e-3}))
    got = resolve_args(["--config", config], world_size=1)
    assert got.num_layers == resolve_args(["--model", "diff-tiny"], world_size=1).num_layers
    assert got.lr == 2e-3 and got.explicit_flags == ["lr"]


def test_recorded_is_what_a_run_adds_to_its_flags():
    dests = {a.dest for a in build_parser()._actions}
    assert set(vars(resolve_args(TINY, world_size=1))) - dests == RECORDED


def test_the_example_13b_config_plus_the_run_paths_is_the_recipes_run(tmp_path):
    env = clean_env(DRY_RUN="1", PYTHON="true", DATA_PATH="builtin", RUNS_ROOT=str(tmp_path / "runs"))
    out = subprocess.run(
        ["bash", "slurm/diff_13b.sh"], cwd=REPO_ROOT, env=env, capture_output=True, text=True, check=True
    ).stdout
    srun = shlex.split(next(line for line in out.splitlines() if line.startswith("srun ")))
    recipe = srun[srun.index("pretrain_diff.py") + 1 :]
    paths = []
    for flag in ("--data-path", "--load", "--save", "--tensorboard-dir", "--metrics-file"):
        paths += [flag, recipe[recipe.index(flag) + 1]]
    config = str(REPO_ROOT / "examples" / "configs" / "diff_13b.toml")
    assert vars(resolve_args(["--config", config, *paths], world_size=64)) == vars(
        resolve_args(recipe, world_size=64)
    )


def test_a_recipes_config_knob_is_passed_as_an_absolute_config_and_a_missing_one_is_refused(tmp_path):
    (tmp_path / "my.toml").write_text("lr = 6e-5\n")
    env = clean_env(DRY_RUN="1", PYTHON="true", DATA_PATH="builtin", RUNS_ROOT=str(tmp_path / "runs"))
    script = str(REPO_ROOT / "slurm" / "diff_13b.sh")
    run = subprocess.run(
        ["bash", script], cwd=tmp_path, env={**env, "CONFIG": "my.toml"}, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    srun = shlex.split(next(line for line in run.stdout.splitlines() if line.startswith("srun ")))
    assert srun[srun.index("pretrain_diff.py") + 1 : srun.index("pretrain_diff.py") + 3] == [
        "--config",
        str(tmp_path / "my.toml"),
    ]
    run = subprocess.run(
        ["bash", script], cwd=tmp_path, env={**env, "CONFIG": "no.toml"}, capture_output=True, text=True
    )
    assert run.returncode == 2 and "error: CONFIG=no.toml: no such file" in run.stderr
