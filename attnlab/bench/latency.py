"""Forward latency with the NS-Attn paper's protocol (Section 3.5), shared by every method.

Protocol: models in evaluation mode under ``torch.inference_mode()``, inputs already on the device; ``rounds``
rounds, each running every model ``warmup`` untimed then ``iters`` timed forwards; the order of the models is
reversed every other round (round 0: a, b; round 1: b, a; ...) so that drift (clocks, temperature) does not favour
whichever model runs first. Timing uses synchronised CUDA events on GPU and ``time.perf_counter`` on CPU. On a GPU
the inputs' device is made the current device for the whole measurement, and the events are recorded on its
current stream, so ``cuda:1`` is timed on ``cuda:1`` (events default to the current device, usually ``cuda:0``).

For model m with round means t_{m,1..R} (ms per batch, each the elapsed time of one round's ``iters`` forwards
divided by ``iters``):

    mean_ms = (1/R) sum_r t_{m,r}                  (= the mean over all R * iters timed forwards)
    sd_ms   = sqrt( sum_r (t_{m,r} - mean_ms)^2 / (R - 1) )     sample SD across round means; None if R < 2
    ratio   = mean_ms(m) / mean_ms(baseline)       baseline = the first model
    overhead_pct = 100 * (ratio - 1)
"""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import Callable

import torch
from torch import nn

from attnlab.errors import ConfigError


def round_orders(names: list[str], rounds: int) -> list[list[str]]:
    """The order the models run in, per round: as given in even rounds, reversed in odd rounds."""
    return [list(names) if r % 2 == 0 else list(reversed(names)) for r in range(rounds)]


def _check_counts(**counts: int) -> None:
    for key, value in counts.items():
        minimum = 0 if key == "warmup" else 1
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise ConfigError(f"{key}={value!r} is invalid; it must be an integer >= {minimum}.")


def _check_device(name: str, model: nn.Module, device: torch.device) -> None:
    param = next(model.parameters(), None)
    if param is not None and param.device != device:
        raise ConfigError(
            f"model '{name}' has its parameters on {param.device} but the inputs are on {device}; "
            "move the models and the inputs to the same device first."
        )


class _Stopwatch:
    """Elapsed milliseconds of a block of work: CUDA events on GPU, a host clock otherwise (or when injected)."""

    def __init__(self, device: torch.device, clock: Callable[[], float] | None):
        self.cuda = device.type == "cuda" and clock is None
        self.device = device
        self.clock = clock or time.perf_counter

    def start(self) -> None:
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._end = torch.cuda.Event(enable_timing=True)
            self._start.record(torch.cuda.current_stream(self.device))
        else:
            _sync(self.device)
            self._t0 = self.clock()

    def stop(self) -> float:
        if self.cuda:
            self._end.record(torch.cuda.current_stream(self.device))
            self._end.synchronize()
            return float(self._start.elapsed_time(self._end))
        _sync(self.device)
        return (self.clock() - self._t0) * 1000.0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _on_device(device: torch.device):
    """``device`` as the current CUDA device: what kernels launched without a tensor argument (Triton's) use."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def measure_latency(models: dict[str, nn.Module], inputs: torch.Tensor, *, warmup: int = 50, iters: int = 200,
                    rounds: int = 3, progress: bool = True, clock: Callable[[], float] | None = None) -> dict:
    """Forward latency of each model on one batch, with the paper's rounds, warm-up and alternating order.

    Args:
        models: name -> module; the first is the baseline for overhead and ratio. Each is run in eval mode
            (its modules' train/eval flags are restored afterwards).
        inputs: one batch, already on the models' device (host-to-device transfer is not timed).
        warmup: untimed forwards per model per round.
        iters: timed forwards per model per round.
        rounds: number of rounds; the model order is reversed in every odd round.
        progress: show a progress bar on stderr.
        clock: a host clock returning seconds (default ``time.perf_counter``); injecting one also replaces the
            CUDA events on GPU (with explicit synchronisation), mainly for tests.

    Returns:
        ``{"device", "batch_size", "warmup", "iters", "rounds", "baseline", "order": [[names] per round],
        "models": {name: {"mean_ms", "sd_ms", "round_ms": [per round], "ratio", "overhead_pct"}}}``,
        ``round_ms`` indexed by round (not by position within the round).

    Raises:
        ConfigError: no models, counts out of range, or models and inputs on different devices.
    """
    if not models:
        raise ConfigError("measure_latency got no models; pass a dict of name -> module with at least one entry.")
    _check_counts(warmup=warmup, iters=iters, rounds=rounds)
    names = list(models)
    device = inputs.device
    for name in names:
        _check_device(name, models[name], device)

    from tqdm.auto import tqdm

    orders = round_orders(names, rounds)
    round_ms: dict[str, list[float]] = {name: [] for name in names}
    saved_flags = {name: [m.training for m in model.modules()] for name, model in models.items()}
    watch = _Stopwatch(device, clock)
    bar = tqdm(total=rounds * len(names), desc="latency", disable=not progress, leave=False)
    try:
        for model in models.values():
            model.eval()
        with _on_device(device), torch.inference_mode():
            for r, order in enumerate(orders):
                for name in order:
                    model = models[name]
                    bar.set_postfix_str(f"round {r + 1}/{rounds} {name}")
                    for _ in range(warmup):
                        model(inputs)
                    _sync(device)
                    watch.start()
                    for _ in range(iters):
                        model(inputs)
                    round_ms[name].append(watch.stop() / iters)
                    bar.update(1)
    finally:
        bar.close()
        for name, model in models.items():
            for module, flag in zip(model.modules(), saved_flags[name]):
                module.training = flag

    stats = {}
    base_mean = statistics.fmean(round_ms[names[0]])
    for name in names:
        mean = statistics.fmean(round_ms[name])
        ratio = mean / base_mean if base_mean > 0 else float("nan")
        stats[name] = {
            "mean_ms": mean,
            "sd_ms": statistics.stdev(round_ms[name]) if rounds >= 2 else None,
            "round_ms": round_ms[name],
            "ratio": ratio,
            "overhead_pct": 100.0 * (ratio - 1.0),
        }
    return {
        "device": str(device) if device.type != "cuda" else f"{device} ({torch.cuda.get_device_name(device)})",
        "batch_size": int(inputs.shape[0]) if inputs.dim() > 0 else 1,
        "warmup": warmup,
        "iters": iters,
        "rounds": rounds,
        "baseline": names[0],
        "order": orders,
        "models": stats,
    }


def format_latency(result: dict) -> str:
    """A Markdown table like the paper's Table 3: ms/batch as mean ± sample SD across round means, overhead %.

    The overhead has one decimal and a sign (``+41.0%``); the baseline row shows an em dash.
    """
    base = result["baseline"]
    lines = [
        f"Forward latency on {result['device']}, batch {result['batch_size']}: {result['rounds']} rounds of "
        f"{result['warmup']} warm-up + {result['iters']} timed forwards, order alternating; "
        "± is the sample SD across round means.",
        "",
        "| Model | ms/batch (mean ± SD) | Overhead | Ratio |",
        "|---|---:|---:|---:|",
    ]
    for name, s in result["models"].items():
        ms = f"{s['mean_ms']:.2f}" if s["sd_ms"] is None else f"{s['mean_ms']:.2f} ± {s['sd_ms']:.2f}"
        overhead = "—" if name == base else f"{s['overhead_pct']:+.1f}%"
        ratio = "—" if name == base else f"{s['ratio']:.3f}x"
        label = f"{name} (baseline)" if name == base else name
        lines.append(f"| {label} | {ms} | {overhead} | {ratio} |")
    return "\n".join(lines) + "\n"
