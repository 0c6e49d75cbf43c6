"""Video metrics worked by hand: top-1, top-k, mean class accuracy (Toyota Smarthome's), multi-view averaging."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from attnlab.data.video_metrics import (average_views, evaluate_video, mean_class_accuracy, topk_accuracy,
                                        video_metrics)
from attnlab.errors import ConfigError

SCORES = torch.tensor([[0.1, 0.7, 0.2],   # predicts 1, label 1: right
                       [0.5, 0.3, 0.2],   # predicts 0, label 1: wrong (1 is second)
                       [0.2, 0.3, 0.5],   # predicts 2, label 2: right
                       [0.6, 0.3, 0.1]])  # predicts 0, label 0: right
LABELS = torch.tensor([1, 1, 2, 0])


def test_topk_and_mean_class_accuracy_by_hand():
    assert topk_accuracy(SCORES, LABELS, 1) == 0.75
    assert topk_accuracy(SCORES, LABELS, 2) == 1.0
    assert topk_accuracy(SCORES, LABELS, 5) == 1.0  # k above the class count: every class
    # class 0: 1/1, class 1: 1/2, class 2: 1/1 -> (1 + 0.5 + 1) / 3, where top-1 weighs class 1 double
    assert mean_class_accuracy(SCORES, LABELS) == pytest.approx(2.5 / 3)
    # a class with no clip does not count: only classes 1 and 2 present -> (0.5 + 1) / 2
    assert mean_class_accuracy(SCORES[:3], LABELS[:3]) == pytest.approx(0.75)


def test_views_average_probabilities_not_logits():
    logits = torch.tensor([[[0.0, 0.0], [math.log(3.0), 0.0]]])  # view 1: (1/2, 1/2), view 2: (3/4, 1/4)
    torch.testing.assert_close(average_views(logits), torch.tensor([[0.625, 0.375]]))
    m = video_metrics(average_views(logits), torch.tensor([1]))
    assert m["top1"] == 0.0 and m["test_loss"] == pytest.approx(-math.log(0.375))
    one = torch.tensor([[2.0, -1.0, 0.5], [0.0, 1.0, 3.0]])
    loss = video_metrics(average_views(one), torch.tensor([0, 1]))["test_loss"]
    assert loss == pytest.approx(float(nn.functional.cross_entropy(one, torch.tensor([0, 1]))), rel=1e-6)


class _Mean(nn.Module):
    """logits (v, -v) with v the clip's mean value."""

    def forward(self, x):
        v = x.mean(dim=(1, 2, 3, 4))
        return torch.stack([v, -v], dim=1)


def test_evaluate_runs_every_view_and_reports_per_cent():
    clips = torch.zeros(2, 2, 1, 1, 1, 1)  # 2 clips, 2 views each
    clips[0, 0], clips[0, 1] = 1.0, 3.0     # both views say class 0
    clips[1, 0], clips[1, 1] = 2.0, -4.0    # one view each way; the sharper view (class 1) wins the average
    loader = [(clips, torch.tensor([0, 1]))]
    model = _Mean().train()
    result = evaluate_video(model, loader)
    assert result["top1"] == 100.0 and result["mean_class_accuracy"] == 100.0 and model.training
    single = [(clips[:, 0], torch.tensor([0, 1]))]  # the first views alone: clip 1 is called class 0
    assert evaluate_video(model, single)["top1"] == 50.0


def test_bad_shapes_are_errors():
    with pytest.raises(ConfigError, match="one label per row"):
        topk_accuracy(SCORES, LABELS[:2])
    with pytest.raises(ConfigError, match="0..2"):
        mean_class_accuracy(SCORES, torch.tensor([0, 1, 2, 3]))
