"""The evaluation metrics against examples worked by hand (numbers in the comments), and attnlab.analysis.evaluation's
evaluate() against the same formulas on a model whose logits the test knows."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from attnlab.analysis.evaluation import (anomaly_score, aurra, auroc, classification_metrics, evaluate,
                                         rms_calibration_error)
from attnlab.errors import ConfigError


def test_rms_calibration_error_by_hand():
    # sorted by confidence: (.6, 1) (.7, 0) | (.8, 0) (.9, 1); bins of 2:
    # bin 1: mean conf .65, accuracy .5, gap .15; bin 2: .85, .5, gap .35 -> sqrt(.5 * .0225 + .5 * .1225)
    conf, correct = [0.9, 0.8, 0.6, 0.7], [1, 0, 1, 0]
    assert rms_calibration_error(conf, correct, bin_size=2) == pytest.approx(math.sqrt(0.0725))
    # Hendrycks' released loop leaves the last bin out: sqrt(.5 * .0225)
    assert rms_calibration_error(conf, correct, bin_size=2, drop_last_bin=True) == pytest.approx(math.sqrt(0.01125))


def test_rms_calibration_error_last_bin_takes_the_remainder():
    # 5 examples, bins of 2 -> [0, 2) and [2, 5): gaps .15 (weight 2/5) and .6 (3/5) -> sqrt(.009 + .216)
    conf, correct = [0.5, 0.1, 0.4, 0.2, 0.3], [1, 0, 1, 0, 1]
    assert rms_calibration_error(conf, correct, bin_size=2) == pytest.approx(math.sqrt(0.225))
    # fewer examples than one bin: one bin, |mean conf - accuracy| = |.3 - .6|
    assert rms_calibration_error(conf, correct) == pytest.approx(0.3)
    # perfectly calibrated bins give 0
    assert rms_calibration_error([0.5] * 4, [1, 0, 1, 0], bin_size=2) == pytest.approx(0.0)


def test_aurra_by_hand():
    # most confident first: correct 1, 0, 1, 1 -> accuracies 1, 1/2, 2/3, 3/4 at response rates 1/4 .. 1
    assert aurra([0.6, 0.9, 0.7, 0.8], [1, 1, 1, 0]) == pytest.approx((1 + 1 / 2 + 2 / 3 + 3 / 4) / 4)
    assert aurra([0.9, 0.1], [0, 1]) == pytest.approx((0 + 1 / 2) / 2)


def test_auroc_is_the_rank_statistic():
    # out .8 beats all three in-scores (3); out .4 beats .1 and .35 and ties .4 (2.5) -> 5.5 / 6
    assert auroc([0.1, 0.4, 0.35], [0.8, 0.4]) == pytest.approx(5.5 / 6)
    assert auroc([0.1, 0.2], [0.3, 0.4]) == 1.0
    assert auroc([0.3, 0.4], [0.1, 0.2]) == 0.0
    assert auroc([0.5], [0.5]) == 0.5


def test_auroc_with_the_anomaly_score_of_logits():
    # in: confident (max prob near 1); out: flat logits (max prob 1/3) -> every out example more anomalous
    logits_in = torch.tensor([[5.0, 0.0, 0.0], [0.0, 6.0, 0.0]])
    logits_out = torch.tensor([[0.0, 0.0, 0.0], [0.1, 0.0, 0.0]])
    torch.testing.assert_close(anomaly_score(logits_out)[0], torch.tensor(-1 / 3, dtype=torch.float64))
    assert auroc(anomaly_score(logits_in), anomaly_score(logits_out)) == 1.0


def test_classification_metrics_by_hand():
    # 3 examples, 6 classes; example 0 right, 1 wrong but in top-5, 2 wrong and last
    logits = torch.tensor([[3.0, 0, 0, 0, 0, 0],
                           [0, 2.0, 1.0, 0, 0, 0],
                           [0, 5.0, 4.0, 3.0, 2.0, 1.0]])
    labels = torch.tensor([0, 2, 0])
    m = classification_metrics(logits, labels)
    assert m["n"] == 3
    assert m["top1"] == pytest.approx(100 / 3) and m["top5"] == pytest.approx(200 / 3)
    logp = logits.double().log_softmax(-1)
    assert m["loss"] == pytest.approx(-float(logp[0, 0] + logp[1, 2] + logp[2, 0]) / 3)
    conf = logits.double().softmax(-1).max(-1).values
    correct = torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64)
    assert m["rms_calibration_error"] == pytest.approx(100 * abs(float(conf.mean()) - 1 / 3))  # one bin
    # AURRA: accuracy of the k most confident, averaged over k
    order = conf.argsort(descending=True)
    acc = torch.cumsum(correct[order], 0) / torch.arange(1, 4)
    assert m["aurra"] == pytest.approx(100 * float(acc.mean()))


class Known(nn.Module):
    """Logits = the first C pixels of the flattened image."""

    def __init__(self, c: int):
        super().__init__()
        self.c = c

    def forward(self, x):
        return x.flatten(1)[:, : self.c]


def test_evaluate_reports_the_formulas_with_noise_and_ood():
    g = torch.Generator().manual_seed(0)
    images = torch.randn(30, 1, 3, 3, generator=g)
    data = [(images[i], i % 6) for i in range(30)]
    ood = [(torch.zeros(1, 3, 3), 0) for _ in range(7)]  # flat logits: max prob 1/6, the most anomalous
    model = Known(6)
    r = evaluate(model, data, ood=ood, batch_size=8)
    expected = classification_metrics(images.flatten(1)[:, :6], torch.tensor([i % 6 for i in range(30)]))
    for key, value in expected.items():
        assert r[key] == pytest.approx(value)
    assert r["ood_n"] == 7 and r["auroc"] == pytest.approx(100.0)
    noisy = evaluate(model, data, noise_std=0.5, batch_size=8)
    assert noisy["noise_std"] == 0.5 and noisy["loss"] != pytest.approx(r["loss"])
    assert evaluate(model, data, noise_std=0.5, batch_size=8) == noisy  # seeded: the same draw each time
    with pytest.raises(ConfigError, match="noise std -1"):
        evaluate(model, data, noise_std=-1)
    with pytest.raises(ConfigError, match="labels run to 5 but the model gives 4 classes"):
        evaluate(Known(4), data)
