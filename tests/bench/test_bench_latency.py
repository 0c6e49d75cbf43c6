"""measure_latency with fake modules and a virtual clock: order, statistics, overhead, eval and inference mode."""

import math

import pytest
import torch
from torch import nn

from attnlab.bench import format_latency, measure_latency, round_orders
from attnlab.errors import ConfigError


class VirtualClock:
    """Milliseconds advanced by the fake modules; read in seconds like time.perf_counter."""

    def __init__(self):
        self.ms = 0.0

    def __call__(self):
        return self.ms / 1000.0


class Fake(nn.Module):
    """Each forward logs (name, training, inference mode) and advances the clock by its cost in that round;
    warm-up forwards cost 1000 ms so that timing them by mistake shows up in the means."""

    def __init__(self, name, costs, log, clock, warmup, iters):
        super().__init__()
        self.name, self.costs, self.log, self.clock = name, costs, log, clock
        self.warmup, self.iters, self.calls = warmup, iters, 0
        self.child = nn.Linear(2, 2)

    def forward(self, x):
        self.log.append((self.name, self.training, self.child.training, torch.is_inference_mode_enabled()))
        rnd, pos = divmod(self.calls, self.warmup + self.iters)
        self.clock.ms += 1000.0 if pos < self.warmup else self.costs[rnd]
        self.calls += 1
        return x


def make(costs, warmup=2, iters=4):
    clock, log = VirtualClock(), []
    models = {name: Fake(name, c, log, clock, warmup, iters) for name, c in costs.items()}
    return models, clock, log


def blocks_of(log, size):
    """The model that made each consecutive block of `size` calls (asserting each block is one model)."""
    names = [name for name, *_ in log]
    blocks = [names[i:i + size] for i in range(0, len(names), size)]
    assert all(len(set(b)) == 1 and len(b) == size for b in blocks)
    return [b[0] for b in blocks]


def test_order_alternates_between_rounds():
    models, clock, log = make({"a": [1, 1, 1, 1], "b": [1, 1, 1, 1], "c": [1, 1, 1, 1]}, warmup=2, iters=4)
    result = measure_latency(models, torch.zeros(8, 2), warmup=2, iters=4, rounds=4, progress=False, clock=clock)
    # each model's 2 warm-up and 4 timed forwards run back to back
    assert blocks_of(log, 6) == ["a", "b", "c", "c", "b", "a", "a", "b", "c", "c", "b", "a"]
    assert result["order"] == [["a", "b", "c"], ["c", "b", "a"], ["a", "b", "c"], ["c", "b", "a"]]
    assert round_orders(["a", "b"], 3) == [["a", "b"], ["b", "a"], ["a", "b"]]


def test_statistics_and_overhead_by_hand():
    # a: 10, 12, 14 ms per forward in rounds 0-2 -> mean 12, SD = sqrt((4 + 0 + 4) / 2) = 2.
    # b: 15, 15, 18 -> mean 16, SD = sqrt((1 + 1 + 4) / 2) = sqrt(3); ratio 16/12 = 4/3, overhead +33.33%.
    models, clock, _ = make({"a": [10, 12, 14], "b": [15, 15, 18]}, warmup=2, iters=4)
    r = measure_latency(models, torch.zeros(8, 2), warmup=2, iters=4, rounds=3, progress=False, clock=clock)
    a, b = r["models"]["a"], r["models"]["b"]
    assert r["baseline"] == "a" and r["batch_size"] == 8 and r["rounds"] == 3
    assert a["round_ms"] == pytest.approx([10, 12, 14])
    assert b["round_ms"] == pytest.approx([15, 15, 18])  # indexed by round, though b runs first in round 1
    assert a["mean_ms"] == pytest.approx(12.0) and a["sd_ms"] == pytest.approx(2.0)
    assert b["mean_ms"] == pytest.approx(16.0) and b["sd_ms"] == pytest.approx(math.sqrt(3))
    assert a["ratio"] == pytest.approx(1.0) and a["overhead_pct"] == pytest.approx(0.0)
    assert b["ratio"] == pytest.approx(4 / 3) and b["overhead_pct"] == pytest.approx(100 / 3)

    table = format_latency(r)
    assert "| a (baseline) | 12.00 ± 2.00 | — | — |" in table
    assert "| b | 16.00 ± 1.73 | +33.3% | 1.333x |" in table


def test_faster_model_has_negative_overhead_and_one_round_has_no_sd():
    models, clock, _ = make({"slow": [20], "fast": [15]}, warmup=0, iters=3)
    r = measure_latency(models, torch.zeros(4, 2), warmup=0, iters=3, rounds=1, progress=False, clock=clock)
    assert r["models"]["fast"]["overhead_pct"] == pytest.approx(-25.0)
    assert r["models"]["slow"]["sd_ms"] is None
    assert "| fast | 15.00 | -25.0% | 0.750x |" in format_latency(r)


def test_eval_mode_inference_mode_and_restored_flags():
    models, clock, log = make({"a": [1, 1], "b": [1, 1]})
    models["b"].child.eval()  # mixed flags must come back exactly as they were
    measure_latency(models, torch.zeros(2, 2), warmup=2, iters=4, rounds=2, progress=False, clock=clock)
    assert log and all(not training and not child_training and inference for _, training, child_training, inference in log)
    assert models["a"].training and models["a"].child.training
    assert models["b"].training and not models["b"].child.training
    assert not torch.is_inference_mode_enabled()


def test_real_clock_smoke():
    models = {"lin": nn.Linear(4, 4), "seq": nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))}
    r = measure_latency(models, torch.randn(3, 4), warmup=1, iters=2, rounds=2, progress=False)
    for s in r["models"].values():
        assert len(s["round_ms"]) == 2 and all(t >= 0 for t in s["round_ms"])
    assert r["device"] == "cpu"


def test_errors():
    with pytest.raises(ConfigError, match="no models"):
        measure_latency({}, torch.zeros(1, 2), progress=False)
    with pytest.raises(ConfigError, match="iters"):
        measure_latency({"a": nn.Linear(2, 2)}, torch.zeros(1, 2), iters=0, progress=False)
    with pytest.raises(ConfigError, match="same device"):
        measure_latency({"a": nn.Linear(2, 2, device="meta")}, torch.zeros(1, 2), progress=False)


class FakeCuda:
    """Stands in for torch.cuda on a machine without a GPU: a current-device index that ``torch.cuda.device`` /
    ``set_device`` change, streams that belong to a device, and events that log the current device (and the
    stream's device, when one is given) at the moment they are recorded."""

    def __init__(self, monkeypatch, current=0):
        self.current, self.records, self.syncs, self.forwards = current, [], [], []
        fake = self

        def index(device):
            if device is None:
                return fake.current
            device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
            return fake.current if device.index is None else device.index

        class Stream:
            def __init__(self, device):
                self.device = torch.device("cuda", index(device))

        class Event:
            def __init__(self, enable_timing=False, **kwargs):
                self.device = None

            def record(self, stream=None):
                fake.records.append((fake.current, None if stream is None else stream.device.index))

            def synchronize(self):
                fake.syncs.append(fake.current)

            def elapsed_time(self, end):
                return 8.0

        class device:  # noqa: N801 - the name torch.cuda uses
            def __init__(self, device):
                self.index, self.saved = index(device), None

            def __enter__(self):
                self.saved, fake.current = fake.current, self.index

            def __exit__(self, *exc):
                fake.current = self.saved

        def set_device(device):
            fake.current = index(device)

        for name, value in {
            "Event": Event, "device": device, "set_device": set_device, "current_device": lambda: fake.current,
            "current_stream": lambda device=None: Stream(device), "is_available": lambda: True,
            "synchronize": lambda device=None: fake.syncs.append(index(device)),
            "get_device_name": lambda device=None: "Fake GPU",
        }.items():
            monkeypatch.setattr(torch.cuda, name, value)


class OnGpu(torch.Tensor):
    """A tensor that only claims to live on a CUDA device (no data; the fake models never read it)."""

    @staticmethod
    def __new__(cls, shape, device):
        return torch.Tensor._make_wrapper_subclass(cls, shape, device=device, dtype=torch.float32)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise AssertionError(f"the latency protocol must not compute on the inputs ({func})")


class LogsCurrentDevice(nn.Module):
    def __init__(self, fake, params=()):
        super().__init__()
        self.fake, self.params = fake, list(params)

    def parameters(self, recurse=True):
        return iter(self.params)

    def forward(self, x):
        self.fake.forwards.append(self.fake.current)
        return x


def test_cuda_events_and_syncs_follow_the_inputs_device(monkeypatch):
    """`bench --device cuda:1`: events recorded while cuda:0 is current would time cuda:0's idle stream."""
    fake = FakeCuda(monkeypatch, current=0)
    models = {"a": LogsCurrentDevice(fake), "b": LogsCurrentDevice(fake)}
    r = measure_latency(models, OnGpu((4, 3), "cuda:1"), warmup=1, iters=2, rounds=2, progress=False)
    assert len(fake.records) == 2 * 2 * 2  # a start and an end event per model per round
    for current, stream_device in fake.records:
        assert current == 1 and stream_device in (None, 1), fake.records
    assert fake.syncs and set(fake.syncs) == {1}
    assert set(fake.forwards) == {1} and len(fake.forwards) == 2 * 2 * 3
    assert fake.current == 0  # the caller's current device is restored
    assert r["device"] == "cuda:1 (Fake GPU)" and r["models"]["b"]["mean_ms"] == pytest.approx(4.0)


def test_models_on_another_gpu_than_the_inputs_are_refused(monkeypatch):
    fake = FakeCuda(monkeypatch)
    on_cuda0 = LogsCurrentDevice(fake, params=[OnGpu((2,), "cuda:0")])
    with pytest.raises(ConfigError, match="cuda:0 but the inputs are on cuda:1"):
        measure_latency({"a": on_cuda0}, OnGpu((4, 3), "cuda:1"), progress=False)
    assert not fake.forwards


def test_cli_refuses_a_gpu_the_machine_lacks_in_one_line(monkeypatch, capsys):
    from attnlab.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    args = ["bench", "--model", "vit_digits", "--attn", "standard", "--warmup", "0", "--iters", "1", "--rounds", "1"]
    assert main([*args, "--device", "cuda:2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "2 CUDA device(s); use cuda:0 to cuda:1" in err[0]
