"""measure_train_throughput with a virtual clock: img/s arithmetic, full training steps, autocast."""

import pytest
import torch
from torch import nn

from attnlab.bench import measure_train_throughput
from attnlab.errors import ConfigError


class Clocked(nn.Module):
    """A linear classifier whose forward advances a virtual clock by 0.5 s and logs the autocast state."""

    def __init__(self, clock):
        super().__init__()
        self.fc = nn.Linear(6, 3)
        self.clock = clock
        self.log = []

    def forward(self, x):
        self.log.append((self.training, torch.is_autocast_enabled("cpu")))
        self.clock[0] += 0.5
        return self.fc(x)


class CountingAdamW(torch.optim.AdamW):
    steps = 0

    def step(self, closure=None):
        CountingAdamW.steps += 1
        return super().step(closure)


def test_images_per_second_by_hand():
    # 2 warm-up + 4 timed steps, 0.5 s each, batch 8: timed span 4 * 0.5 = 2 s -> 8 * 4 / 2 = 16 img/s.
    clock = [0.0]
    model = Clocked(clock).eval()
    before = model.fc.weight.detach().clone()
    CountingAdamW.steps = 0
    made = []

    def factory(params):
        made.append(1)
        return CountingAdamW(params, lr=1e-2)

    batch = (torch.randn(8, 6), torch.randint(0, 3, (8,)))
    ips = measure_train_throughput(model, batch, steps=4, warmup=2, optimizer_factory=factory, clock=lambda: clock[0])
    assert ips == pytest.approx(16.0)
    assert made == [1] and CountingAdamW.steps == 6
    assert len(model.log) == 6 and all(training for training, _ in model.log)
    assert not torch.equal(model.fc.weight, before)  # the optimizer stepped


def test_soft_targets_and_bf16_autocast():
    clock = [0.0]
    model = Clocked(clock)
    soft = torch.softmax(torch.randn(4, 3), dim=-1)  # Mixup-style soft labels
    ips = measure_train_throughput(model, (torch.randn(4, 6), soft), steps=2, warmup=0, amp_dtype=torch.bfloat16,
                                   clock=lambda: clock[0])
    assert ips == pytest.approx(4 * 2 / 1.0)
    assert all(autocast for _, autocast in model.log)


def test_default_optimizer_real_clock_and_errors():
    model = nn.Linear(6, 3)
    before = model.weight.detach().clone()
    ips = measure_train_throughput(model, (torch.randn(4, 6), torch.randint(0, 3, (4,))), steps=2, warmup=1)
    assert ips > 0 and not torch.equal(model.weight, before)
    with pytest.raises(ConfigError, match="steps"):
        measure_train_throughput(model, (torch.randn(4, 6), torch.zeros(4, dtype=torch.long)), steps=0, warmup=0)
