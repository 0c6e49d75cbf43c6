"""Figure 10's panels: predictions (above the score threshold) on the left, ground truth on the right."""

from __future__ import annotations

import torch

from attnlab.analysis.predictions import PALETTE, prediction_figure


def _rgb(hex_colour):
    return torch.tensor([int(hex_colour[i:i + 2], 16) for i in (1, 3, 5)], dtype=torch.uint8)


def test_prediction_beside_ground_truth():
    image = torch.zeros(3, 40, 50)
    mask = torch.zeros(1, 1, 40, 50)
    mask[0, 0, 10:20, 10:30] = 0.9
    prediction = {"boxes": torch.tensor([[10.0, 10, 30, 20], [2, 30, 8, 38]]), "labels": torch.tensor([1, 2]),
                  "scores": torch.tensor([0.9, 0.3]),  # the second is below the threshold: not drawn
                  "masks": torch.cat([mask, torch.ones(1, 1, 40, 50)])}
    target = {"boxes": torch.tensor([[5.0, 5, 45, 35]]), "labels": torch.tensor([2])}
    figure = prediction_figure(image, prediction, target, ["background", "square", "disk"], gap=4)
    assert figure.dtype == torch.uint8 and figure.shape == (3, 40, 104)
    left, spacer, right = figure[:, :, :50], figure[:, :, 50:54], figure[:, :, 54:]
    assert (spacer == 255).all()
    assert torch.equal(left[:, 10, 20], _rgb(PALETTE[1]))  # the predicted box's top edge, label 1's colour
    inside = left[:, 15, 20].int()
    assert 0 < inside.sum() < _rgb(PALETTE[1]).int().sum()  # the mask blended into the black image
    assert (left[:, 34, 5] == 0).all()  # nothing of the low-scoring detection
    assert torch.equal(right[:, 5, 25], _rgb(PALETTE[2]))  # the ground-truth box, label 2's colour
    assert (right[:, 20, 25] == 0).all()  # no ground-truth mask given: the inside stays as it was
