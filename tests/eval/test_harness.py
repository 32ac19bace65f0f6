"""lm-evaluation-harness on a trained tiny checkpoint, offline, with tasks defined here (local JSONL):
tools/eval_harness.py end to end; lm-eval's multiple-choice log-likelihoods are the model's own; a
document's rolling log-likelihood through lm-eval equals tools/eval_long_context.py --prefix-eod's NLL."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from diffmeg.errors import DiffmegError
from tests.conftest import REPO_ROOT
from tests.eval.helpers import MOCK_VOCAB, write_indexed_dataset
from tests.tools.helpers import run_tool, tool_env

pytest.importorskip("lm_eval")

DOC_LENGTHS = (40, 57, 64)
"""At most the evaluated length (64): each document is one lm-eval window, as in eval_long_context."""


def _ids(values) -> str:
    return " ".join(str(int(v)) for v in values)


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    """A multiple-choice task and a document (rolling log-likelihood) task in token ids, as lm-eval task
    YAMLs over local JSONL files, plus the documents as an indexed dataset."""
    root = tmp_path_factory.mktemp("harness_tasks")
    rng = np.random.default_rng(0)
    items = [
        {"context": _ids(rng.integers(0, MOCK_VOCAB, 12)), "label": i % 3,
         "choices": [_ids(rng.integers(0, MOCK_VOCAB, n)) for n in (1, 2, 3)]}
        for i in range(6)
    ]  # fmt: skip
    docs = [rng.integers(0, MOCK_VOCAB - 1, n) for n in DOC_LENGTHS]
    (root / "mc.jsonl").write_text("".join(json.dumps(item) + "\n" for item in items))
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": _ids(d)}) + "\n" for d in docs))
    common = "dataset_path: json\ntest_split: test\n"
    (root / "toy_mc.yaml").write_text(
        f"task: toy_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {root / 'mc.jsonl'}\n"
        "output_type: multiple_choice\ndoc_to_text: '{{context}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{label}}'\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n"
    )
    (root / "toy_docs.yaml").write_text(
        f"task: toy_docs\n{common}dataset_kwargs:\n  data_files:\n    test: {root / 'docs.jsonl'}\n"
        "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
        "metric_list:\n  - metric: word_perplexity\n"
    )
    return {"root": root, "items": items, "docs": docs, "prefix": write_indexed_dataset(root / "docs", docs)}


@pytest.fixture(scope="module")
def harness_run(tiny_ckpts, tasks, tmp_path_factory):
    out = tmp_path_factory.mktemp("harness_out")
    env = tool_env(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", HF_DATASETS_CACHE=str(out / "hf_cache"))
    proc = run_tool(
        "eval_harness", "--load", tiny_ckpts["diff"], "--tasks", tasks["root"] / "toy_mc.yaml",
        tasks["root"] / "toy_docs.yaml", "--log-samples", "--batch-size", "4", "--output-dir", out, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    samples = [json.loads(line) for line in (out / "harness_samples.jsonl").read_text().splitlines()]
    return proc, out, samples


def test_the_tool_scores_local_tasks_on_a_trained_checkpoint(harness_run):
    proc, out, samples = harness_run
    summary = json.loads((out / "harness_results.json").read_text())
    (label,) = summary["checkpoints"]
    results = summary["checkpoints"][label]["results"]
    assert label == "DIFF (diff)" and set(results) == {"toy_mc", "toy_docs"}
    mc = [s for s in samples if s["task"] == "toy_mc"]
    assert len(mc) == 6
    assert results["toy_mc"]["acc"] == pytest.approx(np.mean([s["acc"] for s in mc]))
    assert results["toy_docs"]["word_perplexity"] > 1
    rows = (out / "harness_results.csv").read_text().splitlines()
    assert rows[0] == "label,task,metric,value" and any(r.startswith("DIFF (diff),toy_mc,acc,") for r in rows)
    assert "toy_mc" in proc.stdout and "acc_norm" in proc.stdout


def test_multiple_choice_log_likelihoods_are_the_models_own(harness_run, tasks, tiny_ckpts):
    """Each choice's score is the sum of log-softmax over the model's full logits at its tokens (a
    float64 computation here), after lm-eval's context/continuation split (" " moves to the choice)."""
    from diffmeg.eval.common import CheckpointSet, forward, loaded_models

    _, _, samples = harness_run
    (info,) = CheckpointSet([str(tiny_ckpts["diff"])]).resolve()
    for _, model in loaded_models([info]):
        for sample in (s for s in samples if s["task"] == "toy_mc"):
            item = tasks["items"][sample["doc_id"]]
            context = [int(t) for t in item["context"].split()]
            for choice, ((score, greedy),) in zip(item["choices"], sample["resps"], strict=True):
                cont = [int(t) for t in choice.split()]
                logp = torch.log_softmax(forward(model, context + cont).double(), dim=-1)
                rows = logp[len(context) - 1 : -1]  # position p predicts token p + 1
                expected = float(rows[torch.arange(len(cont)), cont].sum())
                assert score == pytest.approx(expected, abs=1e-5)
                assert greedy == bool((rows.argmax(-1) == torch.tensor(cont)).all())


def test_rolling_log_likelihood_equals_long_context_nll_with_the_eod_prefix(
    harness_run, tasks, tiny_ckpts, tmp_path
):
    from diffmeg.eval.common import CheckpointSet
    from diffmeg.eval.long_context import LongContextConfig, run_long_context_eval

    _, _, samples = harness_run
    rolling = {s["doc_id"]: s["resps"][0][0] for s in samples if s["task"] == "toy_docs"}
    for doc_id, length in enumerate(DOC_LENGTHS):  # one document per run: its own NLL sum
        prefix = write_indexed_dataset(tmp_path / f"doc{doc_id}", [tasks["docs"][doc_id]])
        summary = run_long_context_eval(
            LongContextConfig(
                CheckpointSet([str(tiny_ckpts["diff"])]), data_prefix=prefix, prefix_eod=True,
                max_length=length, output_dir=str(tmp_path / f"out{doc_id}"), plot=False,
            ),
            log=lambda message: None,
        )  # fmt: skip
        (ckpt,) = summary["checkpoints"]
        assert ckpt["tokens_evaluated"] == length and summary["prefix_eod"] == MOCK_VOCAB - 1
        nll = ckpt["mean_nll_per_token"] * ckpt["tokens_evaluated"]
        assert -rolling[doc_id] == pytest.approx(nll, abs=1e-5 * length)


def test_bad_task_text_and_presets():
    from diffmeg.eval.harness import PRESETS, IdText, resolve_tasks

    assert resolve_tasks(["paper", "arc_easy", "x.yaml"]) == PRESETS["paper"] + ["x.yaml"]
    assert PRESETS["paper"] == [
        "arc_challenge", "arc_easy", "boolq", "hellaswag", "openbookqa", "piqa", "winogrande",
    ]  # fmt: skip
    assert IdText(16).tokenize(" 3 15\n0 ") == [3, 15, 0]
    with pytest.raises(DiffmegError, match="reads token ids, not text"):
        IdText(16).tokenize("The cat")
    with pytest.raises(DiffmegError, match="outside the vocabulary of 16"):
        IdText(16).tokenize("3 16")


def test_generation_is_greedy_and_stops_at_the_first_stop_string(tiny_ckpts):
    """generate_until continues like diffmeg's greedy generation and cuts before a stop string."""
    from types import SimpleNamespace

    from diffmeg.eval.common import CheckpointSet, eod_id, loaded_models
    from diffmeg.eval.harness import DiffmegLM, IdText
    from diffmeg.generation import generate

    (info,) = CheckpointSet([str(tiny_ckpts["diff"])]).resolve()
    for _, model in loaded_models([info]):
        lm = DiffmegLM(model, IdText(MOCK_VOCAB), eod_id(info), max_length=64)
        prompt = list(range(3, 40, 3))
        greedy = generate(model, prompt, 6).output_ids
        assert eod_id(info) not in greedy
        text, stop = _ids(greedy), f" {greedy[2]} "
        request = SimpleNamespace(args=(_ids(prompt), {"until": ["never", stop], "max_gen_toks": 6}))
        free = SimpleNamespace(args=(_ids(prompt), {"until": [], "max_gen_toks": 4}))
        stopped, full = lm.generate_until([request, free])
        assert stopped == text[: text.index(stop)] and len(stopped) < len(text)
        assert full == _ids(greedy[:4])


def test_a_misspelt_task_is_one_line_naming_the_nearest(tiny_ckpts, tmp_path):
    """`--tasks hellaswagg`: one line with lm-eval's nearest names and exit 2, before any checkpoint loads
    (lm-eval's own answer is a KeyError traceback)."""
    proc = run_tool(
        "eval_harness", "--load", tiny_ckpts["diff"], "--tasks", "hellaswagg", "--output-dir", tmp_path / "o",
        env=tool_env(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1"),
    )  # fmt: skip
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("error: unknown task 'hellaswagg'; nearest: hellaswag, ")


def _missing_data_task(root, data_file) -> str:
    yaml = root / "missing.yaml"
    yaml.write_text(
        f"task: toy_missing\ndataset_path: json\ntest_split: test\ndataset_kwargs:\n  data_files:\n"
        f"    test: {data_file}\noutput_type: multiple_choice\ndoc_to_text: '{{{{context}}}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{label}}'\nmetric_list:\n  - metric: acc\n"
    )
    return str(yaml)


def test_a_task_whose_data_file_is_missing_is_one_line_naming_it(tmp_path):
    from lm_eval.tasks import TaskManager

    from diffmeg.eval.harness import check_tasks, load_task_data

    yaml = _missing_data_task(tmp_path, tmp_path / "gone.jsonl")
    manager = TaskManager(include_defaults=False)
    check_tasks([yaml], manager.task_index)
    with pytest.raises(DiffmegError) as err:
        load_task_data([yaml], manager)
    assert str(err.value) == (
        f"task data file {tmp_path / 'gone.jsonl'} does not exist (named by task file {yaml}): fix the "
        "task's dataset_kwargs data_files path"
    )
    with pytest.raises(DiffmegError, match=f"^task file {tmp_path / 'other.yaml'} does not exist$"):
        check_tasks([str(tmp_path / "other.yaml")], manager.task_index)


def test_a_hub_dataset_on_an_offline_machine_is_one_line_saying_how_to_cache_it(tmp_path):
    """A task whose dataset lives on the Hub, offline and uncached: which dataset, and the command that
    caches it on a machine with network."""
    import subprocess
    import sys

    yaml = tmp_path / "hub.yaml"
    yaml.write_text(
        "task: hub_task\ndataset_path: someone/never_cached_here\ntest_split: test\n"
        "output_type: multiple_choice\ndoc_to_text: '{{q}}'\ndoc_to_choice: '{{c}}'\ndoc_to_target: 0\n"
        "metric_list:\n  - metric: acc\n"
    )
    code = (
        "from lm_eval.tasks import TaskManager\n"
        "from diffmeg.errors import DiffmegError\n"
        "from diffmeg.eval.harness import load_task_data\n"
        f"try:\n    load_task_data([{str(yaml)!r}], TaskManager(include_defaults=False))\n"
        "except DiffmegError as exc:\n    print(exc)\n"
    )
    env = tool_env(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = proc.stdout.strip().splitlines()
    assert line.startswith("lm-eval needs the dataset someone/never_cached_here from the Hugging Face Hub")
    assert f"get_task_dict([{str(yaml)!r}], TaskManager())" in line and line.endswith("HF_HUB_OFFLINE=1")
