"""The training step does not wait on the host (issue 11 item 3): the only host reads of device values in an epoch
are at the log points, a non-finite loss is still caught there and named by its step, and evaluate's padded last
batch gives the same metrics with one batch shape."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from attnlab.errors import NonFiniteLossError
from attnlab.train.loop import train_one_epoch
from attnlab.train.tasks.classify import classification_stats, classification_step, evaluate
from attnlab.train.optim import build_optimizer, build_scheduler


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(12, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 3))
        self.poison_at = None  # training forward number whose output becomes NaN
        self.calls = 0

    def forward(self, x):
        out = self.net(x)
        if self.training:
            self.calls += 1
            if self.calls == self.poison_at:
                out = out * float("nan")
        return out


def _batches(n: int, batch: int = 8):
    g = torch.Generator().manual_seed(1)
    for _ in range(n):
        x = torch.randn(batch, 3, 2, 2, generator=g)
        y = torch.randint(0, 3, (batch,), generator=g)
        yield x, y, y


def _epoch(model, steps, log_every, on_step=None, clip_grad=1.0):
    optimizer = build_optimizer(model, 1e-2, 0.05)
    scheduler = build_scheduler(optimizer, total_steps=steps, warmup_steps=0, warmup_lr=1e-3, min_lr=1e-4)
    sums, updates = train_one_epoch(
        model, _batches(steps), optimizer, scheduler, classification_step(nn.CrossEntropyLoss(label_smoothing=0.1)),
        steps=steps, device=torch.device("cpu"), amp_dtype=None, epoch=1, epochs=1, num_updates=0,
        clip_grad=clip_grad, log_every=log_every, progress=False, on_step=on_step)
    return classification_stats(sums, sums["seconds"]), updates


@pytest.fixture
def host_reads(monkeypatch):
    """Steps completed (per the on_step counter) at each read of a tensor's value on the host."""
    done, reads = [0], []
    for name in ("item", "tolist", "__bool__", "__float__", "__int__", "__index__"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, **kwargs):
            reads.append(done[0])
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, counted)

    def on_step(step):
        done[0] = step
    return on_step, reads


def test_host_reads_only_at_log_points(host_reads):
    on_step, reads = host_reads
    stats, updates = _epoch(Tiny(), steps=12, log_every=5, on_step=on_step)
    assert updates == 12
    assert reads and set(reads) <= {5, 10, 12}  # the old loop read loss.item() after every forward
    # what the step accumulated on the device is what the batches give (a float64 sum over the same batches)
    model = Tiny()
    optimizer = build_optimizer(model, 1e-2, 0.05)
    scheduler = build_scheduler(optimizer, total_steps=12, warmup_steps=0, warmup_lr=1e-3, min_lr=1e-4)
    loss_sum, correct, seen = 0.0, 0, 0
    for num, (x, _, y) in enumerate(_batches(12), 1):
        logits = model(x)
        loss = nn.functional.cross_entropy(logits, y, label_smoothing=0.1)
        loss_sum += float(loss.detach()) * len(y)
        correct += int((logits.argmax(-1) == y).sum())
        seen += len(y)
        optimizer.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step_update(num)
    assert stats["train_loss"] == pytest.approx(loss_sum / seen, rel=1e-6)
    assert stats["train_acc"] == pytest.approx(100.0 * correct / seen)


def test_non_finite_loss_named_by_its_step_and_window():
    model = Tiny()
    model.poison_at = 3
    with pytest.raises(NonFiniteLossError) as info:
        _epoch(model, steps=12, log_every=5)
    msg = str(info.value)
    assert "epoch 1 step 3 " in msg and "nan" in msg and "after step 5" in msg
    assert model.calls == 5  # the steps ran on until the check, none after it
    # a NaN at the last step of an epoch that is no log point is caught by the epoch-end check
    model = Tiny()
    model.poison_at = 12
    with pytest.raises(NonFiniteLossError, match="step 12 .*after step 12"):
        _epoch(model, steps=12, log_every=5)


def test_evaluate_pads_the_last_batch_to_one_shape():
    model = Tiny().eval()
    g = torch.Generator().manual_seed(2)
    data = [(torch.randn(8, 3, 2, 2, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(2)]
    data.append((torch.randn(5, 3, 2, 2, generator=g), torch.randint(0, 3, (5,), generator=g)))
    shapes = []
    model.register_forward_pre_hook(lambda m, args: shapes.append(tuple(args[0].shape)))
    plain = evaluate(model, data, device=torch.device("cpu"), amp_dtype=None, num_classes=3)
    assert shapes[-1][0] == 5
    shapes.clear()
    padded = evaluate(model, data, device=torch.device("cpu"), amp_dtype=None, num_classes=3, pad_to=8)
    assert set(shapes) == {(8, 3, 2, 2)}
    assert padded == pytest.approx(plain, rel=1e-6)
    # the metrics from their definition, in float64
    x = torch.cat([d[0] for d in data]).double()
    y = torch.cat([d[1] for d in data])
    logits = model.double()(x)
    top = logits.topk(3, dim=-1).indices
    assert padded["test_loss"] == pytest.approx(float(nn.functional.cross_entropy(logits, y)), rel=1e-5)
    assert padded["top1"] == pytest.approx(100.0 * float((top[:, 0] == y).double().mean()))
    assert padded["top5"] == pytest.approx(100.0)  # 3 classes: the top 3 always hold the label


def test_cuda_graph_steps_are_marked(monkeypatch):
    # CUDA graphs (mode reduce-overhead) overwrite a replay's outputs at the next one unless each step is marked
    from attnlab.train.run import compile_mode

    marks = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    model = Tiny()
    optimizer = build_optimizer(model, 1e-2, 0.05)
    scheduler = build_scheduler(optimizer, total_steps=4, warmup_steps=0, warmup_lr=1e-3, min_lr=1e-4)
    train_one_epoch(model, _batches(4), optimizer, scheduler, classification_step(nn.CrossEntropyLoss()), steps=4,
                    device=torch.device("cpu"), amp_dtype=None, epoch=1, epochs=1, num_updates=0, clip_grad=None,
                    log_every=2, progress=False, cudagraphs=True)
    assert len(marks) == 4
    assert compile_mode("auto", torch.device("cuda")) == "reduce-overhead"
    assert compile_mode("auto", torch.device("cpu")) == "default"
    assert compile_mode("max-autotune", torch.device("cpu")) == "max-autotune"


def test_clip_reads_the_optimizer_tensors_only():
    """A frozen tensor that still holds a gradient from elsewhere (the vlm demo's encoder warm-up left one) does
    not change the clipped step: the total norm is over the tensors the optimizer updates (issue 47's resume)."""
    def trained(stale: bool):
        model = Tiny()
        model.frozen = nn.Linear(2, 2)
        model.frozen.requires_grad_(False)
        if stale:
            model.frozen.weight.grad = torch.full((2, 2), 1e3)
        _epoch(model, 3, log_every=3, clip_grad=0.1)
        return model.net.state_dict()

    clean, stale = trained(False), trained(True)
    assert all(torch.equal(clean[k], stale[k]) for k in clean)
