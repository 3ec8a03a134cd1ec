"""Binary metrics against hand-computed values and brute force; throughput warm-up."""

import math

import numpy as np
import pytest
import torch

from hybridrec.metrics import (
    BinaryMetrics,
    RunningLoss,
    Throughput,
    accuracy,
    auc,
    calibration,
    log_loss,
    normalized_entropy,
)
from hybridrec.metrics import throughput as throughput_mod


def brute_force_auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """O(n²) pair count: a positive above a negative counts 1, a tie 1/2."""
    pos, neg = scores[labels == 1], scores[labels == 0]
    diff = pos[:, None] - neg[None, :]
    return float(((diff > 0).sum() + 0.5 * (diff == 0).sum()) / (pos.size * neg.size))


@pytest.mark.parametrize(
    ("labels", "scores", "expected"),
    [
        ([0, 0, 1, 1], [0.1, 0.4, 0.35, 0.8], 0.75),  # 3 of 4 pairs ordered
        ([0, 1], [0.2, 0.9], 1.0),
        ([1, 0], [0.2, 0.9], 0.0),
        ([0, 1, 0, 1], [0.5, 0.5, 0.5, 0.5], 0.5),  # all tied
        ([0, 1, 1], [0.3, 0.3, 0.7], 0.75),  # (1/2 + 1) / 2
        ([0, 0, 1], [0.1, 0.5, 0.5], 0.75),  # (1 + 1/2) / 2
        ([1, 0, 1, 0], [0.1, 0.4, 0.5, 0.8], 0.25),  # 1 of 4 pairs ordered
    ],
)
def test_auc_hand_cases(labels, scores, expected):
    assert auc(labels, scores) == pytest.approx(expected, abs=1e-12)


def test_auc_matches_brute_force_with_many_ties():
    gen = np.random.default_rng(0)
    for n in (2, 7, 100, 1000):
        labels = gen.integers(0, 2, n)
        labels[0], labels[1] = 0, 1  # both classes present
        scores = gen.integers(0, 5, n).astype(np.float64)  # few distinct values → many ties
        assert auc(labels, scores) == pytest.approx(brute_force_auc(labels, scores), abs=1e-12)


def test_auc_accepts_tensors_and_is_invariant_to_monotone_maps():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(500, generator=gen)
    labels = (torch.rand(500, generator=gen) < torch.sigmoid(logits)).float()
    assert auc(labels, logits) == pytest.approx(auc(labels, torch.sigmoid(logits)), abs=1e-12)


def test_auc_one_class_and_empty_are_nan():
    assert math.isnan(auc([1, 1, 1], [0.1, 0.2, 0.3]))
    assert math.isnan(auc([0, 0], [0.1, 0.2]))
    assert math.isnan(auc([], []))
    assert math.isnan(auc([0, 1], [0.1, float("nan")]))


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="labels"):
        auc([0, 2], [0.1, 0.2])
    with pytest.raises(ValueError, match="3"):
        log_loss([0, 1, 1], [0.1, 0.2])


def test_log_loss_ne_calibration_accuracy_tiny_case():
    labels, probs = [1, 0], [0.8, 0.3]
    ll = -(math.log(0.8) + math.log(0.7)) / 2  # 0.289909...
    assert log_loss(labels, probs) == pytest.approx(ll, rel=1e-12)
    assert normalized_entropy(labels, probs) == pytest.approx(ll / math.log(2), rel=1e-12)
    assert calibration(labels, probs) == pytest.approx(0.55 / 0.5, rel=1e-12)
    assert accuracy(labels, probs) == 1.0
    assert accuracy(labels, probs, threshold=0.9) == 0.5


def test_ne_uses_base_rate_entropy():
    labels, probs = [1, 0, 0, 0], [0.6, 0.2, 0.1, 0.4]
    ll = -(math.log(0.6) + math.log(0.8) + math.log(0.9) + math.log(0.6)) / 4
    h = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert normalized_entropy(labels, probs) == pytest.approx(ll / h, rel=1e-12)
    # Predicting the base rate everywhere gives NE = 1.
    assert normalized_entropy(labels, [0.25] * 4) == pytest.approx(1.0, rel=1e-12)


def test_log_loss_clips_and_undefined_cases():
    assert log_loss([1], [0.0]) == pytest.approx(-math.log(1e-7), rel=1e-9)
    assert math.isnan(normalized_entropy([1, 1], [0.5, 0.5]))
    assert math.isnan(calibration([0, 0], [0.5, 0.5]))
    assert math.isnan(log_loss([], []))


def test_binary_metrics_parts_merge_to_whole():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(300, generator=gen)
    labels = (torch.rand(300, generator=gen) < 0.3).float()
    whole = BinaryMetrics()
    parts = [BinaryMetrics() for _ in range(3)]
    for i, (lg, lb) in enumerate(zip(logits.split(50), labels.split(50))):
        whole.update(lg.unsqueeze(1), lb)  # [b, 1] logits are accepted
        parts[i % 3].update(lg, lb)
    expected = whole.compute()
    merged = BinaryMetrics.from_parts([p.state() for p in parts]).compute()
    assert merged == pytest.approx(expected, abs=1e-12)
    assert expected["count"] == 300
    assert expected["ctr"] == pytest.approx(labels.mean().item())
    probs = torch.sigmoid(logits).double()
    assert expected["auc"] == pytest.approx(auc(labels, logits), abs=1e-12)
    assert expected["log_loss"] == pytest.approx(log_loss(labels, probs), abs=1e-6)
    assert set(expected) == {"auc", "log_loss", "ne", "calibration", "accuracy", "ctr", "count"}


def test_binary_metrics_one_class_empty_and_reset():
    m = BinaryMetrics()
    assert m.compute()["count"] == 0 and math.isnan(m.compute()["auc"])
    m.update(torch.tensor([0.5, -1.0]), torch.tensor([1, 1]))
    out = m.compute()
    assert math.isnan(out["auc"]) and math.isnan(out["ne"])
    assert out["accuracy"] == 0.5 and out["ctr"] == 1.0
    with pytest.raises(ValueError):
        m.update(torch.zeros(3), torch.zeros(2))
    m.reset()
    assert m.count == 0


def test_running_loss_window_and_ema():
    r = RunningLoss(ema_decay=0.5)
    for v in (1.0, 2.0, 3.0):
        r.update(torch.tensor(v))
    out = r.compute()
    assert out["loss"] == pytest.approx(2.0)
    # EMA (zero start) = 0.5*(0.5*(0.5*1)+0.5*2)... bias-corrected by 1 - 0.5**3.
    raw = ((0.5 * 1.0) * 0.5 + 0.5 * 2.0) * 0.5 + 0.5 * 3.0
    assert out["loss_ema"] == pytest.approx(raw / (1 - 0.5**3))
    assert math.isnan(r.compute()["loss"])  # window was reset; EMA carries on
    r.update(torch.tensor([4.0]))
    assert r.compute()["loss"] == pytest.approx(4.0)
    r.reset()
    assert math.isnan(r.compute()["loss_ema"])


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_throughput_excludes_warmup(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(throughput_mod.time, "perf_counter", clock)
    t = Throughput(warmup=2, window=2)
    with pytest.raises(RuntimeError):
        t.step(1)
    t.start()
    for seconds in (10.0, 5.0):  # slow warm-up steps, excluded
        clock.now += seconds
        t.step(100)
    assert math.isnan(t.samples_per_sec()) and t.measured_steps == 0
    for seconds, n in ((1.0, 100), (2.0, 100), (1.0, 300)):
        clock.now += seconds
        t.step(n)
    assert t.overall_samples_per_sec() == pytest.approx(500 / 4.0)
    assert t.samples_per_sec() == pytest.approx(400 / 3.0)  # last two steps only
    assert t.summary()["measured_steps"] == 3 and t.steps == 5
