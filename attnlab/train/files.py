"""The names of a run directory's files, named once for every reader and writer (no torch: the command line's
argument checks read them too); docs/training.md, "Run directory", says what each holds."""

from __future__ import annotations

import json
from pathlib import Path

from attnlab.errors import ConfigError

CONFIG = "config.yaml"
METRICS = "metrics.jsonl"
RESULT = "result.json"
WEIGHTS = "checkpoint.safetensors"
STATE = "trainer_state.pt"
PREV_WEIGHTS = "checkpoint.prev.safetensors"
PREV_STATE = "trainer_state.prev.pt"
EMA_WEIGHTS = "ema.safetensors"
TB_DIR = "tensorboard"
TOKENIZER = "tokenizer.json"  # a text run's copy of its tokenizer, read by eval and sample
DATA = "data.json"  # what the run trained on (registry.data_fingerprint), compared on resume, eval and sample


def read_jsonl(path: str | Path) -> list[dict]:
    """The JSON objects of a metrics.jsonl, one per line (blank lines skipped); ConfigError naming the first line
    that is not one."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path} does not exist; the run has logged no epoch yet.") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path} cannot be read as UTF-8 text ({type(err).__name__}); rerun the training.") from None
    out = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except (ValueError, RecursionError):
            obj = None
        if not isinstance(obj, dict):
            raise ConfigError(f"{path} line {number} is not a JSON object; rerun the training or remove the run.")
        out.append(obj)
    return out


def result_line(result: dict) -> str:
    """``name: metric value`` of a finished run (its task's headline, top-1 for classification)."""
    metric = result.get("metric", "top1")
    value = result.get(metric)
    shown = f"{value:.2f}%" if metric in ("top1", "top5") and isinstance(value, float) else \
        f"{value:.4g}" if isinstance(value, float) else str(value)
    return f"{result['name']}: {metric} {shown}"


__all__ = ["CONFIG", "DATA", "EMA_WEIGHTS", "METRICS", "PREV_STATE", "PREV_WEIGHTS", "RESULT", "STATE", "TB_DIR",
           "TOKENIZER", "WEIGHTS", "read_jsonl", "result_line"]
