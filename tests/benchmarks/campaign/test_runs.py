"""benchmarks/campaign/runs.py and procs.child_env: which data the memory phase's runs read.

The GPU plan's runs read the builtin corpus (their loss must fall in 50 iterations; uniform random mock
ids never let it, as the first H100 run showed: transformer-tiny 11.547 -> 11.559) with a tokenizer file
carried beside the wheels (the GPU machine is offline); without one they fall back to mock ids, saying so.
"""

from __future__ import annotations

import argparse
import shutil

from benchmarks.campaign import plan, procs
from benchmarks.campaign.runs import run_data
from diffmeg.data import tiktoken_cl100k as tokenizer


def test_the_gpu_plan_reads_text_and_the_smoke_plan_mock_ids():
    assert plan.GPU_PLAN.run_data == "builtin" and plan.SMOKE_PLAN.run_data == "mock"
    for p in (plan.GPU_PLAN, plan.SMOKE_PLAN):
        assert "--mock-data" not in p.run_args and "--data-path" not in p.run_args  # run_data decides
    assert run_data(plan.SMOKE_PLAN, {}) == (["--mock-data"], "mock")


def test_builtin_corpus_with_a_tokenizer_file(tokenizer_file):
    env = {tokenizer.TOKENIZER_FILE_ENV: tokenizer_file}
    assert run_data(plan.GPU_PLAN, env) == (["--data-path", "builtin"], "builtin")


def test_mock_ids_with_the_reason_when_no_tokenizer_is_found(tmp_path, monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")  # tiktoken's cache is off: nothing else to find
    env = {tokenizer.TOKENIZER_FILE_ENV: str(tmp_path / "absent.tiktoken")}
    args, data = run_data(plan.GPU_PLAN, env)
    assert args == ["--mock-data"]
    assert data.startswith("mock (no tokenizer for the builtin corpus: cannot read tokenizer file")


def test_child_env_points_the_runs_at_a_carried_tokenizer(tmp_path, tokenizer_file, monkeypatch):
    assert procs.TOKENIZER_FILE_ENV == tokenizer.TOKENIZER_FILE_ENV
    monkeypatch.delenv(procs.TOKENIZER_FILE_ENV, raising=False)
    a = argparse.Namespace(device="cpu", wheels=str(tmp_path))
    assert procs.TOKENIZER_FILE_ENV not in procs.child_env(a)  # nothing carried
    shutil.copy(tokenizer_file, tmp_path / procs.TOKENIZER_FILE_NAME)
    env = procs.child_env(a)
    assert env[procs.TOKENIZER_FILE_ENV] == str((tmp_path / procs.TOKENIZER_FILE_NAME).resolve())
    assert run_data(plan.GPU_PLAN, env)[1] == "builtin"
    monkeypatch.setenv(procs.TOKENIZER_FILE_ENV, tokenizer_file)  # the user's own setting wins
    assert procs.child_env(a)[procs.TOKENIZER_FILE_ENV] == tokenizer_file
