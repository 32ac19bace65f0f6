"""pretrain_diff.py on a loss-masked dataset computes its loss on the masked (answer) tokens only.

With --lr 0 the weights never move, so the loss the trainer logs at iteration 1 must equal the mean
cross entropy, over the masked positions of the first global batch, of the checkpoint it saves; the
mean over all positions is far from it (the initialisation is wide, so per-token losses differ)."""

from __future__ import annotations

import argparse
import json
import subprocess

import numpy as np
import pytest
import torch

from diffmeg.data.mqar import MQARSetting, write_mqar_dataset
from tests.distributed.runner import job_env, launch_cmd

SETTING = MQARSetting(6, 4, 1, vocab_size=64)
BATCH = 8


@pytest.fixture(scope="module")
def masked_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("masked")
    prefix = str(tmp / "kv")
    write_mqar_dataset(prefix, SETTING, documents=64, seed=0)
    argv = ["pretrain_diff.py", "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2"]
    argv += ["--seq-length", str(SETTING.seq_length), "--vocab-size", "64", "--tokenizer-type", "null"]
    argv += ["--data-path", prefix, "--split", "1,0,0", "--micro-batch-size", "4"]
    argv += ["--global-batch-size", str(BATCH), "--train-iters", "1", "--lr", "0", "--log-interval", "1"]
    argv += ["--init-method-std", "0.5"]  # peaked predictions: per-token losses differ widely
    argv += ["--eval-iters", "0", "--save", str(tmp / "ckpt"), "--metrics-file", str(tmp / "m.jsonl")]
    from tests.conftest import REPO_ROOT

    argv[0] = str(REPO_ROOT / argv[0])
    proc = subprocess.run(launch_cmd(1, argv), cwd=tmp, env=job_env(tmp, 1), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    losses = [json.loads(line)["lm_loss"] for line in (tmp / "m.jsonl").read_text().splitlines()]
    return tmp, prefix, losses


def test_the_logged_loss_is_the_mean_over_answer_tokens(masked_run):
    from diffmeg.data.loss_mask import build_loss_mask_datasets
    from diffmeg.model_source import load_checkpoint_model, read_checkpoint_info
    from diffmeg.runtime import single_process

    tmp, prefix, losses = masked_run
    train, _, _ = build_loss_mask_datasets([prefix], "1,0,0", SETTING.seq_length, 1234, (BATCH, 0, 0))
    samples = [train[k] for k in range(BATCH)]  # the first global batch
    batch = {key: torch.stack([s[key] for s in samples]) for key in samples[0]}
    assert batch["loss_mask"].sum().item() == BATCH * SETTING.num_queries
    single_process()
    model = load_checkpoint_model(read_checkpoint_info(str(tmp / "ckpt")))
    with torch.no_grad():
        logits = model(input_ids=batch["tokens"], position_ids=batch["position_ids"], attention_mask=None)
    nll = torch.nn.functional.cross_entropy(logits.float().transpose(1, 2), batch["labels"], reduction="none")
    mask = batch["loss_mask"]
    # two micro-batches of 4: the trainer averages each one's masked mean (equal answer counts here)
    masked = np.mean([((nll * mask)[i : i + 4].sum() / mask[i : i + 4].sum()).item() for i in (0, 4)])
    everything = nll.mean().item()
    assert losses[0] == pytest.approx(masked, rel=1e-4)
    assert abs(everything - masked) > 0.05, (everything, masked)


def test_the_trainer_builds_whole_document_samples_for_a_masked_path(tmp_path):
    from diffmeg.data.loss_mask import LossMaskDataset, MaskedDocuments
    from diffmeg.run_config import RunConfig
    from diffmeg.training.data import build_datasets

    prefix = str(tmp_path / "d")
    write_mqar_dataset(prefix, SETTING, documents=10, seed=0)
    args = argparse.Namespace(
        mock_data=False,
        data_path=[prefix],
        split="90,10,0",
        seq_length=SETTING.seq_length,
        seed=1,
        train_iters=4,
        global_batch_size=2,
        eval_interval=2,
        eval_iters=1,
        data_cache_path=None,
    )
    train, valid, test = build_datasets(RunConfig.from_args(args, partial=True))
    assert isinstance(train, LossMaskDataset) and isinstance(valid, LossMaskDataset) and test is None
    assert len(train) == 9 and len(valid) == 6  # max(documents, samples asked for)
    tokens, mask = MaskedDocuments(prefix).get(train.document_index(0))
    sample = train[0]
    assert (
        sample["tokens"].tolist() == tokens[:-1].tolist() and sample["labels"].tolist() == tokens[1:].tolist()
    )
    assert sample["loss_mask"].tolist() == mask[1:].astype(float).tolist()


def test_eval_mqar_scores_the_saved_checkpoint(masked_run):
    """tools/eval_mqar.py on the run's checkpoint: the accuracy this test computes by hand."""
    from diffmeg.data.loss_mask import MaskedDocuments
    from diffmeg.model_source import load_checkpoint_model, read_checkpoint_info
    from diffmeg.runtime import single_process
    from tests.tools.helpers import run_tool

    tmp, prefix, _ = masked_run
    proc = run_tool(
        "eval_mqar", "--load", tmp / "ckpt", "--all-iterations", "--data-prefix", prefix,
        "--max-documents", "16", "--batch-size", "5", "--output-dir", tmp / "eval",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    (result,) = json.loads((tmp / "eval" / "mqar_summary.json").read_text())["results"]
    assert (result["iteration"], result["answers"], result["setting"]) == (1, 16 * 4, SETTING.name)
    single_process()
    model = load_checkpoint_model(read_checkpoint_info(str(tmp / "ckpt")))
    docs = MaskedDocuments(prefix)
    hits = []
    for i in range(16):
        tokens, mask = docs.get(i)
        ids = torch.as_tensor(tokens[:-1]).unsqueeze(0)
        with torch.no_grad():
            logits = model(
                input_ids=ids, position_ids=torch.arange(ids.shape[1]).unsqueeze(0), attention_mask=None
            )
        for p in np.flatnonzero(mask):
            hits.append(int(logits[0, p - 1].argmax()) == int(tokens[p]))
    assert result["accuracy"] == pytest.approx(np.mean(hits))
    assert len(result["by_query"]) == SETTING.num_queries and len(result["by_pair"]) <= SETTING.num_pairs
