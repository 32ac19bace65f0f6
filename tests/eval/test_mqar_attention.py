"""MQAR attention analysis (diffmeg/eval/mqar_attention.py) in float64: hand-built maps of the three
architectures whose pair / noise masses are worked out below from the definitions, the same masses read
out of real tiny models against a per-answer computation, and tools/eval_mqar.py --attention end to end."""

from __future__ import annotations

import csv
import json
import shutil

import numpy as np
import pytest
import torch

from diffmeg.data.indexed import loss_mask_prefix
from diffmeg.data.loss_mask import MaskedDocuments
from diffmeg.data.mqar import MQARSetting, write_mqar_dataset
from diffmeg.errors import DiffmegError
from diffmeg.eval.capture import AttentionRecord, capture_attention
from diffmeg.eval.mqar import evaluate_documents
from diffmeg.eval.mqar_attention import AnswerRows, AttentionTally, normalised_map
from tests.tools.helpers import run_tool

# Vocabulary 16 (keys 1-7, values 8-15). Context: k1=1 v1=9, a distractor 3, k2=2 v2=10 (positions 0-4);
# queries k2 (5) -> 10 (6), k1 (7) -> 9 (8). Inputs are positions 0-7. Answer 6 is read at row 5 with
# pair {3, 4}; answer 8 at row 7 with pair {0, 1}; the context is positions 0-4.
DOC = np.array([1, 9, 3, 2, 10, 2, 10, 1, 9])
MASK = np.zeros(9, dtype=bool)
MASK[[6, 8]] = True

# Rows 5 and 7 of two softmax maps (keys 0..row). A1 row 5: pair 0.4 + 0.3 = 0.7, noise 0.05 + 0.05 +
# 0.1 = 0.2, query 0.1; row 7: pair 0.6, noise 0.3, query 0.1. A2 row 5: pair 0.2, noise 0.6, query 0.2;
# row 7 uniform: pair 2/8, noise 3/8, query 3/8.
A1_ROWS = {5: [0.05, 0.05, 0.1, 0.4, 0.3, 0.1], 7: [0.3, 0.3, 0.1, 0.1, 0.1, 0.04, 0.03, 0.03]}
A2_ROWS = {5: [0.2, 0.2, 0.2, 0.1, 0.1, 0.2], 7: [1 / 8] * 8}


def _map(rows: dict[int, list[float]]) -> torch.Tensor:
    """[1, 1, 8, 8]: the given rows, every other row uniform over its causally visible keys."""
    m = torch.zeros(1, 1, 8, 8, dtype=torch.float64)
    for r in range(8):
        m[0, 0, r, : r + 1] = torch.tensor(rows.get(r, [1 / (r + 1)] * (r + 1)), dtype=torch.float64)
    return m


def _record(kind: str, maps: list[torch.Tensor], lam=None) -> AttentionRecord:
    keep = torch.ones(8, 8, dtype=torch.bool).tril()
    return AttentionRecord(0, kind, [torch.zeros_like(m) for m in maps], maps, keep, lam)


def _tally(record: AttentionRecord) -> dict:
    tally = AttentionTally()
    tally.add(record, AnswerRows.of_documents([DOC], [MASK]))
    (layer,) = tally.summary()
    return layer


def _means(layer: dict, scale: str) -> list[float]:
    return [layer[scale][m] for m in ("pair", "noise", "query")]


def test_answer_rows():
    other = np.array([4, 12, 5, 13, 5, 13, 4, 12])  # pairs (4, 12), (5, 13); queries 5, 4
    other_mask = np.zeros(8, dtype=bool)
    other_mask[[5, 7]] = True
    rows = AnswerRows.of_documents([DOC, other], [MASK, other_mask])
    assert rows.batch.tolist() == [0, 0, 1, 1]
    assert rows.row.tolist() == [5, 7, 4, 6]
    assert rows.pair.tolist() == [3, 0, 2, 0]
    assert rows.context.tolist() == [5, 5, 4, 4]
    not_mqar = np.array([1, 9, 2, 10, 3, 11])  # the query key 3 is not in the context
    with pytest.raises(DiffmegError, match="reads MQAR documents"):
        AnswerRows.of_documents([not_mqar], [np.array([0, 0, 0, 0, 0, 1], dtype=bool)])


def test_transformer_masses_are_the_softmax_map_and_need_no_normalisation():
    layer = _tally(_record("softmax", [_map(A1_ROWS)]))
    # pair (0.7 + 0.6) / 2, noise (0.2 + 0.3) / 2, query 0.1
    np.testing.assert_allclose(_means(layer, "raw"), [0.65, 0.25, 0.1], rtol=0, atol=1e-15)
    assert _means(layer, "normalised") == _means(layer, "raw")
    assert layer["normalised"]["ratio"] == pytest.approx(0.65 / 0.25, rel=1e-14)
    assert layer["lambda"] is None and layer["answers"] == 2


def test_transformer_masses_are_averaged_over_heads():
    maps = torch.cat([_map(A1_ROWS), _map({})], dim=1)  # head 1 uniform: pair 2/6, 2/8; noise 3/6, 3/8
    layer = _tally(_record("softmax", [maps]))
    pair1, noise1 = (2 / 6 + 2 / 8) / 2, (3 / 6 + 3 / 8) / 2
    np.testing.assert_allclose(layer["raw"]["by_head"]["pair"], [0.65, pair1], rtol=0, atol=1e-15)
    np.testing.assert_allclose(layer["raw"]["by_head"]["noise"], [0.25, noise1], rtol=0, atol=1e-15)
    assert layer["raw"]["pair"] == pytest.approx((0.65 + pair1) / 2, abs=1e-15)


def test_diff_v1_rows_are_divided_by_one_minus_lambda():
    layer = _tally(_record("diff", [_map(A1_ROWS), _map(A2_ROWS)], 0.4))
    # A1 - 0.4 A2, row 5: pair 0.7 - 0.08 = 0.62, noise 0.2 - 0.24 = -0.04, query 0.1 - 0.08 = 0.02
    # (sum 0.6 = 1 - lambda); row 7: pair 0.6 - 0.1 = 0.5, noise 0.3 - 0.15 = 0.15, query 0.1 - 0.15 = -0.05.
    raw = [0.56, 0.055, -0.015]
    np.testing.assert_allclose(_means(layer, "raw"), raw, rtol=0, atol=1e-15)
    np.testing.assert_allclose(_means(layer, "normalised"), [v / 0.6 for v in raw], rtol=0, atol=1e-15)
    assert sum(_means(layer, "normalised")) == pytest.approx(1.0, abs=1e-15)
    assert layer["normalised"]["ratio"] == pytest.approx(0.56 / 0.055, rel=1e-13)
    assert layer["lambda"] == pytest.approx(0.4, abs=1e-15)


def test_diff_v2_rows_are_divided_by_their_own_token_lambda():
    lam = torch.full((1, 1, 8, 1), 0.9, dtype=torch.float64)
    lam[0, 0, 5, 0], lam[0, 0, 7, 0] = 0.5, 0.2  # the answers' rows; the others must not matter
    layer = _tally(_record("diff", [_map(A1_ROWS), _map(A2_ROWS)], lam))
    # row 5, lambda 0.5: pair 0.7 - 0.1 = 0.6, noise 0.2 - 0.3 = -0.1, query 0.1 - 0.1 = 0 (sum 0.5);
    # normalised / 0.5: 1.2, -0.2, 0. Row 7, lambda 0.2: pair 0.6 - 0.05 = 0.55, noise 0.3 - 0.075 =
    # 0.225, query 0.1 - 0.075 = 0.025 (sum 0.8); normalised / 0.8: 0.6875, 0.28125, 0.03125.
    np.testing.assert_allclose(_means(layer, "raw"), [0.575, 0.0625, 0.0125], rtol=0, atol=1e-15)
    np.testing.assert_allclose(_means(layer, "normalised"), [0.94375, 0.040625, 0.015625], rtol=0, atol=1e-15)
    assert layer["lambda"] == pytest.approx(0.35, abs=1e-15)
    # one lambda per layer (their mean, 0.35) would give 0.575 / 0.65 = 0.885 for the pair: not this
    assert abs(layer["normalised"]["pair"] - 0.575 / 0.65) > 0.05


def test_a_lambda_of_one_cannot_be_normalised():
    with pytest.raises(DiffmegError, match="lambda is 1"):
        normalised_map(_record("diff", [_map(A1_ROWS), _map(A2_ROWS)], 1.0))


def test_a_negative_noise_has_no_ratio():
    layer = _tally(_record("diff", [_map(A1_ROWS), _map(A2_ROWS)], 0.8))
    # noise: row 5 0.2 - 0.8 * 0.6 = -0.28, row 7 0.3 - 0.8 * 3/8 = 0; the mean -0.14 has no ratio
    assert layer["raw"]["noise"] == pytest.approx(-0.14, abs=1e-15) and layer["raw"]["ratio"] is None
    assert layer["normalised"]["noise"] == pytest.approx(-0.7, abs=1e-14)
    assert layer["normalised"]["ratio"] is None


# ----------------------------------------------------------------------------------------------------
# Real models


def _model(kind: str):
    from diffmeg.model import build_model
    from tests.builders import make_config, make_v2_config

    if kind == "v2":
        cfg = make_v2_config(heads=2, kv_heads=1, head_dim=8, layers=2)
    else:
        cfg = make_config(heads=2, kv_heads=1, head_dim=8, layers=2, diff_attention=kind == "diff")
    model = build_model(cfg, vocab_size=64, max_sequence_length=32, rotary_base=500.0, seed=3).double()
    with torch.no_grad():  # lambda away from its init, so that a normalisation ignoring it is caught
        gen = torch.Generator().manual_seed(5)
        for name, p in model.named_parameters():
            if "lambda" in name:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.5)
    return model.eval()


def _by_hand(model, documents: MaskedDocuments, count: int) -> dict[int, dict[str, np.ndarray]]:
    """Per layer, [pair, noise, query] means over answers and heads, raw and normalised, one document
    and one answer at a time: the row's own sum is checked against 1 - lambda and divided out."""
    sums: dict[int, dict[str, np.ndarray]] = {}
    answers = 0
    for i in range(count):
        doc, mask = documents.get(i)
        records: list[AttentionRecord] = []
        ids = torch.as_tensor(doc[:-1]).unsqueeze(0)
        with torch.no_grad(), capture_attention(model, records.append):
            model(input_ids=ids, position_ids=torch.arange(ids.shape[1]).unsqueeze(0), attention_mask=None)
        positions = np.flatnonzero(mask)
        context = positions[0] - 1
        tokens = doc.tolist()
        answers += len(positions)
        for rec in records:
            acc = sums.setdefault(rec.layer, {"raw": np.zeros(3), "normalised": np.zeros(3)})
            heads = rec.maps[0].shape[1]
            for p in positions:
                r, first = p - 1, tokens.index(tokens[p - 1])
                for h in range(heads):
                    if rec.kind == "softmax":
                        row, lam = rec.maps[0][0, h, r], 0.0
                    else:
                        lam = rec.lam if isinstance(rec.lam, float) else float(rec.lam[0, h, r, 0])
                        row = rec.maps[0][0, h, r] - lam * rec.maps[1][0, h, r]
                    row = row.tolist()
                    assert sum(row) == pytest.approx(1 - lam, abs=1e-12)
                    pair = row[first] + row[first + 1]
                    noise = sum(row[:context]) - pair
                    masses = np.array([pair, noise, sum(row) - pair - noise]) / heads
                    acc["raw"] += masses
                    acc["normalised"] += masses / sum(row)
    return {layer: {k: v / answers for k, v in acc.items()} for layer, acc in sums.items()}


@pytest.mark.parametrize("kind", ["diff", "baseline", "v2"])
def test_masses_of_a_real_model_equal_a_per_answer_computation(single_rank_parallel_state, tmp_path, kind):
    setting = MQARSetting(4, 2, 1, vocab_size=64)
    prefix = str(tmp_path / "kv")
    write_mqar_dataset(prefix, setting, documents=5, seed=3)
    documents = MaskedDocuments(prefix)
    model = _model(kind)
    tally = AttentionTally()
    plain = evaluate_documents(model, documents, None, 2, 64, 64).summary()
    read = evaluate_documents(model, documents, None, 2, 64, 64, attention=tally).summary()
    assert read == plain  # reading the attention changes no prediction
    expected = _by_hand(model, documents, 5)
    summary = tally.summary()
    assert [layer["layer"] for layer in summary] == [0, 1]
    for layer in summary:
        assert layer["answers"] == 5 * 2
        for scale in ("raw", "normalised"):
            got = [layer[scale][m] for m in ("pair", "noise", "query")]
            np.testing.assert_allclose(got, expected[layer["layer"]][scale], rtol=0, atol=1e-12)
        assert sum(layer["normalised"][m] for m in ("pair", "noise", "query")) == pytest.approx(1, abs=1e-12)
        assert (layer["lambda"] is None) == (kind == "baseline")
        if kind != "baseline":  # DIFF's raw rows sum to 1 - lambda, so raw and normalised differ
            assert abs(layer["raw"]["pair"] - layer["normalised"]["pair"]) > 1e-6


# ----------------------------------------------------------------------------------------------------
# The tool


def test_eval_mqar_attention_end_to_end(tiny_ckpts, tmp_path):
    prefix = str(tmp_path / "kv6")
    write_mqar_dataset(prefix, MQARSetting(6, 3, 2, vocab_size=512), documents=6, seed=2)
    out = tmp_path / "eval"
    proc = run_tool(
        "eval_mqar", "--load", tiny_ckpts["diff"], tiny_ckpts["transformer"], "--label", "diff-s1",
        "transformer-s1", "--data-prefix", prefix, "--attention", "--batch-size", "4", "--output-dir", out,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "attention at the answers" in proc.stdout and "diff-s1" in proc.stdout
    summary = json.loads((out / "mqar_attention.json").read_text())
    accuracy = json.loads((out / "mqar_summary.json").read_text())["results"]
    assert [r["label"] for r in summary["results"]] == ["diff-s1", "transformer-s1"]
    for result, scored in zip(summary["results"], accuracy, strict=True):
        assert result["accuracy"] == scored["accuracy"] and result["setting"] == "kv6-q3-d2"
        layers = result["layers"]
        assert [layer["layer"] for layer in layers] == list(range(len(layers))) and layers
        for layer in layers:
            assert layer["answers"] == 6 * 3
            total = sum(layer["normalised"][m] for m in ("pair", "noise", "query"))
            assert total == pytest.approx(1, abs=1e-5)
            if result["architecture"] == "Transformer":
                assert layer["lambda"] is None and layer["raw"] == layer["normalised"]
            else:
                assert layer["lambda"] is not None
                raw = sum(layer["raw"][m] for m in ("pair", "noise", "query"))
                assert raw == pytest.approx(1 - layer["lambda"], abs=1e-5)
    with open(out / "mqar_attention.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 * 2 * len(summary["results"][0]["layers"])
    assert {r["normalised"] for r in rows} == {"True", "False"}
    assert (out / "mqar_attention.png").read_bytes()[:4] == b"\x89PNG"


def test_eval_mqar_attention_needs_mqar_data(tiny_ckpts, tmp_path):
    prefix = str(tmp_path / "kv6")
    write_mqar_dataset(prefix, MQARSetting(6, 3, 0, vocab_size=512), documents=2, seed=2)
    other = str(tmp_path / "masked")
    for a, b in ((prefix, other), (loss_mask_prefix(prefix), loss_mask_prefix(other))):
        for suffix in (".bin", ".idx"):
            shutil.copy(a + suffix, b + suffix)
    proc = run_tool(
        "eval_mqar", "--load", tiny_ckpts["diff"], "--data-prefix", other, "--attention", "--output-dir",
        tmp_path / "eval",
    )  # fmt: skip
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "--attention reads MQAR data" in proc.stderr
