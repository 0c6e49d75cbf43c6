"""Latency and throughput protocols (the NS-Attn paper's: rounds, warm-up, alternating order)."""

from attnlab.bench.latency import format_latency, measure_latency, round_orders
from attnlab.bench.matched import DTYPES, Autocast, bench_variants, input_shape, matched_models, resolve_device
from attnlab.bench.throughput import measure_train_throughput

__all__ = ["DTYPES", "Autocast", "bench_variants", "input_shape", "matched_models", "resolve_device", "format_latency", "measure_latency", "measure_train_throughput", "round_orders"]
