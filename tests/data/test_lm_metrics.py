"""Loss, perplexity, bits per byte, accuracy and z-loss on cases small enough to work out by hand."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from attnlab.data.lm_metrics import batch_sums, bits_per_byte, evaluate_lm, lm_loss, perplexity, summarize

LN2, LN3 = math.log(2), math.log(3)
# vocab 3; position 0: uniform, target 1 -> p = 1/3; position 1: logits (ln 2, 0, 0), target 0 -> p = 2/4;
# position 2 is ignored (-100)
LOGITS = torch.tensor([[[0.0, 0.0, 0.0], [LN2, 0.0, 0.0], [5.0, -5.0, 0.0]]])
TARGETS = torch.tensor([[1, 0, -100]])


def test_loss_perplexity_bits_per_byte_by_hand():
    loss = lm_loss(LOGITS, TARGETS).item()
    assert loss == pytest.approx((LN3 + LN2) / 2)  # -ln(1/3), -ln(1/2)
    assert perplexity(loss) == pytest.approx(math.sqrt(6))  # exp of the mean nats = geometric mean of 1/p
    assert bits_per_byte(loss, 1.0) == pytest.approx(math.log2(6) / 2)
    assert bits_per_byte(loss, 4.0) == pytest.approx(math.log2(6) / 8)  # 4 bytes per token
    assert perplexity(1e4) == math.inf


def test_z_loss_by_hand():
    # log Z per counted position: ln 3 and ln(2 + 1 + 1) = ln 4
    z = lm_loss(LOGITS, TARGETS, z_loss=0.01).item() - lm_loss(LOGITS, TARGETS).item()
    assert z == pytest.approx(0.01 * (LN3 ** 2 + math.log(4) ** 2) / 2, rel=1e-5)  # a float32 difference


def test_sums_and_accuracy_by_hand():
    total, count, correct = batch_sums(LOGITS, TARGETS)
    assert (count, correct) == (2, 1)  # position 1 argmax 0 = target; position 0 argmax 0 != 1
    assert total == pytest.approx(LN3 + LN2)
    out = summarize(total, count, correct, bytes_per_token=1.0)
    assert out["accuracy"] == 0.5 and out["bits_per_byte"] == pytest.approx(math.log2(6) / 2)
    assert "bits_per_byte" not in summarize(total, count, correct)


class Table(nn.Module):
    """logits = table[token]: a 'model' whose outputs are known in advance."""

    def __init__(self):
        super().__init__()
        self.table = nn.Embedding(3, 3)
        with torch.no_grad():
            self.table.weight.copy_(torch.tensor([[0.0, 0.0, 0.0], [LN2, 0.0, 0.0], [0.0, 0.0, math.log(8)]]))

    def forward(self, x):
        return self.table(x)


def test_evaluation_weighs_batches_by_their_tokens():
    """Batch 1: three counted tokens of loss ln 3; batch 2: one counted token of loss ln(10/8) (the last row's
    softmax gives 8/10 to token 2); the mean is over the four tokens, not over the two batches."""
    batches = [(torch.tensor([[0, 0, 0]]), torch.tensor([[0, 1, 2]])),
               (torch.tensor([[2, 1]]), torch.tensor([[2, -100]]))]
    model = Table().train()
    out = evaluate_lm(model, batches, bytes_per_token=2.0)
    assert out["loss"] == pytest.approx((3 * LN3 + math.log(10 / 8)) / 4)
    assert out["accuracy"] == pytest.approx(2 / 4)  # the uniform row's argmax is token 0; token 2 of the last
    assert out["bits_per_byte"] == pytest.approx(out["loss"] / (2 * LN2))
    assert model.training
