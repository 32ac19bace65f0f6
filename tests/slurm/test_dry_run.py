"""`DRY_RUN=1 bash slurm/<recipe>.sh` at the recipes' defaults resolves to exactly the paper's numbers
(DESIGN.md "Paper recipes") on the recipe's default cluster, and passes the dry run's checks (datasets
present, memory plan within the GPU, no ignored flags); knobs that break them are reported. No Slurm
needed: these always run.

The recipes' Python (PYTHON) is tests/preloaded_python.py's: each dry run is a process of its own, forked
from one that imported pretrain_diff.py's modules once (seconds, which twenty real starts would each pay);
the missing-dataset case starts the real interpreter."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from tests.preloaded_python import interpreter
from tests.slurm.helpers import REPO_ROOT, clean_env

DATA_DIR = Path(tempfile.gettempdir()) / f"diffmeg-dry-run-data-{os.getpid()}"
DATA = f"0.7 {DATA_DIR}/web_text_document 0.3 {DATA_DIR}/code_text_document"
"""A blend of two small datasets (the dry run checks that every one exists), made by `datasets`."""
RUNS = "/nonexistent/runs"  # dry runs create nothing


@pytest.fixture(scope="module", autouse=True)
def datasets():
    from diffmeg.data.indexed import IndexedWriter

    DATA_DIR.mkdir(exist_ok=True)
    # 1000 documents each: the recipes' --split 969,30,1 gives every split some (the dry run checks it)
    for name, tokens in (("web_text_document", 7), ("code_text_document", 3)):
        with IndexedWriter(str(DATA_DIR / name)) as writer:
            for doc in range(1000):
                writer.add_document(np.arange(doc, doc + tokens, dtype=np.int32))
            writer.commit()
    yield
    shutil.rmtree(DATA_DIR, ignore_errors=True)


def _ffn(hidden: int) -> int:
    return int(8 * hidden / 3 / 64) * 64  # "8/3 h", rounded down to a multiple of 64 as Megatron-LM


# (label, script, args, extra env)
CASES = [
    ("diff_3b_1T", "diff_3b_1T.sh", [], {}),
    ("transformer_3b_1T", "transformer_3b_1T.sh", [], {}),
    ("diff_3b_1T_1024gpus", "diff_3b_1T.sh", [], {"NODES": "128"}),
    ("diff_13b", "diff_13b.sh", [], {}),
    ("transformer_13b", "diff_13b.sh", [], {"ARCH": "transformer"}),
    ("diff_3b_64k", "diff_3b_64k.sh", [], {}),
    ("transformer_3b_64k", "diff_3b_64k.sh", [], {"ARCH": "transformer"}),
    ("gda_3b_1T", "gda_3b_1T.sh", [], {}),
] + [
    (f"{arch}-{size}", "diff_scaling.sh", [size if arch == "diff" else f"{arch}-{size}"], {})
    for size in ("830m", "1.4b", "2.8b", "6.8b", "13.1b")
    for arch in ("diff", "transformer", "gda")
]
PAPER = [label for label, *_ in CASES]
CASES += [
    # The plan that cannot run: fp32 without the distributed optimizer; sequence parallelism
    # asked for at TP 1 and a CP flag at CP 1, both ignored.
    (
        "fp32_no_distopt",
        "diff_3b_1T.sh",
        [],
        {
            "PRECISION": "fp32",
            "DIST_OPTIMIZER": "0",
            "SEQUENCE_PARALLEL": "1",
            "EXTRA_ARGS": "--cp-comm-type p2p",
            "ASYNC_SAVE": "0",
        },
    ),
    (
        "fp32_on_h200",
        "diff_3b_1T.sh",
        [],
        {"PRECISION": "fp32", "DIST_OPTIMIZER": "0", "GPU_MEMORY_GIB": "141"},
    ),
]


@pytest.fixture(scope="module")
def python() -> str:
    """The interpreter the recipes run: pretrain_diff.py's imports done once (tests/preloaded_python.py), in
    the environment slurm/common.sh gives it."""
    env = clean_env(PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"))
    env.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    return interpreter(REPO_ROOT / "pretrain_diff.py", env)


def dry_run(script: str, args: list[str], **env: str) -> subprocess.CompletedProcess:
    env = clean_env(**{"DRY_RUN": "1", "DATA_PATH": DATA, "RUNS_ROOT": RUNS, "PYTHON": sys.executable, **env})
    return subprocess.run(
        ["bash", str(REPO_ROOT / "slurm" / script), *args],
        env=env,
        cwd="/",
        capture_output=True,
        text=True,
        timeout=300,
    )


def split_output(stdout: str) -> tuple[list[str], dict]:
    """(the lines before the JSON: comments and the srun command, the resolved configuration)."""
    lines = stdout.splitlines()
    start = lines.index("{")
    return lines[:start], json.loads("\n".join(lines[start:]))


@pytest.fixture(scope="module")
def runs(python) -> dict[str, subprocess.CompletedProcess]:
    """All dry runs, two at a time."""
    with ThreadPoolExecutor(max_workers=max(2, min(4, os.cpu_count() or 2))) as pool:
        futures = {
            label: pool.submit(dry_run, script, args, **{"PYTHON": python, **env})
            for label, script, args, env in CASES
        }
    return {label: future.result() for label, future in futures.items()}


@pytest.fixture(scope="module")
def resolved(runs) -> dict[str, tuple[list[str], dict]]:
    results = {}
    for label, proc in runs.items():
        assert proc.returncode == 0, f"{label}: {proc.stderr[-3000:]}"
        results[label] = split_output(proc.stdout)
    return results


def _messages(proc: subprocess.CompletedProcess, kind: str) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith(kind)]


def _srun_line(head: list[str]) -> str:
    (line,) = [x for x in head if x.startswith("srun ")]
    return line


def check_common(
    config: dict, head: list[str], world: int, run_name: str, python: str, decay: str | None = "linear"
) -> None:
    assert config["model"]["vocab_size"] == 100288
    assert config["parallel"]["world_size"] == world
    assert config["parallel"]["use_distributed_optimizer"] is True
    assert config["schedule"]["optimizer"] == "adamw"
    assert config["schedule"]["precision"] == "bf16"
    if decay is not None:
        assert config["schedule"]["lr_decay_style"] == decay
    assert config["schedule"]["lr_decay_iters"] == config["schedule"]["train_iters"]
    assert config["data"]["data_path"] == DATA.split()
    assert config["data"]["mock_data"] is False
    ckpt = f"{RUNS}/{run_name}/checkpoints"
    assert config["checkpointing"]["save"] == ckpt and config["checkpointing"]["async_save"] is True
    srun = _srun_line(head)
    nodes, gpus = world // 8, 8
    assert f"srun --kill-on-bad-exit=1 --nodes={nodes} --ntasks={world} --ntasks-per-node={gpus} " in srun
    assert f" {python} pretrain_diff.py " in srun  # PYTHON
    assert f" --save {ckpt} " in srun
    assert f"--tensorboard-dir {RUNS}/{run_name}/tensorboard" in srun
    # Every recipe has DP > 1: gradient reduce-scatters and weight all-gathers overlap with compute.
    assert " --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather " in srun
    assert all(
        config["features"][k].startswith("on:") for k in ("overlap_grad_reduce", "overlap_param_gather")
    )
    # The default layout fits an 80 GB H100 by the dry run's memory plan, with room to spare.
    assert config["memory_per_gpu_gib"]["total"] < 64, config["memory_per_gpu_gib"]


def test_gda_3b_1T(resolved, python):
    """The 3B run with grouped differential attention: the Transformer's 24 heads as signal heads over 6 noise
    heads and 6 KV heads (DIFF V2 style, 4:1), everything else the paper's 3B recipe."""
    head, c = resolved["gda_3b_1T"]
    check_common(c, head, world=128, run_name="gda-3b-1T", python=python)
    m, s = c["model"], c["schedule"]
    assert m["architecture"] == "gda" and m["preset"] == "gda-3b"
    assert (m["num_layers"], m["hidden_size"], m["ffn_hidden_size"]) == (28, 3072, 8192)
    assert (m["num_attention_heads"], m["num_noise_heads"], m["num_query_groups"]) == (24, 6, 6)
    assert (m["head_dim"], m["value_head_dim"]) == (128, 128)
    assert s["train_iters"] == 238419
    assert (s["lr"], s["min_lr"], s["lr_warmup_iters"]) == (3.2e-4, 1.28e-5, 1000)
    # against the Transformer: 6 more query heads and 18 fewer KV heads of 128, and lambda_proj, a layer
    base = resolved["transformer_3b_1T"][1]["num_parameters"]
    assert c["num_parameters"] - base == 28 * 3072 * (6 * 128 - 2 * 18 * 128 + 24)


@pytest.mark.parametrize("arch", ["diff", "transformer"])
def test_3b_1T(resolved, python, arch):
    head, c = resolved[f"{arch}_3b_1T"]
    check_common(c, head, world=128, run_name=f"{arch}-3b-1T", python=python)
    m, s, b = c["model"], c["schedule"], c["batch"]
    assert m["architecture"] == arch and m["preset"] == f"{arch}-3b"
    assert (m["num_layers"], m["hidden_size"], m["ffn_hidden_size"]) == (28, 3072, 8192)
    heads = 12 if arch == "diff" else 24
    assert (m["num_attention_heads"], m["num_query_groups"], m["head_dim"]) == (heads, heads, 128)
    assert m["value_head_dim"] == (256 if arch == "diff" else 128)
    assert m["seq_length"] == 4096 and m["rotary_base"] == 10000.0
    assert b["global_batch_size"] == 1024 and b["tokens_per_batch"] == 4 * 1024 * 1024
    assert s["train_iters"] == math.ceil(1e12 / (1024 * 4096)) == 238419
    assert 1e12 <= s["total_tokens"] < 1e12 + b["tokens_per_batch"]
    assert (s["lr"], s["min_lr"], s["lr_warmup_iters"]) == (3.2e-4, 1.28e-5, 1000)
    assert (s["adam_beta1"], s["adam_beta2"], s["weight_decay"]) == (0.9, 0.95, 0.1)
    p = c["parallel"]
    assert (p["tensor_model_parallel_size"], p["pipeline_model_parallel_size"], p["data_parallel_size"]) == (
        1,
        1,
        128,
    )
    # Both models have the same parameters outside DIFF's lambdas and head norms.
    other_head, other = resolved["transformer_3b_1T" if arch == "diff" else "diff_3b_1T"]
    extra = 28 * 6 * 128  # lambda_q1, k1, q2, k2 and the head RMSNorm (2d) per layer
    diff_params = c["num_parameters"] if arch == "diff" else other["num_parameters"]
    base_params = other["num_parameters"] if arch == "diff" else c["num_parameters"]
    assert diff_params - base_params == extra


def test_3b_1T_on_1024_gpus(resolved, python):
    head, c = resolved["diff_3b_1T_1024gpus"]
    check_common(c, head, world=1024, run_name="diff-3b-1T", python=python)
    assert c["parallel"]["data_parallel_size"] == 1024
    assert c["batch"]["micro_batch_size"] == 1 and c["batch"]["num_microbatches"] == 1
    assert c["batch"]["global_batch_size"] == 1024


SCALING = {  # size: (layers, hidden, DIFF heads, lr), the DESIGN table
    "830m": (24, 1536, 8, 1.5e-4),
    "1.4b": (24, 2048, 8, 1.5e-4),
    "2.8b": (32, 2560, 10, 1.5e-4),
    "6.8b": (32, 4096, 16, 7.5e-5),
    "13.1b": (40, 5120, 20, 7.5e-5),
}


def check_scaling(c: dict, size: str, arch: str) -> None:
    layers, hidden, diff_heads, lr = SCALING[size]
    m, s, b = c["model"], c["schedule"], c["batch"]
    assert m["architecture"] == arch and m["preset"] == f"{arch}-{size}"
    assert (m["num_layers"], m["hidden_size"], m["ffn_hidden_size"]) == (layers, hidden, _ffn(hidden))
    heads = diff_heads if arch == "diff" else 2 * diff_heads
    assert m["num_attention_heads"] == heads
    if arch == "gda":  # the Transformer's heads as signal heads, a quarter as many noise and KV heads
        assert m["num_noise_heads"] == m["num_query_groups"] == heads // 4
    # Head dim 128, except 830M: the table's 8 DIFF heads at hidden 1536 give 96 (presets follow the table).
    assert m["head_dim"] == (96 if size == "830m" else 128)
    assert m["seq_length"] == 2048
    assert b["global_batch_size"] == 128 and b["tokens_per_batch"] == 256 * 1024
    assert (s["train_iters"], s["lr_warmup_iters"], s["lr"], s["min_lr"]) == (40000, 375, lr, 0.0)
    assert (s["adam_beta1"], s["adam_beta2"], s["weight_decay"]) == (0.9, 0.98, 0.05)


@pytest.mark.parametrize("arch", ["diff", "transformer", "gda"])
@pytest.mark.parametrize("size", list(SCALING))
def test_scaling_sweep(resolved, python, size, arch):
    head, c = resolved[f"{arch}-{size}"]
    check_common(c, head, world=8, run_name=f"{arch}-{size}", python=python)
    check_scaling(c, size, arch)
    p = c["parallel"]
    tp = {"830m": 1, "1.4b": 1, "2.8b": 1, "6.8b": 2, "13.1b": 2 if arch == "gda" else 4}[size]
    assert p["tensor_model_parallel_size"] == tp and p["sequence_parallel"] == (tp > 1)
    assert (" --sequence-parallel " in _srun_line(head)) == (tp > 1)  # passed only where it applies


@pytest.mark.parametrize("arch", ["diff", "transformer"])
def test_13b(resolved, python, arch):
    head, c = resolved[f"{arch}_13b"]
    check_common(c, head, world=64, run_name=f"{arch}-13.1b", python=python)
    check_scaling(c, "13.1b", arch)
    p = c["parallel"]
    assert (p["tensor_model_parallel_size"], p["data_parallel_size"], p["sequence_parallel"]) == (4, 16, True)


@pytest.mark.parametrize("arch", ["diff", "transformer"])
def test_3b_64k(resolved, python, arch):
    head, c = resolved[f"{arch}_3b_64k"]
    check_common(c, head, world=64, run_name=f"{arch}-3b-64k", python=python, decay=None)
    m, s, b, p = c["model"], c["schedule"], c["batch"], c["parallel"]
    assert m["preset"] == f"{arch}-3b-64k" and m["architecture"] == arch
    assert (m["num_layers"], m["hidden_size"], m["ffn_hidden_size"]) == (28, 3072, 8192)
    assert m["num_attention_heads"] == (12 if arch == "diff" else 24)
    assert m["seq_length"] == 65536 and m["rotary_base"] == 640000.0
    assert b["global_batch_size"] == 64 and b["tokens_per_batch"] == 4 * 1024 * 1024
    assert s["train_iters"] == math.ceil(1.5e9 / (64 * 65536)) == 358
    assert 1.5e9 <= s["total_tokens"] < 1.5e9 + b["tokens_per_batch"]
    assert s["lr"] == 8e-5
    assert (s["adam_beta1"], s["adam_beta2"], s["weight_decay"]) == (0.9, 0.95, 0.1)
    assert (p["tensor_model_parallel_size"], p["context_parallel_size"], p["data_parallel_size"]) == (
        2,
        2,
        16,
    )
    # Resume from its own checkpoints; until there are some, start from the 3B run's weights.
    srun = _srun_line(head)
    assert f" --load {RUNS}/{arch}-3b-64k/checkpoints " in srun
    assert f" --pretrained-checkpoint {RUNS}/{arch}-3b-1T/checkpoints " in srun
    assert "--recompute-granularity full" in srun
    # The loss in chunks of 2048 tokens: at most 1/8 of the whole logits' peak; the plan at most 18 GiB.
    assert " --cross-entropy-chunk-size 2048 " in srun
    loss = re.fullmatch(
        r"on: the loss peaks at ([\d.]+) GiB over chunks of 2048 tokens instead of ([\d.]+) GiB over the "
        r"whole logits",
        c["features"]["chunked_cross_entropy"],
    )
    assert loss and float(loss[1]) <= float(loss[2]) / 8, c["features"]["chunked_cross_entropy"]
    assert c["memory_per_gpu_gib"]["total"] <= 18, c["memory_per_gpu_gib"]


def test_outside_slurm_without_dry_run_refuses():
    env = clean_env(DATA_PATH=DATA, RUNS_ROOT=RUNS)
    proc = subprocess.run(
        ["bash", str(REPO_ROOT / "slurm" / "diff_3b_1T.sh")], env=env, capture_output=True, text=True
    )
    assert proc.returncode == 2 and "not inside a Slurm job" in proc.stderr


@pytest.mark.parametrize(
    "args,env,message",
    [
        (["999m"], {}, "usage: diff_scaling.sh SIZE"),
        (["830m"], {"ARCH": "mamba"}, "ARCH must be diff, diff2, gda or transformer"),
        (["830m"], {"DP": "4"}, "DP=4 but 8 ranks"),
        (["830m"], {"TP": "3"}, "not divisible by TP 3"),
    ],
)
def test_bad_knobs_fail_fast(args, env, message):
    proc = dry_run("diff_scaling.sh", args, **env)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_paper_recipes_pass_every_check(runs, resolved):
    for label in PAPER:
        proc = runs[label]
        assert _messages(proc, "data:") == ["data: 2 dataset(s) found, 10,000 tokens"], (label, proc.stderr)
        assert _messages(proc, "warning:") == [] and _messages(proc, "note:") == [], (label, proc.stderr)
        checks = resolved[label][1]["checks"]
        assert checks["memory_fits"] is True and checks["gpu_memory_gib"] == 80


def test_a_plan_over_the_gpu_memory_is_reported_with_the_knobs_that_shrink_it(runs, resolved):
    proc = runs["fp32_no_distopt"]
    (warning,) = _messages(proc, "warning:")
    assert "the memory plan needs 90.4 GiB per GPU, which exceeds --gpu-memory-gib 80 (128 GPUs)" in warning
    assert "PRECISION=bf16, DIST_OPTIMIZER=1, RECOMPUTE=full" in warning
    assert resolved["fp32_no_distopt"][1]["checks"]["memory_fits"] is False
    # The flags the run would ignore are explained, by the recipe and by pretrain_diff.py.
    assert " --sequence-parallel " not in _srun_line(resolved["fp32_no_distopt"][0])
    # Without the distributed optimizer only the gradient all-reduce overlaps (no weights to all-gather).
    assert " --overlap-grad-reduce " in _srun_line(resolved["fp32_no_distopt"][0])
    assert "--overlap-param-gather" not in _srun_line(resolved["fp32_no_distopt"][0])
    assert "diffmeg-slurm: note: SEQUENCE_PARALLEL=1 is not passed" in proc.stderr
    assert _messages(proc, "note:") == [
        "note: --cp-comm-type p2p has no effect: --context-parallel-size is 1"
    ]
    # ASYNC_SAVE=0: synchronous saves.
    assert resolved["fp32_no_distopt"][1]["checkpointing"]["async_save"] is False
    assert " --async-save " not in _srun_line(resolved["fp32_no_distopt"][0])
    # The same plan fits a 141 GB GPU.
    head, config = resolved["fp32_on_h200"]
    assert " --gpu-memory-gib 141 " in _srun_line(head) and config["checks"]["memory_fits"] is True
    assert _messages(runs["fp32_on_h200"], "warning:") == []


def test_a_missing_dataset_stops_the_dry_run_in_one_line():
    data = f"0.7 {DATA_DIR}/web_text_document 0.3 {DATA_DIR}/cod_text_document"
    proc = dry_run("diff_3b_1T.sh", [], DATA_PATH=data)
    assert proc.returncode == 2
    (error,) = _messages(proc, "error:")
    assert error == (
        f"error: --data-path: 1 of 2 dataset(s) not found: {DATA_DIR}/cod_text_document (no .bin or .idx). "
        "A dataset is the prefix of a .bin/.idx pair written by tools/preprocess_data.py"
    )
    assert "rejected this configuration" in proc.stderr and "Warning" not in proc.stderr
