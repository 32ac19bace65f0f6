"""tools/generate.py and diffmeg.generation: KV-cache decoding equals recomputation and transformers' greedy
generation of the exported model; sampling is seeded; generation stops at the end-of-document token."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO_ROOT
from tests.conversion.helpers import (
    GENERATE_PROMPT,
    GENERATE_PROMPT_IDS,
    GENERATE_TOKENS,
    exported_tiny,
    imported,
    refused,
    tiny_hf_reference,
    trained_tiny,
)
from tests.data.helpers import find_bpe_file
from tests.tools.helpers import run_tool, tool_env


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, single_rank_parallel_state):
    from tests.builders import load_model

    model, _ = load_model(str(trained_tiny(tmp_path_factory, "tp1")))
    return model


def test_kv_cache_matches_recomputation(tiny, tmp_path_factory):
    from diffmeg.generation import generate
    from tests.builders import load_model

    _, gqa_ckpt = imported(tmp_path_factory, "gqa")
    gqa, _ = load_model(str(gqa_ckpt))
    for model, prompt in ((tiny, GENERATE_PROMPT_IDS), (gqa, [15339, 1917, 0, 99, 100256])):
        cached = generate(model, prompt, 20, use_cache=True, return_logits=True)
        full = generate(model, prompt, 20, use_cache=False, return_logits=True)
        assert cached.output_ids == full.output_ids and len(cached.output_ids) == 20
        for a, b in zip(cached.step_logits, full.step_logits, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("source", ["checkpoint", "hf-folder"])
def test_greedy_cli_matches_transformers_generate(tmp_path_factory, source):
    """From the checkpoint, and from its Hugging Face export (read as the evaluation tools read one): the
    tokens transformers generates from the export, and nothing but the record on the way."""
    bpe = find_bpe_file()
    if bpe is None:
        pytest.skip("cl100k_base BPE file not found; set DIFFMEG_TOKENIZER_FILE")
    hf = source == "hf-folder"
    load = exported_tiny(tmp_path_factory) if hf else trained_tiny(tmp_path_factory, "tp1")
    args = ["--load", load, "--prompt", GENERATE_PROMPT, "--max-new-tokens", GENERATE_TOKENS, "--greedy"]
    proc = run_tool("generate", *args, "--json", "--tokenizer-file", bpe)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(proc.stdout.strip().splitlines()[-1])
    assert record["prompt"] == GENERATE_PROMPT and record["prompt_ids"] == GENERATE_PROMPT_IDS
    assert record["stop_reason"] == "length" and isinstance(record["output_text"], str)
    assert record["output_ids"] == tiny_hf_reference(tmp_path_factory)["generated"][0]
    for noise in ("Failed to load", "register_constant", "to instantiate a model of type"):
        assert noise not in proc.stderr, proc.stderr[-3000:]


def test_a_missing_iteration_names_the_complete_ones(tmp_path_factory, capsys):
    ckpt = trained_tiny(tmp_path_factory, "tp1")
    request = ["--prompt", "x", "--max-new-tokens", "1"]
    err = refused(capsys, "generate", "--load", ckpt, "--iteration", "7", *request)
    assert err == (
        f"error: --iteration 7: {ckpt}/iter_0000007 is missing; complete iterations in {ckpt}: 2; start from "
        "one with --iteration N"
    )


def test_sampling_is_seeded_and_top_p_truncates(tiny):
    from diffmeg.generation import SamplingConfig, generate

    def sample(**kw) -> list[int]:
        return generate(tiny, GENERATE_PROMPT_IDS, 10, SamplingConfig(**kw)).output_ids

    assert sample(temperature=1.5, seed=3) == sample(temperature=1.5, seed=3)
    assert sample(temperature=1.5, seed=3) != sample(temperature=1.5, seed=4)
    # A nucleus smaller than the top token's probability keeps the argmax only.
    assert sample(top_p=1e-6, seed=5) == sample(greedy=True)


def test_generation_stops_at_the_end_of_document_token(tiny):
    from diffmeg.generation import generate

    free = generate(tiny, GENERATE_PROMPT_IDS, 8).output_ids
    stop = free[3]
    first = free.index(stop)
    result = generate(tiny, GENERATE_PROMPT_IDS, 8, eod_id=stop)
    assert result.output_ids == free[: first + 1] and result.stop_reason == "eod"


def test_bad_requests_are_refused(tiny, tmp_path_factory, capsys):
    from diffmeg.errors import DiffmegError
    from diffmeg.generation import SamplingConfig, generate

    with pytest.raises(DiffmegError, match="outside the model's vocabulary of 512"):
        generate(tiny, [15339], 2)
    with pytest.raises(DiffmegError, match="--temperature must be > 0"):
        SamplingConfig(temperature=0.0)
    with pytest.raises(DiffmegError, match="--top-p must lie in"):
        SamplingConfig(top_p=1.5)
    bpe = find_bpe_file()
    if bpe is not None:
        ckpt = trained_tiny(tmp_path_factory, "tp1")
        proc = run_tool(
            "generate", "--load", ckpt, "--prompt", "x", "--max-new-tokens", "300", "--tokenizer-file", bpe
        )
        assert proc.returncode == 2 and "exceeds the model's 256 positions" in proc.stderr


def test_ctrl_c_is_one_line_and_rc_130():
    code = (
        "import runpy, sys\n"
        "from diffmeg import model_source\n"
        "def stop(*args, **kwargs):\n"
        "    raise KeyboardInterrupt  # Ctrl-C while the checkpoint is read\n"
        "model_source.read_checkpoint_info = stop\n"
        "sys.argv = ['tools/generate.py', '--load', 'ckpt', '--prompt', 'x', '--max-new-tokens', '1']\n"
        "runpy.run_path('tools/generate.py', run_name='__main__')\n"
    )
    cmd = [sys.executable, "-c", code]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=tool_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 130, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == ["error: interrupted; nothing was written"]
